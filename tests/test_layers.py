"""The package layers: no import runs up the order written in docs/architecture.md ("Layers",
read from there, so the page and the check cannot disagree), no import circle, no library
import through an old module name, no private name imported from another package, function-
local imports that say why, and every old name still gives the new module.

Every import counts: the top of a file and inside functions (`ast`), `import a.b` and
`from a import b` alike. Negative controls feed synthetic modules with an upward import and
a circle and check both are reported.
(old names kept verbatim)
"""

from __future__ import annotations

import ast
import importlib
import pathlib
import re
import sys

import pytest

import specjax

ROOT = pathlib.Path(__file__).resolve().parents[1]


def layer_order(doc: str) -> list[list[str]]:
  """The units of each layer, bottom first, from the first code block after "## Layers":
  one layer a line, top first; a line's units (`files.py`, `engine/`) come before its
  description."""
  block = re.search(r"^## Layers\n.*?^```\n(.*?)^```", doc, re.S | re.M).group(1)
  layers = []
  for line in block.splitlines():
    units = []
    for tok in line.split():
      if not re.fullmatch(r"[a-z_]+(/|\.py)", tok):
        break
      units.append(tok)
    if units:
      layers.append(units)
  return layers[::-1]


def library_sources(root: pathlib.Path = ROOT) -> dict[str, tuple[pathlib.Path, str]]:
  """module name -> (path, source) for the library, the studies and the benchmarks."""
  out = {}
  for base, prefix in ((root / "specjax", ["specjax"]),
                       (root / "experiments", ["specjax", "experiments"]),
                       (root / "benchmarks", ["benchmarks"])):
    for p in sorted(base.rglob("*.py")):
      parts = list(p.relative_to(base).with_suffix("").parts)
      if parts[-1] == "__init__":
        parts = parts[:-1]
      out[".".join(prefix + parts)] = (p, p.read_text())
  return out


def imports_of(module: str, source: str, is_package: bool,
               modules: set[str]) -> list[tuple[str, int]]:
  """(imported specjax module, line) for every import in `source`, top and local. `from a
  import b` is module a.b when that is a module, else a."""
  out = []
  for node in ast.walk(ast.parse(source)):
    if isinstance(node, ast.Import):
      out += [(a.name, node.lineno) for a in node.names]
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        pkg = module.split(".") if is_package else module.split(".")[:-1]
        pkg = pkg[:len(pkg) - node.level + 1]
        base = ".".join(pkg + ([base] if base else []))
      for a in node.names:
        full = f"{base}.{a.name}"
        out.append((full if full in modules or full in specjax.MOVED else base, node.lineno))
  return [(m, n) for m, n in out if m == "specjax" or m.startswith("specjax.")]


def unit_of(module: str, root: pathlib.Path = ROOT) -> str | None:
  """The layer unit of a module: `engine/`, `files.py`, `experiments/`; None for the
  package's own __init__ (the public face above every layer)."""
  parts = module.split(".")
  if parts[0] == "benchmarks":
    return "benchmarks/"
  if len(parts) == 1:
    return None
  return f"{parts[1]}/" if (root / "specjax" / parts[1]).is_dir() or parts[1] == "experiments" \
      else f"{parts[1]}.py"


def check(sources: dict[str, tuple[pathlib.Path, str]], layers: list[list[str]],
          root: pathlib.Path = ROOT) -> list[str]:
  """Every violation, one line each: an upward import, an old name, a circle."""
  rank = {u: i for i, units in enumerate(layers) for u in units}
  modules = set(sources)
  problems, edges = [], {}
  for mod, (path, src) in sources.items():
    here = unit_of(mod, root)
    for target, line in imports_of(mod, src, path.name == "__init__.py", modules):
      where = f"{path.relative_to(root)}:{line}"
      if target in specjax.MOVED or any(target.startswith(o + ".") for o in specjax.MOVED):
        problems.append(f"{where}: imports {target}, an old name "
                        f"(now {specjax._new_name(target)})")
        continue
      there = unit_of(target, root)
      if here is None or there is None or here == there:
        if target in modules and target != mod:
          edges.setdefault(mod, set()).add(target)
        continue
      if there not in rank or here not in rank:
        problems.append(f"{where}: {here} or {there} is in no layer of docs/architecture.md")
      elif rank[there] > rank[here]:
        problems.append(f"{where}: {here} imports {target} ({there}), a higher layer")
      if target in modules:
        edges.setdefault(mod, set()).add(target)
  problems += [f"import circle: {' -> '.join(c)}" for c in _circles(edges)]
  return problems


def _circles(edges: dict[str, set[str]]) -> list[list[str]]:
  """One circle per strongly connected component with more than one module (Tarjan)."""
  index, low, stack, on, out = {}, {}, [], set(), []
  sys.setrecursionlimit(max(10000, sys.getrecursionlimit()))

  def visit(v):
    index[v] = low[v] = len(index)
    stack.append(v)
    on.add(v)
    for w in sorted(edges.get(v, ())):
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      comp = []
      while True:
        w = stack.pop()
        on.discard(w)
        comp.append(w)
        if w == v:
          break
      if len(comp) > 1:
        out.append(sorted(comp))

  for v in sorted(edges):
    if v not in index:
      visit(v)
  return out


def unexplained_local_imports(sources) -> list[str]:
  """Function-local specjax imports without a reason: each must carry a comment on its line
  (an optional dependency, load time) or sit under `try:`. commands/ imports lazily by rule
  (its package doc); the benchmarks are scripts that set the environment (threads, XLA
  flags) before they import JAX."""
  out = []
  for mod, (path, src) in sources.items():
    if mod.startswith(("specjax.commands.", "benchmarks")):
      continue
    lines = src.splitlines()
    tree = ast.parse(src)
    for func in ast.walk(tree):
      if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
        continue
      guarded = {id(n) for t in ast.walk(func) if isinstance(t, ast.Try) for n in ast.walk(t)}
      for node in ast.walk(func):
        if isinstance(node, (ast.Import, ast.ImportFrom)) and id(node) not in guarded and (
            imports_of(mod, ast.unparse(node), path.name == "__init__.py", set())) and (
            "#" not in lines[node.lineno - 1]):
          out.append(f"{path.relative_to(ROOT)}:{node.lineno}")
  return sorted(set(out))


def private_imports_across_units(sources) -> list[str]:
  """`from a import _name` where a lies in another unit (package or top module) than the
  importer: what units share is public (the benchmarks, scripts, are not checked)."""
  out = []
  for mod, (path, src) in sources.items():
    if mod.startswith("benchmarks"):
      continue
    for node in ast.walk(ast.parse(src)):
      if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("specjax"):
        if unit_of(node.module) != unit_of(mod):
          out += [f"{path.relative_to(ROOT)}:{node.lineno}: {a.name} from {node.module}"
                  for a in node.names if a.name.startswith("_") and a.name != "__version__"]
  return out


LAYERS = layer_order((ROOT / "docs" / "architecture.md").read_text())


def test_every_package_and_top_module_is_in_a_layer():
  units = {u for layer in LAYERS for u in layer}
  present = {p.name + ("/" if p.is_dir() else "") for p in (ROOT / "specjax").iterdir()
             if (p.is_dir() and (p / "__init__.py").exists()) or
             (p.suffix == ".py" and p.name != "__init__.py")}
  assert present | {"experiments/", "benchmarks/"} == units


def test_no_import_runs_up_a_layer_and_no_circle():
  assert check(library_sources(), LAYERS) == []


def test_the_check_reports_an_upward_import_an_old_name_and_a_circle(tmp_path):
  # negative controls: the same check over the real tree plus synthetic modules
  sources = library_sources()
  fake = {
      "specjax.analysis.fake_up": "def f():\n  from specjax.engine import loop\n",
      "specjax.verify.fake_old": "import specjax.decoding\n",
      "specjax.models.fake_a": "from specjax.models import fake_b\n",
      "specjax.models.fake_b": "def g():\n  import specjax.models.fake_a\n",
  }
  for mod, src in fake.items():
    sources[mod] = (ROOT / (mod.replace(".", "/") + ".py"), src)
  problems = check(sources, LAYERS)
  assert len(problems) == 3, problems
  assert "specjax/analysis/fake_up.py:2: analysis/ imports specjax.engine.loop" in problems[0]
  assert "specjax/verify/fake_old.py:1: imports specjax.decoding, an old name" in problems[1]
  assert problems[2] == "import circle: specjax.models.fake_a -> specjax.models.fake_b"


def test_function_local_imports_say_why():
  assert unexplained_local_imports(library_sources()) == []
  fake = {"specjax.models.fake": (ROOT / "specjax/models/fake.py",
                                  "def f():\n  from specjax.models import cache\n\n\n"
                                  "def g():\n  from specjax.models import cache  # load time\n")}
  assert unexplained_local_imports(fake) == ["specjax/models/fake.py:2"]


def test_private_names_stay_in_their_package():
  assert private_imports_across_units(library_sources()) == []
  fake = {"specjax.engine.fake": (ROOT / "specjax/engine/fake.py",
                                  "from specjax.verify.acceptance import _x, y\n"
                                  "from specjax.engine.loop import _z\n")}
  assert private_imports_across_units(fake) == [
      "specjax/engine/fake.py:1: _x from specjax.verify.acceptance"]


def test_the_layer_table_is_read_from_the_page():
  assert LAYERS[0] == ["files.py", "analysis/"] and LAYERS[-1] == ["cli.py"]
  assert layer_order("## Layers\n\n```\nb.py  c/   the top\na/   the bottom\n```\n") == [
      ["a/"], ["b.py", "c/"]]


@pytest.mark.parametrize("old", sorted(specjax.MOVED))
def test_old_module_names_are_the_new_modules(old):
  assert importlib.import_module(old) is importlib.import_module(specjax.MOVED[old])


def test_public_names():
  import specjax.adaptive
  import specjax.calibration
  import specjax.decoding
  import specjax.exactness
  import specjax.sampling
  import specjax.theory
  import specjax.trees
  from specjax.engine import decoding
  from specjax.training import defaults
  assert specjax.decoding is decoding and callable(specjax.load)
  for name in ("generate", "speculative_generate", "Generation"):
    assert getattr(specjax.decoding, name) is getattr(specjax.engine, name)
  assert specjax.adaptive.AdaptivePolicy.__module__ == "specjax.engine.adaptive.policy"
  assert callable(specjax.sampling.make_sampler) and callable(specjax.trees.chain)
  assert callable(specjax.calibration.calibrate) and callable(specjax.exactness.check)
  assert callable(specjax.calibration.fingerprint)  # the old module's other names too
  assert callable(specjax.theory.expected_tokens) and specjax.roofline.Hardware
  assert callable(defaults.load_default_pair) and callable(defaults.load_default_target)
  import specjax.checkpoints.published.eagle as old
  import specjax.training.published.eagle as new
  assert old is new
