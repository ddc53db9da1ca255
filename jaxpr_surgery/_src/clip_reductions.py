"""Clipped sums (`ClippedSum`, per group `GroupClip`), the clip factor and the handling of
examples whose gradient is not finite.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from jaxpr_surgery._src.norms import stacked_parts
from jaxpr_surgery._src.reductions import ElementwiseReduction, ExampleNorms, Norms, Reduction


@dataclasses.dataclass(frozen=True)
class ClipNorms(Norms):
    """The per-example norms clipping divides by (engine-internal): `Norms`, except
    where a cheap form gave the value (a token-axis ghost norm, a tied table's cross
    terms, whose terms may cancel): there its value plus the worst-case bound of its
    rounding (`norms.untrusted`), never below the norm of the per-example gradient, so
    no example passes its clip with more than ``C``. The statistic `Norms` keeps the
    value itself."""


@dataclasses.dataclass(frozen=True)
class KeptExamples(Reduction):
    """The per-example gradients themselves, ``[B, *leaf]`` (engine-internal): what a
    site keeps for a clipped sum where its tile loop forms them for the norms anyway
    (`sites.dense.DenseKernel.keeps_products_for_clip`), in place of its input and
    cotangent. Never a user's statistic."""

    per_example: ClassVar[bool] = True
    carries: ClassVar[bool] = False
    feature_blocks: ClassVar[None] = None  # whole examples (leading B)

    def aval(self, shape, dtype, B):
        return jax.ShapeDtypeStruct((B,) + tuple(shape), dtype)

    def from_examples(self, G):
        return G

    def merge(self, a, na, b, nb):
        return jnp.concatenate([a, b], axis=0)

    def zeros(self, shape, dtype, B):
        return jnp.zeros((B,) + tuple(shape), dtype)


def is_norms(r) -> bool:
    """``r`` is a per-example norm reduction (`SqNorms` or `Norms`): an array ``[B]``
    per leaf, computed by the same rules (sites.base.direct_norms)."""
    return isinstance(r, ExampleNorms)


def clip_factor(C, norm):
    """``min(1, C / norm)`` without NaN at ``norm = 0`` or ``C = inf``; a traced bound
    that is NaN, zero or negative gives NaN (the result is poisoned, never unclipped)."""
    if isinstance(C, (int, float)):
        if C == float("inf"):
            return jnp.ones_like(norm)
        return C / jnp.maximum(norm, C)
    C = jnp.asarray(C, norm.dtype)
    finite = jnp.isfinite(C)
    Cs = jnp.where(finite & (C > 0), C, 1.0)
    c = jnp.where(finite, Cs / jnp.maximum(norm, Cs), 1.0)
    return jnp.where(C > 0, c, jnp.nan)


def _bound_key(x):
    """A hashable stand-in for one clip bound: its value, or the traced value itself."""
    if isinstance(x, (int, float)) and not isinstance(x, bool):
        return float(x)
    return ("object", id(x))


#: What a clipped sum does with an example whose gradient is not finite (`ClippedSum`).
NONFINITE_MODES = ("drop", "propagate")


def check_nonfinite(nonfinite, owner):
    """``nonfinite`` of a clipped sum, checked (`NONFINITE_MODES`)."""
    if not (isinstance(nonfinite, str) and nonfinite in NONFINITE_MODES):
        raise ValueError(
            f"{owner}(nonfinite=...): expected 'drop' (an example whose gradient holds a NaN "
            "or an infinity adds nothing; js.stats.nonfinite_count() counts them) or "
            f"'propagate' (it makes the sum NaN), got {nonfinite!r}."
        )
    return nonfinite


def nonfinite_examples(norms, w=None):
    """``[B]`` bool: the examples whose gradient is not finite, read from their norms
    ``norms`` (a list of ``[B]`` arrays, one per leaf, finite wherever representable): a
    NaN or an infinity in some leaf (or a leaf's norm past the float range). With
    example weights ``w``, only examples of positive weight (the others are removed
    already). What clipped sums drop, and `stats.nonfinite_count` counts."""
    bad = jnp.logical_not(jnp.all(jnp.isfinite(stacked_parts(norms)), axis=0))
    return bad if w is None else bad & (w > 0)


@dataclasses.dataclass(frozen=True, eq=False)
class ClippedSum(ElementwiseReduction):
    """``sum_b min(1, C / ||g_b||) g_b`` with the global per-example norm, or per group
    of leaves ``sum_b min(1, C_k / ||g_b,k||) g_b,k`` (per-layer clipping).

    ``clip_norm`` is one bound (a float, or a traced scalar inside ``jit``), or a pytree
    of bounds that is a prefix of the differentiated arguments' structure: each bound
    clips the part of every example's gradient under it by that part's own norm. The
    engine binds it to each leaf's group (`GroupClip`, `per_leaf`) and weights every
    leaf's examples by `example_weights` of the norm over the leaf's group.

    ``nonfinite``: ``"drop"`` (the default): an example whose gradient is not finite
    (`nonfinite_examples`) adds nothing, its clip factor ``0`` and its per-example
    inputs read as zeros in the weighted sums, which the engine forms a second time
    without it only when there is one (`clipping.clipped_sums`); ``"propagate"``: it
    makes the sum NaN."""

    clip_norm: Any
    nonfinite: str = "drop"
    weighted_by_norm: ClassVar[bool] = True
    carries: ClassVar[bool] = False
    feature_blocks: ClassVar[None] = None

    @property
    def drops_nonfinite(self):
        return self.nonfinite == "drop"

    def _key(self):
        leaves, tree = jax.tree.flatten(self.clip_norm)
        return ("clip", tree, tuple(_bound_key(x) for x in leaves), self.nonfinite)

    def __eq__(self, other):
        return isinstance(other, ClippedSum) and self._key() == other._key()

    def __hash__(self):
        return hash(self._key())

    def from_examples(self, G):
        raise TypeError(
            "ClippedSum needs every leaf's per-example norm: the engine forms it from "
            "example_weights and weighted sums, never from one leaf's gradients alone."
        )

    def merge(self, a, na, b, nb):
        return a + b

    def zeros(self, shape, dtype, B):
        return jnp.zeros(tuple(shape), dtype)

    def combine_axis(self, value, n_local, N, axis_name):
        return jax.lax.psum(value, axis_name)

    def per_leaf(self, flatten, leaf_avals):
        """Each leaf's group and bound (`GroupClip`): ``flatten.prefix`` maps the tree of
        bounds onto the leaves (one group of every leaf for a single bound)."""
        del leaf_avals
        groups = flatten.prefix(self.clip_norm, "the clip_norm of clipped_sum/clipped_mean",
                                "bound")
        return [GroupClip(C, self.nonfinite, k, path) for k, path, C in groups]

    def example_weights(self, norm):
        """``[B]`` weights of the examples from their norms: ``min(1, C/norm)`` (a single
        bound; the engine asks each leaf's `GroupClip`)."""
        return clip_factor(self.clip_norm, norm)

    @property
    def per_group(self):
        """Per-layer clipping: ``clip_norm`` is a tree of bounds, not a single bound."""
        return not jax.tree_util.treedef_is_leaf(jax.tree.structure(self.clip_norm))

    def describe(self):
        what = "ClippedSum (per group)" if self.per_group else "ClippedSum"
        return what if self.drops_nonfinite else f"{what} (non-finite propagated)"


@dataclasses.dataclass(frozen=True, eq=False)
class GroupClip(ClippedSum):
    """A `ClippedSum` bound to one leaf (engine-internal): the leaf's examples are
    weighted by ``min(1, clip_norm / norm)`` with ``norm`` the per-example norm over every
    leaf of its group (``group``: the index of the bound, ``path``: where it sits in the
    tree of bounds, empty for a single bound)."""

    group: int = 0
    path: str = ""

    def _key(self):
        return ("group-clip", self.group, self.path, _bound_key(self.clip_norm), self.nonfinite)

    def per_leaf(self, flatten, leaf_avals):
        del flatten, leaf_avals
        return None
