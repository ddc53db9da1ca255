"""Rules of the independence proof for contractions, convolutions, gathers and
scatters, collectives, calls and loops (scan, while, cond).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxpr_surgery._src import compat, walker
from jaxpr_surgery._src.independence.layout import _reduce_tag, _summed, _whole_axis
from jaxpr_surgery._src.independence.tags import (
    Acc,
    Cross,
    Cur,
    Ex,
    One,
    P,
    Sum,
    Unknown,
    _cross_sum,
    _is_literal,
    _shape,
)


def _dot_general(it, eqn, tags):
    tl, tr = tags[:2]
    if any(u is not None for u in tags[2:]):
        return it.unknown(eqn, tags, "has an operand the check does not know")
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    nl, nr = len(_shape(eqn.invars[0])), len(_shape(eqn.invars[1]))
    lfree = [d for d in range(nl) if d not in lc and d not in lb]
    rfree = [d for d in range(nr) if d not in rc and d not in rb]

    def place(t, contract, batch, free, offset):
        """('c', i) contracted as the i-th pair, ('b', i) a dot batch dim, ('f', out pos)."""
        if t.axis in contract:
            return "c", tuple(contract).index(t.axis)
        if t.axis in batch:
            return "b", tuple(batch).index(t.axis)
        return "f", offset + free.index(t.axis)

    sums = [t for t in (tl, tr) if isinstance(t, Sum)]
    if sums:
        if tl is None or tr is None:
            return [sums[0]]  # a sum over the batch times a constant
        if len(sums) == 2:
            return [_cross_sum(eqn, "multiplies", sums[1])]
        return [_cross_sum(eqn, "combines per-example values with", sums[0])]
    if tl is None or tr is None:
        t = tl if tl is not None else tr
        kind, i = (place(t, lc, lb, lfree, len(lb)) if tl is not None
                   else place(t, rc, rb, rfree, len(lb) + len(lfree)))
        if kind != "f":  # the constant's axis that meets the batch axis
            other = eqn.invars[1] if tl is not None else eqn.invars[0]
            mine, theirs = ((lc, rc) if kind == "c" else (lb, rb)) if tl is not None else (
                (rc, lc) if kind == "c" else (rb, lb))
            lined = it.lined_up(eqn, tags, t, [(other, theirs[tuple(mine).index(t.axis)])])
            if lined is not None:
                return [lined]
        if kind == "c":
            return [_summed(it, eqn, t)]  # a weighted sum over examples
        return [dataclasses.replace(t, axis=i)]
    pl, pr = place(tl, lc, lb, lfree, len(lb)), place(tr, rc, rb, rfree, len(lb) + len(lfree))
    if pl == pr and pl[0] in "cb":  # the batch axes meet (each operand has it elsewhere)
        tl, tr = dataclasses.replace(tl, axis=0), dataclasses.replace(tr, axis=0)
        both = tl if tl == tr else it.merge([tl, tr])
        if both is not None and pl[0] == "c":
            return [_summed(it, eqn, both)]  # sum over examples of x_b . y_b
        if both is not None:
            return [dataclasses.replace(both, axis=pl[1])]
        if tl.by is not None or tr.by is not None:
            return [Cross(eqn, "combines values of different examples", tl.by or tr.by,
                          how="reordered by")]
    return [Cross(eqn, "pairs different examples (an in-batch product such as q @ k.T)")]


def _conv(it, eqn, tags):
    tl, tr = tags[:2]
    dn = eqn.params["dimension_numbers"]
    if isinstance(tl, Sum) and tr is None:
        return [tl]
    if isinstance(tl, Ex) and tr is None and eqn.params.get("batch_group_count", 1) == 1:
        lhs_spec, _, out_spec = dn
        if tl.axis == lhs_spec[0]:
            return [dataclasses.replace(tl, axis=out_spec[0])]
    if isinstance(tl, Sum) or isinstance(tr, Sum):
        s = tl if isinstance(tl, Sum) else tr
        return [_cross_sum(eqn, "convolves", s)]
    return [Unknown(eqn, "convolves along the batch axis or with per-example kernels")]


def _reduce_window(it, eqn, tags):
    n = len(eqn.outvars)
    ops = tags[: len(tags) // 2] if eqn.primitive is P.reduce_window else tags
    t = it.meet(eqn, ops)
    if isinstance(t, Cross):
        return [t] * n
    if t is None:
        s = next(u for u in ops if isinstance(u, Sum))
        if eqn.primitive is P.reduce_window_sum:
            return [s] * n
        return [_cross_sum(eqn, f"applies {eqn.primitive} to", s)] * n
    a = t.axis
    p = eqn.params
    if p["window_dimensions"][a] > 1:
        return [Cross(eqn, "pools across the batch axis (across examples)")] * n
    ok = (p["window_strides"][a] == 1 and tuple(p["padding"][a]) == (0, 0)
          and p.get("base_dilation", (1,) * (a + 1))[a] == 1)
    return [_whole_axis(it, eqn, t, ok, "strides or pads the batch axis")] * n


def _gather(it, eqn, tags):
    to, ti = tags[:2]
    operand, indices = eqn.invars[:2]
    if isinstance(ti, Sum):
        return [_cross_sum(eqn, "indexes by", ti)]
    if isinstance(to, Sum):
        if ti is None:
            return [to]
        return [_cross_sum(eqn, "indexes, by per-example values,", to)]
    dn = eqn.params["dimension_numbers"]
    offset = tuple(dn.offset_dims)
    collapsed = tuple(dn.collapsed_slice_dims)
    smap = tuple(dn.start_index_map)
    obatch = tuple(getattr(dn, "operand_batching_dims", ()))
    ibatch = tuple(getattr(dn, "start_indices_batching_dims", ()))
    sizes = eqn.params["slice_sizes"]
    oshape, ishape, out_rank = _shape(operand), _shape(indices), len(_shape(eqn.outvars[0]))
    out_batch = [d for d in range(out_rank) if d not in offset]  # <-> indices' dims but last
    op_offset = [d for d in range(len(oshape)) if d not in collapsed and d not in obatch]

    def unknown(why):
        return [Unknown(eqn, why)]

    out_batch_axes = range(len(ishape) - 1)  # the indices' axes but the index vectors'
    cand = None
    if ti is not None:
        if ti.axis == len(ishape) - 1:
            return unknown("gathers with per-example index vectors")
        cand = dataclasses.replace(ti, axis=out_batch[ti.axis])
    if to is not None:
        k = to.axis
        if k in obatch:  # gather batching dims: row b of the operand for index row b
            jb = ibatch[obatch.index(k)]
            mine = dataclasses.replace(to, axis=out_batch[jb])
            if ti is not None and ti.axis != jb:
                return unknown("gathers from one example by the indices of another")
            if ti is None:  # take_along_axis(x, labels) with labels outside the batch
                lined = it.lined_up(eqn, tags, to, [(indices, jb)])
                if lined is not None:
                    return [lined]
        elif k in smap:
            comp = it.components(indices)[smap.index(k)] if not _is_literal(indices) else None
            lined_up = comp is not None and comp < len(ishape) - 1 and ishape[comp] == oshape[k]
            if not lined_up or sizes[k] != 1:
                if ti is None:  # x[order] with an order outside the batch
                    lined = it.lined_up(eqn, tags, to, [(indices, j) for j in out_batch_axes],
                                        index=True)
                    if lined is not None:
                        return [lined]
                return unknown("gathers along the batch axis by data (the examples are "
                               "indexed by values, as in graph batching)")
            mine = dataclasses.replace(to, axis=out_batch[comp])  # x[jnp.arange(B), ...]
            if ti is not None and ti.axis != comp:
                return unknown("gathers from one example by the indices of another")
            if ti is None and indices not in it.iota:  # x[jnp.arange(B)]: the examples
                # x[jnp.arange(B), labels] with labels outside the batch
                lined = it.lined_up(eqn, tags, to, [(indices, comp)])
                if lined is not None:
                    return [lined]
        elif k not in collapsed and sizes[k] == oshape[k]:
            mine = dataclasses.replace(to, axis=offset[op_offset.index(k)])
            if ti is not None:
                return unknown("gathers from per-example rows by the indices of other examples")
        else:
            return unknown("slices the batch axis (keeps some examples)")
        if cand is not None and cand != mine:
            return unknown("gathers from one example by the indices of another")
        cand = mine
    return [cand]


def _scatter(it, eqn, tags):
    to, ti, tu = tags[:3]
    operand, indices, updates = eqn.invars[:3]
    if isinstance(ti, Sum):
        return [_cross_sum(eqn, "indexes by", ti)]
    sums = [t for t in (to, tu) if isinstance(t, Sum)]
    if sums:
        linear = eqn.primitive in (P.scatter_add, P.scatter_sub, P.scatter)
        if ti is None and all(t is None or isinstance(t, Sum) for t in (to, tu)) and linear:
            return [sums[0]]
        return [_cross_sum(eqn, f"applies {eqn.primitive} to", sums[0])]
    dn = eqn.params["dimension_numbers"]
    uwin = tuple(dn.update_window_dims)
    inserted = tuple(dn.inserted_window_dims)
    sdims = tuple(dn.scatter_dims_to_operand_dims)
    obatch = tuple(getattr(dn, "operand_batching_dims", ()))
    ibatch = tuple(getattr(dn, "scatter_indices_batching_dims", ()))
    oshape, ishape, ushape = _shape(operand), _shape(indices), _shape(updates)
    uscatter = [d for d in range(len(ushape)) if d not in uwin]  # <-> indices' dims but last
    op_win = [d for d in range(len(oshape)) if d not in inserted and d not in obatch]

    def unknown(t=None):
        if t is not None and ti is None and not _is_literal(indices):
            # zeros(B).at[order].set(losses) with an order outside the batch
            lined = it.lined_up(eqn, tags, t, [(indices, j) for j in range(len(ishape) - 1)],
                                index=True)
            if lined is not None:
                return [lined]
        return [Unknown(eqn, "scatters across the batch axis by data (the examples are "
                             "indexed by values, as in graph batching)")]

    comps = it.components(indices) if not _is_literal(indices) else [None] * len(sdims)

    def operand_axis(j):
        """The operand axis that indices' axis ``j`` scatters along, one to one: a
        batching dim, or an index component equal to its position along ``j``
        (``x.at[jnp.arange(B), labels]``); else None."""
        if j in ibatch:
            return obatch[ibatch.index(j)]
        for c, d in enumerate(comps):
            k = sdims[c]
            if d == j and ishape[j] == oshape[k] and (k in inserted or k in obatch):
                return k
        return None

    if ti is not None and ti.axis == len(ishape) - 1:
        return unknown()
    # where the batch axis lies in the operand, as seen from each operand that has it
    want = []
    if to is not None:
        want.append(to)
    if tu is not None:
        u = tu.axis
        if u in uwin:
            k = op_win[uwin.index(u)]
            if k in sdims or ushape[u] != oshape[k] or ti is not None:
                return unknown()
        else:
            k = operand_axis(uscatter.index(u))
            if k is None:
                return unknown(tu)
        want.append(dataclasses.replace(tu, axis=k))
    if ti is not None:
        k = operand_axis(ti.axis)
        if k is None:
            return unknown()
        want.append(dataclasses.replace(ti, axis=k))
    if any(w != want[0] for w in want):
        return unknown()
    t = want[0]
    k = t.axis
    scattered = k in sdims or k in obatch
    if scattered and k not in (operand_axis(j) for j in range(len(ishape) - 1)):
        return unknown(t)
    if not scattered and k in inserted:
        return unknown()
    # x.at[jnp.arange(B), labels] with labels (or the updates) outside the batch
    pairs = []
    if ti is None and not _is_literal(indices) and indices not in it.iota:
        pairs += [(indices, j) for j in range(len(ishape) - 1) if operand_axis(j) == k]
    if tu is None:
        pairs += [(updates, u) for j, u in enumerate(uscatter) if operand_axis(j) == k]
        pairs += [(updates, u) for u in uwin if op_win[uwin.index(u)] == k]
    lined = it.lined_up(eqn, tags, t, pairs) if pairs else None
    return [lined or t]


def _collective(summing):
    """psum/pmax/pmin. Integer axes are positional: ``vmap(..., axis_name=...)`` turns a
    collective over its axis into a reduction over the mapped axis (batch norm written
    per example with ``lax.pmean``). Named axes the examples do not vary over (tensor
    parallelism: in a typed ``shard_map`` the operand varies over them, the batch does
    not) add up parts of the same examples; those the batch is split over
    (``axis_name``, or the axes the batch varies over in ``shard_map``) add up other
    devices' examples. A named axis the call knows neither way (``pmap`` or ``shard_map``
    with ``check_vma=False`` without ``axis_name``, whose types say nothing) is undecided."""

    def rule(it, eqn, tags):
        axes = eqn.params.get("axes", eqn.params.get("axis_name", ()))
        axes = tuple(axes) if isinstance(axes, (tuple, list)) else (axes,)
        positional = tuple(int(a) for a in axes if isinstance(a, (int, np.integer)))
        named = [a for a in axes if not isinstance(a, (int, np.integer))]
        data = [a for a in named if a in it.data_axes]
        outs = []
        for v, t in zip(eqn.invars, tags[: len(eqn.outvars)]):
            if t is not None and positional and not isinstance(t, (Cur, One)):
                t = _reduce_tag(it, eqn, t, positional, summing)
            varying = compat._aval_vma(v.aval) or frozenset()
            unknown = [a for a in named if a not in it.data_axes and a not in varying]
            if t is not None and unknown and not data and not isinstance(t, (Cross, Unknown)):
                names = ", ".join(repr(a) for a in unknown)
                t = Unknown(
                    eqn, f"reduces over the named axis {names}, which the call does not know "
                    "(no axis_name, and no types that say what varies over it): if the batch "
                    f"is split over it, pass axis_name={unknown[0]!r} and do not reduce the loss "
                    "over it in fn (per_example_stat combines the devices' examples itself); "
                    "if it splits the model (tensor parallelism), run under shard_map with "
                    "check_vma=True, whose types tell the check", under=t)
            if t is not None and data and not isinstance(t, Cross):
                names = ", ".join(repr(a) for a in data)
                t = Cross(
                    eqn, f"reduces across the devices, over {names}: the mesh axis the batch "
                    "is split over, so it combines other devices' examples",
                    fix=f"do not reduce the loss over {names} in fn: per_example_stat with "
                    f"axis_name={data[0]!r} combines the devices' examples itself, and fn "
                    "is the loss of each device's own examples (their mean)")
            outs.append(t)
        return outs

    return rule


def _across(it, eqn, verb, effect):
    """A collective over named mesh axes that moves blocks between devices (all_gather,
    psum_scatter): `Cross` over an axis the batch is split over (`_collective`'s data
    axes: it ``effect``), `Unknown` over one the call knows neither way (positional, or
    one the operand's types do not say it varies over), else None: over axes the operand
    varies over and the batch does not (tensor parallelism in a typed ``shard_map``) it
    moves parts of the same examples."""
    axes = eqn.params.get("axis_name", ())
    axes = tuple(axes) if isinstance(axes, (tuple, list)) else (axes,)
    data = [a for a in axes if a in it.data_axes]
    if data:
        names = ", ".join(repr(a) for a in data)
        return Cross(eqn, f"{verb} across the devices, over {names}: the mesh axis the batch "
                          f"is split over, so it {effect}")
    varying = compat._aval_vma(eqn.invars[0].aval) or frozenset()
    if any(isinstance(a, (int, np.integer)) or a not in varying for a in axes):
        return Unknown(eqn, f"{verb} over a mesh axis the call does not know (no axis_name, "
                            "and no types that say what varies over it)")
    return None


def _parts(eqn, t, dim, tiled, inserted, verb):
    """The tag of the parts of the same examples moved along dimension ``dim`` (a new
    axis there where ``inserted``, removed where not, unless ``tiled``): the examples'
    axis stays where it was, shifted past the new or removed axis; along it, undecided."""
    if isinstance(t, (One, Cur)) or (isinstance(t, Sum) and not t.terms):
        return t  # (the same examples' parts)
    if not isinstance(t, Ex) or (dim == t.axis and (tiled or not inserted)):
        return Unknown(eqn, f"{verb} the devices' blocks along the batch axis")
    if tiled:
        return t
    return dataclasses.replace(t, axis=t.axis + (1 if inserted else -1) * (dim <= t.axis))


def _moving(verb, effect, dim_param, inserted):
    """all_gather (each device's block of every device along one dimension: a new axis
    there unless tiled) and psum_scatter (the devices' sum, each keeping its block: that
    axis removed unless tiled), checked by `_across`, then `_parts`."""

    def rule(it, eqn, tags):
        bad = _across(it, eqn, verb, effect)
        if bad is not None:
            return [bad]
        prm = eqn.params
        return [_parts(eqn, tags[0], int(prm[dim_param]), bool(prm.get("tiled")), inserted,
                       verb)]

    return rule


# -- structured primitives: they recurse, and see Cross and Unknown operands -- #
def _enter_run(it, eqn, jaxpr, tags):
    """``jaxpr`` (the body of a call-like ``eqn``) run on ``tags``; the values lined up
    with the batch (`Lined`) pass in and out."""
    it.enter(eqn.invars, jaxpr.invars)
    outs = it.tags_of(jaxpr, tags, outer=dict(zip(jaxpr.invars, eqn.invars)), call=eqn)
    it.enter(jaxpr.outvars, eqn.outvars)
    return outs


def _split_axes(spec, dim):
    """The mesh axes a ``PartitionSpec`` splits dimension ``dim`` over (none: ())."""
    entry = spec[dim] if spec is not None and dim < len(spec) else None
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)


def _pass_lined(it, outer, inner, specs):
    """`_Interp.enter` across a ``shard_map``: an operand's axes lined up with the batch
    pass to the block only where its spec keeps them whole."""
    it.enter(outer, inner)
    for v, spec in zip(inner, specs):
        got = None if _is_literal(v) else it.lined.get(v)
        if got:
            kept = {a: src for a, src in got.items() if not _split_axes(spec, a)}
            if kept:
                it.lined[v] = kept
            else:
                it.lined.pop(v, None)


def _shard_map(it, eqn, view, tags, path):
    """A ``shard_map`` inside the loss (`walker.Mapped`) whose blocks keep the batch axis
    whole on every device, as tensor parallelism written by hand does: the body runs on
    the operands' tags, and a collective in it over the mesh axes it maps adds up parts
    of the same examples where the body's types say the value varies over them
    (`_collective`; without ``check_vma`` they say nothing, and the check is undecided).
    A block that splits the examples over a mesh axis, an operand tagged other than by
    the examples' axis, or an output assembled along its batch axis is not followed."""
    n = len(eqn.outvars)
    for t in tags:
        if isinstance(t, (Cross, Unknown)):
            return [t] * n
    for t, spec in zip(tags, view.in_specs):
        if t is None:
            continue
        if not isinstance(t, Ex):
            return [Unknown(eqn, "runs a shard_map on a value the check follows only as a "
                                 "batch of examples")] * n
        if _split_axes(spec, t.axis):
            return [Unknown(eqn, "splits the examples of the batch over the mesh axes "
                                 f"{_split_axes(spec, t.axis)} inside the loss (a shard_map "
                                 "whose in_specs split the batch axis); pass the batch's "
                                 "mesh axes as axis_name instead, with fn the loss of each "
                                 "device's examples")] * n
    _pass_lined(it, eqn.invars, view.jaxpr.invars, view.in_specs)
    outs = it.tags_of(view.jaxpr, tags)
    _pass_lined(it, view.jaxpr.outvars, eqn.outvars, view.out_specs)
    for k, (t, spec) in enumerate(zip(outs, view.out_specs)):
        if isinstance(t, Ex) and _split_axes(spec, t.axis):
            outs[k] = Unknown(eqn, "assembles a shard_map's output along its batch axis "
                                   "from every device's block")
    return outs


def _once(it, eqn, view, tags, path):
    """A call, checkpoint or custom_vjp / custom_jvp call (`walker.Once`): its body."""
    return _enter_run(it, eqn, view.jaxpr, tags)


def _counters(prm, nc, ncar, outer):
    """The carries of a scan that count its iterations from 0 by 1 (``fori_loop``)."""
    body, found = prm.jaxpr, []
    made = {o: e for e in body.eqns for o in e.outvars}
    for k in range(ncar):
        init = outer[nc + k]
        if not (_is_literal(init) and np.ndim(init.val) == 0 and init.val == 0
                and np.issubdtype(np.asarray(init.val).dtype, np.integer)):
            continue
        out = body.outvars[k]
        e = None if _is_literal(out) else made.get(out)
        if e is None or e.primitive is not P.add:
            continue
        a, b = e.invars
        one = [x for x in (a, b) if _is_literal(x) and np.ndim(x.val) == 0 and x.val == 1]
        if one and body.invars[nc + k] in (a, b):
            found.append(k)
    return found


def _scan(it, eqn, prm, tags, path):
    nc, ncar = prm.num_consts, prm.num_carry
    level, xs = None, []
    for t in tags[nc + ncar :]:
        if isinstance(t, Ex):
            if t.axis > 0:
                t = dataclasses.replace(t, axis=t.axis - 1)
            elif (t.outer, t.inner, t.perm) == (1, 1, None):
                level = next(it.levels) if level is None else level
                t = Cur(level)  # lax.map over the examples
            else:
                t = Unknown(eqn, "scans along the batch axis in steps that are not examples")
        xs.append(t)
    body = prm.jaxpr
    it.enter(eqn.invars[:nc], body.invars[:nc])  # loop-invariant
    it.enter([], body.invars[nc : nc + ncar])
    for o, i in zip(eqn.invars[nc + ncar :], body.invars[nc + ncar :]):  # one step of xs
        got = None if _is_literal(o) else it.lined.get(o)
        it.lined.pop(i, None)
        if got and any(a > 0 for a in got):
            it.lined[i] = {a - 1: src for a, src in got.items() if a > 0}
    if prm.length == it.B and not prm.reverse:
        # fori_loop(0, B, ...): its counter indexes the examples (`_dynamic_slice`)
        for k in _counters(prm, nc, ncar, eqn.invars):
            level = next(it.levels) if level is None else level
            it.counter[body.invars[nc + k]] = level
    carry, ys = it.fixpoint(eqn, body, tags[:nc], tags[nc : nc + ncar], xs, level,
                            outer=dict(zip(body.invars[:nc], eqn.invars[:nc])))
    done = []
    for t in carry:
        if isinstance(t, Acc) and t.level == level:
            t = Sum(eqn)  # the loop added up the examples' terms
        done.append(t)
    out = []
    for t in ys:
        if isinstance(t, Ex):
            t = dataclasses.replace(t, axis=t.axis + 1)
        elif isinstance(t, Cur) and t.level == level:
            t = Ex(0)
        elif isinstance(t, Acc) and t.level == level:
            t = Cross(eqn, "accumulates along the batch axis (across examples): its outputs "
                           "are running sums over the examples")
        out.append(t)
    return done + out


def _while(it, eqn, wp, tags, path):
    cn, bn = wp.cond_nconsts, wp.body_nconsts
    it.enter(eqn.invars[:cn], wp.cond.invars[:cn])
    it.enter([], wp.cond.invars[cn:])
    it.enter(eqn.invars[cn : cn + bn], wp.body.invars[:bn])
    it.enter([], wp.body.invars[bn:])
    carry, _ = it.fixpoint(eqn, wp.body, tags[cn : cn + bn], tags[cn + bn :], [],
                           outer=dict(zip(wp.body.invars[:bn], eqn.invars[cn : cn + bn])))
    seen = {}
    (pred,) = it.tags_of(wp.cond, list(tags[:cn]) + carry, seen,
                         outer=dict(zip(wp.cond.invars[:cn], eqn.invars[:cn])))
    if pred is None:
        return carry
    if isinstance(pred, (Ex, Cur, One)):
        # a batched predicate (jax.vmap of a while_loop): each element of the leading axes
        # stops on its own, so every carry follows the predicate's examples; a loop on
        # one example taken out of the batch runs as often as on that example alone
        return [it.join(eqn, c, pred) for c in carry]
    # a loop that runs until the last example is done: the values of the examples that
    # a batch of one would have stopped earlier are right if the body leaves them alone
    masked = _masked_loop(eqn, wp, carry, seen, it.acts_elementwise)
    why = "loops a number of times that depends on the examples"
    return [c if isinstance(c, Cross) or (masked and isinstance(c, Ex)) else Unknown(eqn, why)
            for c in carry]


def _masked_loop(eqn, wp, carry, cond_tags, elementwise):
    """A loop that runs while any example is unfinished, ``while jnp.any(q)`` with ``q``
    one flag per example, and leaves every finished example unchanged: each carry that
    depends on the examples comes out of the body as ``select_n(q', carry, new)``
    (``jnp.where(q', new, carry)``) with ``q'`` computed like ``q`` (`_Numbering`).
    Extra iterations then change no example that a batch of one would have stopped, and
    the others see the same iterations as alone (examples stop, they never pause)."""
    out = wp.cond.outvars[0]
    red = next((e for e in wp.cond.eqns if out in e.outvars), None)
    if red is None or red.primitive is not P.reduce_or or _is_literal(red.invars[0]):
        return False
    q = red.invars[0]
    if len(_shape(q)) != 1 or cond_tags.get(q) != Ex(0):
        return False
    ex = [isinstance(c, Ex) for c in carry]
    if not any(ex) or any(isinstance(c, Ex) and c != Ex(0) for c in carry):
        return False
    num = _Numbering(elementwise)
    outer = [num.operand(v) for v in eqn.invars]
    carry_keys = [num.intern(("carry", k)) for k in range(len(carry))]
    cn = wp.cond_nconsts
    num.run(wp.cond, outer[:cn] + carry_keys)
    qkey = num.strip(num.env_of(wp.cond)[q])
    outs = num.run(wp.body, outer[cn : cn + wp.body_nconsts] + carry_keys)
    for k, o in enumerate(outs):
        if not ex[k] or o == carry_keys[k]:
            continue
        node = num.nodes[o]
        if not (node[0] is P.select_n and len(node[2]) == 3 and node[2][1] == carry_keys[k]
                and num.strip(node[2][0]) == qkey):
            return False
    return True


class _Numbering(walker.Walker):
    """Value numbering of a loop's cond and body: equal numbers, equal computations.
    Broadcasts along trailing axes (``keepdims``, ``jnp.where``'s broadcast of a
    predicate) are seen through where an elementwise op consumes them (`strip`):
    elementwise ops commute with them."""

    def __init__(self, elementwise):
        self.ids, self.nodes, self.envs = {}, [], {}
        self.elementwise = elementwise  # prim -> whether it acts element by element

    def intern(self, node):
        i = self.ids.get(node)
        if i is None:
            i = self.ids[node] = len(self.nodes)
            self.nodes.append(node)
        return i

    def operand(self, v):
        """The number of a loop's operand (a variable or literal of the enclosing jaxpr)."""
        if _is_literal(v):
            return self.literal(v)
        return self.intern(("operand", v))

    def literal(self, v):
        val = np.asarray(v.val)
        return self.intern(("literal", str(val.dtype), val.shape, val.tobytes()))

    def env_of(self, jaxpr):
        return self.envs[id(jaxpr)]

    def strip(self, k):
        node = self.nodes[k]
        while node[0] == "trailing":
            k = node[1]
            node = self.nodes[k]
        return k

    def read(self, env, v):
        if _is_literal(v):
            return self.literal(v)
        if v not in env:
            env[v] = self.intern(("free", id(v)))
        return env[v]

    def run(self, jaxpr, in_keys, path=(), *ctx, consts=None):
        env = self.envs[id(jaxpr)] = dict(zip(jaxpr.invars, in_keys))
        if consts is not None:
            env.update(zip(jaxpr.constvars, consts))
        self.walk(jaxpr, env, path, 0, len(jaxpr.eqns), *ctx)
        return [self.read(env, v) for v in jaxpr.outvars]

    def call(self, eqn, view, ins, path):
        return self.run(view.jaxpr, ins, path)

    def equation(self, eqn, ins, path):
        prim = eqn.primitive
        if _trailing_broadcast(eqn):
            return [self.intern(("trailing", ins[0], _shape(eqn.outvars[0])))]
        if walker.bodies(eqn) or len(eqn.outvars) != 1:
            return [self.intern(("opaque", id(eqn), k)) for k in range(len(eqn.outvars))]
        args = tuple(self.strip(k) for k in ins) if self.elementwise(prim) else tuple(ins)
        return [self.intern((prim, _freeze(eqn.params), args))]

    ENTER = {walker.Nest.CALL: call}


def _trailing_broadcast(eqn):
    """A broadcast that keeps the leading axes in place and adds or expands trailing ones."""
    prim = eqn.primitive
    if len(eqn.invars) != 1 or len(eqn.outvars) != 1:
        return False
    i, o = _shape(eqn.invars[0]), _shape(eqn.outvars[0])
    if prim is P.broadcast_in_dim:
        return tuple(eqn.params["broadcast_dimensions"]) == tuple(range(len(i)))
    if prim is P.squeeze or (prim is P.reshape and eqn.params.get("dimensions") is None):

        def strip(s):
            s = list(s)
            while s and s[-1] == 1:
                s.pop()
            return s

        return strip(i) == strip(o)
    return False


def _freeze(params):
    out = []
    for k in sorted(params):
        v = params[k]
        try:
            hash(v)
        except TypeError:
            v = ("unhashable", id(v))
        out.append((k, v))
    return tuple(out)


def _cond(it, eqn, branches, tags, path):
    idx, ops = tags[0], tags[1:]
    outs = None
    for br in branches.jaxprs:
        it.enter(eqn.invars[1:], br.invars)
        o = it.tags_of(br, ops, outer=dict(zip(br.invars, eqn.invars[1:])))
        outs = o if outs is None else [it.join(eqn, a, b) for a, b in zip(outs, o)]
    if idx is None:
        return outs
    n = len(outs)
    if isinstance(idx, (Cross, Unknown)):
        return [idx] * n
    if isinstance(idx, Sum):
        return [_cross_sum(eqn, "branches on", idx)] * n
    return [it.join(eqn, idx, o) for o in outs]
