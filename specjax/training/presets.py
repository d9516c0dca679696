"""Size presets: a target and a draft (same byte tokenizer) and how to train each.

tiny   a target and a 1-layer draft sized so that training both (target, then the draft
       distilled from it) takes at most ~3 minutes on a 2-core CPU: the quickstart trains them
       on a fresh machine. Measured figures live in BUILD_NOTES.md.
small  a target with ~90 MB of float32 weights, far beyond CPU caches, so a batch-1 decode
       step is memory-bound (streams every weight byte) as on real serving hardware; with a
       2-layer draft. Minutes on an accelerator, about an hour on a 2-core CPU (estimated from
       the FLOP count: 6 x 22.7M params x 2M target tokens at ~100 GFLOP/s; not yet run here).

Both use Llama-family blocks (RMSNorm, RoPE, no biases) with tied embeddings: on the byte
vocabulary the embedding is tiny, and RoPE lets the engine run past the training length. tiny
uses a GELU MLP (two matrices): at d_model 96 it measured ~25% cheaper per step than SwiGLU on
this CPU; small keeps SwiGLU.
"""

from __future__ import annotations

import dataclasses

from specjax.data.tokenizer import ByteTokenizer
from specjax.models.transformer import ModelConfig
from specjax.training.config import TrainConfig

_VOCAB = ByteTokenizer.vocab_size


def _llama(**kw) -> ModelConfig:
  base = dict(vocab_size=_VOCAB, tie_embeddings=True, max_len=256)
  return ModelConfig.llama(**{**base, **kw})


@dataclasses.dataclass(frozen=True)
class Preset:
  name: str
  target: ModelConfig
  draft: ModelConfig
  target_train: TrainConfig
  draft_train: TrainConfig   # objective 'distill' (the plain baseline uses objective 'lm')
  description: str


PRESETS: dict[str, Preset] = {
    "tiny": Preset(
        name="tiny",
        target=_llama(d_model=96, n_layers=2, n_heads=3, n_kv_heads=3, d_ff=384, mlp="gelu"),
        draft=_llama(d_model=96, n_layers=1, n_heads=3, n_kv_heads=3, d_ff=256, mlp="gelu"),
        target_train=TrainConfig(steps=400, batch_size=16, seq_len=128, lr=6e-3,
                                 warmup_steps=25, eval_every=0, ckpt_every=100,
                                 eval_windows=128),
        draft_train=TrainConfig(steps=300, batch_size=16, seq_len=128, lr=6e-3,
                                warmup_steps=20, eval_every=0, ckpt_every=100,
                                eval_windows=128, objective="distill"),
        description="target + 1-layer draft, ~3 minutes on a 2-core CPU"),
    "small": Preset(
        name="small",
        target=_llama(d_model=512, n_layers=8, n_heads=8, n_kv_heads=2, d_ff=1408,
                      max_len=512),
        draft=_llama(d_model=256, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=704,
                     max_len=512),
        target_train=TrainConfig(steps=500, batch_size=16, seq_len=256, lr=1e-3,
                                 warmup_steps=50, eval_every=200, ckpt_every=100,
                                 eval_windows=64),
        draft_train=TrainConfig(steps=300, batch_size=16, seq_len=256, lr=2e-3,
                                warmup_steps=30, eval_every=200, ckpt_every=100,
                                eval_windows=64, objective="distill"),
        description="memory-bound target (~90 MB fp32 weights) + 2-layer draft"),
}


def get_preset(name: str) -> Preset:
  if name not in PRESETS:
    raise ValueError(f"preset must be one of {sorted(PRESETS)}, got {name!r}")
  return PRESETS[name]
