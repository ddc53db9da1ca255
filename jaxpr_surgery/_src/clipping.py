"""Clipped sums: each example's clip factor from the norm over its leaf's group
(`clip_weights`), then ``sum_b c_b g_b`` per leaf, from the sites' kept ingredients or a
second, reweighted backward pass (remat).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxpr_surgery._src import compat, tiling, views
from jaxpr_surgery._src import example_weights as ew
from jaxpr_surgery._src import sink_keys as K
from jaxpr_surgery._src.clip_reductions import nonfinite_examples
from jaxpr_surgery._src.interpreter import Evaluator
from jaxpr_surgery._src.norms import combine_norms
from jaxpr_surgery._src.plans import Mode, example_weights_sink
from jaxpr_surgery._src.segments import Member
from jaxpr_surgery._src.site_fns import make_weighted_site_fn
from jaxpr_surgery._src.sites.base import acc_dtype_for, stacked, weighted_sum_materialised


def clip_weights(plan, clips, norms_leaf):
    """Per clipped sum ``plan.reductions[j]`` of ``clips``, per leaf the examples' weights
    ``c [B]``: each leaf's bound (`Reduction.per_leaf`: a `clip_reductions.GroupClip`) weights its
    examples by the norm over the leaves of its group, combined from the leaves' norms
    (finite wherever representable: a float32 norm past 2^64 whose square overflows
    still clips to ``C g / |g|``). A single bound: one group, the global norm.

    Returns ``(cs, bad)``: ``bad [B]`` the examples whose gradient is not finite
    (`clip_reductions.nonfinite_examples`: a NaN or an infinity in some leaf), whose weight
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


def clipped_sums(plan, ch, cache, values, norms_leaf, deferred):
    """The clipped sums, each leaf weighted by `clip_weights` (the norm over its group):
    from each leaf's kept ingredients, or a second pass (remat).

    An example whose gradient is not finite has the weight 0 in the clipped sums that
    drop it, but ``0 * NaN`` is NaN: those sums read the kept ingredients with their
    non-finite entries as zeros (`_finite_only`: one select per input, no conditional);
    with remat, the one second pass reads them so through the sites' example mask
    (`_without`). Only a request that also propagates them (a clipped sum with
    ``nonfinite="propagate"`` beside one that drops them) runs that pass unmasked and,
    where some example is not finite (a traced flag, so a ``lax.cond``), again masked."""
    clips = [j for j, r in enumerate(plan.reductions) if r.weighted_by_norm]
    cs, bad = clip_weights(plan, clips, norms_leaf)
    n = len(ch.diff)

    def sums(ks, keep=None):  # per clipped sum of ks, per leaf: sum_b c_b g_b
        if plan.clip_recompute:
            p = plan if keep is None else _without(plan, keep)
            return _reweighted_sums(p, ch, cache, [cs[k] for k in ks])
        return [leaf_sums(deferred, cs[k], False, n) for k in ks]

    every = list(range(len(clips)))
    drop = [] if bad is None else [
        k for k in every if plan.reductions[clips[k]].drops_nonfinite]
    if plan.clip_recompute and drop and len(drop) == len(every):
        # every sum drops them: one second pass with the sites' example mask, on every
        # step (a select per site input and cotangent), not the pass without it and a
        # third under `lax.cond` for a step that has one: that conditional's whole
        # forward and backward pass doubled what the clipped sums trace and compile
        out = sums(every, jnp.logical_not(bad))
    elif plan.clip_recompute or not drop:
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
        out = [leaf_sums(deferred, cs[k], k in drop, n) for k in every]
    for k, j in enumerate(clips):
        for i in range(n):
            values[j][i] = out[k][i]


def leaf_sums(deferred, cs, finite_only, n):
    """``[sum_b c_b g_b per leaf]``: each leaf's ``deferred`` value for its weights
    ``cs[i]`` (``finite_only``: its ingredients' non-finite entries read as zeros), a
    recomputed segment's leaves from one pass over its layers (`segments.Member`)."""
    done, out = {}, []
    for i in range(n):
        d = deferred[i]
        if isinstance(d, Member):
            if d.group not in done:
                done[d.group] = d.group(cs, _finite_inputs if finite_only else None)
            out.append(done[d.group][i])
        else:
            out.append(d(cs[i], finite_only))
    return out


def _without(plan, keep):
    """``plan`` whose examples not ``keep`` (``[B]`` bool) have the weight 0 (the sites of
    the remat second pass then read them as zeros: `site_fns.mask_examples`)."""
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
    (site_fns.make_weighted_site_fn) and residual leaves weight their per-example
    copies' gradients. One pass serves all clipped sums of the plan, per-group bounds
    included."""
    an, B = plan.analysis, ch.B

    def sink(s):
        k = plan.kernels[s.path]
        lead = tuple(s.scan_lengths)
        vary = lambda x: compat.make_varying(x, ch.leaf_axes(s.leaf))  # noqa: E731
        out = {
            K.WEIGHTS: [vary(jnp.broadcast_to(c[s.leaf].astype(k.acc), lead + (B,))) for c in cs],
            K.SUMS: [vary(jnp.zeros(lead + tuple(s.view_shape), k.acc)) for _ in cs],
        }
        if plan.weights is not None:
            out[K.EX_WEIGHTS] = example_weights_sink(plan, s, ch)
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
                v = sum(views.to_leaf(sink_cts[s.path][K.SUMS][k], s).astype(acc)
                        for s in an.leaves[i].sites)
            per_leaf.append(v)
        out.append(per_leaf)
    return out


def _weighted_fn(s, k, finite_only=False):
    """``(ing, c) -> sum_b c_b G_b`` of one site in its view's layout; ``finite_only``:
    the ingredients' non-finite entries read as zeros (`_finite_only`)."""

    def fn(ing, c):
        if finite_only:
            ing = _finite_inputs(ing, c)
        if s.depth:
            cs = jnp.broadcast_to(c, tuple(s.scan_lengths) + c.shape)
            return stacked(k.weighted_sum, s.depth)(ing, cs)
        return k.weighted_sum(ing, c)

    return fn


def _in_leaf_space(fn, site):
    """``fn`` (a value in the site's view) followed by the map back to the leaf."""
    return lambda *args: views.to_leaf(fn(*args), site)


def weighted_leaf(ings, cache):
    """``(c, finite_only=False) -> sum_b c_b g_b`` of a leaf from its sites' ingredients;
    ``finite_only``: their non-finite entries read as zeros (`_finite_only`: the dropped
    examples have ``c_b = 0``)."""

    def weighted(c, finite_only=False):
        if len(ings) == 1:  # repeated layers: traced once (the selects too)
            s, k, ing = ings[0]
            sk = cache.site_key(s, k)
            key = sk and ("weighted", sk, bool(finite_only))
            fn = cache.get(key, lambda: _in_leaf_space(_weighted_fn(s, k, finite_only), s))
            return fn(ing, c)
        total = None
        for s, k, ing in ings:
            v = views.to_leaf(_weighted_fn(s, k, finite_only)(ing, c), s)
            total = v if total is None else total + v
        return total

    return weighted


def _finite_inputs(ing, c):
    """A site's ingredients with their non-finite entries read as zeros (`_finite_only`),
    the zero read from the clip factors ``c``: each select made once they exist, not
    where the backward pass made the input (XLA:CPU at jax 0.10 ran the selects there,
    holding every site's input twice until the sums)."""
    zero = tiling.zero_after(c)
    return jax.tree.map(lambda x: _finite_only(x, zero), ing)


def _finite_only(x, zero=0):
    """``x`` with its NaN and infinite entries read as zeros (a non-float ``x``, token ids,
    as it is). The clipped sums that drop the examples whose gradient is not finite read
    their inputs so: such an example's weight is 0, and ``0 * NaN`` would be NaN, while
    an example whose gradient is finite has finite inputs (an infinite or NaN input entry
    makes some product with it, hence its gradient, non-finite). One select per input,
    fused into what reads it where XLA can; ``zero``: a zero computed from a value the
    select must wait for."""
    if not jnp.issubdtype(x.dtype, jnp.inexact):
        return x
    return jnp.where(jnp.isfinite(x), x, jnp.asarray(zero).astype(x.dtype))


def finite_sum(G, c):
    """``sum_b c_b G_b`` of materialised gradients ``G [B, ...]`` with their non-finite
    entries read as zeros (the dropped examples have ``c_b = 0``: their NaN never
    enters): a select inside the reduction, no copy of ``G``."""
    cb = c.astype(G.dtype).reshape((-1,) + (1,) * (G.ndim - 1))
    return jnp.sum(jnp.where(jnp.isfinite(G), cb * G, jnp.zeros((), G.dtype)), axis=0)
