"""The compiled adaptive loop updates both KV caches in place: no cache-sized copy inside the
loop (docs/xla_notes.md, traps 1 and 10). With the menu entries under one `lax.switch`, XLA:CPU
copied the target's and the draft's caches in every speculative entry, every cycle; this test
failed then (37 copies on this menu). Copies in the entry computation (the caches'
initial zeros, once per call) are allowed. One compile of a tiny loop: a lazy k = 0 entry, a
one-pass and a two-pass draft (k = 1, k = 2: the draft cache written twice in one entry)."""

from __future__ import annotations

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
