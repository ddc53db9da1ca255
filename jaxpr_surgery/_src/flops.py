"""FLOPs of jaxpr equations, estimated from their types (for explain's cost of a site whose
per-example gradients are formed by the op's own VJP: the generic kernel, a custom op's
rule): the products of ``dot_general`` and ``conv_general_dilated`` counted exactly (two
FLOPs per multiply-add), an equation with a body by its body's (a ``scan``'s times its
length), any other equation one FLOP per output element."""

from __future__ import annotations

import math

from jaxpr_surgery._src import compat, walker


def _size(aval) -> int:
    return math.prod(getattr(aval, "shape", ()))


def _dot(eqn) -> float:
    (lc, _), _ = eqn.params["dimension_numbers"]
    lhs = eqn.invars[0].aval.shape
    return 2.0 * _size(eqn.outvars[0].aval) * math.prod(lhs[i] for i in lc)


def _conv(eqn) -> float:
    rhs = eqn.invars[1].aval.shape
    dn = eqn.params["dimension_numbers"]
    rhs_spec = getattr(dn, "rhs_spec", None) or tuple(range(len(rhs)))
    per_output = rhs[rhs_spec[1]] * math.prod(rhs[i] for i in rhs_spec[2:])
    return 2.0 * _size(eqn.outvars[0].aval) * per_output


_PRODUCTS = {compat.dot_general_p: _dot, compat.conv_p: _conv}


def eqn_flops(eqn) -> float:
    """The estimated FLOPs of one equation (module docstring)."""
    rule = _PRODUCTS.get(eqn.primitive)
    if rule is not None:
        return rule(eqn)
    subs = walker.bodies(eqn)
    if subs:
        reps = walker.nested(eqn).length if walker.nest_of(eqn) is walker.Nest.SCAN else 1
        # (a custom op's body and its rules: the body, as the forward computes)
        return float(reps * max(jaxpr_flops(s) for s in subs))
    return float(sum(_size(v.aval) for v in eqn.outvars))


def jaxpr_flops(jaxpr) -> float:
    """The estimated FLOPs of every equation of ``jaxpr``."""
    return vjp_flops(jaxpr.eqns)


def vjp_flops(eqns) -> float:
    """The estimated FLOPs of the VJP of ``eqns`` (one example's) with respect to one
    operand: their forward's (the parameter's cotangent of a product is one product of
    the same size: ``x^T dy`` for ``x @ w``), the sum of each equation's."""
    return float(sum(eqn_flops(e) for e in eqns))
