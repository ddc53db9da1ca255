"""The analysis' types: the tags a value gets with respect to the parameters (`PView`,
`Mixed`, `Merged`, and the layout and scale steps of a view), the sites found
(`Site`), each leaf's use (`LeafInfo`, `LeafUse`) and the result (`Analysis`); and the
parsing of a layout equation into its step.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from typing import Any

import jax
import numpy as np

from jaxpr_surgery._src import compat
from jaxpr_surgery._src.sites import pre_scales
from jaxpr_surgery._src.views import Factor, Step


class _Data(enum.Enum):
    """The analysis's tag of a value that depends on the example (a `PView` or `Mixed`
    depends on parameters, None on neither)."""

    DATA = "data"

    def __repr__(self):
        return "DATA"


DATA = _Data.DATA


@dataclasses.dataclass(frozen=True)
class LayoutOp:
    """One step of a view chain: an injective layout step, a static slice, or a scan
    slicing.

    A slice (``W[:k]``, ``W[:, a:b:s]``, ``lax.dynamic_slice`` at constant starts)
    keeps the elements ``start + stride * i`` of every axis; the leaf's per-example
    gradient is the view's, padded with zeros (`inverse` with ``fill``).
    """

    kind: Step
    in_shape: tuple
    out_shape: tuple
    perm: tuple | None = None
    start: tuple | None = None  # slice: the first index kept on every axis
    stride: tuple | None = None  # slice: the step on every axis

    def inverse(self, value, fill=0):
        """Maps a value shaped ``lead + out_shape`` back to ``lead + in_shape``.

        ``fill``: what a slice puts where the leaf has no view (a reduction's value of
        a zero gradient: 0 for sums and moments, ``B phi(0)`` for a sum of ``phi``)."""
        if self.kind is Step.SLICE:
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
        if self.kind is Step.SLICE:
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
        return self.kind is not Step.SLICE

    def describe(self):
        """A short text of the step, for explain (``[0:8, 2:6]``, ``transpose (1, 0)``)."""
        if self.kind is Step.SLICE:
            parts = []
            for s, st, n, m in zip(self.start, self.stride, self.in_shape, self.out_shape):
                if m == n:
                    parts.append(":")
                else:
                    parts.append(f"{s}:{s + (m - 1) * st + 1}" + (f":{st}" if st != 1 else ""))
            return f"slice [{', '.join(parts)}]"
        if self.kind is Step.TRANSPOSE:
            return f"transpose {tuple(int(i) for i in self.perm)}"
        if self.kind is Step.RESHAPE:
            return f"reshape {tuple(self.in_shape)} -> {tuple(self.out_shape)}"
        return self.kind.value

    def _map(self, value, src, dst, perm):
        """``lead + src`` -> ``lead + dst`` by this step's kind (``perm``: the
        transpose's, in that direction)."""
        if self.kind is Step.SCAN or self.kind is Step.IDENTITY:
            return value
        lead = value.shape[: value.ndim - len(src)]
        # (lax's own ops: one equation each, not a jitted jnp function per call; numpy's
        # for index arrays, `ghost_cross._cross_layout`)
        host = isinstance(value, np.ndarray)
        if self.kind is Step.RESHAPE:
            shape = lead + tuple(int(d) for d in dst)
            return value.reshape(shape) if host else jax.lax.reshape(value, shape)
        if self.kind is Step.TRANSPOSE:
            n = len(lead)
            perm = tuple(range(n)) + tuple(n + int(i) for i in perm)
            return value.transpose(perm) if host else jax.lax.transpose(value, perm)
        raise AssertionError(self.kind)


@dataclasses.dataclass(frozen=True)
class Scale:
    """A constant factor of a view (``W * c``, ``W / c``, ``-W``): every site's
    gradient is linear in its output cotangent, so the view's per-example gradient is
    ``c`` times the scaled view's.

    ``kind``: `Factor`; ``operand``: the factor, a Literal or a Var of one element that
    depends on neither the parameters nor the example (None for ``Factor.NEG``).
    """

    kind: Factor
    operand: Any = None

    def describe(self):
        if self.kind is Factor.NEG:
            return "negated"
        if is_literal(self.operand):
            v = np.asarray(self.operand.val).reshape(())
            return f"{'times' if self.kind is Factor.MUL else 'divided by'} {v.item():g}"
        return f"{'times' if self.kind is Factor.MUL else 'divided by'} a constant"


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


@dataclasses.dataclass(frozen=True)
class Merged:
    """A merged low-rank weight ``W + c * (L @ R)`` (a merged LoRA layer), followed by
    layout steps: every site of it is a site of each of its leaves.

    ``factors``: ``((PView, Var), (PView, Var))`` of ``L`` and ``R``, the product's
    operands; ``steps``: the parameter-only equations from the product (first) to this
    value, which its sites apply again; ``scales``: the constant factors of the
    product (`Scale`); ``frozen``: ``(PView, Var, k)`` of a base weight that is a view
    of a leaf, added at ``steps[k]`` (None: none, or a constant); ``added``: whether
    the base weight was added yet.
    """

    factors: tuple
    steps: tuple
    scales: tuple = ()
    frozen: tuple | None = None
    added: bool = False

    @property
    def leaves(self):
        out = {t.leaf for t, _ in self.factors}
        return out | {self.frozen[0].leaf} if self.frozen else out


PARAM_TAGS = (PView, Mixed, Merged)  # tags that depend on some parameter leaf


@dataclasses.dataclass
class Site:
    path: tuple
    eqn: Any
    kernel: type  # the kernel class serving the site (`sites.base.kind_for`)
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
    # a tap: the path of the equation whose own site evaluates it (several sites at
    # one equation, `Merged`); the tap reads its cotangent. ``path`` is then unique
    # to the tap (the equation's path, "tap", its rank)
    tap_of: tuple | None = None

    @property
    def at(self):
        """The path of the site's equation."""
        return self.path if self.tap_of is None else self.tap_of

    @property
    def kind(self):
        """The layer kind's display name (``dense``, ``embedding``, ...; for explain)."""
        return self.kernel.kind

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
        parts = [op.describe() for op in self.chain if op.kind in (Step.SLICE, Step.TRANSPOSE)]
        if any(op.kind is Step.RESHAPE and op.in_shape != op.out_shape for op in self.chain):
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


class LeafUse(enum.Enum):
    """How a leaf meets the data: read per example through a construct the analysis does
    not see into (``RESIDUAL``), not at all (``UNUSED``), at one site or at several."""

    RESIDUAL = enum.auto()
    UNUSED = enum.auto()
    SINGLE = enum.auto()
    MULTI = enum.auto()


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
    # eqn path -> paths of its taps (`Site.tap_of`), in order
    taps: dict = dataclasses.field(default_factory=dict)
    # ``(leaves, eqn, axes)`` of each collective over the examples' mesh axes (an
    # ``all_gather`` over the batch's axis in hand-written FSDP, a ``psum``,
    # ``ppermute``, ...) that parameter ``leaves`` go through: a per-example gradient
    # through it would mix the examples of different devices (`api.front_half` refuses)
    crossing: list = dataclasses.field(default_factory=list)
    # the same over mesh axes the examples are not split on only (a parameter gathered
    # over a model axis inside ``shard_map``): refused (`api.front_half`)
    model_crossing: list = dataclasses.field(default_factory=list)

    def at(self, p):
        """The sites at the equation at ``p``: its own, then its taps."""
        s = self.sites.get(p)
        return [] if s is None else [s] + [self.sites[q] for q in self.taps.get(p, ())]

    def use(self, i) -> LeafUse:
        """How leaf ``i`` meets the data (`LeafUse`)."""
        info = self.leaves[i]
        if info.residual:
            return LeafUse.RESIDUAL
        if not info.sites:
            return LeafUse.UNUSED
        return LeafUse.SINGLE if len(info.sites) == 1 else LeafUse.MULTI


def is_literal(v):
    return isinstance(v, compat.Literal)


def shape_of(v):
    return tuple(v.aval.shape)


_IDENTITY_PRIMS = tuple(
    p
    for p in (compat.copy_p, compat.sharding_constraint_p, *compat.vma_cast_prims)
    if p is not None
)


def layout_op(eqn):
    """The `LayoutOp` of an injective layout eqn, or None."""
    p = eqn.primitive
    ins, outs = eqn.invars, eqn.outvars
    if len(outs) != 1:
        return None
    i_shape, o_shape = shape_of(ins[0]), shape_of(outs[0])
    if p is compat.convert_p:
        import jax.numpy as jnp

        if jnp.issubdtype(ins[0].aval.dtype, jnp.floating) and jnp.issubdtype(
            outs[0].aval.dtype, jnp.floating
        ):
            return LayoutOp(Step.IDENTITY, i_shape, o_shape)
        return None
    if p in _IDENTITY_PRIMS:
        return LayoutOp(Step.IDENTITY, i_shape, o_shape)
    if p is compat.reshape_p and len(ins) == 1 and eqn.params.get("dimensions") is None:
        return LayoutOp(Step.RESHAPE, i_shape, o_shape)
    if p is compat.squeeze_p:
        return LayoutOp(Step.RESHAPE, i_shape, o_shape)
    if p is compat.broadcast_p and len(ins) == 1 and math.prod(i_shape) == math.prod(o_shape):
        return LayoutOp(Step.RESHAPE, i_shape, o_shape)
    if p is compat.transpose_p:
        return LayoutOp(Step.TRANSPOSE, i_shape, o_shape, tuple(eqn.params["permutation"]))
    if p is compat.slice_p:
        start = tuple(int(i) for i in eqn.params["start_indices"])
        stride = tuple(int(i) for i in (eqn.params["strides"] or (1,) * len(i_shape)))
        return _slice_op(i_shape, o_shape, start, stride)
    if p is compat.dynamic_slice_p and all(is_literal(v) for v in ins[1:]):
        # constant starts, clamped as lax.dynamic_slice clamps them
        start = tuple(
            min(max(int(np.asarray(v.val)), 0), n - m)
            for v, n, m in zip(ins[1:], i_shape, o_shape)
        )
        return _slice_op(i_shape, o_shape, start, (1,) * len(i_shape))
    return None


def _slice_op(i_shape, o_shape, start, stride):
    if i_shape == o_shape:
        return LayoutOp(Step.IDENTITY, i_shape, o_shape)
    return LayoutOp(Step.SLICE, i_shape, o_shape, start=start, stride=stride)


def _constant_factor(v, tag):
    """``v`` (an operand of a parameter-only mul/div) is a floating constant that
    depends on neither the parameters nor the example."""
    import jax.numpy as jnp

    return tag is None and jnp.issubdtype(v.aval.dtype, jnp.floating)


def scale_step(eqn, pos, tags):
    """The `Scale` of a parameter-only ``eqn`` that multiplies the view (operand
    ``pos``) by a one-element constant, or None."""
    p = eqn.primitive
    out = shape_of(eqn.outvars[0])
    if out != shape_of(eqn.invars[pos]):
        return None
    if p is compat.neg_p:
        return Scale(Factor.NEG)
    if p not in (compat.mul_p, compat.div_p) or len(eqn.invars) != 2:
        return None
    if p is compat.div_p and pos != 0:
        return None  # c / W is not linear in W
    other = eqn.invars[1 - pos]
    if not _constant_factor(other, tags[1 - pos]) or math.prod(shape_of(other)) != 1:
        return None
    return Scale(Factor.MUL if p is compat.mul_p else Factor.DIV, other)
