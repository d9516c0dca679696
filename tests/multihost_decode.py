"""One process of `test_sharding.test_two_processes_match_one`: joins a two-process
`jax.distributed` run on the CPU backend (4 devices each), decodes over a (data=2, model=4)
mesh spanning both and prints the tokens as one JSON line. Not a test module (no test_
prefix): run as `python multihost_decode.py PROCESS_ID PORT`."""

import json
import os
import sys

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=4").strip()
import jax  # noqa: E402

jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_default_matmul_precision", "float32")
jax.distributed.initialize(f"localhost:{sys.argv[2]}", num_processes=2,
                           process_id=int(sys.argv[1]))
sys.path.insert(0, os.path.dirname(__file__))
import test_sharding as cases  # noqa: E402

from specjax import sharding  # noqa: E402

assert jax.device_count() == 8 and jax.local_device_count() == 4
print("TOKENS " + json.dumps(cases.two_process_case(sharding.make_mesh(2, 4))), flush=True)
