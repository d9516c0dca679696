"""Every drafter side by side: which one pays on this target, by how much, and on what text?

`target` (or its older name `models`), `draft` (the "model" drafter's) and `prompts` by
reference (experiments/references.py). `category` picks the embedded set; with a prompt
file the file's categories go into the rows. The heads this study trains (eagle, medusa)
exist for the embedded target only.

One point = (variant, category, temperature): variant "DRAFTER:SHAPE" names the drafter and
the shape it drafts (`VARIANTS`), all on the same target (the embedded default,
`specjax.training.defaults.load_default_pair()`), the same prompts and the same budgets:

    lookup:chain, lookup:tree            prompt lookup (n-gram), `LookupDrafter`
    layer_skip:chain, layer_skip:tree    the target's first m layers, `LayerSkipDrafter`
    medusa:chain, medusa:tree            Medusa heads; the tree is `acceptance.tree(N)`, the
                                         best static tree of N nodes for the heads' measured
                                         per-position acceptance
    eagle:chain, eagle:tree,             the EAGLE head; the dynamic tree is EAGLE-2's
    eagle:dynamic                        (`trees.DynamicTree(N, depth, width, confidence)`,
                                         scored at `dynamic_confidence`: by default 0.25
                                         at T = 0 and 1 at T > 0, `confidence_for`)
    model:chain, model:tree              the separate distilled draft model (`ModelDrafter`)
    oracle:chain, oracle:tree            the controlled-α drafter at the stated `oracle_alpha`
                                         (a reference for acceptance: it drafts with the
                                         target itself, so its wall time is no real draft's)

Budgets: a chain drafts k tokens (Medusa: at most one per head); every tree drafts N =
`trees.branching(tree_widths)`'s nodes (the static trees are that shape, Medusa's is the
optimal N-node tree, the dynamic tree verifies the N best of its pool), so drafters compare
at equal drafted tokens per cycle.

Candidates: deterministic drafters (lookup, Medusa, dynamic trees) always go through the
point-mass rule; model-like drafters (layer-skip, EAGLE, the draft model) draft sampled
chains and, at T = 0, distinct top-k trees (i.i.d. siblings of a peaked draft are
duplicates), sampled trees at T > 0; the oracle always samples. Every rule is exact.

Categories: "code", held-out files of the corpus the target was trained on (the Python
standard library: code repeats itself, which prompt lookup exploits), and "prose",
held-out documents of the prose corpus (`specjax.data.corpus`: the language reference
topics and the standard library's docstrings, English text about Python). The target is
trained on code only (which includes docstrings and comments), so prose is out of its
training distribution in form, not in vocabulary. With `models="random"` (tests) both are
fixed snippets.

Measured (`measure.compare`, as in the quickstart): `prompts` held-out prompts of the
category (8 by default), decoded in consecutive batches of `batch` rows, plain and
speculative runs alternated
`repeats` times, decode phase only (each also timed with max_new_tokens = 1 and the prefill
subtracted), medians (or the fastest calls). Predicted (`specjax.calibration`): the
compiled loop with this very drafter is timed on the drafter's shapes (its chain, its
static tree, its dynamic tree, and the chains of `calibration_k` shorter than its own, for
the fit), cached on disk and shared by the drafter's points of one (category, temperature).
That gives the cycle of the point's shape in plain target steps; each row's measured reach
P(n ≥ d) = depth_accepted ÷ cycles gives the tokens a loop iteration emits
(`calibration.run_tokens_per_iteration`: a batch waits for its slowest row, harmonic mean
over the batches):

    predicted speedup = τ_loop ÷ cycle_steps(shape),  efficiency = measured ÷ predicted.

The fit cycle = t_fixed + t_verify·(N + 1) + t_draft·D over those shapes shows what a
drafter costs per level (≈ 0 for lookup; Medusa's heads run once per cycle, in t_fixed).
Head training seconds come from the cached heads' manifest (the default target) or are
timed here (random models, `head_steps` steps).
"""

from __future__ import annotations

import functools

import numpy as np

from specjax.experiments import measure, references
from specjax.calibration import loop_costs as calibration
from specjax.analysis import theory
from specjax.verify import trees
from specjax.drafters.layer_skip import check_layers
from specjax.drafters.lookup import check_ngram
from specjax.data.corpus import load_corpus
from specjax.drafters.layer_skip import LayerSkipDrafter
from specjax.drafters.lookup import LookupDrafter
from specjax.drafters.medusa import MedusaDrafter
from specjax.drafters.model import ModelDrafter
from specjax.drafters.oracle import OracleDrafter
from specjax.engine import decoding
from specjax.models import cache as kv
from specjax.sweeps import report as rep

DRAFTERS = ("lookup", "layer_skip", "medusa", "eagle", "model", "oracle")
SHAPES_OF = {"lookup": ("chain", "tree"), "layer_skip": ("chain", "tree"),
             "medusa": ("chain", "tree"), "eagle": ("chain", "tree", "dynamic"),
             "model": ("chain", "tree"), "oracle": ("chain", "tree")}
VARIANTS = tuple(f"{d}:{s}" for d in DRAFTERS for s in SHAPES_OF[d])
CATEGORIES = ("code", "prose")
HEAD_KINDS = ("medusa", "eagle")

PROSE_FALLBACK = """The interpreter reads a program one statement at a time. Each name is
bound in the scope where it is assigned, and a lookup searches the local scope first, then
the enclosing functions, then the module, and finally the builtins. An exception that is
not handled propagates to the caller; if no caller handles it, the program stops and the
traceback is printed. Iteration asks an object for an iterator and calls next on it until
the iterator signals that it is exhausted.
"""


def parse_variant(variant) -> tuple[str, str]:
  """("eagle", "dynamic") from "eagle:dynamic"; ValueError naming the allowed variants."""
  drafter, sep, shape = str(variant).partition(":") if isinstance(variant, str) else ("", "", "")
  if not sep or drafter not in SHAPES_OF or shape not in SHAPES_OF[drafter]:
    raise ValueError(f"variant must be one of {VARIANTS} (DRAFTER:SHAPE; lookup, layer-skip, "
                     f"Medusa, the draft model and the oracle have no dynamic tree), got "
                     f"{variant!r}")
  return drafter, shape


def _check_ints(params: dict, name: str, default, empty: bool = False) -> tuple[int, ...]:
  v = params.get(name, default)
  if isinstance(v, (str, bytes)) or not isinstance(v, (list, tuple)) or not (
      v or empty) or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 1
                             for x in v):
    raise ValueError(f"{name} must be a {'' if empty else 'non-empty '}list of ints >= 1, "
                     f"got {v!r}")
  return tuple(v)


def validate(params: dict) -> None:
  drafter, shape = parse_variant(params.get("variant"))
  measure.check_choice(params, "category", "code", CATEGORIES)
  for name, lo in (("batch", 1), ("k", 1), ("max_new_tokens", 2), ("repeats", 1),
                   ("prompt_len", 8), ("calibration_repeats", 1), ("head_steps", 1),
                   ("max_ngram", 1), ("min_ngram", 1)):
    measure.check_int(params, name, {"max_ngram": 3, "min_ngram": 1, "head_steps": 8}.get(
        name, lo), lo)
  measure.check_int(params, "seed", 0, 0)
  models = references.check_target(params)
  references.check_draft(params)
  prompt_set, _ = references.check_prompts(params)
  if prompt_set not in references.EMBEDDED and params.get("category", "code") != "code":
    raise ValueError(f"category {params['category']!r} picks an embedded prompt set; with "
                     f"prompts={prompt_set!r} the file's own categories go into the rows: "
                     f"drop the category axis (--set category=code)")
  if drafter in HEAD_KINDS:
    references.check_embedded_only(params, f"the {drafter} head this study trains",
                                   ref=models, instead="compare a trained head with "
                                   f"`specjax bench --draft {drafter}:DIR`")
  measure.check_number(params, "temperature", 0.0, 0)
  measure.check_number(params, "oracle_alpha", 0.8, 0, 1)
  measure.check_choice(params, "recalibrate", False, (False, True))
  measure.check_choice(params, "statistic", "median", ("median", "fastest"))
  measure.check_choice(params, "target_dtype", "float32", ("float32", "bfloat16"))
  _check_ints(params, "calibration_k", (1,), empty=True)  # () = the drafter's shapes only
  widths = _check_ints(params, "tree_widths", (2, 1, 1, 1))
  check_ngram(params.get("max_ngram", 3), params.get("min_ngram", 1))
  n_layers = measure.model_configs(models, params.get("draft", "default"))[0].n_layers
  skip = params.get("skip_layers")
  if skip is not None:
    check_layers(skip, n_layers)
  elif drafter == "layer_skip" and n_layers < 2:
    raise ValueError(f"layer_skip needs a target of >= 2 layers, the {models!r} one has "
                     f"{n_layers}")
  confidence = measure.check_number(params, "dynamic_confidence", None, 0, lo_open=True,
                                    allow_none=True,
                                    note=" (the dynamic tree's scoring temperature; None: "
                                         f"{T0_CONFIDENCE} at T = 0, 1 at T > 0)")
  if shape == "dynamic":
    _dynamic(widths, 1.0 if confidence is None else confidence)


def default_skip(n_layers: int) -> int:
  """Layer-skip's default draft depth: half the target's layers (at least 1)."""
  return max(1, n_layers // 2)


def _static(widths) -> trees.TreeSpec:
  return trees.branching(tuple(widths))


# The dynamic tree's scoring temperature at T = 0 when none is given: a head trained to
# match the target's T = 1 law underrates its top choice for an argmax test (EAGLE head,
# base target, N = 8: tau 3.82 at 1, 4.46 at 0.5 and 0.25 on code; 4.17 / 4.42 on prose).
T0_CONFIDENCE = 0.25


def confidence_for(dynamic_confidence: float | None, temperature: float) -> float:
  """The dynamic tree's scoring temperature of a point (None: T0_CONFIDENCE at T = 0, the
  draft's own law at T > 0, where acceptance follows the target's T = 1 law)."""
  if dynamic_confidence is not None:
    return float(dynamic_confidence)
  return T0_CONFIDENCE if temperature == 0 else 1.0


def _dynamic(widths, confidence: float = 1.0) -> trees.DynamicTree:
  """The EAGLE-2 tree at the static tree's budget N, depth and widest level, scored at the
  draft-softmax temperature `confidence`."""
  static = _static(widths)
  try:
    return trees.DynamicTree(budget=static.size, depth=static.max_depth,
                             width=max(widths), confidence=confidence)
  except ValueError as e:
    raise ValueError(f"tree_widths {tuple(widths)}: the dynamic tree of the same budget, depth "
                     f"and width does not exist ({e})") from None


# ----------------------------------------------------------------------------- inputs


@functools.lru_cache(maxsize=4)
def category_texts(models: str, category: str):
  """Prompt texts of a category: held-out documents, or for the random test target a fixed
  snippet."""
  if models == references.RANDOM:
    return None if category == "code" else [PROSE_FALLBACK]
  if models != "default":
    return references.embedded_texts(models, category, measure.target_model(models)[2])
  if category == "code":
    return measure.target_model(models)[2]
  return [d.text for d in load_corpus(category).validation[:64]]


def drafter_and_tree(drafter: str, shape: str, temperature: float, *, models: str, k: int,
                     tree_widths, skip_layers, max_ngram: int, min_ngram: int,
                     oracle_alpha: float, head_steps: int, target_dtype: str = "float32",
                     dynamic_confidence: float | None = None, draft: str = "default"):
  """(Drafter, tree) of one variant (module doc: candidates and budgets). Drafters that run
  on the target (layer-skip, oracle, EAGLE's and Medusa's shared embedding and LM head) use
  it served in `target_dtype`; the heads were trained (and bound) on its float32 weights."""
  target = measure.target_model(models, target_dtype)[0]
  static = _static(tree_widths)
  if shape == "chain":
    tree = trees.chain(k)
  else:
    tree = (static if shape == "tree" else
            _dynamic(tree_widths, confidence_for(dynamic_confidence, temperature)))
  topk = temperature == 0 and shape != "chain"
  if drafter == "lookup":
    return LookupDrafter(max_ngram=max_ngram, min_ngram=min_ngram), tree
  if drafter == "layer_skip":
    m = default_skip(target.config.n_layers) if skip_layers is None else skip_layers
    return LayerSkipDrafter.of(target, m, deterministic=topk), tree
  if drafter == "model":
    return (ModelDrafter.of(measure.models(models, target_dtype, draft)[1],
                            deterministic=topk), tree)
  if drafter == "oracle":
    return OracleDrafter.of(target, oracle_alpha), tree
  if drafter == "eagle":
    return measure.eagle_drafter(target, models, topk or shape == "dynamic", head_steps), tree
  kind, params, acceptance, _ = measure.head(drafter, models, head_steps)
  if shape == "chain":
    return MedusaDrafter.of(target, params), trees.chain(min(k, kind.heads))
  medusa_tree = (acceptance.tree(static.size, max_depth=kind.heads) if acceptance is not None
                 else trees.chain(min(static.size, kind.heads)))
  return MedusaDrafter.of(target, params), medusa_tree


def memory(params: dict) -> int:
  """KV bytes of one point (the target's cache, plain and speculative, and the drafter's own:
  the draft model's, one head layer for EAGLE, a whole target for the oracle, none for
  lookup, Medusa and layer-skip, which drafts in the target's cache), from the preset
  configs: nothing is loaded."""
  drafter, _ = parse_variant(params.get("variant"))
  models = references.target_ref(params.get("target"), params.get("models"))
  batch = params.get("batch", 1)
  widths = params.get("tree_widths", (2, 1, 1, 1))
  slots = max(params.get("k", 4), _static(widths).size) + 1
  n = decoding.cache_len_for(params.get("prompt_len", 64), params.get("max_new_tokens", 64),
                             slots + 1)
  target_cfg, draft_cfg = measure.model_configs(models, params.get("draft", "default"))
  own = {"lookup": None, "medusa": None, "model": draft_cfg, "oracle": target_cfg,
         "eagle": measure.eagle_config(models) if drafter == "eagle" else None,
         "layer_skip": None}[drafter]
  target_bytes = kv.cache_bytes(target_cfg, batch, n)
  return 2 * target_bytes + (0 if own is None else kv.cache_bytes(own, batch, n))


# ----------------------------------------------------------------------------- a point


def _label(drafter: str, shape: str, tree) -> str:
  if shape == "chain":
    return f"{drafter} chain k={tree.size}"
  return f"{drafter} {shape} N={tree.size}"


def verdict(label: str, category: str, batch: int, temperature: float, speedup: float,
            predicted: float, efficiency: float, tau: float) -> str:
  """"lookup chain k=4, code, batch 1, T=0: 1.80× measured, 1.75× predicted, efficiency
  1.03, τ 2.60"."""
  return (f"{label}, {category}, batch {batch}, T={temperature:g}: {speedup:.2f}× measured, "
          f"{predicted:.2f}× predicted, efficiency {efficiency:.2f}, τ {tau:.2f}")


def point(variant: str, category: str = "code", temperature: float = 0.0, batch: int = 1,
          k: int = 4, tree_widths: tuple = (2, 1, 1, 1), skip_layers: int | None = None,
          max_ngram: int = 3, min_ngram: int = 1, oracle_alpha: float = 0.8,
          head_steps: int = 8, max_new_tokens: int = 64, prompt_len: int = 64,
          repeats: int = 5, models: str | None = None, seed: int = 0,
          calibration_k: tuple = (1,), calibration_repeats: int = 3,
          recalibrate: bool = False, statistic: str = "median", prompts="code",
          target_dtype: str = "float32", dynamic_confidence: float | None = None,
          target: str | None = None, draft: str = "default", prompt_count: int = 8,
          chat_template: bool = True) -> dict:
  drafter_name, shape = parse_variant(variant)
  models = references.target_ref(target, models)
  target, tok, _ = measure.target_model(models, target_dtype)
  if references.prompt_spec(prompts)[0] in references.EMBEDDED:  # the category's set
    prompts = references.prompt_spec(prompts)[1] or prompt_count
  work = references.batched_workload(models, tok, category_texts(models, category), prompts,
                                     prompt_count, batch, prompt_len,
                                     chat_template=chat_template)
  all_ids = work.ids
  build = functools.partial(drafter_and_tree, drafter_name, temperature=temperature,
                            models=models, k=k, tree_widths=tree_widths, draft=draft,
                            skip_layers=skip_layers, max_ngram=max_ngram, min_ngram=min_ngram,
                            oracle_alpha=oracle_alpha, head_steps=head_steps,
                            target_dtype=target_dtype, dynamic_confidence=dynamic_confidence)
  drafter, tree = build(shape)
  # The drafter's shapes, calibrated together (shared by its points of this category and
  # temperature): each with the drafter it runs with in its own point.
  by_key = {}
  for s in SHAPES_OF[drafter_name]:
    d, t = build(s)
    by_key[calibration.shape_key(t)] = (d, t)
  chain_k = {t.size for d, t in by_key.values() if isinstance(t, trees.TreeSpec) and t.is_chain}
  for c in sorted(c for c in set(calibration_k) - chain_k if c < max(chain_k)):
    by_key[calibration.shape_key(trees.chain(c))] = (build("chain")[0], trees.chain(c))
  shapes = [t for _, t in by_key.values()]
  cmp = measure.calibrated_compare(
      target, drafter, all_ids, shapes, tree=tree, batch=batch,
      max_new_tokens=max_new_tokens, repeats=repeats, calibration_repeats=calibration_repeats,
      temperature=temperature, seed=seed, recalibrate=recalibrate, statistic=statistic,
      drafter_for=lambda _d, t: by_key[calibration.shape_key(t)][0])
  st = cmp.spec.stats
  tau_loop = calibration.run_tokens_per_iteration(st, tree, batch, max_new_tokens - 1)
  row = measure.speculative_row(cmp, tau_loop, temperature)
  label = _label(drafter_name, shape, tree)
  line = verdict(label, category, batch, temperature, cmp.speedup, row["predicted_speedup"],
                 row["efficiency"], row["tau"])
  measure.say(line)
  train_s = (measure.head(drafter_name, models, head_steps)[3] if drafter_name in HEAD_KINDS
             else None)
  return {
      "verdict": line, "label": label, "drafter": drafter_name, "shape": shape,
      "temperature": float(temperature), "batch": batch, "category": category,
      "prompts": len(all_ids), **row, **work.row_fields(),
      "tau_iid": (float(theory.expected_tokens(row["alpha_trial"], tree.size))
                  if shape == "chain" else None),
      "oracle_alpha": oracle_alpha if drafter_name == "oracle" else None,
      "acceptance_by_position": [float(a) / t if t > 0 else None
                                 for a, t in zip(row["depth_accepted"], row["depth_tried"])],
      "head_train_seconds": train_s,
  }


# ----------------------------------------------------------------------------- report


def _row_name(m: dict) -> str:
  return f"{m['drafter']} {m['shape']}"


def spec_bench_table(records: list[dict], rep) -> str:
  """Spec-Bench style: one row per drafter and shape, one column per (category, T), each
  cell "speedup× (τ)"; at batch `min`."""
  smallest = min(r["metrics"]["batch"] for r in records)
  picked = [r for r in records if r["metrics"]["batch"] == smallest]
  cols = sorted({(r["metrics"]["category"], r["metrics"]["temperature"]) for r in picked},
                key=lambda c: (CATEGORIES.index(c[0]) if c[0] in CATEGORIES else 9, c[1]))
  names = [f"{c} T={t:g}" for c, t in cols]
  rows: dict[str, dict] = {}
  for r in picked:
    m = r["metrics"]
    row = rows.setdefault(_row_name(m), {"drafter": _row_name(m)})
    row[f"{m['category']} T={m['temperature']:g}"] = f"{m['speedup']:.2f}× ({m['tau']:.2f})"
  order = {v.replace(":", " "): i for i, v in enumerate(VARIANTS)}
  ordered = sorted(rows.values(), key=lambda row: order.get(row["drafter"], 99))
  return (f"Speedup over plain decoding (τ = tokens per cycle), batch {smallest}:\n\n"
          + rep.markdown_table(ordered, ["drafter"] + names))


def _plot_speedups(records, run_dir, rep) -> str:
  temps = sorted({r["metrics"]["temperature"] for r in records})
  names = [v.replace(":", " ") for v in VARIANTS
           if any(_row_name(r["metrics"]) == v.replace(":", " ") for r in records)]
  fig, axes = rep.new_figure(ncols=len(temps), figsize=(max(4.0, 0.5 * len(names)) * len(temps),
                                                        4.0), squeeze=False)
  cats = [c for c in CATEGORIES if any(r["metrics"]["category"] == c for r in records)]
  width = 0.8 / max(len(cats), 1)
  for ax, temp in zip(axes[0], temps):
    for j, cat in enumerate(cats):
      xs, meas, pred = [], [], []
      for i, name in enumerate(names):
        hit = [r["metrics"] for r in records if _row_name(r["metrics"]) == name
               and r["metrics"]["category"] == cat and r["metrics"]["temperature"] == temp]
        if hit:
          xs.append(i + (j - (len(cats) - 1) / 2) * width)
          meas.append(np.median([m["speedup"] for m in hit]))
          pred.append(np.median([m["predicted_speedup"] for m in hit]))
      ax.bar(xs, meas, width=width, color=f"C{j}", alpha=0.75, label=f"{cat} measured")
      ax.plot(xs, pred, "k_", markersize=12, mew=2,
              label="predicted" if j == 0 else None)
    ax.axhline(1.0, color="gray", lw=0.6, ls=":")
    ax.set_xticks(range(len(names)))
    ax.set_xticklabels(names, rotation=60, ha="right", fontsize=7)
    ax.set_ylabel("speedup over plain decoding")
    ax.set_title(f"T={temp:g}: bars measured, — predicted", fontsize=8)
    ax.legend(fontsize=6)
  return rep.save(fig, run_dir / "drafters_speedup.png")


def _plot_acceptance(records, run_dir, rep) -> str:
  fig, ax = rep.new_figure(figsize=(5.5, 3.5))
  for r in records:
    m = r["metrics"]
    acc = [np.nan if a is None else a for a in m["acceptance_by_position"]]
    ax.plot(np.arange(1, len(acc) + 1), acc, "o-" if m["shape"] == "chain" else "s--",
            label=f"{_row_name(m)} {m['category']} T{m['temperature']:g}", lw=0.8)
  ax.set_xlabel("draft position (depth)")
  ax.set_ylabel("P(accepted | reached)")
  ax.set_ylim(0, 1.02)
  ax.legend(fontsize=5, ncol=2)
  return rep.save(fig, run_dir / "drafters_acceptance.png")


def report(records: list[dict], run_dir) -> str:
  records = sorted(records, key=lambda r: r.get("index", 0))
  lines = ["## Drafters side by side", "",
           "Every drafter on the same target, prompts and budgets. Speedup = speculative ÷ "
           "plain tokens/s of the decode phase, measured side by side; predicted = tokens "
           "per loop iteration (each row's measured reach by depth) ÷ the calibrated cycle "
           "cost of the loop with that drafter, in plain target steps; efficiency = "
           "measured ÷ predicted. The oracle drafts with the target itself at the stated α: "
           "a reference for acceptance, not for speed.", ""]
  lines += [f"- {r['metrics']['verdict']}" for r in records] + [""]
  lines += [spec_bench_table(records, rep), ""]
  lines += [f"![measured vs predicted speedup by drafter]"
            f"({_plot_speedups(records, run_dir, rep)})",
            f"![acceptance by draft position]({_plot_acceptance(records, run_dir, rep)})", ""]
  heads = {}
  for r in records:
    m = r["metrics"]
    if m.get("head_train_seconds") is not None:
      heads[m["drafter"]] = m["head_train_seconds"]
  if heads:
    lines += ["### Head training", ""]
    lines += [f"- {name}: {sec:.1f} s" for name, sec in heads.items()] + [""]
  lines += ["### What a cycle costs (fit over each drafter's calibrated shapes, target steps)",
            ""]
  seen = set()
  for r in records:
    m = r["metrics"]
    cal = m.get("calibration") or {}
    key = (m["drafter"], m["category"], m["temperature"], m["batch"])
    if key in seen or not cal:
      continue
    seen.add(key)
    fit = cal.get("fit_steps")
    fit_text = "no fit (shapes do not identify it)" if fit is None else (
        f"{fit['t_fixed']:.2f} + {fit['t_verify']:.2f}·(N+1) + {fit['t_draft']:.2f}·D "
        f"(rms {100 * fit['rel_rms']:.1f}%)")
    shapes = ", ".join(f"{s} {v:.2f}" for s, v in cal["cycle_steps"].items())
    lines.append(f"- {key[0]}, {key[1]}, T={key[2]:g}, batch {key[3]}: {fit_text}; "
                 f"{shapes}")
  return "\n".join(lines)
