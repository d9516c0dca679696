"""Sweeps: the generic machinery that runs a study's point function over a grid.

- `sweep.py`   `Sweep`: what a gin config binds (point function, axes, fixed values,
               validation, memory estimate, report, vectorised groups);
- `launch.py`  `specjax run`: gin config -> `Sweep` -> validated points -> run directory ->
               report (the gin entry point: the only library module that imports gin);
- `runner.py`  points, run directories, append-only results, resume, shards, merge;
- `parallel.py` `device_map`: one vectorised group spread over the local devices;
- `report.py`  markdown tables and matplotlib plots for run reports.

The studies themselves (point functions and their reports) live outside the library, in
`experiments/` at the repository's top level (installed as `specjax.experiments`); gin
configs bind them with

    from __gin__ import dynamic_registration
    import specjax.sweeps as sweeps
    import specjax.experiments.quickstart as quickstart

    sweeps.Sweep:
      name = "quickstart"
      point_fn = @quickstart.point
      ...
"""

from __future__ import annotations

from specjax.sweeps.sweep import Sweep

__all__ = ["Sweep"]
