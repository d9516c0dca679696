"""measure.calibrated_compare: the calibrate-then-compare sequence the studies share."""

from __future__ import annotations

import pytest

from specjax.experiments import comparison, measure
from specjax.verify import trees


@pytest.fixture
def recorded(monkeypatch):
  """calibrate and compare replaced by recorders (the wiring is what is tested here; both
  are tested on their own)."""
  calls = {}

  def calibrate(target, draft, prompt_ids, shapes, **kw):
    calls["calibrate"] = dict(draft=draft, shapes=shapes, **kw)
    return "COSTS"

  def compare(target, draft, prompt_ids, **kw):
    calls["compare"] = dict(draft=draft, **kw)
    return "CMP"

  monkeypatch.setattr(comparison.calibration, "calibrate", calibrate)
  monkeypatch.setattr(comparison, "compare", compare)
  monkeypatch.setattr(comparison.calibration, "default_cache_len",
                      lambda target, draft, ids, shapes, n, drafter_for=None:
                      100 + len(shapes) + (7 if drafter_for else 0))
  return calls


def test_one_cache_length_the_calibrated_costs_and_each_shapes_drafter(recorded):
  shapes = [trees.chain(1), trees.chain(4)]
  per_shape = {}

  def drafter_for(draft, tree):
    return per_shape.setdefault(tree.size, f"{draft}/{tree.size}")

  out = measure.calibrated_compare("T", "D", [[1, 2]], shapes, tree=trees.chain(4),
                                   max_new_tokens=16, repeats=3, calibration_repeats=2,
                                   temperature=1.0, seed=5, batch=1, statistic="fastest",
                                   recalibrate=True, revalidate=0.2, drafter_for=drafter_for)
  assert out == "CMP"
  cal, cmp = recorded["calibrate"], recorded["compare"]
  assert cal["cache_len"] == cmp["cache_len"] == 109  # the rule over the shapes' drafters
  assert cal["drafter_for"] is drafter_for and cal["draft"] == "D"
  assert (cal["repeats"], cal["revalidate"], cal["recalibrate"]) == (2, 0.2, True)
  assert cmp["draft"] == "D/4"  # the measured run drafts as the calibrated chain(4) did
  assert cmp["loop_costs"] == "COSTS" and cmp["decode_only"] is True
  assert (cmp["repeats"], cmp["statistic"], cmp["batch"], cmp["seed"]) == (3, "fastest", 1, 5)
  assert cal["temperature"] == cmp["temperature"] == 1.0


def test_a_given_cache_length_and_the_draft_itself(recorded):
  measure.calibrated_compare("T", "D", [[1, 2]], [trees.chain(2)], tree=trees.chain(2),
                             max_new_tokens=16, repeats=1, calibration_repeats=1,
                             cache_len=64, deterministic=True)
  assert recorded["calibrate"]["cache_len"] == recorded["compare"]["cache_len"] == 64
  assert recorded["compare"]["draft"] == "D" and recorded["compare"]["deterministic"] is True
  assert recorded["calibrate"]["drafter_for"] is None

