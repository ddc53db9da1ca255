"""The keys of a site's request (the reductions its backward pass computes) and of its
sink (the pytree whose cotangent carries them out, `site_fns`): typed, and of one type,
`Key`, since jax sorts a dict's keys when it flattens it (a request is vmapped over a
scanned leaf's layers) and cannot sort keys of mixed types.
"""

from __future__ import annotations

import enum
from typing import NamedTuple


class Role(enum.IntEnum):
    """What a sink entry holds."""

    REDUCTION = 0  # the value of the plan's reduction ``index`` (`reduction`)
    CLIP_NORMS = 1  # the per-example norms a clipped sum weighs by (`ClipNorms`)
    KEPT = 2  # per-example products kept for a clipped sum (`KeptExamples`)
    SQ = 3  # squared norms asked for on the way to norms (`sites.base.direct_norms`)
    INGREDIENTS = 4  # the site's ingredients, for its leaf's values afterwards
    CARRY_COUNT = 5  # the examples of earlier chunks (their running values: `carried`)
    EX_WEIGHTS = 6  # the chunk's example weights ``[B]``
    CARRY_WEIGHT = 7  # the weight of the examples of earlier chunks
    WEIGHTS = 8  # a clipped sum's second pass: the examples' weights in
    SUMS = 9  # ... and the weighted sums out


class Kept(enum.Enum):
    """What a site keeps for its leaf's values afterwards (`INGREDIENTS`): its kernel's
    ingredients, or, a site of a recomputed segment (segments.py), its inputs as the
    site read them or its output cotangents alone."""

    ALL = enum.auto()
    X = enum.auto()
    DY = enum.auto()


class Key(NamedTuple):
    """A key of a request or sink: its `Role`, and for a reduction the plan's index."""

    role: Role
    index: int = 0

    def __repr__(self):
        name = self.role.name.lower()
        return f"{name}[{self.index}]" if self.role is Role.REDUCTION else name


def kept_as_ingredients(values: dict) -> bool:
    """Renames the per-example products a site keeps for a clipped sum (``KEPT``) its
    ingredients (``INGREDIENTS``) in ``values`` (a sink's, or its avals): its leaf's values
    afterwards read those. Whether there were any."""
    if KEPT not in values:
        return False
    values[INGREDIENTS] = values.pop(KEPT)
    return True


def reduction(j: int) -> Key:
    """The key of the plan's ``j``-th reduction."""
    return Key(Role.REDUCTION, int(j))


CLIP_NORMS = Key(Role.CLIP_NORMS)
KEPT = Key(Role.KEPT)
SQ = Key(Role.SQ)
INGREDIENTS = Key(Role.INGREDIENTS)
CARRY_COUNT = Key(Role.CARRY_COUNT)
EX_WEIGHTS = Key(Role.EX_WEIGHTS)
CARRY_WEIGHT = Key(Role.CARRY_WEIGHT)
WEIGHTS = Key(Role.WEIGHTS)
SUMS = Key(Role.SUMS)
