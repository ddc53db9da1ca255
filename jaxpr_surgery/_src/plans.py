"""The plan of one call: how each leaf's statistics are computed (`Mode`), each site's
kernel and requests, the reductions bound per leaf.

``Plan`` is built once per trace from the analysed per-example jaxpr (`make_plan`); the
engine (engine.py) runs it chunk by chunk.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

import jax
import jax.numpy as jnp

from jaxpr_surgery._src import compat, cuts, segments, views, walker
from jaxpr_surgery._src import sink_keys as K
from jaxpr_surgery._src import stats as S
from jaxpr_surgery._src.analysis_types import LeafUse
from jaxpr_surgery._src.clip_reductions import ClipNorms, KeptExamples
from jaxpr_surgery._src.sites import kernel_for
from jaxpr_surgery._src.sites.base import acc_dtype_for


class Mode(enum.Enum):
    """How the engine computes a leaf's statistics (`Plan.modes`)."""

    DIRECT = enum.auto()  # its one site reduces inside the backward pass
    INGREDIENTS = enum.auto()  # its sites emit ingredients, reduced after it
    RESIDUAL = enum.auto()  # from per-example copies of the leaf (their gradients)
    UNUSED = enum.auto()  # the loss does not depend on it: zeros


@dataclasses.dataclass
class Plan:
    """One call's plan: the analysed per-example jaxpr, each leaf's `Mode`, each site's
    kernel, the reductions (bound per leaf where they depend on it) and how clipped sums
    are formed. Built once per trace (`make_plan`); `engine.run` evaluates it chunk by
    chunk."""

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
    # leaf -> how its site's direct values are combined across the devices inside the
    # backward pass (`combined_at_site`; a leaf gathered in shard_map: `gathers.AtSite`)
    at_site: dict = dataclasses.field(default_factory=dict)
    # the leaves traced varying over the examples' axes inside typed shard_map
    # (`api.replicated_leaves`): `engine.run` casts their values so too
    varying_leaves: frozenset = frozenset()
    # clipped sums under a batch split: sites whose inner values are recomputed from
    # a few kept ones (`segments.find`), and what each of those sites keeps
    segments: tuple = ()
    kept: dict = dataclasses.field(default_factory=dict)  # path -> `Kept` or None

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
        req = {K.reduction(j): r for j, r in enumerate(self.reductions)
               if not r.weighted_by_norm}
        if self.has_clip:  # (the norms clipping divides by: `ClipNorms`)
            req[K.CLIP_NORMS] = ClipNorms()
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
    varying_leaves=frozenset(),
):
    """``flatten(tree)``: a pytree shaped like the differentiated arguments as a list per
    leaf (references of `DotWith`). ``data_axes``: the shard_map axes the examples vary
    over (typed: the jaxpr casts the parameters to varying, and the VJP of such a cast
    is a psum, which would give the second pass of a clipped sum the whole mesh's sum:
    there clipped sums keep the one-pass form). ``varying_leaves``: `Plan.varying_leaves`."""
    plan = Plan(closed, analysis, leaf_avals, reductions, n_ex, n_other, out_tree, budget=budget,
                varying_leaves=frozenset(varying_leaves))
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
    split_blocks = any(r.cache_blocks and r.blocks_under_split for r in reductions)
    for p, site in analysis.sites.items():
        dts = [site.base.aval.dtype] + [v.aval.dtype for v in site.eqn.outvars]
        plan.kernels[p] = kernel_for(site, acc_dtype_for(*dts), budget, cache_blocks,
                                     split_blocks)
    if cuts.split_count() > 1:  # (segments.py: what recomputing costs there is FLOPs)
        plan.segments, plan.kept = segments.find(plan, Mode.DIRECT, Mode.INGREDIENTS)
    return plan


def site_request(plan, site):
    mode = plan.modes[site.leaf]
    if mode is Mode.DIRECT:
        req = plan.site_requests()
        if plan.keep_for_clip and plan.kernels[site.path].keeps_products_for_clip():
            # the norms' tile loop keeps each G_b for the clipped sum: no contraction
            # after the norms, and less memory than x and dy (`keeps_products_for_clip`)
            req[K.KEPT] = KeptExamples()
        if not plan.keep_for_clip:
            return req, None
        return req, plan.kept.get(site.path, K.Kept.ALL)
    return {}, plan.kept.get(site.path, K.Kept.ALL)


def combined_at_site(plan, site) -> dict:
    """``site``'s direct values that its leaf's `Plan.at_site` combines across the
    devices at the site: key -> ``(fn, reduction, combiner)``, ``fn(value, B)`` the value
    in the site's view to the device's combined value in the leaf's layout (a gathered
    leaf's shard, `gathers.AtSite`). For a site outside scans, or inside one scan over
    the leaf's layers (each layer's value, ``combiner.per_layer()``), whose view slices
    nothing of its leaf."""
    at = plan.at_site.get(site.leaf)
    if at is None or plan.modes[site.leaf] is not Mode.DIRECT or site.pads:
        return {}
    if site.depth == 0:
        def leaf(b, v, B):
            return b.to_leaf(v, site, B)
    elif site.depth == 1 and site.chain and site.chain[0].kind is views.Step.SCAN:
        # one layer of a leaf stacked on its axis 0 (a scan's slicing, then the body's
        # steps): combined in each iteration, the scan stacking the layers' shards
        at = at.per_layer()
        if at is None:
            return {}

        def leaf(b, v, B):
            return jax.tree.map(lambda x: _layer_of(x, site.chain[1:]), v)
    else:
        return {}
    out = {}
    for j, r in enumerate(plan.reductions):
        b = plan.bound(r, site.leaf)
        if r.weighted_by_norm or not at.takes(b):
            continue
        if site.depth and type(b).to_leaf is not S.Reduction.to_leaf:
            continue  # (a value of the layers together, e.g. norms)
        out[K.reduction(j)] = (lambda v, B, b=b: at(b, leaf(b, v, B), B), b, at)
    return out


def _layer_of(value, steps):
    """One layer's value in its view to the layer of the leaf (the view's steps after
    the scan's slicing, inverted)."""
    for op in reversed(steps):
        value = op.inverse(value)
    return value


def at_site_pairs(plan) -> frozenset:
    """The (reduction index, leaf) pairs whose values are combined at their sites
    (`combined_at_site`), typed as the combination leaves them (a gathered leaf's
    shard varies over the gather's axes only)."""
    out = set()
    for i in plan.at_site:
        if plan.modes[i] is Mode.DIRECT:
            keys = combined_at_site(plan, plan.analysis.leaves[i].sites[0])
            out.update((j, i) for j in range(len(plan.reductions)) if K.reduction(j) in keys)
    return frozenset(out)


def uses_remat(jaxpr) -> bool:
    """Whether the jaxpr (or one it calls) contains ``jax.checkpoint``."""
    return any(walker.nest_of(e) is walker.Nest.REMAT for e in walker.equations(jaxpr))


def clips_by_recompute(jaxpr) -> bool:
    """Clipped sums by a second backward pass where the loss uses ``jax.checkpoint``.

    A clipped sum ``sum_b c_b g_b`` needs every example's norm before any weight,
    so in one pass each site keeps its ``x`` and ``dy`` until the norms are known:
    the activations of every layer at once, which remat exists to avoid. With remat
    in the loss the norms come from the first pass and the sum from a second forward
    and backward pass in which each site weights its per-example gradients by ``c``
    (`_reweighted_sums`; grad's memory, one more forward and backward)."""
    return uses_remat(jaxpr)


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


def example_weights_sink(plan, site, ch):
    """The chunk's weights as a site's sink entry: stacked over its enclosing scans, in
    its accumulation dtype."""
    acc = plan.kernels[site.path].acc
    w = jnp.broadcast_to(plan.weights[0].astype(acc), tuple(site.scan_lengths) + (ch.B,))
    return compat.make_varying(w, ch.leaf_axes(site.leaf))


def needs_norms(reductions):
    """Per-example (squared) norms are asked for, or needed by clipping."""
    return any(S.is_norms(r) or r.weighted_by_norm for r in reductions)
