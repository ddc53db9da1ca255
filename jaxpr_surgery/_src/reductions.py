"""Reductions over examples: the protocol every statistic's values come from.

A `Reduction` is one summary of the per-example gradients ``g_b`` of one parameter
leaf (or of a site's view of it) over the examples ``b``, with everything the engine
needs to compute it anywhere: its value's shapes (`Reduction.aval`), its value over
materialised per-example gradients (`Reduction.from_examples`), the merge of its
values over two disjoint sets of examples (`Reduction.merge`: one rule for the tiles
of a tile loop, the chunks of a batch and the devices of a mapped axis), a running
accumulator (`Reduction.add_examples`, `Reduction.accumulate`, `Reduction.finish`),
the combination across devices (`Reduction.combine_axis`) and the map from a site's
view to the leaf (`Reduction.to_leaf`). A layer kind never needs to know a reduction:
where a kernel has no fast rule for it, it produces tiles of per-example gradients and
the reduction reduces them. A new reduction is one class implementing the three
abstract methods (and the defaults it needs to change).

The built-in reductions (``g_b`` is the per-example gradient of one leaf, ``B`` the
number of examples):

* `PhiSum` -- ``sum_b phi(g_b)`` elementwise (``phi=None``: the plain sum).
* `Centered` -- ``(mean_b g_b, sum_b (g_b - mean)^2)``, computed without catastrophic
  cancellation (each tile's exact moments merged into the running ones by Chan's rule;
  within derivatives in the example weights, running `Shifted` sums re-centred within
  `MAX_SHIFT_AMPLIFICATION`).
* `SqNorms` -- ``[B]`` array of ``||g_b||^2`` for the leaf (per example).
* `Norms` -- ``[B]`` array of ``||g_b||``, finite wherever the norm is representable
  (also where its square is not: float32 norms past ``2^64``).
* `ClippedSum` -- ``sum_b min(1, C / ||g_b||) g_b`` with the *global* norm over every
  differentiated leaf, or per group of leaves with a bound each (per-layer clipping):
  weighted by the engine once every leaf's norms are known.
* `KronSum` (kron_sum.py) -- per axis ``j`` of the leaf, ``sum_b U_j(g_b) U_j(g_b)^T`` with
  ``U_j(g) = moveaxis(g, j, 0).reshape(n_j, -1)`` (or its diagonal).

(`dots.DotWith` is the per-example inner product with a reference gradient.)
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from jaxpr_surgery._src import cuts, versions, views
from jaxpr_surgery._src import example_weights as ew
from jaxpr_surgery._src import fingerprint as fp
from jaxpr_surgery._src.fn_equality import function_name, same_function
from jaxpr_surgery._src.moments import (
    Moments,
    Shifted,
    Totals,
    about_the_mean,
    chan_update,
    merge_moments,
    merge_shifted,
    moments_of,
    nonneg,
    recentre,
    reshift,
    shifted_moments,
    weighted_moments,
)
from jaxpr_surgery._src.norms import combine_norms, materialised_norms, sqrt0

SDS = jax.ShapeDtypeStruct

# One-pass centred sums against a fixed shift (`Shifted`, where they are not merged by
# Chan's rule): the most rounding is amplified against the two-pass (re-centring on the
# running mean once the examples to come would exceed it).
MAX_SHIFT_AMPLIFICATION = 32


def _zeros_of(avals):
    return jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), avals)


def acc_dtype_for(*dtypes):
    """The dtype statistics accumulate in: the widest of float32 and the floating
    ``dtypes`` (a bfloat16 leaf accumulates in float32)."""
    return jnp.result_type(jnp.float32, *[d for d in dtypes if jnp.issubdtype(d, jnp.floating)])


def lookup(table, r, default=None):
    """The entry of ``table`` (a dict keyed by reduction classes) for ``r``'s class or
    its nearest base class: rule tables of kernels and routes, by type, not by an
    ``isinstance`` chain."""
    for cls in type(r).__mro__:
        if cls in table:
            return table[cls]
    return default


def weighted_examples(w, X):
    """``sum_b w_b X_b`` of ``X [B, ...]`` (``w [B]``, in ``X``'s dtype): a product and a
    sum over the examples where XLA fuses them (`versions.FUSES_PRODUCT_SUMS`: jax 0.12's
    CPU compiles the contraction as a loop nest of its own, GPT-2 small's clipped mean
    3.8 s -> 3.0 s with the product), else a contraction; and a contraction under a
    batch split by device, around which XLA's partitioner placed a layer recompute's
    kept inputs better (the 2-D scan stack's clipped mean: 1.97x grad's collective
    bytes, 2.05x with the product)."""
    if versions.FUSES_PRODUCT_SUMS and cuts.split_count() == 1:
        return jnp.sum(_per_example(w, X) * X, axis=0)
    return jnp.tensordot(w.astype(X.dtype), X, axes=(0, 0))


def gather_over_axis(x, axis_name):
    """``[D, *x.shape]``: every device's ``x`` along the mapped axis ``axis_name``, in
    order, the same on every device: a psum of each ``x`` in its own slot of zeros (exact),
    replicated; inside ``shard_map`` an ``all_gather`` would stay varying over the axis."""
    D = jax.lax.psum(1, axis_name)  # static: the size of the axis
    full = jnp.zeros((D,) + tuple(jnp.shape(x)), jnp.result_type(x))
    full = jax.lax.dynamic_update_index_in_dim(full, x, jax.lax.axis_index(axis_name), 0)
    return jax.lax.psum(full, axis_name)


class Reduction(abc.ABC):
    """A reduction over examples of the per-example gradients of one parameter leaf.

    Subclasses implement `aval`, `from_examples` and `merge`; everything else has a
    default written in terms of those three, which a subclass overrides where it knows
    better (a psum across devices for a sum, a one-pass accumulator, a value that is
    not shaped like the leaf). The engine uses nothing else, so a new reduction is
    exact through tiles of examples, chunks of the batch, devices and views as soon as
    those three are right. Reductions that compare equal are computed once per call.

    Class attributes:
      per_example: the value is an array ``[B]`` with one entry per example (norms,
        dots): written in place by tile loops, concatenated across chunks, and kept by
        the device holding the example across devices.
      carries: a chunk's tile loops may start from the running accumulator of the
        chunks before it (`add_examples` with an accumulator) instead of merging their
        own value into it afterwards.
      feature_blocks: how the values of blocks of features of one example's gradient
        combine, where a tile loop cuts a large ``G`` into blocks (a `cuts.FeatureBlocks`, or
        its string): ``PLACE`` (the value is elementwise over the gradient's shape: each
        block's value goes to its place), ``ADD`` (per-example values that add over
        blocks, as squared norms), or None (never cut).
      shift_bounded: the running accumulator holds sums against a shift whose rounding
        the tile loop keeps within `MAX_SHIFT_AMPLIFICATION` by calling `recentre`.
      linear: the plain sum of the per-example gradients (kernels contract it).
      weighted_by_norm: not reduced from the examples alone: the engine weights each
        leaf's examples by `example_weights` of their norms over the leaf's group
        (clipping: every leaf, or the leaves under one bound of a tree of bounds).
      knows_total: the accumulator knows the plain sum of its examples (`total`).
      cache_blocks: the accumulator passes over each block of an example's gradient
        several times (centred moments): on CPU a call that has one cuts a large ``G``
        into cache-sized blocks (`tiling.feature_tile`; 6% faster per step than whole at
        d=768, T=256), but under a device split a ``G`` up to `tiling.SPLIT_TILE_BYTES` is
        whole unless ``blocks_under_split`` (many arrays per block: the kurtosis). Calls
        reading each block once take a long sequence's ``G`` whole (`tiling.cache_sized`).
      additive: the accumulator is one array shaped like the gradient, the sum over the
        examples of a term of each (``from_examples`` of one example is its term,
        ``add_examples`` adds it, ``finish`` leaves it): a tile loop of several such
        sums keeps them in one stacked array (`tiling.additive_loop`).
    """

    per_example: ClassVar[bool] = False
    carries: ClassVar[bool] = True
    feature_blocks: ClassVar[cuts.FeatureBlocks | str | None] = None
    shift_bounded: ClassVar[bool] = False
    linear: ClassVar[bool] = False
    weighted_by_norm: ClassVar[bool] = False
    knows_total: ClassVar[bool] = False
    additive: ClassVar[bool] = False
    cache_blocks: ClassVar[bool] = False
    blocks_under_split: ClassVar[bool] = False

    # -- the three a reduction must define ------------------------------------- #
    @abc.abstractmethod
    def aval(self, shape, dtype, B):
        """The value's shapes and dtypes (a pytree of ``jax.ShapeDtypeStruct``) for a
        leaf (or view) of ``shape`` and ``B`` examples, accumulated in ``dtype``."""

    @abc.abstractmethod
    def from_examples(self, G):
        """The value over the examples of ``G [b, *shape]``, their per-example
        gradients (materialised, in the accumulation dtype)."""

    @abc.abstractmethod
    def merge(self, a, na, b, nb):
        """The value over two disjoint sets of ``na`` and ``nb`` examples from their
        values ``a`` and ``b`` (for a per-example value: ``b``'s examples after ``a``'s).
        Counts may be traced."""

    # -- derived: running accumulators (tile loops, chunks) --------------------- #
    def empty(self, shape, dtype):
        """The accumulator over no examples (the running value before the first chunk):
        `accumulate` from it with ``n = 0`` gives the value added."""
        return _zeros_of(self.aval(shape, dtype, 0))

    def accumulate(self, acc, n, value, m):
        """The accumulator ``acc`` of ``n`` examples followed by ``m`` more whose value is
        ``value``."""
        return self.merge(acc, n, value, m)

    def add_examples(self, acc, n, G):
        """The accumulator of ``acc``'s ``n`` examples followed by those of ``G [b,
        *shape]`` (``acc`` None: none before). The tile loop's step."""
        v = self.from_examples(G)
        return v if acc is None else self.accumulate(acc, n, v, G.shape[0])

    def start_examples(self, acc, n, G):
        """`add_examples` for the first tile of a loop (``acc``: a carried accumulator,
        whose ``n`` may be a traced 0 for the first chunk)."""
        return self.add_examples(acc, n, G)

    def finish(self, acc, n):
        """The value of the accumulator ``acc`` of ``n`` examples."""
        del n
        return acc

    def recentre(self, acc, n):
        """The same accumulator with a fresh shift (`shift_bounded` reductions)."""
        del n
        return acc

    def total(self, acc, n):
        """The plain sum of the ``n`` examples the accumulator holds, where it knows it
        (a centred accumulator does: a plain sum riding along costs nothing), else
        None."""
        del acc, n
        return None

    def block(self, cut):
        """This reduction restricted to the block ``cut`` (cuts.py) of the features of
        one example's gradient (`feature_blocks`); reductions holding arrays shaped like
        the gradient cut them (`cuts.take`)."""
        del cut
        return self

    # -- example weights (`Weighted`) ------------------------------------------ #
    def from_weighted(self, G, w):
        """The value over the examples of ``G [b, *shape]`` weighted by ``w [b]`` (``w_b
        >= 0``, frequency weights: a weight 2 counts the example twice; ``G_b`` is zero
        where ``w_b`` is). Needed for ``example_weights`` by every reduction that is not
        per example; the counts its `merge` then receives are sums of weights."""
        del G, w
        raise NotImplementedError(
            f"example_weights: the reduction {self.describe()} has no weighted form. "
            "Define from_weighted(G, w) on it (the value over the examples of G weighted "
            "by w, whose merges then receive sums of weights as counts), or call without "
            "example_weights."
        )

    #: ``d`` where the value is homogeneous of degree ``d`` in the examples' gradients
    #: (the value over ``s_b g_b`` is the one over ``g_b`` weighted by ``s_b^d``, for
    #: ``s_b >= 0``): example weights then scale the cotangents by ``w_b^(1/d)`` and
    #: the kernels' fast rules serve (`Weighted.scaled`). None: not homogeneous.
    weight_degree: ClassVar[int | None] = None

    def scaled(self):
        """``(inner, s [B])`` where this reduction's value is ``inner``'s over the
        examples' gradients scaled by ``s_b``, else None (`Weighted`)."""
        return None

    def weighted_parts(self):
        """``(inner, w [B])`` where this reduction is ``inner`` over the examples weighted
        by ``w`` (its value ``inner.from_weighted(G, w)``), else None (`Weighted`): the
        key of the kernels' weighted rules (`Kernel.FAST_WEIGHTED`)."""
        return None

    def add_weighted(self, acc, W, G, w):
        """`add_examples` with weights: ``acc`` holds examples of total weight ``W``."""
        v = self.from_weighted(G, w)
        return v if acc is None else self.accumulate(acc, W, v, jnp.sum(w))

    def start_weighted(self, acc, W, G, w):
        """`start_examples` with weights."""
        return self.add_weighted(acc, W, G, w)

    # -- derived: values -------------------------------------------------------- #
    def zeros(self, shape, dtype, B):
        """The value over ``B`` examples whose gradient is zero (a leaf the loss does
        not use, the part of a leaf a sliced view leaves out): ``B`` merges of one
        zero example's value, by doubling."""
        if not B:
            return self.empty(shape, dtype)
        one = self.from_examples(jnp.zeros((1,) + tuple(shape), dtype))
        out, n_out, cur, n_cur, k = None, 0, one, 1, int(B)
        while k:
            if k & 1:
                out = cur if out is None else self.merge(out, n_out, cur, n_cur)
                n_out += n_cur
            k >>= 1
            if k:
                cur, n_cur = self.merge(cur, n_cur, cur, n_cur), 2 * n_cur
        return out

    def combined_share(self, value, n_local, axis_name, parts):
        """``value`` (one part's, of ``n_local`` examples, finished) combined at once over
        the ``parts`` parts of a batch split by device along ``axis_name`` (devices.py),
        as one part's share: a value the same on every part whose union over the parts
        (`merge`, `combine_axis`) is the whole batch's. Tile and block loops keep then
        one accumulator for every part instead of one per part (XLA holds each device's
        parts: under FSDP a whole leaf per device where grad holds its shard), and XLA
        reduces each block as it is finished. (Exact where ``parts`` is a power of
        two; otherwise to the last bit.) None: combined at the end only (the default)."""
        del value, n_local, axis_name, parts
        return None

    def combine_copies(self, value, parts):
        """The whole batch's value where all ``parts`` parts of a batch split by device
        hold this ``value`` (a share), with no collective (`combine_axis` reads every
        field: XLA kept a scan's stacked means). None: `combine_axis` (the default)."""
        del value, parts
        return None

    def combine_axis(self, value, n_local, N, axis_name):
        """Every device's value over the whole batch split along ``axis_name`` (each
        device holds ``n_local`` of its ``N`` examples): per-example values stay with
        their device; others merge every device's value in the devices' order."""
        del N
        if self.per_example:
            return value
        vals = jax.tree.map(lambda x: gather_over_axis(x, axis_name), value)
        counts = gather_over_axis(jnp.asarray(n_local), axis_name)
        D = counts.shape[0]
        out, n = jax.tree.map(lambda x: x[0], vals), counts[0]
        for d in range(1, D):
            out = self.merge(out, n, jax.tree.map(lambda x, d=d: x[d], vals), counts[d])
            n = n + counts[d]
        return out

    def to_leaf(self, value, site, B):
        """A site's value (in its view of the leaf, stacked over the scans around it) in
        the leaf's layout: each array through the view's chain, a slice's missing part
        taking the value of a zero gradient (`zeros` of one element)."""
        fill = self._fill(value, B) if getattr(site, "pads", False) else None
        if fill is None:
            return jax.tree.map(lambda x: views.to_leaf(x, site), value)
        return jax.tree.map(lambda x, f: views.to_leaf(x, site, f), value, fill)

    def _fill(self, value, B):
        z = self.zeros((1,), jax.tree.leaves(value)[0].dtype, B)
        return jax.tree.map(lambda x: x.reshape(-1)[0], z)

    def from_leaf(self, value, site):
        """A leaf-layout value (a running accumulator carried into a site) in the site's
        view (undoes `to_leaf`)."""
        return jax.tree.map(lambda x: views.from_leaf(x, site), value)

    def direct_ok(self, site):
        """Whether a site alone can give this reduction of its leaf inside the backward
        pass (else the engine works from the site's ingredients afterwards)."""
        del site
        return True

    def per_leaf(self, flatten, leaf_avals):
        """The reduction to compute for each differentiated leaf, where it depends on
        the leaf (a reference gradient's part: `dots.DotWith`, a clip bound's group:
        `ClippedSum`), else None (itself on every leaf). ``flatten(tree)``: a tree shaped
        like the differentiated arguments as a list per leaf; ``flatten.prefix(tree,
        name)``: for a tree that is a prefix of theirs (or a single value), per leaf
        ``(k, path, value)``, the index, path and value of the entry above the leaf
        (a ``ValueError`` naming ``name`` and the path where the tree does not fit)."""
        del flatten, leaf_avals
        return None

    def combine_shards(self, value, axes):
        """The value of a leaf sharded over the mesh ``axes`` (tensor parallelism inside
        ``shard_map``) from each shard's value over its part of every example's
        gradient: elementwise values are exact per shard (the default); values of the
        whole gradient (norms, inner products) combine over the shards."""
        del axes
        return value

    def clash(self, other):
        """A message when ``other``, equal to this reduction (so computed once), would
        get a different value, else None."""
        del other
        return None

    def describe(self):
        """A short name for reports."""
        return type(self).__name__


class ElementwiseReduction(Reduction):
    """A reduction whose value is elementwise over the gradient's shape (an array, or a
    tuple of arrays, shaped like the leaf): sums of a function, centred moments."""

    feature_blocks = cuts.FeatureBlocks.PLACE

    def aval(self, shape, dtype, B):
        return SDS(tuple(shape), dtype)


def _per_example(w, G):
    """Weights ``w [b]`` broadcast against ``G [b, ...]`` in its dtype."""
    return w.astype(G.dtype).reshape((-1,) + (1,) * (G.ndim - 1))


def _is_moments(x):
    return isinstance(x, (Moments, Shifted))


def _definer(cls, name):
    return next(c for c in cls.__mro__ if name in vars(c))


def combined_share(r, value, n_local, axis_name, parts):
    """``r.combined_share(...)`` where ``r``'s class defines it along with its
    `combine_axis` (a subclass that overrides `combine_axis` alone is combined at the
    end only: its parent's share would not be its combination's)."""
    cls = type(r)
    if not issubclass(_definer(cls, "combined_share"), _definer(cls, "combine_axis")):
        return None
    return r.combined_share(value, n_local, axis_name, parts)


def is_additive(r):
    """Whether ``r`` is `Reduction.additive`, as the class that says so defines it: a
    subclass that overrides how the examples are summed (``from_examples``, ``merge``,
    ``accumulate``, ``add_examples``, ``start_examples``, ``finish``) without saying so
    again is not."""
    cls = type(r)
    if not cls.additive:
        return False
    says = _definer(cls, "additive")
    return all(issubclass(says, _definer(cls, m)) for m in (
        "from_examples", "merge", "accumulate", "add_examples", "start_examples", "finish"))


def combined_copies(r, value, parts):
    """``r.combine_copies(...)``, guarded as `combined_share`."""
    cls = type(r)
    if not issubclass(_definer(cls, "combine_copies"), _definer(cls, "combine_axis")):
        return None
    return r.combine_copies(value, parts)


def centred_copies(value, parts):
    """`Reduction.combine_copies` of a centred value (as `centred_share`): the mean, the
    sums about it times ``parts`` (copies of one mean: no term between them)."""
    if ew.is_open():
        return None
    return value._replace(**{f: getattr(value, f) * parts for f in value._fields[1:]})


def centred_share(r, value, n_local, axis_name, parts):
    """`Reduction.combined_share` of a centred value (a NamedTuple: the mean, then sums
    about it, as `Moments`): the whole batch's (``r.combine_axis``), its sums divided among
    the parts (their means are equal: no term between them). None within derivatives in
    the example weights (a part of weight 0 holds raw sums: combined at the end)."""
    if ew.is_open():
        return None
    N = jax.lax.psum(jnp.asarray(n_local, jnp.result_type(value.mean)), axis_name)
    c = r.combine_axis(value, n_local, N, axis_name)
    return c._replace(**{f: getattr(c, f) / parts for f in c._fields[1:]})


# --------------------------------------------------------------------------- #
# The built-in reductions
# --------------------------------------------------------------------------- #
@dataclasses.dataclass(frozen=True, eq=False)
class PhiSum(ElementwiseReduction):
    """``sum_b phi(g_b)`` elementwise, per leaf (``phi=None`` is the identity).

    Attributes:
      phi: elementwise function of an array, or ``None`` for the plain sum.
      multiplicative: declares ``phi(a * b) == phi(a) * phi(b)`` (square, sign,
        abs, powers), which lets rank-one layers use ``phi(x)^T phi(dy)``.
      name: used for equality and in reports; two ``PhiSum`` with the same
        ``name`` and ``multiplicative`` are computed once. Giving one name to two
        different functions in one request raises a ``ValueError``.
    """

    phi: Callable[[jax.Array], jax.Array] | None = None
    multiplicative: bool = False
    name: str | None = None
    _builtin: bool = dataclasses.field(default=False, repr=False)
    # phi(s g) = s^d phi(g) for s >= 0 (`Reduction.weight_degree`; None: unknown)
    _degree: int | None = dataclasses.field(default=None, repr=False)

    additive: ClassVar[bool] = True

    def _key(self):
        # A user's name never aliases a built-in reduction of the same name.
        ident = (self._builtin, self.name) if self.name is not None else self.phi
        return ("phisum", ident, self.multiplicative)

    def __eq__(self, other):
        return isinstance(other, PhiSum) and self._key() == other._key()

    def __hash__(self):
        return hash(self._key())

    @property
    def linear(self):
        return self.phi is None

    @property
    def weight_degree(self):
        return 1 if self.phi is None else (self._degree or None)

    def apply(self, g):
        return g if self.phi is None else self.phi(g)

    def from_examples(self, G):
        return jnp.sum(self.apply(G), axis=0)

    def from_weighted(self, G, w):
        return weighted_examples(w, self.apply(G))

    def merge(self, a, na, b, nb):
        return a + b

    def zeros(self, shape, dtype, B):
        return B * self.apply(jnp.zeros(tuple(shape), dtype))

    def combined_share(self, value, n_local, axis_name, parts):
        del n_local
        return jax.lax.psum(value, axis_name) / parts

    def combine_axis(self, value, n_local, N, axis_name):
        return jax.lax.psum(value, axis_name)

    def clash(self, other):
        if isinstance(other, PhiSum) and not same_function(self.phi, other.phi):
            return (f"both name their elementwise function name={self.name!r}, but the "
                    f"functions differ ({function_name(self.phi)} and "
                    f"{function_name(other.phi)})")
        return None

    def describe(self):
        return self.name or function_name(self.phi)


@dataclasses.dataclass(frozen=True)
class Centered(ElementwiseReduction):
    """Mean and centred sum of squares ``(mean_b g_b, sum_b (g_b - mean)^2)``, a
    `Moments`; run as `Shifted` sums against the running mean (``s1 = 0``), each tile's
    exact two-pass moments merged in by Chan's rule (`chan_update`): one pass over the
    examples and no cancellation that grows with the batch. (Against a fixed shift,
    the first tile's mean, the rounding grew with every example after it: 4x float32's
    error at 32 examples.) Within derivatives in the example weights
    (`example_weights.is_open`) the sums stay against a shift, so that parts of weight
    0 keep their raw sums (`reshift`), re-centred in groups (`shift_bounded`)."""

    knows_total: ClassVar[bool] = True
    cache_blocks: ClassVar[bool] = True  # (mean and m2: a Chan merge per block)

    @property
    def shift_bounded(self):
        return ew.is_open()

    def aval(self, shape, dtype, B):
        v = SDS(tuple(shape), dtype)
        return Moments(v, v)

    def empty(self, shape, dtype):
        z = jnp.zeros(tuple(shape), dtype)
        return Shifted(z, z if ew.is_open() else None, z)  # (about the mean: no s1)

    def from_examples(self, G):
        return moments_of(G)

    @fp.traced_once
    def merge(self, a, na, b, nb):
        return merge_moments(a, na, b, nb)

    @fp.traced_once
    def accumulate(self, acc, n, value, m):
        if ew.is_open():
            return merge_shifted(acc, n, value, m)
        return about_the_mean(chan_update(acc, n, value.mean, value.m2, m))

    def start_examples(self, acc, n, G):
        """The first tile of a loop (``acc``: a carried accumulator, or None)."""
        if not ew.is_open():
            return self._chan(acc, n, G)
        # sums against the tile's mean (its exact two-pass moments), or against a
        # carried shift once there are examples before
        mu = jnp.mean(G, axis=0) if G.shape[0] > 1 else G[0]
        if acc is None:
            return self._add(Shifted(mu, None, None), G)
        return self._add(acc._replace(shift=jnp.where(jnp.asarray(n) > 0, acc.shift, mu)), G)

    def add_examples(self, acc, n, G):
        if not ew.is_open():
            return self._chan(acc, n, G)
        if acc is None:
            return self.start_examples(None, 0, G)
        return self._add(acc, G)

    def from_weighted(self, G, w):
        return weighted_moments(G, _per_example(w, G))[1]

    def start_weighted(self, acc, W, G, w):
        wb = _per_example(w, G)
        if not ew.is_open():
            return self._chan(acc, W, G, wb)
        Wt = jnp.sum(wb, axis=0)
        mu = jnp.sum(wb * G, axis=0) / jnp.where(Wt > 0, Wt, 1)
        if acc is None:
            return self._add(Shifted(mu, None, None), G, wb)
        K = jnp.where(jnp.asarray(W) > 0, acc.shift, mu)
        return self._add(reshift(acc, W, K), G, wb)

    def add_weighted(self, acc, W, G, w):
        if not ew.is_open():
            return self._chan(acc, W, G, _per_example(w, G))
        if acc is None:
            return self.start_weighted(None, W, G, w)
        return self._add(acc, G, _per_example(w, G))

    @staticmethod
    def _chan(acc, n, G, wb=None):
        """``acc`` (None: no examples before; else of ``n`` examples, or of total weight
        ``n`` with weights ``wb``) followed by the examples of ``G``: the tile's exact
        two-pass moments merged in by Chan's rule, the sums against the new mean."""
        nb, m = (G.shape[0], moments_of(G)) if wb is None else weighted_moments(G, wb)
        if acc is None:
            return about_the_mean(m)
        return about_the_mean(chan_update(acc, n, m.mean, m.m2, nb))

    @staticmethod
    def _add(acc, G, wb=None):
        d = G - acc.shift
        if wb is None:
            s1, s2 = jnp.sum(d, axis=0), jnp.sum(jnp.square(d), axis=0)
        else:
            s1, s2 = jnp.sum(wb * d, axis=0), jnp.sum(wb * jnp.square(d), axis=0)
        if acc.s2 is None:  # (no sums yet: the tile's shift only)
            return Shifted(acc.shift, s1, s2)
        return Shifted(acc.shift, acc.s1 + s1, acc.s2 + s2)

    @fp.traced_once
    def finish(self, acc, n):
        if acc.s1 is None:  # (about the mean: `_chan`)
            return Moments(acc.shift, nonneg(acc.s2))
        return shifted_moments(acc, n)

    @fp.traced_once
    def recentre(self, acc, n):
        if acc.s1 is None:  # (about the mean already)
            return acc
        return recentre(acc, n)

    def total(self, acc, n):
        if acc.s1 is None:  # (about the mean)
            return jnp.asarray(n, acc.shift.dtype) * acc.shift
        return jnp.asarray(n, acc.shift.dtype) * acc.shift + acc.s1

    def combine_axis(self, value, n_local, N, axis_name, totals=None):
        """(``totals``: a `Totals`, for a leaf gathered in shard_map, `gathers.combine`.)"""
        t = totals or Totals.psum(axis_name)
        n = jnp.asarray(n_local, value.mean.dtype)
        opened = ew.is_open()  # (a device of weight 0: raw sums, `reshift`)
        p = jnp.where(n > 0, n * value.mean, value.mean) if opened else value.mean * n
        kept = t.sums(p) / N
        mean = t.spread(kept)
        m2 = value.m2 + n * jnp.square(value.mean - mean)
        if opened:
            m2 = jnp.where(n > 0, m2, value.m2 - 2 * mean * p + jnp.square(mean) * n)
        return Moments(kept, t.sums(m2))

    def combined_share(self, value, n_local, axis_name, parts):
        return centred_share(self, value, n_local, axis_name, parts)

    def combine_copies(self, value, parts):
        return centred_copies(value, parts)


@dataclasses.dataclass(frozen=True, eq=False)
class CenteredAbout(ElementwiseReduction):
    """`Centered` moments against a known exact mean (the two-pass form): the value is
    ``Moments(mean, sum_b (g_b - mean)^2)``. Engine-internal (dense.py's exact path)."""

    mean: Any
    carries: ClassVar[bool] = False

    def aval(self, shape, dtype, B):
        v = SDS(tuple(shape), dtype)
        return Moments(v, v)

    def from_examples(self, G):
        return Moments(self.mean, jnp.sum(jnp.square(G - self.mean), axis=0))

    def from_weighted(self, G, w):  # (``mean``: the weighted mean)
        return Moments(self.mean, jnp.sum(_per_example(w, G) * jnp.square(G - self.mean), axis=0))

    def merge(self, a, na, b, nb):
        return Moments(a.mean, a.m2 + b.m2)

    def block(self, cut):
        return CenteredAbout(cuts.take(cut, self.mean, cuts.axis_of(cut)))


class ExampleNorms(Reduction):
    """Per-example values ``[B]`` of a leaf's norm (`SqNorms`, `Norms`): one entry per
    example, concatenated across chunks, local across devices; the layers of a scan
    over stacked layers are one leaf."""

    per_example: ClassVar[bool] = True
    carries: ClassVar[bool] = False

    def aval(self, shape, dtype, B):
        return SDS((B,), dtype)

    def merge(self, a, na, b, nb):
        return jnp.concatenate([a, b], axis=0)

    def zeros(self, shape, dtype, B):
        return jnp.zeros((B,), dtype)

    def from_weighted(self, G, w):  # per-example values: the weights do not enter
        del w
        return self.from_examples(G)


@dataclasses.dataclass(frozen=True)
class SqNorms(ExampleNorms):
    """Per-example squared norm ``||g_b||^2`` of each leaf, an array ``[B]``."""

    feature_blocks: ClassVar[cuts.FeatureBlocks | None] = cuts.FeatureBlocks.ADD

    def from_examples(self, G):
        return jnp.sum(jnp.square(G), axis=tuple(range(1, G.ndim)))

    def to_leaf(self, value, site, B):  # the layers of enclosing scans: one leaf
        return value.reshape((-1, B)).sum(0) if site.depth else value

    def combine_shards(self, value, axes):
        return jax.lax.psum(value, axes)


@dataclasses.dataclass(frozen=True)
class Norms(ExampleNorms):
    """Per-example norm ``||g_b||`` of each leaf, an array ``[B]``.

    The square roots of `SqNorms`, except where a square overflows (a float32 gradient
    whose norm exceeds ``2^64`` has the squared norm ``inf``): there the norm of the
    example scaled by a power of two, scaled back, so the value is finite wherever the
    norm itself is representable. Norms of several leaves combine with `combine_norms`.
    """

    def from_examples(self, G):
        return materialised_norms(G)

    def to_leaf(self, value, site, B):
        return combine_norms(value.reshape((-1, B))) if site.depth else value

    def combine_shards(self, value, axes):
        """``sqrt(psum n^2)`` scaled by the largest part (no overflow where the squares
        would)."""
        m = jax.lax.pmax(jax.lax.stop_gradient(value), axes)
        ms = jnp.where(m > 0, m, 1)
        return ms * sqrt0(jax.lax.psum(jnp.square(value / ms), axes))


SQUARE = PhiSum(jnp.square, multiplicative=True, name="square", _builtin=True, _degree=2)
SIGN = PhiSum(jnp.sign, multiplicative=True, name="sign", _builtin=True)
ABS = PhiSum(jnp.abs, multiplicative=True, name="abs", _builtin=True, _degree=1)
SUM = PhiSum(None, multiplicative=True, name="identity", _builtin=True, _degree=1)


