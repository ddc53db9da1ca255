"""Token-axis tiling: reductions of per-example gradients produced tile by tile.

Where a statistic needs the per-example gradient ``G_b`` itself (E[g²], signs,
centred moments, ... at a site with a token axis), ``G`` is never formed for
the whole batch. Every site kind supplies ``make(b0, size) -> G[b0:b0+size]``
(in any layout, the same for every tile); this module loops over tiles of
examples, applies every requested reduction to the tile while it is hot, and
accumulates. One loop serves all statistics of a leaf.

Tile sizes come from a memory budget (``memory_budget_bytes``, a public
option). On CPU a tile of one example is a plain 2-D matmul per example, which
XLA:CPU runs several times faster than a batched ``dot_general``; elsewhere
tiles hold as many examples as the budget allows (a batched GEMM per tile).

Where one example's ``G`` is itself large (a vocabulary-sized unembedding or
tied table), sites that can produce a slice of it (``make_f(b0, size, f0, fs)``)
are also tiled over features: an outer loop over blocks of one axis, an inner
loop over examples, so the block and its accumulators stay in cache (on CPU)
or within the budget (elsewhere) while every reduction reads it.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jaxpr_surgery._src import compat
from jaxpr_surgery._src import stats as S

DEFAULT_MEMORY_BUDGET_BYTES = 64 << 20  # per tile of materialised per-example gradients
CACHE_TILE_BYTES = 2 << 20  # CPU: one example's block of G, kept cache-sized
MIN_FEATURE_TILE_BYTES = 256 << 10  # smaller blocks cost more in loop overhead than they save


def tile_size(B: int, bytes_per_example: int, budget: int | None, *, batched_ok=True) -> int:
    """Examples per tile: as many as fit in ``budget`` (at least one, at most ``B``).

    ``batched_ok=False`` (a tile whose production is a batched matmul, on CPU)
    gives one example per tile.
    """
    if not batched_ok:
        return 1
    budget = DEFAULT_MEMORY_BUDGET_BYTES if budget is None else int(budget)
    return int(max(1, min(B, budget // max(int(bytes_per_example), 1))))


def leaf_tile(B: int, shape, dtype, budget, kernels) -> int:
    """Examples per tile of a multi-site leaf's summed ``G [B, *shape]``: one per tile
    on CPU when a site has a token axis (its products are 2-D matmuls), else by budget."""
    per_ex = prefer_per_example() and any(
        k.kind in ("dense", "conv") and getattr(k, "c", None) and k.c["N"] > 1 for k in kernels
    )
    return tile_size(B, bytes_of(shape, dtype), budget, batched_ok=not per_ex)


def feature_tile(shape, dtype, axes, budget) -> tuple[int, int] | None:
    """``(axis, size)``: blocks of ``size`` along ``axis`` (the longest of ``axes``) for
    one example's ``G`` of ``shape``, or None where it is small enough whole.

    On CPU blocks are about `CACHE_TILE_BYTES` (or the budget, if smaller); elsewhere
    one example is split only where it alone exceeds the budget. Never below
    `MIN_FEATURE_TILE_BYTES`.
    """
    axes = [a for a in axes if shape[a] > 1]
    if not axes:
        return None
    budget = DEFAULT_MEMORY_BUDGET_BYTES if budget is None else int(budget)
    target = min(CACHE_TILE_BYTES, budget) if prefer_per_example() else budget
    target = max(target, MIN_FEATURE_TILE_BYTES)
    total = bytes_of(shape, dtype)
    if total <= target:
        return None
    axis = max(axes, key=lambda a: shape[a])
    n = int(shape[axis])
    blocks = min(n, -(-total // target))
    size = -(-n // blocks)
    return (axis, size) if size < n else None


def describe(tile: int, ft, shape) -> str:
    """``"1 example/tile"``, or with feature blocks ``"1 example x 2048 of 8192 on
    axis 0/tile"`` (for `explain`)."""
    ex = f"{tile} example{'s' if tile > 1 else ''}"
    if ft is None:
        return f"{ex}/tile"
    axis, size = ft
    return f"{ex} x {size} of {shape[axis]} on axis {axis}/tile"


def tile_bytes(tile: int, ft, shape, dtype) -> int:
    """Bytes of one tile of ``G`` (examples x feature block)."""
    if ft is not None:
        axis, size = ft
        shape = tuple(shape[:axis]) + (size,) + tuple(shape[axis + 1 :])
    return tile * bytes_of(shape, dtype)


def prefer_per_example() -> bool:
    """True where a batched ``dot_general`` is slow (XLA:CPU): tile one example at a time."""
    return jax.default_backend() == "cpu"


def _tile_values(G, reductions, means):
    """Per-tile contributions: ``G`` is ``[size, *shape]``. Centred sums are taken
    against the exact mean of the whole batch (two-pass); the rest as for any
    materialised ``G``."""
    from jaxpr_surgery._src.sites.base import reduce_materialised

    return [
        jnp.sum(jnp.square(G - m), axis=0) if isinstance(r, S.Centered)
        else reduce_materialised(G, r)
        for r, m in zip(reductions, means)
    ]


def reduce_tiles(
    make, B: int, reductions, tile: int, *, means=None, shape, dtype, features=None
):
    """Reductions of ``G [B, *shape]`` with ``G[b0:b0+size] = make(b0, size)``.

    Args:
      make: ``(b0, size) -> [size, *shape]`` (``b0`` may be traced; ``size`` static).
      reductions: `PhiSum` (any phi), `Centered` (two-pass: ``means`` holds the
        exact mean for it, computed beforehand by a contraction) or `SqNorms`.
      tile: examples per tile.
      shape, dtype: of one example's ``G``.
      features: optional ``(axis, size, make_f)`` (`feature_tile`'s block and
        ``make_f(b0, size, f0, fs) -> G[b0:b0+size]`` restricted to ``f0:f0+fs`` on
        ``axis``): blocks of features in an outer loop, examples in the inner one.
        Used where every reduction is a built-in one (elementwise or a sum over
        features); else ignored.

    Returns:
      One value per reduction: ``sum_b phi(G_b)``; `Moments` ``(mean, sum_b (G_b-mean)^2)``;
      ``[B]`` squared norms.
    """
    reductions = list(reductions)
    means = list(means) if means is not None else [None] * len(reductions)
    if features is not None and all(
        S.extension(r) is None and isinstance(r, (S.PhiSum, S.Centered, S.SqNorms))
        for r in reductions
    ):
        return _feature_blocks(features, B, reductions, tile, means, tuple(shape), dtype)
    tile = int(max(1, min(tile, B)))
    nfull, rem = divmod(B, tile)
    sq = [  # per-example values ([B]): written in place, not summed
        isinstance(r, S.SqNorms) or getattr(S.extension(r), "per_example", False)
        for r in reductions
    ]

    def add(acc, b0, size):
        vals = _tile_values(make(b0, size).astype(dtype), reductions, means)
        return [
            jax.lax.dynamic_update_slice_in_dim(a, v, b0, 0) if s else jax.tree.map(jnp.add, a, v)
            for a, v, s in zip(acc, vals, sq)
        ]

    # The first tile is peeled: the accumulators take its type (inside shard_map,
    # the manual axes the values vary over), which the loop carry must keep.
    first = _tile_values(make(0, tile).astype(dtype), reductions, means)
    acc = [
        jax.lax.dynamic_update_slice_in_dim(
            compat.make_varying(jnp.zeros((B,), dtype), compat.vma_of(v)), v, 0, 0
        )
        if s
        else v
        for v, s in zip(first, sq)
    ]
    if nfull > 1:
        acc = jax.lax.fori_loop(1, nfull, lambda k, acc: add(acc, k * tile, tile), acc)
    if rem:
        acc = add(acc, nfull * tile, rem)
    out = []
    for r, a, m in zip(reductions, acc, means):
        out.append(S.Moments(m, a) if isinstance(r, S.Centered) else a)
    return out


def _feature_blocks(features, B, reductions, tile, means, shape, dtype):
    """`reduce_tiles` with an outer loop over blocks of one axis of ``G``."""
    axis, fs, make_f = features
    n = shape[axis]
    fs = int(max(1, min(fs, n)))
    nf, rem = divmod(n, fs)
    per_ex = [isinstance(r, S.SqNorms) for r in reductions]

    def block(f0, size):
        sub = shape[:axis] + (size,) + shape[axis + 1 :]
        ms = [
            None if m is None else jax.lax.dynamic_slice_in_dim(m, f0, size, axis)
            for m in means
        ]
        vals = reduce_tiles(
            lambda b0, bs: make_f(b0, bs, f0, size), B, reductions, tile,
            means=ms, shape=sub, dtype=dtype,
        )
        return [v.m2 if isinstance(v, S.Moments) else v for v in vals]

    def put(acc, vals, f0):
        return [
            a + v if p else jax.lax.dynamic_update_slice_in_dim(a, v, f0, axis)
            for a, v, p in zip(acc, vals, per_ex)
        ]

    # first block peeled: the accumulators take its type (see reduce_tiles)
    first = block(0, fs)
    acc = [
        v if p else jax.lax.dynamic_update_slice_in_dim(
            compat.make_varying(jnp.zeros(shape, v.dtype), compat.vma_of(v)), v, 0, axis
        )
        for v, p in zip(first, per_ex)
    ]
    if nf > 1:
        acc = jax.lax.fori_loop(1, nf, lambda k, acc: put(acc, block(k * fs, fs), k * fs), acc)
    if rem:
        acc = put(acc, block(nf * fs, rem), nf * fs)
    return [
        S.Moments(m, a) if isinstance(r, S.Centered) else a
        for r, a, m in zip(reductions, acc, means)
    ]


def sum_tiles(f, B: int, tile: int):
    """``sum`` over tiles of examples of ``f(b0, size)`` (a pytree; ``size`` static)."""
    tile = int(max(1, min(tile, B)))
    nfull, rem = divmod(B, tile)
    acc = f(0, tile)  # peeled: the accumulator takes its type (see reduce_tiles)
    if nfull > 1:
        acc = jax.lax.fori_loop(
            1, nfull, lambda k, acc: jax.tree.map(jnp.add, acc, f(k * tile, tile)), acc
        )
    if rem:
        acc = jax.tree.map(jnp.add, acc, f(nfull * tile, rem))
    return acc


def bytes_of(shape, dtype) -> int:
    return int(math.prod(shape)) * jnp.dtype(dtype).itemsize
