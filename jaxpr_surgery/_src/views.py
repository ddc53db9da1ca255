"""A site's view of its parameter leaf, and values mapped between the two.

A site sees its leaf through a chain of steps (analysis.py's ``LayoutOp``: reshapes,
transposes, static slices, the slicing of a ``lax.scan`` over stacked layers). A value
shaped like the view (a reduction's value, stacked over the enclosing scans) maps back
to the leaf through the chain's inverse, and a leaf-shaped value (a running statistic
carried into a site, a reference gradient) forward to the view. Only the steps'
``inverse``/``forward``/``kind``/``perm``/``start``/``stride`` are read here.
"""

from __future__ import annotations

import enum


class Step(enum.Enum):
    """A step of a view chain (`analysis_types.LayoutOp.kind`)."""

    RESHAPE = "reshape"
    TRANSPOSE = "transpose"
    IDENTITY = "identity"
    SCAN = "scan"  # a lax.scan's slicing of a stacked leaf
    SLICE = "slice"  # a static slice (the others move every element)


class Factor(enum.Enum):
    """A constant factor of a view (`analysis_types.Scale.kind`)."""

    MUL = "mul"
    DIV = "div"
    NEG = "neg"


def to_leaf(value, site, fill=0):
    """A value in the site's view (stacked over enclosing scans) in leaf space.
    ``fill``: the value where a slice of the leaf has no view (a zero gradient's)."""
    for op in reversed(site.chain):
        value = op.inverse(value, fill) if op.kind is Step.SLICE else op.inverse(value)
    return value


def from_leaf(value, site):
    """A leaf-space value (stacked over enclosing scans) in the site's view (undoes
    `to_leaf`)."""
    for op in site.chain:
        value = op.forward(value)
    return value


def is_noop(op):
    return op.kind is Step.IDENTITY or (op.kind is Step.RESHAPE and op.in_shape == op.out_shape)


def leaf_axes(site):
    """For each axis of the site's view, the leaf axis it is; None when the view is
    more than a permutation of the leaf (a reshape, a slice, stacked layers)."""
    if site.depth:
        return None
    m = None
    for op in site.chain:
        if m is None:
            m = list(range(len(op.in_shape)))
        if is_noop(op):
            continue
        if op.kind is Step.TRANSPOSE:
            m = [m[int(p)] for p in op.perm]
            continue
        return None
    return tuple(m) if m is not None else tuple(range(len(site.view_shape)))


def leaf_map(site):
    """For each axis of the site's view, ``(leaf axis, start, stride)``: the view's
    index ``i`` on it is the leaf's ``start + stride * i`` (a permutation of the leaf's
    axes, with slices); None when the view is more than that (a reshape, a slice of
    stacked layers)."""
    if site.depth:
        return None
    m = None
    for op in site.chain:
        if m is None:
            m = [(a, 0, 1) for a in range(len(op.in_shape))]
        if is_noop(op):
            continue
        if op.kind is Step.TRANSPOSE:
            m = [m[int(p)] for p in op.perm]
            continue
        if op.kind is Step.SLICE:
            m = [(a, s0 + st0 * s, st0 * st) for (a, s0, st0), s, st in zip(m, op.start, op.stride)]
            continue
        return None
    if m is None:
        return tuple((a, 0, 1) for a in range(len(site.view_shape)))
    return tuple(m)


def leaf_shape(site):
    """The shape of the leaf a site's view comes from (per scan slice: the view of a
    layer of stacked ones is mapped back to the stack by `to_leaf`)."""
    return tuple(site.chain[0].in_shape) if site.chain else tuple(site.view_shape)
