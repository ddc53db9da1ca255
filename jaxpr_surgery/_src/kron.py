"""Per-example Kronecker moments (``kron_moments``) from token factors.

For a leaf of shape ``(n_1, ..., n_k)`` the reduction `KronSum` is, per axis ``j``,

    M_j = sum_b U_j(g_b) U_j(g_b)^T,   U_j(g) = moveaxis(g, j, 0).reshape(n_j, -1),

or its diagonal when ``n_j > max_dim``. At dense, einsum, conv-over-patches and
embedding sites the per-example gradient is a sum over tokens of outer products,

    G_b[k, p, q] = sum_n P_{b,k,n}[p] Q_{b,k,n}[q]

(``k``: block dims shared with the weight, ``p``/``q``: the two groups of the
other axes; for an embedding ``P`` is the one-hot row of a token's id). For an
axis ``a`` of group ``p`` with the rest ``r`` of the group,

    M_a = sum_b sum_k sum_{n,m} (Q_n . Q_m) P_n[a, r] P_m[a', r],

token grams and one sandwich per example: no ``G_b`` is ever formed. A leaf
shared by several such sites (a tied embedding and unembedding) concatenates
their tokens. Axes of the shared block dims use cross-block grams. Examples are
processed in tiles (`tiling.sum_tiles`); elsewhere (generic sites, layers inside
``lax.scan``, views that reshape the leaf) the moments come from tiles of
materialised per-example gradients, the exact fallback.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from jaxpr_surgery._src import tiling
from jaxpr_surgery._src.kron_sum import kron_value_shapes as value_shapes
from jaxpr_surgery._src.views import leaf_axes, leaf_map  # noqa: F401 - kron.leaf_axes


def view_leaf_axes(site):
    """For each axis of the site's view, the leaf axis it lies on (`leaf_map`), or None."""
    lm = leaf_map(site)
    return None if lm is None else tuple(a for a, _, _ in lm)


# --------------------------------------------------------------------------- #
# Token factors
# --------------------------------------------------------------------------- #
@dataclasses.dataclass(frozen=True)
class OneHot:
    """The one-hot rows of token ids ``[B, n]`` (int32, in range) over ``size`` rows."""

    ids: jax.Array
    size: int


jax.tree_util.register_pytree_node(
    OneHot, lambda o: ((o.ids,), o.size), lambda size, ch: OneHot(ch[0], size)
)


@dataclasses.dataclass(frozen=True)
class Factors:
    """``G_b = sum_n P_n (x) Q_n`` per block ``k``, for one site.

    Attributes:
      kaxes: axes (of the view, or of the leaf after `to_leaf_axes`) of the block
        dims, in the factors' order.
      groups: two ``(axes, F)``: ``F`` is ``[B, *kdims, n, *dims of axes]`` or a
        `OneHot` (one axis, no block dims).
    """

    kaxes: tuple
    groups: tuple

    def to_leaf_axes(self, m):
        """The same factors with view axes renamed to leaf axes ``m[view axis]`` and
        every group's axes sorted (so sites tied on one leaf line up)."""
        kaxes = tuple(m[a] for a in self.kaxes)
        groups = []
        nk = len(kaxes)
        for axes, F in self.groups:
            axes = tuple(m[a] for a in axes)
            order = sorted(range(len(axes)), key=lambda i: axes[i])
            if not isinstance(F, OneHot) and order != list(range(len(axes))):
                lead = F.ndim - len(axes)
                F = jnp.transpose(F, tuple(range(lead)) + tuple(lead + i for i in order))
            groups.append((tuple(axes[i] for i in order), F))
        groups.sort(key=lambda g: min(g[0]) if g[0] else -1)
        korder = sorted(range(nk), key=lambda i: kaxes[i])
        if korder != list(range(nk)):
            groups = [
                (
                    ax,
                    F
                    if isinstance(F, OneHot)
                    else jnp.transpose(
                        F, (0,) + tuple(1 + i for i in korder) + tuple(range(1 + nk, F.ndim))
                    ),
                )
                for ax, F in groups
            ]
            kaxes = tuple(kaxes[i] for i in korder)
        return Factors(kaxes, tuple(groups))

    @property
    def structure(self):
        return (self.kaxes, tuple(ax for ax, _ in self.groups))


def leaf_structure(kaxes, gaxes, m):
    """`Factors.structure` after `Factors.to_leaf_axes` (static: for explain)."""
    groups = sorted(
        (tuple(sorted(m[a] for a in ax)) for ax in gaxes), key=lambda ax: min(ax) if ax else -1
    )
    return (tuple(sorted(m[a] for a in kaxes)), tuple(groups))


def _slice(F, b0, size):
    if isinstance(F, OneHot):
        return OneHot(jax.lax.dynamic_slice_in_dim(F.ids, b0, size, 0), F.size)
    return jax.lax.dynamic_slice_in_dim(F, b0, size, 0)


def _index(F, i):
    return OneHot(F.ids[i], F.size) if isinstance(F, OneHot) else F[i]


def _flat(F, nk):
    """One example's dense factor ``[*kd, n, *dims]`` as ``[*kd, n, prod(dims)]``."""
    return F.reshape(F.shape[: nk + 1] + (-1,))


def _dense(F, nk):
    if isinstance(F, OneHot):
        return jax.nn.one_hot(F.ids, F.size, dtype=jnp.float32)
    return F


def _gram(Fa, Fb, nk, dtype):
    """``[*kd, n_a, n_b]``: inner products of one example's tokens over a group."""
    oa, ob = isinstance(Fa, OneHot), isinstance(Fb, OneHot)
    if oa and ob:
        return (Fa.ids[:, None] == Fb.ids[None, :]).astype(dtype)
    if oa:
        return jnp.take(Fb, Fa.ids, axis=1).T
    if ob:
        return jnp.take(Fa, Fb.ids, axis=1)
    return jnp.einsum("...nx,...mx->...nm", _flat(Fa, nk), _flat(Fb, nk))


def _moved_rows(F, nk, pos):
    """Dense one-example factor ``[*kd, n, *dims]`` as ``[dims[pos], rest]``."""
    F = jnp.moveaxis(F, nk + 1 + pos, 0)
    return F.reshape(F.shape[0], -1)


# --------------------------------------------------------------------------- #
# One example's contributions, per leaf axis
# --------------------------------------------------------------------------- #
def _example_terms(sites, axes_wanted, max_dim, sizes, dtype):
    """For one example: per wanted axis, a list of terms: a pair ``(L, T)`` (the axis's
    moment is ``sum L T^T`` over examples) or an array (added up over examples).

    ``sites`` is a list of one-example `Factors` sharing one structure.
    """
    kaxes, gaxes = sites[0].structure
    nk = len(kaxes)
    out = {}
    grams = {}

    def gram(gi, s, t):
        key = (gi, s, t)
        if key not in grams:
            grams[key] = _gram(sites[s].groups[gi][1], sites[t].groups[gi][1], nk, dtype)
        return grams[key]

    for ax in axes_wanted:
        n_ax = sizes[ax]
        full = n_ax <= max_dim
        if ax in kaxes:
            out[ax] = [_block_axis_term(sites, nk, kaxes.index(ax), n_ax, full)]
            continue
        gi = next(i for i, a in enumerate(gaxes) if ax in a)
        pos = gaxes[gi].index(ax)
        if full:
            out[ax] = _group_axis_pairs(sites, nk, gi, pos, gram)
        else:
            out[ax] = [_group_axis_diagonal(sites, nk, gi, pos, n_ax, gram, dtype)]
    return out


def _block_axis_term(sites, nk, kp, n_ax, full):
    """The moment of block axis ``kp`` (a dot batch dim of the factors), ``[n, n]`` or
    its diagonal ``[n]``: cross-block grams ``[a, A, rest k, n, m]`` per group,
    multiplied over the two groups and summed over every pair of sites."""
    acc = None
    for fs in sites:
        for ft in sites:
            prod = None
            for gi in range(2):
                Fa = _flat(fs.groups[gi][1], nk)
                Fb = _flat(ft.groups[gi][1], nk)
                Fa = jnp.moveaxis(Fa, kp, 0).reshape((n_ax, -1) + Fa.shape[nk:])
                Fb = jnp.moveaxis(Fb, kp, 0).reshape((n_ax, -1) + Fb.shape[nk:])
                g = (
                    jnp.einsum("aknx,Akmx->aAknm", Fa, Fb)
                    if full
                    else jnp.einsum("aknx,akmx->aknm", Fa, Fb)
                )
                prod = g if prod is None else prod * g
            v = jnp.sum(prod, axis=(-3, -2, -1))
            acc = v if acc is None else acc + v
    return acc


def _group_axis_pairs(sites, nk, gi, pos, gram):
    """The full moment of axis ``pos`` of group ``gi`` as pairs ``(L, T)``, one per
    site: ``L`` its factor's rows along the axis, ``T`` the other group's grams applied
    to every site's factor."""
    hi = 1 - gi
    terms = []
    for s in range(len(sites)):
        L = _dense(sites[s].groups[gi][1], nk)
        T = None
        for t in range(len(sites)):
            W = gram(hi, s, t)
            Ft = _dense(sites[t].groups[gi][1], nk)
            Tt = jnp.einsum("...nm,...mx->...nx", W, _flat(Ft, nk)).reshape(
                W.shape[:-1] + Ft.shape[nk + 1 :]
            )
            T = Tt if T is None else T + Tt
        terms.append((_moved_rows(L, nk, pos), _moved_rows(T, nk, pos)))
    return terms


def _group_axis_diagonal(sites, nk, gi, pos, n_ax, gram, dtype):
    """The diagonal ``[n]`` of the moment of axis ``pos`` of group ``gi`` (an axis
    longer than ``max_dim``); one-hot factors add at their ids' rows."""
    hi = 1 - gi
    vec = jnp.zeros((n_ax,), dtype)
    dense_T = {}
    for s in range(len(sites)):
        Fs = sites[s].groups[gi][1]
        for t in range(len(sites)):
            Ft = sites[t].groups[gi][1]
            W = gram(hi, s, t)
            os_, ot = isinstance(Fs, OneHot), isinstance(Ft, OneHot)
            if not os_ and not ot:
                Tt = jnp.einsum("...nm,...mx->...nx", W, _flat(Ft, nk)).reshape(
                    W.shape[:-1] + Ft.shape[nk + 1 :]
                )
                dense_T[s] = Tt if s not in dense_T else dense_T[s] + Tt
            elif os_ and ot:
                eq = (Fs.ids[:, None] == Ft.ids[None, :]).astype(dtype)
                vec = vec.at[Fs.ids].add(jnp.sum(W * eq, axis=1))
            elif os_:  # sum_m W[n, m] Ft[m, id_n], at row id_n
                vals = jnp.einsum("nm,mn->n", W, jnp.take(Ft, Fs.ids, axis=1))
                vec = vec.at[Fs.ids].add(vals)
            else:  # sum_n W[n, m] Fs[n, id_m], at row id_m
                vals = jnp.einsum("nm,nm->m", W, jnp.take(Fs, Ft.ids, axis=1))
                vec = vec.at[Ft.ids].add(vals)
    for s, T in dense_T.items():
        L = sites[s].groups[gi][1]
        vec = vec + jnp.sum(_moved_rows(L, nk, pos) * _moved_rows(T, nk, pos), axis=1)
    return vec


def _tile_value(sites, axes_wanted, max_dim, sizes, dtype, size):
    """Sum over one tile of examples (``size`` static): per axis, the moment's part."""
    if size == 1:  # plain 2-D products (a batched dot_general is slow on XLA:CPU)
        one = [Factors(f.kaxes, tuple((a, _index(F, 0)) for a, F in f.groups)) for f in sites]
        terms = jax.tree.map(
            lambda x: x[None], _example_terms(one, axes_wanted, max_dim, sizes, dtype)
        )
    else:

        def ex(arrays):
            one = [
                Factors(f.kaxes, tuple((a, F) for (a, _), F in zip(f.groups, fs)))
                for f, fs in zip(sites, arrays)
            ]
            return _example_terms(one, axes_wanted, max_dim, sizes, dtype)

        terms = jax.vmap(ex)([[F for _, F in f.groups] for f in sites])
    out = {}
    for ax, ts in terms.items():
        acc = None
        for t in ts:
            if isinstance(t, tuple):
                v = jnp.einsum("bax,bAx->aA", t[0], t[1], precision="highest")
            else:
                v = jnp.sum(t, axis=0)
            acc = v if acc is None else acc + v
        out[ax] = acc
    return out


def bytes_per_example(sites, dtype):
    """Rough scratch of one example: its factors twice (the weighted tokens) and grams."""
    it = jnp.dtype(dtype).itemsize
    total, ntok = 0, 0
    for f in sites:
        for _, F in f.groups:
            if isinstance(F, OneHot):
                ntok = max(ntok, F.ids.shape[1])
            else:
                total += math.prod(F.shape[1:])
    return int(it * (2 * total + 4 * ntok * ntok + 1))


def moments(sites, shape, r, dtype, budget=None):
    """`KronSum` value (a tuple over the leaf's axes) of a leaf whose per-example gradient
    is the sum of the given sites' factors (all with one structure, in leaf axes)."""
    if not shape:
        return ()
    B = _batch(sites[0])
    sizes = tuple(int(n) for n in shape)
    if _empty(sites, sizes):
        # no tokens (T = 0) or a zero-width axis: every per-example gradient is an empty
        # sum or has no entries, so each axis's moment is zeros
        return tuple(jnp.zeros(s, dtype) for s in value_shapes(sizes, r))
    per_ex = (
        any(
            not isinstance(F, OneHot) and F.shape[1 + len(f.kaxes)] > 1
            for f in sites
            for _, F in f.groups
        )
        and tiling.prefer_per_example()
    )
    tile = tiling.tile_size(B, bytes_per_example(sites, dtype), budget, batched_ok=not per_ex)
    axes = tuple(range(len(shape)))
    vals = tiling.sum_tiles(
        lambda b0, size: _tile_value(
            [Factors(f.kaxes, tuple((a, _slice(F, b0, size)) for a, F in f.groups)) for f in sites],
            axes,
            r.max_dim,
            sizes,
            dtype,
            size,
        ),
        B,
        tile,
    )
    return tuple(vals[a].astype(dtype) for a in axes)


def _empty(sites, sizes):
    """The leaf has a zero-size axis, or some site's factors hold no entries (no
    tokens, a zero-width group): the moments are zeros."""
    if 0 in sizes:
        return True
    for f in sites:
        for _, F in f.groups:
            if (F.ids if isinstance(F, OneHot) else F).size == 0:
                return True
    return False


def _batch(f):
    F = f.groups[0][1]
    return (F.ids if isinstance(F, OneHot) else F).shape[0]


def flops(sites_meta, r, B):
    """Rough extra FLOPs for explain; ``sites_meta``: ``(n_tokens, kdims, pdims, qdims)``."""
    total = 0.0
    for n, kd, pd, qd in sites_meta:
        K, P, Q = math.prod(kd), math.prod(pd), math.prod(qd)
        total += 2.0 * B * K * n * n * (P + Q)  # token grams and weighted tokens
        total += sum(2.0 * B * K * n * P * min(a, r.max_dim) for a in pd)
        total += sum(2.0 * B * K * n * Q * min(a, r.max_dim) for a in qd)
        total += sum(2.0 * B * K * a * a * n * n * (P + Q) for a in kd)
    return total
