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
import enum
from typing import Any, NamedTuple

import jax.numpy as jnp
from jax import lax

from jaxpr_surgery._src import compat


class FeatureBlocks(str, enum.Enum):
    """How the values of blocks of features of one example's gradient combine, where a
    tile loop cuts a large ``G`` into blocks (`Reduction.feature_blocks`; a reduction may
    give the plain strings, which `feature_blocks_of` reads)."""

    PLACE = "place"  # elementwise over the gradient's shape: a block's value to its place
    ADD = "add"  # per-example values that add over the blocks (squared norms)


def feature_blocks_of(r):
    """``r.feature_blocks`` as a `FeatureBlocks` (None: never cut), raising a clear error
    for a value that is neither."""
    v = r.feature_blocks
    if v is None:
        return None
    try:
        return FeatureBlocks(v)
    except ValueError:
        raise ValueError(
            f"{type(r).__name__}.feature_blocks is {v!r}: give 'place' (elementwise "
            "values, each block's to its place), 'add' (per-example values summed over "
            "blocks) or None (never cut into blocks)."
        ) from None


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


def layout(cut, shape, pos) -> tuple:
    """The shape of an accumulator of blocks ``cut`` of a value of ``shape`` (blocks on
    axis ``pos``): a strided cut's axis split in two, ``(size, n)``, whose second `put`
    updates in place (a reshape around each update made XLA:CPU at jax 0.10 copy the
    whole accumulator every block), else ``shape``. `merged` undoes it."""
    shape = tuple(shape)
    if isinstance(cut, Strided):
        return shape[:pos] + (cut.size, cut.n) + shape[pos + 1 :]
    return shape


def merged(cut, acc, pos):
    """An accumulator in `layout` as the value's shape."""
    if isinstance(cut, Strided):
        return acc.reshape(acc.shape[:pos] + (-1,) + acc.shape[pos + 2 :])
    return acc


def put(cut, acc, v, pos):
    """``acc`` (in `layout`) with its block ``cut`` (on axis ``pos``) replaced by ``v``."""
    if isinstance(cut, Strided):
        return lax.dynamic_update_index_in_dim(acc, v, cut.k, pos + 1)
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


# Devices a batch is split over (devices.py), innermost last: ``(count, axis name,
# shares)``. Feature blocks are then strided (cuts.py), so that a block takes a share
# of every device's piece of an axis XLA splits among them, and tile loops combine each
# finished value across the split at once (tiling.py's `_shared`) except where the
# caller keeps them each part's own (`own_values`).
_SPLIT = [(1, None, False)]


def split_count() -> int:
    """The devices of the innermost batch split being traced (1: none)."""
    return _SPLIT[-1][0]


def split_axis():
    """The axis name of the innermost batch split being traced (None: none)."""
    return _SPLIT[-1][1]


def shares() -> bool:
    """Finished values are combined across the split at once (not within `own_values`)."""
    return _SPLIT[-1][2] and _SPLIT[-1][1] is not None


@contextlib.contextmanager
def split_over(nd: int, axis_name=None):
    """A batch split over ``nd`` devices along ``axis_name`` while this runs."""
    _SPLIT.append((int(nd), axis_name, True))
    try:
        yield
    finally:
        _SPLIT.pop()


@contextlib.contextmanager
def own_values(on: bool = True):
    """While this runs (``on``), finished values stay each part's own, combined once at
    the end (`Reduction.combined_share` not taken): values merged into a part's running
    accumulator (a chunk of a chunk loop: combining each chunk's would cost a collective
    per chunk and leave the accumulators per part all the same)."""
    if not on:
        yield
        return
    _SPLIT.append(_SPLIT[-1][:2] + (False,))
    try:
        yield
    finally:
        _SPLIT.pop()


def any_part(flag):
    """``flag`` (a traced bool) of any part of the batch split being traced: every part
    then takes the same branch of a ``lax.cond`` on it (a share is only right where every
    part takes one), and the cond stays one (on a flag that differs between the parts,
    ``vmap`` runs both branches)."""
    axis = split_axis()
    if axis is None:
        return flag
    return lax.psum(jnp.asarray(flag, jnp.int32), axis) > 0


def strided_count(n: int, fs: int, nd: int) -> int | None:
    """Blocks of strided features on an axis of ``n``: the fewest, of at most ``fs``
    features where one divides, whose size ``nd`` divides (each device's piece of the
    axis, split in up to ``nd`` pieces, in every block); None where no count does."""
    ok = [nf for nf in range(2, n + 1) if n % nf == 0 and (n // nf) % nd == 0]
    if not ok:
        return None
    small = [nf for nf in ok if n // nf <= fs]
    return small[0] if small else ok[-1]
