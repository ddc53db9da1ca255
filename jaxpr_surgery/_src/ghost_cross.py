"""Ghost cross terms of a tied leaf: ``<G_a, G_b>`` per example between an embedding's
and a dense site's gradients of one ``[V, d]`` table, without forming either, and the
cost model that picks them or tiles of the leaf's summed gradient.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxpr_surgery._src import stats as S
from jaxpr_surgery._src import views
from jaxpr_surgery._src.norms import no_derivative, rounding, staged_sum
from jaxpr_surgery._src.sites.base import Candidate, cheapest


def cross_layout(sa, ka, sb, kb):
    """For an embedding site and a dense site on the same [V, d] leaf (tying): on which
    canonical dense axis ("C" or "F") the table rows lie, or None if no ghost cross term.

    An embedding is a kernel that `gathers_rows`, a dense site one with a `dense_layout`
    (`sites.base.Kernel`). Decided once per pair of a plan's sites (kept on the
    kernel: the engine and the cost model ask several times)."""
    memo = ka.__dict__.setdefault("_cross_layouts", {})
    key = (id(sa), id(sb), id(kb))
    if key not in memo:
        memo[key] = _cross_layout(sa, ka, sb, kb)
    return memo[key]


_UNDECIDED = object()


def _cross_layout(sa, ka, sb, kb, by_axes=True):
    if ka.dense_layout() is not None and kb.gathers_rows() is not None:
        sa, ka, sb, kb = sb, kb, sa, ka
    table, c = ka.gathers_rows(), kb.dense_layout()
    if table is None or c is None or sa.depth or sb.depth:
        return None
    if sa.pads or sb.pads:
        return None
    if c.K != 1:
        return None
    V, d = table
    if by_axes:
        out = _cross_layout_by_axes(sa, ka, sb, c, V, d)
        if out is not _UNDECIDED:
            return out
    # The checks below map index arrays of the leaf's size through the views (numpy:
    # static). A vocabulary-sized table holds tens of millions of entries: int32 indices
    # and comparisons against strided views of one arange, never a meshgrid (which cost
    # seconds of every trace at GPT-2's table).
    itype = np.int32 if V * d < 2**31 else np.int64
    flat = np.arange(V * d, dtype=itype)
    # the embedding's table rows are the leaf's rows (not its columns: a square table
    # gathered as ``table.T[ids]``)?
    rows = flat.reshape(V, d)
    if not np.array_equal(np.asarray(views.to_leaf(ka._view(rows), sa)), rows):
        return None
    # where does canonical (c, f) land in the [V, d] leaf?
    if c.C * c.F != V * d:
        return None
    leaf_idx = np.asarray(views.to_leaf(kb.to_view(flat.reshape(1, c.C, c.F)), sb))
    if leaf_idx.shape != (V, d):
        return None
    if c.C == d and c.F == V and np.array_equal(leaf_idx, flat.reshape(d, V).T):
        return "F"
    if c.C == V and c.F == d and np.array_equal(leaf_idx, rows):
        return "C"
    return None


def _cross_layout_by_axes(sa, ka, sb, c, V, d):
    """`cross_layout`'s answer where both views only permute the leaf's two axes (a
    table used as itself and as its transpose, the usual tying), from the
    permutations alone: what the index arrays would give, without forming them.
    `_UNDECIDED` otherwise."""
    emb, dense = views.leaf_axes(sa), views.leaf_axes(sb)
    table_2d = getattr(ka, "_table_2d", None)
    if emb is None or dense is None or table_2d is None or not table_2d():
        return _UNDECIDED
    if len(c.canon_w) != 2 or len(dense) != 2:
        return _UNDECIDED
    if emb != (0, 1):  # the table's rows are the leaf's columns
        return None
    # canonical axis i of the dense site (C, then F) is its view's axis canon_w[i]
    on_c, on_f = dense[c.canon_w[0]], dense[c.canon_w[1]]
    if c.C == d and c.F == V and (on_c, on_f) == (1, 0):
        return "F"
    if c.C == V and c.F == d and (on_c, on_f) == (0, 1):
        return "C"
    return None


def ghost_cross_ok(sites, kernels):
    """Every pair of a shared leaf's sites has a ghost cross term (`cross_layout`)."""
    return all(
        cross_layout(sites[a], kernels[a], sites[b], kernels[b]) is not None
        for a in range(len(sites))
        for b in range(a + 1, len(sites))
    )


def shared_norm_candidates(sites, kernels, B, shape, acc):
    """The two forms of a shared leaf's per-example squared norms, cheapest first
    (`sites.base.cheapest`): each site's own norms (its cheapest form) plus the ghost
    cross terms of every pair (``2 T N d`` FLOPs per example and pair: ``T`` ids, ``N``
    tokens of the dense site), or the squares of tiles of the leaf's summed ``G_b``
    (each site's contribution, about its weight-gradient FLOPs, plus the leaf through
    memory). At long sequences the cross terms grow as ``T N`` and the tiles win."""
    it = jnp.dtype(acc).itemsize
    size = int(np.prod(shape))
    own = 0.0
    for k in kernels:
        rl = k.rule(S.SqNorms(), B)
        own += min((c.cost for c in rl.candidates), default=rl.flops)
    cross = 0.0
    for a in range(len(sites)):
        for b in range(a + 1, len(sites)):
            ka, kb = kernels[a], kernels[b]
            sa, sb = sites[a], sites[b]
            if ka.dense_layout() is not None:
                sa, ka, sb, kb = sb, kb, sa, ka
            table, c = ka.gathers_rows(), kb.dense_layout()
            if table is None or c is None:
                continue
            T = int(np.prod(sa.eqn.outvars[0].aval.shape)) // table[1]
            cross += 2.0 * B * T * c.N * table[1] + 2.0 * B * T * c.N
    ghost = Candidate("own norms + ghost cross terms", own + cross, 0.0, 0.0)
    tiles = Candidate(
        "tiles of the shared leaf's products",
        sum(k.rule(S.SUM, B).flops for k in kernels) + 2.0 * B * size,
        2.0 * B * size * it, 0.0,
    )
    return cheapest([ghost, tiles])


def shared_norms_by_ghost(sites, kernels, B, shape, acc):
    """A shared leaf's norms from its sites' own forms and ghost cross terms: where
    every pair has one (`ghost_cross_ok`) and the cost model finds them cheaper than
    tiles of the leaf's summed ``G`` (`shared_norm_candidates`). The engine and
    `explain` both decide by this function."""
    return ghost_cross_ok(sites, kernels) and (
        shared_norm_candidates(sites, kernels, B, shape, acc)[0].how.startswith("own")
    )


def cross_fast(sa, ka, inga, sb, kb, ingb):
    """``(<G_a, G_b>, bound)`` per example (ghost form) and a bound on its rounding
    (`norms.rounding`: the ``[T, N]`` products are off by at most ``rounding(d)`` of
    ``|a_t| |b_n|`` each, their sum, over ``n`` then ``t``, by ``rounding(N + T)`` of the
    sum of magnitudes), or None when there is no cheap formula."""
    rows_on = cross_layout(sa, ka, sb, kb)
    if rows_on is None:
        return None
    if ka.dense_layout() is not None:  # (the other one gathers rows)
        sa, ka, inga, sb, kb, ingb = sb, kb, ingb, sa, ka, inga
    ids, valid, dye = ka.ctx(inga)  # [B, T], [B, T], [B, T, d]
    x, dy = ingb  # [B, 1, N, C], [B, 1, N, F]
    x, dy = x[:, 0], dy[:, 0]
    # rows_on F: G_b[v, :] = sum_n dy[n, v] x[n, :]; C: G_b[v, :] = sum_n x[n, v] dy[n, :]
    other, picked = (x, dy) if rows_on == "F" else (dy, x)
    hi = jax.lax.Precision.HIGHEST
    A = jnp.einsum("btc,bnc->btn", dye, other, precision=hi)
    P = jnp.take_along_axis(picked, ids[:, None, :], axis=2)  # [B, N, T]
    P = jnp.swapaxes(P, 1, 2)  # [B, T, N]
    cross = staged_sum(jnp.sum(A * P, -1))  # (products and sums: no unit batch dots)
    dye, other, A, P = no_derivative(dye, other, A, P)  # (the bound: a margin)
    ne = jnp.sqrt(jnp.sum(jnp.square(dye), -1))
    no = jnp.sqrt(jnp.sum(jnp.square(other), -1))
    aP, dt = jnp.abs(P), cross.dtype
    N, T = other.shape[1], ids.shape[1]
    bound = (rounding(dye.shape[-1], dt) * jnp.sum(ne[:, :, None] * no[:, None, :] * aP, (1, 2))
             + rounding(N + T, dt) * jnp.sum(jnp.abs(A) * aP, (1, 2)))
    return cross, bound
