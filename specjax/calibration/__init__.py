"""The cost model as the loop pays it: calibrated loop costs (`loop_costs`: `calibrate`,
`LoopCosts`), the fitted cycle cost (`cycle_fit`) and alternated timing (`timing`)."""

from specjax.calibration.loop_costs import LoopCosts, calibrate, measure

__all__ = ["LoopCosts", "calibrate", "measure"]


def __getattr__(name: str):
  # The other names of the former module `specjax.calibration`, for one release.
  if not name.startswith("__"):
    from specjax.calibration import loop_costs  # first use only
    if hasattr(loop_costs, name):
      return getattr(loop_costs, name)
  raise AttributeError(f"module 'specjax.calibration' has no attribute {name!r}")
