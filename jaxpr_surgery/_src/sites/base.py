"""The kernel protocol shared by every layer kind, and the registry.

A kernel serves one *site* (an equation where a parameter view meets example
data). Inside the backward pass it receives the site's inputs (the parameter
view ``w``, the other inputs, batched over examples on axis 0) and the output
cotangent ``dy`` ``[B, ...]``, and produces either reduced statistics
(``direct``) or compact *ingredients* from which norms, clipped sums and
materialised per-example gradients are computed after the backward pass.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from jaxpr_surgery._src import stats as S

KERNELS: dict = {}

# The rule vocabulary of ``explain`` (docs/explain.md): what a user pays.
STREAMED = "streamed"  # no per-example tensor of the leaf (contraction, rank-one, ghost, tiled)
MATERIALISED = "materialised"  # a [B, *leaf] per-example tensor of the leaf
FALLBACK = "fallback"  # exact per-example gradient of the leaf (residual)
UNUSED = "unused"  # the loss does not depend on the leaf
RULE_ORDER = (UNUSED, STREAMED, MATERIALISED, FALLBACK)  # cheapest to dearest


@dataclasses.dataclass(frozen=True)
class Rule:
    """How one site computes one reduction (for explain)."""

    word: str  # one of STREAMED, MATERIALISED, FALLBACK
    how: str  # e.g. "ghost norm", "tiled per-example products (1 example/tile)"
    flops: float  # estimated extra FLOPs
    bytes: float  # estimated extra temporary memory


def register(kind):
    def deco(cls):
        if kind in KERNELS:
            raise ValueError(f"A kernel for layer kind {kind!r} is already registered.")
        KERNELS[kind] = cls
        cls.kind = kind
        return cls

    return deco


def kernel_for(site, acc_dtype, budget=None):
    k = KERNELS[site.kind](site, acc_dtype)
    k.budget = budget
    return k


def acc_dtype_for(*dtypes):
    return jnp.result_type(jnp.float32, *[d for d in dtypes if jnp.issubdtype(d, jnp.floating)])


# --------------------------------------------------------------------------- #
# Reductions of materialised per-example gradients G [B, *shape]
# --------------------------------------------------------------------------- #
def reduce_materialised(G, reduction):
    ext = S.extension(reduction)
    if ext is not None:
        return ext.materialised(G, reduction)
    axes = tuple(range(1, G.ndim))
    if isinstance(reduction, S.PhiSum):
        return jnp.sum(reduction.apply(G), axis=0)
    if isinstance(reduction, S.SqNorms):
        return jnp.sum(jnp.square(G), axis=axes)
    if isinstance(reduction, S.Centered):
        m = jnp.mean(G, axis=0)
        return S.Moments(m, jnp.sum(jnp.square(G - m), axis=0))
    raise TypeError(f"reduction {reduction!r} cannot be computed directly")


def weighted_sum_materialised(G, c):
    return jnp.tensordot(c.astype(G.dtype), G, axes=(0, 0))


class Kernel:
    """Base class: everything derives from ``materialise`` unless overridden."""

    kind = "?"

    def __init__(self, site, acc_dtype, budget=None):
        self.site = site
        self.acc = acc_dtype
        self.budget = budget  # bytes per tile of per-example gradients (None: default)

    # inside the backward pass ------------------------------------------- #
    def prepare(self, w, ext, ext_batched, dy):  # pragma: no cover - abstract
        raise NotImplementedError

    def prepare_site(self, w, ext, ext_batched, dy):
        """`prepare`, then the view's constant factor (``W / 16``: the site's
        ``Site.scales``) folded into the context by `scale`, so that everything computed
        from it is of the leaf's view rather than of the scaled operand."""
        ctx = self.prepare(w, ext, ext_batched, dy)
        c = view_scale(self.site, ext, self.acc)
        return ctx if c is None else self.scale(ctx, c)

    def scale(self, ctx, c):
        """The context of the gradient times the scalar ``c``. Every rule is linear in
        the output cotangent; kernels scale theirs (here: a materialised ``G``)."""
        return ctx * c

    def direct(self, ctx, reduction):
        return reduce_materialised(self.materialise(ctx), reduction)

    def direct_all(self, ctx, reductions, carry=None):
        """``{key: direct(ctx, r)}``; kernels override to share work between reductions.

        ``carry``: a `stats.Carry` keyed like ``reductions`` (in the view's layout), only
        for keys `carried_keys` names: those come back over its examples as well."""
        return {k: self.direct(ctx, r) for k, r in reductions.items()}

    def carried_keys(self, reductions, B):
        """Keys of ``reductions`` whose computation for ``B`` examples starts from the
        running values of earlier chunks (`direct_all`'s ``carry``); the caller merges
        the others."""
        return ()

    def ingredients(self, ctx):
        return ctx

    def ingredient_avals(self, B):
        """The shapes of ``ingredients`` for ``B`` examples where the kernel knows them
        without tracing (None: the engine traces ``prepare``). Exact: a test checks
        them against the traced ones."""
        return None

    def ctx(self, ing):
        """The ``prepare`` context back from ingredients."""
        return ing

    # after the backward pass (ingredients; B leading) -------------------- #
    def materialise(self, ing):
        raise NotImplementedError

    # A leaf shared by several sites (tying) sums their ``G`` tiles in the leaf's
    # layout; kernels that write straight into the sum (a scatter) go last.
    adds_in_place = False

    def add_to_leaf(self, ing, total, to_leaf, cut=None):
        """``total + G`` of the examples in ``ing`` in the leaf's layout (``total``
        may be None); ``to_leaf`` maps the site's view to the leaf. Kernels override
        this to produce ``G`` in the leaf's layout directly (no per-tile transpose) or
        to add into ``total`` in place.

        ``cut = (axis, f0, size)`` restricts ``G`` (and ``total``) to ``f0:f0+size`` on
        leaf ``axis`` (a block of features, tiling.py). This default forms the whole
        ``G`` first; kernels produce the block alone on the axes `leaf_cut_axes` names.
        """
        g = to_leaf(self.materialise(ing)).astype(self.acc)
        if cut is not None:
            axis, f0, size = cut
            g = jax.lax.dynamic_slice_in_dim(g, f0, size, axis + 1)
        return g if total is None else total + g

    def leaf_cut_axes(self):
        """Leaf axes on which `add_to_leaf` produces a block without the whole ``G``."""
        return ()

    def sq_norms(self, ing):
        return reduce_materialised(self.materialise(ing), S.SqNorms())

    def weighted_sum(self, ing, c):
        return weighted_sum_materialised(self.materialise(ing), c)

    def dots(self, ctx, ref):
        """``[B]``: ``<G_b, ref>`` with ``ref`` in the view's layout."""
        G = self.materialise(ctx)
        return jnp.einsum("b...,...->b", G, ref.astype(G.dtype), precision="highest")

    # reporting ----------------------------------------------------------- #
    def rule(self, reduction, B) -> Rule:
        """How this site computes ``reduction`` for a batch of ``B``; for explain."""
        out = sum(math.prod(v.aval.shape) for v in self.site.eqn.outvars)
        view = math.prod(self.site.view_shape)
        itemsize = jnp.dtype(self.acc).itemsize
        return Rule(
            MATERIALISED, "per-example VJP", float(2 * B * (out + view)), float(B * view * itemsize)
        )


def view_scale(site, ext, dtype):
    """The product of the site's constant view factors (`analysis.Scale`) as a scalar
    of ``dtype``, or None where it has none. ``ext``: the site's other inputs (the
    factors' values among them), not batched."""
    from jaxpr_surgery._src import compat

    c = None
    for sc in site.scales:
        if sc.kind == "neg":
            f = jnp.asarray(-1, dtype)
        else:
            v = sc.operand
            f = v.val if isinstance(v, compat.Literal) else ext[site.ext_vars.index(v)]
            f = jnp.reshape(jnp.asarray(f).astype(dtype), ())
            if sc.kind == "div":
                f = 1 / f
        c = f if c is None else c * f
    return c


def dn_batch(x):
    return jax.tree.leaves(x)[0].shape[0]
