"""Generic orbax save/restore: round trip, config check, keep-last-N, partial steps."""

import dataclasses
import functools

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from specjax.checkpoints import orbax_io


@dataclasses.dataclass(frozen=True)
class Cfg:
  width: int = 4
  kind: str = "mlp"
  sizes: tuple = (1, 2)


class Net(nnx.Module):
  def __init__(self, width: int, rngs: nnx.Rngs):
    self.layers = nnx.List([nnx.Linear(3, width, rngs=rngs), nnx.Linear(width, 2, rngs=rngs)])


@functools.lru_cache(maxsize=None)
def _state(seed=0, width=4):
  """Parameters of a small Net (built under jit: eager init would compile op by op)."""
  return jax.jit(lambda: nnx.split(Net(width, nnx.Rngs(seed)), nnx.Param)[1])()


def _equal(a, b):
  flat_a, flat_b = jax.tree.leaves(a), jax.tree.leaves(b)
  return (len(flat_a) == len(flat_b)
          and all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(flat_a, flat_b)))


def test_roundtrip_params_opt_state_metadata(tmp_path):
  params = _state(0)
  tx = optax.adamw(1e-2)
  opt_state = jax.jit(tx.init)(params)
  grads = jax.tree.map(np.ones_like, params)
  _, opt_state = jax.jit(tx.update)(grads, opt_state, params)  # non-trivial moments
  meta = {"data": {"seed": 3, "step": 7}, "note": "x"}
  orbax_io.save(tmp_path, 7, params=params, config=Cfg(), opt_state=opt_state, metadata=meta)

  other = _state(1)
  assert not _equal(other, params)
  restored = orbax_io.restore(tmp_path, params_target=other, config=Cfg(),
                              opt_state_target=jax.jit(tx.init)(other))
  assert restored.step == 7 and restored.metadata == meta
  assert isinstance(restored.params, nnx.State) and _equal(restored.params, params)
  assert jax.tree.structure(restored.opt_state) == jax.tree.structure(opt_state)
  assert _equal(restored.opt_state, opt_state)
  assert orbax_io.config_from_json(restored.config, Cfg) == Cfg()
  # without a target the params come back as stored (nested dicts of arrays)
  raw = orbax_io.restore(tmp_path).params
  np.testing.assert_array_equal(raw["layers"]["0"]["kernel"],
                                params["layers"][0]["kernel"][...])


def test_config_mismatch_names_fields(tmp_path):
  orbax_io.save(tmp_path, 1, params=_state(), config=Cfg())
  with pytest.raises(ValueError) as e:
    orbax_io.restore(tmp_path, params_target=_state(), config=Cfg(width=8, kind="attn"))
  msg = str(e.value)
  assert "width: checkpoint=4, expected=8" in msg and "kind: checkpoint='mlp'" in msg
  assert "sizes" not in msg


# The same class, later, with a field added after the checkpoint was written.
NewerCfg = dataclasses.make_dataclass("Cfg", [("window", "int | None", None)], bases=(Cfg,),
                                      frozen=True)


def test_fields_added_later_take_their_defaults(tmp_path):
  orbax_io.save(tmp_path, 1, params=_state(), config=Cfg())
  orbax_io.restore(tmp_path, params_target=_state(), config=NewerCfg())
  with pytest.raises(ValueError, match="window: checkpoint=None, expected=3"):
    orbax_io.restore(tmp_path, params_target=_state(), config=NewerCfg(window=3))


def test_shape_mismatch_is_a_clear_error(tmp_path):
  orbax_io.save(tmp_path, 1, params=_state(width=4))
  with pytest.raises(ValueError, match="does not match the expected parameter structure"):
    orbax_io.restore(tmp_path, params_target=_state(width=5))


def test_keep_last_n_and_step_selection(tmp_path):
  with orbax_io.Checkpointer(tmp_path, keep=2) as ckpt:
    for step in (10, 20, 30):
      ckpt.save(step, params=_state(step), metadata={"step": step})
    assert ckpt.all_steps() == [20, 30]
  assert orbax_io.latest_step(tmp_path) == 30
  assert orbax_io.read_meta(tmp_path, 20)["metadata"] == {"step": 20}
  assert _equal(orbax_io.restore(tmp_path, params_target=_state(), step=20).params, _state(20))
  with pytest.raises(ValueError, match="step 10 is not in checkpoint"):
    orbax_io.restore(tmp_path, params_target=_state(), step=10)


def test_missing_and_partial_checkpoints(tmp_path):
  assert orbax_io.latest_step(tmp_path / "nothing") is None
  with pytest.raises(ValueError, match="does not exist"):
    orbax_io.restore(tmp_path / "nothing")
  (tmp_path / "empty").mkdir()
  with pytest.raises(ValueError, match="no checkpoint found"):
    orbax_io.restore(tmp_path / "empty")
  orbax_io.save(tmp_path / "c", 5, params=_state())
  # a step folder left by a writer killed mid-save is never taken for a finished step
  (tmp_path / "c" / "9.orbax-checkpoint-tmp-123").mkdir()
  assert orbax_io.latest_step(tmp_path / "c") == 5


def test_latest_step_lists_again_when_a_writer_deletes_a_step_meanwhile(tmp_path, monkeypatch):
  """A trainer keeping the last N steps deletes an old one while another process lists the
  directory (orbax raises FileNotFoundError for it): the listing is retried, and a directory
  that keeps failing still raises."""
  orbax_io.save(tmp_path, 7, params=_state())
  real = orbax_io.Checkpointer.latest_step
  failures = {"left": 2}

  def flaky(self):
    if failures["left"]:
      failures["left"] -= 1
      raise FileNotFoundError(str(tmp_path / "4"))
    return real(self)

  monkeypatch.setattr(orbax_io.Checkpointer, "latest_step", flaky)
  assert orbax_io.latest_step(tmp_path) == 7 and failures["left"] == 0
  failures["left"] = orbax_io.LISTING_ATTEMPTS
  with pytest.raises(FileNotFoundError):
    orbax_io.latest_step(tmp_path)


def test_bad_arguments(tmp_path):
  with pytest.raises(ValueError, match="keep must be"):
    orbax_io.Checkpointer(tmp_path, keep=0)
  with pytest.raises(ValueError, match="config must be a dataclass"):
    orbax_io.save(tmp_path, 0, params=_state(), config={"width": 4})


_SAVE_ON_LAST_DEVICE = """
import sys
import jax, jax.numpy as jnp
from specjax.checkpoints import orbax_io
device = jax.devices()[-1]
params = {"w": jax.device_put(jnp.arange(6.0).reshape(2, 3), device),
          "b": jax.device_put(jnp.ones(3), device)}
orbax_io.save(sys.argv[1], 1, params=params, opt_state=params)
print(device)
"""


def test_checkpoint_from_another_topology_restores_here(tmp_path):
  """A checkpoint written by a process with other devices (here: saved on the 4th of four
  host devices, as a GPU or a multi-device run would) restores in this one, with and without
  a target; orbax alone refuses it ("Topology mismatch")."""
  import os
  import subprocess
  import sys
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4",
             JAX_PLATFORMS="cpu")
  out = subprocess.run([sys.executable, "-c", _SAVE_ON_LAST_DEVICE, str(tmp_path / "ck")],
                       env=env, capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stderr[-2000:]
  assert "3" in out.stdout  # really saved on a device this process does not have
  assert len(jax.devices()) < 4
  target = {"w": np.zeros((2, 3), np.float32), "b": np.zeros(3, np.float32)}
  for params_target in (target, None):
    restored = orbax_io.restore(tmp_path / "ck", params_target=params_target,
                                opt_state_target=target)
    np.testing.assert_array_equal(np.asarray(restored.params["w"]),
                                  np.arange(6.0).reshape(2, 3))
    np.testing.assert_array_equal(np.asarray(restored.opt_state["b"]), np.ones(3))
    assert restored.params["w"].devices() == {jax.devices()[0]}


# ----------------------------------------------------------------------------- damaged steps


def _truncate_arrays(step):
  """Cut every file of the params item's data folders ('d/': array bytes and, for arrays
  this small, the b-tree nodes they are inlined in) to a third."""
  for f in (step / "params").rglob("*"):
    if f.is_file() and f.parent.name == "d":
      f.write_bytes(f.read_bytes()[: f.stat().st_size // 3])


def _empty(step):
  import shutil
  for child in step.iterdir():
    shutil.rmtree(child) if child.is_dir() else child.unlink()


DAMAGE = {  # name -> (damage the step folder, what the message names)
    "no-meta": (lambda s: __import__("shutil").rmtree(s / "meta"), "'meta' item"),
    "empty-step": (_empty, "the step holds nothing"),
    "no-params": (lambda s: __import__("shutil").rmtree(s / "params"), "'params' item"),
    "no-manifest": (lambda s: (s / "params" / "manifest.ocdbt").unlink(), "manifest.ocdbt"),
    "meta-not-json": (lambda s: (s / "meta" / "metadata").write_text("{not"), "meta/metadata"),
    "meta-not-object": (lambda s: (s / "meta" / "metadata").write_text("[1]"), "meta/metadata"),
    "array-metadata-not-json": (lambda s: (s / "params" / "_METADATA").write_text("x{"),
                                "_METADATA"),
    "truncated-arrays": (_truncate_arrays, "cannot read its arrays"),
}


@pytest.mark.parametrize("name", sorted(DAMAGE))
def test_a_damaged_step_is_a_value_error_naming_the_directory(tmp_path, name):
  """Missing items, files or bytes, unparseable JSON: ValueError naming the directory and
  the step and saying it is damaged (a missing file named without asking orbax), never
  KeyError, a JSON error or orbax's bare Exception."""
  orbax_io.save(tmp_path, 3, params=_state(), config=Cfg(), metadata={"kind": "x"})
  damage, names = DAMAGE[name]
  damage(tmp_path / "3")
  with pytest.raises(ValueError) as e:
    orbax_io.restore(tmp_path, params_target=_state(), config=Cfg())
  msg = str(e.value)
  assert f"checkpoint {str(tmp_path)!r} step 3 is damaged" in msg and names in msg, msg
  assert "\n" not in msg
  if name.startswith(("no-meta", "empty", "meta")):  # read_meta alone refuses it too
    with pytest.raises(ValueError, match="step 3 is damaged"):
      orbax_io.read_meta(tmp_path)


def test_listing_a_damaged_step_logs_nothing(tmp_path, caplog):
  """An empty step folder makes orbax warn ("Metadata file does not exist") each time it
  lists the directory; read-only access drops that (the read itself names the damage)."""
  orbax_io.save(tmp_path, 3, params=_state())
  _empty(tmp_path / "3")
  with caplog.at_level("DEBUG"):
    assert orbax_io.latest_step(tmp_path) == 3
    with pytest.raises(ValueError, match="damaged"):
      orbax_io.read_meta(tmp_path)
  assert not [r for r in caplog.records if str(tmp_path) in r.getMessage()]


def test_only_the_echo_of_an_aborted_read_is_silenced(monkeypatch):
  """The unraisable-hook and asyncio-log filters drop exactly what an aborted orbax read
  leaves behind ("Event loop is closed", an orbax read coroutine closed by the garbage
  collector, an unretrieved tensorstore error) and pass everything else on."""
  import logging
  import sys
  import types
  seen = []
  monkeypatch.setattr(sys, "unraisablehook", seen.append)
  orbax_io._quiet_aborted_reads()
  orbax_io._quiet_aborted_reads()  # installed once
  assert isinstance(sys.unraisablehook, orbax_io._QuietUnraisableHook)
  assert sys.unraisablehook.previous == seen.append

  def unraisable(exc, obj=None):
    return types.SimpleNamespace(exc_type=type(exc), exc_value=exc, exc_traceback=None,
                                 err_msg=None, object=obj)

  async def not_orbax():
    pass
  coroutine = not_orbax()
  coroutine.close()
  orbax_code = types.SimpleNamespace(
      co_filename="/x/site-packages/orbax/checkpoint/_src/serialization/serialization.py")
  sys.unraisablehook(unraisable(RuntimeError("Event loop is closed")))
  sys.unraisablehook(unraisable(Exception("read"), types.SimpleNamespace(cr_code=orbax_code)))
  assert seen == []
  others = [unraisable(RuntimeError("another")), unraisable(ValueError("x"), coroutine)]
  for u in others:
    sys.unraisablehook(u)
  assert seen == others

  filters = [f for f in logging.getLogger("asyncio").filters
             if isinstance(f, orbax_io._AbortedTaskFilter)]
  assert len(filters) == 1

  def record(msg, exc=None):
    return logging.LogRecord("asyncio", logging.ERROR, __file__, 1, msg, None,
                             (type(exc), exc, None) if exc else None)

  monkeypatch.setattr(orbax_io, "_read_failed", False)
  never = "_GatheringFuture exception was never retrieved\nfuture: <...>"
  assert not filters[0].filter(record(never, ValueError("Error reading in OCDBT database")))
  assert filters[0].filter(record(never, ValueError("something else")))
  assert filters[0].filter(record("Task was destroyed but it is pending!"))
  monkeypatch.setattr(orbax_io, "_read_failed", True)  # after a failed restore: any
  assert not filters[0].filter(record(never, ValueError("something else")))
