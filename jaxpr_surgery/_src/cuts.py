"""Blocks of features of one example's gradient (tiling.py's feature loops): a ``cut``.

A cut is ``(axis, f0, size)``, the features ``f0:f0+size`` on ``axis`` (``f0`` may be
traced), or a `Strided` one, the features ``k, k + n, k + 2n, ...`` (``size`` of them,
on an axis of length ``size * n``). Under XLA's partitioner an axis is split over
devices in contiguous pieces: a contiguous block of a split axis lives on one device,
so a loop over such blocks gathers the axis every iteration, while a strided block
with ``size`` a multiple of the number of pieces takes the same share of every
device's piece (devices.py selects strided blocks for a batch split by device). Every
site cuts its inputs through `take` (and an embedding's ids through `rows`), every
accumulator takes a block's values through `put`.
"""

from __future__ import annotations

import contextlib
from typing import Any, NamedTuple

import jax.numpy as jnp
from jax import lax

from jaxpr_surgery._src import compat


class Strided(NamedTuple):
    """The features ``k + j * n`` for ``j < size`` on ``axis`` (of length ``size * n``)."""

    axis: int
    k: Any
    size: int
    n: int


def axis_of(cut) -> int:
    return cut[0]


def size_of(cut) -> int:
    return cut[2]


def take(cut, x, pos):
    """``x`` restricted to ``cut`` on its axis ``pos`` (the cut's axis in ``x``'s layout)."""
    if isinstance(cut, Strided):
        shp = x.shape
        x = x.reshape(shp[:pos] + (cut.size, cut.n) + shp[pos + 1 :])
        return lax.dynamic_index_in_dim(x, cut.k, pos + 1, keepdims=False)
    _, f0, size = cut
    return compat.slice_at(x, f0, size, pos)


def put(cut, acc, v, pos):
    """``acc`` with its block ``cut`` (on axis ``pos``) replaced by ``v``."""
    if isinstance(cut, Strided):
        shp = acc.shape
        a = acc.reshape(shp[:pos] + (cut.size, cut.n) + shp[pos + 1 :])
        return lax.dynamic_update_index_in_dim(a, v, cut.k, pos + 1).reshape(shp)
    # (lax's default, wrap-around select included: with the block's offset passed as
    # it is XLA:CPU ran s512's variance 1.3x slower)
    return lax.dynamic_update_slice_in_dim(acc, v, cut[1], pos)


def rows(cut, ids):
    """Row ids of a table cut on its rows: each id's position in the block, ``size``
    (dropped by a scatter with ``mode="drop"``) for the rows outside it."""
    if isinstance(cut, Strided):
        inside = ids % cut.n == cut.k
        return jnp.where(inside, ids // cut.n, cut.size)
    _, f0, size = cut
    ids = ids - f0
    return jnp.where((ids >= 0) & (ids < size), ids, size)


# Devices a batch is split over (devices.py), innermost last: feature blocks are then
# strided (cuts.py), so that a block takes a share of every device's piece of an axis
# XLA splits among them.
_SPLIT = [1]


def split_count() -> int:
    """The devices of the innermost batch split being traced (1: none)."""
    return _SPLIT[-1]


@contextlib.contextmanager
def split_over(nd: int):
    """Feature blocks strided for a batch split over ``nd`` devices while this runs."""
    _SPLIT.append(int(nd))
    try:
        yield
    finally:
        _SPLIT.pop()


def strided_count(n: int, fs: int, nd: int) -> int | None:
    """Blocks of strided features on an axis of ``n``: the fewest, of at most ``fs``
    features where one divides, whose size ``nd`` divides (each device's piece of the
    axis, split in up to ``nd`` pieces, in every block); None where no count does."""
    ok = [nf for nf in range(2, n + 1) if n % nf == 0 and (n // nf) % nd == 0]
    if not ok:
        return None
    small = [nf for nf in ok if n // nf <= fs]
    return small[0] if small else ok[-1]
