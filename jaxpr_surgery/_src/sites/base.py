"""The kernel protocol shared by every layer kind, and the registry.

A kernel serves one *site* (an equation where a parameter view meets example
data). Inside the backward pass it receives the site's inputs (the parameter
view ``w``, the other inputs, batched over examples on axis 0) and the output
cotangent ``dy`` ``[B, ...]``, and produces either reduced statistics
(``direct``) or compact *ingredients* from which norms, clipped sums and
materialised per-example gradients are computed after the backward pass.

Which kernel serves a site is a registry lookup, the way JAX keeps its rules
(``jet``, ``checkify``): `SITE_RULES` maps a primitive object to the kernels
anchored on it (`Kernel.anchors`), and `kind_for` returns the first whose
`Kernel.matches` accepts the site, else the default (generic) kernel. Adding a
kind is one module under ``sites/`` whose kernel class is `register`-ed.
"""

from __future__ import annotations

import abc
import dataclasses
import math
from collections.abc import Callable
from typing import Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp

from jaxpr_surgery._src import compat, cuts
from jaxpr_surgery._src import sink_keys as K
from jaxpr_surgery._src import stats as S
from jaxpr_surgery._src.clip_reductions import ClipNorms, KeptExamples
from jaxpr_surgery._src.norms import (  # noqa: F401 - re-exported for the kernels
    example_norm,
    example_scale,
    flagged_norms,
    honest_sq,
    materialised_norms,
    norms_of_products,
    recompute_flagged,
    scale_examples,
    sqrt0,
    with_bound,
)
from jaxpr_surgery._src.reductions import acc_dtype_for, weighted_examples  # noqa: F401 - re-exported
from jaxpr_surgery._src.views import Factor

KERNELS: dict = {}  # kind (display name) -> kernel class, every registered kernel
SITE_RULES: dict = {}  # primitive object -> kernel classes anchored on it, asked in order
_DEFAULT: list = []  # the kernel of a site no anchored kernel matches (one)

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
    # the forms the cost model weighed for this rule (`Candidate`s, the chosen first);
    # empty where there is one form
    candidates: tuple = ()


# The cost model that chooses between forms of one statistic at a site (ghost norms or
# per-example products, ...): a form costs its FLOPs plus `BYTE_FLOPS` per byte it moves
# through memory (a CPU core does a few FLOPs in the time it moves a byte; a GPU more).
BYTE_FLOPS = 4.0


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One form of a statistic at a site, as the cost model weighs it (explain shows
    them): ``flops`` and ``traffic`` (bytes moved through memory) for a batch of ``B``,
    ``bytes`` of temporary memory."""

    how: str
    flops: float
    traffic: float
    bytes: float

    @property
    def cost(self) -> float:
        return self.flops + BYTE_FLOPS * self.traffic


def cheapest(candidates):
    """The candidates sorted by `Candidate.cost`, cheapest first (ties: given order)."""
    return tuple(sorted(candidates, key=lambda c: c.cost))


def _own(cls, name):
    """``cls``'s own class attribute ``name`` (not inherited), or raise naming it."""
    if name not in vars(cls):
        raise TypeError(
            f"register({cls.__name__}): the class must set its own {name!r} (a registered "
            f"kernel does not inherit it from {cls.__mro__[1].__name__})."
        )
    return vars(cls)[name]


def _claim_kind(cls):
    kind = _own(cls, "kind")
    if not isinstance(kind, str) or not kind:
        raise TypeError(f"register({cls.__name__}): kind must be a non-empty str, got {kind!r}.")
    if kind in KERNELS:
        raise ValueError(
            f"register({cls.__name__}): a kernel for layer kind {kind!r} is already "
            f"registered ({KERNELS[kind].__name__})."
        )
    KERNELS[kind] = cls


def register(cls):
    """Registers the kernel class ``cls`` at the primitives of ``cls.anchors``.

    The class sets its own ``kind`` (a display name, unique) and ``anchors`` (a
    non-empty tuple of primitive objects from `compat`) and overrides `matches`;
    `kind_for` asks the kernels anchored on a site's primitive in order of
    ``priority`` (higher first; equal: first registered first).

    Raises:
      ValueError: if the kind is already registered.
      TypeError: if ``kind`` or ``anchors`` is missing or not of the right type.
    """
    anchors = _own(cls, "anchors")
    if (
        not isinstance(anchors, tuple)
        or not anchors
        or not all(isinstance(p, compat.Primitive) for p in anchors)
    ):
        raise TypeError(
            f"register({cls.__name__}): anchors must be a non-empty tuple of primitive "
            f"objects (from compat), got {anchors!r}."
        )
    if "matches" not in vars(cls):
        raise TypeError(f"register({cls.__name__}): the class must define matches().")
    _claim_kind(cls)
    for p in dict.fromkeys(anchors):
        _add_rule(p, cls)
    return cls


def _add_rule(prim, cls):
    """Files the kernel class ``cls`` among those asked at ``prim``, by its priority."""
    rules = SITE_RULES.setdefault(prim, [])
    rules.append(cls)
    rules.sort(key=lambda k: -k.priority)  # stable: registration order among equals


def anchor(cls, prim):
    """Anchors the registered kernel class ``cls`` at the primitive object ``prim`` as
    well (a user's rule for a primitive, `sites.custom.register_primitive_rule`);
    `unanchor` undoes it."""
    if prim in cls.anchors:
        return
    cls.anchors = (*cls.anchors, prim)
    _add_rule(prim, cls)


def unanchor(cls, prim):
    """Undoes `anchor`."""
    cls.anchors = tuple(p for p in cls.anchors if p is not prim)
    rules = [k for k in SITE_RULES.get(prim, ()) if k is not cls]
    if rules:
        SITE_RULES[prim] = rules
    else:
        SITE_RULES.pop(prim, None)


def register_default(cls):
    """Registers ``cls`` as the kernel of every site no anchored kernel matches (the
    exact per-example VJP of the site's equation).

    Raises:
      ValueError: if a default or the kind is already registered.
    """
    if _DEFAULT:
        raise ValueError(
            f"register_default({cls.__name__}): {_DEFAULT[0].__name__} is already the "
            "default kernel."
        )
    _claim_kind(cls)
    _DEFAULT.append(cls)
    return cls


class OneHot(NamedTuple):
    """What the analysis recognised of a value (`Patterns`): ``one_hot(ids)``, ``ids``
    (a variable) compared with a range of ``n`` along the result's axis ``axis``."""

    ids: Any
    axis: int
    n: int


class MergedUse(NamedTuple):
    """What the analysis recognised of a value (`Patterns`): the merged low-rank weight
    ``merged`` (`analysis_types.Merged`) where it meets the data."""

    merged: Any


#: what the analysis recognised of other values than a site's view, by variable, for
#: the kernels' ``matches`` and ``extra_inputs``: `OneHot` or `MergedUse`
Patterns = dict


def kind_for(eqn, tag, pos, patterns):
    """The kernel class serving the site ``eqn`` (the site's kind).

    Args:
      eqn: the equation where the parameter view meets example data.
      tag: the view (`analysis_types.PView`: ``pre``, ``base``, ``chain``, ``scales``).
      pos: the operand indices of ``eqn`` holding the view (a list).
      patterns: what the analysis recognised of other values, by variable
        (`Patterns`: ``OneHot(ids, axis, n)`` for ``one_hot(ids)``).

    Returns:
      The first kernel anchored on ``eqn.primitive`` whose `Kernel.matches` is true,
      else the default kernel (`register_default`).
    """
    for cls in SITE_RULES.get(eqn.primitive, ()):
        if cls.matches(eqn, tag, pos, patterns):
            return cls
    return _DEFAULT[0]


def kernel_for(site, acc_dtype, budget=None, cache_blocks=True, split_blocks=False):
    k = site.kernel(site, acc_dtype)
    k.budget = budget
    k.cache_blocks = cache_blocks
    k.split_blocks = split_blocks
    return k


# --------------------------------------------------------------------------- #
# Per-example norms at a site
# --------------------------------------------------------------------------- #
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
    if kernel.has_scaled_sq_norms(alone=not req):
        out = dict(compute(req))
        q, s = stacked(kernel.scaled_sq_norms, depth)(ctx)
        norms = sqrt0(q) * s
        for k in keys:  # the squares: inf only where past the dtype's range
            out[k] = norms if isinstance(reductions[k], S.Norms) else q * s * s
        return out
    clip = None
    if kernel.has_sq_and_norms():
        out = dict(compute(req))
        sq, norms, bound = stacked(kernel.sq_and_norms_bound, depth)(ctx)
        # clipping: the value and the bound of its rounding (`ClipNorms`)
        clip = with_bound(norms, sq, bound)
    else:
        # (a key of the requests' one type, `sink_keys.Key`: jax sorts a request's keys
        # when it flattens it, vmapped over a scanned leaf's layers)
        sq_key = K.SQ
        assert sq_key not in req, "internal error: a request holds the squares' own key"
        req[sq_key] = S.SqNorms()
        out = dict(compute(req))
        sq = out.pop(sq_key)
        kept = next((out[k] for k, r in req.items() if isinstance(r, KeptExamples)), None)
        if kept is not None:  # the products themselves, kept for a clipped sum
            norms = stacked(norms_of_products, depth)(sq, kept)
        else:
            norms = kernel.norms_from(ctx, sq, depth)
    for k in keys:
        r = reductions[k]
        if isinstance(r, ClipNorms) and clip is not None:
            out[k] = clip
        else:
            out[k] = norms if isinstance(r, S.Norms) else honest_sq(sq, norms)
    return out


def stacked(fn, depth):
    """``fn`` mapped over ``depth`` leading axes (the layers of enclosing scans)."""
    for _ in range(depth):
        fn = jax.vmap(fn)
    return fn


def times_examples(a, s):
    """``a [B, ...]`` with example ``b`` times ``s_b`` (in ``a``'s dtype)."""
    return a * s.astype(a.dtype).reshape((-1,) + (1,) * (a.ndim - 1))


def weighted_sum_materialised(G, c):
    """``sum_b c_b G_b`` of materialised gradients ``G [B, ...]`` (`weighted_examples`)."""
    return weighted_examples(c, G)


@dataclasses.dataclass(frozen=True)
class Fast:
    """A kernel's fast rule for one kind of reduction (`Kernel.FAST`).

    Attributes:
      value: ``(kernel, ctx, reduction) -> value`` in the view's layout, without the
        per-example gradients.
      applies: ``(kernel, reduction) -> bool``: whether the rule serves this reduction
        at this site (a multiplicative phi of a rank-one product, ...).
      rule: ``(kernel, reduction, B) -> Rule`` for explain, or None (the kernel's own).
    """

    value: Callable
    applies: Callable = lambda kernel, reduction: True
    rule: Callable | None = None


class Kernel(abc.ABC):
    """Base class: everything derives from ``materialise`` unless overridden.

    A kernel's fast rules are a table `FAST` keyed by reduction classes (`stats.lookup`
    finds a subclass's entry); a reduction without one (or whose rule does not apply
    at the site) is computed from the per-example gradients (`Reduction.from_examples`
    of `materialise` here; tiles of them in kernels that stream)."""

    FAST: ClassVar[dict] = {}
    #: weighted rules, keyed by the class of the reduction weighted (`stats.Weighted`):
    #: `Fast` entries whose ``value(kernel, ctx, inner, w)`` is ``inner``'s weighted value
    #: over the site's examples (``inner.from_weighted(G, w)``; the examples of weight 0
    #: are zeros in ``ctx``), for reductions whose weights do not fold into the cotangents
    FAST_WEIGHTED: ClassVar[dict] = {}

    kind = "?"  # display name of the layer kind (explain); never used for dispatch
    anchors: tuple = ()  # primitive objects whose sites this kernel may serve
    priority = 0  # among kernels anchored on one primitive, higher is asked first

    # choosing the kernel (analysis, before any kernel exists) ------------ #
    @classmethod
    def matches(cls, eqn, tag, pos, patterns) -> bool:
        """Whether this kernel serves the site ``eqn`` of one of its `anchors` (the
        arguments of `kind_for`)."""
        return False

    @classmethod
    def extra_inputs(cls, eqn, tag, pos, patterns) -> tuple:
        """Values depending on the example that the kernel reads besides the operands
        of ``eqn`` (the ids of a one-hot input): appended last to ``Site.ext_vars``."""
        return ()

    # what other modules ask of a kernel (never its kind's name) ---------- #
    def token_matmuls(self) -> bool:
        """Its per-example products are 2-D matmuls over a token axis (``N > 1``): a
        leaf it shares is tiled one example at a time on CPU (`tiling.leaf_tile`)."""
        return False

    def gathers_rows(self):
        """``(V, d)`` where the site gathers whole rows of the table ``_view`` maps to
        its view, by ids, with the context (`ctx`) ``(ids [B, T], valid [B, T],
        dy [B, T, d])``: a tied dense site has a ghost cross term with it
        (`ghost_cross.cross_layout`). Else None."""
        return None

    def dense_layout(self):
        """The canonical layout ``c`` (`dense_layout.canon`) where the site is a dense layer
        whose ingredients are ``(x [B, K, N, C], dy [B, K, N, F])`` and ``to_view`` maps
        ``[K, C, F]`` to the view: a tied embedding has a ghost cross term with it. Else
        None."""
        return None

    def __init__(self, site, acc_dtype, budget=None):
        self.site = site
        self.acc = acc_dtype
        self.budget = budget  # bytes per tile of per-example gradients (None: default)
        # a reduction of the call passes over each block of G several times
        # (`Reduction.cache_blocks`; `tiling.cache_sized`): set by the plan
        self.cache_blocks = True
        # ... and keeps its cache-sized blocks under a batch split by device
        # (`Reduction.blocks_under_split`)
        self.split_blocks = False

    # the site's value for a batch (the forward pass and its VJP) ---------- #
    def forward(self, f, ext_batched):
        """``F(w, *ext) -> outs``: the site's equations for a batch of examples.

        ``f(w, *ext)`` evaluates them for one example (`generic.composite`); ``ext``
        holds the site's other inputs, batched on axis 0 where ``ext_batched`` says.
        Here ``jax.vmap(f)`` with the view shared by the examples; kernels whose
        primitive jax cannot map that way override it (`batched_every_operand`)."""
        return batched_every_operand(f, self.site, ext_batched)

    # inside the backward pass ------------------------------------------- #
    @abc.abstractmethod
    def prepare(self, w, ext, ext_batched, dy):
        """The site's context for a batch (the one method a kernel must define): a pytree
        of the parameter view ``w``, the other inputs ``ext`` (batched where
        ``ext_batched``) and the output cotangents ``dy`` (each ``[B, ...]``), typed by the
        kernel's family (``dense_layout.Tokens``, ``embedding.Rows``)."""

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

    def scale_examples(self, ctx, s):
        """The context of each example's gradient times its ``s_b`` (``s [B]``); here
        the materialised ``G``."""
        return times_examples(ctx, s)

    def fast_rule(self, reduction):
        """This site's `Fast` rule for ``reduction``, or None (from the examples). A
        reduction over weighted examples (`stats.Weighted`) takes the kernel's weighted
        rule of its inner one (`FAST_WEIGHTED`) if there is one; else, if its value is
        the inner one's over scaled gradients (`Reduction.scaled`), the inner one's rule
        on the scaled context: weights cost nothing where the inner one is fast."""
        fast = S.lookup(self.FAST, reduction)
        if fast is not None:
            return fast if fast.applies(self, reduction) else None
        parts = reduction.weighted_parts()
        wfast = parts and S.lookup(self.FAST_WEIGHTED, parts[0])
        if wfast is not None and wfast.applies(self, parts[0]):
            inner, w = parts
            wrule = wfast.rule
            return Fast(
                lambda k, ctx, r: wfast.value(k, ctx, inner, w),
                rule=wrule and (lambda k, r, B: wrule(k, inner, B)),
            )
        scaled = reduction.scaled()
        if scaled is None:
            return None
        inner, s = scaled
        fast = self.fast_rule(inner)
        if fast is None:
            return None
        rule = fast.rule
        return Fast(
            lambda k, ctx, r: fast.value(k, k.scale_examples(ctx, s), inner),
            rule=rule and (lambda k, r, B: rule(k, inner, B)),
        )

    def direct(self, ctx, reduction):
        fast = self.fast_rule(reduction)
        if fast is not None:
            return fast.value(self, ctx, reduction)
        return self.from_examples(ctx, reduction)

    def from_examples(self, ctx, reduction):
        """``reduction`` without a fast rule: from the per-example gradients."""
        return reduction.from_examples(self.materialise(ctx))

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

        ``cut`` (cuts.py) restricts ``G`` (and ``total``) to a block of features on a
        leaf axis (tiling.py). This default forms the whole
        ``G`` first; kernels produce the block alone on the axes `leaf_cut_axes` names.
        """
        g = to_leaf(self.materialise(ing)).astype(self.acc)
        if cut is not None:
            g = cuts.take(cut, g, cuts.axis_of(cut) + 1)
        return g if total is None else total + g

    def leaf_cut_axes(self):
        """Leaf axes on which `add_to_leaf` produces a block without the whole ``G``."""
        return ()

    def sq_norms(self, ing):
        return S.SqNorms().from_examples(self.materialise(ing))

    def sq_norms_bound(self, ing):
        """``(sq, bound)``: `sq_norms` and a bound on how far rounding may have moved them
        beyond the exact route's own rounding (``G_b`` formed, its squares summed): 0
        here, where they come from ``G_b`` (or its rows) itself; a ghost form's bound
        (`norms.untrusted`) where the kernel kept one."""
        sq = self.sq_norms(ing)
        return sq, jnp.zeros_like(sq)

    # per-example norms safe from overflow (sites.base.direct_norms) ----------- #
    def has_scaled_sq_norms(self, alone=False):
        """Whether `scaled_sq_norms` serves this site (its norms then need no
        recomputation); ``alone``: the norms are all the site computes (a site may
        offer them where a pass of their own costs nothing beside its other
        statistics')."""
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

    def sq_and_norms_bound(self, ing):
        """``(sq, norms, bound)``: `sq_and_norms` and the bound of their rounding beyond
        the exact route's (`sq_norms_bound`; 0 here)."""
        sq, norms = self.sq_and_norms(ing)
        return sq, norms, jnp.zeros_like(sq)

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
        return example_norm(lambda cut: compat.slice_at(G, b, 1, 0))

    def weighted_sum(self, ing, c):
        return weighted_sum_materialised(self.materialise(ing), c)

    def keeps_products_for_clip(self) -> bool:
        """Whether, for a clipped sum, the site keeps its per-example gradients
        (`clip_reductions.KeptExamples`, from the tile loop of its norms) rather than its
        ingredients; its `weighted_sum` then takes them."""
        return False

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


def batches_every_operand(site) -> bool:
    """Whether the site's equations hold a primitive that ``jax.vmap`` maps only with
    every operand batched (`compat.BATCH_EVERY_OPERAND`: ``ragged_dot``)."""
    return any(e.primitive in compat.BATCH_EVERY_OPERAND for e in (*site.pre, site.eqn))


def broadcast_unbatched(vals, batched, B):
    """``vals`` with each unbatched one broadcast to ``[B, ...]``."""
    return tuple(
        v if b else jnp.broadcast_to(v, (B,) + jnp.shape(v)) for v, b in zip(vals, batched)
    )


# primitive object -> ``rule(eqn, vals, batched, B) -> outs or None``: the equation for a
# batch of ``B`` examples where jax.vmap cannot map it (`compat.BATCH_EVERY_OPERAND`)
# without copies of its unbatched operands; None: no better way than the copies
BATCH_RULES: dict = {}


def map_eqn(eqn, vals, batched, B):
    """The outputs of ``eqn`` for a batch of ``B`` examples, ``vals`` batched on axis 0
    where ``batched`` says, for a primitive of `compat.BATCH_EVERY_OPERAND`: its
    `BATCH_RULES` entry, else ``jax.vmap`` over every unbatched operand broadcast (a
    copy per example)."""
    rule = BATCH_RULES.get(eqn.primitive)
    outs = rule(eqn, vals, batched, B) if rule is not None else None
    if outs is not None:
        return outs
    vals = broadcast_unbatched(vals, batched, B)
    return jax.vmap(lambda *a: tuple(compat.bind_eqn(eqn, list(a))))(*vals)


def batched_every_operand(f, site, ext_batched):
    """``jax.vmap(f)`` over ``(w, *ext)`` with ``w`` and the unbatched ``ext`` shared,
    except where the site needs every operand batched (`batches_every_operand`): there
    they are broadcast to the batch first (``B`` copies of the view, as the
    per-example VJP of such a site costs anyway)."""
    if not batches_every_operand(site):
        return jax.vmap(f, in_axes=(None,) + tuple(0 if b else None for b in ext_batched))

    def F(w, *ext):
        B = next(x.shape[0] for x, b in zip(ext, ext_batched) if b)
        w, *ext = broadcast_unbatched((w, *ext), (False, *ext_batched), B)
        return jax.vmap(f)(w, *ext)

    return F


def view_scale(site, ext, dtype):
    """The product of the site's constant view factors (`analysis_types.Scale`) as a scalar
    of ``dtype``, or None where it has none. ``ext``: the site's other inputs (the
    factors' values among them), not batched."""
    c = None
    for sc in site.scales:
        if sc.kind is Factor.NEG:
            f = jnp.asarray(-1, dtype)
        else:
            v = sc.operand
            f = v.val if isinstance(v, compat.Literal) else ext[site.ext_vars.index(v)]
            f = jnp.reshape(jnp.asarray(f).astype(dtype), ())
            if sc.kind is Factor.DIV:
                f = 1 / f
        c = f if c is None else c * f
    return c


def pre_scales(site_or_tag):
    """``[(Factor, operand, varying view axes)]`` when every parameter-only step after
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
        shape = tuple(view.aval.shape)
        if tuple(e.outvars[0].aval.shape) != shape:
            return None
        if e.primitive is compat.neg_p and e.invars[0] is view:
            out.append((Factor.NEG, None, ()))
        elif e.primitive in (compat.mul_p, compat.div_p) and len(e.invars) == 2:
            ps = [k for k, v in enumerate(e.invars) if v is view]
            if len(ps) != 1 or (e.primitive is compat.div_p and ps[0] != 0):
                return None
            other = e.invars[1 - ps[0]]
            osh = tuple(other.aval.shape)
            if not jnp.issubdtype(other.aval.dtype, jnp.floating):
                return None
            if osh and (len(osh) != len(shape) or any(a not in (1, b) for a, b in zip(osh, shape))):
                return None
            axes = frozenset(k for k, a in enumerate(osh) if a != 1)
            out.append((Factor.MUL if e.primitive is compat.mul_p else Factor.DIV, other, axes))
        else:
            return None
        view = e.outvars[0]
    return out


def dn_batch(x):
    return jax.tree.leaves(x)[0].shape[0]
