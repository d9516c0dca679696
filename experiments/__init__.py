"""The studies: one module per experiment (its point function, validation, memory estimate
and report), and `measure`, the measurement skeleton they share.

Gin configs in configs/ bind them into a `specjax.sweeps.Sweep`; `specjax run NAME` runs
one. The library never imports this package.
"""
