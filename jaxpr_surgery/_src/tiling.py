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
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxpr_surgery._src import compat, fused
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
    per_ex = prefer_per_example() and any(k.token_matmuls() for k in kernels)
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


def _tile_values(G, reductions, centres):
    """Per-tile contributions: ``G`` is ``[size, *shape]``. A centred sum is taken
    against its centre: the exact mean (two-pass: one array) or a shift ``K`` (one
    pass: the pair ``sum (G - K)``, ``sum (G - K)^2``); the rest as for any
    materialised ``G``."""
    from jaxpr_surgery._src.sites.base import reduce_materialised

    out = []
    for r, c in zip(reductions, centres):
        if not isinstance(r, S.Centered):
            out.append(reduce_materialised(G, r))
        elif c.exact:
            out.append(jnp.sum(jnp.square(G - c.value), axis=0))
        else:
            d = G - c.value
            out.append((jnp.sum(d, axis=0), jnp.sum(jnp.square(d), axis=0)))
    return out


class _Centre(NamedTuple):
    value: jax.Array
    exact: bool  # the exact mean (two-pass) or a shift (one pass)


# One-pass centred sums: the most rounding is amplified against the two-pass
# (re-centring on the running mean once the examples to come would exceed it).
MAX_SHIFT_AMPLIFICATION = 32


def reduce_tiles(
    make, B: int, reductions, tile: int, *, means=None, shape, dtype, features=None,
    carry=None, factors=None,
):
    """Reductions of ``G [B, *shape]`` with ``G[b0:b0+size] = make(b0, size)``.

    Args:
      make: ``(b0, size) -> [size, *shape]`` (``b0`` may be traced; ``size`` static).
      reductions: `PhiSum` (any phi), `Centered` or `SqNorms`.
      tile: examples per tile.
      means: per reduction, None or (for a `Centered`) the exact mean, computed
        beforehand: then the centred sum is two-pass. Without it, one pass with no
        contraction over the batch: `stats.Shifted` sums ``S1``, ``S2`` of ``G_b - K``
        and of its square, ``K`` the first tile's mean (its exact two-pass moments),
        so ``mean = K + S1/n`` and ``M2 = S2 - S1^2/n``. The subtraction that matters
        happens first, on the raw values, so rounding does not grow with the mean's
        size against the spread (unlike ``E[g^2] - E[g]^2``); the final one cancels at
        most ``1 + m/n_K`` fold where ``K`` is the mean of ``n_K`` examples and ``m``
        came after it (about 2 for a typical coordinate). Groups of tiles are cut so
        that this stays within `MAX_SHIFT_AMPLIFICATION`: one group for up to 32
        tiles, then each group first re-centres on the running mean (`stats.recentre`).
      shape, dtype: of one example's ``G``.
      features: optional ``(axis, size, make_f)`` (`feature_tile`'s block and
        ``make_f(b0, size, f0, fs) -> G[b0:b0+size]`` restricted to ``f0:f0+fs`` on
        ``axis``): blocks of features in an outer loop, examples in the inner one.
        Used where every reduction is a built-in one (elementwise or a sum over
        features); else ignored.
      carry: optional `stats.Carry` (values aligned with ``reductions``): the
        running values of the ``carry.n`` examples of earlier chunks (which must be at
        least ``B`` unless zero). A carried sum of ``phi`` starts from its running
        value; a carried one-pass centred sum continues its `stats.Shifted` sums
        against their shift (the first tile's mean when ``carry.n`` is 0), so no
        merge of the chunk's own moments is needed (a pass over every accumulator per
        chunk); api.py re-centres between chunks to keep the shift's bound. Only
        `stats.carries` reductions without a given mean may be carried.
      factors: optional ``(X [B, K, N, C], DY [B, K, N, F])`` with ``G_b = X_b^T DY_b``
        (``shape`` ``(K, C, F)``), where the site can give them: sums of the built-in
        ``phi`` and one-pass centred sums then take the fused kernel where it is
        selected (fused.py), which never forms a tile of ``G``.

    Returns:
      One value per reduction: ``sum_b phi(G_b)``; `Moments` ``(mean, sum_b (G_b-mean)^2)``;
      ``[B]`` squared norms. Carried ones: over the ``carry.n + B`` examples.
    """
    if any(isinstance(r, S.Norms) for r in reductions):  # feature blocks add squares
        raise AssertionError("reduce_tiles: norms come from SqNorms (sites.base.direct_norms)")
    reductions = list(reductions)
    means = list(means) if means is not None else [None] * len(reductions)
    inits = list(carry.values) if carry is not None else [None] * len(reductions)
    n0 = carry.n if carry is not None else 0
    for r, m, i in zip(reductions, means, inits):
        if i is not None and not (S.carries(r) and m is None):
            raise AssertionError(f"reduce_tiles: {r!r} cannot be carried here")
    if factors is not None:
        # built-in sums and one-pass centred moments by the fused kernel, where selected
        take = [i for i, r in enumerate(reductions) if fused.builtin(r) and means[i] is None]
        if take and fused.applies([reductions[i] for i in take], dtype, factors):
            vals = fused.phi_sums(*factors, [reductions[i] for i in take])
            out = {
                i: v if inits[i] is None
                else S.merge_shifted(inits[i], n0, v, B) if isinstance(v, S.Moments)
                else inits[i] + v
                for i, v in zip(take, vals)
            }
            rest = [i for i in range(len(reductions)) if i not in out]
            if rest:
                more = reduce_tiles(
                    make, B, [reductions[i] for i in rest], tile,
                    means=[means[i] for i in rest], shape=shape, dtype=dtype,
                    features=features,
                    carry=None if carry is None else S.Carry([inits[i] for i in rest], n0),
                )
                out.update(zip(rest, more))
            return [out[i] for i in range(len(reductions))]
    if features is not None and all(
        S.extension(r) is None and isinstance(r, (S.PhiSum, S.Centered, S.SqNorms))
        for r in reductions
    ):
        return _feature_blocks(
            features, B, reductions, tile, means, tuple(shape), dtype, inits, n0
        )
    one = [isinstance(r, S.Centered) and m is None for r, m in zip(reductions, means)]
    plain = [S.is_plain_sum(r) for r in reductions]
    if any(one) and any(plain):  # the plain sum is B * mean: not a second pass over G
        keep = [i for i, p in enumerate(plain) if not p]
        vals = reduce_tiles(
            make, B, [reductions[i] for i in keep], tile, means=[means[i] for i in keep],
            shape=shape, dtype=dtype,
            carry=None if carry is None else S.Carry([inits[i] for i in keep], n0),
        )
        ci = next(i for i in keep if one[i])
        c = vals[keep.index(ci)]
        carried = inits[ci] is not None  # c's mean is over the earlier chunks' examples too
        if any((inits[i] is not None) != carried for i, p in enumerate(plain) if p):
            raise AssertionError("reduce_tiles: a plain sum and its centred sum carry alike")
        if carried:  # Shifted: n * mean = n * shift + s1
            total = jnp.asarray(n0 + B, c.shift.dtype) * c.shift + c.s1
        else:
            total = B * c.mean
        out = dict(zip(keep, vals))
        return [out[i] if i in out else total for i in range(len(reductions))]
    tile = int(max(1, min(tile, B)))
    nfull, rem = divmod(B, tile)
    sq = [  # per-example values ([B]): written in place, not summed
        isinstance(r, S.SqNorms) or getattr(S.extension(r), "per_example", False)
        for r in reductions
    ]
    exact = [_Centre(m, True) if isinstance(r, S.Centered) else None
             for r, m in zip(reductions, means)]

    # The first tile is peeled: the accumulators take its type (inside shard_map,
    # the manual axes the values vary over), which the loop carry must keep. One-pass
    # centred sums are `Shifted` sums against the first tile's mean (its exact
    # two-pass moments), or continue carried ones against their shift.
    G0 = make(0, tile).astype(dtype)
    mu0 = jnp.mean(G0, axis=0) if tile > 1 else G0[0]
    shifts = [
        (jnp.where(jnp.asarray(n0) > 0, i.shift, mu0) if i is not None else mu0) if o else None
        for o, i in zip(one, inits)
    ]
    first = _tile_values(
        G0, reductions, [_Centre(k, False) if o else c for o, k, c in zip(one, shifts, exact)]
    )
    acc = [
        jax.lax.dynamic_update_slice_in_dim(
            compat.make_varying(jnp.zeros((B,), dtype), compat.vma_of(v)), v, 0, 0
        )
        if s
        else v if i is None and not o
        else S.Shifted(k, *v) if i is None
        else S.Shifted(k, i.s1 + v[0], i.s2 + v[1]) if o
        else jax.tree.map(jnp.add, i, v)  # a carried sum of phi
        for v, s, o, k, i in zip(first, sq, one, shifts, inits)
    ]

    def group(acc, b0, ntiles, size, recentre):
        """Tiles ``b0 + k*size`` for ``k < ntiles`` (``b0`` static); ``recentre``: one-pass
        centred sums first take the running mean of the examples before ``b0`` as their
        shift."""
        if recentre:
            acc = [S.recentre(a, n0 + b0) if o else a for a, o in zip(acc, one)]
        centres = [_Centre(a.shift, False) if o else c for a, o, c in zip(acc, one, exact)]

        def body(k, inner):
            begin = b0 + k * size
            vals = _tile_values(make(begin, size).astype(dtype), reductions, centres)
            return [
                jax.lax.dynamic_update_slice_in_dim(a, v, begin, 0) if s
                else S.Shifted(a.shift, a.s1 + v[0], a.s2 + v[1]) if o
                else jax.tree.map(jnp.add, a, v)
                for a, v, s, o in zip(inner, vals, sq, one)
            ]

        if ntiles == 1:
            return body(0, acc)
        return jax.lax.fori_loop(0, ntiles, body, acc)

    # Groups of tiles, each against one shift: the first against the first tile's
    # mean (or a carried shift, which api.py keeps able to take this whole call); each
    # later one re-centres first and takes at most (MAX_SHIFT_AMPLIFICATION - 1) times
    # the examples its shift is the mean of (a single group without centred sums).
    limit = MAX_SHIFT_AMPLIFICATION - 1
    n_shift, since, t = tile, 0, 1  # examples the shift is the mean of; after it; tiles
    while t < nfull or rem:
        size, left = (tile, nfull - t) if t < nfull else (rem, 1)
        k = left if not any(one) else min(left, (limit * n_shift - since) // size)
        recentre = k == 0
        if recentre:
            n_shift, since = t * tile, 0
            k = left if not any(one) else min(left, max(1, limit * n_shift // size))
        acc = group(acc, t * tile, k, size, recentre)
        since += k * size
        if t < nfull:
            t += k
        else:
            rem = 0
    return [
        (a if i is not None else S.shifted_moments(a, B)) if o
        else S.Moments(c.value, a) if c is not None
        else a
        for a, o, c, i in zip(acc, one, exact, inits)
    ]


def _feature_blocks(features, B, reductions, tile, means, shape, dtype, inits, n0):
    """`reduce_tiles` with an outer loop over blocks of one axis of ``G``."""
    axis, fs, make_f = features
    n = shape[axis]
    fs = int(max(1, min(fs, n)))
    nf, rem = divmod(n, fs)
    per_ex = [isinstance(r, S.SqNorms) for r in reductions]
    carried = any(i is not None for i in inits)

    def block(f0, size):
        sub = shape[:axis] + (size,) + shape[axis + 1 :]

        def cut(m):
            return None if m is None else jax.tree.map(
                lambda x: jax.lax.dynamic_slice_in_dim(x, f0, size, axis), m
            )

        return reduce_tiles(
            lambda b0, bs: make_f(b0, bs, f0, size), B, reductions, tile,
            means=[cut(m) for m in means], shape=sub, dtype=dtype,
            carry=S.Carry([cut(i) for i in inits], n0) if carried else None,
        )

    def put(acc, vals, f0):
        return [
            a + v if p else jax.tree.map(
                lambda a, v: jax.lax.dynamic_update_slice_in_dim(a, v, f0, axis), a, v
            )
            for a, v, p in zip(acc, vals, per_ex)
        ]

    def whole(v):  # the first block's value in an accumulator of the whole shape
        z = compat.make_varying(jnp.zeros(shape, v.dtype), compat.vma_of(v))
        return jax.lax.dynamic_update_slice_in_dim(z, v, 0, axis)

    # first block peeled: the accumulators take its type (see reduce_tiles)
    acc = [v if p else jax.tree.map(whole, v) for v, p in zip(block(0, fs), per_ex)]
    if nf > 1:
        acc = jax.lax.fori_loop(1, nf, lambda k, acc: put(acc, block(k * fs, fs), k * fs), acc)
    if rem:
        acc = put(acc, block(nf * fs, rem), nf * fs)
    return acc


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
