"""Analysis of the per-example jaxpr: where does each parameter leaf meet the data?

Every variable gets a *tag*:

* ``None`` -- constant: depends on neither parameters nor example data;
* ``DATA`` -- depends on the example;
* `PView` -- depends on exactly one parameter leaf and no data: a view of
  the leaf (``chain``: injective layout steps and slices), scaled by constant
  factors (``scales``: ``W / 16``, ``-W``, a multiplier passed as an argument),
  optionally followed by parameter-only ops (``pre``) such as broadcasts that
  the site absorbs;
* `Merged` -- a merged low-rank weight ``W + c * (A @ B)`` (a merged LoRA
  layer): the product of two views, constant factors, at most one base weight
  (a constant or a third leaf's view) and layout steps. Where it meets the data
  in a ``dot_general``, that equation is a site of each of its leaves;
* `Mixed` -- depends on several leaves in any other way, or on a leaf through a
  construct we do not see into; those leaves are *residual*.

The first equation where a `PView` meets ``DATA`` is a **site**; the site
registry (`sites.base.kind_for`, keyed by primitive objects) names the kernel
that serves it. A leaf whose uses are all sites gets fast rules; any other use
makes it residual (exact per-example gradients through a per-example copy of
the leaf). An equation that is the site of several leaves (a `Merged` weight's)
is evaluated by the first one's kernel; the others are *taps* of it
(`Site.tap_of`): they read the same cotangent.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import numpy as np

from jaxpr_surgery._src import compat, custom_ops, walker
from jaxpr_surgery._src.analysis_types import (
    DATA,
    PARAM_TAGS,
    Analysis,
    LayoutOp,
    LeafInfo,
    Merged,
    Mixed,
    PView,
    Scale,
    Site,
    is_literal,
    layout_op,
    scale_step,
    shape_of,
)
from jaxpr_surgery._src.sites import kind_for
from jaxpr_surgery._src.sites.base import MergedUse, OneHot
from jaxpr_surgery._src.views import Factor, Step


class _Analyzer(walker.Walker):
    def __init__(self, n_leaves, data_axes=frozenset()):
        self.leaves = [LeafInfo() for _ in range(n_leaves)]
        self.data_axes = frozenset(data_axes)
        # (leaves, eqn, axes) of each collective over the examples' mesh axes that a
        # parameter goes through (`Analysis.crossing`)
        self.crossing = []
        self.model_crossing = []
        self.sites = {}
        self.primitives = set()
        self.patterns = {}  # Var -> OneHot | MergedUse (`sites.base.Patterns`)
        self.onehot_parts = {}  # Var -> _Bcast | _Iota | OneHot (compared, not converted)
        self.scope_of = {}  # Var -> path of the jaxpr run that defines it (scale operands)
        self.groups = []  # [(site, is_factor), ...] of each site of a `Merged` weight

    # -- helpers ---------------------------------------------------------- #
    def residual(self, tag, reason):
        for leaf in self.leaves_of(tag):
            if reason not in self.leaves[leaf].reasons:
                self.leaves[leaf].reasons.append(reason)

    @staticmethod
    def leaves_of(tag):
        if isinstance(tag, PView):
            return {tag.leaf}
        if isinstance(tag, (Mixed, Merged)):
            return set(tag.leaves)
        return set()

    @staticmethod
    def parameter_only_call(eqn, tags, has_data):
        """``(tag, var)`` of a call's one parameter input when the call sees no data and
        returns one value (so it can run as a whole at the site), else None."""
        views = [(t, v) for v, t in zip(eqn.invars, tags) if isinstance(t, PARAM_TAGS)]
        if has_data or len(eqn.outvars) != 1 or len(views) != 1:
            return None
        return views[0] if isinstance(views[0][0], PView) else None

    @staticmethod
    def extend_pre(tag, pv, eqn):
        """``tag`` (held by ``pv``) followed by the parameter-only ``eqn``, which its site
        applies again."""
        base = tag.base if tag.pre else pv
        return dataclasses.replace(tag, base=base, pre=tag.pre + (eqn,))

    def to_boundary(self, tag, where):
        """A tag crossing into or out of a sub-jaxpr."""
        if isinstance(tag, Merged):
            self.residual(tag, f"a merged weight (W + A @ B) crossing a {where} boundary")
            return Mixed(frozenset(tag.leaves))
        if isinstance(tag, PView) and tag.pre:
            self.residual(tag, f"transformed outside the {where} where it meets the data")
            return Mixed(frozenset({tag.leaf}))
        return tag

    def scales_visible(self, tag, path):
        """The scale operands of ``tag`` (coming out of the sub-jaxpr of the eqn at
        ``path``) are defined outside it."""
        for sc in getattr(tag, "scales", ()):
            v = sc.operand
            if v is None or is_literal(v):
                continue
            if len(self.scope_of.get(v, path)) >= len(path):
                return False
        return True

    @staticmethod
    def outer_scales(tag, jaxpr, eqn):
        """``tag`` coming out of ``eqn``'s sub-jaxpr with scale operands that are inputs
        of the sub-jaxpr named by the values passed in (a helper ``f(w, c)`` that
        returns ``w * c``)."""
        if not isinstance(tag, PView) or not tag.scales:
            return tag
        ins = {v: k for k, v in enumerate(jaxpr.invars)}
        scales = tuple(
            dataclasses.replace(sc, operand=eqn.invars[ins[sc.operand]])
            if sc.operand is not None and not is_literal(sc.operand) and sc.operand in ins
            else sc
            for sc in tag.scales
        )
        return dataclasses.replace(tag, scales=scales)

    def leave(self, tag, where, path):
        """A tag coming out of the sub-jaxpr of the eqn at ``path``."""
        if isinstance(tag, PView) and not self.scales_visible(tag, path):
            self.residual(tag, f"scaled inside the {where} by a value defined there")
            return Mixed(frozenset({tag.leaf}))
        return self.to_boundary(tag, where)

    # -- main walk (`walker.Walker`: jit / remat / scan entered by the hooks in ENTER) -- #
    def run(self, jaxpr, in_tags, path=(), scan_lengths=(), consts=None):
        """The tags of ``jaxpr``'s outputs; ``scan_lengths``: the lengths of the scans
        enclosing it."""
        for v in (*jaxpr.invars, *jaxpr.constvars):
            self.scope_of[v] = path
        return super().run(jaxpr, in_tags, path, scan_lengths, consts=consts)

    def step(self, eqn, tags, path, scan_lengths):
        self.primitives.add(eqn.primitive)
        self.track_onehot(eqn)
        for v in eqn.outvars:
            self.scope_of[v] = path[:-1]
        params_tags = [t for t in tags if isinstance(t, PARAM_TAGS)]
        if params_tags and self.data_axes:
            self.collective_on_parameter(eqn, params_tags)
        return super().step(eqn, tags, path, scan_lengths)

    def remat(self, eqn, view, tags, path, scan_lengths):
        inner = [self.to_boundary(t, "checkpoint") for t in tags]
        outs = self.run(view.jaxpr, inner, path, scan_lengths)
        outs = [self.outer_scales(t, view.jaxpr, eqn) for t in outs]
        return [self.leave(t, "checkpoint", path) for t in outs]

    def equation(self, eqn, tags, path, scan_lengths):
        """The tags of ``eqn``'s outputs from its inputs' ``tags``; records sites and
        residual leaves on the way."""
        prim = eqn.primitive
        n_out = len(eqn.outvars)
        params_tags = [t for t in tags if isinstance(t, PARAM_TAGS)]
        has_data = any(t == DATA for t in tags)

        if not params_tags:
            return [DATA if has_data else None] * n_out
        if n_out == 0:  # effects only (jax.debug.print, callbacks): no gradient flows
            return []

        pvars = {v for v, t in zip(eqn.invars, tags) if isinstance(t, PARAM_TAGS)}
        # a custom_vjp / custom_jvp op whose one parameter operand meets the data is a
        # site of the generic kernel (the exact per-example VJP of the op, its view shared
        # by the examples: vmap(grad)'s cost), where every other construct with a body
        # is opaque (the leaf is read per example)
        custom = walker.nest_of(eqn) is walker.Nest.CUSTOM
        # (so is an equation of a primitive given a rule, `custom_ops.primitive_entry`,
        # even one holding a jaxpr such as a Pallas call)
        ruled = not custom and custom_ops.primitive_entry(eqn) is not None
        custom_site = (
            (custom or ruled) and has_data and len(pvars) == 1
            and not isinstance(params_tags[0], (Mixed, Merged))
        )
        opaque = not custom_site and (custom or bool(walker.bodies(eqn)))
        if not opaque:
            out = self.merged(eqn, tags, path, scan_lengths, has_data)
            if out is not None:
                return out
        if opaque or len(pvars) > 1 or any(isinstance(t, (Mixed, Merged)) for t in params_tags):
            if opaque:
                self.residual_all(params_tags, f"used inside {prim}" + _at(eqn))
            elif len(pvars) > 1:
                self.residual_all(
                    params_tags, f"combined with another parameter in {prim}" + _at(eqn)
                )
            elif isinstance(params_tags[0], Merged):
                self.residual(
                    params_tags[0],
                    f"a merged weight (W + A @ B) used in {prim}" + _at(eqn)
                    + " (served: scaling by constants, adding one weight, transposing, "
                    "then a dot_general with the data)",
                )
            return [DATA] * n_out if has_data else [Mixed(self.union(params_tags))] * n_out

        (pv,) = pvars
        tag = params_tags[0]
        pos = [k for k, v in enumerate(eqn.invars) if v is pv]
        if not has_data:
            return self.parameter_only(eqn, tags, tag, pv, pos)
        if tag.depth < len(scan_lengths):
            self.residual(tag, "closed over by lax.scan (used in every iteration)" + _at(eqn))
            return [DATA] * n_out
        self.site(eqn, tags, tag, pv, pos, path, scan_lengths)
        return [DATA] * n_out

    def collective_on_parameter(self, eqn, params_tags):
        """Records ``eqn`` (or a collective inside it, where the walk does not enter it:
        a ``custom_vjp``, a loop) when it communicates over the examples' mesh axes and
        a parameter goes through it (`Analysis.crossing`)."""
        named = compat.collective_axes(eqn)
        axes = named & self.data_axes
        inner = eqn
        if not axes and not self.enters(eqn):
            inner, axes = _collective_within(eqn, self.data_axes)
        if axes:
            self.crossing.append((self.union(params_tags), inner, axes))
        elif named:  # over other mesh axes only (a model axis): `Analysis.model_crossing`
            self.model_crossing.append((self.union(params_tags), eqn, named))

    def call(self, eqn, view, tags, path, scan_lengths):
        """A jit / closed_call / call: its body is walked in place."""
        jaxpr = view.jaxpr
        has_data = any(t == DATA for t in tags)
        opaque = self.parameter_only_call(eqn, tags, has_data)
        if opaque is not None and opaque[0].pre:  # already transformed: one more step
            return [self.extend_pre(*opaque, eqn)]
        inner = [self.to_boundary(t, "jit") for t in tags]
        outs = self.run(jaxpr, inner, path, scan_lengths)
        outs = [self.outer_scales(t, jaxpr, eqn) for t in outs]
        if (
            opaque is not None
            and isinstance(outs[0], PView)
            and (outs[0].pre or not self.scales_visible(outs[0], path))
        ):
            # transformed inside (a gather by constant positions, ``jnp.take``, a
            # scale by a value computed there): the whole call is one
            # parameter-only step, applied again at the site
            return [self.extend_pre(*opaque, eqn)]
        self.onehots_out_of(jaxpr, eqn)
        return [self.leave(t, "jit", path) for t in outs]

    def onehots_out_of(self, jaxpr, eqn):
        """One-hot vectors built inside the call ``eqn`` (body ``jaxpr``) from ids passed
        into it are one-hot vectors of the ids outside."""
        for vi, vo in zip(jaxpr.outvars, eqn.outvars):
            pat = self.patterns.get(vi)
            if isinstance(pat, OneHot) and pat.ids in jaxpr.invars:
                outer_ids = eqn.invars[jaxpr.invars.index(pat.ids)]
                if not is_literal(outer_ids):
                    self.patterns[vo] = pat._replace(ids=outer_ids)

    def parameter_only(self, eqn, tags, tag, pv, pos):
        """An op on the view ``tag`` (held by ``pv``, operands ``pos``) and constants:
        a constant factor or a layout step extends the view; anything else is a
        parameter-only step the site applies again (``pre``)."""
        n_out = len(eqn.outvars)
        if tag.is_layout and n_out == 1 and len(pos) == 1:
            sc = scale_step(eqn, pos[0], tags)
            if sc is not None:  # a constant factor: commutes with the layout steps
                scales = tag.scales + (sc,)
                return [dataclasses.replace(tag, scales=scales, base=eqn.outvars[0])]
        if tag.is_layout and n_out == 1 and len(pos) == 1 and pos[0] == 0:
            op = layout_op(eqn)
            if op is not None and all(is_literal(v) or v is pv for v in eqn.invars):
                return [dataclasses.replace(tag, chain=tag.chain + (op,), base=eqn.outvars[0])]
        if n_out != 1:
            self.residual(tag, f"parameter-only {eqn.primitive} with several outputs")
            return [Mixed(frozenset({tag.leaf}))] * n_out
        return [self.extend_pre(tag, pv, eqn)]

    def site(self, eqn, tags, tag, pv, pos, path, scan_lengths):
        """Records the site ``eqn`` where the view ``tag`` (held by ``pv``, operands
        ``pos``) meets the data; the registry (`sites.base.kind_for`) picks its kernel."""
        kernel = kind_for(eqn, tag, pos, self.patterns)
        extra = tuple(kernel.extra_inputs(eqn, tag, pos, self.patterns))
        base = tag.base if tag.pre else pv
        ext = _site_inputs(tag, eqn, base, extra)
        batched = [v for v, t in zip(eqn.invars, tags) if t == DATA]
        site = Site(
            path=path,
            eqn=eqn,
            kernel=kernel,
            leaf=tag.leaf,
            chain=tag.chain,
            depth=tag.depth,
            base=base,
            pre=tag.pre,
            ext_vars=ext,
            param_pos=pos[0],
            scan_lengths=tuple(scan_lengths),
            view_shape=shape_of(base),
            ext_batched=tuple(
                any(v is u for u in batched) or any(v is u for u in extra) for v in ext
            ),
            scales=tag.scales,
        )
        self.sites.setdefault(path, []).append(site)
        self.leaves[tag.leaf].sites.append(site)
        return site

    # -- merged low-rank weights (`Merged`) --------------------------------- #
    def merged(self, eqn, tags, path, scan_lengths, has_data):
        """The tags of ``eqn``'s outputs where it starts, extends or meets the data with
        a `Merged` weight as served (the product of two views; then constant factors,
        adding one base weight, layout steps; then a ``dot_general`` with the data),
        else None: any other use makes the weight's leaves residual (the caller)."""
        pos = [k for k, t in enumerate(tags) if isinstance(t, PARAM_TAGS)]
        ms = [k for k in pos if isinstance(tags[k], Merged)]
        if not ms:
            return self.product(eqn, tags, has_data, pos)
        if len(ms) != 1 or len(eqn.outvars) != 1:
            return None
        (k,) = ms
        m = tags[k]
        if has_data:
            if eqn.primitive is not compat.dot_general_p or pos != [k]:
                return None
            self.merged_sites(eqn, tags, m, k, path, scan_lengths)
            return [DATA]
        if pos == [k]:
            sc = scale_step(eqn, k, tags)
            if sc is not None:  # scales the product (and the base weight once added)
                frozen = m.frozen
                if frozen is not None and m.added:
                    t, v, at = frozen
                    frozen = (dataclasses.replace(t, scales=t.scales + (sc,)), v, at)
                return [dataclasses.replace(
                    m, steps=m.steps + (eqn,), scales=m.scales + (sc,), frozen=frozen)]
            op = layout_op(eqn)
            if (op is not None and op.kind in (Step.IDENTITY, Step.TRANSPOSE) and k == 0
                    and all(is_literal(v) for v in eqn.invars[1:])):
                return [dataclasses.replace(m, steps=m.steps + (eqn,))]
        return self.base_weight(eqn, tags, m, k)

    @staticmethod
    def base_weight(eqn, tags, m, k):
        """``[m]`` plus (or minus) a base weight of its shape, a constant or a layout view
        of another leaf (a `Merged` takes one); else None."""
        if eqn.primitive not in (compat.add_p, compat.sub_p) or m.added or len(eqn.invars) != 2:
            return None
        shape = shape_of(eqn.outvars[0])
        if any(shape_of(v) != shape for v in eqn.invars):
            return None
        j = 1 - k
        other = tags[j]
        neg = (Scale(Factor.NEG),) if eqn.primitive is compat.sub_p else ()
        steps = m.steps + (eqn,)
        scales = m.scales + (neg if k == 1 else ())
        if other is None:
            return [dataclasses.replace(m, steps=steps, scales=scales, added=True)]
        if isinstance(other, PView) and other.is_layout and other.leaf not in m.leaves:
            w = dataclasses.replace(other, scales=other.scales + (neg if j == 1 else ()))
            frozen = (w, eqn.invars[j], len(m.steps))
            return [dataclasses.replace(m, steps=steps, scales=scales, frozen=frozen, added=True)]
        return None

    @staticmethod
    def product(eqn, tags, has_data, pos):
        """``[Merged]`` where ``eqn`` multiplies two layout views of distinct leaves
        (2-D, one contracted axis, no batch axes, floating), else None."""
        import jax.numpy as jnp

        if has_data or eqn.primitive is not compat.dot_general_p or pos != [0, 1]:
            return None
        a, b = tags[0], tags[1]
        if not (isinstance(a, PView) and isinstance(b, PView) and a.is_layout and b.is_layout):
            return None
        (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
        if a.leaf == b.leaf or lb or rb or len(lc) != 1 or len(rc) != 1:
            return None
        if any(len(shape_of(v)) != 2 or not jnp.issubdtype(v.aval.dtype, jnp.floating)
               for v in (*eqn.invars, *eqn.outvars)):
            return None
        return [Merged(((a, eqn.invars[0]), (b, eqn.invars[1])), (eqn,))]

    def merged_sites(self, eqn, tags, m, k, path, scan_lengths):
        """Records the site ``eqn`` (the data times the merged weight ``m``, operand
        ``k``) of each leaf of ``m``: its factors, and its base weight if a leaf. Each
        site applies the steps from its view on again (`Site.pre`); the factors' sites
        take the product's constant factors as their view's."""
        members = [(t, v, m.steps, m.scales, True) for t, v in m.factors]
        if m.frozen is not None:
            t, v, at = m.frozen
            members.append((t, v, m.steps[at:], (), False))
        if any(t.depth < len(scan_lengths) for t, *_ in members):
            self.residual(m, "closed over by lax.scan (used in every iteration)" + _at(eqn))
            return
        self.patterns[eqn.invars[k]] = MergedUse(m)  # for the kernels' `matches`
        group = []
        for t, v, pre, scales, factor in members:
            tag = dataclasses.replace(t, base=v, pre=pre, scales=t.scales + scales)
            group.append((self.site(eqn, tags, tag, v, [k], path, scan_lengths), factor))
        self.groups.append(group)

    def track_onehot(self, eqn):
        """Recognises ``one_hot(ids) = convert(eq(broadcast(ids), iota))``."""
        import jax.numpy as jnp

        prim, part = eqn.primitive, self.onehot_parts
        if len(eqn.outvars) != 1:
            return
        out = eqn.outvars[0]
        if prim is compat.broadcast_p and jnp.issubdtype(eqn.invars[0].aval.dtype, jnp.integer):
            if not is_literal(eqn.invars[0]):
                part[out] = _Bcast(eqn.invars[0], tuple(eqn.params["broadcast_dimensions"]))
        elif prim is compat.iota_p:
            part[out] = _Iota(eqn.params["dimension"])
        elif prim is compat.eq_p and not any(is_literal(v) for v in eqn.invars):
            a, b = (part.get(v) for v in eqn.invars)
            if isinstance(a, _Iota) and isinstance(b, _Bcast):
                a, b = b, a
            if not (isinstance(a, _Bcast) and isinstance(b, _Iota)):
                return
            ids, bdims = a
            axis = b.dimension
            shape = shape_of(out)
            ids_shape = shape_of(ids)
            rest = tuple(i for i in range(len(shape)) if i != axis)
            # an iota in a dtype too narrow for the axis wraps (uint8 ids, 300 classes):
            # several rows then match one id, which is no embedding
            iota_dtype = eqn.invars[0].aval.dtype
            fits = jnp.issubdtype(iota_dtype, jnp.integer) and (
                shape[axis] - 1 <= np.iinfo(iota_dtype).max
            )
            if fits and bdims == rest and tuple(shape[i] for i in rest) == ids_shape:
                part[out] = OneHot(ids, axis, shape[axis])  # (boolean: one once converted)
        elif prim is compat.convert_p and jnp.issubdtype(out.aval.dtype, jnp.floating):
            src = part.get(eqn.invars[0])
            if isinstance(src, OneHot):
                self.patterns[out] = src

    @staticmethod
    def union(tags):
        out = set()
        for t in tags:
            out |= _Analyzer.leaves_of(t)
        return frozenset(out)

    def residual_all(self, tags, reason):
        for t in tags:
            self.residual(t, reason)

    def scan(self, eqn, prm, tags, path, scan_lengths):
        nc, ncar = prm.num_consts, prm.num_carry
        body = prm.jaxpr
        consts, carry, xs = tags[:nc], tags[nc : nc + ncar], tags[nc + ncar :]
        consts = [self.to_boundary(t, "scan") for t in consts]
        for t in carry:
            if isinstance(t, PARAM_TAGS):
                self.residual(t, "carried through lax.scan")
        xs_in = []
        for v, t in zip(eqn.invars[nc + ncar :], xs):
            t = self.to_boundary(t, "scan")
            if isinstance(t, PView):
                op = LayoutOp(Step.SCAN, shape_of(v), shape_of(v)[1:])
                t = dataclasses.replace(t, chain=t.chain + (op,), depth=t.depth + 1, base=None)
            xs_in.append(t)
        inner_lengths = tuple(scan_lengths) + (prm.length,)
        # Carries are evaluated batched (per example), so they are DATA: a site
        # fed by a carry computes exact per-example quantities either way.
        carry = [DATA] * ncar
        outs = self.run(body, consts + carry + xs_in, path, inner_lengths)
        for t in outs:
            if isinstance(t, PARAM_TAGS):
                self.residual(t, "returned from lax.scan")
        outs = [DATA if isinstance(t, PARAM_TAGS) else t for t in outs]
        return outs

    ENTER = {walker.Nest.CALL: call, walker.Nest.REMAT: remat, walker.Nest.SCAN: scan}


def _site_inputs(tag, eqn, base, extra):
    """Every input of a site but its view ``base``, once each, in order: the operands of
    its ``pre`` steps and of ``eqn``, the view's scale factors, then ``extra`` (a kernel's
    `extra_inputs`, such as a one-hot site's ids)."""
    pre_out = {e.outvars[0] for e in tag.pre}
    ext, seen = [], set()

    def add(v):
        if v not in seen:
            seen.add(v)
            ext.append(v)

    for e in (*tag.pre, eqn):
        for v in e.invars:
            if not (is_literal(v) or v is base or v in pre_out):
                add(v)
    for sc in tag.scales:  # the factors' values, read by the kernel (never batched)
        if sc.operand is not None and not is_literal(sc.operand):
            add(sc.operand)
    for v in extra:  # (last)
        add(v)
    return tuple(ext)


class _Bcast(NamedTuple):
    """Integer ``ids`` broadcast along ``dims`` (a one-hot's first part)."""

    ids: Any
    dims: tuple


class _Iota(NamedTuple):
    """A range along ``dimension`` (a one-hot's second part)."""

    dimension: int


def _collective_within(eqn, data_axes):
    """``(eqn, axes)`` of the first collective over ``data_axes`` in the jaxprs ``eqn``
    holds, at any depth, else ``(None, frozenset())``."""
    for sub in walker.bodies(eqn):
        for e in walker.equations(sub):
            axes = compat.collective_axes(e) & data_axes
            if axes:
                return e, axes
    return None, frozenset()


def _at(eqn):
    src = compat.source_line(eqn)
    return f" at {src}" if src else ""


def analyse_jaxpr(jaxpr, in_tags, n_leaves, data_axes=frozenset()):
    """The `Analysis` of the per-example ``jaxpr``; ``data_axes``: the mesh axes the
    examples are split over (``axis_name`` and the axes the batch varies over inside
    ``shard_map``), whose collectives on parameters `Analysis.crossing` lists."""
    a = _Analyzer(n_leaves, data_axes)
    outs = a.run(jaxpr, in_tags, (), ())
    if outs and isinstance(outs[0], PARAM_TAGS):
        a.residual(outs[0], "the loss depends on it without passing through example data")
    _merged_residuals(a)
    # prune sites of residual leaves; at an equation that is the site of several
    # leaves, the first one left evaluates it and the others are its taps
    sites, taps = {}, {}
    for p, group in a.sites.items():
        active = [s for s in group if not a.leaves[s.leaf].residual]
        for j, s in enumerate(active):
            if j:
                s.tap_of, s.path = p, p + ("tap", j)
                taps.setdefault(p, []).append(s.path)
            sites[s.path] = s
    kept = {id(s) for s in sites.values()}
    for li in a.leaves:
        if li.residual:
            li.sites = [s for s in li.sites if id(s) in kept]
        else:
            li.sites = sorted(li.sites, key=lambda s: s.path)
    scopes = set()
    for s in sites.values():
        for k in range(1, len(s.at)):
            scopes.add(s.at[:k])
    # a scale defined in an outer scope reaches the site through every eqn between
    forwards = {}
    for s in sites.values():
        for sc in s.scales:
            v = sc.operand
            if v is None or is_literal(v):
                continue
            for k in range(len(a.scope_of[v]) + 1, len(s.at)):
                fw = forwards.setdefault(s.at[:k], [])
                if v not in fw:
                    fw.append(v)
    return Analysis(
        a.leaves, sites, scopes, a.primitives, {k: tuple(v) for k, v in forwards.items()},
        {p: tuple(q) for p, q in taps.items()}, a.crossing, a.model_crossing,
    )


def _merged_residuals(a):
    """The sites of a merged weight read each other's leaves as values shared by the
    examples. Where a factor is residual (its value is a per-example copy), so are the
    other factor and the base weight; a residual base weight is read per example."""
    reason = "merged (W + A @ B) with a factor that takes exact per-example gradients"
    changed = True
    while changed:
        changed = False
        for group in a.groups:
            if not any(a.leaves[s.leaf].residual for s, factor in group if factor):
                continue
            for s, _ in group:
                if not a.leaves[s.leaf].residual:
                    a.leaves[s.leaf].reasons.append(reason)
                    changed = True
    for group in a.groups:
        copies = [s.base for s, factor in group if not factor and a.leaves[s.leaf].residual]
        for s, _ in group:
            s.ext_batched = tuple(
                b or any(v is c for c in copies) for v, b in zip(s.ext_vars, s.ext_batched)
            )
