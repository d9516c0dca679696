"""Hugging Face transformers as a peer, on the same weights and token ids as specjax.

One place for what the studies and benchmarks that time transformers beside specjax share:
`load(ref)` (a Hugging Face directory, or a `.gguf` file through transformers' own GGUF
loader, float32, eval mode), `generate(...)` (greedy or sampled `generate` of one prompt of
token ids, plain, with prompt lookup or with an assistant model, counting the target's
forward passes so τ can be reported), `pin_assistant` (a fixed draft length for assisted
generation) and `gguf_to_hf` (a GGUF file dequantized by transformers and written out as a
float32 Hugging Face directory: the road a new user takes into specjax without a GGUF
reader).

Transformers' sampling is made to draw from the same law as specjax's `make_sampler(T)`:
top_k = 0 and top_p = 1 (its defaults would cut the distribution at 50 tokens), no other
logits processor; greedy at T = 0.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib


@dataclasses.dataclass
class HFRun:
  """One transformers call: the new tokens (EOS included when hit) and the target's forward
  passes (the prefill is one; plain decoding adds one per further token)."""
  tokens: list[int]
  forwards: int

  @property
  def tau(self) -> float | None:
    """Tokens per verification after the prefill: (new − 1) ÷ (forwards − 1)."""
    return (len(self.tokens) - 1) / (self.forwards - 1) if self.forwards > 1 else None


def load(ref: str):
  """A transformers causal LM in float32 from a Hugging Face directory or a `.gguf` file
  (dequantized by transformers' GGUF loader; needs the `gguf` package)."""
  import torch
  import transformers
  transformers.logging.set_verbosity_error()
  path = pathlib.Path(ref)
  kwargs = {"dtype": torch.float32}
  if path.suffix == ".gguf":
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, **kwargs)
  else:
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), **kwargs)
  return model.eval()


def gguf_to_hf(gguf_file: str | os.PathLike, out: str | os.PathLike) -> pathlib.Path:
  """`gguf_file` loaded by transformers (dequantized to float32) and saved, with its
  tokenizer, as a Hugging Face directory `out` (written to a sibling temporary directory
  and renamed: all or nothing). The quantization record is cleared first: the weights
  written are plain float32."""
  import transformers
  gguf_file, out = pathlib.Path(gguf_file), pathlib.Path(out)
  model = load(str(gguf_file))
  model.config.quantization_config = None
  if hasattr(model.config, "quantization_config"):
    del model.config.quantization_config
  model.hf_quantizer = None
  tok = transformers.AutoTokenizer.from_pretrained(str(gguf_file.parent),
                                                   gguf_file=gguf_file.name)
  tmp = out.with_name(out.name + f".tmp{os.getpid()}")
  model.save_pretrained(tmp)
  tok.save_pretrained(tmp)
  os.replace(tmp, out)
  return out


def pin_assistant(model, k: int) -> None:
  """Fixed draft length k for transformers' assisted generation (its default adapts k)."""
  model.generation_config.num_assistant_tokens = k
  model.generation_config.num_assistant_tokens_schedule = "constant"
  model.generation_config.assistant_confidence_threshold = 0.0


def _count_forwards(model) -> list:
  """A counter (a one-element list) of `model`'s forward calls, kept by a pre-hook."""
  counter = getattr(model, "_specjax_forwards", None)
  if counter is None:
    counter = [0]
    model.register_forward_pre_hook(lambda *_: counter.__setitem__(0, counter[0] + 1))
    model._specjax_forwards = counter
  return counter


def generate(model, prompt: list[int], max_new_tokens: int, *, temperature: float = 0.0,
             eos_ids=None, lookup_tokens: int | None = None, assistant=None,
             min_new_tokens: int | None = None, seed: int = 0) -> HFRun:
  """`model.generate` of one prompt (batch 1): greedy at T = 0, else sampled from the full
  tempered law (top_k 0, top_p 1) with torch seeded by `seed`; with prompt lookup
  (`prompt_lookup_num_tokens=lookup_tokens`) or an assistant model; stopping at any of
  `eos_ids` (None: never, unless `min_new_tokens` says so)."""
  import torch
  counter = _count_forwards(model)
  ids = torch.tensor([prompt])
  eos = list(eos_ids) if eos_ids else None
  sample = temperature > 0
  kwargs = dict(do_sample=sample, num_beams=1)
  if sample:
    kwargs.update(temperature=temperature, top_k=0, top_p=1.0)
  if lookup_tokens:
    kwargs["prompt_lookup_num_tokens"] = lookup_tokens
  if assistant is not None:
    kwargs["assistant_model"] = assistant
  if min_new_tokens:
    kwargs["min_new_tokens"] = min_new_tokens
  if sample:
    torch.manual_seed(seed)
  before = counter[0]
  with torch.inference_mode():
    out = model.generate(ids, attention_mask=torch.ones_like(ids),
                         max_new_tokens=max_new_tokens, eos_token_id=eos,
                         pad_token_id=eos[0] if eos else 0, **kwargs)
  return HFRun(out[0, len(prompt):].tolist(), counter[0] - before)
