"""Drafters behind one protocol (`base.Drafter`): a separate model, the controlled-α oracle,
prompt lookup (n-gram) and layer-skip self-speculation."""

from specjax.models.lm import LM
from specjax.drafters.base import Context, Drafter, Proposal
from specjax.drafters.layer_skip import LayerSkipDrafter
from specjax.drafters.lookup import LookupDrafter
from specjax.drafters.model import ModelDrafter
from specjax.drafters.oracle import OracleDrafter

__all__ = ["LM", "Context", "Drafter", "Proposal", "ModelDrafter", "OracleDrafter",
           "LookupDrafter", "LayerSkipDrafter"]
