"""specjax: exact speculative decoding in JAX.

`specjax.load(target=..., draft=...)` resolves a target, its drafter and tokenizer from two
references (`specjax.resolve`); the engine is `specjax.decoding`.
"""

__version__ = "0.1.0"


def load(target: str = "default", draft: str = "eagle:default", **kwargs):
  """`specjax.resolve.load`: (target, tokenizer, draft, drafter, shape) from references."""
  from specjax.resolve import load as _load
  return _load(target, draft, **kwargs)
