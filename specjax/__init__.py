"""specjax: exact speculative decoding in JAX.

`specjax.load(target=..., draft=...)` resolves a target, its drafter and tokenizer from two
references (`specjax.resolve`); the engine's host API is `specjax.engine` (`generate`,
`speculative_generate`, `Generation`). docs/architecture.md maps the packages.

The modules that moved into packages keep their old names for one release
(`specjax.decoding`, `specjax.trees`, ...: `MOVED`): importing an old name gives the new
module itself (the same object, so a monkeypatch through either name is seen by both), and
nothing is imported before first use.
"""

import importlib
import importlib.abc
import importlib.util
import sys

__version__ = "0.1.0"

# old module name -> the module that holds its content now (old names kept verbatim)
MOVED = {
    "specjax.acceptance": "specjax.verify.acceptance",
    "specjax.sampling": "specjax.verify.sampling",
    "specjax.trees": "specjax.verify.trees",
    "specjax.verify_layout": "specjax.verify.layout",
    "specjax.theory": "specjax.analysis.theory",
    "specjax.roofline": "specjax.analysis.roofline",
    "specjax.metrics": "specjax.analysis.metrics",
    "specjax.chat": "specjax.data.chat",
    "specjax.prompts": "specjax.data.prompts",
    "specjax.checkpoints.dirs": "specjax.files",
    "specjax.checkpoints.published": "specjax.training.published",
    "specjax.batching": "specjax.engine.batching",
    "specjax.plan": "specjax.engine.plan",
    "specjax.loop": "specjax.engine.loop",
    "specjax.decoding": "specjax.engine.decoding",
    "specjax.adaptive": "specjax.engine.adaptive.policy",
    "specjax.adaptive_plan": "specjax.engine.adaptive.planning",
    "specjax.adaptive_loop": "specjax.engine.adaptive.loop",
    "specjax.adaptive_k": "specjax.engine.adaptive.roofline_k",
    "specjax.cycle_fit": "specjax.calibration.cycle_fit",
    "specjax.timing": "specjax.calibration.timing",
    "specjax.planted_bugs": "specjax.exactness.planted_bugs",
}


def _new_name(fullname: str) -> str | None:
  """The new name of an old module, or of a module under an old package name."""
  if fullname in MOVED:
    return MOVED[fullname]
  for old, new in MOVED.items():
    if fullname.startswith(old + "."):
      return new + fullname[len(old):]
  return None


class _AliasLoader(importlib.abc.Loader):

  def __init__(self, target: str):
    self.target = target

  def create_module(self, spec):
    return None  # a placeholder; exec_module swaps the real module in

  def exec_module(self, module):
    # The import system returns what sys.modules holds under the old name once this returns:
    # the new module itself, its own __name__ and __spec__ untouched.
    sys.modules[module.__name__] = importlib.import_module(self.target)


class _AliasFinder(importlib.abc.MetaPathFinder):

  def find_spec(self, fullname, path=None, target=None):
    new = _new_name(fullname) if fullname.startswith("specjax.") else None
    if new is None:
      return None
    return importlib.util.spec_from_loader(fullname, _AliasLoader(new))


if not any(isinstance(f, _AliasFinder) for f in sys.meta_path):
  sys.meta_path.insert(0, _AliasFinder())


def __getattr__(name: str):
  # `import specjax; specjax.decoding` (an old name read as an attribute)
  if f"specjax.{name}" in MOVED:
    return importlib.import_module(f"specjax.{name}")
  raise AttributeError(f"module 'specjax' has no attribute {name!r}")


def load(target: str = "default", draft: str = "eagle:default", **kwargs):
  """`specjax.resolve.load`: (target, tokenizer, draft, drafter, shape) from references."""
  from specjax.resolve import load as _load  # load time: `import specjax` stays light
  return _load(target, draft, **kwargs)
