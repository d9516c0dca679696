"""The measurement skeleton every experiment shares, under one name: `measure.X`.

An experiment keeps only its point function, its validation, its memory estimate and its
report; everything it measures goes through here. Each concept lives in its own module and
is re-exported here, so a study reads `measure.compare`, `measure.models`, ... :

- `study_models`: `models(which, target_dtype, draft)`, `target_model`, `draft_model`,
  `head`, `eagle_drafter` (the studies' models by reference, loaded once per process) and
  `model_configs` / `eagle_config` / `cache_bytes` (configs and KV bytes without loading
  weights, for memory estimates);
- `study_prompts`: `prompts` (the embedded sets' windows) and `workload` (rounded up to
  whole batches); a study's prompts by reference: `references.workload`;
- `forward_timing`: `alternate(fns, repeats)` (the one alternating-timing loop, giving
  `Timing`s), `forward_seconds`, `draft_passes`, `step_costs` -> `StepCosts` (the standalone
  costs t_1, v, c) and `hardware()` (this machine's roofline, calibrated once per process);
- `comparison`: `compare(...) -> Comparison`, plain vs speculative decoding measured side by
  side with the predicted speedup (calibrated loop costs or standalone step costs),
  `calibrated_compare(...)`, the calibrate-then-compare sequence of the studies, and
  `cycle_slots` / `drafter_of` (the engine's cache-length rule for a point);
- `report_fields`: `speculative_row(cmp, tau_loop, temperature)`, the result fields every
  point reports about a `Comparison` measured with calibrated loop costs, `loop_fields`,
  `divergences`, and `say(line)`, a verdict on the console;
- `checks`: `check_int` / `check_number` / `check_choice`, the parameter checks of every
  `validate`.
"""

from __future__ import annotations

from specjax.experiments.checks import check_choice, check_int, check_number
from specjax.experiments.comparison import (Comparison, calibrated_compare, compare, cycle_slots,
                                            drafter_of)
from specjax.experiments.forward_timing import (StepCosts, Timing, alternate, draft_passes,
                                                forward_seconds, hardware, step_costs)
from specjax.experiments.report_fields import divergences, loop_fields, say, speculative_row
from specjax.experiments.study_models import (cache_bytes, draft_model, eagle_config,
                                              eagle_drafter, head, model_configs, models,
                                              target_model)
from specjax.experiments.study_prompts import FALLBACK_TEXT, _held_out_texts, prompts, workload

__all__ = [
    "FALLBACK_TEXT", "Comparison", "StepCosts", "Timing", "alternate", "cache_bytes",
    "calibrated_compare",
    "check_choice", "check_int", "check_number", "compare", "cycle_slots", "divergences",
    "draft_model", "draft_passes", "drafter_of", "eagle_config", "eagle_drafter",
    "forward_seconds", "hardware", "head", "loop_fields", "model_configs", "models",
    "prompts", "say", "speculative_row", "step_costs", "target_model", "workload",
    "_held_out_texts",
]
