"""Sites of a ``jax.custom_vjp`` or ``jax.custom_jvp`` op registered with a rule
(`custom_ops.CustomOpRule`), or of a primitive given one: the per-example gradient of
its parameter from the op's operands and output cotangents, by the user's rule
(``jaxpr_surgery.extend.register_custom_op(op, rule=...)``,
``jaxpr_surgery.extend.register_primitive_rule(primitive, rule)``).

The context is the call's `custom_ops.OpSite`; its ingredients (for norms after the
backward pass, clipped sums, several sites of one leaf) are the per-example gradients.
The rule's optional squared norms and summed gradient serve `stats.SqNorms` and the plain
(linear) sum where it has them; every other reduction reads `per_example_grad`.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jaxpr_surgery._src import compat, custom_ops, flops, walker
from jaxpr_surgery._src import stats as S
from jaxpr_surgery._src.sites.base import (
    MATERIALISED,
    STREAMED,
    Fast,
    Kernel,
    Rule,
    anchor,
    register,
    times_examples,
    unanchor,
    weighted_sum_materialised,
)


@register
class CustomRuleKernel(Kernel):
    """A registered custom op's parameter, or a primitive's given a rule: its per-example
    gradient by the user's rule."""

    kind = "custom-op"
    anchors = tuple(p for p in (compat.custom_vjp_call_p, compat.custom_jvp_call_p)
                    if p is not None)
    priority = 10  # a user's rule for a primitive: asked before the package's kernels

    @classmethod
    def matches(cls, eqn, tag, pos, patterns):
        # (the parameter itself an operand: no parameter-only step between)
        return not tag.pre and len(set(pos)) == 1 and custom_ops.rule_of(eqn) is not None

    def __init__(self, site, acc_dtype, budget=None):
        super().__init__(site, acc_dtype, budget)
        entry = custom_ops.ruled_entry(site.eqn)
        self.user_rule, self.name = entry.rule, entry.describe

    def prepare(self, w, ext, ext_batched, dy):
        site = self.site
        operands, batched = [], []
        for v in site.eqn.invars:
            if v is site.base:
                operands.append(w)
                batched.append(False)
            elif isinstance(v, compat.Literal):
                operands.append(v.val)
                batched.append(False)
            else:
                k = site.ext_vars.index(v)
                operands.append(ext[k])
                batched.append(bool(ext_batched[k]))
        dys = tuple(dy) if isinstance(dy, (tuple, list)) else (dy,)
        return custom_ops.OpSite(tuple(operands), tuple(batched), site.param_pos, dys)

    # (the rule's methods are linear in the cotangents: scaling them scales the gradients;
    # a context rebuilt from ingredients is the gradients themselves)
    def scale(self, ctx, c):
        if not isinstance(ctx, custom_ops.OpSite):
            return super().scale(ctx, c)
        return ctx.with_cotangents(d * jnp.asarray(c).astype(d.dtype) for d in ctx.cotangents)

    def scale_examples(self, ctx, s):
        if not isinstance(ctx, custom_ops.OpSite):
            return super().scale_examples(ctx, s)
        return ctx.with_cotangents(times_examples(d, s) for d in ctx.cotangents)

    def _grads(self, ctx):
        G = self.user_rule.per_example_grad(ctx)
        want = (ctx.batch_size,) + tuple(self.site.view_shape)
        if tuple(G.shape) != want:
            raise ValueError(
                f"{type(self.user_rule).__name__}.per_example_grad (the rule of "
                f"{self.name}) returned shape {tuple(G.shape)}; expected {want} (the batch, "
                "then the parameter operand's shape)."
            )
        return G.astype(self.acc)

    def materialise(self, ing):
        return self._grads(ing) if isinstance(ing, custom_ops.OpSite) else ing

    def ingredients(self, ctx):
        return self._grads(ctx)

    def ingredient_avals(self, B):
        return jax.ShapeDtypeStruct((B,) + tuple(self.site.view_shape), self.acc)

    def weighted_sum(self, ing, c):
        if isinstance(ing, custom_ops.OpSite) and self.user_rule.has("summed_grad"):
            return self.user_rule.summed_grad(self.scale_examples(ing, c)).astype(self.acc)
        return weighted_sum_materialised(self.materialise(ing), c)

    def rule(self, reduction, B) -> Rule:
        view = math.prod(self.site.view_shape)
        item = jnp.dtype(self.acc).itemsize
        fast = self.fast_rule(reduction)
        if fast is not None:
            what = "sq_norms" if isinstance(reduction, S.SqNorms) else "summed_grad"
            return Rule(STREAMED, f"custom rule {what}", float(2 * B * view), 0.0)
        # (the rule's gradients: priced as the op's VJP, `flops.vjp_flops`)
        grads = B * flops.vjp_flops((self.site.eqn,))
        return Rule(MATERIALISED, "custom rule per_example_grad", float(2 * B * view) + grads,
                    float(B * view * item))


def _sq_norms(kernel, ctx, r):
    return kernel.user_rule.sq_norms(ctx).astype(kernel.acc)


def _plain_sum(kernel, ctx, r):
    return kernel.user_rule.summed_grad(ctx).astype(kernel.acc)


CustomRuleKernel.FAST = {
    S.SqNorms: Fast(_sq_norms, lambda k, r: k.user_rule.has("sq_norms")),
    S.PhiSum: Fast(_plain_sum, lambda k, r: r.linear and k.user_rule.has("summed_grad")),
}


def register_primitive_rule(primitive, rule, *, where=None) -> custom_ops.Registration:
    """Registers a layer rule for the equations of a JAX primitive.

    Where a parameter meets the example's data in an equation of ``primitive`` (the
    parameter itself one operand, not transformed first), its per-example gradients
    (squared norms and sums where the rule has them) come from ``rule``, read from the
    equation's operands and output cotangents (`OpSite`), as for a custom op registered
    with a rule (`register_custom_op`). Without one, such a site takes the exact route:
    ``jax.vmap`` of the equation's VJP, its per-example gradients materialised. For a
    primitive of your own (``jax.extend.core.Primitive`` with its JVP or transpose, and a
    batching rule) or one the package serves only that way (a grouped convolution).

    `check_rule` checks the rule on your model against the per-example gradients jax's
    own derivative of the primitive gives.

    Args:
      primitive: a primitive object (``jax.extend.core.Primitive``); not one whose
        equations hold a jaxpr the package walks into (``jit``, ``checkpoint``, ``scan``,
        ``while``, ``cond``) nor a ``custom_vjp`` / ``custom_jvp`` call (register the op
        with `register_custom_op`).
      rule: a `CustomOpRule` instance.
      where: ``where(eqn) -> bool``: which of the primitive's equations the rule serves
        (by its params: ``lambda eqn: eqn.params["feature_group_count"] > 1``); None:
        all. Several rules for one primitive are asked in registration order.

    Returns:
      A `Registration`: ``.remove()`` unregisters the rule; as a context manager, the
      rule is registered inside the ``with`` block only.

    Raises:
      TypeError: ``primitive`` is not a primitive object, ``rule`` is not a
        `CustomOpRule` overriding ``per_example_grad``, or ``where`` is not callable.
      ValueError: ``primitive`` is a structured or custom-derivative primitive, or
        already has a rule for all its equations.
    """
    what = "register_primitive_rule"
    if not isinstance(primitive, compat.Primitive):
        raise TypeError(
            f"{what}: primitive must be a JAX primitive object (jax.extend.core.Primitive), "
            f"got {type(primitive).__name__}; for a jax.custom_vjp / custom_jvp function use "
            "register_custom_op.")
    if primitive in compat.custom_prims:
        raise ValueError(
            f"{what}: {primitive.name} is the primitive of every custom_vjp / custom_jvp "
            "call; register the op itself with register_custom_op(op, rule=...).")
    if walker.NESTS.get(primitive) is not None:
        raise ValueError(
            f"{what}: the equations of {primitive.name} hold a jaxpr the package walks into "
            "(their layers get their own rules; a shard_map's, the exact per-example "
            "fallback); register a rule for the primitive of the layer inside, or wrap the "
            "layer in a jax.custom_vjp and use register_custom_op.")
    def on_remove():  # the primitive's last rule removed
        if not custom_ops.has_primitive_rules(primitive):
            unanchor(CustomRuleKernel, primitive)

    reg = custom_ops.add_primitive_rule(primitive, rule, where, on_remove)
    anchor(CustomRuleKernel, primitive)
    return reg
