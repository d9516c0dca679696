"""Exactness as a tool: does a drafter (or acceptance rule) leave the target's law intact?

`check(target, drafter, k=... | tree=..., sampler=...)` runs the real compiled speculative
loop (`decoding.speculative_generate`) on `samples` independent rows of one prompt and
compares the joint law of the first m = `tokens` emitted tokens with the target's own law,
enumerated exactly:

    P(t_1 .. t_m | prompt) = Π_j p_warp(t_j | prompt, t_1 .. t_{j-1}),

each factor from the target's cache-free forward under the same warp (temperature, top-k,
top-p). The law has at most s^m outcomes (s = top_k, or the vocabulary when top-k is off);
more than `max_cells` is refused before any work: restrict a real model with top-k.

The comparison is Pearson's χ² goodness-of-fit test (scipy.stats.chisquare) at the stated
false-alarm rate: cells with expected count < 5 are pooled into one; an outcome the target
gives probability 0 must never occur (one occurrence rejects). Its power is stated, not
hoped for: for any law a with total-variation distance δ from the target p on the test's
cells, Cauchy–Schwarz gives Σ (a − p)²/p ≥ (Σ |a − p|)² = 4δ², so the noncentral χ²
(noncentrality 4Nδ², N rows) bounds the probability of rejecting it from below; the report
gives that bound at `deviation` = δ and the smallest δ detected with probability 0.99.

Negative controls run alongside, through the same loop, sample size and threshold, with a
planted acceptance bug (`planted_bugs.PLANTED_BUGS`: always accept; residual = p). Each
compiles a loop of its own (the bug's name is a static argument), so it can never share a
compiled program with the real path. The verdict is PASS only if the real run passes and
every control is rejected: a check that cannot see a planted bug says nothing.

Greedy mode (temperature 0): the loop must reproduce plain greedy decoding token for token
on a ragged batch (the prompt plus random prompts), and the always-accept control must not.

Notes. The first emitted token comes from the prefill, the rest from speculative cycles:
to see a chain's bonus token take m >= k + 2 (a tree: its depth + 2). Rows are independent
(each draws its own uniforms), and share one compiled loop; the rows are run in chunks of
equal size when they would not fit in memory at once. Any `drafters.base.Drafter` works
unchanged: the tool only calls the host API and the loop.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from scipy import optimize, stats

from specjax.engine import decoding, loop, plan
from specjax.exactness import planted_bugs
from specjax.verify import sampling
from specjax.models.lm import LM
from specjax.drafters.base import Drafter
from specjax.models import cache as kv
from specjax.models.transformer import Transformer
from specjax.verify.trees import DynamicTree, TreeSpec

MAX_CELLS = 4096  # outcomes of the enumerated law (and rows of its forward passes)
MIN_EXPECTED = 5.0  # cells expected below this are pooled
POWER_LEVEL = 0.99  # `detectable_tv` is the deviation detected with this probability
GREEDY_PROMPTS = 16  # rows of the greedy identity check (the prompt + random ones)
GREEDY_TOKENS = 32  # default tokens compared per row at T = 0
CHI2_TOKENS = 3  # default m at T > 0
ROW_BYTES_BUDGET = 512 * 2 ** 20  # memory for one chunk of rows (logits, laws, caches)


# ----------------------------------------------------------------------------- results


@dataclasses.dataclass
class GofTest:
  """One χ² comparison of N samples with the exact law (cells pooled as in the module doc).

  p_value is 0 when an impossible outcome (target probability 0) occurred; tv is the total
  variation distance between the empirical and the exact law (sampling noise included).
  """

  statistic: float
  dof: int
  p_value: float
  rejected: bool
  samples: int
  impossible: int  # samples in cells of probability 0
  pooled_cells: int
  tv: float


@dataclasses.dataclass
class ControlResult:
  """A planted bug run through the same check; `rejected` must be True."""

  bug: str
  description: str
  rejected: bool
  test: GofTest | None = None  # χ² mode
  differing_rows: int | None = None  # greedy mode: rows that differ from plain decoding


@dataclasses.dataclass
class ExactnessReport:
  """What `check` found. `passed`: the real run passed and every control was rejected."""

  mode: str  # "chi2" (T > 0) or "greedy" (T = 0)
  passed: bool
  verdict: str  # one line
  settings: dict
  controls: list[ControlResult]
  acceptance: float  # α of the real run: accepted / drafted nodes
  seconds: float
  test: GofTest | None = None  # χ² mode
  cells: int | None = None  # outcomes of positive probability
  power: float | None = None  # P(reject) against any law at TV >= settings["deviation"]
  detectable_tv: float | None = None  # TV rejected with probability POWER_LEVEL
  rows: int | None = None  # greedy mode
  identical_rows: int | None = None

  @property
  def real_passed(self) -> bool:
    if self.mode == "greedy":
      return self.identical_rows == self.rows
    return not self.test.rejected

  def to_dict(self) -> dict:
    """Strict JSON: NaN and infinities as null, tuples as lists."""
    return _jsonable(dataclasses.asdict(self) | {"real_passed": self.real_passed})

  def lines(self) -> list[str]:
    """A short human-readable report (the CLI prints it)."""
    s = self.settings
    if self.mode == "chi2":
      t = self.test
      head = [f"law of the first {s['tokens']} tokens: {self.cells} outcomes; {t.samples} "
              f"samples: χ² = {t.statistic:.1f} on {t.dof} dof, p = {t.p_value:.3g} (false "
              f"alarm {s['false_alarm']:g}, {t.impossible} impossible outcomes)",
              f"power {self.power:.3f} against any deviation of total variation >= "
              f"{s['deviation']:g}; a deviation of {self.detectable_tv:.3f} is detected with "
              f"probability {POWER_LEVEL:g}"]
    else:
      head = [f"greedy: {self.identical_rows}/{self.rows} rows identical to plain decoding "
              f"over {s['tokens']} tokens"]
    out = head + [f"acceptance rate α = {self.acceptance:.3f}"]
    for c in self.controls:
      what = (f"p = {c.test.p_value:.3g}, TV {c.test.tv:.3f}" if c.test is not None
              else f"{c.differing_rows}/{self.rows} rows differ")
      out.append(f"control {c.bug}: {'rejected' if c.rejected else 'NOT rejected'} ({what})")
    return out + [self.verdict]


def _jsonable(x):
  if isinstance(x, dict):
    return {k: _jsonable(v) for k, v in x.items()}
  if isinstance(x, (list, tuple)):
    return [_jsonable(v) for v in x]
  if isinstance(x, (np.integer,)):
    return int(x)
  if isinstance(x, (float, np.floating)):
    return float(x) if math.isfinite(x) else None
  return x


# ----------------------------------------------------------------------------- validation


def _int(name: str, value, lo: int, hi: int | None = None) -> int:
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < lo or (
      hi is not None and value > hi):
    allowed = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
    raise ValueError(f"{name} must be an int {allowed}, got {value!r}")
  return int(value)


def _fraction(name: str, value, hi_closed: bool) -> float:
  ok = isinstance(value, (int, float, np.floating, np.integer)) and not isinstance(value, bool)
  if ok:
    v = float(value)
    ok = math.isfinite(v) and 0.0 < v and (v <= 1.0 if hi_closed else v < 1.0)
  if not ok:
    raise ValueError(f"{name} must be a number in (0, 1{']' if hi_closed else ')'}, "
                     f"got {value!r}")
  return v


def _sampler_values(sampler) -> tuple[float, int, float]:
  if not isinstance(sampler, sampling.SamplerParams):
    raise ValueError(f"sampler must be a sampling.SamplerParams (sampling.make_sampler(...)), "
                     f"got {sampler!r}")
  return (float(sampler.temperature), int(sampler.top_k), float(sampler.top_p))


def _prompt(prompt, vocab: int, seed: int) -> list[int]:
  if prompt is None:
    return np.random.default_rng(seed).integers(0, vocab, 4).tolist()
  p = np.asarray(prompt)
  if p.ndim != 1 or p.size == 0 or not np.issubdtype(p.dtype, np.integer):
    raise ValueError(f"prompt must be a non-empty sequence of token ids, got {prompt!r}")
  if p.min() < 0 or p.max() >= vocab:
    raise ValueError(f"prompt has token ids outside [0, {vocab}): {p.tolist()}")
  return p.tolist()


def outcome_bound(vocab: int, top_k: int, tokens: int) -> int:
  """Outcomes the law of `tokens` tokens may have: s^m, s = top_k (if on) else the vocab."""
  s = top_k if 0 < top_k < vocab else vocab
  return s ** tokens


# ----------------------------------------------------------------------------- exact law


@jax.jit
def _next_laws(target: LM, seqs_BT, at, sampler):
  """Warped target law of the token after position `at` of each row (cache-free forward;
  positions after `at` are padding, invisible to it under the causal mask)."""
  positions = jnp.broadcast_to(jnp.arange(seqs_BT.shape[1], dtype=jnp.int32), seqs_BT.shape)
  logits_BTV, _, _ = target(seqs_BT, positions)
  return sampling.warp(jnp.take(logits_BTV, at, axis=1), sampler)


def target_law(target, prompt: Sequence[int], sampler, tokens: int, *,
               max_cells: int = MAX_CELLS) -> tuple[np.ndarray, np.ndarray]:
  """The exact law of the first `tokens` tokens after `prompt`: (cells [C, m] int, probs [C]
  float64), the C outcomes of positive probability (a chain of warped target conditionals).

  One compiled forward: prefixes padded to the prompt + m - 1 tokens, in chunks of equal
  size. Raises ValueError when more than `max_cells` outcomes have positive probability.
  """
  lm = LM.of(target)
  m, width = tokens, len(prompt) + tokens - 1
  rows = min(max_cells, 256)
  cells = np.zeros((1, 0), np.int64)
  probs = np.ones(1)
  for j in range(m):
    laws = []
    for start in range(0, len(cells), rows):
      part = cells[start:start + rows]
      seqs = np.zeros((rows, width), np.int32)
      seqs[:, :len(prompt)] = prompt
      seqs[:len(part), len(prompt):len(prompt) + j] = part
      law = _next_laws(lm, jnp.asarray(seqs), jnp.asarray(len(prompt) + j - 1), sampler)
      laws.append(np.asarray(law, np.float64)[:len(part)])
    law_CV = np.concatenate(laws) * probs[:, None]
    parent, token = np.nonzero(law_CV > 0)
    if len(parent) > max_cells:
      raise ValueError(f"the target's law of the first {j + 1} tokens has {len(parent)} "
                       f"outcomes of positive probability, more than max_cells={max_cells}: "
                       f"restrict it with top_k or lower tokens")
    cells = np.concatenate([cells[parent], token[:, None]], axis=1)
    probs = law_CV[parent, token]
  return cells, probs / probs.sum()


# ----------------------------------------------------------------------------- the test


def _counts(samples_NM: np.ndarray, cells_CM: np.ndarray) -> tuple[np.ndarray, int]:
  """Samples per cell, and the samples that fall in no cell (probability 0)."""
  index = {tuple(c): i for i, c in enumerate(cells_CM.tolist())}
  rows, n = np.unique(samples_NM, axis=0, return_counts=True)
  counts = np.zeros(len(cells_CM), np.int64)
  impossible = 0
  for row, c in zip(rows.tolist(), n.tolist()):
    i = index.get(tuple(row))
    if i is None:
      impossible += c
    else:
      counts[i] += c
  return counts, impossible


def _pool(expected_C: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """(kept cell indices, pooled cell indices): cells expected < MIN_EXPECTED form one pooled
  cell; if that is still below it, the least expected kept cell joins it."""
  order = np.argsort(expected_C, kind="stable")
  small = expected_C[order] < MIN_EXPECTED
  n_small = int(small.sum())
  if 0 < n_small < len(order) and expected_C[order[:n_small]].sum() < MIN_EXPECTED:
    n_small += 1
  if n_small == 1:  # a single sparse cell pools with nothing: keep it
    n_small = 0
  return np.sort(order[n_small:]), order[:n_small]


def chi_square(samples_NM: np.ndarray, cells_CM: np.ndarray, probs_C: np.ndarray,
               false_alarm: float) -> GofTest:
  """Pearson's χ² test of the rows of `samples_NM` against the exact law (module doc)."""
  n = len(samples_NM)
  counts, impossible = _counts(samples_NM, cells_CM)
  expected = probs_C * n
  kept, pooled = _pool(expected)
  obs, exp = counts[kept].astype(float), expected[kept]
  if len(pooled):
    obs, exp = np.append(obs, counts[pooled].sum()), np.append(exp, expected[pooled].sum())
  dof = len(obs) - 1
  tv = 0.5 * (np.abs(counts / n - probs_C).sum() + impossible / n)
  if dof == 0:
    statistic, p_value = 0.0, 1.0
  else:
    possible = obs.sum()
    statistic, p_value = stats.chisquare(obs, exp * possible / exp.sum()) if possible else (
        0.0, 1.0)
  if impossible:
    p_value = 0.0
  return GofTest(statistic=float(statistic), dof=dof, p_value=float(p_value),
                 rejected=bool(p_value < false_alarm), samples=n, impossible=int(impossible),
                 pooled_cells=int(len(pooled)), tv=float(tv))


def power(samples: int, dof: int, deviation: float, false_alarm: float) -> float:
  """P(the test rejects) for any law at total variation >= deviation from the target, on the
  test's cells: noncentral χ² with noncentrality 4·N·δ² (a lower bound; module doc). With a
  single cell every deviation lands on probability-0 outcomes: 1 − (1 − δ)^N."""
  if dof == 0:
    return float(-np.expm1(samples * np.log1p(-deviation))) if deviation < 1 else 1.0
  crit = stats.chi2.isf(false_alarm, dof)
  return float(stats.ncx2.sf(crit, dof, 4.0 * samples * deviation ** 2))


def detectable_tv(samples: int, dof: int, false_alarm: float,
                  level: float = POWER_LEVEL) -> float:
  """The smallest total variation δ the test detects with probability `level` (the bound)."""
  if dof == 0:
    return float(-np.expm1(np.log1p(-level) / samples))
  crit = stats.chi2.isf(false_alarm, dof)
  if stats.chi2.sf(crit, dof) >= level:  # a false-alarm rate >= level: any deviation
    return 0.0
  lam = optimize.brentq(lambda x: stats.ncx2.sf(crit, dof, x) - level, 1e-9, 1e9)
  return float(math.sqrt(lam / (4.0 * samples)))


# ----------------------------------------------------------------------------- running


@functools.partial(jax.jit, static_argnames=("tree", "cache_len"))
def _planted_tokens(target, drafter, prompt_BP, prompt_len_B, budget_B, eos, sampler, key,
                    which, *, tree, cache_len: int):
  """The speculative loop traced with the planted acceptance bugs (`planted_bugs.planted`),
  bug `which` (an int32 index into PLANTED_BUGS, a runtime value: one compile serves every
  control). A jit of its own, so the bugs never reach a shared compiled loop."""
  with planted_bugs.planted(which):
    return loop.speculative_loop(target, drafter, prompt_BP, prompt_len_B, budget_B, eos,
                                 sampler, key, tree=tree, cache_len=cache_len).tokens


@dataclasses.dataclass(frozen=True)
class _Plan:
  target: LM
  drafter: Drafter
  spec: plan.SpeculationPlan  # a fixed shape (`plan.of`)
  sampler: Any
  tokens: int
  slots: int
  max_len: int

  @property
  def tree(self):
    return self.spec.tree


def _prepared(p: _Plan, prompts, key=0) -> plan.Prepared:
  """The host API's checks of a run of these prompts, once (`plan.prepare`)."""
  return plan.prepare(p.target, p.drafter, prompts, p.spec, max_new_tokens=p.tokens,
                      sampler=p.sampler, seed=key)


def _emitted(p: _Plan, prompts, key, bug: str | None) -> tuple[list[list[int]], dict | None]:
  """The tokens each prompt's row emits (exact path: the host API; else a planted loop)."""
  if bug is None:
    run = decoding.speculative_generate(p.target, p.drafter, prompts, plan=p.spec,
                                        max_new_tokens=p.tokens, sampler=p.sampler, seed=key)
    return run.tokens, run.stats
  which = jnp.asarray(list(planted_bugs.PLANTED_BUGS).index(bug), jnp.int32)
  run = _prepared(p, prompts, key)
  tokens = np.asarray(_planted_tokens(*run.loop_args(), which, **run.loop_kwargs()))
  return [tokens[b, n:n + p.tokens].tolist()
          for b, n in enumerate(run.batch.prompt_len_B.tolist())], None


def _chunks(plan: _Plan, samples: int, cache_len: int) -> tuple[int, int]:
  """(chunks, rows per chunk): equal chunks (one compile) that fit ROW_BYTES_BUDGET."""
  cfg, draft = plan.target.config, plan.drafter.config
  per_row = 6 * 4 * plan.tree.n_nodes * cfg.vocab_size + kv.cache_bytes(cfg, 1, cache_len)
  if draft is not None:
    per_row += kv.cache_bytes(draft, 1, cache_len)
  most = max(64, ROW_BYTES_BUDGET // per_row)
  chunks = -(-samples // most)
  return chunks, -(-samples // chunks)


def _sample(plan: _Plan, prompt, samples: int, key, bug: str | None):
  """First `tokens` emitted tokens of `samples` independent rows [N, m], and (exact path)
  the accepted / drafted counts."""
  chunks, rows = _chunks(plan, samples, _prepared(plan, [prompt]).batch.cache_len)
  out, accepted, drafted = [], 0, 0
  for i in range(chunks):
    toks, st = _emitted(plan, [prompt] * rows, jax.random.fold_in(key, i), bug)
    out.append(np.asarray(toks, np.int64))
    if st is not None:
      accepted, drafted = accepted + int(st["accepted"].sum()), drafted + int(st["drafted"].sum())
  return np.concatenate(out)[:samples], accepted / max(drafted, 1)


# ----------------------------------------------------------------------------- check


def _models(target, drafter):
  """The target as an `LM` and the drafter as a `Drafter` (a draft model wrapped), each
  refused by type first."""
  if not isinstance(target, (Transformer, LM)):
    raise ValueError(f"target must be a specjax Transformer or LM, got {type(target).__name__}")
  if not isinstance(drafter, (Drafter, Transformer, LM)):
    raise ValueError(f"drafter must be a drafters.base.Drafter or a draft model, got "
                     f"{type(drafter).__name__}")
  return LM.of(target), decoding.as_drafter(drafter)


def _fixed_shape(k, tree) -> plan.SpeculationPlan:
  """The speculation plan of exactly one of k and tree; a fixed shape (not adaptive)."""
  spec = plan.of(k=k, tree=tree)
  if spec.adaptive:
    raise ValueError(f"k must be an int >= 1 (the check runs one fixed shape), got {k!r}")
  return spec


def _controls(controls, greedy: bool) -> list[str]:
  """The planted bugs to run: default every one visible at this temperature; at least one,
  each known and visible."""
  visible = ["always_accept"] if greedy else list(planted_bugs.PLANTED_BUGS)
  controls = visible if controls is None else [controls] if isinstance(
      controls, str) else list(controls)
  if not controls:
    raise ValueError(f"controls must name at least one planted bug of {visible}, got "
                     f"{controls!r}: a check that cannot fail says nothing")
  for name in controls:
    if name not in planted_bugs.PLANTED_BUGS:
      raise ValueError(f"controls: unknown planted bug {name!r}; known: "
                       f"{sorted(planted_bugs.PLANTED_BUGS)}")
    if name not in visible:
      raise ValueError(f"controls: planted bug {name!r} is invisible at temperature 0 (the "
                       f"residual of a one-hot target is the target itself); use {visible}")
  return controls


def _check_law_size(vocab: int, top_k: int, tokens: int, max_cells: int) -> None:
  """Refuses an enumerated law (T > 0) that may have more than max_cells outcomes."""
  if outcome_bound(vocab, top_k, tokens) > max_cells:
    s = top_k if 0 < top_k < vocab else vocab
    raise ValueError(f"the law of the first {tokens} tokens may have {s}^{tokens} = "
                     f"{s ** tokens} outcomes, more than max_cells={max_cells}: restrict the "
                     f"target with top_k (top_k=8 gives {8 ** tokens}) or lower tokens")


def _run_prompts(setup: _Plan, prompt, greedy: bool, seed: int, samples: int) -> list:
  """The prompts the runs use (T = 0: a ragged batch, the prompt and random ones no longer
  than what fits; T > 0: the prompt), after the host API's checks (context, prompt,
  drafter) on the prompt, then again at the batch the runs use (the drafter at that batch,
  memory)."""
  prompts = [prompt]
  first = _prepared(setup, prompts)
  if greedy:
    vocab = setup.target.config.vocab_size
    rng = np.random.default_rng(seed + 1)
    longest = max(1, min(16, setup.max_len - setup.tokens - setup.slots))
    prompts += [rng.integers(0, vocab, n).tolist()
                for n in rng.integers(1, longest + 1, GREEDY_PROMPTS - 1)]
  _prepared(setup, prompts if greedy else [prompt] * _chunks(
      setup, samples, first.batch.cache_len)[1])
  return prompts


def check(target, drafter, *, k: int | None = None, tree: TreeSpec | DynamicTree | None = None,
          sampler, tokens: int | None = None, samples: int = 20_000,
          false_alarm: float = 1e-3, deviation: float = 0.05, seed: int = 0,
          prompt: Sequence[int] | None = None, controls: Sequence[str] | None = None,
          max_cells: int = MAX_CELLS) -> ExactnessReport:
  """Checks that speculative decoding with `drafter` samples exactly the target's law.

  target: a `Transformer` (or `LM`); drafter: any `drafters.base.Drafter`, or a draft model
  (wrapped as `ModelDrafter`). Exactly one of k (a chain) and tree. sampler:
  `sampling.make_sampler(T, top_k, top_p)`; T = 0 selects greedy mode.
  tokens: m, the emitted tokens compared (default 3 at T > 0; at T = 0 as many as fit,
  up to 32).
  samples: independent rows at T > 0. false_alarm: the χ² test's size. deviation: the total
  variation δ at which the power is stated. prompt: token ids (default: 4 random ids from
  `seed`). controls: planted bugs to run (default: every bug of `planted_bugs.PLANTED_BUGS`
  visible at this temperature). max_cells: the refused size of the enumerated law.
  Raises ValueError (naming the argument) before any work; returns an `ExactnessReport`.
  """
  start = time.perf_counter()
  lm, drafter = _models(target, drafter)
  cfg = lm.config
  temperature, top_k, top_p = _sampler_values(sampler)
  greedy = temperature == 0.0
  seed = _int("seed", seed, 0)
  spec = _fixed_shape(k, tree)
  tree = spec.tree
  prompt = _prompt(prompt, cfg.vocab_size, seed)
  max_len = min([cfg.max_len] + ([drafter.config.max_len] if drafter.config else []))
  slots = max(tree.n_nodes, drafter.slots_needed(tree))
  if tokens is None:  # at T = 0, as many as fit (up to GREEDY_TOKENS)
    tokens = max(1, min(GREEDY_TOKENS, max_len - len(prompt) - slots)) if greedy else CHI2_TOKENS
  tokens = _int("tokens", tokens, 1 if greedy else 2)
  samples = _int("samples", samples, 100)
  false_alarm = _fraction("false_alarm", false_alarm, hi_closed=False)
  deviation = _fraction("deviation", deviation, hi_closed=True)
  max_cells = _int("max_cells", max_cells, 2)
  controls = _controls(controls, greedy)
  drafter = decoding.fit_vocab(drafter, cfg.vocab_size)  # padded, or refused
  if not greedy:
    _check_law_size(cfg.vocab_size, top_k, tokens, max_cells)
  setup = _Plan(target=lm, drafter=drafter, spec=spec, sampler=sampler, tokens=tokens,
                slots=slots, max_len=max_len)
  prompts = _run_prompts(setup, prompt, greedy, seed, samples)
  settings = dict(drafter=type(drafter).__name__, tree=list(tree.parents) if isinstance(
      tree, TreeSpec) else str(tree), temperature=temperature, top_k=top_k, top_p=top_p,
                  tokens=tokens, samples=len(prompts) if greedy else samples,
                  false_alarm=false_alarm, deviation=deviation, seed=seed, prompt=prompt,
                  controls=controls)
  keys = jax.random.split(jax.random.key(seed), 1 + len(controls))
  if greedy:
    report = _check_greedy(setup, prompts, keys, controls, settings)
  else:
    report = _check_chi2(setup, prompt, samples, keys, controls, settings, max_cells)
  report.seconds = time.perf_counter() - start
  return report


def _check_chi2(plan, prompt, samples, keys, controls, s, max_cells) -> ExactnessReport:
  cells, probs = target_law(plan.target, prompt, plan.sampler, plan.tokens, max_cells=max_cells)
  fa = s["false_alarm"]
  got, alpha = _sample(plan, prompt, samples, keys[0], None)
  test = chi_square(got, cells, probs, fa)
  results = []
  for name, key in zip(controls, keys[1:]):
    bad, _ = _sample(plan, prompt, samples, key, name)
    t = chi_square(bad, cells, probs, fa)
    results.append(ControlResult(bug=name, description=planted_bugs.PLANTED_BUGS[name].description,
                                 rejected=t.rejected, test=t))
  pw = power(samples, test.dof, s["deviation"], fa)
  missed = [c.bug for c in results if not c.rejected]
  if test.rejected:
    why = (f"{test.impossible} samples are outcomes the target gives probability 0"
           if test.impossible else f"χ² p = {test.p_value:.3g} < false alarm {fa:g}")
    verdict = (f"FAIL: the first {plan.tokens} emitted tokens do not follow the target's law "
               f"({why})")
  elif missed:
    verdict = _missed_verdict(missed, alpha)
  else:
    verdict = (f"PASS: the first {plan.tokens} tokens of {samples} runs follow the target's "
               f"law (p = {test.p_value:.3g} >= {fa:g}); every planted bug rejected; power "
               f"{pw:.3f} against any deviation of total variation >= {s['deviation']:g}")
  return ExactnessReport(mode="chi2", passed=not test.rejected and not missed, verdict=verdict,
                         settings=s, controls=results, acceptance=alpha, seconds=0.0,
                         test=test, cells=len(cells), power=pw,
                         detectable_tv=detectable_tv(samples, test.dof, fa))


def _check_greedy(plan, prompts, keys, controls, s) -> ExactnessReport:
  plain = decoding.generate(plan.target, prompts, max_new_tokens=plan.tokens,
                            sampler=plan.sampler)
  spec, st = _emitted(plan, prompts, keys[0], None)
  same = sum(a == b for a, b in zip(plain.tokens, spec))
  alpha = float(st["accepted"].sum()) / max(int(st["drafted"].sum()), 1)
  results = []
  for name, key in zip(controls, keys[1:]):
    bad, _ = _emitted(plan, prompts, key, name)
    differ = sum(a != b for a, b in zip(plain.tokens, bad))
    results.append(ControlResult(bug=name, description=planted_bugs.PLANTED_BUGS[name].description,
                                 rejected=differ > 0, differing_rows=differ))
  missed = [c.bug for c in results if not c.rejected]
  rows = len(prompts)
  if same < rows:
    verdict = (f"FAIL: greedy speculative decoding differs from plain greedy decoding in "
               f"{rows - same} of {rows} rows")
  elif missed:
    verdict = _missed_verdict(missed, alpha)
  else:
    verdict = (f"PASS: greedy speculative decoding equals plain greedy decoding token for token "
               f"({rows} rows × {plan.tokens} tokens); the planted bug changes the output")
  return ExactnessReport(mode="greedy", passed=same == rows and not missed, verdict=verdict,
                         settings=s, controls=results, acceptance=alpha, seconds=0.0,
                         rows=rows, identical_rows=same)


def _missed_verdict(missed: list[str], alpha: float) -> str:
  return (f"FAIL (inconclusive): the output matches the target, but the planted bug(s) "
          f"{', '.join(missed)} were not rejected (acceptance rate α = {alpha:.3f}): this check "
          f"could not see such a broken rule here. Use a weaker draft, more samples or more "
          f"tokens, or leave out a bug that cannot change the law with this drafter (e.g. "
          f"residual_is_p with the oracle drafter, whose residual is p itself)")
