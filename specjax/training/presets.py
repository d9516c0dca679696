"""Size presets: a target, a draft and a tokenizer, and how to train each.

shipped the default pair (`DEFAULT_PRESET`): a 10.4M-parameter target (5 layers, d_model
        384) over a 4,096-id byte-level BPE and a 1-layer distilled draft, with EAGLE and
        Medusa heads, trained on an accelerator on code+tests and committed under
        `specjax/embedded/` (`training.shipped`). Why: BUILD_NOTES.md, "Training and the
        embedded models".
base    the CPU-built pair (4.8M-parameter target, 6 layers, d_model 256, BPE 2,048; a
        1-layer d_model 96 draft distilled from it), built on first use in about four
        minutes on a 2-core CPU; the default before `shipped`.
tiny    the first-wave pair (0.25M-parameter target, byte vocabulary): overhead-bound, kept for
        tests and comparisons.
small   a target with ~90 MB of float32 weights, far beyond CPU caches, with a 2-layer draft.
        Minutes on an accelerator, about an hour on a 2-core CPU (estimated from the FLOP count:
        6 x 22.7M params x 2M target tokens at ~100 GFLOP/s; not run here).

All use Llama-family blocks (RMSNorm, RoPE, no biases) with tied embeddings; shipped, base
and tiny use a GELU MLP (two matrices), measured ~25% cheaper per step than SwiGLU at these
widths on this CPU; small keeps SwiGLU. `tokenizer` is "byte" (the 259-id ByteTokenizer) or
"bpe:N" (a byte-level BPE with N ids, trained on the corpus's training split when the pair is
built).
"""

from __future__ import annotations

import dataclasses

from specjax.data.tokenizer import ByteTokenizer
from specjax.models.transformer import ModelConfig
from specjax.training.config import TrainConfig

_VOCAB = ByteTokenizer.vocab_size


DEFAULT_PRESET = "shipped"  # what `--target default`, the experiments and the quickstart use
_BPE_VOCAB = 2048


def _llama(**kw) -> ModelConfig:
  base = dict(vocab_size=_VOCAB, tie_embeddings=True, max_len=256)
  return ModelConfig.llama(**{**base, **kw})


def _schedule(steps: int, lr: float, warmup: int, *, objective: str = "lm", ckpt_every: int,
              eval_windows: int) -> TrainConfig:
  """A CPU-sized schedule: batch 16 × 128 tokens, validation only at the end."""
  return TrainConfig(steps=steps, batch_size=16, seq_len=128, lr=lr, warmup_steps=warmup,
                     eval_every=0, ckpt_every=ckpt_every, eval_windows=eval_windows,
                     objective=objective)


def tokenizer_vocab_size(tokenizer: str) -> int:
  """Ids of a preset's tokenizer: 259 for "byte", N for "bpe:N"."""
  if tokenizer == "byte":
    return _VOCAB
  kind, _, n = tokenizer.partition(":")
  if kind != "bpe" or not n.isdigit() or int(n) < _VOCAB:
    raise ValueError(f"tokenizer must be 'byte' or 'bpe:N' with N >= {_VOCAB}, got "
                     f"{tokenizer!r}")
  return int(n)


@dataclasses.dataclass(frozen=True)
class Preset:
  name: str
  target: ModelConfig
  draft: ModelConfig
  target_train: TrainConfig
  draft_train: TrainConfig   # objective 'distill' (the plain baseline uses objective 'lm')
  description: str
  tokenizer: str = "byte"    # "byte" or "bpe:N"
  # The default heads' (spec, schedule) per kind, where this preset has its own (None: the
  # CPU-sized `training.defaults.DEFAULT_HEADS`).
  heads: dict | None = None
  corpus: str = "code"       # the embedded corpus its default pair is trained on

  def __post_init__(self):
    n = tokenizer_vocab_size(self.tokenizer)
    for role, cfg in (("target", self.target), ("draft", self.draft)):
      if cfg.vocab_size != n:
        raise ValueError(f"preset {self.name!r}: {role} vocab_size {cfg.vocab_size} != "
                         f"{n} ids of tokenizer {self.tokenizer!r}")


PRESETS: dict[str, Preset] = {
    "base": Preset(
        name="base",
        target=_llama(d_model=256, n_layers=6, n_heads=4, n_kv_heads=4, d_ff=1024, mlp="gelu",
                      vocab_size=_BPE_VOCAB, max_len=512),
        draft=_llama(d_model=96, n_layers=1, n_heads=3, n_kv_heads=3, d_ff=256, mlp="gelu",
                     vocab_size=_BPE_VOCAB, max_len=512),
        target_train=_schedule(200, 4e-3, 20, ckpt_every=50, eval_windows=64),
        draft_train=_schedule(200, 6e-3, 20, objective="distill", ckpt_every=50,
                              eval_windows=64),
        description="4.8M-parameter target + 1-layer draft, BPE 2048, ~4 minutes on a 2-core "
                    "CPU",
        tokenizer=f"bpe:{_BPE_VOCAB}"),
    # Trained on an accelerator (bf16 compute, float32 master weights): on an H200 the whole
    # recipe (tokenizer, target, draft, EAGLE and Medusa heads) takes minutes; on a 2-core CPU
    # it would take days (BUILD_NOTES.md, "Shipped pair (training)"). Corpus: code+tests.
    "shipped": Preset(
        name="shipped",
        target=_llama(d_model=384, n_layers=5, n_heads=6, n_kv_heads=6, d_ff=1536, mlp="gelu",
                      vocab_size=4096, max_len=1024),
        draft=_llama(d_model=128, n_layers=1, n_heads=2, n_kv_heads=2, d_ff=384, mlp="gelu",
                     vocab_size=4096, max_len=1024),
        target_train=TrainConfig(steps=3000, batch_size=64, seq_len=512, lr=2e-3,
                                 warmup_steps=200, dtype="bfloat16", eval_every=1000,
                                 ckpt_every=1000, eval_windows=256, keep=1),
        draft_train=TrainConfig(steps=2000, batch_size=64, seq_len=512, lr=4e-3,
                                warmup_steps=100, dtype="bfloat16", eval_every=1000,
                                ckpt_every=1000, eval_windows=256, keep=1,
                                objective="distill"),
        description="10.4M-parameter target (5 layers, d 384, ~21 MB in bf16) + 1-layer "
                    "draft, BPE 4096, on code+tests: the shipped embedded pair (minutes on an "
                    "accelerator)",
        tokenizer="bpe:4096", corpus="code+tests",
        heads={"medusa": ({"heads": 4, "decay": 0.8},
                          TrainConfig(steps=1200, batch_size=32, seq_len=256, lr=3e-3,
                                      warmup_steps=60, eval_every=0, ckpt_every=600,
                                      eval_windows=64, keep=1)),
               "eagle": ({"steps": 2, "decay": 0.8, "layers": None, "width": 192},
                         TrainConfig(steps=2400, batch_size=32, seq_len=256, lr=2e-3,
                                     warmup_steps=100, eval_every=0, ckpt_every=800,
                                     eval_windows=64, keep=1))}),
    "tiny": Preset(
        name="tiny",
        target=_llama(d_model=96, n_layers=2, n_heads=3, n_kv_heads=3, d_ff=384, mlp="gelu"),
        draft=_llama(d_model=96, n_layers=1, n_heads=3, n_kv_heads=3, d_ff=256, mlp="gelu"),
        target_train=_schedule(400, 6e-3, 25, ckpt_every=100, eval_windows=128),
        draft_train=_schedule(300, 6e-3, 20, objective="distill", ckpt_every=100,
                              eval_windows=128),
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


# ----------------------------------------------------------------------------- real targets
#
# Drafters for a real target, trained on its own answers (`specjax train selfdistill-data`)
# by `specjax train eagle3|medusa --recipe NAME --target FILE.gguf --corpus selfdistill:DIR
# --out DIR` (heads) and `specjax train draft --recipe NAME --teacher FILE.gguf ...` (a draft
# model with the target's tokenizer). A recipe gives the kind's own flags, the schedule and,
# for a draft model, its shape; a flag given on the command line wins. Measured figures
# (time, tokens, held-out acceptance): BUILD_NOTES.md, "Drafters for SmolLM2".


@dataclasses.dataclass(frozen=True)
class Recipe:
  name: str
  kind: str                           # the `specjax train` command it belongs to
  flags: tuple[tuple[str, object], ...]  # (argparse dest, value) of the kind's own flags
  schedule: TrainConfig
  description: str
  model: ModelConfig | None = None    # a draft model's shape (its vocab_size: the target's)


def _recipe_schedule(steps: int, lr: float) -> TrainConfig:
  """8 windows of 256 tokens a step (about 1,000 answer tokens: the selfdistill rows are
  half prompt), checkpointed every 40 steps, held-out acceptance at the end."""
  return TrainConfig(steps=steps, batch_size=8, seq_len=256, lr=lr, warmup_steps=20,
                     eval_every=0, ckpt_every=40, eval_windows=64, keep=1)


RECIPES: dict[str, Recipe] = {
    "smollm2-eagle3": Recipe(
        name="smollm2-eagle3", kind="eagle3",
        flags=(("draft_vocab", 8192), ("ttt_steps", 3), ("decay", 0.8)),
        schedule=_recipe_schedule(240, 3e-3),
        description="EAGLE-3 head for SmolLM2-135M-Instruct: the format's three layers, "
                    "an 8,192-token draft vocabulary (9.8 M parameters, 19.6 MB in bf16), "
                    "three unrolled steps; 240 steps of 8 x 256 tokens"),
    "smollm2-medusa": Recipe(
        name="smollm2-medusa", kind="medusa", flags=(("heads", 4), ("decay", 0.8)),
        schedule=_recipe_schedule(240, 3e-3),
        description="four Medusa-1 heads for SmolLM2-135M-Instruct, each a residual block "
                    "and the full 49,152-id head"),
    "smollm2-draft": Recipe(
        name="smollm2-draft", kind="draft", flags=(),
        schedule=dataclasses.replace(_recipe_schedule(240, 2e-3), objective="distill"),
        model=_llama(d_model=256, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=768,
                     vocab_size=49152, max_len=2048, rope_theta=100000.0),
        description="a distilled draft model for SmolLM2-135M-Instruct: 2 layers of width "
                    "256 with the target's tokenizer and tied 49,152-id embedding (14.2 M "
                    "parameters), the target's RoPE base and 2,048 positions"),
}


def get_recipe(name: str, kind: str) -> Recipe:
  """The recipe `name` of kind `kind` (a head kind or "draft"); ValueError naming the
  allowed ones."""
  mine = sorted(n for n, r in RECIPES.items() if r.kind == kind)
  if name not in RECIPES or RECIPES[name].kind != kind:
    raise ValueError(f"--recipe must be one of {mine} for `train {kind}`, got {name!r}")
  return RECIPES[name]


def get_preset(name: str) -> Preset:
  if name not in PRESETS:
    raise ValueError(f"preset must be one of {sorted(PRESETS)}, got {name!r}")
  return PRESETS[name]
