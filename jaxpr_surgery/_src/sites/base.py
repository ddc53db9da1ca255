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
        return jnp.sum(jnp.square(G), axis=axes)  # no cancellation: inf on overflow
    if isinstance(reduction, S.Norms):
        return materialised_norms(G)
    if isinstance(reduction, S.Centered):
        m = jnp.mean(G, axis=0)
        return S.Moments(m, jnp.sum(jnp.square(G - m), axis=0))
    raise TypeError(f"reduction {reduction!r} cannot be computed directly")


def example_scale(a):
    """``[B]``: each example's largest magnitude in ``a [B, ...]`` (1 where that is 0
    or not finite), to divide it by before squaring. No derivative: the norm
    ``s sqrt(sum (a/s)^2)`` is the same function whatever ``s``."""
    m = jnp.max(jnp.abs(jax.lax.stop_gradient(a)).reshape(a.shape[0], -1), axis=1)
    return jnp.where((m > 0) & jnp.isfinite(m), m, 1)


def scale_examples(a, s):
    """``a [B, ...]`` with example ``b`` divided by ``s_b``."""
    return a / s.reshape((-1,) + (1,) * (a.ndim - 1))


def recompute_flagged(exact, args, values, bad):
    """``values [B]`` with ``exact(args, b)`` in place of the examples where ``bad``.

    The value comes from one loop over the flagged examples alone (flagged first in
    ``order``): no trip in the usual case and no branch to trace or lower. A loop
    with a traced trip count has no reverse-mode derivative, so derivatives (of any
    order) come from recomputing every example in a loop with static bounds, taken
    where flagged: paid only by programs that differentiate the statistic. No branch
    there either: under ``vmap`` a branch on traced flags becomes a select whose
    operands pass through ``stop_gradient``, which reverse mode cannot transpose
    inside this rule. ``exact`` must read traced values only from ``args``.
    """

    @jax.custom_jvp
    def fast(args, values, bad):
        order = jnp.argsort(jnp.logical_not(bad), stable=True)

        def one(i, v):
            b = order[i]
            return v.at[b].set(exact(args, b))

        return jax.lax.fori_loop(0, jnp.sum(bad, dtype=jnp.int32), one, values)

    def differentiable(args, values, bad):
        def one(b, v):
            return v.at[b].set(jnp.where(bad[b], exact(args, b), v[b]))

        return jax.lax.fori_loop(0, values.shape[0], one, values)

    fast.defjvp(lambda primals, tangents: jax.jvp(differentiable, primals, tangents))
    return fast(args, values, bad)


def example_norm(make, blocks=None):
    """``||G||`` of one example, ``G = make(cut)`` (shaped ``[1, *shape]``), exact and
    without a square past the range: against a running scale (the largest magnitude
    so far, as LAPACK's ``nrm2``). ``blocks = (axis, size, n)``: in blocks of ``size``
    along ``axis`` of ``n`` (``cut = (axis, f0, size)``; the last block, which
    ``dynamic_slice`` shifts back to fit, counts only its new part), else ``cut =
    None``."""

    def add(state, g, keep=True):
        scale, ssq = state
        m = jnp.max(jnp.where(keep, jnp.abs(g), 0))
        new = jnp.maximum(scale, m)
        safe = jnp.where(new > 0, new, 1)
        ssq = ssq * jnp.square(scale / safe) + jnp.sum(jnp.where(keep, jnp.square(g / safe), 0))
        return new, ssq

    if blocks is None:
        g = make(None)
        m = jnp.max(jnp.abs(g))
        return m * jnp.sqrt(jnp.sum(jnp.square(g / jnp.where(m > 0, m, 1))))
    axis, size, n = blocks

    def block(k, state):
        f0 = k * size
        g = make((axis, f0, size))
        idx = jnp.minimum(f0, n - size) + jnp.arange(size)  # where the slice landed
        keep = (idx >= f0).reshape((size,) + (1,) * (g.ndim - axis - 2))
        return add(state, g, keep)

    zero = jnp.zeros((), jax.eval_shape(lambda: make((axis, 0, size))).dtype)
    scale, ssq = jax.lax.fori_loop(0, -(-n // size), block, (zero, zero))
    return scale * jnp.sqrt(ssq)


def flagged_norms(sq, exact_norm, args):
    """``sqrt(sq)`` (``[B]`` squared norms), with ``exact_norm(args, b)`` for the examples
    whose square is not finite: overflowed (float32 norms past ``2^64``), or NaN from
    overflowing terms. A loop over those alone (`recompute_flagged`): nothing runs,
    and no branch is traced, in the usual case."""
    return recompute_flagged(exact_norm, args, S.sqrt0(sq), jnp.logical_not(jnp.isfinite(sq)))


def materialised_norms(G):
    """``[B]`` norms of ``G [B, ...]``, finite wherever representable: its squares
    summed, the examples whose square overflows one at a time (`flagged_norms`)."""

    def exact(G, b):
        return example_norm(lambda cut: jax.lax.dynamic_slice_in_dim(G, b, 1, 0))

    return flagged_norms(jnp.sum(jnp.square(G), axis=tuple(range(1, G.ndim))), exact, G)


def honest_sq(sq, norms):
    """Squared norms where they came out NaN or inf from overflowing terms (a ghost
    norm's products, cross terms of opposite signs): the square of the exact norm,
    ``inf`` only where that square is past the dtype's range."""
    return jnp.where(jnp.isfinite(sq), sq, jnp.square(norms))


def direct_norms(kernel, ctx, reductions, compute, depth=0):
    """``compute(reductions)`` for a site, its per-example (squared) norms safe from
    overflow: from the kernel's `scaled_sq_norms` where it has them (no branch), or its
    `sq_and_norms`, else from one `SqNorms` serving every `Norms` and `SqNorms` request,
    the norms from
    `Kernel.norms_from` (exact where the squares overflow) and the squares made
    `honest_sq`. Kernels themselves never see `Norms`. ``depth``: ``ctx`` and the
    values are stacked over that many enclosing scans."""
    keys = [k for k, r in reductions.items() if S.is_norms(r)]
    if not keys:
        return compute(reductions)
    req = {k: r for k, r in reductions.items() if not S.is_norms(r)}
    if kernel.has_scaled_sq_norms():
        out = dict(compute(req))
        q, s = stacked(kernel.scaled_sq_norms, depth)(ctx)
        norms = S.sqrt0(q) * s
        for k in keys:  # the squares: inf only where past the dtype's range
            out[k] = q * s * s if isinstance(reductions[k], S.SqNorms) else norms
        return out
    if kernel.has_sq_and_norms():
        out = dict(compute(req))
        sq, norms = stacked(kernel.sq_and_norms, depth)(ctx)
    else:
        sq_key = ("sq", len(req))
        req[sq_key] = S.SqNorms()
        out = dict(compute(req))
        sq = out.pop(sq_key)
        norms = kernel.norms_from(ctx, sq, depth)
    for k in keys:
        out[k] = norms if isinstance(reductions[k], S.Norms) else honest_sq(sq, norms)
    return out


def stacked(fn, depth):
    """``fn`` mapped over ``depth`` leading axes (the layers of enclosing scans)."""
    for _ in range(depth):
        fn = jax.vmap(fn)
    return fn


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

    # per-example norms safe from overflow (sites.base.direct_norms) ----------- #
    def has_scaled_sq_norms(self):
        """Whether `scaled_sq_norms` serves this site (its norms then need no recomputation)."""
        return False

    def scaled_sq_norms(self, ing):
        """``(q, s)`` with ``||G_b||^2 = q_b s_b^2``, ``q`` computed on the example
        divided by ``s`` (about its size), where that costs little
        (`has_scaled_sq_norms`): no square overflows where the norm is representable."""
        raise NotImplementedError

    def has_sq_and_norms(self):
        """Whether `sq_and_norms` serves this site (one computation for both)."""
        return False

    def sq_and_norms(self, ing):
        """``(sq, norms)``: squared norms, and norms exact where the squares overflow."""
        raise NotImplementedError

    def norms_from(self, ing, sq, depth=0):
        """``[B]`` norms of ``G_b`` from this site's squared norms ``sq`` (of ``ing``:
        ingredients or context): their square roots, and `example_norm` for the
        examples whose square overflowed (`flagged_norms`). ``depth``: both stacked
        over enclosing scans."""
        return stacked(lambda ing, sq: flagged_norms(sq, self.example_norm, ing), depth)(ing, sq)

    def example_norm(self, ing, b):
        """The exact norm of example ``b``'s ``G`` (`base.example_norm`), for
        `norms_from`; kernels whose ``G`` is large override it to form it in blocks."""
        G = self.materialise(ing)
        return example_norm(lambda cut: jax.lax.dynamic_slice_in_dim(G, b, 1, 0))

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
