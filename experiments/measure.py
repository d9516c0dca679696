"""Measurement helpers shared by the experiments: models, prompts, standalone forward timings.

`models(which)`: "default" = the embedded trained tiny pair (trained on first use, cached)
with held-out prompts from its corpus; "random" = random tiny Llama models on the byte
vocabulary (fast; for tests and smoke runs). `forward_seconds` times one jitted target or
draft forward of `t` tokens per row at a given context length (median of `repeats`), the
unit every analytic prediction here is built from. `median_alternating` times several
callables side by side, alternating within every repeat so drift hits all alike.
"""

from __future__ import annotations

import functools
import statistics
import time

import jax
import jax.numpy as jnp

from specjax.models import cache as kv


@functools.lru_cache(maxsize=2)
def models(which: str):
  """(target, draft, tokenizer, prompt texts)."""
  if which == "default":
    from specjax.data.corpus import load_corpus
    from specjax.training.defaults import load_default_pair
    pair = load_default_pair("tiny", "code")
    texts = [d.text for d in load_corpus("code").validation[:64]]  # held out from training
    return pair.target_module(), pair.draft_module(), pair.tokenizer, texts
  from flax import nnx

  from specjax.data.tokenizer import ByteTokenizer
  from specjax.models.presets import PRESETS
  from specjax.models.transformer import Transformer
  tok = ByteTokenizer()
  cfg = PRESETS["tiny-llama"].replace(vocab_size=tok.vocab_size)
  return (Transformer(cfg, rngs=nnx.Rngs(0)), Transformer(cfg.replace(n_layers=1),
                                                           rngs=nnx.Rngs(1)), tok, None)


FALLBACK_TEXT = '''def _check(name, value, lo):
    if not isinstance(value, int) or value < lo:
        raise ValueError(f"{name} must be an int >= {lo}, got {value!r}")
    return value


class Counter:
    """Counts things."""

    def __init__(self):
        self.counts = {}

    def add(self, key):
        self.counts[key] = self.counts.get(key, 0) + 1
'''


def prompts(tok, texts, batch: int, prompt_len: int) -> list[list[int]]:
  source = "\n".join(texts) if texts else FALLBACK_TEXT * 8
  ids = tok.encode(source)
  stride = max(1, (len(ids) - prompt_len) // max(batch, 1))
  return [ids[i * stride:i * stride + prompt_len] for i in range(batch)]


@functools.partial(jax.jit, donate_argnames="cache")
def _forward(lm, tokens, positions, cache):
  """One forward against the cache; the cache is donated and returned (lengths unchanged, so
  feeding it back keeps the context fixed) so the write updates it in place, as in the
  decoding loop, instead of copying it (PERF_NOTES trap 1)."""
  logits, _, cache = lm(tokens, positions, cache)
  return logits[:, -1], cache


def forward_seconds(lm, batch, t, context, cache_len, repeats, min_sample_s: float = 0.02):
  """Median seconds of one forward of `t` tokens per row at `context` cached tokens.

  Tiny models run in well under a millisecond, where one timing is mostly noise: each sample
  is the mean over a burst of calls lasting at least `min_sample_s`; the median is over
  max(repeats, 5) samples.
  """
  cache = kv.set_lengths(kv.init(lm.config, batch, cache_len),
                         jnp.full((batch,), context, jnp.int32))
  toks = jnp.zeros((batch, t), jnp.int32)
  pos = context + jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (batch, t))
  out, cache = jax.block_until_ready(_forward(lm, toks, pos, cache))  # compile
  start = time.perf_counter()
  out, cache = jax.block_until_ready(_forward(lm, toks, pos, cache))
  once = max(time.perf_counter() - start, 1e-6)
  burst = max(1, min(1000, int(min_sample_s / once)))
  times = []
  for _ in range(max(repeats, 5)):
    start = time.perf_counter()
    for _ in range(burst):
      out, cache = _forward(lm, toks, pos, cache)
    jax.block_until_ready(out)
    times.append((time.perf_counter() - start) / burst)
  return statistics.median(times)


def step_costs(lm_t, lm_d, batch, n_verify, draft_passes, width, context, cache_len,
               repeats) -> dict:
  """The costs every prediction here uses, timed standalone at `context`:

  t1 = one-token target step; v = target forward of n_verify tokens ÷ t1;
  c  = draft cost per pass ÷ t1 = (d(2) + (D − 1)·d(W)) / (D·t1), D = draft_passes: the
       first pass of a cycle feeds 2 tokens (the catch-up rule), later passes W tokens
       (1 for a chain, the widest fed level for a tree).
  """
  t1 = forward_seconds(lm_t, batch, 1, context, cache_len, repeats)
  tv = forward_seconds(lm_t, batch, n_verify, context, cache_len, repeats)
  d2 = forward_seconds(lm_d, batch, 2, context, cache_len, repeats)
  dw = (forward_seconds(lm_d, batch, width, context, cache_len, repeats)
        if draft_passes > 1 else 0.0)
  return {"t1": t1, "v": tv / t1, "c": (d2 + (draft_passes - 1) * dw) / (draft_passes * t1)}


def median_alternating(fns: dict, repeats: int) -> dict:
  """{name: (median seconds, last result)} of each callable, alternated within every repeat
  after one warm-up call each (compilation excluded)."""
  last = {name: fn() for name, fn in fns.items()}
  times = {name: [] for name in fns}
  for _ in range(repeats):
    for name, fn in fns.items():
      start = time.perf_counter()
      last[name] = jax.block_until_ready(fn())
      times[name].append(time.perf_counter() - start)
  return {name: (statistics.median(times[name]), last[name]) for name in fns}
