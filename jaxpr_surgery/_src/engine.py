"""One pass over a chunk of examples: plan, batched forward, one VJP, assembly.

``Plan`` is built once per trace from the analysed per-example jaxpr; ``run``
evaluates one chunk of ``B`` examples and returns the reduced values of every
requested reduction for every leaf (in leaf space), the per-example losses and
the per-example aux outputs.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxpr_surgery._src import compat, cuts, dots, kron, tiling, views
from jaxpr_surgery._src import example_weights as ew
from jaxpr_surgery._src import fingerprint as fp
from jaxpr_surgery._src import stats as S
from jaxpr_surgery._src.analysis import LeafUse
from jaxpr_surgery._src.interpreter import (
    CARRY_COUNT,
    CARRY_WEIGHT,
    EX_WEIGHTS,
    KEPT,
    SUMS,
    WEIGHTS,
    Evaluator,
    make_site_fn,
    make_weighted_site_fn,
)
from jaxpr_surgery._src.norms import (
    GHOST_TOLERANCE,
    combine_norms,
    live_examples,
    recompute_flagged,
    rounding,
    sqrt0,
    staged_sum,
    untrusted,
    with_bound,
)
from jaxpr_surgery._src.reductions import ClipNorms, KeptExamples, nonfinite_examples
from jaxpr_surgery._src.sites import kernel_for
from jaxpr_surgery._src.sites.base import (
    Candidate,
    acc_dtype_for,
    cheapest,
    direct_norms,
    example_norm,
    weighted_sum_materialised,
)

SDS = jax.ShapeDtypeStruct


class Mode(enum.Enum):
    """How the engine computes a leaf's statistics (`Plan.modes`)."""

    DIRECT = enum.auto()  # its one site reduces inside the backward pass
    INGREDIENTS = enum.auto()  # its sites emit ingredients, reduced after it
    RESIDUAL = enum.auto()  # from per-example copies of the leaf (their gradients)
    UNUSED = enum.auto()  # the loss does not depend on it: zeros


@dataclasses.dataclass
class Plan:
    closed: Any  # ClosedJaxpr of the per-example loss
    analysis: Any
    leaf_avals: list
    reductions: list  # unique Reduction objects
    n_ex: int
    n_other: int
    out_tree: Any  # treedef of (loss, aux)
    kernels: dict = dataclasses.field(default_factory=dict)  # path -> Kernel
    modes: list = dataclasses.field(default_factory=list)  # per leaf: `Mode`
    budget: int | None = None  # memory_budget_bytes: bytes per tile of per-example gradients
    # reductions that depend on the leaf (`Reduction.per_leaf`) -> the one of each leaf
    refs: dict = dataclasses.field(default_factory=dict)
    # clipped sums by a second, reweighted backward pass (see `clips_by_recompute`)
    clip_recompute: bool = False
    # sites finish their statistics before the backward pass goes on (make_site_fn)
    finish_sites_first: bool = True
    # clipped sums in one pass: every site also keeps its ingredients (x, dy) for the
    # reweighted sum once all norms are known
    keep_for_clip: bool = False
    # one chunk's ``example_weights``: ``(w [B], W0)``, the weight of the examples of
    # earlier chunks (set by `run` for its chunk; None: unweighted)
    weights: Any = None

    def with_consts(self, consts):
        """This plan with ``consts`` for its jaxpr's constants (the same values, passed
        as arguments where a transformation needs every traced input explicit)."""
        if all(a is b for a, b in zip(consts, self.closed.consts)):
            return self
        closed = compat.ClosedJaxpr(self.closed.jaxpr, list(consts))
        return dataclasses.replace(self, closed=closed)

    @property
    def needs_norms(self):
        return needs_norms(self.reductions)

    @property
    def has_clip(self):
        return any(r.weighted_by_norm for r in self.reductions)

    def site_requests(self):
        """What a direct-mode site computes inside the backward pass: every reduction,
        except that a clipped sum needs only the norms there (its weighted sum comes
        once every leaf's norm is known)."""
        req = {rkey(j): r for j, r in enumerate(self.reductions) if not r.weighted_by_norm}
        if self.has_clip:  # (the norms clipping divides by: `ClipNorms`)
            req[CLIP_NORMS] = ClipNorms()
        return req

    def bound(self, r, i, carry=None):
        """``r`` for leaf ``i`` (a reduction that depends on the leaf: `per_leaf`), over
        the chunk's weighted examples where it has ``example_weights`` (`stats.Weighted`:
        counted from the chunk's first example, or with ``carry`` from the first of the
        earlier chunks')."""
        b = self.refs[r][i] if r in self.refs else r
        if self.weights is None or not S.weighs(b):
            return b
        w, W0 = self.weights
        return S.Weighted(b, w) if carry is None else S.Weighted(b, w, carry.n, W0)


def rkey(j):
    return f"r{j}"


CLIP_NORMS = "clip_norms"  # the key of a site's `ClipNorms` (never an `rkey`)


def make_plan(
    closed,
    analysis,
    leaf_avals,
    reductions,
    n_ex,
    n_other,
    out_tree,
    budget=None,
    flatten=None,
    data_axes=frozenset(),
):
    """``flatten(tree)``: a pytree shaped like the differentiated arguments as a list per
    leaf (references of `DotWith`). ``data_axes``: the shard_map axes the examples vary
    over (typed: the jaxpr casts the parameters to varying, and the VJP of such a cast
    is a psum, which would give the second pass of a clipped sum the whole mesh's sum:
    there clipped sums keep the one-pass form)."""
    plan = Plan(closed, analysis, leaf_avals, reductions, n_ex, n_other, out_tree, budget=budget)
    remat = uses_remat(closed.jaxpr)
    # (under a batch split by device, cuts.py, the second pass would repeat the model's
    # collectives: one pass, keeping the products, measured 2.4x -> 1.06x grad's bytes
    # and 3.9x -> 1.7x its memory on a tensor-parallel scan stack)
    plan.clip_recompute = plan.has_clip and not data_axes and remat and cuts.split_count() == 1
    plan.finish_sites_first = not remat
    plan.keep_for_clip = plan.has_clip and not plan.clip_recompute
    for r in reductions:
        bound = r.per_leaf(flatten, leaf_avals)
        if bound is not None:
            plan.refs[r] = bound
    for i in range(len(leaf_avals)):
        use = analysis.use(i)
        # a reduction a site cannot give alone inside the backward pass (Kronecker
        # moments of a layer inside lax.scan or of a view that reshapes its leaf,
        # dots with a reference) takes the leaf's ingredients afterwards
        if use is LeafUse.SINGLE and all(
                r.direct_ok(analysis.leaves[i].sites[0]) for r in reductions):
            plan.modes.append(Mode.DIRECT)
        elif use in (LeafUse.SINGLE, LeafUse.MULTI):
            plan.modes.append(Mode.INGREDIENTS)
        else:
            plan.modes.append(Mode.RESIDUAL if use is LeafUse.RESIDUAL else Mode.UNUSED)
    # (one decision per call: every tile loop, explain's rules and the cost model agree)
    cache_blocks = any(r.cache_blocks for r in reductions)
    for p, site in analysis.sites.items():
        dts = [site.base.aval.dtype] + [v.aval.dtype for v in site.eqn.outvars]
        plan.kernels[p] = kernel_for(site, acc_dtype_for(*dts), budget, cache_blocks)
    return plan


def _site_request(plan, site):
    mode = plan.modes[site.leaf]
    if mode is Mode.DIRECT:
        req = plan.site_requests()
        if plan.keep_for_clip and plan.kernels[site.path].keeps_products_for_clip():
            # the norms' tile loop keeps each G_b for the clipped sum: no contraction
            # after the norms, and less memory than x and dy (`keeps_products_for_clip`)
            req[KEPT] = KeptExamples()
        return req, plan.keep_for_clip
    return {}, True


def uses_remat(jaxpr) -> bool:
    """Whether the jaxpr (or one it calls) contains ``jax.checkpoint``."""
    for eqn in jaxpr.eqns:
        if eqn.primitive is compat.remat_p:
            return True
        if any(uses_remat(getattr(j, "jaxpr", j)) for j in compat.subjaxprs(eqn)):
            return True
    return False


def clips_by_recompute(jaxpr) -> bool:
    """Clipped sums by a second backward pass where the loss uses ``jax.checkpoint``.

    A clipped sum ``sum_b c_b g_b`` needs every example's norm before any weight,
    so in one pass each site keeps its ``x`` and ``dy`` until the norms are known:
    the activations of every layer at once, which remat exists to avoid. With remat
    in the loss the norms come from the first pass and the sum from a second forward
    and backward pass in which each site weights its per-example gradients by ``c``
    (`_reweighted_sums`; grad's memory, one more forward and backward)."""
    return uses_remat(jaxpr)


def _sink_avals(plan, site, B, cache):
    kernel = plan.kernels[site.path]
    direct, want_ing = _site_request(plan, site)
    lead = tuple(site.scan_lengths)
    # the statistics: known without tracing the kernel (`Reduction.aval`)
    def aval(r):
        a = r.aval(tuple(site.view_shape), kernel.acc, B)
        return jax.tree.map(lambda x: SDS(lead + tuple(x.shape), x.dtype), a)

    out = {k: aval(r) for k, r in direct.items()}
    if KEPT in out:  # the products kept are the ingredients
        out["ing"] = out.pop(KEPT)
    if not want_ing or "ing" in out:
        return out
    # the ingredients: as the kernel states them, else traced once for repeated layers
    ing = kernel.ingredient_avals(B)
    if ing is None:
        sk = cache.site_key(site, kernel)
        key = sk and ("sink-ingredients", sk, B)
        ing = cache.value(key, lambda: _traced_ingredient_avals(site, kernel, B))
    out["ing"] = jax.tree.map(lambda a: SDS(lead + tuple(a.shape), a.dtype), ing)
    return out


def _traced_ingredient_avals(site, kernel, B):
    """The shapes of a site's ingredients for ``B`` examples, by tracing its kernel."""
    w = SDS(site.view_shape, site.base.aval.dtype)
    ext = tuple(
        SDS(((B,) if b else ()) + tuple(v.aval.shape), v.aval.dtype)
        for v, b in zip(site.ext_vars, site.ext_batched)
    )
    dy = tuple(SDS((B,) + tuple(v.aval.shape), v.aval.dtype) for v in site.eqn.outvars)

    def f(w, ext, dy):
        return kernel.ingredients(kernel.prepare_site(w, ext, site.ext_batched, dy))

    return jax.eval_shape(f, w, ext, dy)


def _stacked(fn, depth):
    for _ in range(depth):
        fn = jax.vmap(fn)
    return fn


_to_leaf = views.to_leaf
_from_leaf = views.from_leaf


def value_dtype(plan, i):
    """The dtype of leaf ``i``'s merged statistics: the widest of the leaf's accumulation
    dtype and its sites' (a float32 leaf meeting float64 data under x64 accumulates in
    float64), whatever route computed them, so that chunks carry one type."""
    return jnp.result_type(
        acc_dtype_for(plan.leaf_avals[i].dtype),
        *(plan.kernels[s.path].acc for s in plan.analysis.leaves[i].sites),
    )


def _typed(plan, i, v, axes):
    """A merged value of leaf ``i`` in `value_dtype`, varying over ``axes`` (shard_map)."""
    dt = value_dtype(plan, i)
    return jax.tree.map(lambda x: compat.make_varying(x.astype(dt), axes), v)


def zero_carry(plan, diff_leaves, data_axes):
    """The running accumulators before the first chunk (a `stats.Carry` over no
    examples): `Reduction.empty`, typed like `run`'s merged values."""
    values = {}
    for j, r in enumerate(plan.reductions):
        if r.per_example:
            continue
        values[j] = [
            _typed(plan, i, plan.bound(r, i).empty(tuple(aval.shape), aval.dtype),
                   data_axes | compat.vma_of(x))
            for i, (x, aval) in enumerate(zip(diff_leaves, plan.leaf_avals))
        ]
    return S.Carry(values, 0)


def _carry_sink(plan, site, sink, carry, axes):
    """A direct-mode site's sink seeded with the running values of earlier chunks (its
    tile loops continue them: interpreter.carried) and their count."""
    sink = dict(sink)
    for j, r in enumerate(plan.reductions):
        key = rkey(j)
        if key in sink and r.carries:
            v = r.from_leaf(carry.values[j][site.leaf], site)
            dt = jax.tree.leaves(sink[key])[0].dtype  # the site's accumulation dtype
            sink[key] = jax.tree.map(lambda x, dt=dt: compat.make_varying(x.astype(dt), axes), v)
    acc = plan.kernels[site.path].acc
    n = jnp.broadcast_to(jnp.asarray(carry.n, acc), tuple(site.scan_lengths))
    sink[CARRY_COUNT] = compat.make_varying(n, axes)
    if plan.weights is not None:
        W0 = jnp.broadcast_to(jnp.asarray(plan.weights[1], acc), tuple(site.scan_lengths))
        sink[CARRY_WEIGHT] = compat.make_varying(W0, axes)
    return sink


@dataclasses.dataclass
class _Chunk:
    """One chunk's arguments: the differentiated, per-example and other leaves."""

    diff: list
    ex: list
    other: list
    B: int
    data_axes: frozenset

    def leaf_axes(self, i):
        """The axes leaf ``i``'s statistics vary over: the data axes and those it is
        sharded on (tensor parallelism inside shard_map: each shard's part)."""
        return self.data_axes | compat.vma_of(self.diff[i])

    def copies(self, plan):
        """Per-example copies of the residual leaves (their gradients: per example)."""
        B = self.B
        return {
            i: compat.make_varying(
                jnp.broadcast_to(self.diff[i], (B,) + tuple(jnp.shape(self.diff[i]))),
                self.data_axes)
            for i, m in enumerate(plan.modes) if m is Mode.RESIDUAL
        }

    def backward(self, plan, ev, sinks, copies):
        """One forward and backward pass of the per-example losses through ``ev``,
        seeded with ones: ``(sink_cts, copy_cts, loss_b, aux)``."""
        n, B = len(self.diff), self.B

        def forward(sinks, copies):
            vals = [copies.get(i, self.diff[i]) for i in range(n)]
            flags = [i in copies for i in range(n)]
            vals += list(self.ex) + list(self.other)
            flags += [True] * len(self.ex) + [False] * len(self.other)
            outs, ofl = ev.run(plan.closed.jaxpr, plan.closed.consts, vals, flags, sinks)
            outs = [o if f else jnp.broadcast_to(o, (B,) + jnp.shape(o))
                    for o, f in zip(outs, ofl)]
            return jnp.sum(outs[0]), (outs[0], outs[1:])

        total, pull, (loss_b, aux) = jax.vjp(forward, sinks, copies, has_aux=True)
        seed = compat.make_varying(jnp.ones((), total.dtype), compat.vma_of(total))
        sink_cts, copy_cts = pull(seed)
        return sink_cts, copy_cts, loss_b, aux


def run(plan, diff_leaves, ex_leaves, other_leaves, B, data_axes, carry=None, weights=None):
    """Evaluates one chunk; returns (values: dict j -> list per leaf, loss_b, aux_flat).

    ``carry``: a `stats.Carry` (values keyed like the returned ones; none for
    per-example reductions): the running values of the examples of earlier chunks.
    The values returned are then over those examples and this chunk's: tile loops
    start from them (no pass over the accumulators to merge), the rest is merged.
    ``weights``: ``(w [B], W0)``, the chunk's ``example_weights`` and the weight of the
    earlier chunks' examples: every reduction is then over the weighted examples
    (`stats.Weighted`), per-example values read 0 where ``w_b = 0``, and clipped sums
    weigh each example's clip factor by ``w_b``. Every site reads the examples of
    weight 0 as zeros (`interpreter.mask_examples`). Within derivatives in the weights
    (`example_weights.kept`) only those that are not finite: the others take part,
    weighted by 0, and their per-example values are read 0 later (`api.finalize_values`)."""
    with cuts.own_values(carry is not None):  # (a chunk's: merged into the carry)
        return _run(plan, diff_leaves, ex_leaves, other_leaves, B, data_axes, carry, weights)


def _run(plan, diff_leaves, ex_leaves, other_leaves, B, data_axes, carry, weights):
    if weights is not None:
        plan = dataclasses.replace(plan, weights=weights)
    ch = _Chunk(list(diff_leaves), list(ex_leaves), list(other_leaves), B, data_axes)
    cache = fp.TraceCache()  # repeated layers are traced once (fingerprint.py)
    sinks, done = _init_sinks(plan, ch, cache, carry)
    site_fn = make_site_fn(lambda s: _site_request(plan, s), cache, plan.finish_sites_first)
    ev = Evaluator(plan.analysis, plan.kernels, site_fn, B, cache)
    sink_cts, copy_cts, loss_b, aux = ch.backward(plan, ev, sinks, ch.copies(plan))
    with live_examples(None if plan.weights is None else ew.live(plan.weights[0])):
        values, norms_leaf, deferred = _leaf_values(plan, sink_cts, copy_cts, B, cache)
    for i in range(len(ch.diff)):
        _combine_shards(plan, i, values, norms_leaf, tuple(sorted(ch.leaf_axes(i) - data_axes)))
    if plan.has_clip:
        _clipped_sums(plan, ch, cache, values, norms_leaf, deferred)
    for j, r in enumerate(plan.reductions):
        if r.per_example:
            if plan.weights is not None:  # (a padded example's NaN included; within
                # derivatives a finite one stays for the statistics that weigh it: api.py)
                values[j] = [_kept_only(plan.weights[0], v) for v in values[j]]
            continue
        for i in range(len(ch.diff)):
            v = values[j][i]
            if carry is not None and (j, i) not in done:
                v = plan.bound(r, i, carry).accumulate(carry.values[j][i], carry.n, v, B)
            # one type, chunked or not (a chunk loop's carry keeps zero_carry's)
            values[j][i] = _typed(plan, i, v, ch.leaf_axes(i))
    return values, loss_b, aux


def _kept_only(w, v):
    """Per-example values ``v [B, ...]`` reading 0 for the examples not `ew.kept`."""
    keep = ew.kept(w, (v,)).reshape((-1,) + (1,) * (jnp.ndim(v) - 1))
    return jnp.where(keep, v, jnp.zeros((), v.dtype))


def _init_sinks(plan, ch, cache, carry):
    """Every site's zero sink (`_sink_avals`), seeded with ``carry`` where a direct
    site continues it: ``(sinks, done)``, ``done`` the (reduction, leaf) pairs whose
    values continue ``carry`` already."""
    zeros = {}  # one zero array per shape, dtype and axes: sinks share them

    def zero(a, axes):
        k = (tuple(a.shape), a.dtype, frozenset(axes))
        if k not in zeros:
            zeros[k] = compat.make_varying(jnp.zeros(a.shape, a.dtype), axes)
        return zeros[k]

    sites = plan.analysis.sites
    sinks = {
        p: jax.tree.map(lambda a, s=s: zero(a, ch.leaf_axes(s.leaf)),
                        _sink_avals(plan, s, ch.B, cache))
        for p, s in sites.items()
    }
    if plan.weights is not None:
        for p, s in sites.items():
            sinks[p] = {**sinks[p], EX_WEIGHTS: _example_weights(plan, s, ch)}
    done = set()
    if carry is not None:
        for p, s in sites.items():
            # (a sliced view's values are merged: outside the slice they are those of
            # this chunk's zero gradients, `Reduction.to_leaf`)
            if plan.modes[s.leaf] is Mode.DIRECT and not s.pads:
                sinks[p] = _carry_sink(plan, s, sinks[p], carry, ch.leaf_axes(s.leaf))
                done.update((j, s.leaf) for j, r in enumerate(plan.reductions) if r.carries)
    return sinks, done


def _example_weights(plan, site, ch):
    """The chunk's weights as a site's sink entry: stacked over its enclosing scans, in
    its accumulation dtype."""
    acc = plan.kernels[site.path].acc
    w = jnp.broadcast_to(plan.weights[0].astype(acc), tuple(site.scan_lengths) + (ch.B,))
    return compat.make_varying(w, ch.leaf_axes(site.leaf))


def _leaf_values(plan, sink_cts, copy_cts, B, cache):
    """Every leaf's values by its mode: ``(values, norms_leaf, deferred)``, the norms
    clipping needs and, per leaf, ``c -> sum_b c_b g_b`` for its clipped sums."""
    n = len(plan.leaf_avals)
    values = {j: [None] * n for j in range(len(plan.reductions))}
    norms_leaf = [None] * n
    deferred = {}
    for i, aval in enumerate(plan.leaf_avals):
        mode = plan.modes[i]
        acc = acc_dtype_for(aval.dtype)
        sites = plan.analysis.leaves[i].sites
        if mode is Mode.UNUSED:
            for j, r in enumerate(plan.reductions):
                values[j][i] = plan.bound(r, i).zeros(tuple(aval.shape), acc, B)
            norms_leaf[i] = jnp.zeros((B,), acc)
            deferred[i] = lambda c, finite_only=False, aval=aval, acc=acc: jnp.zeros(
                aval.shape, acc)
        elif mode is Mode.RESIDUAL:
            G = copy_cts[i].astype(acc)
            if plan.weights is not None:  # (a padded example's NaN never enters)
                keep = ew.kept(plan.weights[0], (G,)).reshape((-1,) + (1,) * (G.ndim - 1))
                G = jnp.where(keep, G, jnp.zeros((), G.dtype))
            for j, r in enumerate(plan.reductions):
                if not r.weighted_by_norm:
                    values[j][i] = plan.bound(r, i).from_examples(G)
            if plan.has_clip:
                norms_leaf[i] = S.Norms().from_examples(G)
            deferred[i] = lambda c, finite_only=False, G=G: (
                _finite_sum(G, c) if finite_only else weighted_sum_materialised(G, c))
        elif mode is Mode.DIRECT:
            (site,) = sites
            ct = sink_cts[site.path]
            for j, r in enumerate(plan.reductions):
                if rkey(j) in ct:
                    values[j][i] = plan.bound(r, i).to_leaf(ct[rkey(j)], site, B)
            if plan.has_clip:  # the norms came with the other statistics
                norms_leaf[i] = S.Norms().to_leaf(ct[CLIP_NORMS], site, B)
            if plan.keep_for_clip:  # and the ingredients, for the reweighted sum
                deferred[i] = _weighted_leaf([(site, plan.kernels[site.path], ct["ing"])], cache)
        else:  # ingredients (merged afterwards: measured slower when its tile loop
            # continued the running values, 5-15% on the large-vocabulary tied table)
            ings = [(s, plan.kernels[s.path], sink_cts[s.path]["ing"]) for s in sites]
            _ingredient_leaf(plan, i, ings, B, values, norms_leaf, deferred, cache)
    return values, norms_leaf, deferred


def _combine_shards(plan, i, values, norms_leaf, model_axes):
    """Tensor parallelism: a leaf sharded over mesh axes beyond the data axes holds a
    part of each example's gradient on every shard (`Reduction.combine_shards`;
    replicated leaves count once)."""
    if not model_axes:
        return
    for j, r in enumerate(plan.reductions):
        values[j][i] = plan.bound(r, i).combine_shards(values[j][i], model_axes)
    if norms_leaf[i] is not None:
        norms_leaf[i] = S.Norms().combine_shards(norms_leaf[i], model_axes)


def clip_weights(plan, clips, norms_leaf):
    """Per clipped sum ``plan.reductions[j]`` of ``clips``, per leaf the examples' weights
    ``c [B]``: each leaf's bound (`Reduction.per_leaf`: a `reductions.GroupClip`) weights its
    examples by the norm over the leaves of its group, combined from the leaves' norms
    (finite wherever representable: a float32 norm past 2^64 whose square overflows
    still clips to ``C g / |g|``). A single bound: one group, the global norm.

    Returns ``(cs, bad)``: ``bad [B]`` the examples whose gradient is not finite
    (`reductions.nonfinite_examples`: a NaN or an infinity in some leaf), whose weight
    is 0 in the clipped sums that drop them (the default), or None where none of
    ``clips`` drops them."""
    dt = jnp.result_type(*norms_leaf)
    group_norms = {}  # leaves of a group -> their combined norm (shared by clipped sums)
    bad = None
    if any(plan.reductions[j].drops_nonfinite for j in clips):
        bad = nonfinite_examples(norms_leaf, None if plan.weights is None else plan.weights[0])

    def norm_of(leaves):
        if leaves not in group_norms:
            group_norms[leaves] = combine_norms(
                jnp.stack([norms_leaf[i].astype(dt) for i in leaves]))
        return group_norms[leaves]

    out = []
    for j in clips:
        bounds = [plan.bound(plan.reductions[j], i) for i in range(len(norms_leaf))]
        groups = {}
        for i, b in enumerate(bounds):
            groups.setdefault(getattr(b, "group", 0), []).append(i)
        cs = [None] * len(bounds)
        for leaves in groups.values():
            # the clip factors of the group's examples: formed here, and only here
            c = bounds[leaves[0]].example_weights(norm_of(tuple(leaves)))
            if plan.weights is not None:  # each clipped example weighted (0: removed,
                # its clip factor kept where finite: the derivative in its weight)
                w = plan.weights[0].astype(c.dtype)
                c = jnp.where((w > 0) | jnp.isfinite(c), c, jnp.zeros((), c.dtype)) * w
            if plan.reductions[j].drops_nonfinite:  # (a [B] select: no cost to speak of)
                c = jnp.where(bad, jnp.zeros((), c.dtype), c)
            for i in leaves:
                cs[i] = c
        out.append(cs)
    return out, bad


def _clipped_sums(plan, ch, cache, values, norms_leaf, deferred):
    """The clipped sums, each leaf weighted by `clip_weights` (the norm over its group):
    from each leaf's kept ingredients, or a second pass (remat).

    An example whose gradient is not finite has the weight 0 in the clipped sums that
    drop it, but ``0 * NaN`` is NaN: those sums read the kept ingredients with their
    non-finite entries as zeros (`_finite_only`: one select per input, no conditional);
    with remat, where there is one (a traced flag, so a ``lax.cond``), the second pass
    runs again with the sites' example mask (`_without`)."""
    clips = [j for j, r in enumerate(plan.reductions) if r.weighted_by_norm]
    cs, bad = clip_weights(plan, clips, norms_leaf)
    n = len(ch.diff)

    def sums(ks, keep=None):  # per clipped sum of ks, per leaf: sum_b c_b g_b
        if plan.clip_recompute:
            p = plan if keep is None else _without(plan, keep)
            return _reweighted_sums(p, ch, cache, [cs[k] for k in ks])
        return [[deferred[i](cs[k][i]) for i in range(n)] for k in ks]

    every = list(range(len(clips)))
    drop = [] if bad is None else [
        k for k in every if plan.reductions[clips[k]].drops_nonfinite]
    if plan.clip_recompute or not drop:
        out = sums(every)
        if drop:  # (a second pass without them, only on a step that has one)
            def without_them(out):
                got = dict(zip(drop, sums(drop, jnp.logical_not(bad))))
                return [got.get(k, out[k]) for k in every]  # (propagating ones: as they are)

            out = jax.lax.cond(jnp.any(bad), without_them, lambda out: out, out)
    else:
        # no conditional: the sums that drop them read every site's kept inputs with
        # their non-finite entries as zeros (`_finite_only`), exact since a dropped
        # example's weight is 0 and a finite gradient's inputs are finite. (A
        # conditional around the sums kept copies of every site's inputs alive: twice
        # the temporary memory, or one more copy of the sums, and compiled a second
        # form of every sum.)
        out = [[deferred[i](cs[k][i], k in drop) for i in range(n)] for k in every]
    for k, j in enumerate(clips):
        for i in range(n):
            values[j][i] = out[k][i]


def _without(plan, keep):
    """``plan`` whose examples not ``keep`` (``[B]`` bool) have the weight 0 (the sites of
    the remat second pass then read them as zeros: `interpreter.mask_examples`)."""
    if plan.weights is None:
        w, W0 = keep.astype(jnp.float32), jnp.zeros((), jnp.float32)
    else:
        w, W0 = plan.weights
        w = jnp.where(keep, w, jnp.zeros((), w.dtype))
    return dataclasses.replace(plan, weights=(w, W0))


def _reweighted_sums(plan, ch, cache, cs):
    """``[sum_b c_b g_b per leaf]`` for each clipped sum's per-leaf weights ``c`` of
    ``cs`` (a ``[B]`` vector per leaf): a second forward and backward pass of the
    per-example losses (remat and all), seeded with ones like the first, in which every
    site forms its weighted sum from its ``x`` and ``dy`` with its leaf's weights
    (interpreter.make_weighted_site_fn) and residual leaves weight their per-example
    copies' gradients. One pass serves all clipped sums of the plan, per-group bounds
    included."""
    an, B = plan.analysis, ch.B

    def sink(s):
        k = plan.kernels[s.path]
        lead = tuple(s.scan_lengths)
        vary = lambda x: compat.make_varying(x, ch.leaf_axes(s.leaf))  # noqa: E731
        out = {
            WEIGHTS: [vary(jnp.broadcast_to(c[s.leaf].astype(k.acc), lead + (B,))) for c in cs],
            SUMS: [vary(jnp.zeros(lead + tuple(s.view_shape), k.acc)) for _ in cs],
        }
        if plan.weights is not None:
            out[EX_WEIGHTS] = _example_weights(plan, s, ch)
        return out

    sinks = {p: sink(s) for p, s in an.sites.items()}
    ev = Evaluator(an, plan.kernels, make_weighted_site_fn(cache), B, cache)
    sink_cts, copy_cts, _, _ = ch.backward(plan, ev, sinks, ch.copies(plan))
    out = []
    for k, c in enumerate(cs):
        per_leaf = []
        for i, aval in enumerate(plan.leaf_avals):
            acc = acc_dtype_for(aval.dtype)
            if plan.modes[i] is Mode.RESIDUAL:
                G = copy_cts[i].astype(acc)
                if plan.weights is not None:  # (a padded example's NaN never enters)
                    keep = ew.kept(plan.weights[0], (G,)).reshape((-1,) + (1,) * (G.ndim - 1))
                    G = jnp.where(keep, G, jnp.zeros((), G.dtype))
                v = weighted_sum_materialised(G, c[i])
            elif plan.modes[i] is Mode.UNUSED:
                v = jnp.zeros(aval.shape, acc)
            else:
                v = sum(_to_leaf(sink_cts[s.path][SUMS][k], s).astype(acc)
                        for s in an.leaves[i].sites)
            per_leaf.append(v)
        out.append(per_leaf)
    return out


def _slice_b(ing, depth, b0, size):
    return jax.tree.map(lambda x: compat.slice_at(x, b0, size, axis=depth), ing)


def leaf_feature_tile(B, shape, acc, budget, kernels):
    """Blocks of features of a multi-site leaf's ``G`` (tiling.py), on an axis every
    site can cut, or None; only where a tile holds one example."""
    if tiling.leaf_tile(B, shape, acc, budget, kernels) != 1:
        return None
    axes = set(range(len(shape)))
    for k in kernels:
        axes &= set(k.leaf_cut_axes())
    return tiling.feature_tile(tuple(shape), acc, sorted(axes), budget)


def _tiled_materialised(plan, ings, mat, B, reductions):
    """Reductions of a leaf's ``G [B, *leaf] = mat(b0, size)``, tile by tile (tiling.py)."""
    aval = plan.leaf_avals[ings[0][0].leaf]
    acc = acc_dtype_for(aval.dtype)
    ks = [k for _, k, _ in ings]
    tile = tiling.leaf_tile(B, aval.shape, acc, plan.budget, ks)
    ft = leaf_feature_tile(B, aval.shape, acc, plan.budget, ks)
    features = ft and (*ft, mat)
    return tiling.reduce_tiles(
        mat, B, reductions, tile, shape=tuple(aval.shape), dtype=acc,
        features=features,
    )


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
    if c["K"] != 1:
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
    if not np.array_equal(np.asarray(_to_leaf(ka._view(rows), sa)), rows):
        return None
    # where does canonical (c, f) land in the [V, d] leaf?
    if c["C"] * c["F"] != V * d:
        return None
    leaf_idx = np.asarray(_to_leaf(kb.to_view(flat.reshape(1, c["C"], c["F"])), sb))
    if leaf_idx.shape != (V, d):
        return None
    if c["C"] == d and c["F"] == V and np.array_equal(leaf_idx, flat.reshape(d, V).T):
        return "F"
    if c["C"] == V and c["F"] == d and np.array_equal(leaf_idx, rows):
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
    if len(c["canon_w"]) != 2 or len(dense) != 2:
        return _UNDECIDED
    if emb != (0, 1):  # the table's rows are the leaf's columns
        return None
    # canonical axis i of the dense site (C, then F) is its view's axis canon_w[i]
    on_c, on_f = dense[c["canon_w"][0]], dense[c["canon_w"][1]]
    if c["C"] == d and c["F"] == V and (on_c, on_f) == (1, 0):
        return "F"
    if c["C"] == V and c["F"] == d and (on_c, on_f) == (0, 1):
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
            cross += 2.0 * B * T * c["N"] * table[1] + 2.0 * B * T * c["N"]
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


def _cross_fast(sa, ka, inga, sb, kb, ingb):
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
    ne = jnp.sqrt(jnp.sum(jnp.square(dye), -1))
    no = jnp.sqrt(jnp.sum(jnp.square(other), -1))
    aP, dt = jnp.abs(P), cross.dtype
    N, T = other.shape[1], ids.shape[1]
    bound = (rounding(dye.shape[-1], dt) * jnp.sum(ne[:, :, None] * no[:, None, :] * aP, (1, 2))
             + rounding(N + T, dt) * jnp.sum(jnp.abs(A) * aP, (1, 2)))
    return cross, bound


def _weighted_fn(s, k):
    """``(ing, c) -> sum_b c_b G_b`` of one site in its view's layout."""

    def fn(ing, c):
        if s.depth:
            cs = jnp.broadcast_to(c, tuple(s.scan_lengths) + c.shape)
            return _stacked(k.weighted_sum, s.depth)(ing, cs)
        return k.weighted_sum(ing, c)

    return fn


def _in_leaf_space(fn, site):
    """``fn`` (a value in the site's view) followed by the map back to the leaf."""
    return lambda *args: _to_leaf(fn(*args), site)


def _weighted_leaf(ings, cache):
    """``(c, finite_only=False) -> sum_b c_b g_b`` of a leaf from its sites' ingredients;
    ``finite_only``: their non-finite entries read as zeros (`_finite_only`: the dropped
    examples have ``c_b = 0``)."""

    def weighted(c, finite_only=False):
        both = ings if not finite_only else [
            (s, k, jax.tree.map(_finite_only, ing)) for s, k, ing in ings]
        if len(both) == 1:  # repeated layers: traced once
            s, k, ing = both[0]
            sk = cache.site_key(s, k)
            key = sk and ("weighted", sk)
            fn = cache.get(key, lambda: _in_leaf_space(_weighted_fn(s, k), s))
            return fn(ing, c)
        total = None
        for s, k, ing in both:
            v = _to_leaf(_weighted_fn(s, k)(ing, c), s)
            total = v if total is None else total + v
        return total

    return weighted


def _finite_only(x):
    """``x`` with its NaN and infinite entries read as zeros (a non-float ``x``, token ids,
    as it is). The clipped sums that drop the examples whose gradient is not finite read
    their inputs so: such an example's weight is 0, and ``0 * NaN`` would be NaN, while
    an example whose gradient is finite has finite inputs (an infinite or NaN input entry
    makes some product with it, hence its gradient, non-finite). One select per input,
    fused into what reads it where XLA can."""
    if not jnp.issubdtype(x.dtype, jnp.inexact):
        return x
    return jnp.where(jnp.isfinite(x), x, jnp.zeros((), x.dtype))


def _finite_sum(G, c):
    """``sum_b c_b G_b`` of materialised gradients ``G [B, ...]`` with their non-finite
    entries read as zeros (the dropped examples have ``c_b = 0``: their NaN never
    enters): a select inside the reduction, no copy of ``G``."""
    cb = c.astype(G.dtype).reshape((-1,) + (1,) * (G.ndim - 1))
    return jnp.sum(jnp.where(jnp.isfinite(G), cb * G, jnp.zeros((), G.dtype)), axis=0)


def _leaf_mat(ings, acc):
    """``mat(b0, size, cut=None)``: the leaf's summed per-example gradients of examples
    ``b0:b0+size`` (``cut``: a block of features, `leaf_feature_tile`) from its sites'
    ingredients."""

    def mat(b0, size, cut=None):
        total = None
        for s, k, ing in sorted(ings, key=lambda ski: ski[1].adds_in_place):
            ing = _slice_b(ing, s.depth, b0, size)
            if s.depth:
                g = jnp.moveaxis(_stacked(k.materialise, s.depth)(ing), s.depth, 0)
                v = _to_leaf(g, s).astype(acc)
                if cut is not None:
                    v = cuts.take(cut, v, cuts.axis_of(cut) + 1)
                total = v if total is None else total + v
            else:
                total = k.add_to_leaf(ing, total, lambda g, s=s: _to_leaf(g, s), cut)
        return total

    return mat


def _ingredient_leaf(plan, i, ings, B, values, norms_leaf, deferred, cache):
    """Reductions of a leaf from its sites' ingredients (after the backward pass)."""
    deferred[i] = _weighted_leaf(ings, cache)
    with tiling.anchored(jax.tree.leaves([ing for _, _, ing in ings])[0]):
        if len(ings) == 1:
            _single_site_leaf(plan, i, ings[0], B, values, norms_leaf, cache)
        else:
            _SharedLeaf(plan, i, ings, B).run(values, norms_leaf, deferred[i])


def _single_site_leaf(plan, i, ing3, B, values, norms_leaf, cache):
    """One site's leaf: every reduction the site can give in one call (they share its
    tile loop), the others by their leaf route (`LEAF_ROUTES`) or from tiles of its
    per-example gradients."""
    s, k, ing = ing3
    bound = [plan.bound(r, i) for r in plan.reductions]
    req = {
        rkey(j): r for j, r in enumerate(bound)
        if not r.weighted_by_norm and r.direct_ok(s) and S.lookup(LEAF_ROUTES, r) is None
    }
    if plan.needs_norms:  # (the norms clipping divides by: `ClipNorms`)
        req[CLIP_NORMS] = ClipNorms()
    sk = cache.site_key(s, k)
    key = sk and fp.keyed(lambda: ("leaf", sk, fp.value_key(req)))

    def leaf_fn(ing):  # with the conversion to leaf space: one jit per repeated leaf
        ctx = _stacked(k.ctx, s.depth)(ing)

        def compute(rq):
            return _stacked(lambda c: k.direct_all(c, rq), s.depth)(ctx)

        out = direct_norms(k, ctx, req, compute, s.depth)
        return {q: r.to_leaf(out[q], s, B) for q, r in req.items() if q in out}

    out = cache.get(key, lambda: leaf_fn)(ing)
    for j in range(len(plan.reductions)):
        if rkey(j) in out:
            values[j][i] = out[rkey(j)]
    if plan.needs_norms:
        norms_leaf[i] = out[CLIP_NORMS]
    acc = S.acc_dtype_for(plan.leaf_avals[i].dtype)
    mat = _leaf_mat([ing3], acc)
    rest = [j for j, r in enumerate(bound) if rkey(j) not in req and not r.weighted_by_norm]
    tiled = []
    for j in rest:
        route = S.lookup(LEAF_ROUTES, bound[j])
        if route is not None:
            values[j][i] = route(plan, i, [ing3], bound[j], B, mat)
        else:
            tiled.append(j)
    if tiled:  # the leaf's per-example gradient, tile by tile
        outs = _tiled_materialised(plan, [ing3], mat, B, [bound[j] for j in tiled])
        for j, v in zip(tiled, outs):
            values[j][i] = v


class _SharedLeaf:
    """A leaf several sites use (tying): its reductions by `multi_site_routes`."""

    def __init__(self, plan, i, ings, B):
        self.plan, self.i, self.ings, self.B = plan, i, ings, B
        self.aval = plan.leaf_avals[i]
        self.acc = S.acc_dtype_for(self.aval.dtype)
        self.mat = _leaf_mat(ings, self.acc)
        # (only norms ask; the layout check is numpy work)
        self.ghost_ok = plan.needs_norms and shared_norms_by_ghost(
            [s for s, _, _ in ings], [k for _, k, _ in ings], B, self.aval.shape, self.acc)
        self.ft = leaf_feature_tile(B, self.aval.shape, self.acc, plan.budget,
                                    [k for _, k, _ in ings])
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
                _cross_fast(*self.ings[a], *self.ings[b])
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
            blocks = ft and (ft[0], ft[1], self.aval.shape[ft[0]])

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
        todo, rides = multi_site_routes(plan.reductions, self.ghost_ok, self.facs is not None,
                                        self.ft)
        sums = [j for j, r in enumerate(plan.reductions) if r.linear]
        if rides:
            todo, sums = todo + sums, []
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
            reds = [S.SqNorms() if j is None or plan.reductions[j] == S.Norms()
                    else plan.bound(plan.reductions[j], i) for j in todo]
            outs = _tiled_materialised(plan, self.ings, self.mat, B, reds)
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
    return _leaf_dots(leaf.plan, leaf.i, leaf.ings, r, leaf.B, leaf.mat)


# A shared leaf's reductions with a route of their own (else tiles of its summed
# per-example gradient), keyed by reduction type; ``multi_site_routes`` says which
# are open (norms: the sites' ghost forms and cross terms; Kronecker: token factors).
SHARED_ROUTES = {
    S.SqNorms: _sq_route,
    S.Norms: _norms_route,
    S.KronSum: _kron_route,
    dots._PerExampleDots: _dots_route,
}
_OPEN = {_sq_route: "ghost", _norms_route: "ghost", _kron_route: "kron", _dots_route: True}


def _leaf_dots(plan, i, ings, r, B, mat):
    """``<g_b, ref>`` of a leaf, ``[B]`` (``r``: a `dots.BoundDot`): each site's
    contraction of the reference with its inputs where its view permutes the leaf;
    else tiles of the leaf's per-example gradients."""
    acc = S.acc_dtype_for(plan.leaf_avals[i].dtype)
    if all(kron.leaf_map(s) is not None for s, _, _ in ings):
        # the reference in each site's view (transposed, sliced the same way)
        total = None
        for s, k, ing in ings:
            v = k.dots(k.ctx(ing), _from_leaf(jnp.asarray(r.ref), s).astype(acc))
            total = v if total is None else total + v
        return total
    return _tiled_materialised(plan, ings, mat, B, [r])[0]


# A single site's reductions computed from the leaf rather than by the site's kernel,
# keyed by reduction type (dots: the reference in the site's view)
LEAF_ROUTES = {dots.BoundDot: _leaf_dots}


def needs_norms(reductions):
    """Per-example (squared) norms are asked for, or needed by clipping."""
    return any(S.is_norms(r) or r.weighted_by_norm for r in reductions)


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
    is_open = {"ghost": ghost_ok, "kron": kron_ok, True: True, None: False}
    tiled = [
        j
        for j, r in enumerate(reductions)
        if not r.weighted_by_norm and not r.linear
        and not is_open[_OPEN.get(S.lookup(SHARED_ROUTES, r))]
    ]
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
