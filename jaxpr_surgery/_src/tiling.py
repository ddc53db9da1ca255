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
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jaxpr_surgery._src import compat
from jaxpr_surgery._src import stats as S

DEFAULT_MEMORY_BUDGET_BYTES = 64 << 20  # per tile of materialised per-example gradients


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


def reduce_tiles(make, B: int, reductions, tile: int, *, means=None, shape, dtype):
    """Reductions of ``G [B, *shape]`` with ``G[b0:b0+size] = make(b0, size)``.

    Args:
      make: ``(b0, size) -> [size, *shape]`` (``b0`` may be traced; ``size`` static).
      reductions: `PhiSum` (any phi), `Centered` (two-pass: ``means`` holds the
        exact mean for it, computed beforehand by a contraction) or `SqNorms`.
      tile: examples per tile.
      shape, dtype: of one example's ``G``.

    Returns:
      One value per reduction: ``sum_b phi(G_b)``; `Moments` ``(mean, sum_b (G_b-mean)^2)``;
      ``[B]`` squared norms.
    """
    reductions = list(reductions)
    means = list(means) if means is not None else [None] * len(reductions)
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
