"""The studies: one module per experiment (its point function, validation, memory estimate
and report), and `measure`, the measurement skeleton they share.

Gin configs in configs/ bind them into a `specjax.sweeps.Sweep`; `specjax run NAME` runs
one. Installed as `specjax.experiments` (setup.py maps it); the engine never imports it,
only the CLI's `specjax bench` imports its study.
"""
