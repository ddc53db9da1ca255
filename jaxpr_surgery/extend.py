"""Extending jaxpr_surgery: rules for your own ops.

A ``jax.custom_vjp`` or ``jax.custom_jvp`` op (a fused layer, a Pallas kernel behind a
custom backward, a memory-saving rewrite, a hand-written JVP) is opaque to the
analysis: the parameters it touches get the op's exact per-example gradients,
materialised (the cost of ``vmap(grad)``; see
`jaxpr_surgery.explain`). Register the plain
JAX function it computes, and every layer inside gets the package's fast rules:

    import jaxpr_surgery as js

    js.extend.register_custom_op(fused_dense, lambda w, x: x @ w)
    js.extend.check_rule(loss)(params, batch)   # the op's backward is the reference's

An op with no JAX reference (a Pallas kernel) gets a rule instead: a `CustomOpRule`
whose ``per_example_grad`` reads the op's operands and output cotangents (`OpSite`),
with optional cheaper ``sq_norms`` and ``summed_grad``:

    js.extend.register_custom_op(pallas_dense, rule=MyDenseRule())

A primitive (your own ``jax.extend.core.Primitive``, or one the package serves only by
its exact per-example VJP) takes the same kind of rule:

    js.extend.register_primitive_rule(my_dense_p, MyDenseRule())

A new reduction (`js.stats.Reduction`) is checked against the laws the engine relies on
(merges, running accumulators, devices, shares, weights) with `check_reduction`.

See docs/extending.md.
"""

from jaxpr_surgery._src.check import check_rule as check_rule
from jaxpr_surgery._src.custom_ops import CustomOpRule as CustomOpRule
from jaxpr_surgery._src.custom_ops import OpSite as OpSite
from jaxpr_surgery._src.custom_ops import Registration as Registration
from jaxpr_surgery._src.custom_ops import register_custom_op as register_custom_op
from jaxpr_surgery._src.laws import check_reduction as check_reduction
from jaxpr_surgery._src.sites.custom import register_primitive_rule as register_primitive_rule

__all__ = ["register_custom_op", "register_primitive_rule", "check_rule", "check_reduction",
           "Registration", "CustomOpRule", "OpSite"]
