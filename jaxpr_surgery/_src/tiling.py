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
tied table), sites that can produce a block of it (``make_f(b0, size, cut)``, cuts.py)
are also tiled over features: an outer loop over blocks of one axis, an inner
loop over examples, so the block and its accumulators stay in cache (on CPU)
or within the budget (elsewhere) while every reduction reads it.
"""

from __future__ import annotations

import contextlib
import functools
import math

import jax
import jax.numpy as jnp

from jaxpr_surgery._src import compat, cuts, fused
from jaxpr_surgery._src import stats as S

DEFAULT_MEMORY_BUDGET_BYTES = 64 << 20  # per tile of materialised per-example gradients
CACHE_TILE_BYTES = 2 << 20  # CPU: one example's block of G, kept cache-sized
# ... but under a batch split by device (devices.py) one example's G up to this size is
# taken whole. Each block's finished values are combined across the devices at once (a
# collective per block), and where XLA runs a layer's backward pass split over the
# features of a weight it shards, the block loop gathers each example's input again in
# every block. On the scan-over-layers stack of shard_check.py at d 1024, T 256, B 16
# under FSDP (8 devices): the variance's collective bytes 1.75x -> 1.28x grad's,
# temporary memory 0.96x -> 1.00x. Larger ones keep cache-sized blocks (blocks of this
# size, a vocabulary table's, took the kurtosis under tensor parallelism, four parts per
# device, from 0.96x to 1.52x grad's memory), and so do reductions with many arrays per
# block (`Reduction.blocks_under_split`: the kurtosis).
SPLIT_TILE_BYTES = 16 << 20
MIN_FEATURE_TILE_BYTES = 256 << 10  # smaller blocks cost more in loop overhead than they save
# Feature blocks: a count of blocks that divides the axis is preferred, up to this many
# times the count the budget asks for (no remainder block to compile; 1: off)
DIVISOR_BLOCKS_FACTOR = 2
# An example recomputed alone (its ghost norm overflowed or cancelled: norms.py) forms its
# ``G`` in blocks of at most this share of the budget: the loop over such examples is
# compiled (and its buffers allocated) whether or not it runs, beside the backward pass's
# live values, once for each device's part of the batch, and XLA may hold several copies
# of a block (the product, its magnitudes, its scaled squares).
RECOMPUTE_BUDGET_SHARE = 8
# CPU, a tile of one example: where a loop's reductions are several plain sums of a
# function of ``G`` (`Reduction.additive`: the mean beside E[g²]), each step takes up to
# this many examples, each its own 2-D product, their terms summed, and updates the sums
# kept in one array (`additive_loop`) ...
ADDITIVE_UNROLL = 4
# ... while those examples' ``G`` together stay within this size: four cache-sized
# feature blocks (`CACHE_TILE_BYTES`; perf_check's short transformer, mean and E[g²] at
# jax 0.12: 1.22x E[g²] alone with 2 MiB, 1.19x with 4 MiB, 1.14x with 8 MiB).
ADDITIVE_UNROLL_BYTES = 8 << 20


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


# One example's ``G = X^T DY`` over at least this many tokens costs 512 FLOPs or more per
# element it writes: compute-bound, so reductions that read each block once take it whole
# (within the budget) rather than in cache-sized blocks. Measured on CPU: no faster in
# blocks at T=256 (d=768), 20% faster at T=32 (the short transformer of tokens_check).
WHOLE_G_MIN_TOKENS = 256


def cache_sized(cache_blocks, tokens) -> bool:
    """Whether one example's ``G``, a product over ``tokens`` tokens, is cut into
    cache-sized blocks on CPU (`feature_tile`): where it is cheap to produce (fewer than
    `WHOLE_G_MIN_TOKENS` tokens), or where the call has a reduction that passes over each
    block several times (``cache_blocks``: `Reduction.cache_blocks`, centred moments)."""
    return cache_blocks or tokens < WHOLE_G_MIN_TOKENS


def feature_tile(
    shape, dtype, axes, budget, cache=True, whole_under_split=True
) -> tuple[int, int] | None:
    """``(axis, size)``: blocks of ``size`` along ``axis`` (the longest of ``axes``) for
    one example's ``G`` of ``shape``, or None where it is small enough whole.

    On CPU, with ``cache`` (`cache_sized`), blocks are about `CACHE_TILE_BYTES` (or the
    budget, if smaller; under a batch split by device, a ``G`` of at most
    `SPLIT_TILE_BYTES` whole, unless not ``whole_under_split``); elsewhere one
    example is split only where it alone exceeds the budget. (A long sequence's products
    read once ran no faster in cache-sized blocks, and every block loop is one more loop
    for XLA to compile: GPT-2 small's `second_moment` 1.6 s -> 1.3 s.) Never below
    `MIN_FEATURE_TILE_BYTES`.
    """
    axes = [a for a in axes if shape[a] > 1]
    if not axes:
        return None
    budget = DEFAULT_MEMORY_BUDGET_BYTES if budget is None else int(budget)
    target = min(CACHE_TILE_BYTES, budget) if cache and prefer_per_example() else budget
    target = max(target, MIN_FEATURE_TILE_BYTES)
    total = bytes_of(shape, dtype)
    if total <= target or (whole_under_split and cuts.split_count() > 1
                           and total <= min(SPLIT_TILE_BYTES, budget)):
        return None
    axis = max(axes, key=lambda a: shape[a])
    n = int(shape[axis])
    blocks = min(n, -(-total // target))
    # A count of blocks that divides the axis, if one is near (`DIVISOR_BLOCKS_FACTOR`,
    # no block below the minimum size): no remainder block, whose program XLA would
    # compile beside the loop's.
    row = total // n
    for b in range(blocks, min(n, DIVISOR_BLOCKS_FACTOR * blocks) + 1):
        if n % b == 0 and (n // b) * row >= MIN_FEATURE_TILE_BYTES:
            blocks = b
            break
    size = -(-n // blocks)
    return (axis, size) if size < n else None


def recompute_tile(shape, dtype, axes, budget) -> tuple[int, int, int] | None:
    """``(axis, size, n)``: blocks for one example's ``G`` of ``shape`` formed alone
    (`RECOMPUTE_BUDGET_SHARE` of the budget each, ``n`` the axis' length), or None where
    it is small enough whole."""
    budget = DEFAULT_MEMORY_BUDGET_BYTES if budget is None else int(budget)
    ft = feature_tile(shape, dtype, axes, budget // RECOMPUTE_BUDGET_SHARE, cache=False)
    return ft and (ft[0], ft[1], int(shape[ft[0]]))


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


def reduce_tiles(
    make, B: int, reductions, tile: int, *, shape, dtype, features=None, carry=None,
    factors=None, combine=None,
):
    """Reductions of ``G [B, *shape]`` with ``G[b0:b0+size] = make(b0, size)``.

    Every reduction reads each tile while it is hot through its own protocol
    (reductions.py): per-example ones write their entries in place, the others
    accumulate (`Reduction.add_examples`; a one-pass centred sum keeps `stats.Shifted`
    sums against the first tile's mean, re-centred by groups of tiles within
    `stats.MAX_SHIFT_AMPLIFICATION`) and are finished at the end.

    Args:
      make: ``(b0, size) -> [size, *shape]`` (``b0`` may be traced; ``size`` static).
      reductions: any `stats.Reduction` whose `from_examples` reads ``G``.
      tile: examples per tile.
      shape, dtype: of one example's ``G``.
      features: optional ``(axis, size, make_f)`` (`feature_tile`'s block and
        ``make_f(b0, size, cut) -> G[b0:b0+size]`` restricted to the block ``cut`` on
        ``axis``, cuts.py): blocks of features in an outer loop, examples in the inner one.
        Used where every reduction has `Reduction.feature_blocks`; else ignored.
      carry: optional `stats.Carry` (values aligned with ``reductions``, None for one
        that is not carried): the running accumulators of the ``carry.n`` examples of
        earlier chunks. They continue here (no merge of the chunk's own value, a
        pass over every accumulator per chunk) and come back unfinished; chunking.py
        re-centres between chunks to keep the shift's bound. Only `Reduction.carries`
        reductions may be carried.
      factors: optional ``(X [B, K, N, C], DY [B, K, N, F])`` with ``G_b = X_b^T DY_b``
        (``shape`` ``(K, C, F)``), where the site can give them: sums of the built-in
        ``phi`` and one-pass centred sums then take the fused kernel where it is
        selected (fused.py), which never forms a tile of ``G``.
      combine: optional, with ``features``: the reductions' values of a leaf gathered
        over the devices (hand-written FSDP: `gathers.AtSite`) combined block by block
        into accumulators shaped like the device's shard (`_feature_blocks`).

    Returns:
      One value per reduction (`Reduction.finish`ed), or for a carried one its
      accumulator over the ``carry.n + B`` examples.
    """
    reductions = list(reductions)
    inits = list(carry.values) if carry is not None else [None] * len(reductions)
    n0 = carry.n if carry is not None else 0
    for r, i in zip(reductions, inits):
        if i is not None and not r.carries:
            raise AssertionError(f"reduce_tiles: {r!r} cannot be carried")
    if factors is not None:
        out = _fused(make, B, reductions, tile, shape, dtype, features, inits, n0, factors)
        if out is not None:
            return out
    nd = cuts.split_count()
    if features is not None and all(r.feature_blocks for r in reductions) and (
            nd == 1 or cuts.strided_count(shape[features[0]], features[1], nd)):
        # (each block's values combined by its own `reduce_tiles`: `_shared`)
        return _feature_blocks(features, B, reductions, tile, tuple(shape), dtype, inits, n0,
                               combine)
    if B == 1 and all(i is None for i in inits):
        # one example (a chunk of one, on CPU): its values, no loop and no accumulator
        G = make(0, 1).astype(dtype)
        return _shared(reductions, inits, B, [r.from_examples(G) for r in reductions])
    derived = _derived_sums(reductions, inits)
    if derived:
        vals = _with_derived_sums(make, B, reductions, tile, shape, dtype, inits, n0, derived)
    else:
        vals = _tile_loop(make, B, reductions, tile, shape, dtype, inits, n0)
    return _shared(reductions, inits, B, vals)


def shared_values(reductions, values, B):
    """A site's finished values (dicts keyed alike: ``{key: reduction}``, ``{key: value}``)
    combined across a batch split by device at once (`_shared`): the values of a layer
    inside a scan then stack one for every part, not one per part. A value combined
    already (by its tile loop) is unchanged: a share's share is itself."""
    if not cuts.shares():
        return values
    keys = [k for k, r in reductions.items() if k in values]
    vals = _shared([reductions[k] for k in keys], [None] * len(keys), B,
                   [values[k] for k in keys])
    return {**values, **dict(zip(keys, vals))}


def _shared(reductions, inits, B, vals):
    """Under a batch split by device (devices.py) the finished values combined across
    the split at once, as each part's share (`Reduction.combined_share`): a block loop
    then holds one accumulator for every part, and XLA reduces each block where it is
    finished, as grad reduces each layer's gradient, instead of holding every part's
    values of every leaf to the end. Carried accumulators and per-example values stay
    the part's own."""
    if not cuts.shares():
        return vals
    nd, axis = cuts.split_count(), cuts.split_axis()
    out = []
    for r, i, v in zip(reductions, inits, vals):
        s = None if i is not None or r.per_example else S.combined_share(r, v, B, axis, nd)
        out.append(v if s is None else s)
    return out


def _fused(make, B, reductions, tile, shape, dtype, features, inits, n0, factors):
    """The fused kernel's values (fused.py) of the reductions it takes, where it is
    selected, the rest by the tile loop; None where it takes none."""
    take = [i for i, r in enumerate(reductions) if fused.builtin(r)]
    if not take or not fused.applies([reductions[i] for i in take], dtype, factors):
        return None
    vals = _shared([reductions[i] for i in take], [inits[i] for i in take], B,
                   fused.phi_sums(*factors, [reductions[i] for i in take]))
    out = {
        i: v if inits[i] is None else reductions[i].accumulate(inits[i], n0, v, B)
        for i, v in zip(take, vals)
    }
    rest = [i for i in range(len(reductions)) if i not in out]
    if rest:
        more = reduce_tiles(
            make, B, [reductions[i] for i in rest], tile, shape=shape, dtype=dtype,
            features=features,
            carry=None if all(inits[i] is None for i in rest)
            else S.Carry([inits[i] for i in rest], n0),
        )
        out.update(zip(rest, more))
    return [out[i] for i in range(len(reductions))]


def _derived_sums(reductions, inits):
    """``{plain sum's index: index of a reduction whose accumulator knows the sum}``
    (`Reduction.knows_total`, carried alike): the plain sum is then no second
    consumer of each tile."""
    providers = [i for i, r in enumerate(reductions) if r.knows_total]
    out = {}
    for i, r in enumerate(reductions):
        if not r.linear:
            continue
        same = [j for j in providers if (inits[j] is None) == (inits[i] is None)]
        if same:
            out[i] = same[0]
    return out


def _with_derived_sums(make, B, reductions, tile, shape, dtype, inits, n0, derived):
    keep = [i for i in range(len(reductions)) if i not in derived]
    accs = _tile_loop(
        make, B, [reductions[i] for i in keep], tile, shape, dtype, [inits[i] for i in keep],
        n0, finish=False,
    )
    acc = dict(zip(keep, accs))
    out = {}
    for i in range(len(reductions)):
        j = derived.get(i)
        if j is not None:
            out[i] = reductions[j].total(acc[j], n0 + B)
        elif inits[i] is None:
            out[i] = reductions[i].finish(acc[i], n0 + B)
        else:
            out[i] = acc[i]
    return [out[i] for i in range(len(reductions))]


def _first_tile(reductions, G0, B, inits, n0):
    """The accumulators after the first tile (peeled: they take its type, inside
    shard_map the manual axes the values vary over, which the loop carry must keep);
    per-example values in a buffer of all ``B`` examples."""
    acc = []
    for r, i in zip(reductions, inits):
        if r.per_example:
            v = r.from_examples(G0)
            buf = jnp.zeros((B,) + tuple(v.shape[1:]), v.dtype)
            acc.append(compat.update_at(
                compat.make_varying(buf, compat.vma_of(v)), v, 0, 0))
        else:
            acc.append(r.start_examples(i, n0, G0))
    return acc


def _empty_accumulators(make, reductions, tile, shape, dtype, B, inits):
    """The accumulators before the first tile: a carried one, else `Reduction.empty`
    (per-example values: a buffer of all ``B`` examples), varying (inside shard_map)
    like a tile's ``G``. Every tile then starts from them alike (`start_examples`
    with its count: the first one, at count 0, takes its shift). (A tile is traced
    for its type only under a named axis: elsewhere it varies over none.)"""
    if compat.named_axes_bound():
        G = jax.eval_shape(lambda: make(0, tile).astype(dtype))
    else:
        G = jax.ShapeDtypeStruct((tile,) + tuple(shape), dtype)
    axes = compat.vma_of(G)
    acc = []
    for r, i in zip(reductions, inits):
        if r.per_example:
            v = jax.eval_shape(r.from_examples, G)
            a = jnp.zeros((B,) + tuple(v.shape[1:]), v.dtype)
        else:
            a = r.empty(tuple(shape), dtype) if i is None else i
        acc.append(jax.tree.map(lambda x: compat.make_varying(x, axes), a))
    return acc


def additive_unroll(B, reductions, tile, shape, dtype) -> int:
    """Examples per step of `additive_loop` for these reductions (1: the plain tile loop):
    on CPU, tiles of one example, and two or more reductions, every one `additive`."""
    if tile != 1 or len(reductions) < 2 or not prefer_per_example():
        return 1
    if not all(S.is_additive(r) for r in reductions):
        return 1
    return int(max(1, min(ADDITIVE_UNROLL, B, ADDITIVE_UNROLL_BYTES // bytes_of(shape, dtype))))


def additive_loop(make, B, reductions, k, shape, dtype, inits, n0):
    """The sums of `additive` ``reductions`` of ``G [B, *shape]``, ``k`` examples a step
    (`additive_unroll`), in ONE array ``[*shape, R]``: each step forms its examples' ``G``
    one at a time (2-D products, as the tile loop on CPU), sums each reduction's terms
    over them, and adds all of them to the stacked sums in one elementwise kernel (a
    select over the last axis). The plain loop updates each sum in a kernel of its own
    that reads ``G`` again and writes its own array: on CPU (a 256 x 1024 weight, 32
    tokens, 32 examples) the mean beside E[g²] cost +28% over E[g²] alone at jax 0.12,
    +3% this way; on perf_check's short transformer, mean and E[g²] 1.24x -> 1.16x
    E[g²] alone at jax 0.12, 1.18x -> 1.07x at jax 0.10. The sums start from zeros;
    carried ones (``inits``, of ``n0`` examples) are added as the stack is taken apart,
    in the kernel that does it (stacking them first cost a copy of each per chunk)."""
    (z,) = _empty_accumulators(make, reductions[:1], 1, shape, dtype, B, [None])
    last = len(shape)
    acc = _late(compat.make_varying(jnp.zeros(z.shape + (len(reductions),), z.dtype),
                                    compat.vma_of(z)))

    def step(b0, a, size):
        Gs = [make(b0 + j, 1).astype(dtype) for j in range(size)]
        terms = [functools.reduce(jnp.add, [r.from_examples(G) for G in Gs])
                 for r in reductions]
        pick = jax.lax.broadcasted_iota(jnp.int32, a.shape, last)
        add = terms[-1][..., None].astype(a.dtype)
        for i in range(len(terms) - 2, -1, -1):
            add = jnp.where(pick == i, terms[i][..., None].astype(a.dtype), add)
        return a + add

    nfull, rem = divmod(B, k)
    if nfull > 1:
        acc = jax.lax.fori_loop(0, nfull, lambda i, a: step(i * k, a, k), acc)
    elif nfull:
        acc = step(0, acc, k)
    if rem:
        acc = step(nfull * k, acc, rem)
    axes = compat.vma_of(z)  # (inside shard_map: the carried sums typed like the tiles')
    return [acc[..., i] if init is None
            else r.accumulate(compat.make_varying(init, axes), n0, acc[..., i], B)
            for i, (r, init) in enumerate(zip(reductions, inits))]


def _tile_loop(make, B, reductions, tile, shape, dtype, inits, n0, finish=True):
    """The tile loop: accumulators (finished where not carried, with ``finish``)."""
    tile = int(max(1, min(tile, B)))
    k = additive_unroll(B, reductions, tile, shape, dtype)
    if k > 1:
        acc = additive_loop(make, B, reductions, k, shape, dtype, inits, n0)
        return _finished(reductions, acc, inits, n0 + B) if finish else acc
    nfull, rem = divmod(B, tile)
    bounded = [r.shift_bounded for r in reductions]
    if nfull > 1 and all(r.per_example or r.carries for r in reductions):
        # every tile in the loop, from empty accumulators typed like a tile's values
        # (abstract: nothing computed twice), so XLA compiles the tile's program once
        acc = _late(_empty_accumulators(make, reductions, tile, shape, dtype, B, inits))
        t, since = 0, -tile  # (the first tile's own examples make its shift)
    else:  # the first tile peeled: the accumulators take its type
        acc = _first_tile(reductions, make(0, tile).astype(dtype), B, inits, n0)
        t, since = 1, 0

    def group(acc, b0, ntiles, size, recentre):
        """Tiles ``b0 + k*size`` for ``k < ntiles`` (``b0`` static); ``recentre``:
        shift-bounded accumulators first re-centre on the examples before ``b0``."""
        if recentre:
            acc = [r.recentre(a, n0 + b0) if o else a
                   for r, a, o in zip(reductions, acc, bounded)]

        def body(k, inner):
            begin = b0 + k * size
            G = make(begin, size).astype(dtype)
            return [
                compat.update_at(a, r.from_examples(G), begin, 0)
                if r.per_example else r.start_examples(a, n0 + begin, G)
                for r, a in zip(reductions, inner)
            ]

        if ntiles == 1:
            return body(0, acc)
        return jax.lax.fori_loop(0, ntiles, body, acc)

    # Groups of tiles, each against one shift: the first against the first tile's
    # mean (or a carried shift, which chunking.py keeps able to take this whole call);
    # each later one re-centres first and takes at most (MAX_SHIFT_AMPLIFICATION - 1)
    # times the examples its shift is the mean of (one group without such sums).
    limit = S.MAX_SHIFT_AMPLIFICATION - 1
    n_shift = tile  # examples the shift is the mean of (`since`: after it; `t`: tiles)
    while t < nfull or rem:
        size, left = (tile, nfull - t) if t < nfull else (rem, 1)
        k = left if not any(bounded) else min(left, (limit * n_shift - since) // size)
        recentre = k == 0
        if recentre:
            n_shift, since = t * tile, 0
            k = left if not any(bounded) else min(left, max(1, limit * n_shift // size))
        acc = group(acc, t * tile, k, size, recentre)
        since += k * size
        if t < nfull:
            t += k
        else:
            rem = 0
    return _finished(reductions, acc, inits, n0 + B) if finish else acc


def _finished(reductions, acc, inits, n):
    """The loop's accumulators of ``n`` examples finished, but carried ones and
    per-example values."""
    return [r.finish(a, n) if i is None and not r.per_example else a
            for r, a, i in zip(reductions, acc, inits)]


def _feature_blocks(features, B, reductions, tile, shape, dtype, inits, n0, combine=None):
    """`reduce_tiles` with an outer loop over blocks of one axis of ``G``: each
    reduction restricted to the block (`Reduction.block`), its values put in place
    (``"place"``) or added (``"add"``, per-example sums over the features). Contiguous
    blocks, or strided ones (cuts.py) under a batch split by device (`split_over`).

    ``combine`` (a leaf gathered over the devices, `gathers.AtSite`): the values it
    takes are combined across the devices block by block (the gather's transpose, as
    for the whole leaf) and put in accumulators shaped like the device's shard, so no
    device holds the whole leaf's sums (the tied table of hand-written FSDP: its
    kurtosis' four sums). Where the gather splits the blocks' axis, the blocks are
    strided, each taking the same share of every device's piece: a block's combined
    value is the device's strided block of its shard."""
    axis, fs, make_f = features
    n = shape[axis]
    fs = int(max(1, min(fs, n)))
    adds = [S.feature_blocks_of(r) is S.FeatureBlocks.ADD for r in reductions]
    carried = any(i is not None for i in inits)
    taken = [combine is not None and combine.takes(r) for r in reductions]
    over = combine.parts(axis) if combine is not None else 1  # (devices the axis spans)
    nd = max(cuts.split_count(), over)
    if nd > 1:
        nf, rem = cuts.strided_count(n, fs, nd), 0
        full = lambda k: cuts.Strided(axis, k, n // nf, nf)  # noqa: E731
    else:
        nf, rem = divmod(n, fs)
        full = lambda k: (axis, k * fs, fs)  # noqa: E731

    def mine(cut, t):  # the accumulator's block: a device's share of a combined one
        if t and over > 1:
            return cuts.Strided(axis, cut.k, cut.size // over, cut.n)
        return cut

    def block(cut):
        sub = shape[:axis] + (cuts.size_of(cut),) + shape[axis + 1 :]

        def cut_init(m):
            return None if m is None else jax.tree.map(lambda x: cuts.take(cut, x, axis), m)

        vals = reduce_tiles(
            lambda b0, bs: make_f(b0, bs, cut), B,
            [r.block(cut) for r in reductions], tile, shape=sub, dtype=dtype,
            carry=S.Carry([cut_init(i) for i in inits], n0) if carried else None,
        )
        return [combine(r, v, B) if t else v for r, v, t in zip(reductions, vals, taken)]

    def put(acc, vals, cut):
        return [
            a + v if p else jax.tree.map(lambda a, v, t=t: cuts.put(mine(cut, t), a, v, axis),
                                         a, v)
            for a, v, p, t in zip(acc, vals, adds, taken)
        ]

    def zeros(s, whole, t):  # an accumulator for a block's value ``s`` (of the whole axis)
        if whole:
            length = n // over if t else n
            shp = cuts.layout(mine(full(0), t), s.shape[:axis] + (length,)
                              + s.shape[axis + 1 :], axis)
        else:
            shp = s.shape
        return compat.make_varying(jnp.zeros(shp, s.dtype), compat.vma_of(s))

    # Every block runs in the loop, from zeros typed like a block's values (abstract:
    # nothing is computed twice), so XLA compiles the block's program once.
    first = jax.eval_shape(lambda: block(full(0)))
    acc = _late([jax.tree.map(lambda s, p=p, t=t: zeros(s, not p, t), v)
                 for v, p, t in zip(first, adds, taken)])
    acc = jax.lax.fori_loop(0, nf, lambda k, acc: put(acc, block(full(k)), full(k)), acc)
    acc = [v if p else jax.tree.map(lambda a, t=t: cuts.merged(mine(full(0), t), a, axis), v)
           for v, p, t in zip(acc, adds, taken)]
    if rem:
        tail = (axis, nf * fs, rem)
        acc = put(acc, block(tail), tail)
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


# The array a site's statistics start from (its cotangent, `anchored`), innermost last.
_ANCHOR = [None]


@contextlib.contextmanager
def anchored(x):
    """While this runs, the tile and block loops' zero accumulators are made no earlier
    than ``x`` (a site's cotangent, interpreter.py; or a list of arrays, every one of
    them: a leaf's ingredients, leaves.py): XLA's CPU scheduler otherwise
    allocated every loop's zeros (their copies, one per loop) at the start of the program,
    holding every site's accumulators at once (the kurtosis: 5 per site; under FSDP
    1.5x grad's temporary memory)."""
    _ANCHOR.append(x)
    try:
        yield
    finally:
        _ANCHOR.pop()


def _late(acc):
    """``acc`` (zeros) made once the innermost `anchored` array is there: computed from
    it (plus a zero from its first entry, finite or not, combined across a batch split by
    device so that an accumulator shared by the devices stays one), which XLA cannot
    compute before it. No optimisation barrier with it: a barrier's operands are
    buffers, so the zeros passed through one were made at the start of the program and
    held until the barrier (XLA:CPU at jax 0.12 scheduled them there: a scan stack's
    kurtosis on a 2-D mesh with its activations constrained 1.29x grad's temporary
    memory, 0.96x without; at jax 0.10 XLA dropped the barrier's ordering and copied the
    zeros for each loop at the start of the program, which the dependency alone
    prevents: the kurtosis under tensor parallelism 2.0x -> 0.8x)."""
    anchor = _ANCHOR[-1]
    if anchor is None:
        return acc
    anchors = jax.tree.leaves(anchor)
    # (not an accumulator typed to vary over fewer mesh axes than the anchor: a gathered
    # leaf's shard, combined over the others, `_feature_blocks`; a zero computed from the
    # anchor would type it to vary over them all)
    leaves, tree = jax.tree.flatten(acc)
    vma = frozenset().union(*map(compat.vma_of, anchors))
    late = [i for i, x in enumerate(leaves) if vma <= compat.vma_of(x)]
    if not late:
        return acc
    zero = functools.reduce(jnp.add, map(zero_after, anchors))
    if cuts.split_axis() is not None:
        zero = jax.lax.psum(zero, cuts.split_axis())
    vma = compat.vma_of(zero)

    def tied(x):
        if not jnp.issubdtype(x.dtype, jnp.inexact) or not vma <= compat.vma_of(x):
            return x
        return x + zero.astype(x.dtype)

    for i in late:
        leaves[i] = tied(leaves[i])
    return jax.tree.unflatten(tree, leaves)


def zero_after(x):
    """A zero (a float32 scalar) computed from ``x``'s first entry, whatever it holds (NaN
    and infinities included): what XLA cannot compute before ``x`` exists, where an
    optimisation barrier only orders (XLA:CPU at jax 0.10 dropped that ordering for
    copies it made of the zeros afterwards). The entry's top bit (0 or 1) times 0: no
    select or test of finiteness (a program's count of those stays its own), and nothing
    XLA folds (two shifts in a row it merged into one that is constant). Indexed, not
    reshaped: a reshape of a sharded ``x`` would gather it. No derivative."""
    first = jax.lax.stop_gradient(x[(0,) * x.ndim]) if jnp.size(x) else jnp.zeros(())
    if jnp.iscomplexobj(first):
        first = jnp.real(first)
    if jnp.issubdtype(first.dtype, jnp.floating):
        width = first.dtype.itemsize * 8
        bits = jax.lax.bitcast_convert_type(first, jnp.dtype(f"uint{width}"))
    else:
        width, bits = 32, first.astype(jnp.uint32)
    top = jax.lax.shift_right_logical(bits, jnp.asarray(width - 1, bits.dtype))
    return top.astype(jnp.float32) * 0  # (0 or 1, times 0: XLA folds no float product)


def bytes_of(shape, dtype) -> int:
    return int(math.prod(shape)) * jnp.dtype(dtype).itemsize
