"""Embedding sites: rows of a table gathered by integer ids (``table[ids]``, ``jnp.take``).

Per example the table gradient has a row ``s_t = sum_{t': id_t' = id_t} dy_t'``
at every distinct id of the example. With the ``[T, T]`` equality mask of the
example's ids, every statistic is a scatter of per-(example, first occurrence)
rows into the table -- no ``[B, V, d]`` tensor is ever formed:

* sum: scatter-add of ``dy``;
* ``sum_b phi(G_b)`` for ``phi(0) = 0``: scatter-add of ``phi(s_t)`` at first occurrences;
* squared norms: ``sum_t first_t ||s_t||^2``;
* centered moments: ``sum_touched (s - mean)^2 + (B - n_row) mean^2`` (no cancellation).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxpr_surgery._src import compat, cuts, kron, views
from jaxpr_surgery._src import stats as S
from jaxpr_surgery._src import stats_research as R
from jaxpr_surgery._src.sites.base import (
    MATERIALISED,
    STREAMED,
    Fast,
    Kernel,
    OneHot,
    Rule,
    example_scale,
    register,
    scale_examples,
    times_examples,
)


def canonical_ids(ids, V):
    """Integer ids of any dtype as int32 with their meaning against a table of ``V`` rows
    kept: values below 0 become -1 and values at or above ``V`` become ``V``. The
    comparison happens in the ids' own dtype only where ``V`` is representable in it, so
    narrow ids (uint8 into a table of 300 rows) never see a wrapped ``V``."""
    dt = ids.dtype
    if not jnp.issubdtype(dt, jnp.integer):
        raise TypeError(f"embedding ids must be integers, got {dt}")
    info = np.iinfo(dt)
    lo = max(int(info.min), -1)
    hi = min(int(info.max), int(V))
    ids = jax.lax.clamp(jnp.asarray(lo, dt), ids, jnp.asarray(hi, dt))
    return ids.astype(jnp.int32)


_ID_SPLIT = 1 << 12  # ids travel as two floats, each exact: id // 4096 and id % 4096


def pack_ids(ids, dtype):
    """int32 ids (-1: invalid) as a float pair ``[..., 2]`` that is exact in ``dtype``
    (ids up to 2**31; float16/bfloat16 have 11/8 significant bits: use float32)."""
    hi = jnp.floor_divide(ids, _ID_SPLIT)
    lo = ids - hi * _ID_SPLIT
    return jnp.stack([hi, lo], -1).astype(dtype)


def unpack_ids(packed):
    both = jnp.round(packed).astype(jnp.int32)
    return both[..., 0] * _ID_SPLIT + both[..., 1]


def _phi_zero_is_zero(reduction):
    if reduction.phi is None:
        return True
    try:  # (concretely also while a jit traces the statistics: rules are chosen then)
        with jax.ensure_compile_time_eval():
            z = np.asarray(reduction.phi(jnp.zeros((1,), jnp.float32)))
    except Exception:  # noqa: BLE001 - phi not evaluable concretely
        return False
    return bool(np.all(z == 0))


def row_gather_layout(eqn):
    """``(n_index_components, row_component, row_axis)`` if ``eqn`` gathers whole rows
    of a table by integer ids, else None.

    Two forms are recognised:

    * ``table[ids]``, ``jnp.take`` and ``jnp.take_along_axis`` along the rows: one
      collapsed ``row_axis`` indexed by the only index component, every other axis
      taken whole, and only axes of size 1 before the row axis (``take_along_axis(
      table[None], ids[..., None], axis=1)`` gathers from a ``[1, V, d]`` view), so
      that the table is a ``[V, d]`` reshape of the operand; the gathered rows follow
      the ids' axes in memory (offset axes of size 1 may sit anywhere);
    * a batched ``dynamic_slice`` of a row of a table, which is what ``jax.vmap``
      makes of ``table[i]`` with a scalar ``i`` (``eqx.nn.Embedding``, or a token's
      expert weights ``w[i]`` of a ``[E, d, f]`` table): no collapsed dim, an index per
      axis of the table in clip mode, where the start of every full-width axis is
      always clamped to 0.
    """
    from jax.lax import GatherScatterMode

    dn = eqn.params["dimension_numbers"]
    operand, idx = eqn.invars
    shape = tuple(operand.aval.shape)
    if len(shape) < 2 or not np.issubdtype(idx.aval.dtype, np.integer):
        return None
    if getattr(dn, "operand_batching_dims", ()) or getattr(dn, "start_indices_batching_dims", ()):
        return None
    sizes = tuple(int(n) for n in eqn.params["slice_sizes"])
    out_shape = tuple(eqn.outvars[0].aval.shape)
    out_rank = len(out_shape)
    smap, collapsed, offs = (tuple(dn.start_index_map), tuple(dn.collapsed_slice_dims),
                             tuple(dn.offset_dims))
    ncomp = idx.aval.shape[-1] if idx.aval.shape else 0
    if len(collapsed) == 1 and smap == collapsed and ncomp == 1:
        r = int(collapsed[0])
        whole = sizes == shape[:r] + (1,) + shape[r + 1 :]
        if whole and all(n == 1 for n in shape[:r]):
            ids_axes = [i for i in range(out_rank) if i not in offs and out_shape[i] != 1]
            row_axes = [i for i in offs if out_shape[i] != 1]
            if not ids_axes or not row_axes or max(ids_axes) < min(row_axes):
                return 1, 0, r
        return None
    rank = len(shape)
    if sizes != (1,) + shape[1:]:
        return None
    if collapsed == () and offs == tuple(range(out_rank - rank, out_rank)) and 0 in smap:
        mode = eqn.params.get("mode")
        if smap == (0,) and ncomp == 1:
            return 1, 0, 0
        if sorted(smap) == list(range(rank)) and ncomp == rank and mode == GatherScatterMode.CLIP:
            return rank, smap.index(0), 0
    return None


class Rows(NamedTuple):
    """An embedding site's context for a batch (`Kernel.prepare`): each example's row ids
    ``ids [B, T]`` (clipped into the table), whether each selects a row ``valid [B, T]``
    (an out-of-range id gets no gradient) and the gathered rows' cotangents ``dy [B, T,
    d]`` (zero where not valid)."""

    ids: Any
    valid: Any
    dy: Any


class PackedRows(NamedTuple):
    """`Rows` as a site's ingredients, which travel as cotangents (floats): the ids (-1
    where not valid) as an exact float pair (`pack_ids`), and ``dy``."""

    packed: Any
    dy: Any


@register
class EmbeddingKernel(Kernel):
    """Rows of a table gathered by integer ids (`row_gather_layout`)."""

    kind = "embedding"
    anchors = (compat.gather_p,)

    @classmethod
    def matches(cls, eqn, tag, pos, patterns):
        return pos == [0] and not tag.pre and row_gather_layout(eqn) is not None

    def __init__(self, site, acc_dtype):
        super().__init__(site, acc_dtype)
        eqn = site.eqn
        self.ncomp, self.row_comp, self.row_axis = row_gather_layout(eqn)
        shape = tuple(int(s) for s in eqn.invars[0].aval.shape)
        self.V = shape[self.row_axis]
        self.d = int(np.prod(shape)) // self.V if self.V else int(np.prod(shape[1:]))
        self.mode = eqn.params["mode"]

    def _view(self, v):
        """A value in the table's layout ``[..., V, d]`` in the view's (the gathered
        operand, ``[1, V, d]`` for ``take_along_axis(table[None], ...)``): a reshape."""
        view = tuple(self.site.view_shape)
        if len(view) == 2:
            return v
        return v.reshape(v.shape[:-2] + view)

    def _table_2d(self):
        """The view is the table itself (no axes of size 1 around it)."""
        return len(self.site.view_shape) == 2

    def scale(self, ctx, c):
        return ctx._replace(dy=ctx.dy * c.astype(ctx.dy.dtype))

    def scale_examples(self, ctx, s):
        return ctx._replace(dy=times_examples(ctx.dy, s))

    def gathers_rows(self):
        return self.V, self.d

    def prepare(self, w, ext, ext_batched, dy):
        from jax.lax import GatherScatterMode

        idx = ext[self.site.ext_vars.index(self.site.eqn.invars[1])]
        (dy,) = dy
        B = dy.shape[0]
        ids = canonical_ids(idx.reshape(B, -1, self.ncomp)[..., self.row_comp], self.V)
        dy = dy.reshape(B, -1, self.d).astype(self.acc)
        if self.mode == GatherScatterMode.CLIP:
            valid = jnp.ones(ids.shape, bool)
        else:
            # FILL_OR_DROP and PROMISE_IN_BOUNDS: the transposed scatter drops
            # out-of-range rows, so they get no gradient
            valid = (ids >= 0) & (ids < self.V)
        ids = jnp.clip(ids, 0, self.V - 1)
        dy = jnp.where(valid[..., None], dy, 0)
        return Rows(ids, valid, dy)

    # helpers ------------------------------------------------------------------ #
    @staticmethod
    def _segments(ids, valid, dy):
        eq = (ids[:, :, None] == ids[:, None, :]) & valid[:, :, None] & valid[:, None, :]
        s = jnp.einsum("btu,bud->btd", eq.astype(dy.dtype), dy)
        T = ids.shape[1]
        earlier = jnp.tril(jnp.ones((T, T), bool), -1)
        first = valid & ~jnp.any(eq & earlier[None], axis=2)
        return s, first

    def _scatter(self, ids, rows):
        flat = ids.reshape(-1)
        return (
            jnp.zeros((self.V,) + rows.shape[2:], rows.dtype)
            .at[flat]
            .add(rows.reshape((-1,) + rows.shape[2:]), mode="drop")
        )

    # reductions ----------------------------------------------------------------- #
    # (the fast rules: `FAST`, after the class; the others from per-example tables)
    def phi_sum(self, ctx, reduction, w=None):
        """``sum_b phi(G_b)`` where ``phi(0) = 0``: phi of each row's segment sum (with
        example weights ``w``: ``sum_b w_b phi(G_b)``, the weights after phi)."""
        ids, valid, dy = ctx
        wb = None if w is None else w.astype(dy.dtype)[:, None, None]
        if reduction.linear:
            return self._view(self._scatter(ids, dy if wb is None else dy * wb))
        s, first = self._segments(ids, valid, dy)
        rows = reduction.apply(s) if wb is None else wb * reduction.apply(s)
        return self._view(self._scatter(ids, jnp.where(first[..., None], rows, 0)))

    def _row_mean(self, ctx, w):
        """What `centered` and `central_sums` start from: ``(ids, s, first, W, wb, mean,
        n_row)``: each example's segment sums ``s`` and first occurrences ``first``
        (`_segments`), the total weight ``W`` (``B`` unweighted), the weights ``wb``
        broadcast against ``s`` (None unweighted), each row's mean gradient, and the
        number (the weight) of the examples using each row."""
        ids, valid, dy = ctx
        s, first = self._segments(ids, valid, dy)
        if w is None:
            W, wt, wb = ids.shape[0], first.astype(dy.dtype), None
        else:
            wb = w.astype(dy.dtype)
            W = jnp.sum(wb)
            wt, wb = jnp.where(first, wb[:, None], 0), wb[:, None, None]
        mean = self._scatter(ids, dy if wb is None else dy * wb)
        mean = mean / (W if w is None else jnp.where(W > 0, W, 1))
        return ids, s, first, W, wb, mean, self._scatter(ids, wt)

    def centered(self, ctx, reduction, w=None):
        """Centred moments: rows no example uses add ``B - n_row`` zero gradients (with
        example weights ``w``, `Centered.from_weighted`: ``W - `` the weight of the
        examples using the row)."""
        ids, s, first, W, wb, mean, n_row = self._row_mean(ctx, w)
        dev = jnp.square(s - mean[ids])
        dev = jnp.where(first[..., None], dev if wb is None else wb * dev, 0)
        m2 = self._scatter(ids, dev) + (W - n_row)[:, None] * jnp.square(mean)
        return S.Moments(self._view(mean), self._view(m2))

    def central_sums(self, ctx, reduction, w=None):
        """`stats_research.CentralSums` (kurtosis), exact as `centered`: sums of powers
        of each row's segment sums less the mean, the rows no example uses adding ``B -
        n_row`` (with weights ``W - `` theirs) zero gradients; against the rounded mean,
        corrected by the first sum (`CentralMoments.finish`)."""
        ids, s, first, W, wb, mean, n_row = self._row_mean(ctx, w)
        zeros = (W - n_row)[:, None]  # (weight of) the examples at 0
        c, k = s - mean[ids], -mean  # (a zero gradient's distance from the mean)
        sums, cp, kp = [], c, k
        for _ in range(4):
            v = jnp.where(first[..., None], cp if wb is None else wb * cp, 0)
            sums.append(self._view(self._scatter(ids, v) + zeros * kp))
            cp, kp = cp * c, kp * k
        return reduction.finish(R.ShiftedSums(self._view(mean), *sums), W)

    def _row_axes(self):
        """The view's axes: the row axis, and the others (a row's ``d`` values)."""
        rest = tuple(i for i in range(len(self.site.view_shape)) if i != self.row_axis)
        return (self.row_axis,), rest

    def kron_factors(self, ctx):
        """Token factors (kron.py): the one-hot rows of the ids and the rows of ``dy``
        (out-of-range tokens carry a zero ``dy``, so they add nothing)."""
        ids, valid, dy = ctx
        rows, rest = self._row_axes()
        view = tuple(self.site.view_shape)
        dy = dy.reshape(dy.shape[:2] + tuple(view[i] for i in rest))
        return kron.Factors((), ((rows, kron.OneHot(ids, self.V)), (rest, dy)))

    def dots(self, ctx, ref):
        """``[B]``: ``sum_t ref[id_t] . dy_t`` (out-of-range tokens carry a zero ``dy``)."""
        ids, valid, dy = ctx
        table = ref.reshape(self.V, self.d)
        return jnp.einsum("btd,btd->b", jnp.take(table, ids, axis=0).astype(dy.dtype), dy)

    def kron_meta(self):
        """``((n_tokens, kdims, pdims, qdims), structure in leaf axes)`` for explain."""
        T = int(np.prod(self.site.eqn.outvars[0].aval.shape)) // self.d
        m = kron.view_leaf_axes(self.site)
        return (T, (), (self.V,), (self.d,)), kron.leaf_structure((), self._row_axes(), m)

    def ingredients(self, ctx):
        ids, valid, dy = ctx
        # ingredients travel as cotangents (floats): ids as an exact float pair
        return PackedRows(pack_ids(jnp.where(valid, ids, -1), dy.dtype), dy)

    def ctx(self, ing):
        return self._unpack(ing)

    @staticmethod
    def _unpack(ing):
        packed, dy = ing
        ids = unpack_ids(packed)
        valid = ids >= 0
        return Rows(jnp.where(valid, ids, 0), valid, dy)

    def _rows(self, ing):
        """``ing`` as `Rows`: a context, or ingredients (`PackedRows`) unpacked."""
        return self._unpack(ing) if isinstance(ing, PackedRows) else ing

    def materialise(self, ing):
        ids, valid, dy = self._rows(ing)
        return self._view(jax.vmap(lambda i, r: self._scatter(i[None], r[None]))(ids, dy))

    adds_in_place = True

    def _in_place(self):
        """`add_to_leaf` scatters into the leaf's own layout: the table is the leaf (its
        view at most a no-op of it: a cast to varying inside shard_map, a copy)."""
        return (not self.site.depth and all(views.is_noop(op) for op in self.site.chain)
                and self._table_2d())

    def leaf_cut_axes(self):
        return (0, 1) if self._in_place() else ()

    def add_to_leaf(self, ing, total, to_leaf, cut=None):
        """Scatter-adds the rows into ``total`` (another site's tile of a tied table)
        where the table is the leaf itself: no zero table per tile, no extra add. A
        ``cut`` of rows keeps the ids inside it (shifted); of columns, slices ``dy``."""
        if not self._in_place():
            return super().add_to_leaf(ing, total, to_leaf, cut)
        ids, valid, dy = self._unpack(ing)
        dy = dy.astype(self.acc)
        rows, cols = self.V, self.d
        if cut is not None:
            if cuts.axis_of(cut) == 0:
                ids = cuts.rows(cut, ids)  # (outside the block: dropped)
                rows = cuts.size_of(cut)
            else:
                dy = cuts.take(cut, dy, 2)
                cols = cuts.size_of(cut)
        if total is None:
            total = jnp.zeros((ids.shape[0], rows, cols), dy.dtype)
        b = jnp.broadcast_to(jnp.arange(ids.shape[0])[:, None], ids.shape)
        return total.at[b, ids].add(dy.astype(total.dtype), mode="drop")

    def sq_norms(self, ing):
        ids, valid, dy = self._rows(ing)
        s, first = self._segments(ids, valid, dy)
        return jnp.sum(jnp.where(first[..., None], jnp.square(s), 0), axis=(1, 2))

    def weighted_sum(self, ing, c):
        ids, valid, dy = self._unpack(ing)
        return self._view(self._scatter(ids, dy * c.astype(dy.dtype)[:, None, None]))

    def has_scaled_sq_norms(self, alone=False):
        return True

    def scaled_sq_norms(self, ctx):
        """Squared norms of the example's rows scaled to unit size (``dy``: the size of
        the layer's output; one more reduction and product over it)."""
        ids, valid, dy = ctx
        s = example_scale(dy)
        return self.sq_norms((ids, valid, scale_examples(dy, s))), s

    def rule(self, reduction, B):
        T = int(np.prod(self.site.eqn.outvars[0].aval.shape)) // self.d
        it = jnp.dtype(self.acc).itemsize
        if reduction.linear:
            return Rule(STREAMED, "scatter-add", float(B * T * self.d), 0.0)
        if self.fast_rule(reduction) is None and not reduction.weighted_by_norm:
            return Rule(
                MATERIALISED, "per-example table", float(B * self.V * self.d),
                float(B * self.V * self.d * it),
            )
        return Rule(
            STREAMED, "segment sums (T x T ids mask)", float(2 * B * T * T * self.d),
            float(B * T * (T + self.d) * it),
        )


EmbeddingKernel.FAST = {
    S.PhiSum: Fast(
        lambda k, ctx, r: k.phi_sum(ctx, r), lambda k, r: r.linear or _phi_zero_is_zero(r)
    ),
    S.SqNorms: Fast(lambda k, ctx, r: k.sq_norms(ctx)),
    S.Centered: Fast(lambda k, ctx, r: k.centered(ctx, r)),
    R.CentralMoments: Fast(lambda k, ctx, r: k.central_sums(ctx, r)),
    S.KronSum: Fast(  # (one-hot sites: one contracted axis, no dot batch, analysis)
        lambda k, ctx, r: kron.moments(
            [k.kron_factors(ctx)], tuple(k.site.view_shape), r, k.acc, k.budget
        )
    ),
}
# weighted rules: the weights after phi, and weighted centred moments (Kernel.FAST_WEIGHTED)
EmbeddingKernel.FAST_WEIGHTED = {
    S.PhiSum: Fast(
        lambda k, ctx, r, w: k.phi_sum(ctx, r, w),
        lambda k, r: r.linear or _phi_zero_is_zero(r),
    ),
    S.Centered: Fast(lambda k, ctx, r, w: k.centered(ctx, r, w)),
    R.CentralMoments: Fast(lambda k, ctx, r, w: k.central_sums(ctx, r, w)),
}


def _onehot_dense_ok(eqn, p, axis):
    """The one-hot axis is the only contracted dim, against a 2-D [V, d] weight (no dot batch)."""
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    xc, wc = (rc, lc) if p == 0 else (lc, rc)
    w_shape = tuple(eqn.invars[p].aval.shape)
    return not lb and tuple(xc) == (axis,) and len(w_shape) == 2 and len(wc) == 1


def _onehot_of(eqn, pos, patterns):
    """The `base.OneHot` when the data operand of the dense site ``eqn`` is a
    recognised ``one_hot(ids)``, else None."""
    pat = patterns.get(eqn.invars[1 - pos[0]])
    return pat if isinstance(pat, OneHot) else None


@register
class OneHotEmbeddingKernel(EmbeddingKernel):
    """``one_hot(ids) @ table``: a dense site computed as an embedding (rows = one-hot axis).

    Out-of-range ids give an all-zero one-hot row, i.e. no gradient (drop semantics).
    """

    kind = "onehot-embedding"
    anchors = (compat.dot_general_p,)
    priority = 1  # a special form of a dense site: asked before the dense kernel

    @classmethod
    def matches(cls, eqn, tag, pos, patterns):
        if len(pos) != 1 or tag.pre:
            return False
        oh = _onehot_of(eqn, pos, patterns)
        return oh is not None and _onehot_dense_ok(eqn, pos[0], oh.axis)

    @classmethod
    def extra_inputs(cls, eqn, tag, pos, patterns):
        return (_onehot_of(eqn, pos, patterns).ids,)  # the ids (read by `prepare`)

    def gathers_rows(self):
        return None  # rows on a one-hot axis of a view: no ghost cross term with a dense site

    def __init__(self, site, acc_dtype):
        from jaxpr_surgery._src.sites.dense_layout import canon

        Kernel.__init__(self, site, acc_dtype)
        self.c = canon(site)
        self.V, self.d = self.c.C, self.c.F

    def prepare(self, w, ext, ext_batched, dy):
        c = self.c
        ids = ext[-1]  # the ids are the last input (analysis)
        (dy,) = dy
        B = dy.shape[0]
        dy = jnp.transpose(dy, (0,) + tuple(1 + i for i in c.dy_perm))
        dy = dy.reshape(B, c.N, c.F).astype(self.acc)
        ids = canonical_ids(ids.reshape(B, c.N), self.V)
        valid = (ids >= 0) & (ids < self.V)
        dy = jnp.where(valid[..., None], dy, 0)
        return Rows(jnp.clip(ids, 0, self.V - 1), valid, dy)

    adds_in_place = False
    add_to_leaf = Kernel.add_to_leaf  # rows on a one-hot axis of a view: the generic path
    leaf_cut_axes = Kernel.leaf_cut_axes

    def _view(self, v):
        from jaxpr_surgery._src.sites.dense import DenseKernel

        return DenseKernel.to_view(self, v[..., None, :, :])

    def kron_factors(self, ctx):
        ids, valid, dy = ctx
        c = self.c
        cw, fd = c.canon_w, c.fdims
        return kron.Factors(
            (), ((cw[:1], kron.OneHot(ids, self.V)), (cw[1:], dy.reshape(dy.shape[:2] + fd)))
        )

    def kron_meta(self):
        c = self.c
        cw = c.canon_w
        m = kron.view_leaf_axes(self.site)
        meta = (c.N, (), (self.V,), c.fdims)
        return meta, kron.leaf_structure((), (cw[:1], cw[1:]), m)

    def dots(self, ctx, ref):
        c = self.c
        table = jnp.transpose(ref, c.canon_w).reshape(c.C, c.F)
        return super().dots(ctx, table)

    # (direct, materialise and weighted_sum map the table to the view by `_view`)
    def _table_2d(self):
        return False

