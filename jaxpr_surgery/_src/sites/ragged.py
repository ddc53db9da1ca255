"""Grouped matmuls: ``jax.lax.ragged_dot`` with the parameter as the grouped operand.

``ragged_dot(x [m, k], w [g, k, n], group_sizes [g])`` multiplies the rows of group
``e`` (consecutive: rows ``s_e .. s_e + group_sizes[e]`` with ``s_e`` the sizes
before it) by ``w[e]``; rows past the last group give zeros. In a mixture of
experts ``x`` holds an example's tokens sorted by expert and ``w`` the expert
weights. Example ``b``'s gradient is, per expert,

    G_b[e] = sum over the rows r of group e of x_r dy_r^T,

a dense site whose per-example product is grouped. The kernel is the dense kernel
(dense.py) with the weight seen as ``[g * k, n]`` and token ``r`` carrying ``x_r`` in
the block of its group (the one-hot *dispatch* of ``x``): every dense rule applies
and is exact. The dispatch is never formed for the batch where it is not needed:
the site keeps ``x`` with each row's group id, tiles of ``G`` are one grouped
(ragged) contraction per example, the sum over examples one ragged contraction of
all rows sorted by group, and the ghost norm masks the token Gram matrix to pairs
routed to the same group.

jax maps ``ragged_dot`` only with every operand batched, so the forward pass for
the batch is one ``ragged_dot`` of every example's rows sorted by group against
the shared weight (no copy of ``w`` per example), `forward`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxpr_surgery._src import compat, cuts, tiling
from jaxpr_surgery._src import stats as S
from jaxpr_surgery._src.norms import (
    GHOST_TOLERANCE,
    gram_ghost_bound,
    staged_sum,
    untrusted,
)
from jaxpr_surgery._src.sites.base import (
    BATCH_RULES,
    STREAMED,
    Kernel,
    Rule,
    broadcast_unbatched,
    register,
)
from jaxpr_surgery._src.sites.dense import DenseKernel
from jaxpr_surgery._src.sites.dense_layout import DenseLayout, Tokens


@dataclasses.dataclass(frozen=True, kw_only=True)
class RaggedLayout(DenseLayout):
    """A ``ragged_dot`` site as a dense one over its dispatched tokens: ``G`` groups of
    ``k`` inputs each (``C = G * k``); ``x_t``: the tokens' operand is ``[k, m]``."""

    G: int
    k: int
    x_t: bool


def ragged_canon(eqn) -> RaggedLayout | None:
    """Static layout of ``ragged_dot(x, w, group_sizes)`` with the parameter ``w`` as
    a dense site over the dispatched tokens (``C = g * k``), or None where the
    equation is not a grouped matmul of that form: ``x`` 2-D, ragged on its free
    axis, ``w`` 3-D with one group, one contracted and one free axis, no dot batch
    axes, no group offset."""
    rdn = eqn.params["ragged_dot_dimension_numbers"]
    (lc, rc), (lb, rb) = rdn.dot_dimension_numbers
    lhs, rhs = (tuple(int(s) for s in v.aval.shape) for v in eqn.invars[:2])
    ragged, groups = tuple(rdn.lhs_ragged_dimensions), tuple(rdn.rhs_group_dimensions)
    if eqn.params.get("group_offset") is not None or lb or rb:
        return None
    if len(lhs) != 2 or len(rhs) != 3 or len(lc) != 1 or len(ragged) != 1 or len(groups) != 1:
        return None
    lcd, rcd, ld, gd = int(lc[0]), int(rc[0]), int(ragged[0]), int(groups[0])
    if ld == lcd or gd == rcd:
        return None
    (rf,) = {0, 1, 2} - {gd, rcd}
    g, k, n, m = rhs[gd], rhs[rcd], rhs[rf], lhs[ld]
    canon_w = (gd, rcd, rf)
    return RaggedLayout(
        kdims=(),
        cdims=(g, k),
        fdims=(n,),
        canon_w=canon_w,
        K=1,
        C=g * k,
        F=n,
        N=m,
        G=g,
        k=k,
        x_t=ld == 1,  # x is [k, m]
        canon_shape=(g, k, n),
        inv_w=tuple(int(i) for i in np.argsort(canon_w)),
        x_pos=0,
    )


def group_ids(gs, m):
    """``[..., m]`` int32: the group of each of ``m`` rows for group sizes ``gs [..., g]``
    (``g`` for rows past the last group, which the product leaves at zero)."""
    ends = jnp.cumsum(gs.astype(jnp.int32), axis=-1)
    rows = jnp.arange(m, dtype=jnp.int32)
    return jnp.sum(ends[..., None, :] <= rows[:, None], axis=-1, dtype=jnp.int32)


def _counts(gid, g):
    """Group sizes ``[..., g]`` of rows with group ids ``gid [..., m]`` (ids ``g``: none)."""
    return jnp.sum(gid[..., :, None] == jnp.arange(g, dtype=gid.dtype), axis=-2, dtype=jnp.int32)


# G = x^T dy per group: rows of x and dy grouped alike, contracted (the transpose of
# ragged_dot in its weight)
_GROUPED_T = dict(
    dot_dimension_numbers=(((0,), (0,)), ((), ())),
    lhs_ragged_dimensions=(0,),
    rhs_group_dimensions=(),
)


def grouped_outer(x, d, gid, g):
    """``[g, k, n]``: ``sum_{r: gid_r = e} x_r d_r^T`` for ``x [M, k]``, ``d [M, n]``, rows
    consecutive by group (ids ``g`` last: left out)."""
    dn = jax.lax.RaggedDotDimensionNumbers(**_GROUPED_T)
    return jax.lax.ragged_dot_general(x, d, _counts(gid, g), dn)


def ragged_dot_batch(eqn, x, w, gs):
    """``ragged_dot`` ``eqn`` of every example, ``x [B, ...]`` (its lhs) and ``gs [B, g]``,
    against one shared ``w``: the site's own equation once, on every example's rows
    sorted by group, the rows put back in order (the products of each example's own,
    and their VJP jax's). ``eqn`` is of the form `ragged_canon` accepts."""
    c = ragged_canon(eqn)
    B, m, k = x.shape[0], c.N, c.k
    if c.x_t:
        x = jnp.swapaxes(x, 1, 2)
    gid = group_ids(gs, m)
    order = _sorted_rows(gid)
    xs = x.reshape(B * m, k)[order]
    counts = _counts(gid.reshape(-1), c.G).astype(eqn.invars[2].aval.dtype)
    (ys,) = compat.bind_eqn(eqn, [xs.T if c.x_t else xs, w, counts])
    y = jnp.zeros_like(ys).at[order].set(ys, unique_indices=True)
    return y.reshape((B,) + tuple(eqn.outvars[0].aval.shape))


def _batch_rule(eqn, vals, batched, B):
    """`base.BATCH_RULES`: a ``ragged_dot`` outside any site whose weight is shared by the
    examples (frozen experts) by `ragged_dot_batch`, no copy of the weight."""
    if batched[1] or ragged_canon(eqn) is None:
        return None
    x, w, gs = vals
    x, gs = broadcast_unbatched((x, jnp.asarray(gs)), (batched[0], batched[2]), B)
    return [ragged_dot_batch(eqn, x, w, gs)]


BATCH_RULES[compat.ragged_dot_p] = _batch_rule


def _sorted_rows(gid):
    """The rows of every example ``[B, m]`` in one order, consecutive by group (then by
    example and row), and the group sizes of all of them."""
    return jnp.argsort(gid.reshape(-1), stable=True)


@register
class RaggedKernel(DenseKernel):
    """``ragged_dot`` with the parameter as the grouped operand (mixture-of-experts
    weights): a dense kernel over the tokens dispatched to their group."""

    kind = "ragged-dense"
    anchors = (compat.ragged_dot_p,)

    @classmethod
    def matches(cls, eqn, tag, pos, patterns):
        return pos == [1] and not tag.pre and ragged_canon(eqn) is not None

    def __init__(self, site, acc_dtype):
        Kernel.__init__(self, site, acc_dtype)
        self.c = ragged_canon(site.eqn)
        self.fold_side = None

    def dense_layout(self):
        return None  # its ingredients hold the tokens and their groups, not the dispatch

    def use_ghost(self):
        """Ghost norms where the token pairs take at most half of ``G``'s memory (its
        ghost form pairs the tokens of one group only: not `DenseKernel`'s cost model)."""
        c = self.c
        return 2 * c.N ** 2 <= c.C * c.F

    # operands ----------------------------------------------------------------- #
    def _operand(self, ext, i):
        v = self.site.eqn.invars[i]
        return v.val if isinstance(v, compat.Literal) else ext[self.site.ext_vars.index(v)]

    def _batched(self, i):
        v = self.site.eqn.invars[i]
        return not isinstance(v, compat.Literal) and (
            self.site.ext_batched[self.site.ext_vars.index(v)]
        )

    def _lhs_and_sizes(self, ext, B):
        """The site's ``x`` and group sizes for every example (``[B, ...]``)."""
        return broadcast_unbatched(
            (self._operand(ext, 0), jnp.asarray(self._operand(ext, 2))),
            (self._batched(0), self._batched(2)), B,
        )

    def _rows_and_groups(self, ext, B):
        """``x [B, m, k]`` and the rows' group ids ``[B, m]``, every example's."""
        x, gs = self._lhs_and_sizes(ext, B)
        if self.c.x_t:
            x = jnp.swapaxes(x, 1, 2)
        return x, group_ids(gs, self.c.N)

    def forward(self, f, ext_batched):
        """The site for a batch: `ragged_dot_batch`, the weight shared (no copies)."""

        def F(w, *ext):
            B = next(x.shape[0] for x, b in zip(ext, ext_batched) if b)
            x, gs = self._lhs_and_sizes(ext, B)
            return (ragged_dot_batch(self.site.eqn, x, w, gs),)

        return F

    # the site's context: x with each row's group id as one more column ------ #
    def prepare(self, w, ext, ext_batched, dy):
        c = self.c
        (dy,) = dy
        B = dy.shape[0]
        x, gid = self._rows_and_groups(ext, B)
        x = jnp.concatenate([x.astype(self.acc), gid.astype(self.acc)[..., None]], -1)
        return Tokens(x, dy.reshape(B, 1, c.N, c.F).astype(self.acc))

    def _split(self, x):
        return x[..., :-1], jnp.round(x[..., -1]).astype(jnp.int32)

    def tokens(self, x):
        """The dispatched tokens ``[b, 1, m, g * k]``: row ``r`` holds ``x_r`` in the
        block of its group, zeros elsewhere."""
        x, gid = self._split(x)
        b, m, k = x.shape
        onehot = (gid[..., None] == jnp.arange(self.c.G)).astype(x.dtype)
        return (onehot[..., None] * x[..., None, :]).reshape(b, 1, m, self.c.G * k)

    def tile_extra_bytes(self):
        """A tile's grouped product may expand its rows per group (the ragged
        contraction on backends without a ragged instruction, XLA:CPU)."""
        return tiling.bytes_of((self.c.N, self.c.C), self.acc)

    FEATURE_AXES = (2,)  # blocks of one example's G cut the outputs (dy)

    def _grouped(self, x, dy, cut=None):
        """Canonical ``G [b, 1, g * k, F]`` of examples ``x [b, m, k + 1]``, ``dy [b, 1, m,
        F]``: one grouped contraction per example."""
        x, gid = self._split(x)
        d = dy[:, 0]
        if cut is not None:
            d = cuts.take(cut, d, 2)
        G = jax.vmap(lambda x, d, i: grouped_outer(x, d, i, self.c.G))(x, d, gid)
        return G.reshape(G.shape[0], 1, self.c.C, G.shape[-1])

    def _tile_G(self, x, dy, b0, size, cut=None, tokens=None):
        if tokens is not None:  # canonical tokens (the exact centred path)
            return super()._tile_G(x, dy, b0, size, cut, tokens)
        xs = compat.slice_at(x, b0, size, 0)
        ds = compat.slice_at(dy, b0, size, 0)
        return self._grouped(xs, ds, cut)

    def materialise(self, ing):
        x, dy = ing
        return self.to_view(self._grouped(x, dy))

    # written in place by the dense kernel: the per-example G of the generic path here
    add_to_leaf = Kernel.add_to_leaf
    leaf_cut_axes = Kernel.leaf_cut_axes

    def contract(self, x, dy, c=None):
        """``sum_b c_b G_b``: every example's rows sorted by group, one grouped
        contraction (the weight gradient of the batch, as ``jax.grad`` computes it)."""
        x, gid = self._split(x)
        d = dy[:, 0]
        if c is not None:
            d = d * c.astype(d.dtype)[:, None, None]
        order = _sorted_rows(gid)
        M = x.shape[0] * x.shape[1]
        G = grouped_outer(
            x.reshape(M, -1)[order], d.reshape(M, -1)[order], gid.reshape(M)[order], self.c.G
        )
        return self.to_view(G.reshape(1, self.c.C, self.c.F))

    def dots(self, ctx, ref):
        """``[B]``: ``<G_b, ref> = sum_r x_r^T ref[e_r] dy_r``, ``x`` through the site's own
        product with ``ref`` as the weight (no dispatch, no ``G``)."""
        x, dy = ctx
        xr, gid = self._split(x)
        B, m, k = xr.shape
        c = self.c
        order = _sorted_rows(gid)
        xs = xr.reshape(B * m, k)[order]
        gs = _counts(gid.reshape(-1), c.G)
        dn = jax.lax.RaggedDotDimensionNumbers(
            dot_dimension_numbers=(((1,), (1,)), ((), ())),
            lhs_ragged_dimensions=(0,),
            rhs_group_dimensions=(0,),
        )
        R = jnp.transpose(ref, c.canon_w).astype(xs.dtype)  # [g, k, n]
        ys = jax.lax.ragged_dot_general(xs, R, gs, dn, precision=jax.lax.Precision.HIGHEST)
        y = jnp.zeros_like(ys).at[order].set(ys, unique_indices=True).reshape(B, m, -1)
        return jnp.einsum("bmn,bmn->b", y, dy[:, 0])

    def ghost_sq_bound(self, ing):
        """``(ghost, bound, untrusted)`` by the ghost form over token pairs routed to the
        same group, ``sum_{r, s: e_r = e_s} (x_r . x_s)(dy_r . dy_s)``, its error bounded as
        the dense kernel's (`DenseKernel.ghost_sq_bound`)."""
        x, dy = ing
        xr, gid = self._split(x)
        d = dy[:, 0]
        g = self.c.G
        M, k, n = xr.shape[1], xr.shape[2], d.shape[2]
        hi = jax.lax.Precision.HIGHEST
        same = (gid[:, :, None] == gid[:, None, :]) & (gid < g)[:, :, None]
        gx = jnp.where(same, jnp.einsum("bmc,bnc->bmn", xr, xr, precision=hi), 0)
        gd = jnp.where(same, jnp.einsum("bmf,bnf->bmn", d, d, precision=hi), 0)
        ghost = staged_sum(jnp.sum(gx * gd, -1))  # (products and sums, as the dense's)
        # (the bound: the dense kernel's margin; jax has no second derivative of
        # ragged_dot yet, so no statistic of this site is differentiated through it today)
        bound = gram_ghost_bound(xr, d, gx, gd, (k, n, 2 * M), (1, 2), ghost.dtype)
        return ghost, bound, untrusted(ghost, bound, GHOST_TOLERANCE)

    # reporting ------------------------------------------------------------------ #
    def rule(self, reduction, B):
        c = self.c
        N, g, k, n = c.N, c.G, c.k, c.F
        it = jnp.dtype(self.acc).itemsize
        grouped = float(2 * B * N * k * n)  # the ragged products' FLOPs, every row once

        def tiled():
            t, ft, shape = self.tile(B), self.feature_tile(B), (1, c.C, n)
            return Rule(
                STREAMED,
                f"tiled per-example grouped products ({tiling.describe(t, ft, shape)})",
                grouped + float(2 * B * g * k * n),
                float(tiling.tile_bytes(t, ft, shape, self.acc) + t * self.tile_extra_bytes()),
            )

        if reduction.weighted_by_norm:  # a clipped sum: the site computes the norms
            reduction = S.SqNorms()
        if reduction.linear:
            return Rule(
                STREAMED, "grouped contraction (rows sorted by group)", grouped,
                float(B * N * (k + n) * it),
            )
        if reduction == S.SqNorms() and N > 1 and self.use_ghost():
            return Rule(
                STREAMED, "ghost norm (token pairs of one group)", float(2 * B * N * N * (k + n)),
                float(2 * B * N * N * it),
            )
        if N == 1:
            return super().rule(reduction, B)  # rank-one rules on the one dispatched token
        return tiled()
