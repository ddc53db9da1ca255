"""Analysis of the per-example jaxpr: where does each parameter leaf meet the data?

Every variable gets a *tag*:

* ``None`` -- constant: depends on neither parameters nor example data;
* ``DATA`` -- depends on the example;
* `PView` -- depends on exactly one parameter leaf and no data: a view of
  the leaf (``chain``: injective layout steps and slices), scaled by constant
  factors (``scales``: ``W / 16``, ``-W``, a multiplier passed as an argument),
  optionally followed by parameter-only ops (``pre``) such as broadcasts that
  the site absorbs;
* `Mixed` -- depends on several leaves (LoRA ``A @ B``) or on a leaf
  through a construct we do not see into; those leaves are *residual*.

The first equation where a `PView` meets ``DATA`` is a **site**. A leaf
whose uses are all sites gets fast rules; any other use makes it residual
(exact per-example gradients through a per-example copy of the leaf).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from jaxpr_surgery._src import compat

DATA = "data"


@dataclasses.dataclass(frozen=True)
class LayoutOp:
    """One step of a view chain: an injective layout step, a static slice, or a scan
    slicing.

    A slice (``W[:k]``, ``W[:, a:b:s]``, ``lax.dynamic_slice`` at constant starts)
    keeps the elements ``start + stride * i`` of every axis; the leaf's per-example
    gradient is the view's, padded with zeros (`inverse` with ``fill``).
    """

    kind: str  # "reshape" | "transpose" | "identity" | "scan" | "slice"
    in_shape: tuple
    out_shape: tuple
    perm: tuple | None = None
    start: tuple | None = None  # slice: the first index kept on every axis
    stride: tuple | None = None  # slice: the step on every axis

    def inverse(self, value, fill=0):
        """Maps a value shaped ``lead + out_shape`` back to ``lead + in_shape``.

        ``fill``: what a slice puts where the leaf has no view (a reduction's value of
        a zero gradient: 0 for sums and moments, ``B phi(0)`` for a sum of ``phi``)."""
        if self.kind == "slice":
            import jax
            import jax.numpy as jnp

            value = jnp.asarray(value)
            lead = value.ndim - len(self.out_shape)
            cfg = [(0, 0, 0)] * lead + [
                (s, n - s - ((m - 1) * st + 1), st - 1) if m else (s, n - s, 0)
                for s, st, n, m in zip(self.start, self.stride, self.in_shape, self.out_shape)
            ]
            return jax.lax.pad(value, jnp.asarray(fill, value.dtype), cfg)
        perm = None if self.perm is None else np.argsort(self.perm)
        return self._map(value, self.out_shape, self.in_shape, perm)

    def forward(self, value):
        """Maps a value shaped ``lead + in_shape`` to ``lead + out_shape`` (undoes
        `inverse`)."""
        if self.kind == "slice":
            import jax

            lead = value.ndim - len(self.in_shape)
            limit = tuple(s + (m - 1) * st + 1 if m else s for s, st, m in zip(
                self.start, self.stride, self.out_shape))
            return jax.lax.slice(
                value, (0,) * lead + tuple(self.start), tuple(value.shape[:lead]) + limit,
                (1,) * lead + tuple(self.stride),
            )
        return self._map(value, self.in_shape, self.out_shape, self.perm)

    @property
    def is_permutation(self):
        """The step moves elements without dropping any (all but a slice)."""
        return self.kind != "slice"

    def describe(self):
        """A short text of the step, for explain (``[0:8, 2:6]``, ``transpose (1, 0)``)."""
        if self.kind == "slice":
            parts = []
            for s, st, n, m in zip(self.start, self.stride, self.in_shape, self.out_shape):
                if m == n:
                    parts.append(":")
                else:
                    parts.append(f"{s}:{s + (m - 1) * st + 1}" + (f":{st}" if st != 1 else ""))
            return f"slice [{', '.join(parts)}]"
        if self.kind == "transpose":
            return f"transpose {tuple(int(i) for i in self.perm)}"
        if self.kind == "reshape":
            return f"reshape {tuple(self.in_shape)} -> {tuple(self.out_shape)}"
        return self.kind

    def _map(self, value, src, dst, perm):
        """``lead + src`` -> ``lead + dst`` by this step's kind (``perm``: the
        transpose's, in that direction)."""
        if self.kind == "scan" or self.kind == "identity":
            return value
        lead = value.shape[: value.ndim - len(src)]
        if self.kind == "reshape":
            return value.reshape(lead + tuple(dst))
        if self.kind == "transpose":
            n = len(lead)
            return value.transpose(tuple(range(n)) + tuple(n + int(i) for i in perm))
        raise AssertionError(self.kind)


@dataclasses.dataclass(frozen=True)
class Scale:
    """A constant factor of a view (``W * c``, ``W / c``, ``-W``): every site's
    gradient is linear in its output cotangent, so the view's per-example gradient is
    ``c`` times the scaled view's.

    ``kind``: "mul", "div" or "neg"; ``operand``: the factor, a Literal or a Var of one
    element that depends on neither the parameters nor the example (None for "neg").
    """

    kind: str
    operand: Any = None

    def describe(self):
        if self.kind == "neg":
            return "negated"
        if _is_literal(self.operand):
            v = np.asarray(self.operand.val).reshape(())
            return f"{'times' if self.kind == 'mul' else 'divided by'} {v.item():g}"
        return f"{'times' if self.kind == 'mul' else 'divided by'} a constant"


@dataclasses.dataclass(frozen=True)
class PView:
    leaf: int
    chain: tuple = ()
    depth: int = 0
    base: Any = None  # the Var holding the layout view (only meaningful with ``pre``)
    pre: tuple = ()  # parameter-only eqns applied after ``base`` (same scope)
    scales: tuple = ()  # `Scale` factors of the view (commute with the chain's steps)

    @property
    def is_layout(self):
        return not self.pre


@dataclasses.dataclass(frozen=True)
class Mixed:
    leaves: frozenset


@dataclasses.dataclass
class Site:
    path: tuple
    eqn: Any
    kind: str  # dense | embedding | scale-shift | conv | generic
    leaf: int
    chain: tuple
    depth: int
    base: Any  # Var with the view value passed to the site
    pre: tuple  # eqns from base to the param operand
    ext_vars: tuple  # every other input var (data and constants), ordered
    param_pos: int  # operand index of the parameter in ``eqn``
    scan_lengths: tuple  # lengths of the enclosing scans, outermost first
    view_shape: tuple  # shape of ``base`` (per scan slice)
    ext_batched: tuple = ()  # whether each ext var depends on the example
    scales: tuple = ()  # `Scale` factors between the leaf's view and ``base``

    @property
    def pads(self):
        """The view drops elements of the leaf (a slice in the chain): a reduction's
        value there is that of a zero gradient."""
        return any(not op.is_permutation for op in self.chain)

    def describe_view(self):
        """What the site sees of its leaf, for explain, where it slices or scales it
        (empty otherwise: a layout view is no news)."""
        folded = pre_scales(self) if self.pre else None
        if not (self.pads or self.scales or folded):
            return ""
        parts = [op.describe() for op in self.chain if op.kind in ("slice", "transpose")]
        if any(op.kind == "reshape" and op.in_shape != op.out_shape for op in self.chain):
            parts.append("reshaped")
        parts += [sc.describe() for sc in self.scales]
        if folded:
            parts.append(
                "scaled elementwise by a constant array along "
                + ", ".join(f"axis {a}" for a in sorted(set().union(*(a for _, _, a in folded))))
            )
        return ", ".join(parts)


@dataclasses.dataclass
class LeafInfo:
    sites: list = dataclasses.field(default_factory=list)
    reasons: list = dataclasses.field(default_factory=list)

    @property
    def residual(self):
        return bool(self.reasons)


@dataclasses.dataclass
class Analysis:
    leaves: list  # LeafInfo per parameter leaf
    sites: dict  # path -> Site (active sites only, after residual pruning)
    scopes: set  # eqn paths that contain an active site below them
    primitives: set  # every primitive seen (for the tripwire)
    # eqn path of a call / remat / scan -> outer variables its sites read (a view's
    # scale defined outside, e.g. ``jnp.einsum(..., W * c)``): the interpreter binds
    # them in the inner scope
    forwards: dict = dataclasses.field(default_factory=dict)

    def rule(self, i):
        info = self.leaves[i]
        if info.residual:
            return "residual"
        if not info.sites:
            return "unused"
        return "single" if len(info.sites) == 1 else "multi"


def _absorbable():
    from jax._src.lax import slicing

    return (
        compat.broadcast_p,
        compat.reshape_p,
        compat.convert_p,
        compat.squeeze_p,
        slicing.slice_p,
        slicing.dynamic_slice_p,
    )


_ABSORBABLE = _absorbable()


def _is_literal(v):
    return isinstance(v, compat.Literal)


def _shape(v):
    return tuple(v.aval.shape)


_CALL_PRIMS = tuple(p for p in (compat.jit_p, compat.closed_call_p, compat.call_p) if p is not None)
_IDENTITY_PRIMS = tuple(
    p
    for p in (compat.copy_p, compat.sharding_constraint_p, *compat.vma_cast_prims)
    if p is not None
)




def _layout_op(eqn):
    """The `LayoutOp` of an injective layout eqn, or None."""
    p = eqn.primitive
    ins, outs = eqn.invars, eqn.outvars
    if len(outs) != 1:
        return None
    i_shape, o_shape = _shape(ins[0]), _shape(outs[0])
    if p is compat.convert_p:
        import jax.numpy as jnp

        if jnp.issubdtype(ins[0].aval.dtype, jnp.floating) and jnp.issubdtype(
            outs[0].aval.dtype, jnp.floating
        ):
            return LayoutOp("identity", i_shape, o_shape)
        return None
    if p in _IDENTITY_PRIMS:
        return LayoutOp("identity", i_shape, o_shape)
    if p is compat.reshape_p and len(ins) == 1 and eqn.params.get("dimensions") is None:
        return LayoutOp("reshape", i_shape, o_shape)
    if p is compat.squeeze_p:
        return LayoutOp("reshape", i_shape, o_shape)
    if p is compat.broadcast_p and len(ins) == 1 and math.prod(i_shape) == math.prod(o_shape):
        return LayoutOp("reshape", i_shape, o_shape)
    if p is compat.transpose_p:
        return LayoutOp("transpose", i_shape, o_shape, tuple(eqn.params["permutation"]))
    if p is compat.slice_p:
        start = tuple(int(i) for i in eqn.params["start_indices"])
        stride = tuple(int(i) for i in (eqn.params["strides"] or (1,) * len(i_shape)))
        return _slice_op(i_shape, o_shape, start, stride)
    if p is compat.dynamic_slice_p and all(_is_literal(v) for v in ins[1:]):
        # constant starts, clamped as lax.dynamic_slice clamps them
        start = tuple(
            min(max(int(np.asarray(v.val)), 0), n - m)
            for v, n, m in zip(ins[1:], i_shape, o_shape)
        )
        return _slice_op(i_shape, o_shape, start, (1,) * len(i_shape))
    return None


def _slice_op(i_shape, o_shape, start, stride):
    if i_shape == o_shape:
        return LayoutOp("identity", i_shape, o_shape)
    return LayoutOp("slice", i_shape, o_shape, start=start, stride=stride)


def _constant_factor(v, tag):
    """``v`` (an operand of a parameter-only mul/div) is a floating constant that
    depends on neither the parameters nor the example."""
    import jax.numpy as jnp

    return tag is None and jnp.issubdtype(v.aval.dtype, jnp.floating)


def _scale_step(eqn, pos, tags):
    """The `Scale` of a parameter-only ``eqn`` that multiplies the view (operand
    ``pos``) by a one-element constant, or None."""
    p = eqn.primitive
    out = _shape(eqn.outvars[0])
    if out != _shape(eqn.invars[pos]):
        return None
    if p is compat.neg_p:
        return Scale("neg")
    if p not in (compat.mul_p, compat.div_p) or len(eqn.invars) != 2:
        return None
    if p is compat.div_p and pos != 0:
        return None  # c / W is not linear in W
    other = eqn.invars[1 - pos]
    if not _constant_factor(other, tags[1 - pos]) or math.prod(_shape(other)) != 1:
        return None
    return Scale("mul" if p is compat.mul_p else "div", other)


def pre_scales(site_or_tag):
    """``[(kind, operand, varying view axes)]`` when every parameter-only step after
    the site's ``base`` multiplies (or divides) the view elementwise by a constant
    that broadcasts against it (a per-row or per-column multiplier), else None."""
    pre = site_or_tag.pre
    if not pre:
        return []
    view = site_or_tag.base
    out = []
    for e in pre:
        if len(e.outvars) != 1 or view is None:
            return None
        shape = _shape(view)
        if _shape(e.outvars[0]) != shape:
            return None
        if e.primitive is compat.neg_p and e.invars[0] is view:
            out.append(("neg", None, ()))
        elif e.primitive in (compat.mul_p, compat.div_p) and len(e.invars) == 2:
            ps = [k for k, v in enumerate(e.invars) if v is view]
            if len(ps) != 1 or (e.primitive is compat.div_p and ps[0] != 0):
                return None
            other = e.invars[1 - ps[0]]
            osh = _shape(other)
            import jax.numpy as jnp

            if not jnp.issubdtype(other.aval.dtype, jnp.floating):
                return None
            if osh and (len(osh) != len(shape) or any(a not in (1, b) for a, b in zip(osh, shape))):
                return None
            axes = frozenset(k for k, a in enumerate(osh) if a != 1)
            out.append(("mul" if e.primitive is compat.mul_p else "div", other, axes))
        else:
            return None
        view = e.outvars[0]
    return out


def dense_fold_side(eqn, pos, scales):
    """Where a dense site folds its view's elementwise constant factors (`pre_scales`):
    "dy" when they vary along the weight's free (and dot batch) axes only, "x" along
    its contracted (and dot batch) axes only, else None. No factors: "dy"."""
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    wc, wb = (lc, lb) if pos == 0 else (rc, rb)
    varying = set().union(*(a for _, _, a in scales)) if scales else set()
    wc, wb = {int(i) for i in wc}, {int(i) for i in wb}
    rank = len(_shape(eqn.invars[pos]))
    wf = set(range(rank)) - wc - wb
    if varying <= wf | wb:
        return "dy"
    if varying <= wc | wb:
        return "x"
    return None


class _Analyzer:
    def __init__(self, n_leaves):
        self.leaves = [LeafInfo() for _ in range(n_leaves)]
        self.sites = {}
        self.primitives = set()
        self.patterns = {}  # Var -> ("bcast"|"iota"|"eq"|"onehot", info): one-hot detection
        self.scope_of = {}  # Var -> path of the jaxpr run that defines it (scale operands)

    # -- helpers ---------------------------------------------------------- #
    def residual(self, tag, reason):
        for leaf in self.leaves_of(tag):
            if reason not in self.leaves[leaf].reasons:
                self.leaves[leaf].reasons.append(reason)

    @staticmethod
    def leaves_of(tag):
        if isinstance(tag, PView):
            return {tag.leaf}
        if isinstance(tag, Mixed):
            return set(tag.leaves)
        return set()

    @staticmethod
    def parameter_only_call(eqn, tags, has_data):
        """``(tag, var)`` of a call's one parameter input when the call sees no data and
        returns one value (so it can run as a whole at the site), else None."""
        views = [(t, v) for v, t in zip(eqn.invars, tags) if isinstance(t, (PView, Mixed))]
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
        if isinstance(tag, PView) and tag.pre:
            self.residual(tag, f"transformed outside the {where} where it meets the data")
            return Mixed(frozenset({tag.leaf}))
        return tag

    def scales_visible(self, tag, path):
        """The scale operands of ``tag`` (coming out of the sub-jaxpr of the eqn at
        ``path``) are defined outside it."""
        for sc in getattr(tag, "scales", ()):
            v = sc.operand
            if v is None or _is_literal(v):
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
            if sc.operand is not None and not _is_literal(sc.operand) and sc.operand in ins
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

    # -- main walk -------------------------------------------------------- #
    def run(self, jaxpr, in_tags, path, scan_lengths):
        env = {}

        def read(v):
            return None if _is_literal(v) else env.get(v)

        for v, t in zip(jaxpr.invars, in_tags):
            env[v] = t
            self.scope_of[v] = path
        for v in jaxpr.constvars:
            env[v] = None
            self.scope_of[v] = path

        for i, eqn in enumerate(jaxpr.eqns):
            self.primitives.add(eqn.primitive)
            p = path + (i,)
            tags = [read(v) for v in eqn.invars]
            self.track_onehot(eqn)
            out_tags = self.eqn(eqn, tags, p, scan_lengths)
            for v, t in zip(eqn.outvars, out_tags):
                env[v] = t
                self.scope_of[v] = path
        return [read(v) for v in jaxpr.outvars]

    def eqn(self, eqn, tags, path, scan_lengths):
        prim = eqn.primitive
        n_out = len(eqn.outvars)
        params_tags = [t for t in tags if isinstance(t, (PView, Mixed))]
        has_data = any(t == DATA for t in tags)

        if prim in _CALL_PRIMS:
            jaxpr, _ = compat.call_parts(eqn)
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
            # one-hot vectors built inside the call, from ids passed into it
            for vi, vo in zip(jaxpr.outvars, eqn.outvars):
                pat = self.patterns.get(vi)
                if pat and pat[0] == "onehot" and pat[1][0] in jaxpr.invars:
                    outer_ids = eqn.invars[jaxpr.invars.index(pat[1][0])]
                    if not _is_literal(outer_ids):
                        self.patterns[vo] = ("onehot", (outer_ids,) + pat[1][1:])
            return [self.leave(t, "jit", path) for t in outs]
        if prim is compat.remat_p:
            inner = [self.to_boundary(t, "checkpoint") for t in tags]
            body = compat.remat_params(eqn).jaxpr
            outs = self.run(body, inner, path, scan_lengths)
            outs = [self.outer_scales(t, body, eqn) for t in outs]
            return [self.leave(t, "checkpoint", path) for t in outs]
        if prim is compat.scan_p:
            return self.scan(eqn, tags, path, scan_lengths)

        if not params_tags:
            return [DATA if has_data else None] * n_out
        if n_out == 0:  # effects only (jax.debug.print, callbacks): no gradient flows
            return []

        if compat.subjaxprs(eqn) or prim in compat.custom_prims:
            self.residual_all(params_tags, f"used inside {prim}" + _at(eqn))
            return [DATA] * n_out if has_data else [Mixed(self.union(params_tags))] * n_out

        pvars = {v for v, t in zip(eqn.invars, tags) if isinstance(t, (PView, Mixed))}
        if len(pvars) > 1 or any(isinstance(t, Mixed) for t in params_tags):
            if len(pvars) > 1:
                self.residual_all(
                    params_tags, f"combined with another parameter in {prim}" + _at(eqn)
                )
            return [DATA] * n_out if has_data else [Mixed(self.union(params_tags))] * n_out

        (pv,) = pvars
        tag = params_tags[0]
        pos = [k for k, v in enumerate(eqn.invars) if v is pv]

        if not has_data:
            # parameter-only op: extend the view or absorb into the site later
            if tag.is_layout and n_out == 1 and len(pos) == 1:
                sc = _scale_step(eqn, pos[0], tags)
                if sc is not None:  # a constant factor: commutes with the layout steps
                    scales = tag.scales + (sc,)
                    return [dataclasses.replace(tag, scales=scales, base=eqn.outvars[0])]
            if tag.is_layout and n_out == 1 and len(pos) == 1 and pos[0] == 0:
                op = _layout_op(eqn)
                if op is not None and all(_is_literal(v) or v is pv for v in eqn.invars):
                    return [dataclasses.replace(tag, chain=tag.chain + (op,), base=eqn.outvars[0])]
            if n_out != 1:
                self.residual(tag, f"parameter-only {prim} with several outputs")
                return [Mixed(frozenset({tag.leaf}))] * n_out
            base = tag.base if tag.pre else pv
            return [dataclasses.replace(tag, base=base, pre=tag.pre + (eqn,))]

        # a site: the view meets the data
        if tag.depth < len(scan_lengths):
            self.residual(tag, "closed over by lax.scan (used in every iteration)" + _at(eqn))
            return [DATA] * n_out
        kind = self.kind(eqn, tag, pos)
        extra = []
        if kind == "dense" and not tag.pre:
            x = eqn.invars[1 - pos[0]]
            pat = self.patterns.get(x)
            if pat and pat[0] == "onehot" and _onehot_dense_ok(eqn, pos[0], pat[1][1]):
                kind = "onehot-embedding"
                extra = [pat[1][0]]
        base = tag.base if tag.pre else pv
        pre_out = {e.outvars[0] for e in tag.pre}
        ext, seen = [], set()
        for e in (*tag.pre, eqn):
            for v in e.invars:
                if _is_literal(v) or v is base or v in pre_out or v in seen:
                    continue
                seen.add(v)
                ext.append(v)
        for sc in tag.scales:  # the factors' values, read by the kernel (never batched)
            v = sc.operand
            if v is not None and not _is_literal(v) and v not in seen:
                seen.add(v)
                ext.append(v)
        for v in extra:  # (last: a one-hot site's ids)
            if v not in seen:
                seen.add(v)
                ext.append(v)
        site = Site(
            path=path,
            eqn=eqn,
            kind=kind,
            leaf=tag.leaf,
            chain=tag.chain,
            depth=tag.depth,
            base=base,
            pre=tag.pre,
            ext_vars=tuple(ext),
            param_pos=pos[0],
            scan_lengths=tuple(scan_lengths),
            view_shape=_shape(base),
            ext_batched=tuple(
                any(v is u and t == DATA for u, t in zip(eqn.invars, tags)) or v in extra
                for v in ext
            ),
            scales=tag.scales,
        )
        self.sites[path] = site
        self.leaves[tag.leaf].sites.append(site)
        return [DATA] * n_out

    def track_onehot(self, eqn):
        """Recognises ``one_hot(ids) = convert(eq(broadcast(ids), iota))``."""
        import jax.numpy as jnp
        from jax._src.lax import lax as _lax

        prim, pat = eqn.primitive, self.patterns
        if len(eqn.outvars) != 1:
            return
        out = eqn.outvars[0]
        if prim is compat.broadcast_p and jnp.issubdtype(eqn.invars[0].aval.dtype, jnp.integer):
            if not _is_literal(eqn.invars[0]):
                pat[out] = ("bcast", (eqn.invars[0], tuple(eqn.params["broadcast_dimensions"])))
        elif prim is _lax.iota_p:
            pat[out] = ("iota", eqn.params["dimension"])
        elif prim is _lax.eq_p and not any(_is_literal(v) for v in eqn.invars):
            a, b = (pat.get(v) for v in eqn.invars)
            if a and b and a[0] == "iota" and b[0] == "bcast":
                a, b = b, a
            if not (a and b and a[0] == "bcast" and b[0] == "iota"):
                return
            ids, bdims = a[1]
            axis = b[1]
            shape = _shape(out)
            ids_shape = _shape(ids)
            rest = tuple(i for i in range(len(shape)) if i != axis)
            # an iota in a dtype too narrow for the axis wraps (uint8 ids, 300 classes):
            # several rows then match one id, which is no embedding
            iota_dtype = eqn.invars[0].aval.dtype
            fits = jnp.issubdtype(iota_dtype, jnp.integer) and (
                shape[axis] - 1 <= np.iinfo(iota_dtype).max
            )
            if fits and bdims == rest and tuple(shape[i] for i in rest) == ids_shape:
                pat[out] = ("eq", (ids, axis, shape[axis]))
        elif prim is compat.convert_p and jnp.issubdtype(out.aval.dtype, jnp.floating):
            src = pat.get(eqn.invars[0])
            if src and src[0] == "eq":
                pat[out] = ("onehot", src[1])

    @staticmethod
    def union(tags):
        out = set()
        for t in tags:
            out |= _Analyzer.leaves_of(t)
        return frozenset(out)

    def residual_all(self, tags, reason):
        for t in tags:
            self.residual(t, reason)

    @staticmethod
    def kind(eqn, tag, pos):
        prim = eqn.primitive
        if tag.pre:
            # a per-row / per-column constant multiplier before a dense site folds into
            # its input or cotangent (dense.py)
            folded = pre_scales(tag)
            if (
                folded is not None
                and prim is compat.dot_general_p
                and len(pos) == 1
                and dense_fold_side(eqn, pos[0], folded) is not None
            ):
                return "dense"
            absorbable = all(e.primitive in _ABSORBABLE for e in tag.pre)
            if prim in (compat.mul_p, compat.add_p, compat.sub_p) and absorbable:
                return "scale-shift"
            return "generic"
        if prim is compat.dot_general_p and len(pos) == 1:
            return "dense"
        if prim is compat.gather_p and pos == [0] and _is_row_gather(eqn):
            return "embedding"
        if prim is compat.conv_p and pos == [1]:
            return "conv"
        if prim in (compat.mul_p, compat.add_p, compat.sub_p):
            return "scale-shift"
        return "generic"

    def scan(self, eqn, tags, path, scan_lengths):
        prm = compat.scan_params(eqn)
        nc, ncar = prm.num_consts, prm.num_carry
        body = prm.jaxpr
        consts, carry, xs = tags[:nc], tags[nc : nc + ncar], tags[nc + ncar :]
        consts = [self.to_boundary(t, "scan") for t in consts]
        for t in carry:
            if isinstance(t, (PView, Mixed)):
                self.residual(t, "carried through lax.scan")
        xs_in = []
        for v, t in zip(eqn.invars[nc + ncar :], xs):
            t = self.to_boundary(t, "scan")
            if isinstance(t, PView):
                op = LayoutOp("scan", _shape(v), _shape(v)[1:])
                t = dataclasses.replace(t, chain=t.chain + (op,), depth=t.depth + 1, base=None)
            xs_in.append(t)
        inner_lengths = tuple(scan_lengths) + (prm.length,)
        # Carries are evaluated batched (per example), so they are DATA: a site
        # fed by a carry computes exact per-example quantities either way.
        carry = [DATA] * ncar
        outs = self.run(body, consts + carry + xs_in, path, inner_lengths)
        for t in outs:
            if isinstance(t, (PView, Mixed)):
                self.residual(t, "returned from lax.scan")
        outs = [DATA if isinstance(t, (PView, Mixed)) else t for t in outs]
        return outs


def _at(eqn):
    src = compat.source_line(eqn)
    return f" at {src}" if src else ""


def _onehot_dense_ok(eqn, p, axis):
    """The one-hot axis is the only contracted dim, against a 2-D [V, d] weight (no dot batch)."""
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    xc, wc = (rc, lc) if p == 0 else (lc, rc)
    w_shape = _shape(eqn.invars[p])
    return not lb and tuple(xc) == (axis,) and len(w_shape) == 2 and len(wc) == 1


def row_gather_layout(eqn):
    """``(n_index_components, row_component, row_axis)`` if ``eqn`` gathers whole rows
    of a table by integer ids, else None.

    Two forms are recognised:

    * ``table[ids]``, ``jnp.take`` and ``jnp.take_along_axis`` along the rows: one
      collapsed ``row_axis`` indexed by the only index component, every other axis
      taken whole, and only axes of size 1 before the row axis (``take_along_axis(
      table[None], ids[..., None], axis=1)`` gathers from a ``[1, V, d]`` view), so
      that the table is a ``[V, d]`` reshape of the operand; the gathered rows follow
      the ids' axes in memory (offset axes of size 1 may sit anywhere);
    * a batched ``dynamic_slice`` of a row of a 2-D table, which is what ``jax.vmap``
      makes of ``table[i]`` with a scalar ``i`` (``eqx.nn.Embedding``): no collapsed
      dim, an index pair (row, column) in clip mode, where the column start of a
      full-width slice is always clamped to 0.
    """
    from jax.lax import GatherScatterMode

    dn = eqn.params["dimension_numbers"]
    operand, idx = eqn.invars
    shape = _shape(operand)
    if len(shape) < 2 or not np.issubdtype(idx.aval.dtype, np.integer):
        return None
    if getattr(dn, "operand_batching_dims", ()) or getattr(dn, "start_indices_batching_dims", ()):
        return None
    sizes = tuple(int(n) for n in eqn.params["slice_sizes"])
    out_shape = _shape(eqn.outvars[0])
    out_rank = len(out_shape)
    smap, collapsed, offs = (tuple(dn.start_index_map), tuple(dn.collapsed_slice_dims),
                             tuple(dn.offset_dims))
    ncomp = _shape(idx)[-1] if _shape(idx) else 0
    if len(collapsed) == 1 and smap == collapsed and ncomp == 1:
        r = int(collapsed[0])
        whole = sizes == shape[:r] + (1,) + shape[r + 1 :]
        if whole and all(n == 1 for n in shape[:r]):
            ids_axes = [i for i in range(out_rank) if i not in offs and out_shape[i] != 1]
            row_axes = [i for i in offs if out_shape[i] != 1]
            if not ids_axes or not row_axes or max(ids_axes) < min(row_axes):
                return 1, 0, r
        return None
    if len(shape) != 2 or sizes != (1, shape[1]):
        return None
    if collapsed == () and offs == (out_rank - 2, out_rank - 1) and 0 in smap:
        mode = eqn.params.get("mode")
        if smap == (0,) and ncomp == 1:
            return 1, 0, 0
        if sorted(smap) == [0, 1] and ncomp == 2 and mode == GatherScatterMode.CLIP:
            return 2, smap.index(0), 0
    return None


def _is_row_gather(eqn):
    """``table[ids]``: rows of a 2-D table gathered by integer ids."""
    return row_gather_layout(eqn) is not None


def analyse_jaxpr(jaxpr, in_tags, n_leaves):
    a = _Analyzer(n_leaves)
    outs = a.run(jaxpr, in_tags, (), ())
    if outs and isinstance(outs[0], (PView, Mixed)):
        a.residual(outs[0], "the loss depends on it without passing through example data")
    # prune sites of residual leaves
    sites = {p: s for p, s in a.sites.items() if not a.leaves[s.leaf].residual}
    for li in a.leaves:
        if li.residual:
            li.sites = [s for s in li.sites if s.path in sites]
        else:
            li.sites = sorted(li.sites, key=lambda s: s.path)
    scopes = set()
    for p in sites:
        for k in range(1, len(p)):
            scopes.add(p[:k])
    # a scale defined in an outer scope reaches the site through every eqn between
    forwards = {}
    for p, s in sites.items():
        for sc in s.scales:
            v = sc.operand
            if v is None or _is_literal(v):
                continue
            for k in range(len(a.scope_of[v]) + 1, len(p)):
                fw = forwards.setdefault(p[:k], [])
                if v not in fw:
                    fw.append(v)
    return Analysis(
        a.leaves, sites, scopes, a.primitives, {k: tuple(v) for k, v in forwards.items()}
    )
