"""A call's arguments as the entry points read them: which are parameters and which the
batch (`argnums`, `batch_argnums`), the leaves differentiated, the statistics requested
flattened (`Options`, `Prepared`, `LeafLayout`), the batch size and its checks.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxpr_surgery._src import compat, custom_ops, devices, meshes, prefix
from jaxpr_surgery._src import stats as S


# --------------------------------------------------------------------------- #
# Argument handling
# --------------------------------------------------------------------------- #
def norm_nums(nums, name, nargs):
    if isinstance(nums, (int, np.integer)):
        nums = (int(nums),)
    elif isinstance(nums, Sequence) and all(isinstance(n, (int, np.integer)) for n in nums):
        nums = tuple(int(n) for n in nums)
    else:
        raise TypeError(f"{name} must be an int or a tuple of ints, got {nums!r}.")
    if not nums:
        raise ValueError(f"{name} must name at least one argument, got an empty tuple.")
    out = []
    for n in nums:
        if not -nargs <= n < nargs:
            raise ValueError(
                f"{name}={n} is out of range: the function was called with {nargs} positional "
                f"argument(s)."
            )
        out.append(n % nargs)
    if len(set(out)) != len(out):
        raise ValueError(f"{name}={nums!r} names the same argument twice.")
    return tuple(out)


def is_array(x):
    return isinstance(x, (jax.Array, np.ndarray, np.generic)) or isinstance(x, jax.core.Tracer)


class _LeafKind(enum.Enum):
    """What the entry points do with a leaf of the differentiated argument(s)."""

    DIFF = "differentiated"  # a float array: its statistics
    SKIPPED = "skipped"  # an integer or boolean array (or float0): None, noted
    STATIC = "static"  # not an array: None, as under ``eqx.filter_grad``


def _diff_leaf_kind(x, path, name):
    """How a leaf of the differentiated argument(s) is treated: a float array is
    differentiated, another array (integer, bool, a PRNG key, float0) is skipped, and
    anything else is static, as under ``eqx.filter_grad``. Complex arrays raise."""
    if not is_array(x):
        return _LeafKind.STATIC
    dtype = x.dtype
    if jnp.issubdtype(dtype, jnp.complexfloating):
        raise NotImplementedError(
            f"{name}: parameter leaf {path} has the complex dtype {dtype}; per-example "
            "statistics of complex parameters are not supported (E[g^2], signs and norms of "
            "a complex gradient have no single meaning). Store it as two float leaves, its "
            "real and imaginary parts, and build the complex value inside the loss."
        )
    return _LeafKind.DIFF if jnp.issubdtype(dtype, jnp.floating) else _LeafKind.SKIPPED


def _path_str(path):
    return jax.tree_util.keystr(path) or "<root>"


@dataclasses.dataclass(frozen=True)
class Options:
    argnums: tuple
    batch_argnums: tuple
    keep_batch_dim: bool
    has_aux: bool
    chunk_size: int | str | None
    strict: bool
    axis_name: Any
    memory_budget_bytes: int | None = None
    check: bool = True  # prove from the batch loss's jaxpr that the examples do not interact


def flatten_stats(stat):
    """(statistics, their treedef, each one's reductions, the unique reductions of all).

    Equal reductions are computed once; a user's `stats.PhiSum` is equal to another by
    its ``name``, so two names given to different functions raise here.
    """
    flat, treedef = jax.tree_util.tree_flatten_with_path(
        stat,
        is_leaf=lambda x: (
            S.is_statistic(x) or (hasattr(x, "reductions") and hasattr(x, "finalize"))
        ),
    )
    if not flat:
        raise TypeError("stat: expected a statistic or a pytree of statistics, got an empty tree.")
    leaves = [s for _, s in flat]
    reqs = [S.validate(s) for s in leaves]
    unique, owner = [], []
    for (path, s), req in zip(flat, reqs):
        for r in req.values():
            if r not in unique:
                unique.append(r)
                owner.append((path, s, r))
                continue
            opath, os_, o = owner[unique.index(r)]
            clash = o.clash(r)
            if clash is not None:
                where = lambda p, st: f"{_path_str(p)} ({st!r})"  # noqa: E731
                raise ValueError(
                    f"stat: the statistics at {where(opath, os_)} and {where(path, s)} "
                    f"{clash}. Reductions that compare equal are computed once, so one "
                    "statistic would silently get the other's values. "
                    "Give each function a different name (or name=None)."
                )
    return leaves, treedef, reqs, unique


def _none_for_skipped(tree, diff):
    """``tree`` (a prefix of the differentiated arguments' structure) with None for the
    dict keys of ``diff`` (their tree, True at the differentiated leaves) that it lacks
    and under which no leaf is differentiated: a skipped leaf (an integer buffer, a PRNG
    key) or static one needs no entry (no clip bound). Other mismatches are left to
    `prefix.leaf_groups` to name."""
    if type(tree) is dict and type(diff) is dict and set(tree) <= set(diff):
        out = {k: _none_for_skipped(v, diff[k]) for k, v in tree.items()}
        out.update({k: None for k, d in diff.items() if k not in tree and not any(
            jax.tree.leaves(d))})
        return out
    if type(tree) in (list, tuple) and type(tree) is type(diff) and len(tree) == len(diff):
        return type(tree)(_none_for_skipped(t, d) for t, d in zip(tree, diff))
    return tree


class _LeafFlatten:
    """Trees given per differentiated leaf, as the reductions bound per leaf read them
    (`Reduction.per_leaf`): ``flatten(tree)`` for a tree shaped like the differentiated
    arguments, ``flatten.prefix(tree, what, entry)`` for a prefix of their structure."""

    def __init__(self, prep):
        self._prep = prep

    def __call__(self, tree):
        return self._prep.flatten_like_diff(tree)

    def prefix(self, tree, what, entry="entry"):
        return self._prep.prefix_like_diff(tree, what, entry)


def _batch_size(bflat, name) -> int:
    """The examples of the batch's leaves ``[(path, leaf)]``: each an array with the same
    leading size >= 1, else a clear error."""
    sizes = {}
    for p, x in bflat:
        if not is_array(x):
            raise TypeError(
                f"{name}: batch leaf {_path_str(p)} is a {type(x).__name__}; every leaf of the "
                "batch argument(s) must be an array with examples on axis 0."
            )
        if np.ndim(x) == 0:
            raise ValueError(
                f"{name}: batch leaf {_path_str(p)} is a scalar; every batch leaf needs a "
                "leading example axis."
            )
        sizes[_path_str(p)] = int(np.shape(x)[0])
    if len(set(sizes.values())) > 1:
        raise ValueError(
            f"{name}: batch leaves have different leading sizes {sizes}; every leaf of the "
            "batch must hold the same number of examples on axis 0."
        )
    B = next(iter(sizes.values()))
    if B == 0:
        raise ValueError(f"{name}: the batch is empty (0 examples); statistics need B >= 1.")
    return B


class Prepared:
    """Everything derived from the call's arguments, shared by the entry points."""

    def __init__(self, fn, args, opts: Options, name: str, traces=None):
        nargs = len(args)
        # (key -> (closed, out_tree, constraints) of `trace`; the parts of a batch split
        # by device share their whole batch's, api.py)
        self.traces = {} if traces is None else traces
        self.argnums = norm_nums(opts.argnums, "argnums", nargs)
        self.batch_argnums = norm_nums(opts.batch_argnums, "batch_argnums", nargs)
        overlap = set(self.argnums) & set(self.batch_argnums)
        if overlap:
            raise ValueError(
                f"{name}: argnums={opts.argnums!r} and batch_argnums={opts.batch_argnums!r} "
                f"overlap on argument {sorted(overlap)}: an argument is either differentiated "
                "(parameters) or split into examples (data), not both."
            )
        self.single = isinstance(opts.argnums, (int, np.integer))
        diff = args[self.argnums[0]] if self.single else tuple(args[i] for i in self.argnums)
        flat, self.diff_tree = jax.tree_util.tree_flatten_with_path(diff)
        # Non-array leaves (Python numbers, Equinox modules' flags and dropout rates,
        # activation functions, strings, ...) are static, and non-float arrays (an
        # Equinox buffer, NNX `Rngs`' keys and counts) are inputs of the jaxpr beside
        # the other arguments' arrays: neither is differentiated, as under
        # eqx.filter_grad, and every statistic holds None for them.
        kinds = [_diff_leaf_kind(x, _path_str(p), name) for p, x in flat]
        self.diff_is_arr = [k is _LeafKind.DIFF for k in kinds]
        self.diff_static = [x if k is _LeafKind.STATIC else None
                            for k, (_, x) in zip(kinds, flat)]
        self.diff_paths = [_path_str(p) for (p, _), a in zip(flat, self.diff_is_arr) if a]
        self.diff_leaves = [jnp.asarray(x) for (_, x), a in zip(flat, self.diff_is_arr) if a]
        # (index among the flat leaves, path, dtype) of every skipped non-float array
        self.skipped = [
            (i, _path_str(p), "float0" if x.dtype == jax.dtypes.float0 else str(x.dtype))
            for i, ((p, x), k) in enumerate(zip(flat, kinds))
            if k is _LeafKind.SKIPPED
        ]
        skipped_leaves = [jnp.asarray(x) for (_, x), k in zip(flat, kinds)
                          if k is _LeafKind.SKIPPED]
        if not self.diff_leaves:
            raise ValueError(
                f"{name}: the differentiated argument(s) argnums={opts.argnums!r} hold no "
                "floating-point arrays"
                + (
                    f" (non-float leaves are skipped: {', '.join(p for _, p, _ in self.skipped)})"
                    if self.skipped
                    else ""
                )
                + "; pass the parameters to differentiate in argnums."
            )

        batch = tuple(args[i] for i in self.batch_argnums)
        bflat, self.batch_tree = jax.tree_util.tree_flatten_with_path(batch)
        if not bflat:
            raise ValueError(
                f"{name}: the batch argument(s) batch_argnums={self.batch_argnums} hold no arrays."
            )
        self.B = _batch_size(bflat, name)
        self.ex_leaves = [jnp.asarray(x) for _, x in bflat]
        # mesh axes in Explicit mode (sharding in types): computed in Auto mode
        self.explicit = meshes.explicit_mesh_axes([*self.ex_leaves, *self.diff_leaves])

        # other arguments: arrays become jaxpr inputs, the rest stay static
        self.other_idx = [i for i in range(nargs) if i not in self.argnums + self.batch_argnums]
        other = tuple(args[i] for i in self.other_idx)
        oleaves, self.other_tree = jax.tree.flatten(other)
        self.other_is_arr = [is_array(x) for x in oleaves]
        self.other_static = [None if a else x for a, x in zip(self.other_is_arr, oleaves)]
        self.other_leaves = [x for a, x in zip(self.other_is_arr, oleaves) if a]
        # the skipped leaves of the differentiated argument(s) ride after them
        self.n_other = len(self.other_leaves)
        self.other_leaves += skipped_leaves
        self.fn, self.args_n, self.opts, self.name = fn, nargs, opts, name

    def flatten_like_diff(self, tree):
        """A pytree with the structure of the differentiated arguments as a list over their
        array leaves (None where ``tree`` has None)."""
        if not self.single and isinstance(tree, list):
            tree = tuple(tree)  # several argnums: a tuple of their trees
        full = self.diff_tree.flatten_up_to(tree)
        return [x for x, a in zip(full, self.diff_is_arr) if a]

    def layout(self) -> LeafLayout:
        """The static layout of the differentiated argument(s) (`LeafLayout`)."""
        return LeafLayout(
            self.diff_tree,
            tuple(self.diff_is_arr),
            tuple(tuple(jnp.shape(x)) for x in self.diff_leaves),
            tuple(jnp.dtype(x.dtype) for x in self.diff_leaves),
            tuple(self.diff_paths),
        )

    def prefix_like_diff(self, tree, what, entry="entry"):
        """For a tree that is a prefix of the differentiated arguments' structure (one
        value per group of leaves; a single value: one group of all), per array leaf
        ``(k, path, value)`` of the entry above it (`prefix.leaf_groups`)."""
        if not self.single and isinstance(tree, list):
            tree = tuple(tree)  # several argnums: a tuple of their trees
        tree = _none_for_skipped(tree, jax.tree.unflatten(self.diff_tree, self.diff_is_arr))
        entries, groups = prefix.leaf_groups(tree, self.diff_tree, f"{self.name}: {what}", entry)
        return [(k, *entries[k]) for k, a in zip(groups, self.diff_is_arr) if a]

    def leaf_flatten(self):
        """The ``flatten`` of `Reduction.per_leaf`: `flatten_like_diff`, with
        `prefix_like_diff` as its ``prefix``."""
        return _LeafFlatten(self)

    @property
    def data_axes(self):
        """The shard_map axes the examples vary over (empty outside typed shard_map)."""
        return frozenset().union(*[compat.vma_of(x) for x in self.ex_leaves])

    def unflatten_diff(self, leaves, static=None, *, keep_static=False):
        """A tree like the differentiated argument(s) from one value per array leaf;
        static (non-array) leaves get ``static``, or keep their value with ``keep_static``."""
        it = iter(leaves)
        full = [
            next(it) if a else (s if keep_static else static)
            for a, s in zip(self.diff_is_arr, self.diff_static)
        ]
        return jax.tree.unflatten(self.diff_tree, full)

    def rebuild(self, diff_leaves, batch_leaves, other_leaves, *, one_example):
        other_leaves, skipped = other_leaves[: self.n_other], other_leaves[self.n_other :]
        at, sk, it = {i for i, _, _ in self.skipped}, iter(skipped), iter(diff_leaves)
        full = [
            next(sk) if i in at else next(it) if a else s
            for i, (a, s) in enumerate(zip(self.diff_is_arr, self.diff_static))
        ]
        diff = jax.tree.unflatten(self.diff_tree, full)
        diff = (diff,) if self.single else diff
        if one_example and self.opts.keep_batch_dim:
            batch_leaves = [x[None] for x in batch_leaves]
        batch = jax.tree.unflatten(self.batch_tree, batch_leaves)
        it = iter(other_leaves)
        oleaves = [next(it) if a else s for a, s in zip(self.other_is_arr, self.other_static)]
        other = jax.tree.unflatten(self.other_tree, oleaves)
        args = [None] * self.args_n
        for k, i in enumerate(self.argnums):
            args[i] = diff[k]
        for k, i in enumerate(self.batch_argnums):
            args[i] = batch[k]
        for k, i in enumerate(self.other_idx):
            args[i] = other[k]
        return args

    def split_out(self, out):
        if self.opts.has_aux:
            if not (isinstance(out, tuple) and len(out) == 2):
                raise TypeError(
                    f"{self.name}: has_aux=True requires fn to return a pair (loss, aux), got "
                    f"{type(out).__name__}."
                )
            return out
        return out, None

    def per_example_fn(self):
        def pe(diff_leaves, ex_leaves, other_leaves):
            args = self.rebuild(diff_leaves, ex_leaves, other_leaves, one_example=True)
            loss, aux = self.split_out(self.fn(*args))
            return (loss, aux)

        return pe

    def trace(self, substitute=True, varying=frozenset()):
        """Per-example jaxpr, traced under vmap over the real batch (keeps sharding/vma);
        with ``substitute``, calls of registered custom ops replaced by their references
        (`custom_ops.substitute`); sharding constraints on the example's unit axis
        released (`devices.release_unit_constraints`: what they named,
        `batch_constraints`). Traced once per ``(substitute, varying)``: ``traces``
        (shared with the parts of a batch split by device, whose examples trace alike).
        ``varying``: the differentiated leaves cast to vary over `data_axes` before ``fn``
        reads them (`api.replicated_leaves`: inside typed shard_map, each device's
        per-example gradients of a replicated leaf are its own)."""
        holder = {}
        pe = self.per_example_fn()

        def flat_pe(diff_leaves, ex_leaves, other_leaves):
            if varying:
                diff_leaves = [compat.make_varying(x, self.data_axes) if i in varying else x
                               for i, x in enumerate(diff_leaves)]
            out = pe(diff_leaves, ex_leaves, other_leaves)
            flat, tree = jax.tree.flatten(out)
            holder["out_tree"] = tree
            return flat

        def trace_one(ex_leaves):
            try:
                closed, shapes = jax.make_jaxpr(flat_pe, return_shape=True)(
                    self.diff_leaves, ex_leaves, self.other_leaves
                )
            except TypeError as e:
                if "not a valid JAX type" not in str(e):
                    raise
                raise TypeError(
                    f"{self.name}: fn returned a value that is not an array"
                    + (" in its aux output" if self.opts.has_aux else "")
                    + ": the loss (and aux, with has_aux=True) must be pytrees of arrays; "
                    "return strings and other Python objects outside the function. "
                    f"({e})"
                ) from None
            # (registered custom ops replaced by their references: extend.register_custom_op)
            if substitute:
                closed = custom_ops.substitute(closed)
            # (a constraint on the example's unit axis: released, devices.py)
            n = len(self.diff_leaves)
            closed, holder["constraints"] = devices.release_unit_constraints(
                closed, range(n, n + len(self.ex_leaves)))
            holder["closed"], holder["shapes"] = closed, shapes
            return jnp.zeros(())

        key = (substitute, frozenset(varying))
        if key in self.traces:
            return self.traces[key][:2]
        jax.eval_shape(jax.vmap(trace_one), self.ex_leaves)
        loss = holder["shapes"][0]
        if loss.shape != () or not jnp.issubdtype(loss.dtype, jnp.floating):
            raise ValueError(
                f"{self.name}: fn must return a scalar floating-point loss (the mean over the "
                f"batch), but on one example it returned {loss.dtype}{list(loss.shape)}. "
                + ("Reduce the loss to a scalar" if loss.shape else "Return a float loss")
                + (
                    ", or pass has_aux=True to return (loss, aux)."
                    if not self.opts.has_aux
                    else "."
                )
            )
        self.traces[key] = holder["closed"], holder["out_tree"], holder["constraints"]
        return holder["closed"], holder["out_tree"]

    def batch_constraints(self):
        """What the per-example jaxpr's sharding constraints name
        (`devices.BatchConstraints`), from its `trace`."""
        self.trace()
        return self.traces[(True, frozenset())][2]


def gather_examples(v, n_local, axis_name):
    """The whole batch's per-example values ``[N, ...]`` from each device's ``[n_local, ...]``,
    in the order of the devices along ``axis_name``, the same on every device.

    Written as a psum of each device's values placed in its own slot of zeros (exact: the
    other devices add zeros), so the result is replicated: inside ``shard_map`` an
    ``all_gather`` stays varying over the axis and could not leave with ``P()``.
    """
    n_dev = jax.lax.psum(1, axis_name)  # static: the size of the axis
    i = jax.lax.axis_index(axis_name)
    full = jnp.zeros((n_dev * n_local,) + tuple(v.shape[1:]), v.dtype)
    full = compat.update_at(full, v, i * n_local, 0)
    return jax.lax.psum(full, axis_name)


STATIC = None  # the value of every statistic at a static (non-array) parameter leaf


def axis_names(axis_name):
    """The mesh/pmap axes the batch is split over, as a set of names."""
    if axis_name is None:
        return frozenset()
    return frozenset(axis_name if isinstance(axis_name, (tuple, list)) else (axis_name,))


@dataclasses.dataclass(frozen=True)
class LeafLayout:
    """The static layout of the differentiated argument(s): their tree, which of its
    leaves are differentiated (float arrays), and those leaves' shapes and dtypes.
    Statistics' values (one per differentiated leaf) become pytrees shaped like the
    arguments through it; two calls on parameters of one structure, shapes and dtypes
    have equal layouts."""

    tree: Any  # the PyTreeDef of the differentiated argument(s)
    is_arr: tuple  # per flat leaf: differentiated
    shapes: tuple  # per differentiated leaf
    dtypes: tuple  # per differentiated leaf
    paths: tuple = dataclasses.field(default=(), compare=False)

    def unflatten(self, leaves, static=None):
        """A tree like the differentiated argument(s) from one value per differentiated
        leaf; the other leaves get ``static``."""
        it = iter(leaves)
        return jax.tree.unflatten(self.tree, [next(it) if a else static for a in self.is_arr])

    def cast_like(self, result):
        """Gradient-like statistics (mean, sum, clipped sums) come back in the parameters'
        dtypes, like ``jax.grad``; the others stay in their (at least float32) dtype."""
        try:
            params = self.unflatten(
                [jax.ShapeDtypeStruct(s, d) for s, d in zip(self.shapes, self.dtypes)], STATIC
            )
            if jax.tree.structure(result) != jax.tree.structure(params):
                return result
            return jax.tree.map(
                lambda r, p: r.astype(p.dtype) if jnp.shape(r) == p.shape else r, result, params
            )
        except Exception:  # noqa: BLE001 - result not shaped like params
            return result
