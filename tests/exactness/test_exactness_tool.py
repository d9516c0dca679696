"""The exactness tool (`specjax.exactness.checker.check`, `specjax check-exact`) on tiny models.

The tool must accept the project's rules (chains and static trees at T > 0, stochastic and
deterministic candidates: the end-to-end χ² through the loop; greedy identity for a dynamic
tree) and reject planted bugs with the power it states. Everything runs with fixed seeds, so
the outcomes are deterministic; each χ² test has false-alarm rate 1e-3. Vocabulary 12
restricted by top-k = 4 and m = 3 tokens: 64 outcomes, 8,000 rows, power >= 0.99 against any
deviation of total variation >= 0.06 (the tests assert the tool says so).
"""

import json

import jax.numpy as jnp
import numpy as np
import pytest
from flax import struct

from specjax.exactness import checker as exactness, planted_bugs
from specjax.verify import sampling, trees
from specjax.cli import main
from specjax.drafters.base import Drafter
from specjax.drafters.model import ModelDrafter
from specjax.drafters.oracle import OracleDrafter, controlled_law
from specjax.models.transformer import ModelConfig
from specjax_testing import model, perturbed

FALSE_ALARM = 1e-3
SAMPLES = 8000
DEVIATION = 0.06
SAMPLER = dict(temperature=1.0, top_k=4)
PROMPT = [3, 1, 7, 5]


@pytest.fixture(scope="module")
def pair():
  cfg = ModelConfig.llama(vocab_size=12, d_model=16, n_layers=2, n_heads=2, n_kv_heads=1,
                          d_ff=32, max_len=32)
  target = model(cfg, seed=2, logit_scale=6.0)
  return target, perturbed(target, seed=4, noise=0.7)


def _check(target, drafter, sampler=None, **kwargs):
  kwargs.setdefault("samples", SAMPLES)
  return exactness.check(target, drafter, sampler=sampler or sampling.make_sampler(**SAMPLER),
                         false_alarm=FALSE_ALARM, deviation=DEVIATION, seed=0, prompt=PROMPT,
                         **kwargs)


def _assert_passed(report):
  assert report.passed, "\n".join(report.lines())
  assert report.test.p_value >= FALSE_ALARM and report.test.impossible == 0
  assert report.power >= 0.99 and report.detectable_tv <= DEVIATION
  assert report.controls and all(c.rejected for c in report.controls)
  json.dumps(report.to_dict(), allow_nan=False)


# ----------------------------------------------------------------------------- chains


@pytest.mark.slow
def test_oracle_chain_passes_and_the_stated_power_covers_the_planted_bug(pair):
  """The controlled-α drafter: the real run passes; the always-accept bug is rejected, and
  its deviation is provably inside the stated power: it emits the second token from q, so its
  law is at total variation >= E_t1[TV(q, p)] = 1 − α from the target's (exactness.md)."""
  target, _ = pair
  alpha = 0.5
  report = _check(target, OracleDrafter.of(target, alpha), k=1, controls=["always_accept"])
  _assert_passed(report)
  assert abs(report.acceptance - alpha) < 0.05
  # The bug's deviation, from the enumerated law: first speculative token ~ q instead of p.
  sampler = sampling.make_sampler(**SAMPLER)
  cells, probs = exactness.target_law(target, PROMPT, sampler, 2)
  p_12 = np.zeros((12, 12))
  p_12[cells[:, 0], cells[:, 1]] = probs
  p1 = p_12.sum(1)
  cond = p_12[p1 > 0] / p1[p1 > 0, None]
  q = np.asarray(controlled_law(jnp.asarray(cond, jnp.float32), alpha), np.float64)
  bug_tv = float(np.sum(p1[p1 > 0] * 0.5 * np.abs(q - cond).sum(1)))
  assert bug_tv == pytest.approx(1 - alpha, abs=1e-5) and bug_tv >= DEVIATION
  assert report.controls[0].test.p_value < 1e-20


@pytest.mark.slow  # compile-heavy (fast-tier durations)
def test_a_control_the_drafter_cannot_show_makes_the_verdict_inconclusive(pair):
  """The oracle's residual is p itself under top-k, so 'residual = p' changes nothing: the
  control is not rejected and the verdict must not be PASS."""
  target, _ = pair
  report = _check(target, OracleDrafter.of(target, 0.5), k=1)
  assert not report.test.rejected and report.real_passed
  by_bug = {c.bug: c for c in report.controls}
  assert by_bug["always_accept"].rejected and not by_bug["residual_is_p"].rejected
  assert not report.passed and report.verdict.startswith("FAIL (inconclusive)")


@struct.dataclass
class MisreportingDrafter(Drafter):
  """A drafter bug: it samples from its real law but reports the uniform law as q."""

  inner: ModelDrafter

  @property
  def config(self):
    return self.inner.config

  def slots_needed(self, tree):
    return self.inner.slots_needed(tree)

  def init(self, *args, **kwargs):
    return self.inner.init(*args, **kwargs)

  def propose(self, state, ctx, tree, sampler, key):
    proposal, state = self.inner.propose(state, ctx, tree, sampler, key)
    return proposal.replace(q=jnp.full_like(proposal.q, 1.0 / proposal.q.shape[-1])), state

  def commit(self, *args, **kwargs):
    return self.inner.commit(*args, **kwargs)


@pytest.mark.slow
def test_a_drafter_that_misreports_its_law_fails(pair):
  target, draft = pair
  report = _check(target, MisreportingDrafter(ModelDrafter.of(draft)), k=1,
                  controls="always_accept")
  assert report.test.rejected and not report.passed
  assert report.verdict.startswith("FAIL: the first 3 emitted tokens do not follow")


# ----------------------------------------------------------------------------- trees


@pytest.mark.slow
@pytest.mark.parametrize("deterministic", [False, True], ids=["sampled", "top-k"])
def test_static_tree_end_to_end_chi_square_at_positive_temperature(pair, deterministic):
  """A static tree (two siblings at the root, one grandchild under each) through the loop at
  T = 0.9 with top-k and top-p: the first three tokens follow the target's law; both planted
  bugs (always accept; residual = p / r never updated between siblings) are rejected."""
  target, draft = pair
  sampler = sampling.make_sampler(0.9, 4, 0.95)
  report = _check(target, ModelDrafter.of(draft, deterministic=deterministic),
                  sampler=sampler, tree=trees.branching((2, 1)))
  _assert_passed(report)
  assert {c.bug for c in report.controls} == set(planted_bugs.PLANTED_BUGS)
  assert all(c.test.p_value < 1e-20 for c in report.controls)


@pytest.mark.slow
def test_greedy_mode_checks_identity_with_plain_decoding(pair):
  """T = 0: a ragged batch (the prompt and random ones) must equal plain greedy decoding
  token for token; the always-accept bug must not. (The experiment runs a dynamic tree.)"""
  target, draft = pair
  report = exactness.check(target, ModelDrafter.of(draft), k=2,
                           sampler=sampling.make_sampler(0.0), tokens=10, seed=0)
  assert report.mode == "greedy" and report.passed, "\n".join(report.lines())
  assert report.identical_rows == report.rows == exactness.GREEDY_PROMPTS
  assert [c.bug for c in report.controls] == ["always_accept"]
  assert report.controls[0].differing_rows > 0


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("kwargs, match", [
    (dict(sampler=sampling.make_sampler(1.0), tokens=4), r"12\^4 = 20736 outcomes, more than "
     r"max_cells=4096"),
    (dict(sampler=sampling.make_sampler(1.0), max_cells=500), "max_cells=500"),
    (dict(tokens=1), "tokens must be an int >= 2"),
    (dict(samples=50), "samples must be an int >= 100"),
    (dict(false_alarm=0.0), r"false_alarm must be a number in \(0, 1\)"),
    (dict(false_alarm=1.0), r"false_alarm must be a number in \(0, 1\)"),
    (dict(deviation=0), r"deviation must be a number in \(0, 1\]"),
    (dict(controls=["nope"]), "unknown planted bug 'nope'"),
    (dict(controls=[]), "at least one planted bug"),
    (dict(sampler=sampling.make_sampler(0.0), controls=["residual_is_p"]),
     "invisible at temperature 0"),
    (dict(tree=trees.chain(2)), "exactly one of k"),
    (dict(prompt=[1, 12]), r"prompt has token ids outside \[0, 12\)"),
    (dict(sampler=None), "sampler must be a sampling.SamplerParams"),
    (dict(seed=-1), "seed must be an int >= 0"),
])
def test_bad_input_is_refused_before_any_work(pair, kwargs, match):
  target, draft = pair
  args = dict(k=1, sampler=sampling.make_sampler(**SAMPLER), prompt=PROMPT)
  args.update(kwargs)
  with pytest.raises(ValueError, match=match):
    exactness.check(target, ModelDrafter.of(draft), **args)


def test_bad_models_and_drafters_are_refused(pair):
  target, _ = pair
  sampler = sampling.make_sampler(**SAMPLER)
  with pytest.raises(ValueError, match="target must be a specjax Transformer"):
    exactness.check("gpt2", target, k=1, sampler=sampler)
  with pytest.raises(ValueError, match="drafter must be a drafters.base.Drafter"):
    exactness.check(target, "ngram", k=1, sampler=sampler)
  other = model(target.config.replace(vocab_size=13))
  with pytest.raises(ValueError, match=r"draft vocabulary \(13\) must match the target's \(12\)"):
    exactness.check(target, other, k=1, sampler=sampler)
  with pytest.raises(ValueError, match="controlled-α drafter samples its candidates"):
    exactness.check(target, OracleDrafter.of(target, 0.5), tree=trees.DynamicTree(2, 1, 2),
                    sampler=sampler)


def test_power_bound_and_pooling():
  """Power against TV δ uses noncentrality 4Nδ²: at the detectable δ it equals 0.99; the
  bound holds for a concrete alternative; sparse cells are pooled, impossible ones count."""
  n, dof = 5000, 20
  d = exactness.detectable_tv(n, dof, FALSE_ALARM)
  assert exactness.power(n, dof, d, FALSE_ALARM) == pytest.approx(0.99, abs=1e-6)
  rng = np.random.default_rng(0)
  p = rng.dirichlet(np.ones(dof + 1))
  a = rng.dirichlet(np.ones(dof + 1))
  tv = 0.5 * np.abs(a - p).sum()
  assert np.sum((a - p) ** 2 / p) >= 4 * tv ** 2  # Cauchy–Schwarz, the bound used
  cells = np.arange(4)[:, None]
  probs = np.array([0.5, 0.4985, 0.001, 0.0005])
  samples = np.repeat([0, 1, 2, 5], [500, 498, 1, 1])[:, None]
  t = exactness.chi_square(samples, cells, probs, FALSE_ALARM)
  assert t.impossible == 1 and t.p_value == 0.0 and t.rejected
  assert t.pooled_cells == 3 and t.dof == 1  # the two sparse cells and the smallest kept one


# ----------------------------------------------------------------------------- CLI


@pytest.mark.slow
def test_check_exact_cli_end_to_end(tmp_path, capsys):
  out = tmp_path / "report.json"
  argv = ["check-exact", "--target-config", "tiny-llama:n_layers=1,d_model=32,d_ff=64",
          "--draft-config", "tiny-llama:n_layers=1,d_model=16,d_ff=32", "--k", "1",
          "--top-k", "3", "--samples", "2000", "--seed", "1"]
  assert main(argv + ["--json", "--out", str(out)]) == 0
  report = json.loads(capsys.readouterr().out)
  assert report["passed"] and report["mode"] == "chi2" and report["cells"] == 27
  assert json.loads(out.read_text()) == report
  assert {c["bug"] for c in report["controls"]} == set(planted_bugs.PLANTED_BUGS)
  # A false-alarm rate of 0.999 rejects almost any sample: FAIL, exit code 1, same programs.
  assert main(argv + ["--false-alarm", "0.999"]) == 1
  text = capsys.readouterr().out
  assert text.strip().splitlines()[-1].startswith("FAIL: the first 3 emitted tokens")


@pytest.mark.parametrize("args, match", [
    (["--top-k", "0"], "more than max_cells=4096"),
    (["--tree", "2,x"], "--tree must be children per depth"),
    (["--tree", "dynamic:1,2"], "--tree must be children per depth"),
    (["--controls", "foo"], "--controls: unknown planted bug 'foo'"),
    (["--samples", "10"], "--samples must be an int >= 100"),
    (["--false-alarm", "2"], r"--false-alarm must be in \(0, 1\)"),
    (["--alpha", "1.5", "--draft", "oracle"], "--alpha: alpha must lie in"),
    (["--out", "/nonexistent-dir/r.json"], "--out /nonexistent-dir/r.json: the directory"),
    (["--top-p", "0"], r"top_p must be in \(0, 1\]"),
])
def test_check_exact_cli_bad_input_is_one_line(capsys, args, match):
  assert main(["check-exact", "--target-config", "tiny-llama:n_layers=1", "--draft", "self",
               *args]) == 2
  err = capsys.readouterr().err
  assert err.startswith("specjax: error: ") and err.count("\n") == 1
  assert __import__("re").search(match, err), err


# ----------------------------------------------------------------------------- experiment


@pytest.mark.slow
def test_exactness_experiment_reduced(tmp_path):
  """The `exactness` study (configs/exactness.gin) on one loop case, few rows."""
  from specjax.sweeps import launch, runner
  params = ['sweeps.Sweep.axes = {"case": ["model/chain"], "temperature": [1.0], '
            '"top_p": [1.0]}',
            'sweeps.Sweep.fixed = {"vocab": 16, "samples": 2000, "top_k": 3, "tokens": 3}']
  summary = launch.run("exactness", params, out=str(tmp_path / "run"), progress=False)
  assert summary.ok == 1 and summary.failed == 0
  (record,) = runner.read_results(summary.run_dir / runner.RESULTS).values()
  m = record["metrics"]
  assert m["passed"] and m["mode"] == "chi2" and m["controls_rejected"], m["verdict"]
  assert set(m["controls"]) == set(planted_bugs.PLANTED_BUGS)
  assert "1/1 points PASS" in (summary.run_dir / "report.md").read_text()
