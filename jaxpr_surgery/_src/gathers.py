"""Parameters gathered over the examples' mesh axis: hand-written FSDP inside ``shard_map``.

A loss that starts with ``w = jax.lax.all_gather(w_shard, "fsdp", tiled=True)``, the
examples split over ``"fsdp"`` as well, uses the whole weight on every device. Each
example's gradient of the shard is a slice of its gradient of the whole weight, which
the device that holds the example computes alone. So the gather is lifted out of the
per-example jaxpr (`lift`): the whole weight becomes the differentiated input, gathered
once before the statistics (`gather`); every device reduces its own examples'
gradients of the whole weight, the devices' values are combined over ``axis_name`` as
for a replicated weight, and each device keeps its shard of a leaf-shaped statistic
(`scatter`: the transpose of the gather, as ``jax.grad`` gives the shard's gradient).
Per-example norms are those of the whole weight's gradient, which the device holds for
its own examples: no sum over the devices, and clipping reads them as they are.

Any other collective over the examples' axes that a parameter goes through is refused
(`analysis_types.Analysis.crossing`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from jaxpr_surgery._src import compat, stats_research, walker
from jaxpr_surgery._src import stats as S
from jaxpr_surgery._src.moments import Totals
from jaxpr_surgery._src.weighting import unweighted


def _gather_axes(eqn):
    names = eqn.params["axis_name"]
    return tuple(names) if isinstance(names, (tuple, list)) else (names,)


def liftable(eqn, axes):
    """``eqn`` is an ``all_gather`` over some of ``axes`` (the ``axis_name`` the
    examples are split on) of the whole axis group."""
    return (
        eqn.primitive is compat.all_gather_p
        and eqn.params.get("axis_index_groups") is None
        and bool(_gather_axes(eqn))
        and all(not isinstance(a, int) and a in axes for a in _gather_axes(eqn))
    )


def lift(closed, n_leaves, axes):
    """``(closed, gathers)``: the per-example jaxpr with the ``all_gather`` of each
    parameter leaf whose every use is that gather (over ``axes``, the same each time)
    removed, the gathered value its input in place of the leaf; ``gathers``: leaf index
    -> the gather's equation (`gather`, `scatter`). A gather inside the body of a
    ``lax.scan`` (of a stacked leaf's layer, or of a leaf the body closes over), a
    ``jax.checkpoint`` or a ``jax.jit`` the leaf is passed into is hoisted out of it
    (`_hoisted`): the whole leaf is gathered once before the body, as a gather written
    before the loop would be. Leaves used any other way are left as they are (and
    refused by the analysis where a collective over ``axes`` remains)."""
    jaxpr = closed.jaxpr
    if not axes:
        return closed, {}
    gathers = {}
    for i in range(n_leaves):
        got = _hoisted(jaxpr, jaxpr.invars[i], axes)
        if got is not None:
            jaxpr, gathers[i] = got
    if not gathers:
        return closed, {}
    return compat.ClosedJaxpr(jaxpr, closed.consts), gathers


def _hoisted(jaxpr, v, axes):
    """``(jaxpr', eqn)`` where every use of ``jaxpr``'s input ``v`` is an ``all_gather``
    over ``axes`` with the same params, directly or inside the bodies of equations it is
    passed into (`_into_body`): ``jaxpr'`` takes the gathered value in place of ``v``
    (those gathers removed), ``eqn`` gathers ``v`` into it. None where some use is not."""
    if any(x is v for x in jaxpr.outvars):
        return None
    gathered, eqn, subst, eqns = None, None, {}, []
    for e in jaxpr.eqns:
        at = [k for k, x in enumerate(e.invars) if x is v]
        if not at:
            eqns.append(e)
            continue
        if liftable(e, axes):
            one = e
        elif (custom := _custom_gather(e, at, axes)) is not None:
            e = one = custom  # (a gather written with its own backward pass)
        else:
            got = _into_body(e, at, axes)
            if got is None:
                return None
            e, one = got
        if eqn is not None and one.params != eqn.params:
            return None
        if gathered is None:
            gathered, eqn = one.outvars[0], one
        elif one is e:
            subst[e.outvars[0]] = gathered
        if one is not e:
            eqns.append(e.replace(invars=[gathered if k in at else x
                                          for k, x in enumerate(e.invars)]))
    if eqn is None:
        return None
    eqn = eqn.replace(invars=[v])  # (one from a body gathers the body's input)

    def sub(vs):
        return [subst.get(x, x) if not isinstance(x, compat.Literal) else x for x in vs]

    if subst:
        eqns = [e.replace(invars=sub(e.invars)) for e in eqns]
    invars = [gathered if x is v else x for x in jaxpr.invars]
    return jaxpr.replace(invars=invars, eqns=eqns, outvars=sub(jaxpr.outvars)), eqn


def _custom_gather(e, at, axes):
    """An ``all_gather`` of a ``jax.custom_vjp`` call's operand into its output, where the
    call is a gather written with its own backward pass (ZeRO-style code): its primal
    body that gather of its one operand alone, its backward pass the gather's transpose
    (a ``psum_scatter`` of the cotangent over the same axes and dimension, nothing else:
    the statistics' own combination replaces it exactly). One that scales, casts (a
    reduce-scatter in bfloat16) or computes anything else is not one (its leaf is
    refused: the statistics would not be of its gradients). None for any other
    equation."""
    if (e.primitive is not compat.custom_vjp_call_p or at != [0] or len(e.invars) != 1
            or len(e.outvars) != 1):
        return None
    body = walker.body(e)
    got = _hoisted(body, body.invars[0], axes)
    if got is None or got[0].eqns or got[0].outvars[0] is not got[0].invars[0]:
        return None
    g = got[1]
    return g.replace(invars=list(e.invars), outvars=list(e.outvars)) if _transposes(e, g) else None


def _transposes(e, g):
    """Whether the backward pass of custom_vjp call ``e`` is the transpose of gather
    ``g``: traced (jax.vjp of the call) and read, its output a ``psum_scatter`` of the
    cotangent with ``g``'s axes, dimension and tiling (through casts to varying only)."""
    xa, ya = e.invars[0].aval, e.outvars[0].aval
    vma = compat.vma_of(xa) | compat.vma_of(ya)

    def back(w, ct):
        return jax.vjp(lambda w: compat.bind_eqn(e, [w])[0], w)[1](ct)[0]

    zero = lambda a: compat.make_varying(jax.numpy.zeros(a.shape, a.dtype), vma)  # noqa: E731
    try:
        jaxpr = jax.make_jaxpr(back)(zero(xa), zero(ya)).jaxpr
    except Exception:  # noqa: BLE001 - a backward pass that cannot run alone: not a gather's
        return False
    made = {o: q for q in jaxpr.eqns for o in q.outvars}
    v, scattered = jaxpr.outvars[0], False
    while isinstance(v, compat.Var) and v in made:  # (a literal: a constant cotangent)
        q = made[v]
        if q.primitive is compat.reduce_scatter_p and not scattered:
            p, want = q.params, g.params
            if (tuple(_gather_axes(q)) != tuple(_gather_axes(g)) or p["axis_index_groups"]
                    or p["scatter_dimension"] != want["all_gather_dimension"]
                    or p["tiled"] != want["tiled"]):
                return False
            scattered = True
        elif q.primitive not in compat.vma_cast_prims or len(q.invars) != 1:
            return False
        v = q.invars[0]
    return scattered and v is jaxpr.invars[1]


def _into_body(e, at, axes):
    """``(e', gather)``: equation ``e`` (a ``scan``, ``jax.checkpoint`` or plain
    ``jax.jit``) whose operands ``at`` are one leaf, each gathered in its body
    (`_hoisted`), with a body that takes the gathered values instead; ``gather`` an
    ``all_gather`` of the leaf into a new variable of the value ``e'`` takes (a scan's
    layers: the gather's axis one further). None where the leaf is a scan's carry or
    used otherwise in the body."""
    nest = walker.nest_of(e)
    if nest is walker.Nest.SCAN:
        loop = walker.nested(e)
        body, start = loop.jaxpr, loop.num_consts + loop.num_carry
        if any(loop.num_consts <= k < start for k in at):
            return None
        stacked = [k >= start for k in at]
    elif nest is walker.Nest.REMAT or (nest is walker.Nest.CALL and compat.plain_call(e)):
        body, stacked = walker.body(e), [False] * len(at)
    else:
        return None
    new, one = body, None
    for k, layers in zip(at, stacked):
        got = _hoisted(new, new.invars[k], axes)
        if got is None:
            return None
        new, inner = got
        dim = inner.params["all_gather_dimension"] + int(layers)
        aval = inner.outvars[0].aval
        if layers:
            aval = aval.update(shape=(loop.length, *aval.shape))
        cand = inner.replace(params={**inner.params, "all_gather_dimension": dim},
                             outvars=[compat.Var(aval)])
        if one is not None and (cand.params != one.params
                                or cand.outvars[0].aval != one.outvars[0].aval):
            return None
        one = one or cand
    return compat.map_subjaxprs(e, lambda j: new if j is body else j), one


def gather(eqn, x):
    """The whole weight from the device's shard ``x``, by the loss's own gather."""
    return compat.bind_eqn(eqn, [x])[0]


def scatter(eqn, value, offset=0):
    """This device's shard of a statistic shaped like the whole weight (a tree of
    arrays: moments): the slice the gather put there. ``offset``: axes of the weight
    the value lacks before the gathered one (one layer of a stacked weight)."""
    names = _gather_axes(eqn)
    a = eqn.params["all_gather_dimension"] - offset
    n = eqn.params["axis_size"]
    idx = jax.lax.axis_index(names if len(names) > 1 else names[0])

    def one(x):
        if eqn.params["tiled"]:
            k = x.shape[a] // n
            return jax.lax.dynamic_slice_in_dim(x, idx * k, k, axis=a)
        return jax.lax.dynamic_index_in_dim(x, idx, axis=a, keepdims=False)

    return jax.tree.map(one, value)


# reductions combined over the devices by a plain sum (`Reduction.combine_axis`: psum)
_SUMMED = (S.PhiSum.combine_axis, S.ClippedSum.combine_axis)
# reductions whose combination totals sums about the whole batch's mean, which their
# `combine_axis` takes as ``totals=`` (a `moments.Totals`)
_SPLIT = (S.Centered.combine_axis, stats_research.CentralMoments.combine_axis)


def combine(eqn, r, value, n_local, N, axis_name, offset=0):
    """The value of reduction ``r`` over every device's examples for a leaf gathered by
    ``eqn``, this device's shard of it: a sum (of a function, a clipped sum) is
    reduce-scattered over the gather's axes (the transpose of the gather, as ``jax.grad``
    gives the shard's gradient; summed over the other axes of ``axis_name``); so are
    the moments' mean and their sums about it, the mean then gathered whole to centre
    each device's sums (no whole mean is all-reduced: XLA merged those all-reduces into
    one for every leaf at the end of the backward pass, so each leaf's moments were held
    whole until then: hand-written FSDP's variance at 1.3x grad's memory); any other
    value is combined whole (`Reduction.combine_axis`), then sliced. ``offset``: as in
    `scatter`."""
    if r.per_example:
        return value
    names = _gather_axes(eqn)
    every = tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)
    rest = tuple(a for a in every if a not in names)
    group = names if len(names) > 1 else names[0]
    dim, tiled = eqn.params["all_gather_dimension"] - offset, eqn.params["tiled"]

    def total(value):  # (every device's sum, reduce-scattered to the device's shard,
        # then summed over the other axes: a shard, not the whole value, crosses them)
        value = jax.tree.map(
            lambda x: jax.lax.psum_scatter(x, group, scatter_dimension=dim, tiled=tiled),
            value)
        return jax.lax.psum(value, rest) if rest else value

    kind = type(unweighted(r)).combine_axis
    if kind in _SPLIT:
        spread = lambda x: jax.lax.all_gather(x, group, axis=dim, tiled=tiled)  # noqa: E731
        return r.combine_axis(value, n_local, N, axis_name,
                              totals=Totals(total, spread, lambda x: scatter(eqn, x, offset)))
    if kind not in _SUMMED:
        return scatter(eqn, r.combine_axis(value, n_local, N, axis_name), offset)
    return total(value)


@dataclasses.dataclass(frozen=True, eq=False)
class AtSite:
    """A gathered leaf's statistics combined across the devices at its site, inside the
    backward pass (`plans.combined_at_site`), where the engine would combine them after
    it (api.py): each device then holds its shard of the leaf's sums from the site on,
    not every layer's whole sums until the backward pass ends (the moments of
    hand-written FSDP: XLA kept each layer's whole sums to the end of the program).
    A sum (of a function) and the moments; not a call in chunks or with example
    weights (their values are carried or weighed after the site)."""

    eqn: Any  # the leaf's all_gather (`lift`)
    axis_name: Any
    offset: int = 0  # 1: the values are of one layer of a stacked leaf (its axis 0)

    @property
    def key(self):
        p = self.eqn.params
        return ("gathered", _gather_axes(self.eqn), p["all_gather_dimension"], p["tiled"],
                p["axis_size"], _axes(self.axis_name), self.offset)

    def per_layer(self):
        """The same for the values of one layer of the leaf stacked on its axis 0 (a site
        inside ``lax.scan``); None where the gather is over that axis (a layer is then
        one device's)."""
        if self.eqn.params["all_gather_dimension"] == 0:
            return None
        return dataclasses.replace(self, offset=1)

    @property
    def size(self) -> int:
        """The devices the leaf is gathered from."""
        return self.eqn.params["axis_size"]

    def parts(self, axis) -> int | None:
        """How many pieces the devices' shards cut axis ``axis`` of a leaf-shaped value
        into (1: the gather is along another axis), for a loop over blocks of that axis
        whose values this combines block by block (`tiling.reduce_tiles`'s
        ``combine``); None where the shard lacks an axis of the leaf (an untiled gather)
        or the values are a layer's."""
        p = self.eqn.params
        if not p["tiled"] or self.offset:
            return None
        return p["axis_size"] if p["all_gather_dimension"] == axis else 1

    def varying(self, axes) -> frozenset:
        """The mesh axes (of the leaf's ``axes``) a combined value varies over: the
        gather's (each device its shard; summed over the others)."""
        return frozenset(axes) & frozenset(_gather_axes(self.eqn))

    def takes(self, r) -> bool:
        """Whether reduction ``r``'s value is combined at the site."""
        return not r.per_example and type(r).combine_axis in _SUMMED + _SPLIT

    def aval(self, value):
        """The device's part of a leaf-shaped value (a tree of ``ShapeDtypeStruct``)."""
        p = self.eqn.params
        a, n = p["all_gather_dimension"] - self.offset, p["axis_size"]

        def one(x):
            shape = list(x.shape)
            if p["tiled"]:
                shape[a] //= n
            else:
                del shape[a]
            return jax.ShapeDtypeStruct(tuple(shape), x.dtype)

        return jax.tree.map(one, value)

    def __call__(self, r, value, B):
        return combine(self.eqn, r, value, B, jax.lax.psum(B, self.axis_name), self.axis_name,
                       self.offset)


def _axes(axis_name) -> tuple:
    return tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)


def check_reductions(gathers, reductions, paths, name):
    """Refuses a statistic a gathered leaf cannot give: only elementwise ones (each
    device keeps its shard) and per-example norms (of the whole weight) are served."""
    for r in reductions:
        inner = unweighted(r)
        if isinstance(inner, (S.ElementwiseReduction, S.SqNorms, S.Norms)):
            continue
        leaves = ", ".join(paths[i] for i in sorted(gathers))
        raise NotImplementedError(
            f"{name}: {inner.describe()} of a parameter leaf gathered over the examples' "
            f"mesh axis ({leaves}, all_gather over "
            f"{', '.join(repr(a) for a in _gather_axes(next(iter(gathers.values()))))}) "
            "is not served: only elementwise statistics (mean, sum, moments, variance, "
            "sign_mean, clipped sums, each device keeping its shard) and per-example "
            "norms are. Gather the parameters outside the statistic and pass the whole "
            "ones, or shard them with jax.jit and a NamedSharding (no axis_name)."
        )
