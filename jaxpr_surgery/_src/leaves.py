"""A leaf's statistics from its sites' ingredients, after the backward pass: one site's
(`single_site_leaf`: its kernel's reductions, the rest by `LEAF_ROUTES` or tiles of its
per-example gradients) or several sites' (`SharedLeaf`, tying: `multi_site_routes`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxpr_surgery._src import compat, cuts, dots, kron, tiling, views
from jaxpr_surgery._src import fingerprint as fp
from jaxpr_surgery._src import sink_keys as K
from jaxpr_surgery._src import stats as S
from jaxpr_surgery._src.clip_reductions import ClipNorms
from jaxpr_surgery._src.clipping import weighted_leaf
from jaxpr_surgery._src.ghost_cross import cross_fast, shared_norms_by_ghost
from jaxpr_surgery._src.norms import (
    GHOST_TOLERANCE,
    recompute_flagged,
    rounding,
    sqrt0,
    untrusted,
    with_bound,
)
from jaxpr_surgery._src.plans import Mode, at_site_pairs, needs_norms
from jaxpr_surgery._src.sites.base import acc_dtype_for, direct_norms, example_norm, stacked


def _slice_b(ing, depth, b0, size):
    return jax.tree.map(lambda x: compat.slice_at(x, b0, size, axis=depth), ing)


def leaf_cut_axes(shape, kernels) -> list:
    """The axes of a multi-site leaf every site can cut in feature blocks."""
    axes = set(range(len(shape)))
    for k in kernels:
        axes &= set(k.leaf_cut_axes())
    return sorted(axes)


def leaf_feature_tile(B, shape, acc, budget, kernels, gathered=None):
    """Blocks of features of a multi-site leaf's ``G`` (tiling.py), on an axis every
    site can cut, or None; only where a tile holds one example, or for a leaf
    ``gathered`` over the devices (a `gathers.AtSite`, `block_combined`: its blocks'
    values combined in the loop, each device's accumulators its shard's), whose blocks
    are then no larger than a device's share of the axis."""
    if gathered is None and tiling.leaf_tile(B, shape, acc, budget, kernels) != 1:
        return None
    axes = leaf_cut_axes(shape, kernels)
    ft = tiling.feature_tile(tuple(shape), acc, axes, budget,
                             whole_under_split=not any(k.split_blocks for k in kernels))
    if gathered is None or not axes:
        return ft
    axis = ft[0] if ft is not None else max(axes, key=lambda a: shape[a])
    share = max(1, shape[axis] // gathered.size)
    return (axis, share) if ft is None or ft[1] > share else ft


def tiled_materialised(plan, ings, mat, B, reductions, combine=None):
    """Reductions of a leaf's ``G [B, *leaf] = mat(b0, size)``, tile by tile (tiling.py;
    ``combine``: its ``combine``, `block_combined`)."""
    aval = plan.leaf_avals[ings[0][0].leaf]
    acc = acc_dtype_for(aval.dtype)
    ks = [k for _, k, _ in ings]
    tile = tiling.leaf_tile(B, aval.shape, acc, plan.budget, ks)
    ft = leaf_feature_tile(B, aval.shape, acc, plan.budget, ks, combine)
    features = ft and (*ft, mat)
    return tiling.reduce_tiles(
        mat, B, reductions, tile, shape=tuple(aval.shape), dtype=acc,
        features=features, combine=combine,
    )


def _shared_tiled(plan, i, tiled, rides):
    """``(indices, reductions)`` a tied leaf reads from tiles of its ``G`` (by
    `multi_site_routes`' ``tiled`` and ``rides``: the plain sums too); None: the norms
    clipping needs, read as squared norms."""
    js = tiled + [j for j, r in enumerate(plan.reductions) if r.linear] if rides else tiled
    return js, [S.SqNorms() if j is None or plan.reductions[j] == S.Norms()
                else plan.bound(plan.reductions[j], i) for j in js]


def combined_pairs(plan, B) -> frozenset:
    """The (reduction, leaf) pairs whose values the engine returns combined across the
    devices, typed as the combination leaves them: at their sites
    (`plans.at_site_pairs`) or in a tied leaf's block loop (`block_combined`). The
    engine and api.py (no combination afterwards) both decide by this function."""
    return at_site_pairs(plan) | {
        (j, i) for i in plan.at_site for j in block_combined(plan, i, B)}


def block_combined(plan, i, B) -> frozenset:
    """The reductions (indices) of tied leaf ``i`` whose values its tile loop combines
    across the devices block by block (`tiling.reduce_tiles`' ``combine``): a leaf
    gathered over them in hand-written FSDP (`Plan.at_site`, `gathers.AtSite`) whose
    ``G`` is read in blocks of features, of an axis the gather leaves whole or splits
    in strided blocks. Its sums then never stand whole on a device (the tied table of
    the scan stack's kurtosis at 1.4x grad's memory). `SharedLeaf` and
    `combined_pairs` both decide by this function."""
    at = plan.at_site.get(i)
    sites = plan.analysis.leaves[i].sites
    if at is None or plan.modes[i] is not Mode.INGREDIENTS or len(sites) < 2:
        return frozenset()
    aval, ks = plan.leaf_avals[i], [plan.kernels[s.path] for s in sites]
    acc = S.acc_dtype_for(aval.dtype)
    ft = leaf_feature_tile(B, aval.shape, acc, plan.budget, ks, at)
    over = None if ft is None else at.parts(ft[0])
    if over is None or (over > 1 and not cuts.strided_count(aval.shape[ft[0]], ft[1], over)):
        return frozenset()
    ghost_ok = plan.needs_norms and shared_norms_by_ghost(sites, ks, B, aval.shape, acc)
    # (Kronecker moments of a gathered leaf are refused: `gathers.check_reductions`)
    js, reds = _shared_tiled(plan, i, *multi_site_routes(plan.reductions, ghost_ok, False, ft))
    if not reds or not all(r.feature_blocks for r in reds):
        return frozenset()
    return frozenset(j for j, r in zip(js, reds) if j is not None and at.takes(r))


def _leaf_mat(ings, acc):
    """``mat(b0, size, cut=None)``: the leaf's summed per-example gradients of examples
    ``b0:b0+size`` (``cut``: a block of features, `leaf_feature_tile`) from its sites'
    ingredients."""

    def mat(b0, size, cut=None):
        total = None
        for s, k, ing in sorted(ings, key=lambda ski: ski[1].adds_in_place):
            ing = _slice_b(ing, s.depth, b0, size)
            if s.depth:
                g = jnp.moveaxis(stacked(k.materialise, s.depth)(ing), s.depth, 0)
                v = views.to_leaf(g, s).astype(acc)
                if cut is not None:
                    v = cuts.take(cut, v, cuts.axis_of(cut) + 1)
                total = v if total is None else total + v
            else:
                total = k.add_to_leaf(ing, total, lambda g, s=s: views.to_leaf(g, s), cut)
        return total

    return mat


def ingredient_leaf(plan, i, ings, B, values, norms_leaf, deferred, cache):
    """Reductions of a leaf from its sites' ingredients (after the backward pass)."""
    deferred[i] = weighted_leaf(ings, cache)
    with tiling.anchored(_anchors(ings)):
        if len(ings) == 1:
            single_site_leaf(plan, i, ings[0], B, values, norms_leaf, cache)
        else:
            SharedLeaf(plan, i, ings, B).run(values, norms_leaf, deferred[i])


def _anchors(ings):
    """What a leaf's loops start after: every floating ingredient of its sites (their
    inputs and cotangents, the last of which the backward pass gives late), or the first
    ingredient where none floats. The first alone (a lookup's ids, there from the
    program's start) let XLA make a tied table's block accumulators before the forward
    pass's logits, the peak: the scan stack's kurtosis on a 2-D mesh 1.37x grad's
    temporary memory."""
    leaves = jax.tree.leaves([ing for _, _, ing in ings])
    some = [x for x in leaves if jnp.issubdtype(x.dtype, jnp.inexact)]
    return some or leaves[:1]


def single_site_leaf(plan, i, ing3, B, values, norms_leaf, cache):
    """One site's leaf: every reduction the site can give in one call (they share its
    tile loop), the others by their leaf route (`LEAF_ROUTES`) or from tiles of its
    per-example gradients."""
    s, k, ing = ing3
    bound = [plan.bound(r, i) for r in plan.reductions]
    req = {
        K.reduction(j): r for j, r in enumerate(bound)
        if not r.weighted_by_norm and r.direct_ok(s) and S.lookup(LEAF_ROUTES, r) is None
    }
    if plan.needs_norms:  # (the norms clipping divides by: `ClipNorms`)
        req[K.CLIP_NORMS] = ClipNorms()
    sk = cache.site_key(s, k)
    key = sk and fp.keyed(lambda: ("leaf", sk, fp.value_key(req)))

    def leaf_fn(ing):  # with the conversion to leaf space: one jit per repeated leaf
        ctx = stacked(k.ctx, s.depth)(ing)

        def compute(rq):
            return stacked(lambda c: k.direct_all(c, rq), s.depth)(ctx)

        out = direct_norms(k, ctx, req, compute, s.depth)
        return {q: r.to_leaf(out[q], s, B) for q, r in req.items() if q in out}

    out = cache.get(key, lambda: leaf_fn)(ing)
    for j in range(len(plan.reductions)):
        if K.reduction(j) in out:
            values[j][i] = out[K.reduction(j)]
    if plan.needs_norms:
        norms_leaf[i] = out[K.CLIP_NORMS]
    acc = S.acc_dtype_for(plan.leaf_avals[i].dtype)
    mat = _leaf_mat([ing3], acc)
    rest = [j for j, r in enumerate(bound) if K.reduction(j) not in req and not r.weighted_by_norm]
    tiled = []
    for j in rest:
        route = S.lookup(LEAF_ROUTES, bound[j])
        if route is not None:
            values[j][i] = route(plan, i, [ing3], bound[j], B, mat)
        else:
            tiled.append(j)
    if tiled:  # the leaf's per-example gradient, tile by tile
        outs = tiled_materialised(plan, [ing3], mat, B, [bound[j] for j in tiled])
        for j, v in zip(tiled, outs):
            values[j][i] = v


class SharedLeaf:
    """A leaf several sites use (tying): its reductions by `multi_site_routes`."""

    def __init__(self, plan, i, ings, B):
        self.plan, self.i, self.ings, self.B = plan, i, ings, B
        self.aval = plan.leaf_avals[i]
        self.acc = S.acc_dtype_for(self.aval.dtype)
        self.mat = _leaf_mat(ings, self.acc)
        # (only norms ask; the layout check is numpy work)
        self.ghost_ok = plan.needs_norms and shared_norms_by_ghost(
            [s for s, _, _ in ings], [k for _, k, _ in ings], B, self.aval.shape, self.acc)
        # (a gathered leaf's values combined block by block, `block_combined`)
        self.combine = plan.at_site[i] if block_combined(plan, i, B) else None
        self.ft = leaf_feature_tile(B, self.aval.shape, self.acc, plan.budget,
                                    [k for _, k, _ in ings], self.combine)
        wants_kron = any(S.lookup(SHARED_ROUTES, r) is _kron_route for r in plan.reductions)
        # (weighted Kronecker moments: from tiles of the leaf's weighted examples)
        self.facs = leaf_factors(ings) if wants_kron and plan.weights is None else None
        self._rescued = {}  # id(sq) -> (sq, norms, recomputed): one per leaf
        self._untrusted = {}  # id(sq) -> [B] bool (`sq_norms`)
        self._bound = {}  # id(sq) -> [B], the bound of its rounding (`sq_norms`)
        self._sq = None

    def sq_norms(self):
        """Squared norms from each site's ghost norms and the pairs' cross terms, and
        which examples' sum cannot be trusted (`norms.untrusted`: the bound of its own
        and cross terms' rounding exceeds `norms.GHOST_TOLERANCE` of it, terms that
        cancelled), recomputed from the example's summed gradient (`norms`)."""
        if self._sq is None:
            crosses = [
                cross_fast(*self.ings[a], *self.ings[b])
                for a in range(len(self.ings)) for b in range(a + 1, len(self.ings))
            ]
            # (sites with a cross term lie outside scans: `cross_layout`)
            own = [k.sq_norms_bound(ing) for _, k, ing in self.ings]
            sq = sum(o for o, _ in own) + 2 * sum(c for c, _ in crosses)
            mags = sum(o for o, _ in own) + 2 * sum(jnp.abs(c) for c, _ in crosses)
            bound = (sum(e for _, e in own) + 2 * sum(e for _, e in crosses)
                     + rounding(len(own) + len(crosses), sq.dtype) * mags)
            tol = GHOST_TOLERANCE
            self._sq = sq
            self._untrusted[id(sq)] = untrusted(sq, bound, tol)
            self._bound[id(sq)] = bound
        return self._sq

    def norms(self, sq):
        """The leaf's norms from its squared norms ``sq``; where a square overflowed, or
        its ghost terms may have cancelled (`sq_norms`), from the example's summed
        gradient alone (`recompute_flagged`)."""
        if id(sq) not in self._rescued:
            ft, ings = self.ft, self.ings
            if ft is not None:
                blocks = (ft[0], ft[1], self.aval.shape[ft[0]])
            else:  # (one example formed alone: `tiling.RECOMPUTE_BUDGET_SHARE`)
                shape, ks = tuple(self.aval.shape), [k for _, k, _ in ings]
                blocks = tiling.recompute_tile(shape, self.acc, leaf_cut_axes(shape, ks),
                                               self.plan.budget)

            def exact(arrays, b):  # the ingredients as arguments (a custom_jvp's)
                m = _leaf_mat([(s, k, a) for (s, k, _), a in zip(ings, arrays)], self.acc)
                return example_norm(lambda cut: m(b, 1, cut), blocks)

            bad = self._untrusted.get(id(sq), jnp.logical_not(jnp.isfinite(sq)))
            args = [ing for _, _, ing in ings]
            self._rescued[id(sq)] = (sq, recompute_flagged(exact, args, sqrt0(sq), bad), bad)
        return self._rescued[id(sq)][1]

    def clip_norms(self):
        """The norms clipping divides by (`ClipNorms`): where the ghost sum holds, its
        value plus the bound of its rounding; the recomputed norm elsewhere."""
        sq = self.sq_norms()
        n = self.norms(sq)
        bound = jnp.where(self._rescued[id(sq)][2], 0, self._bound[id(sq)])
        return with_bound(n, sq, bound)

    def trusted_sq(self, sq):
        """``sq`` where it holds, the square of the recomputed norm where not (`norms`)."""
        n = self.norms(sq)
        return jnp.where(self._rescued[id(sq)][2], jnp.square(n), sq)

    def run(self, values, norms_leaf, weighted):
        plan, i, B = self.plan, self.i, self.B
        tiled, rides = multi_site_routes(plan.reductions, self.ghost_ok, self.facs is not None,
                                         self.ft)
        todo, reds = _shared_tiled(plan, i, tiled, rides)
        sums = [] if rides else [j for j, r in enumerate(plan.reductions) if r.linear]
        for j, r in enumerate(plan.reductions):
            if j not in todo and not r.weighted_by_norm and not r.linear:
                values[j][i] = S.lookup(SHARED_ROUTES, r)(self, plan.bound(r, i))
        if plan.needs_norms and None not in todo:
            norms_leaf[i] = self.clip_norms()
        if sums:
            w = jnp.ones((B,), self.acc) if plan.weights is None else plan.weights[0]
            total = weighted(w.astype(self.acc))
            for j in sums:
                values[j][i] = total
        if todo:
            # (the clipping norms read as squared norms: tiles sum squares of G, inf on
            # overflow, which `norms` rescues; centred sums take one pass, tiling.py)
            outs = tiled_materialised(plan, self.ings, self.mat, B, reds, self.combine)
            for j, v in zip(todo, outs):
                if j is None:
                    norms_leaf[i] = self.norms(v)
                elif plan.reductions[j] == S.Norms():
                    values[j][i] = self.norms(v)
                else:
                    values[j][i] = v


def _sq_route(leaf, r):  # (cross terms may cancel, or be NaN from overflow)
    return leaf.trusted_sq(leaf.sq_norms())


def _norms_route(leaf, r):
    return leaf.norms(leaf.sq_norms())


def _kron_route(leaf, r):
    return kron.moments(leaf.facs, tuple(leaf.aval.shape), r, leaf.acc, leaf.plan.budget)


def _dots_route(leaf, r):
    return leaf_dots(leaf.plan, leaf.i, leaf.ings, r, leaf.B, leaf.mat)


# A shared leaf's reductions with a route of their own (else tiles of its summed
# per-example gradient), keyed by reduction type; ``multi_site_routes`` says which
# are open (norms: the sites' ghost forms and cross terms; Kronecker: token factors).
SHARED_ROUTES = {
    S.SqNorms: _sq_route,
    S.Norms: _norms_route,
    S.KronSum: _kron_route,
    dots._PerExampleDots: _dots_route,
}


# whether a shared route serves, given ``(ghost_ok, kron_ok)`` (`multi_site_routes`)
_SERVES = {_sq_route: lambda ghost, kron: ghost, _norms_route: lambda ghost, kron: ghost,
           _kron_route: lambda ghost, kron: kron, _dots_route: lambda ghost, kron: True}


def leaf_dots(plan, i, ings, r, B, mat):
    """``<g_b, ref>`` of a leaf, ``[B]`` (``r``: a `dots.BoundDot`): each site's
    contraction of the reference with its inputs where its view permutes the leaf;
    else tiles of the leaf's per-example gradients."""
    acc = S.acc_dtype_for(plan.leaf_avals[i].dtype)
    if all(kron.leaf_map(s) is not None for s, _, _ in ings):
        # the reference in each site's view (transposed, sliced the same way)
        total = None
        for s, k, ing in ings:
            v = k.dots(k.ctx(ing), views.from_leaf(jnp.asarray(r.ref), s).astype(acc))
            total = v if total is None else total + v
        return total
    return tiled_materialised(plan, ings, mat, B, [r])[0]


# A single site's reductions computed from the leaf rather than by the site's kernel,
# keyed by reduction type (dots: the reference in the site's view)
LEAF_ROUTES = {dots.BoundDot: leaf_dots}


def multi_site_routes(reductions, ghost_ok, kron_ok, leaf_ft):
    """How a leaf used by several sites (tying) gets its reductions: ``(tiled, rides)``.

    ``tiled``: the reductions (indices; None for the norms that clipping needs) read
    from tiles of the leaf's summed per-example gradient; the others come from the
    sites' own forms (`SHARED_ROUTES`): squared norms from their ghost norms and cross
    terms (``ghost_ok``), Kronecker moments from their token factors (``kron_ok``),
    dots with a reference per site, plain sums by one contraction per site. ``rides``:
    the plain sums are added in that tile loop instead: centred sums give them for
    free (tiling.py), and with ``G`` (or its blocks, ``leaf_ft``) in cache, one
    example a tile on CPU, the add is faster than a contraction per site (long
    transformer, tied embedding: mean+E[g²] 1.16-1.24x -> 1.00-1.04x E[g²] alone);
    elsewhere a contraction per site is faster than a second consumer of a whole
    ``G_b``. The engine and `explain` both decide by this function.
    """
    def served(r):
        route = S.lookup(SHARED_ROUTES, r)
        return route is not None and _SERVES[route](ghost_ok, kron_ok)

    tiled = [j for j, r in enumerate(reductions)
             if not r.weighted_by_norm and not r.linear and not served(r)]
    if needs_norms(reductions) and not ghost_ok:
        tiled.append(None)
    rides = bool(tiled) and (
        any(j is not None and reductions[j].knows_total for j in tiled)
        or leaf_ft is not None
        or tiling.prefer_per_example()
    )
    return tiled, rides


def leaf_factors(ings):
    """The token factors of a multi-site leaf's sites in leaf axes, or None where some
    site has none (generic sites, views that reshape the leaf, layers inside scans) or
    they do not line up (tokens can be concatenated only with one structure)."""
    out = []
    for s, k, ing in ings:
        axes = kron.leaf_axes(s)
        if axes is None or not hasattr(k, "kron_factors"):
            return None
        out.append(k.kron_factors(k.ctx(ing)).to_leaf_axes(axes))
    if len({f.structure for f in out}) != 1 or (len(out) > 1 and out[0].kaxes):
        return None
    return out
