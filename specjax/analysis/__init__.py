"""The analytic model: closed forms (`theory`), the roofline (`roofline`) and the statistics of
a run (`metrics`). numpy and scipy only: nothing here imports JAX at import time, so the
package imports in milliseconds (`roofline.calibrate` imports JAX when it is called)."""
