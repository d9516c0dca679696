"""specjax vs Hugging Face transformers on the same imported weights (greedy, batch 1, CPU).

    python benchmarks/bench_vs_transformers.py [--new-tokens 64] [--k 4] [--out results.json]

A GPT-2-small-shaped target (12 layers, d=768, vocab 50257) and a small GPT-2 draft (2 layers,
d=256) are built from configs with random weights by `transformers`, saved with
`save_pretrained` and imported into specjax with `load_model`: both libraries run the very
same float32 weights. Each prompt is decoded alone (batch 1), greedily, for --new-tokens
tokens. Compared, in one process, variants alternated within every repeat, medians over
repeats:

  plain        specjax `generate`              vs transformers `generate`
  spec-draft   specjax `speculative_generate`  vs transformers assisted generation with the
               small draft as `assistant_model`
  spec-self    the same with the target as its own draft / assistant (every draft accepted)

Assisted generation runs with its draft length pinned to k (num_assistant_tokens=k,
num_assistant_tokens_schedule="constant", assistant_confidence_threshold=0), so both sides
verify k drafted tokens per target pass. Tokens/s = emitted tokens / wall seconds of the
whole call (host preparation included; compilation excluded by a warm-up call). Every
comparison also checks that both libraries emitted identical tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time


def _log(message: str) -> None:
  print(message, file=sys.stderr, flush=True)


def _uptime() -> str:
  try:
    with open("/proc/loadavg") as f:
      return " ".join(f.read().split()[:3])
  except OSError:
    return "n/a"


def build_models(directory: str, seed: int):
  """(hf target, hf draft, target dir, draft dir): random GPT-2 small and a 2-layer draft."""
  import torch
  import transformers
  common = dict(vocab_size=50257, n_positions=1024, bos_token_id=50256, eos_token_id=50256)
  torch.manual_seed(seed)
  target = transformers.GPT2LMHeadModel(transformers.GPT2Config(**common)).eval()
  torch.manual_seed(seed + 1)
  draft = transformers.GPT2LMHeadModel(transformers.GPT2Config(
      n_embd=256, n_layer=2, n_head=4, n_inner=1024, **common)).eval()
  dirs = []
  for name, model in (("target", target), ("draft", draft)):
    path = os.path.join(directory, name)
    model.save_pretrained(path)
    dirs.append(path)
  return target, draft, *dirs


def hf_generate(model, prompt, n, assistant=None):
  """Greedy transformers `generate` of exactly n tokens (`hf_peer.generate`)."""
  from specjax.experiments import hf_peer
  return hf_peer.generate(model, prompt, n, assistant=assistant, min_new_tokens=n).tokens


def pick_torch_threads(model, prompt) -> int:
  """The faster torch thread count for `model.generate` on this machine right now."""
  import torch
  best = None
  for threads in sorted({1, os.cpu_count() or 1}):
    torch.set_num_threads(threads)
    hf_generate(model, prompt, 8)
    start = time.perf_counter()
    for _ in range(2):
      hf_generate(model, prompt, 16)
    elapsed = time.perf_counter() - start
    _log(f"torch threads {threads}: {32 / elapsed:.1f} tok/s")
    if best is None or elapsed < best[1]:
      best = (threads, elapsed)
  return best[0]


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--new-tokens", type=int, default=64)
  p.add_argument("--k", type=int, default=4)
  p.add_argument("--prompts", type=int, default=3, help="number of prompts (each batch 1)")
  p.add_argument("--prompt-len", type=int, default=24)
  p.add_argument("--repeats", type=int, default=3)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--torch-threads", type=int, default=None,
                 help="torch intra-op threads (default: the faster of 1 and all cores, timed "
                 "here: on a loaded machine torch's spinning worker threads can be 5x slower)")
  p.add_argument("--out", default=None, help="write the results as JSON here")
  args = p.parse_args()

  import jax
  import numpy as np
  import torch
  import transformers

  from specjax.engine import decoding
  from specjax.checkpoints import load_model
  from specjax.experiments.hf_peer import pin_assistant

  transformers.logging.set_verbosity_error()
  load_before = _uptime()
  with tempfile.TemporaryDirectory() as tmp:
    hf_target, hf_draft, target_dir, draft_dir = build_models(tmp, args.seed)
    target, _ = load_model(target_dir)
    draft, _ = load_model(draft_dir)
  rng = np.random.default_rng(args.seed)
  prompts = [rng.integers(0, 50257, args.prompt_len).tolist() for _ in range(args.prompts)]
  n, k = args.new_tokens, args.k
  threads = args.torch_threads or pick_torch_threads(hf_target, prompts[0])
  torch.set_num_threads(threads)

  def ours_plain(prompt):
    return decoding.generate(target, [prompt], max_new_tokens=n).tokens[0]

  def ours_spec(prompt, d):
    g = decoding.speculative_generate(target, d, [prompt], k=k, max_new_tokens=n)
    stats[id(d)] = (int(g.stats["accepted"].sum()), int(g.stats["drafted"].sum()))
    return g.tokens[0]

  stats: dict = {}
  hf_self = hf_target  # the target as its own assistant (a separate cache, same weights)
  pin_assistant(hf_draft, k)
  pin_assistant(hf_self, k)
  variants = {
      ("plain", "specjax"): ours_plain,
      ("plain", "transformers"): lambda pr: hf_generate(hf_target, pr, n),
      ("spec-draft", "specjax"): lambda pr: ours_spec(pr, draft),
      ("spec-draft", "transformers"): lambda pr: hf_generate(hf_target, pr, n, hf_draft),
      ("spec-self", "specjax"): lambda pr: ours_spec(pr, target),
      ("spec-self", "transformers"): lambda pr: hf_generate(hf_target, pr, n, hf_self),
  }
  outputs = {}
  for key, fn in variants.items():  # warm-up (compiles specjax's loops)
    start = time.perf_counter()
    outputs[key] = [fn(pr) for pr in prompts]
    _log(f"warm-up {key}: {time.perf_counter() - start:.1f} s")
  seconds = {key: [] for key in variants}
  for r in range(args.repeats):
    for key, fn in variants.items():  # alternated: machine drift hits every variant alike
      start = time.perf_counter()
      outs = [fn(pr) for pr in prompts]
      seconds[key].append(time.perf_counter() - start)
      assert outs == outputs[key], f"{key} is not deterministic"
    _log(f"repeat {r + 1}/{args.repeats}: "
         + ", ".join(f"{'/'.join(key)} {v[-1]:.1f} s" for key, v in seconds.items()))
  emitted = n * len(prompts)
  tok_s = {key: emitted / statistics.median(v) for key, v in seconds.items()}

  rows = []
  for mode in ("plain", "spec-draft", "spec-self"):
    ours, theirs = tok_s[(mode, "specjax")], tok_s[(mode, "transformers")]
    identical = outputs[(mode, "specjax")] == outputs[(mode, "transformers")]
    rows.append({"mode": mode, "specjax_tok_s": ours, "transformers_tok_s": theirs,
                 "ratio": ours / theirs, "identical": identical})
  alpha = {name: (stats[id(m)][0] / stats[id(m)][1]) for name, m in
           (("spec-draft", draft), ("spec-self", target))}
  result = {
      "rows": rows, "alpha_specjax": alpha, "k": k, "new_tokens": n, "prompts": args.prompts,
      "seconds": {"/".join(key): v for key, v in seconds.items()},
      "prompt_len": args.prompt_len, "repeats": args.repeats,
      "plain_identical_to_greedy_transformers": all(r["identical"] for r in rows),
      "versions": {"jax": jax.__version__, "torch": torch.__version__,
                   "transformers": transformers.__version__},
      "torch_threads": threads, "cpu_count": os.cpu_count(),
      "machine": platform.machine(), "backend": jax.default_backend(),
      "loadavg_before": load_before, "loadavg_after": _uptime(),
  }
  print(f"GPT-2 small target, 2-layer d=256 draft, greedy, batch 1, {n} new tokens × "
        f"{args.prompts} prompts, k = {k}, median of {args.repeats} (load {load_before} -> "
        f"{result['loadavg_after']})")
  print(f"{'mode':12s} {'specjax tok/s':>14s} {'transformers tok/s':>19s} {'ratio':>7s} "
        f"{'identical':>10s}")
  for r in rows:
    print(f"{r['mode']:12s} {r['specjax_tok_s']:14.1f} {r['transformers_tok_s']:19.1f} "
          f"{r['ratio']:6.2f}x {str(r['identical']):>10s}")
  print(f"specjax α: spec-draft {alpha['spec-draft']:.3f}, spec-self {alpha['spec-self']:.3f}")
  if args.out:
    with open(args.out, "w") as f:
      json.dump(result, f, indent=2)


if __name__ == "__main__":
  main()
