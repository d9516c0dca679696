"""The studies: one module per experiment (its point function, validation, memory estimate
and report), and `measure`, the measurement skeleton they share (re-exporting its concept
modules: `study_models`, `study_prompts`, `forward_timing`, `comparison`, `report_fields`,
`checks`), with `references`, what every study takes by reference.

Gin configs in configs/ bind them into a `specjax.sweeps.Sweep`; `specjax run NAME` runs
one. Installed as `specjax.experiments` (setup.py maps it); the engine never imports it,
only the CLI's `specjax bench` imports its study.
"""
