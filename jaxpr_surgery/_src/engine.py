"""One pass over a chunk of examples: sinks, batched forward, one VJP, assembly.

``run`` evaluates one chunk of ``B`` examples by a `plans.Plan` and returns the reduced
values of every requested reduction for every leaf (in leaf space), the per-example
losses and the per-example aux outputs. Each site's sink (the zeros its statistics and
ingredients come back as cotangents of) is made here; a leaf's values from ingredients
by leaves.py, clipped sums by clipping.py.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxpr_surgery._src import compat, cuts, segments
from jaxpr_surgery._src import example_weights as ew
from jaxpr_surgery._src import fingerprint as fp
from jaxpr_surgery._src import sink_keys as K
from jaxpr_surgery._src import stats as S
from jaxpr_surgery._src.clipping import clipped_sums, finite_sum, weighted_leaf
from jaxpr_surgery._src.interpreter import Evaluator
from jaxpr_surgery._src.leaves import combined_pairs, ingredient_leaf
from jaxpr_surgery._src.norms import live_examples
from jaxpr_surgery._src.plans import (
    Mode,
    combined_at_site,
    example_weights_sink,
    site_request,
    value_dtype,
)
from jaxpr_surgery._src.site_fns import make_site_fn, traced_ingredient_avals
from jaxpr_surgery._src.sites.base import acc_dtype_for, weighted_sum_materialised


def _sink_avals(plan, site, B, cache):
    """The shapes of a site's sink: the statistics it computes in the backward pass
    (`plans.site_request`), and its ingredients where its leaf takes them afterwards,
    stacked over its enclosing scans."""
    kernel = plan.kernels[site.path]
    direct, want_ing = site_request(plan, site)
    lead = tuple(site.scan_lengths)
    # the statistics: known without tracing the kernel (`Reduction.aval`)
    def aval(r):
        a = r.aval(tuple(site.view_shape), kernel.acc, B)
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(lead + tuple(x.shape), x.dtype), a)

    out = {k: aval(r) for k, r in direct.items()}
    # (combined at the site: the device's part of the leaf, or of each stacked layer)
    layer = tuple(plan.leaf_avals[site.leaf].shape)[len(lead):]
    for k, (_, r, at) in combined_at_site(plan, site).items():
        out[k] = jax.tree.map(lambda x: jax.ShapeDtypeStruct(lead + tuple(x.shape), x.dtype),
                              at.aval(r.aval(layer, kernel.acc, B)))
    if K.kept_as_ingredients(out) or not want_ing or K.INGREDIENTS in out:
        return out
    if want_ing is not K.Kept.ALL:  # (a segment's site: its inputs or cotangents alone)
        vs = site.ext_vars if want_ing is K.Kept.X else site.eqn.outvars
        out[K.INGREDIENTS] = tuple(jax.ShapeDtypeStruct(lead + (B,) + tuple(v.aval.shape),
                                                        v.aval.dtype) for v in vs)
        return out
    # the ingredients: as the kernel states them, else traced once for repeated layers
    ing = kernel.ingredient_avals(B)
    if ing is None:
        sk = cache.site_key(site, kernel)
        key = sk and ("sink-ingredients", sk, B)
        ing = cache.value(key, lambda: traced_ingredient_avals(site, kernel, B))
    out[K.INGREDIENTS] = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(lead + tuple(a.shape), a.dtype), ing)
    return out


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
    tile loops continue them: site_fns.carried) and their count."""
    sink = dict(sink)
    for j, r in enumerate(plan.reductions):
        key = K.reduction(j)
        if key in sink and r.carries:
            v = r.from_leaf(carry.values[j][site.leaf], site)
            dt = jax.tree.leaves(sink[key])[0].dtype  # the site's accumulation dtype
            sink[key] = jax.tree.map(lambda x, dt=dt: compat.make_varying(x.astype(dt), axes), v)
    acc = plan.kernels[site.path].acc
    n = jnp.broadcast_to(jnp.asarray(carry.n, acc), tuple(site.scan_lengths))
    sink[K.CARRY_COUNT] = compat.make_varying(n, axes)
    if plan.weights is not None:
        W0 = jnp.broadcast_to(jnp.asarray(plan.weights[1], acc), tuple(site.scan_lengths))
        sink[K.CARRY_WEIGHT] = compat.make_varying(W0, axes)
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
            outs, ofl = ev.evaluate(plan.closed.jaxpr, plan.closed.consts, vals, flags, sinks)
            outs = [o if f else jnp.broadcast_to(o, (B,) + jnp.shape(o))
                    for o, f in zip(outs, ofl)]
            return jnp.sum(outs[0]), (outs[0], outs[1:])

        total, pull, (loss_b, aux) = jax.vjp(forward, sinks, copies, has_aux=True)
        seed = compat.make_varying(jnp.ones((), total.dtype), compat.vma_of(total))
        sink_cts, copy_cts = pull(seed)
        return sink_cts, copy_cts, loss_b, aux


@compat.implicit_rank_promotion
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
    weight 0 as zeros (`site_fns.mask_examples`). Within derivatives in the weights
    (`example_weights.kept`) only those that are not finite: the others take part,
    weighted by 0, and their per-example values are read 0 later (`api.finalize_values`)."""
    with cuts.own_values(carry is not None):  # (a chunk's: merged into the carry)
        return _run(plan, diff_leaves, ex_leaves, other_leaves, B, data_axes, carry, weights)


def _run(plan, diff_leaves, ex_leaves, other_leaves, B, data_axes, carry, weights):
    if weights is not None:
        plan = dataclasses.replace(plan, weights=weights)
    # (inside typed shard_map a leaf replicated over the examples' axes varies over them,
    # as the jaxpr was traced (`api.replicated_leaves`): its per-example gradients are
    # each device's own, never summed over the devices by the transpose of a cast)
    diff_leaves = [compat.make_varying(x, data_axes) if i in plan.varying_leaves else x
                   for i, x in enumerate(diff_leaves)]
    ch = _Chunk(list(diff_leaves), list(ex_leaves), list(other_leaves), B, data_axes)
    cache = fp.TraceCache()  # repeated layers are traced once (fingerprint.py)
    sinks, done = _init_sinks(plan, ch, cache, carry)
    site_fn = make_site_fn(lambda s: site_request(plan, s), cache, plan.finish_sites_first,
                           lambda s: combined_at_site(plan, s))
    ev = Evaluator(plan.analysis, plan.kernels, site_fn, B, cache)
    sink_cts, copy_cts, loss_b, aux = ch.backward(plan, ev, sinks, ch.copies(plan))
    sink_cts = segments.tail_ingredients(plan, sink_cts, ch)
    with live_examples(None if plan.weights is None else ew.live(plan.weights[0])):
        values, norms_leaf, deferred = _leaf_values(plan, sink_cts, copy_cts, B, cache)
    for i in range(len(ch.diff)):
        _combine_shards(plan, i, values, norms_leaf, tuple(sorted(ch.leaf_axes(i) - data_axes)))
    if plan.has_clip:
        segments.install(plan, plan.segments, sink_cts, ch.diff, deferred)
        clipped_sums(plan, ch, cache, values, norms_leaf, deferred)
    at_site = combined_pairs(plan, B)  # (typed where they were combined)
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
            values[j][i] = _typed(plan, i, v, () if (j, i) in at_site else ch.leaf_axes(i))
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
    sinks = {}
    for p, s in sites.items():
        avals, axes = _sink_avals(plan, s, ch.B, cache), ch.leaf_axes(s.leaf)
        at = {k: c.varying(axes) for k, (_, _, c) in combined_at_site(plan, s).items()}
        sinks[p] = {k: _zeros(zero, v, at[k] if k in at else axes) for k, v in avals.items()}
    if plan.weights is not None:
        for p, s in sites.items():
            sinks[p] = {**sinks[p], K.EX_WEIGHTS: example_weights_sink(plan, s, ch)}
    done = set()
    if carry is not None:
        for p, s in sites.items():
            # (a sliced view's values are merged: outside the slice they are those of
            # this chunk's zero gradients, `Reduction.to_leaf`)
            if plan.modes[s.leaf] is Mode.DIRECT and not s.pads:
                sinks[p] = _carry_sink(plan, s, sinks[p], carry, ch.leaf_axes(s.leaf))
                done.update((j, s.leaf) for j, r in enumerate(plan.reductions) if r.carries)
    return sinks, done


def _zeros(zero, avals, axes):
    return jax.tree.map(lambda a: zero(a, axes), avals)


def _leaf_values(plan, sink_cts, copy_cts, B, cache):
    """Every leaf's values by its mode: ``(values, norms_leaf, deferred)``, the norms
    clipping needs and, per leaf, ``c -> sum_b c_b g_b`` for its clipped sums."""
    n = len(plan.leaf_avals)
    values = {j: [None] * n for j in range(len(plan.reductions))}
    norms_leaf = [None] * n
    deferred = {}
    layered = segments.in_layers(plan)
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
                finite_sum(G, c) if finite_only else weighted_sum_materialised(G, c))
        elif mode is Mode.DIRECT:
            (site,) = sites
            ct, done = sink_cts[site.path], combined_at_site(plan, site)
            for j, r in enumerate(plan.reductions):
                k = K.reduction(j)
                if k in ct:  # (combined at the site: in the leaf's layout already)
                    values[j][i] = ct[k] if k in done else plan.bound(r, i).to_leaf(ct[k], site, B)
            if plan.has_clip:  # the norms came with the other statistics
                norms_leaf[i] = S.Norms().to_leaf(ct[K.CLIP_NORMS], site, B)
            if plan.keep_for_clip and site.path not in layered:  # and the ingredients,
                # for the reweighted sum (a scan layer's segment's: `segments.install`)
                deferred[i] = weighted_leaf(
                    [(site, plan.kernels[site.path], ct[K.INGREDIENTS])], cache)
        else:  # ingredients (merged afterwards: measured slower when its tile loop
            # continued the running values, 5-15% on the large-vocabulary tied table)
            ings = [(s, plan.kernels[s.path], sink_cts[s.path][K.INGREDIENTS]) for s in sites]
            ingredient_leaf(plan, i, ings, B, values, norms_leaf, deferred, cache)
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
