"""Analysis of the per-example jaxpr: where does each parameter leaf meet the data?

Every variable gets a *tag*:

* ``None`` -- constant: depends on neither parameters nor example data;
* ``DATA`` -- depends on the example;
* `PView` -- depends on exactly one parameter leaf and no data: an
  injective layout view of the leaf (``chain``), optionally followed by
  parameter-only ops (``pre``) such as broadcasts that the site absorbs;
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
    """One injective layout step of a view chain (or a scan slicing)."""

    kind: str  # "reshape" | "transpose" | "identity" | "scan"
    in_shape: tuple
    out_shape: tuple
    perm: tuple | None = None

    def inverse(self, value):
        """Maps a value shaped ``lead + out_shape`` back to ``lead + in_shape``."""
        perm = None if self.perm is None else np.argsort(self.perm)
        return self._map(value, self.out_shape, self.in_shape, perm)

    def forward(self, value):
        """Maps a value shaped ``lead + in_shape`` to ``lead + out_shape`` (undoes
        `inverse`)."""
        return self._map(value, self.in_shape, self.out_shape, self.perm)

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
class PView:
    leaf: int
    chain: tuple = ()
    depth: int = 0
    base: Any = None  # the Var holding the layout view (only meaningful with ``pre``)
    pre: tuple = ()  # parameter-only eqns applied after ``base`` (same scope)

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
    return None


class _Analyzer:
    def __init__(self, n_leaves):
        self.leaves = [LeafInfo() for _ in range(n_leaves)]
        self.sites = {}
        self.primitives = set()
        self.patterns = {}  # Var -> ("bcast"|"iota"|"eq"|"onehot", info): one-hot detection

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

    # -- main walk -------------------------------------------------------- #
    def run(self, jaxpr, in_tags, path, scan_lengths):
        env = {}

        def read(v):
            return None if _is_literal(v) else env.get(v)

        for v, t in zip(jaxpr.invars, in_tags):
            env[v] = t
        for v in jaxpr.constvars:
            env[v] = None

        for i, eqn in enumerate(jaxpr.eqns):
            self.primitives.add(eqn.primitive)
            p = path + (i,)
            tags = [read(v) for v in eqn.invars]
            self.track_onehot(eqn)
            out_tags = self.eqn(eqn, tags, p, scan_lengths)
            for v, t in zip(eqn.outvars, out_tags):
                env[v] = t
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
            if opaque is not None and isinstance(outs[0], PView) and outs[0].pre:
                # transformed inside (a gather by constant positions, ``jnp.take``): the
                # whole call is one parameter-only step, applied again at the site
                return [self.extend_pre(*opaque, eqn)]
            # one-hot vectors built inside the call, from ids passed into it
            for vi, vo in zip(jaxpr.outvars, eqn.outvars):
                pat = self.patterns.get(vi)
                if pat and pat[0] == "onehot" and pat[1][0] in jaxpr.invars:
                    outer_ids = eqn.invars[jaxpr.invars.index(pat[1][0])]
                    if not _is_literal(outer_ids):
                        self.patterns[vo] = ("onehot", (outer_ids,) + pat[1][1:])
            return [self.to_boundary(t, "jit") for t in outs]
        if prim is compat.remat_p:
            inner = [self.to_boundary(t, "checkpoint") for t in tags]
            outs = self.run(compat.remat_params(eqn).jaxpr, inner, path, scan_lengths)
            return [self.to_boundary(t, "checkpoint") for t in outs]
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
        if kind == "dense":
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
        for v in extra:
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
    """``(n_index_components, row_component)`` if ``eqn`` gathers whole rows of a 2-D
    table by integer ids, else None.

    Two forms are recognised: ``table[ids]`` / ``jnp.take`` (the row dim collapsed,
    one index component) and a batched ``dynamic_slice`` of a row, which is what
    ``jax.vmap`` makes of ``table[i]`` with a scalar ``i`` (``eqx.nn.Embedding``):
    no collapsed dim, an index pair (row, column) in clip mode, where the column
    start of a full-width slice is always clamped to 0.
    """
    from jax.lax import GatherScatterMode

    dn = eqn.params["dimension_numbers"]
    operand, idx = eqn.invars
    if len(_shape(operand)) != 2 or not np.issubdtype(idx.aval.dtype, np.integer):
        return None
    if getattr(dn, "operand_batching_dims", ()) or getattr(dn, "start_indices_batching_dims", ()):
        return None
    if tuple(eqn.params["slice_sizes"]) != (1, _shape(operand)[1]):
        return None
    out_rank = len(_shape(eqn.outvars[0]))
    smap, collapsed, offs = (tuple(dn.start_index_map), tuple(dn.collapsed_slice_dims),
                             tuple(dn.offset_dims))
    ncomp = _shape(idx)[-1] if _shape(idx) else 0
    if collapsed == (0,) and smap == (0,) and ncomp == 1 and offs == (out_rank - 1,):
        return 1, 0
    if collapsed == () and offs == (out_rank - 2, out_rank - 1) and 0 in smap:
        mode = eqn.params.get("mode")
        if smap == (0,) and ncomp == 1:
            return 1, 0
        if sorted(smap) == [0, 1] and ncomp == 2 and mode == GatherScatterMode.CLIP:
            return 2, smap.index(0)
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
    return Analysis(a.leaves, sites, scopes, a.primitives)
