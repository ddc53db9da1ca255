"""Per-example norms that stay finite past the range of their squares.

Helpers on arrays of per-example values ``[B, ...]`` shared by the site kernels, the
reductions and the dots (no kernel here): a float32 gradient of norm above ``2^64`` has
the squared norm ``inf``, so the examples whose squares overflow are scaled by their
largest magnitude (or recomputed one at a time, as LAPACK's ``nrm2`` does) before
squaring.
"""

from __future__ import annotations

import contextlib
import contextvars

import jax
import jax.numpy as jnp

from jaxpr_surgery._src import compat, cuts

# The examples whose per-example values are kept (`live_examples`), while a call with
# ``example_weights`` traces the statistics of its sites and leaves; None otherwise.
_LIVE = contextvars.ContextVar("jaxpr_surgery_live_examples", default=None)


@contextlib.contextmanager
def live_examples(keep):
    """While tracing: ``keep [B]`` (bool), the examples of positive weight. The
    per-example values of the others are zeros in the end (`engine.run`), so none of
    them is recomputed one at a time (`recompute_flagged`): an example of weight 0 reads
    as zeros at every site, and the ghost form flags an all-zero example (its terms'
    scale is 0). ``keep=None``: every example counts."""
    token = _LIVE.set(keep)
    try:
        yield
    finally:
        _LIVE.reset(token)


def live_examples_set():
    """Whether `live_examples` holds examples now (functions reading them close over a
    traced value: `fingerprint.traced_once` runs them as they are)."""
    return _LIVE.get() is not None


def example_scale(a):
    """``[B]``: each example's largest magnitude in ``a [B, ...]`` (1 where that is 0
    or not finite), to divide it by before squaring. No derivative: the norm
    ``s sqrt(sum (a/s)^2)`` is the same function whatever ``s``."""
    m = jnp.max(jnp.abs(jax.lax.stop_gradient(a)).reshape(a.shape[0], -1), axis=1)
    return jnp.where((m > 0) & jnp.isfinite(m), m, 1)


def scale_examples(a, s):
    """``a [B, ...]`` with example ``b`` divided by ``s_b``."""
    return a / s.reshape((-1,) + (1,) * (a.ndim - 1))


def recompute_flagged(exact, args, values, bad):
    """``values [B]`` with ``exact(args, b)`` in place of the examples where ``bad``.

    The value comes from one loop over the flagged examples alone (flagged first in
    ``order``): no trip in the usual case and no branch to trace or lower. A loop
    with a traced trip count has no reverse-mode derivative, so derivatives (of any
    order) come from recomputing every example in a loop with static bounds, taken
    where flagged: paid only by programs that differentiate the statistic. No branch
    there either: under ``vmap`` a branch on traced flags becomes a select whose
    operands pass through ``stop_gradient``, which reverse mode cannot transpose
    inside this rule. ``exact`` must read traced values only from ``args``. Within
    `live_examples`, examples of weight 0 are never flagged. Under a batch split by
    device the loop runs over the examples' places instead (`_flagged_in_place`).
    """
    live = _LIVE.get()
    if live is not None and jnp.shape(bad)[-1:] == jnp.shape(live):
        bad = bad & live  # (the examples of weight 0: their values are zeroed after)

    axis = cuts.split_axis()

    @jax.custom_jvp
    def fast(args, values, bad):
        if axis is not None:
            return _flagged_in_place(exact, args, values, bad, axis)
        order = jnp.argsort(jnp.logical_not(bad), stable=True)

        def one(i, v):
            b = order[i]
            return v.at[b].set(exact(args, b))

        return jax.lax.fori_loop(0, jnp.sum(bad, dtype=jnp.int32), one, values)

    def differentiable(args, values, bad):
        return jax.lax.fori_loop(0, values.shape[0], _where_flagged(exact, args, bad), values)

    fast.defjvp(lambda primals, tangents: jax.jvp(differentiable, primals, tangents))
    return fast(args, values, bad)


def _flagged_in_place(exact, args, values, bad, axis):
    """`recompute_flagged`'s loop under a batch split by device (``vmap`` over the parts,
    ``axis``): over the examples ``0 .. n - 1`` of every part at once, ``n`` the last
    flagged one's place plus one in any part (none: no trip), each taken where flagged.
    Its index is the same on every part, so each part slices its own example where it
    is; a part's own order of its flagged examples made the slice's index differ between
    the parts, and XLA's partitioner then gathered every part's inputs to every device
    in the loop, which it compiles whether or not it runs (the benchmark's 2-D mesh's
    scan stack at B 16, T 256, d 1024: sq_norms 1.27x -> 1.23x grad's collective bytes).
    The loop sits in a ``lax.cond`` on ``n > 0`` (the same on every part: one branch
    taken): bare, XLA at jax 0.10 allocated its buffers beside the program's peak
    (shard_check.py's model under tensor parallelism: sq_norms 1.16x -> 1.33x grad's
    temporary memory, clipped mean 1.05x -> 1.38x); in the branch, 1.14x and 1.05x."""
    place = jnp.where(bad, jnp.arange(1, bad.shape[0] + 1, dtype=jnp.int32), 0)
    n = jax.lax.pmax(jnp.max(place), axis)
    one = _where_flagged(exact, args, bad)
    return jax.lax.cond(n > 0, lambda v: jax.lax.fori_loop(0, n, one, v), lambda v: v, values)


def _where_flagged(exact, args, bad):
    """A loop body over example places ``b``: ``values[b]`` becomes ``exact(args, b)``
    where ``bad[b]``, else stays."""

    def one(b, v):
        return v.at[b].set(jnp.where(bad[b], exact(args, b), v[b]))

    return one


# --------------------------------------------------------------------------- #
# Ghost forms: where their rounding cannot be trusted
# --------------------------------------------------------------------------- #
# A ghost form sums products of Gram entries, ``sum_nm (x_n . x_m)(dy_n . dy_m)``, whose
# terms may cancel: its rounding error is bounded by the terms' magnitudes, not by its
# value. Each example's ghost value comes with a worst-case bound of that error, whatever
# order its sums run in (`rounding`). Where the bound exceeds ``GHOST_TOLERANCE`` of the
# value (it cannot exclude that the value is all rounding: cancelled terms), the
# example's ``G_b`` is formed alone (`recompute_flagged`). Elsewhere the statistics keep
# the value, and clipping divides by the square root of the value plus the bound
# (`clip_reductions.ClipNorms`): never below the norm of the per-example gradient, so no
# example passes its clip with more than ``C``, whatever its inputs.
GHOST_TOLERANCE = 1.0


def rounding(n, dtype):
    """Worst-case relative error of a sum of ``n`` rounded products in ``dtype``, in any
    order (Higham's ``gamma_{n+1}``, ``u = eps / 2``), doubled to cover the bound's own
    rounding and second-order terms: ``|fl(sum) - sum| <= rounding(n) sum |terms|``."""
    k = (n + 1) * float(jnp.finfo(dtype).eps) / 2
    return 2 * k / (1 - k) if k < 0.5 else float("inf")


def with_bound(norms, sq, bound):
    """The norms clipping divides by: ``sqrt(sq + bound)`` where a ghost value ``sq`` kept
    a positive ``bound`` (as ``norms sqrt(1 + bound / sq)``: no square past the range),
    ``norms`` elsewhere."""
    has = bound > 0
    return jnp.where(has, norms * jnp.sqrt(1 + bound / jnp.where(has & (sq > 0), sq, 1)), norms)


def untrusted(value, bound, tol):
    """``[B]``: the examples whose ghost ``value`` cannot be trusted: its error ``bound``
    exceeds ``tol`` of it (cancelled terms: a value near zero or negative against large
    terms), or it (or the bound) is not finite (overflowing terms)."""
    return jnp.logical_not(bound <= tol * value) | jnp.logical_not(jnp.isfinite(value))


def staged_sum(rows):
    """``[B]``: the sum of ``rows [B, ...]`` over its other axes, that axis by axis after
    an optimisation barrier on ``rows`` (XLA would merge two reductions into one whose
    summation depth, the product of the lengths, is what `rounding` must then assume)."""
    return jnp.sum(jax.lax.optimization_barrier(rows), axis=tuple(range(1, rows.ndim)))


def example_norm(make, blocks=None):
    """``||G||`` of one example, ``G = make(cut)`` (shaped ``[1, *shape]``), exact and
    without a square past the range: against a running scale (the largest magnitude
    so far, as LAPACK's ``nrm2``). ``blocks = (axis, size, n)``: in blocks of ``size``
    along ``axis`` of ``n`` (``cut = (axis, f0, size)``, and a last block of the
    remainder, as `tiling.reduce_tiles` cuts them: a site that keeps a table's rows by
    their ids, `cuts.rows`, reads the same block as one that slices), else ``cut =
    None``."""

    def add(state, g):
        scale, ssq = state
        m = jnp.max(jnp.abs(g))
        new = jnp.maximum(scale, m)
        safe = jnp.where(new > 0, new, 1)
        return new, ssq * jnp.square(scale / safe) + jnp.sum(jnp.square(g / safe))

    if blocks is None:
        g = make(None)
        m = jnp.max(jnp.abs(g))
        return m * sqrt0(jnp.sum(jnp.square(g / jnp.where(m > 0, m, 1))))
    axis, size, n = blocks
    nd = cuts.split_count()
    nf = cuts.strided_count(n, size, nd) if nd > 1 else None
    if nf is not None:  # (a batch split by device: blocks strided over them, cuts.py)
        count, rem, cut = nf, 0, lambda k: cuts.Strided(axis, k, n // nf, nf)  # noqa: E731
    else:
        count, rem = divmod(n, size)
        cut = lambda k: (axis, k * size, size)  # noqa: E731
    like = jax.eval_shape(lambda: make(cut(0)))  # (inside shard_map: varying like G)
    zero = compat.make_varying(jnp.zeros((), like.dtype), compat.vma_of(like))
    state = jax.lax.fori_loop(0, count, lambda k, state: add(state, make(cut(k))), (zero, zero))
    if rem:
        state = add(state, make((axis, count * size, rem)))
    scale, ssq = state
    return scale * sqrt0(ssq)  # (an example whose gradient is zero: a zero derivative)


def flagged_norms(sq, exact_norm, args):
    """``sqrt(sq)`` (``[B]`` squared norms), with ``exact_norm(args, b)`` for the examples
    whose square is not finite: overflowed (float32 norms past ``2^64``), or NaN from
    overflowing terms. A loop over those alone (`recompute_flagged`): nothing runs,
    and no branch is traced, in the usual case."""
    return recompute_flagged(exact_norm, args, sqrt0(sq), jnp.logical_not(jnp.isfinite(sq)))


def norms_of_products(sq, G):
    """``[B]`` norms from squared norms ``sq`` of per-example products ``G [B, ...]`` the
    caller holds anyway (a clipped sum's kept products): ``sqrt(sq)``, and where the
    square is not finite the norm of ``G_b`` itself scaled by its largest magnitude.
    One more pass over ``G`` instead of recomputing flagged examples (a loop of their
    own in every layer of the program)."""
    s = example_scale(G)
    exact = s * sqrt0(jnp.sum(jnp.square(scale_examples(G, s)), axis=tuple(range(1, G.ndim))))
    ok = jnp.isfinite(sq)
    return jnp.where(ok, sqrt0(jnp.where(ok, sq, 1)), exact)


def materialised_norms(G):
    """``[B]`` norms of ``G [B, ...]``, finite wherever representable: its squares
    summed, the examples whose square overflows one at a time (`flagged_norms`)."""

    def exact(G, b):
        return example_norm(lambda cut: compat.slice_at(G, b, 1, 0))

    return flagged_norms(jnp.sum(jnp.square(G), axis=tuple(range(1, G.ndim))), exact, G)


def honest_sq(sq, norms):
    """Squared norms where they came out NaN or inf from overflowing terms (a ghost
    norm's products, cross terms of opposite signs): the square of the exact norm,
    ``inf`` only where that square is past the dtype's range."""
    return jnp.where(jnp.isfinite(sq), sq, jnp.square(norms))


def no_derivative(*arrays):
    """``arrays`` read by a bound of rounding errors (a ghost form's): a margin, not a
    function to differentiate. Differentiated, the square roots of its row norms would
    give a NaN derivative wherever a row is zero (a token whose cotangent is zero: a
    padded or masked token, a branch ``jnp.where`` did not take), and the statistics'
    gradients (clipping's norms read the bound) would be NaN."""
    return tuple(jax.lax.stop_gradient(a) for a in arrays)


def gram_ghost_bound(x, dy, gx, gd, dims, axes, dt):
    """A bound on the rounding of a ghost form ``sum (x_n . x_m)(dy_n . dy_m)`` over the
    token pairs of each example, from its token rows ``x`` and ``dy`` (features last)
    and their Gram matrices ``gx``, ``gd`` (token pairs on the two axes before the
    last of the products, summed over ``axes``), in ``dt``. ``dims``: ``(C, F, S)``,
    the lengths of the dots of ``gx`` and ``gd`` and of the sum of their products.
    Each Gram entry is off by at most ``rounding(C) |x_n| |x_m|`` (``F``: ``|dy_n|
    |dy_m|``), the sum of products by ``rounding(S)`` of the sum of their magnitudes.
    A margin, not differentiated (`no_derivative`). Shared by the dense and the ragged
    kernels' ghost forms."""
    C, F, S = dims
    x, dy, gx, gd = no_derivative(x, dy, gx, gd)
    nx = jnp.sqrt(jnp.sum(jnp.square(x), -1))
    nd = jnp.sqrt(jnp.sum(jnp.square(dy), -1))
    ax, ad = jnp.abs(gx), jnp.abs(gd)

    def outer(v):
        return v[..., :, None] * v[..., None, :]

    return (rounding(C, dt) * jnp.sum(outer(nx) * ad, axes)
            + rounding(F, dt) * jnp.sum(outer(nd) * ax, axes)
            + rounding(S, dt) * jnp.sum(ax * ad, axes))


def sqrt0(sq):
    """``sqrt(sq)`` whose derivative at 0 is 0, not NaN (double where); NaN stays NaN."""
    pos = sq > 0
    return jnp.where(pos, jnp.sqrt(jnp.where(pos, sq, 1)), sq * 0)


def pow2(e, dtype):
    """``2.0 ** e`` for integer exponents ``e`` (clipped to the normal range), exact in
    ``dtype``: its bits (a few integer ops; ``jnp.ldexp`` compiles to fifty per use)."""
    info = jnp.finfo(dtype)
    ints = {16: jnp.int16, 32: jnp.int32, 64: jnp.int64}[info.bits]
    e = jnp.clip(jnp.asarray(e), info.minexp, info.maxexp - 1).astype(ints)
    return jax.lax.bitcast_convert_type((e + (info.maxexp - 1)) << info.nmant, dtype)


def stacked_parts(parts):
    """``parts`` (arrays of one shape: per-leaf or per-group values of every example)
    stacked along a new leading axis behind an optimisation barrier, in their common
    dtype and varying manual axes, for ONE reduction over them. A chain of adds (or
    ``and``s) over a model's hundreds of leaves is what XLA makes of anything else: its
    simplifier then moves one reshape per pass through the chain and stops at its
    iteration limit, every pass over the whole program, and its fusion copies the whole
    chain into each consumer (22,000 ``is-finite`` ops for GPT-2 small's 148 leaves);
    the barrier keeps it from turning the reduction back into the chain."""
    parts = list(parts)
    dt = jnp.result_type(*parts)
    axes = frozenset().union(*(compat.vma_of(x) for x in parts))
    stacked = jnp.stack([compat.make_varying(jnp.asarray(x).astype(dt), axes) for x in parts])
    return jax.lax.optimization_barrier(stacked)


def combine_norms(norms, axis=0):
    """``sqrt(sum n^2)`` over ``axis`` of per-part norms (leaves, scanned layers, model
    shards), scaled by the largest part so that no square overflows (float32 norms
    past ``2^64``); the scale is a power of two, so the result is that of the plain
    formula wherever the plain one does not overflow."""
    # (a barrier: XLA would turn the sum over stacked parts back into a chain of adds,
    # and a model's hundreds of leaves then keep its simplifier at its iteration limit,
    # every pass over the whole program: `stats._SqNorms.finalize`)
    norms = jax.lax.optimization_barrier(jnp.asarray(norms))
    m = jnp.max(jax.lax.stop_gradient(norms), axis=axis, keepdims=True)
    e = exponent(m)  # sqrt(sum (n/2^e)^2) 2^e: the same function, whatever e
    r = sqrt0(jnp.sum(jnp.square(norms * pow2(-e, norms.dtype)), axis=axis))
    return r * jnp.squeeze(pow2(e, norms.dtype), axis)


def exponent(m):
    """The binary exponent of ``|m|`` from its bits (``2^e <= |m| < 2^(e+1)`` for normal
    numbers), clipped to ``[-126, 126]`` so that ``2^e`` and ``2^-e`` are normal; 0 for
    zero, subnormal, inf and NaN values. Exact and a few integer ops (no log2)."""
    info = jnp.finfo(m.dtype)
    ints = {16: jnp.int16, 32: jnp.int32, 64: jnp.int64}[info.bits]
    bits = jax.lax.bitcast_convert_type(jnp.abs(m), ints)
    biased = (bits >> info.nmant).astype(jnp.int32)  # sign bit cleared by abs
    top = 2 * info.maxexp - 1  # all ones: inf and NaN
    e = jnp.where((biased > 0) & (biased < top), biased - (info.maxexp - 1), 0)
    return jnp.clip(e, -126, 126)
