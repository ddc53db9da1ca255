"""Clipped sums under a batch split: a layer's inner values recomputed, not kept.

A clipped sum in one pass keeps every site's input ``x`` and output cotangent ``dy``
until every example's norm is known, then forms ``sum_b c_b x_b^T dy_b`` per site
(clipping.py). Inside a scan over layers that is every layer's values at once. Under
tensor parallelism some of them (a column-parallel layer's input, a row-parallel
layer's cotangent: the residual stream) are whole on every device of the model axis,
and the rest (the attention's heads, the MLP's hidden units) are split over it.

A *segment* is a run of a layer's sites whose inner values follow from a few kept ones
by the layer's own equations: the attention's ``wq``, ``wk``, ``wv`` read one input
``a``, their outputs reach only the attention, whose output is ``wo``'s input; the
MLP's ``w1`` (and bias) feed only ``w2`` through the activation. Keeping ``a`` and
``wo``'s cotangent, the clipped sums recompute, one layer at a time (``lax.map``), the
inner inputs by the forward equations and the inner cotangents by their VJP from the
kept cotangent. Where no collective sits between them (the equations of one device's
heads or hidden units under tensor parallelism) that costs FLOPs, not bytes, and the
layer's inner values are never held for every layer at once.

The loss's *tail* is a segment too: the sites whose outputs reach the per-example loss
through no other site (a language model's head) keep their input alone, and their
vocabulary-sized cotangent is recomputed from the loss once the backward pass is done
(`tail_ingredients`), where it had been held through the whole backward pass.

`find` picks the segments of a `plans.Plan` (`sink_keys.Kept`: what each of their sites
keeps); `install` gives the layers' segments' leaves their clipped sums
(``engine._leaf_values``'s ``deferred``) from the kept values. A layer's segment's sites
are direct-mode sites of one scan body, each its leaf's only site, whose view is the
scan's layer of the leaf; the values between them are read by nothing else (so the
cotangent the VJP gives is the whole of each inner cotangent), and every free input of
their equations is a literal, a site's view or computed from those alone.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp

from jaxpr_surgery._src import compat, cuts, tiling, views, walker
from jaxpr_surgery._src import sink_keys as K
from jaxpr_surgery._src.site_fns import mask_examples, traced_ingredient_avals
from jaxpr_surgery._src.sites.generic import composite

#: whether `find` looks for segments (tests switch it to compare both forms)
ENABLED = True
_WORTH = [True]  # `worth_it`: whether the batch split being traced recomputes

#: site primitives whose input's cotangent is its output's, elementwise (a bias, a
#: scale): a segment may pass through them. Any other site (a matmul, whose input's
#: cotangent contracts its output's features: under tensor parallelism a collective,
#: as in grad's own backward pass) only begins a segment, its input kept.
PASS_THROUGH = frozenset({compat.add_p, compat.sub_p, compat.mul_p})


@contextlib.contextmanager
def worth_it(on: bool):
    """While this runs, `find` looks for segments only where ``on``: a batch split by
    device whose examples' values some mesh axis holds whole on each of its devices
    (tensor parallelism), or whose placement is unknown (devices.py decides)."""
    _WORTH.append(bool(on))
    try:
        yield
    finally:
        _WORTH.pop()


@dataclasses.dataclass(frozen=True)
class Segment:
    """Sites of one scan body recomputed together.

    ``members``: the sites' paths in equation order (``target`` last among those it
    reads); ``target``: the site whose cotangent is kept; ``holders``: each kept input
    variable -> the path of the source site that keeps it; ``eqns``: the body's
    equations evaluated between them (indices, in order; sites included)."""

    scope: tuple
    jaxpr: Any
    target: tuple
    members: tuple
    holders: tuple  # ((var, path), ...)
    eqns: tuple


class _Res(tuple):
    """A backward closure: (equation indices, source site indices, interior site
    indices, kept variables). Immutable; `_union` merges."""


def _res(eqns=(), sources=(), interior=(), kept=()):
    return _Res((frozenset(eqns), frozenset(sources), frozenset(interior), frozenset(kept)))


def _union(*rs):
    return _Res(tuple(frozenset().union(*(r[k] for r in rs)) for k in range(4)))


def _scan_body(top, scope):
    """The open jaxpr at ``scope`` (a path of equation indices) where that path enters
    exactly one scan, and calls and checkpoints besides; else None."""
    j, scans = top, 0
    for idx in scope:
        eqn = j.eqns[idx]
        nest = walker.nest_of(eqn)
        if nest not in (walker.Nest.CALL, walker.Nest.REMAT, walker.Nest.SCAN):
            return None
        scans += nest is walker.Nest.SCAN
        j = walker.nested(eqn).jaxpr
    return j if scans == 1 else None


def find(plan, direct_mode, ingredients_mode=None):
    """``(segments, kept)``: the plan's `Segment` s and, for each of their sites, what
    it keeps (`sink_keys.Kept`, or None: nothing). ``direct_mode``: the `plans.Mode` of
    a leaf whose single site computes its values in the backward pass;
    ``ingredients_mode``: of a leaf whose sites' ingredients give them afterwards (a
    tied table)."""
    if not (ENABLED and _WORTH[-1]) or not plan.keep_for_clip:
        return (), {}
    an = plan.analysis
    top = plan.closed.jaxpr

    def plain(s):  # one batched input, its own site at its equation, no view factors
        return (not s.pads and not s.scales and s.tap_of is None
                and s.leaf not in plan.at_site and len(s.ext_vars) == 1 and all(s.ext_batched)
                and len(an.at(s.path)) == 1
                and not plan.kernels[s.path].keeps_products_for_clip())

    def eligible(s):  # a layer's: its leaf's only site, the scan's layer of the leaf
        return (plain(s) and plan.modes[s.leaf] is direct_mode
                and len(an.leaves[s.leaf].sites) == 1
                and s.depth == 1 and s.chain and s.chain[0].kind is views.Step.SCAN)

    def tail_eligible(s):  # (a tied table's head among them: its other sites keep theirs)
        return plain(s) and s.depth == 0 and plan.modes[s.leaf] in (direct_mode,
                                                                   ingredients_mode)

    scopes = {}
    for p, s in an.sites.items():
        scopes.setdefault(p[:-1], {})[p[-1]] = s
    segments, kept = [], {}
    nbytes = lambda s: _kept_bytes(plan, s)  # noqa: E731
    for scope, here in scopes.items():
        j = _scan_body(top, scope)
        if j is None:
            continue
        here = {i: s for i, s in here.items() if eligible(s) and j.eqns[i] is s.eqn}
        segments += _segments_of(j, scope, here, an, nbytes)
    here = {p[-1]: s for p, s in an.sites.items() if len(p) == 1 and tail_eligible(s)}
    segments += _tail_of(top, here, an, nbytes)
    for seg in segments:
        held = {p for _, p in seg.holders}
        for p in seg.members:
            kept[p] = (K.Kept.DY if p == seg.target else K.Kept.X if p in held else None)
    return tuple(segments), kept


def _tail_of(j, here, an, kept_bytes):
    """The loss's tail (a `Segment` without target: ``target`` None), or none: the sites
    whose outputs reach the per-example loss through no other site (a language model's
    head, and its bias), kept as their input alone; their cotangents are recomputed after
    the backward pass by the VJP of the equations from them to the loss (the log-softmax:
    under tensor parallelism a few ``[B, T]`` sums across the vocabulary's shards), where
    the backward pass had kept them for every site's norms and weighted sums."""
    if not here or isinstance(j.outvars[0], compat.Literal):
        return []
    free = set(j.invars) | set(j.constvars)
    back, uses, outs = _closure(j, (), here, an, free)
    end = j.outvars[0]
    r = back(end)
    if r is None or not r[1]:
        return []
    eqns, sources, interior, keep = r
    members = sources | interior
    if not _closed(j, eqns, members, None, uses, outs, end):
        return []
    if _raw_bytes(list(keep)) >= sum(kept_bytes(here[i]) for i in members):
        return []
    holders = tuple((v, (min(i for i in sources if here[i].ext_vars[0] is v),)) for v in keep)
    return [Segment((), j, None, tuple((i,) for i in sorted(members)), holders,
                    tuple(sorted(eqns)))]


def _nbytes(avals):
    return sum(math.prod(a.shape) * jnp.dtype(a.dtype).itemsize for a in jax.tree.leaves(avals))


def _kept_bytes(plan, site):
    """The bytes of two examples' ingredients a site keeps for a clipped sum otherwise
    (a scale's or bias's: its per-example gradient, smaller than its input)."""
    k = plan.kernels[site.path]
    ing = k.ingredient_avals(2)
    return _nbytes(traced_ingredient_avals(site, k, 2) if ing is None else ing)


def _raw_bytes(vs):
    return 2 * sum(math.prod(v.aval.shape) * jnp.dtype(v.aval.dtype).itemsize for v in vs)


def _closure(j, scope, here, an, free):
    """``(back, uses, outs)`` for the jaxpr ``j`` at ``scope`` whose eligible sites are
    ``here`` (equation index -> site): ``back(v)`` the equations that compute ``v`` from
    ``free`` variables, literals and sites' outputs (`_Res`: a site that passes its
    input's cotangent through, `PASS_THROUGH`, is computed from its input where that is
    computable too; any other is a source, its input kept), or None."""
    producer = {v: i for i, e in enumerate(j.eqns) for v in e.outvars}
    uses = {}
    for i, e in enumerate(j.eqns):
        for v in e.invars:
            if not isinstance(v, compat.Literal):
                uses.setdefault(v, set()).add(i)
    outs = {v for v in j.outvars if not isinstance(v, compat.Literal)}
    specials = {p[-1] for p in an.scopes if p[:-1] == scope} | {
        p[-1] for p in an.sites if p[:-1] == scope}
    memo = {}

    def back(v):
        if isinstance(v, compat.Literal):
            return _res()
        if v in memo:
            return memo[v]
        memo[v] = None  # (a jaxpr has no cycles; a guard all the same)
        r = None
        if v in free:
            r = _res()
        elif v in producer:
            i = producer[v]
            e = j.eqns[i]
            if i in here:
                s = here[i]
                (x,) = s.ext_vars
                rw = back(s.base)
                rx = back(x) if e.primitive in PASS_THROUGH else None
                if rw is not None:
                    r = _union(rw, _res({i}, sources={i}, kept={x}) if rx is None
                               else _union(rx, _res({i}, interior={i})))
            elif i not in specials:
                rs = [back(u) for u in e.invars]
                if all(q is not None for q in rs):
                    r = _union(_res({i}), *rs)
        memo[v] = r
        return r

    return back, uses, outs


def _segments_of(j, scope, here, an, kept_bytes):
    back, uses, outs = _closure(j, scope, here, an, {s.base for s in here.values()})

    taken, found = set(), []
    for t in sorted(here, reverse=True):  # the last first: the largest segments
        if t in taken:
            continue
        (x,) = here[t].ext_vars
        r = back(x)
        if r is None or not r[1]:
            continue
        eqns, sources, interior, keep = r
        members = sources | interior | {t}
        if members & taken or not _closed(j, eqns, sources | interior, t, uses, outs):
            continue
        # (worth it where what the segment keeps is less than its sites' ingredients)
        if (_raw_bytes(list(keep)) + _raw_bytes(here[t].eqn.outvars)
                >= sum(kept_bytes(here[i]) for i in members)):
            continue
        taken |= members
        holders = []
        for v in keep:
            p = min(i for i in sources if here[i].ext_vars[0] is v)
            holders.append((v, scope + (p,)))
        found.append(Segment(scope, j, scope + (t,), tuple(scope + (i,) for i in sorted(members)),
                             tuple(holders), tuple(sorted(eqns | {t}))))
    return found


def _closed(j, eqns, inner, t, uses, outs, end=None):
    """Whether every value computed from the inner sites' outputs is read by the
    segment's equations alone (so the VJP from the target's cotangent is each one's
    whole cotangent)."""
    dep = set()
    for i in sorted(eqns):
        e = j.eqns[i]
        if i in inner or any(v in dep for v in e.invars if not isinstance(v, compat.Literal)):
            dep.update(e.outvars)
    allowed = eqns if t is None else eqns | {t}
    return all((v not in outs or v is end) and uses.get(v, set()) <= allowed for v in dep)


class Member:
    """A leaf's clipped sum given by its segment (`install`): ``group(cs, prepare=None)``
    gives every member leaf's at once, for the per-leaf weights ``cs``, each site's
    ingredients read through ``prepare(ing, c)`` where given (clipping.py: their
    non-finite entries as zeros)."""

    def __init__(self, group):
        self.group = group


def in_layers(plan) -> set:
    """The paths of the sites whose clipped sums a scan layer's segment gives
    (`install`; a tail's sites get their ingredients back: `tail_ingredients`)."""
    return {p for seg in plan.segments if seg.target is not None for p in seg.members}


def install(plan, segments, sink_cts, diff, deferred):
    """``deferred[i]`` of every leaf of the scan layers' ``segments`` a `Member` of its
    segment's sums."""
    for seg in segments:
        if seg.target is None:
            continue
        fn = _group(plan, seg, sink_cts, diff)
        for p in seg.members:
            deferred[plan.analysis.sites[p].leaf] = Member(fn)


def _evaluate(seg, sites, env, probes):
    """The segment's equations for one example from ``env`` (its kept inputs, and free
    values: views, the call's other inputs), each site's outputs plus its zero probe
    (``probes``: their cotangents are the sites' output cotangents under ``jax.vjp``).
    Returns ``(read, ext)``: a reader of ``env`` after them, and each site's inputs."""
    read = lambda v: v.val if isinstance(v, compat.Literal) else env[v]  # noqa: E731
    by_idx = {p[-1]: p for p in seg.members}
    ext = {}
    for i in seg.eqns:
        e, p = seg.jaxpr.eqns[i], by_idx.get(i)
        if p is None:
            env.update(zip(e.outvars, compat.bind_eqn(e, [read(v) for v in e.invars])))
            continue
        s = sites[p]
        ext[p] = tuple(read(v) for v in s.ext_vars)
        outs = composite(s)(read(s.base), *ext[p])
        if p in probes:
            outs = tuple(o + d for o, d in zip(outs, probes[p]))
        env.update(zip(e.outvars, outs))
    return read, ext


def _probes(sites, paths, B):
    """Zeros shaped like the outputs of the sites at ``paths`` for ``B`` examples."""
    return {p: tuple(jnp.zeros((B,) + tuple(v.aval.shape), v.aval.dtype)
                     for v in sites[p].eqn.outvars) for p in paths}


def tail_ingredients(plan, sink_cts, ch):
    """``sink_cts`` with the ingredients of the loss tail's sites (`_tail_of`) formed
    again: their inputs as kept, their output cotangents by the VJP of the equations from
    them to the per-example loss (seeded with ones, as the backward pass), once every
    other site's values are out of the backward pass (so that XLA does not form them
    early and hold them through it). ``ch``: the chunk's leaves (engine._Chunk)."""
    tails = [seg for seg in plan.segments if seg.target is None]
    if not tails:
        return sink_cts
    an, out = plan.analysis, dict(sink_cts)
    (seg,) = tails
    others = [ct for p, ct in sink_cts.items() if p not in seg.members]
    late = sum((tiling.zero_after(jax.tree.leaves(ct)[0]) for ct in others
                if jax.tree.leaves(ct)), jnp.zeros((), jnp.float32))
    sites = {p: an.sites[p] for p in seg.members}
    kept_vars = [v for v, _ in seg.holders]
    kept = [sink_cts[p][K.INGREDIENTS][0] for _, p in seg.holders]
    kept = [x + late.astype(x.dtype) if jnp.issubdtype(x.dtype, jnp.inexact) else x
            for x in kept]
    j = seg.jaxpr
    n_diff, n_ex = len(ch.diff), len(ch.ex)
    ex_vars = j.invars[n_diff:n_diff + n_ex]
    const = dict(zip(j.constvars, plan.closed.consts))
    const.update(zip(j.invars[:n_diff], ch.diff))
    const.update(zip(j.invars[n_diff + n_ex:], ch.other))

    def one(ex, kv, probes):  # one example: the tail from its kept inputs to its loss
        env = {**const, **dict(zip(ex_vars, ex)), **dict(zip(kept_vars, kv))}
        read, ext = _evaluate(seg, sites, env, probes)
        return read(j.outvars[0]), (ext, {p: read(sites[p].base) for p in seg.members})

    run = jax.vmap(one, in_axes=(0, 0, 0), out_axes=(0, (0, None)))
    probes = _probes(sites, seg.members, ch.B)
    loss, pull, (ext, w) = jax.vjp(lambda pr: run(list(ch.ex), kept, pr), probes, has_aux=True)
    (dys,) = pull(jnp.ones_like(loss))
    for p in seg.members:
        s, k = sites[p], plan.kernels[p]
        x, dy = ext[p], dys[p]
        if plan.weights is not None:  # (as the site read them: `site_fns.mask_examples`)
            x, dy = mask_examples(plan.weights[0], x, s.ext_batched, dy)
        out[p] = {**out[p], K.INGREDIENTS: k.ingredients(k.prepare_site(w[p], x,
                                                                           s.ext_batched, dy))}
    return out


def _share(v):
    """A layer's sum, under a batch split by device, as each part's share of the sum
    over the parts (`Reduction.combined_share`'s: the same on every part, so that
    the layers' loop holds one for every part, not one per part; the clipped sum's
    ``psum`` at the end makes it whole). Exact where the parts are a power of two."""
    if not cuts.shares():
        return v
    return jax.lax.psum(v, cuts.split_axis()) / cuts.split_count()


def _group(plan, seg, sink_cts, diff):
    """``(cs, prepare=None) -> {leaf: sum_b c_b g_b}`` of the segment's leaves, one
    layer at a time (a scan over the layers, `Member`)."""
    an = plan.analysis
    sites = {p: an.sites[p] for p in seg.members}
    kept_vars = [v for v, _ in seg.holders]
    kept = [sink_cts[p][K.INGREDIENTS][0] for _, p in seg.holders]
    dy_t = tuple(sink_cts[seg.target][K.INGREDIENTS])
    ws = {p: views.from_leaf(diff[s.leaf], s) for p, s in sites.items()}
    inner = [p for p in seg.members if p != seg.target]

    def layer(xs, cs, prepare):
        kept_l, dy_l, w_l = xs

        def one(kv, probes):  # one example: the segment's equations from the kept inputs
            env = dict(zip(kept_vars, kv))
            env.update((sites[p].base, w_l[p]) for p in seg.members)
            read, ext = _evaluate(seg, sites, env, probes)
            return tuple(read(v) for v in sites[seg.target].eqn.outvars), ext

        probes = _probes(sites, inner, dy_l[0].shape[0])
        _, pull, ext = jax.vjp(lambda pr: jax.vmap(one)(kept_l, pr), probes, has_aux=True)
        (dys,) = pull(tuple(d.astype(v.aval.dtype) for d, v in
                            zip(dy_l, sites[seg.target].eqn.outvars)))
        out = {}
        for p in seg.members:
            s, k = sites[p], plan.kernels[p]
            dy = dy_l if p == seg.target else dys[p]
            ing = k.ingredients(k.prepare_site(w_l[p], ext[p], s.ext_batched, dy))
            c = cs[s.leaf]
            if prepare is not None:
                ing = prepare(ing, c)
            out[p] = _share(k.weighted_sum(ing, c))
        return out

    def group(cs, prepare=None):
        # the layers' sums accumulate in place into zeros made from the clip factors:
        # stacked by ``lax.map`` their buffers were zeros XLA made at the program's
        # start and held through it (a leaf's size each)
        L = dy_t[0].shape[0]
        zero = tiling.zero_after(cs[sites[seg.target].leaf])
        if cuts.shares():  # (one for every part, as the shares it accumulates)
            zero = jax.lax.psum(zero, cuts.split_axis())
        accs = {p: jnp.full((L,) + tuple(s.view_shape), zero, plan.kernels[p].acc)
                for p, s in sites.items()}

        def step(accs, xs):
            l, rest = xs
            out = layer(rest, cs, prepare)
            return {p: jax.lax.dynamic_update_index_in_dim(
                a, out[p].astype(a.dtype), l, 0) for p, a in accs.items()}, None

        sums, _ = jax.lax.scan(step, accs, (jnp.arange(L), (kept, dy_t, ws)))
        return {sites[p].leaf: views.to_leaf(v, sites[p]) for p, v in sums.items()}

    return group
