"""Adaptive speculation: the policy (`policy.AdaptivePolicy`, a menu of shapes priced per
cycle), its host-side planning (`planning`), the roofline's k per batch size (`roofline_k`)
and the adaptive loop (`loop`)."""

from specjax.engine.adaptive.policy import AdaptivePolicy

__all__ = ["AdaptivePolicy"]
