"""The compiled adaptive loop updates both KV caches in place: no cache-sized copy inside the
loop (docs/xla_notes.md, traps 1 and 10). With the menu entries under one `lax.switch`, XLA:CPU
copied the target's and the draft's caches in every speculative entry, every cycle; this test
failed then (37 copies on this menu). Copies in the entry computation (the caches'
initial zeros, once per call) are allowed. One compile of a tiny loop: a lazy k = 0 entry, a
one-pass and a two-pass draft (k = 1, k = 2: the draft cache written twice in one entry).
Nor is a fused product's concatenated weight rebuilt inside the loop (trap 12)."""

from __future__ import annotations

import contextlib
import re

import jax
import jax.numpy as jnp

from specjax.engine.adaptive import policy as adaptive, loop as adaptive_loop
from specjax.engine import decoding
from specjax.verify import sampling
from specjax.models.lm import LM
from specjax.drafters.model import ModelDrafter
from specjax_testing import RAGGED, TINY, model, perturbed


def _cache_copies_in_loop(hlo: str, rows: int, head_dim: int, cache_len: int) -> list[str]:
  """Copy instructions of a K (B·Hkv, head_dim, S) or V (B·Hkv, S, head_dim) cache buffer
  outside the entry computation of the compiled HLO text."""
  shapes = (f"[{rows},{head_dim},{cache_len}]", f"[{rows},{cache_len},{head_dim}]")
  found, in_entry = [], False
  for line in hlo.splitlines():
    if line and not line.startswith(" "):  # a computation's header
      in_entry = line.startswith("ENTRY")
    if not in_entry and re.search(r"\bcopy\(", line) and any(s in line for s in shapes):
      found.append(line.strip()[:160])
  return found


def test_adaptive_loop_has_no_cache_copies():
  target = model(TINY["llama"], seed=0, logit_scale=4.0)
  drafter = ModelDrafter.of(perturbed(target, seed=1, noise=0.25))
  assert drafter.lazy_catch_up
  batch = decoding.prepare_batch(RAGGED[:2], vocab_size=target.config.vocab_size,
                                 max_len=target.config.max_len, max_new_tokens=20, slots=4)
  policy = adaptive.AdaptivePolicy.create((0, 1, 2), [1.0, 1.2, 1.4])
  lowered = adaptive_loop.adaptive_jit.lower(LM.of(target), drafter, policy, batch.prompt_BP,
                                             batch.prompt_len_B, batch.budget_B, jnp.asarray(-1),
                                             sampling.make_sampler(0.0), jax.random.key(0),
                                             cache_len=batch.cache_len)
  hlo = lowered.compile().as_text()
  assert "while(" in hlo  # the loop is there
  rows = 2 * target.config.n_kv_heads  # B·Hkv: the draft is the same shape
  assert _cache_copies_in_loop(hlo, rows, target.config.head_dim, batch.cache_len) == []


def _loop_computations(hlo: str) -> dict[str, list[str]]:
  """The compiled HLO's computations that run inside a while loop (a loop's body or
  condition, and everything they call), name -> instruction lines."""
  comps, calls, name = {}, {}, None
  for line in hlo.splitlines():
    if line and not line.startswith(" ") and "{" in line:  # a computation's header
      name = line.split()[1] if line.startswith("ENTRY") else line.split()[0]
      name = name.lstrip("%")
      comps[name], calls[name] = [], set()
    elif name is not None and line.strip():
      comps[name].append(line.strip())
      calls[name].update(m.lstrip("%") for m in re.findall(
          r"(?:body|condition|calls|to_apply|branch_computations)=\{?(%?[\w.\-]+)", line))
  todo = [c for lines in comps.values() for line in lines for c in re.findall(
      r"(?:body|condition)=(%?[\w.\-]+)", line)]
  inside = set()
  while todo:
    c = todo.pop().lstrip("%")
    if c in comps and c not in inside:
      inside.add(c)
      todo.extend(calls[c])
  return {c: comps[c] for c in inside}


def _fused_weight_concats(hlo: str, shapes: list[str]) -> list[str]:
  return [line[:160] for lines in _loop_computations(hlo).values() for line in lines
          if " concatenate(" in line and any(s in line.split("=")[1] for s in shapes)]


def test_fused_weights_are_concatenated_once_before_the_adaptive_loop(monkeypatch):
  """With fused products (q|k|v, gate|up: `fused.project`), the concatenated weights
  are computed before the loop (`fused.prefused`), not inside it. XLA lifts them out
  of a simple loop body but not out of the adaptive loop's zero-or-one-trip entries, where
  every cycle concatenated every fused weight again: 0.7 of a plain step of SmolLM2-135M
  (docs/xla_notes.md, trap 12). Control: without `prefused` the concatenations are found."""
  from specjax.engine import loop
  from specjax.models import one_row_bf16
  monkeypatch.setattr(one_row_bf16, "fuse_products", lambda: True)
  cfg = TINY["llama"]
  target = model(cfg, seed=0, logit_scale=4.0)
  drafter = ModelDrafter.of(perturbed(target, seed=1, noise=0.25))
  batch = decoding.prepare_batch(RAGGED[:2], vocab_size=cfg.vocab_size, max_len=cfg.max_len,
                                 max_new_tokens=20, slots=4)
  policy = adaptive.AdaptivePolicy.create((0, 1, 2), [1.0, 1.2, 1.4])
  qkv = (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim
  shapes = [f"f32[{cfg.d_model},{qkv}]", f"f32[{cfg.d_model},{2 * cfg.d_ff}]"]

  def hlo(cache_len):  # a cache length of its own: a fresh trace, not a cached one
    lowered = adaptive_loop.adaptive_jit.lower(
        LM.of(target), drafter, policy, batch.prompt_BP, batch.prompt_len_B, batch.budget_B,
        jnp.asarray(-1), sampling.make_sampler(0.0), jax.random.key(0), cache_len=cache_len)
    return lowered.compile().as_text()
  assert _loop_computations(hlo(batch.cache_len))  # the loop is there
  assert _fused_weight_concats(hlo(batch.cache_len), shapes) == []
  monkeypatch.setattr(loop, "prefused", lambda *models: contextlib.nullcontext())
  assert len(_fused_weight_concats(hlo(2 * batch.cache_len), shapes)) >= 4  # 20 found
