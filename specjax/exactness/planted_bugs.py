"""Planted acceptance bugs: named, deliberately inexact variants of the acceptance rule (the
negative controls of the exactness tool, `specjax.exactness`, and of the tests). An exactness
check that cannot reject them cannot be trusted to reject a real bug.

`PLANTED_BUGS` names them (always accept; residual = p); `planted(bug)` makes a loop traced
inside it use one instead of the exact rule. They are the rule's own pieces swapped
(`acceptance.ChainRule`, `acceptance.TreeRule`) through the one hook `accept_tree` reads
(`acceptance._PLANTED`), at trace time only: the exact path pays nothing, and nothing in
the engine imports this module.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, NamedTuple

import jax
import jax.numpy as jnp

from specjax.verify import acceptance
from specjax.verify.acceptance import EXACT, EXACT_TREE, ChainRule, TreeRule


class PlantedBug(NamedTuple):
  """A deliberately inexact acceptance rule, for chains and for trees (a negative control:
  an exactness check that cannot reject it cannot be trusted to reject a real bug)."""

  name: str
  description: str
  chain: ChainRule
  tree: TreeRule


def _always_accept(u, p_x, q_x):
  del p_x, q_x
  return jnp.ones(u.shape, bool)


PLANTED_BUGS: dict[str, PlantedBug] = {bug.name: bug for bug in (
    PlantedBug("always_accept",
               "every tried candidate is accepted (the test u·q(x) < p(x) is skipped), so "
               "drafted tokens follow the draft's law q, not the target's p",
               ChainRule(accept=_always_accept), TreeRule(accept=_always_accept)),
    PlantedBug("residual_is_p",
               "after a rejection the token is drawn from p instead of the residual "
               "norm(max(0, p - q)) (trees: r is never updated between siblings), so "
               "tokens the draft over-proposes are emitted too often; invisible at T = 0",
               ChainRule(residual=lambda p, q: p),
               TreeRule(update=lambda r, q, last: r, update_point=lambda r, x, last: r)),
)}


def _switched(which: jax.Array) -> PlantedBug:
  """Every planted bug in one rule: PLANTED_BUGS' i-th bug (in order) where which == i, the
  exact rule for any other value. `which` is an int32 scalar, possibly traced, so a single
  compiled loop runs every control; pieces a bug leaves exact are not duplicated."""
  bugs = list(PLANTED_BUGS.values())

  def merge(exact: NamedTuple, pieces: list[NamedTuple]) -> NamedTuple:
    out = {}
    for field, base in exact._asdict().items():
      variants = [(i, getattr(p, field)) for i, p in enumerate(pieces)
                  if getattr(p, field) is not base]
      if not variants:
        out[field] = base
        continue

      def piece(*args, base=base, variants=variants):
        value = base(*args)
        for i, fn in variants:
          value = jnp.where(which == i, fn(*args), value)
        return value

      out[field] = piece
    return type(exact)(**out)

  return PlantedBug("switched", "one of PLANTED_BUGS, chosen at run time",
                    merge(EXACT, [b.chain for b in bugs]),
                    merge(EXACT_TREE, [b.tree for b in bugs]))


@contextlib.contextmanager
def planted(bug: str | jax.Array) -> Iterator[PlantedBug]:
  """Negative controls only: `accept_tree` *traced* inside this context uses a planted bug
  instead of the exact rule: `bug` is a name (a key of PLANTED_BUGS), or an int32 scalar
  (may be traced) choosing the i-th bug of PLANTED_BUGS at run time (any other value: the
  exact rule), so that one compiled loop serves every control.

  The override is read when a program is traced, never when it runs: it costs the exact
  path nothing, and a program compiled outside the context is unaffected. Conversely a
  jitted function traced inside it keeps the bug in its compile cache, so trace the
  planted loop in a jitted function of its own (as `specjax.exactness` does); never call a
  shared compiled loop (`loop.speculative_jit`, `decoding.speculative_generate`) inside
  this context.
  """
  if isinstance(bug, str):
    if bug not in PLANTED_BUGS:
      raise ValueError(f"planted bug must be one of {sorted(PLANTED_BUGS)}, got {bug!r}")
    rule = PLANTED_BUGS[bug]
  else:
    rule = _switched(jnp.asarray(bug, jnp.int32))
  token = acceptance._PLANTED.set(rule)
  try:
    yield rule
  finally:
    acceptance._PLANTED.reset(token)
