"""Exactness as a tool: the χ² check of a drafter against the enumerated target law
(`checker.check`) and its negative controls, the planted acceptance bugs (`planted_bugs`)."""

from specjax.exactness.checker import ExactnessReport, check

__all__ = ["ExactnessReport", "check"]


def __getattr__(name: str):
  # The other names of the former module `specjax.exactness`, for one release.
  if not name.startswith("__"):
    from specjax.exactness import checker  # first use only
    if hasattr(checker, name):
      return getattr(checker, name)
  raise AttributeError(f"module 'specjax.exactness' has no attribute {name!r}")
