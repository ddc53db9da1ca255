"""Public entry points: ``per_example_stat`` and ``value_and_per_example_stat``
(``check_per_example`` lives in ``check.py``)."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import types
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxpr_surgery._src import analysis as A
from jaxpr_surgery._src import (
    chunking,
    compat,
    custom_ops,
    cuts,
    devices,
    engine,
    explicit,
    gathers,
    independence,
    leaves,
    meshes,
    plans,
    tiling,
    untyped,
)
from jaxpr_surgery._src import example_weights as ew
from jaxpr_surgery._src import fingerprint as fp
from jaxpr_surgery._src import stats as S
from jaxpr_surgery._src.arguments import (
    Options,
    Prepared,
    axis_names,
    flatten_stats,
    gather_examples,
    is_array,
)

PyTree = Any


# --------------------------------------------------------------------------- #
# The computation
# --------------------------------------------------------------------------- #
@dataclasses.dataclass
class Front:
    """What `per_example_stat` and `explain` derive alike from a call, before running
    it: the traced per-example loss, its analysis, the `plans.Plan` and the chunk
    size."""

    closed: Any
    out_tree: Any
    analysis: Any
    leaf_avals: list
    plan: Any
    chunk: int | None
    activation_bytes: Any  # int, or a callable giving it (computed once, on demand)
    # leaf index -> the all_gather over ``axis_name`` lifted out of the loss (FSDP in
    # shard_map, `gathers.lift`): the leaf's statistics are of the whole weight
    gathers: dict = dataclasses.field(default_factory=dict)


def front_half(prep, reductions, opts, name, check=None, check_budget=True):
    """Traces the call, analyses its jaxpr, plans the statistics and sizes the chunks
    (`Front`). ``check()`` runs once the call is traced, before the analysis (the
    refusal of cross-example losses); ``opts.strict`` refuses leaves without a fast
    rule."""
    chunking.validate(opts.chunk_size, name)
    mb = opts.memory_budget_bytes
    if check_budget and mb is not None and (
        isinstance(mb, bool) or not isinstance(mb, (int, np.integer)) or mb <= 0
    ):
        raise ValueError(
            f"{name}: memory_budget_bytes must be a positive int (bytes per tile of per-example "
            f"gradients) or None for the default ({tiling.DEFAULT_MEMORY_BUDGET_BYTES}), got "
            f"{mb!r}."
        )
    varying = replicated_leaves(prep)
    try:
        try:
            closed, out_tree = prep.trace(varying=varying)
        except Exception:  # (a loss that casts a leaf itself, `jax.lax.pcast`: as given)
            if not varying:
                raise
            # (the other replicated leaves are still traced varying)
            varying, got = cast_elsewhere(prep, varying)
            closed, out_tree = got if got is not None else prep.trace()
    except Exception:
        if check is not None:  # a cross-example loss can fail on one example (the top k
            try:  # of the batch's losses): say so rather than JAX's error
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", independence.CrossExampleWarning)
                    check()
            except independence.CrossExampleError:
                raise
            except Exception:  # noqa: BLE001 - the trace's own error says more
                pass
        raise
    if check is not None:
        check()
    n = len(prep.diff_leaves)
    in_tags = (
        [A.PView(i) for i in range(n)]
        + [A.DATA] * len(prep.ex_leaves)
        + [None] * len(prep.other_leaves)
    )
    axes = prep.data_axes | axis_names(opts.axis_name)  # (the examples are split over)
    closed, lifted = gathers.lift(closed, n, axis_names(opts.axis_name))
    if lifted:
        gathers.check_reductions(lifted, reductions, prep.diff_paths, name)
    untyped.check(closed.jaxpr, reductions, lifted, axes, prep.diff_paths, name)
    with custom_ops.asked_once():  # (a rule's `where` asked once per equation)
        an, plan = _analysed(closed, in_tags, n, axes, prep, reductions, opts, out_tree,
                             lifted, name, varying)
    act = functools.cache(lambda: chunking.activation_bytes_of(
        closed.jaxpr, n, len(prep.ex_leaves), len(prep.other_leaves)))
    cs = chunk_for(opts.chunk_size, prep.B, act, reductions, plan.leaf_avals)
    return Front(closed, out_tree, an, plan.leaf_avals, plan, cs, act, lifted)


def cast_elsewhere(prep, varying):
    """``(leaves, trace)``: the leaves of ``varying`` (`replicated_leaves`) that the loss
    does not cast to varying itself (``jax.lax.pcast(w, axis, to="varying")``, refused by
    JAX on a value that varies already), and the per-example trace with them varying
    (``(frozenset(), None)``: none can be). Found by halving: a trace with a set of
    leaves varying fails where the set holds a leaf the loss casts (about two traces per
    such leaf per halving; only for a loss that casts a leaf itself)."""

    def trace(leaves):
        try:
            return prep.trace(varying=leaves)
        except Exception:  # noqa: BLE001 - one of them is cast by the loss
            return None

    cast = set()

    def find(leaves):  # (a sorted list whose trace failed)
        if len(leaves) == 1:
            cast.update(leaves)
        else:
            for part in (leaves[: len(leaves) // 2], leaves[len(leaves) // 2 :]):
                if trace(frozenset(part)) is None:
                    find(part)

    find(sorted(varying))
    rest = frozenset(varying) - cast
    got = trace(rest) if rest else None
    return (rest, got) if got is not None else (frozenset(), None)


def replicated_leaves(prep) -> frozenset:
    """Inside typed shard_map, the leaves replicated over every axis the examples vary
    over: they are traced, and evaluated, varying over those axes (`arguments.Prep.trace`,
    `engine.run`), as each device's examples see them. Traced as given, JAX casts such a
    leaf to varying where it meets the data, also inside a loop's, a branch's or a jitted
    call's body, and a per-example gradient through that cast would be summed over the
    devices; a leaf sharded over those axes (hand-written FSDP) keeps its own type. A
    leaf the loss casts itself (``jax.lax.pcast(w, axis, to="varying")``, which JAX
    refuses on a varying value) is traced as given, the others varying
    (`front_half`, `cast_elsewhere`)."""
    axes = prep.data_axes
    return frozenset(i for i, x in enumerate(prep.diff_leaves)
                     if axes and not compat.vma_of(x) & axes)


def _analysed(closed, in_tags, n, axes, prep, reductions, opts, out_tree, lifted, name,
              varying=frozenset()):
    """The analysis of a call's jaxpr and its plan (`front_half`); ``axes``: those the
    examples are split over; ``varying``: the leaves traced varying over them
    (`replicated_leaves`)."""
    an = A.analyse_jaxpr(closed.jaxpr, in_tags, n, axes)
    if an.crossing:
        raise _crossing_error(an.crossing, prep.diff_paths, name)
    if an.model_crossing:
        raise _model_crossing_error(an.model_crossing, prep.diff_paths, name)
    if opts.strict:
        bad = [(prep.diff_paths[i], li.reasons) for i, li in enumerate(an.leaves) if li.residual]
        if bad:
            lines = "; ".join(f"{p}: {', '.join(r)}" for p, r in bad)
            raise NotImplementedError(
                f"{name}(strict=True): no fast rule for parameter leaf/leaves: {lines}. "
                "Pass strict=False to compute them exactly from per-example gradients of those "
                "leaves (chunk_size bounds the memory)."
            )
    leaf_avals = [jax.ShapeDtypeStruct(jnp.shape(x), x.dtype) for x in prep.diff_leaves]
    for i, e in lifted.items():  # (the whole weight's statistics)
        leaf_avals[i] = jax.ShapeDtypeStruct(e.outvars[0].aval.shape, e.outvars[0].aval.dtype)
    plan = plans.make_plan(
        closed, an, leaf_avals, reductions, len(prep.ex_leaves), len(prep.other_leaves),
        out_tree, budget=opts.memory_budget_bytes, flatten=prep.leaf_flatten(),
        data_axes=prep.data_axes, varying_leaves=varying,
    )
    return an, plan


def chunk_for(chunk_size, B, act, reductions, leaf_avals):
    """The examples per chunk a call of ``B`` examples runs with (`chunking.resolve`;
    ``act``: a function giving one example's activation bytes). Under a batch split by
    device, called for one part (its ``B``, inside `cuts.split_over`): `explain` sizes
    the parts' chunks by this too."""
    return chunking.resolve(
        chunk_size, B, act, lambda: chunking.accumulator_bytes(reductions, leaf_avals))


def _crossing_parts(crossing, paths):
    """``(first equation, leaf paths, primitives, axes)`` of ``crossing`` (a list of
    ``(leaves, eqn, axes)``, `analysis_types.Analysis.crossing` / ``model_crossing``), as the
    refusals name them."""
    _, eqn, axes = crossing[0]
    leaves = sorted(set().union(*(c[0] for c in crossing)))
    names = ", ".join(paths[i] for i in leaves)
    prims = ", ".join(dict.fromkeys(str(c[1].primitive) for c in crossing))
    ax = ", ".join(repr(a) for a in sorted(axes, key=str))
    return eqn, names, prims, ax


def _crossing_error(crossing, paths, name):
    """The refusal of parameters that go through a collective over the examples' mesh
    axes (`analysis_types.Analysis.crossing`)."""
    eqn, names, prims, ax = _crossing_parts(crossing, paths)
    return NotImplementedError(
        f"{name}: parameter leaf/leaves {names} go through {prims} over mesh axis {ax} "
        f"(first{A._at(eqn)}), the axis the examples are split on: each example's gradient "
        "would take "
        "in the examples of the other devices (the transpose of a collective sums over "
        "them), so every statistic would be wrong. Served: a leaf whose every use is an "
        "all_gather of the leaf itself over axes of axis_name, the same each time (hand-"
        "written FSDP; pass axis_name), at the top level of fn or inside a lax.scan, "
        "jax.checkpoint or jax.jit body, or a custom_vjp gather whose backward pass is "
        "its psum_scatter alone. Otherwise gather (or combine) the "
        "parameters outside the statistic and pass the whole ones, e.g. "
        f"per_example_stat(fn)(jax.lax.all_gather(params, {ax}, tiled=True), batch), or "
        "shard them with jax.jit and a NamedSharding (XLA partitions the program; no "
        "axis_name)."
    )


def _model_crossing_error(crossing, paths, name):
    """The refusal of parameters that go through a collective over mesh axes the
    examples are not split on (`analysis_types.Analysis.model_crossing`)."""
    eqn, names, prims, ax = _crossing_parts(crossing, paths)
    return NotImplementedError(
        f"{name}: parameter leaf/leaves {names} go through {prims} over mesh axis {ax} "
        f"(first{A._at(eqn)}), an axis the examples are not split on (not in axis_name): "
        "a collective on a parameter itself is served only over the examples' axes "
        "(hand-written FSDP). Tensor parallelism in shard_map uses each shard as it is "
        "(combine activations, not parameters). Otherwise gather the parameters outside "
        "the statistic and pass the whole ones, or shard them with jax.jit and a "
        "NamedSharding (XLA partitions the program; docs/howto/sharded.md)."
    )


@dataclasses.dataclass(frozen=True)
class Reduced:
    """What one call computes before any statistic's ``finalize``: the shared half of
    `per_example_stat` and `jaxpr_surgery.per_example_partial`.

    Attributes:
      values: reduction index -> list over the differentiated leaves of its value over
        the batch, combined across devices with ``axis_name`` (per-example values stay
        each device's own ``[B]``; with weights, read 0 at weight 0 there, and otherwise
        by `finalize_values`).
      whole: with ``axis_name`` only, reduction index -> list per leaf of the whole
        batch's per-example values ``[N]``, for the reductions a ``whole_batch``
        statistic reads (empty otherwise).
      count: the number of examples ``N`` (over every device with ``axis_name``), or
        with ``example_weights`` their total weight ``W``.
      loss: the (weighted) mean of the per-example losses.
      aux: the per-example aux outputs (``has_aux``), else None.
      num_examples: ``N``.
      weights: the whole batch's ``example_weights`` (gathered across devices with
        ``axis_name``: ``[N]``), else None.
      bad: with weights, a traced flag: some weight is negative, NaN or infinite
        (every result is then NaN: `example_weights.poison`; where no weight is
        positive, a call's statistics that are not `defined_when_empty` also, a
        partial's not: another call may bring some).
    """

    values: dict
    whole: dict
    count: Any
    loss: Any
    aux: Any
    num_examples: Any = None
    weights: Any = None
    bad: Any = None


def reduce_call(prep, flat, opts: Options, name, spec=None) -> Reduced:
    """Runs the call and reduces its per-example gradients: every reduction's value of
    ``flat`` (`flatten_stats`), before any statistic's ``finalize``. ``spec``: the
    call's ``example_weights`` or ``is_padding_example`` (`example_weights.pop`)."""
    stat_leaves, _, reqs, reductions = flat
    axes = prep.data_axes | axis_names(opts.axis_name)
    check = (lambda: independence.check(prep, name, axes)) if opts.check else None
    front = front_half(prep, reductions, opts, name, check)
    plan, B, data_axes = front.plan, prep.B, prep.data_axes
    w = None if spec is None else ew.as_weights(
        spec, B, name, per_device=opts.axis_name is not None or bool(data_axes))

    def evaluate(diff, ex, other, consts, w):
        p = plan.with_consts(consts)
        if front.chunk is None:
            return engine.run(p, diff, ex, other, B, data_axes,
                              weights=None if w is None else (w, jnp.zeros((), w.dtype)))
        zero = engine.zero_carry(p, diff, data_axes)
        return chunking.run_chunks(
            lambda d, e, o, b, c, wt=None: engine.run(p, d, e, o, b, data_axes, carry=c,
                                                      weights=wt),
            types.SimpleNamespace(diff_leaves=diff, ex_leaves=ex, other_leaves=other, B=B),
            int(front.chunk), zero.values, reductions, w,
        )

    diff = [gathers.gather(front.gathers[i], x) if i in front.gathers else x
            for i, x in enumerate(prep.diff_leaves)]
    if front.gathers and front.chunk is None and w is None:  # (`gathers.AtSite`)
        plan = dataclasses.replace(plan, at_site={
            i: gathers.AtSite(e, opts.axis_name) for i, e in front.gathers.items()
            if not compat.vma_of(diff[i]) - axes})
    at_site = leaves.combined_pairs(plan, B)
    args = (diff, prep.ex_leaves, prep.other_leaves, plan.closed.consts)
    if w is None:
        values, loss_b, aux = evaluate(*args, None)
    else:  # (derivatives that no example of weight 0 spoils)
        values, loss_b, aux = ew.differentiable(evaluate, *args, w)
    N = B
    bad = None
    if w is None:
        loss_sum, count = jnp.sum(loss_b), N
    else:  # (a padded example's loss may be NaN: a token mean over no tokens)
        w, terms = ew.loss_terms(w, loss_b)
        loss_sum = jnp.sum(terms)
        count = jnp.sum(w)
        bad = ew.invalid(w)  # (and no weight at all: below, once summed over devices)
    whole = {}
    whole_w = w
    if opts.axis_name is not None:
        N = jax.lax.psum(B, opts.axis_name)
        # (a gathered leaf: each device keeps its shard, `gathers.combine`)
        values = {
            j: [v if (j, i) in at_site  # (combined at its site: the device's shard)
                else gathers.combine(front.gathers[i], _weighing(reductions[j], w), v, B, N,
                                     opts.axis_name)
                if i in front.gathers
                else _combined(_weighing(reductions[j], w), v, B, N, opts.axis_name)
                for i, v in enumerate(vals)]
            for j, vals in values.items()
        }
        loss_sum = jax.lax.psum(loss_sum, opts.axis_name)
        if w is None:
            count = N
        else:
            count = jax.lax.psum(count, opts.axis_name)
            bad = jax.lax.psum(bad.astype(jnp.int32), opts.axis_name) > 0
            whole_w = gather_examples(w, B, opts.axis_name)
        # statistics reducing per-example values over the batch (quantiles of norms,
        # diversity) get the whole batch's; the others keep each device's own
        for s, req in zip(stat_leaves, reqs):
            if not getattr(s, "whole_batch", False):
                continue
            for r in req.values():
                j = reductions.index(r)
                if r.per_example and j not in whole:
                    whole[j] = [gather_examples(v, B, opts.axis_name) for v in values[j]]
    if w is not None and opts.axis_name is not None:  # (each device's own: read 0 at
        # weight 0 here; otherwise in `finalize_values`)
        values = {j: [ew.weightless_zero(v, w) for v in vals] if reductions[j].per_example
                  else vals for j, vals in values.items()}
    aux_out = jax.tree.unflatten(front.out_tree, [loss_b] + list(aux))[1]
    return Reduced(values, whole, count, loss_sum / count, aux_out, N, whole_w, bad)


def _combined(r, v, B, N, axis_name):
    """``r``'s value ``v`` over the whole batch (`Reduction.combine_axis`); under a batch
    split by device, a value the same on every part (not mapped over the split's
    ``vmap``: a share, combined at its site) by `Reduction.combine_copies`."""
    if axis_name == cuts.split_axis() == devices.AXIS and not any(
            compat.mapped_over(x, axis_name) for x in jax.tree.leaves(v)):
        c = S.combined_copies(r, v, cuts.split_count())
        if c is not None:
            return c
    return r.combine_axis(v, B, N, axis_name)


def _weighing(r, w):
    """``r`` over the call's examples weighted by ``w`` (None: ``r``)."""
    return r if w is None or not S.weighs(r) else S.Weighted(r, w)


def _ddofs(stat):
    """``(name, ddof)`` of the statistics in ``stat`` whose estimate divides by
    ``count - ddof`` (checked against concrete weights)."""
    leaves = jax.tree.leaves(stat, is_leaf=S.is_statistic)
    return [(getattr(s, "_name", type(s).__name__), int(s.ddof)) for s in leaves
            if isinstance(getattr(s, "ddof", None), (int, np.integer))]


@compat.implicit_rank_promotion
def finalize_values(layout, flat, values, whole, count, weights=None, empty=None):
    """Every statistic's ``finalize`` of its reductions' values (pytrees shaped like
    the differentiated arguments by ``layout``, a `LeafLayout`), in ``flat``'s tree.

    ``values``/``whole`` as in `Reduced`: a statistic that reduces per-example values
    over the batch (quantiles of norms, diversity) declares ``whole_batch`` and gets
    ``whole``'s values where there are some (across devices); the others keep each
    device's own (per-example outputs stay with their device). A statistic that
    declares ``uses_weights`` gets ``weights=`` the whole batch's example weights (None
    without ``example_weights``); the others read per-example values 0 at weight 0.
    ``empty``: a traced flag, no example has a positive weight: the statistics that
    are not ``defined_when_empty`` (means, variances: they divide by ``W = 0``) are then
    NaN, the others (sums: 0) keep their value."""
    stat_leaves, stat_tree, reqs, reductions = flat

    def value_for(s, r):
        j = reductions.index(r)
        vals = whole[j] if getattr(s, "whole_batch", False) and j in whole else values[j]
        if r.per_example and getattr(weights, "ndim", 0) == 1 and not getattr(
                s, "uses_weights", False):
            # per-example values read 0 at weight 0; a statistic that weighs them reads
            # them as they are (its derivative in a weight 0 needs them). (Each device's
            # own values under axis_name, shorter than the weights, are read 0 already.)
            vals = [ew.weightless_zero(v, weights) if jnp.shape(v)[0] == weights.shape[0]
                    else v for v in vals]
        return vals

    results = []
    for s, req in zip(stat_leaves, reqs):
        vals = {k: layout.unflatten(value_for(s, r)) for k, r in req.items()}
        if getattr(s, "uses_weights", False):
            out = s.finalize(vals, count, weights=weights)
        else:
            out = s.finalize(vals, count)
        if getattr(s, "gradient_like", False):
            out = layout.cast_like(out)
        if empty is not None and not getattr(s, "defined_when_empty", False):
            out = ew.poison(out, empty)
        results.append(out)
    return jax.tree.unflatten(stat_tree, results)


def defined_when_empty(stat) -> bool:
    """Some statistic of ``stat`` (a pytree of them) has a value on a batch of no
    example (`Statistic.defined_when_empty`): an eager call on an all-padding batch then
    computes (the others are NaN) rather than raising."""
    leaves = jax.tree.leaves(stat, is_leaf=lambda x: S.is_statistic(x) or (
        hasattr(x, "reductions") and hasattr(x, "finalize")))
    return any(getattr(s, "defined_when_empty", False) for s in leaves)


def _compute(prep, stat, opts: Options, name, spec=None):
    flat = flatten_stats(stat)
    red = reduce_call(prep, flat, opts, name, spec)
    empty = None if red.bad is None else ~(red.count > 0)  # (all padding)
    result = finalize_values(prep.layout(), flat, red.values, red.whole, red.count,
                             red.weights, empty)
    loss = red.loss
    if red.bad is not None:  # bad traced weights: NaN, never a number (and the mean
        # loss of no example)
        loss, result = ew.poison((loss, result), red.bad)
        loss = ew.poison(loss, empty)
    return loss, red.aux, result


CHUNK_LOOP = chunking.CHUNK_LOOP  # the name scope of the loops over chunks (tests find them by it)


# --------------------------------------------------------------------------- #
# Public entry points
# --------------------------------------------------------------------------- #
def value_and_per_example_stat(
    fn: Callable[..., Any],
    stat: PyTree,
    *,
    argnums: int | Sequence[int] = 0,
    batch_argnums: int | Sequence[int] = 1,
    keep_batch_dim: bool = True,
    has_aux: bool = False,
    chunk_size: int | str | None = "auto",
    strict: bool = False,
    axis_name: Any = None,
    memory_budget_bytes: int | None = None,
    check: bool = True,
) -> Callable[..., tuple[Any, PyTree]]:
    r"""Like `per_example_stat`, also returning the loss (and aux).

    The loss is the mean of the per-example losses \(\frac1B\sum_b l_b\)
    (equal to ``fn(params, batch)`` for a batch-mean loss without cross-example
    interaction). With ``has_aux=True`` the first output is ``(loss, aux)``
    where ``aux`` holds the per-example aux outputs stacked on axis 0.

    Returns:
      A function with the signature of ``fn`` returning ``(loss, result)`` or
      ``((loss, aux), result)``.

    Examples:
      >>> import jax, jax.numpy as jnp, jaxpr_surgery as js
      >>> loss = lambda w, b: jnp.mean((b["x"] @ w - b["y"]) ** 2)
      >>> w = jnp.ones((3,)); b = {"x": jnp.eye(4, 3), "y": jnp.arange(4.0)}
      >>> l, m = js.value_and_per_example_stat(loss, js.stats.mean())(w, b)
      >>> bool(jnp.allclose(m, jax.grad(loss)(w, b)))
      True
    """
    opts = make_options(argnums, batch_argnums, keep_batch_dim, has_aux, chunk_size, strict,
                        axis_name, memory_budget_bytes, check)
    return _value_and_stat(fn, stat, opts, "value_and_per_example_stat")


def _value_and_stat(fn, stat, opts, name):
    """`value_and_per_example_stat`'s function; ``name``: the entry point the user called
    (every message names it)."""
    flatten_stats(stat)  # validate early
    if not callable(fn):
        raise TypeError(f"{name}: fn must be callable, got {fn!r}.")

    def body(prep, spec):
        loss, aux, result = _compute(prep, stat, prep.opts, name, spec)
        return ((loss, aux) if opts.has_aux else loss), result

    return entry(fn, opts, name, body, _ddofs(stat), empty_ok=defined_when_empty(stat))


def make_options(argnums, batch_argnums, keep_batch_dim, has_aux, chunk_size, strict,
                 axis_name, memory_budget_bytes, check) -> Options:
    """The `Options` of an entry point's keyword arguments."""
    return Options(
        argnums,
        batch_argnums,
        bool(keep_batch_dim),
        bool(has_aux),
        chunk_size,
        bool(strict),
        axis_name,
        memory_budget_bytes,
        bool(check),
    )


@contextlib.contextmanager
def collector_paused():
    """Python's cyclic garbage collector paused while a call is traced (restored after,
    as it was: nested calls and other threads see it paused until the outermost call
    ends). A trace allocates many short-lived objects, so the collector ran several
    times per trace, each full pass over every object the process holds (jax's and the
    model's included): 10-27% of a GPT-2-sized statistic's time to lower, measured
    (docs/benchmarks.md). What a trace leaves in cycles is collected afterwards."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _typed_like_inputs(out, args, prep):
    """``out`` (computed replicated, Explicit axes switched to Auto) typed as jax.grad's
    results are: every subtree shaped like the differentiated arguments with their
    shardings (a local slice of the replicated value, no communication), every ``[B]``
    vector with the batch's (per-example values). Leaves that match nothing stay
    replicated."""
    diff = args[prep.argnums[0]] if prep.single else tuple(args[i] for i in prep.argnums)
    pdef = jax.tree.structure(diff)
    def placed(x):  # (a sharding on a mesh: not an array outside any)
        s = jax.typeof(x).sharding if is_array(x) else None
        return s if getattr(getattr(s, "mesh", None), "axis_names", ()) else None

    shardings = [placed(x) for x in jax.tree.leaves(diff)]
    bs = placed(prep.ex_leaves[0])
    bspec = jax.sharding.PartitionSpec(*tuple(bs.spec)[:1]) if bs and bs.spec else None

    def like_params(t):
        return not is_array(t) and jax.tree.structure(t) == pdef

    def retype(t):
        if like_params(t):
            leaves = [jax.sharding.reshard(x, s)
                      if s is not None and is_array(x) and jnp.shape(x) == jnp.shape(p) else x
                      for x, s, p in zip(jax.tree.leaves(t), shardings, jax.tree.leaves(diff))]
            return jax.tree.unflatten(pdef, leaves)
        if (bspec is not None and is_array(t) and jnp.ndim(t) == 1
                and jnp.shape(t)[0] == prep.B):
            return jax.sharding.reshard(t, jax.sharding.NamedSharding(bs.mesh, bspec))
        return t

    return jax.tree.map(retype, out, is_leaf=lambda t: like_params(t) or is_array(t))


def _explicit_annotation_error(name, axes) -> str:
    return (
        f"{name}: an annotation of shardings over the Explicit mesh axes {tuple(axes)} "
        "(out_sharding= or jax.sharding.reshard) reached Auto mode, where the statistics are "
        "computed: the loss's own annotations are dropped (explicit.py), but not those in "
        "code jax traces later, such as a custom_vjp's backward rule (its forward and a "
        "custom_jvp's rule are traced again without them). Fix: leave annotations out of "
        "such rules, or write the loss for an Auto mesh with "
        "jax.lax.with_sharding_constraint hints (docs/howto/sharded.md#explicit-sharding)."
    )


def entry(fn, opts: Options, name: str, body, ddofs=(), all_zero_ok=False, empty_ok=False):
    """The function an entry point returns: ``body(prep, spec)`` of the `Prepared`
    call and its ``example_weights`` / ``is_padding_example`` (``spec``, or None;
    example_weights.py: never passed to ``fn``; concrete ones are checked against the
    ``(name, ddof)`` of ``ddofs`` first, and refused all zero unless ``all_zero_ok``: a
    partial's examples may all be padding, or ``empty_ok``: some statistic is defined on
    a batch of no example).

    Other keyword arguments pass through like jax.grad's: neither differentiated nor
    batched. Eager calls, also under transformations applied eagerly (``jax.grad``,
    ``jax.vmap`` outside any jit), are compiled once per argument structure
    (`fingerprint.EagerCache`; jax.jit then caches per shape and dtype, and per
    configuration: x64, matmul precision, promotion rules, default device), so they
    neither re-trace nor re-analyse nor run one operation at a time; under a staging
    transformation (jit, pmap, shard_map, a scan body) the computation is traced into
    the caller's."""

    def direct(args, kwargs):
        with collector_paused():
            return _direct(args, kwargs)

    def _direct(args, kwargs):
        kwargs, spec = ew.pop(kwargs, name)
        f = functools.partial(fn, **kwargs) if kwargs else fn
        prep = Prepared(f, args, opts, name)
        if prep.explicit is None:
            return _placed(f, prep, args, spec)
        # inside auto_axes the arguments (and the weights) are new values: prepare them there;
        # the loss's own annotations for the axes are dropped there (explicit.untyped)
        f = explicit.untyped(f, prep.explicit[0], name, args, prep.batch_argnums)
        try:
            if spec is None:
                out = meshes.in_auto_mode(
                    lambda *a: _placed(f, Prepared(f, a, opts, name), a, None),
                    args, *prep.explicit)
            else:
                kind, w = spec
                out = meshes.in_auto_mode(
                    lambda w, *a: _placed(f, Prepared(f, a, opts, name), a, (kind, w)),
                    (jnp.asarray(w), *args), *prep.explicit,
                )
            return _typed_like_inputs(out, args, prep)
        except ValueError as e:
            if not explicit.is_mode_error(e):
                raise
            raise NotImplementedError(_explicit_annotation_error(name, prep.explicit[1])) from e

    def _placed(f, prep, args, spec):
        """``body`` for arguments placed by XLA's partitioner (Auto axes: also those of an
        Explicit mesh, switched to Auto): a batch sharded over devices is split by device."""
        D = devices.split_count(prep, opts)
        if D > 1:  # (a batch sharded by XLA: each device's examples reduced on it)
            if opts.check:  # (on the whole batch: a part's examples may be one)
                independence.check(prep, name, prep.data_axes)
            part = devices.part_options(opts, D)
            return devices.split_run(
                prep, lambda a, sp: body(Prepared(f, a, part, name, traces=prep.traces), sp),
                args, spec, D)
        return body(prep, spec)

    compiled = fp.EagerCache()

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        _, spec = ew.pop(kwargs, name)
        if spec is not None:  # bad concrete weights raise here (traced ones: NaN)
            ew.check_concrete(spec, name, ddofs, all_zero_ok, empty_ok)
        leaves, tree = jax.tree.flatten((args, kwargs))
        if any(isinstance(x, jax.core.Tracer) for x in leaves) and not (
            compat.under_eager_transformations()
        ):  # (under eager grad / vmap: compiled too, not run one operation at a time)
            return direct(args, kwargs)
        is_arr = tuple(is_array(x) for x in leaves)
        static = tuple(None if a else x for a, x in zip(is_arr, leaves))
        try:
            key = (tree, is_arr, static)
            hash(key)
        except TypeError:  # an unhashable static leaf: no cache
            return direct(args, kwargs)

        def run(arrays, key=key):
            it = iter(arrays)
            full = [next(it) if a else s for a, s in zip(key[1], key[2])]
            a, k = jax.tree.unflatten(key[0], full)
            return direct(a, k)

        return compiled.get(key, lambda: run)([x for x, a in zip(leaves, is_arr) if a])

    return wrapped


def per_example_stat(
    fn: Callable[..., Any],
    stat: PyTree,
    *,
    argnums: int | Sequence[int] = 0,
    batch_argnums: int | Sequence[int] = 1,
    keep_batch_dim: bool = True,
    has_aux: bool = False,
    chunk_size: int | str | None = "auto",
    strict: bool = False,
    axis_name: Any = None,
    memory_budget_bytes: int | None = None,
    check: bool = True,
) -> Callable[..., PyTree]:
    r"""Transforms a batch loss into a function computing statistics of per-example gradients.

    With per-example loss \(l_b = \mathrm{fn}(\theta, \mathrm{batch}[b{:}b{+}1])\)
    and per-example gradient \(g_b = \nabla_\theta l_b\), returns a function
    computing ``stat`` (one statistic of `jaxpr_surgery.stats` or any
    pytree of them) over the batch, in one forward and one backward pass.
    Dense, embedding, scale-shift and conv uses of parameters are detected in
    the jaxpr and get cheap rules; any other parameter gets exact per-example
    gradients. Composes with ``jit``, ``grad``, ``vmap``, ``pmap`` and
    ``shard_map``; called outside ``jit`` (also under an eager ``grad`` or
    ``vmap``) it compiles once per argument structure.

    Args:
      fn: the loss, ``fn(*args) -> scalar`` (a mean over the batch), or
        ``(scalar, aux)`` with ``has_aux=True``.
      stat: a statistic or pytree of statistics (``js.stats.mean()``, ...).
      argnums: positional argument(s) differentiated: their float array leaves.
        Non-array leaves are static and non-float arrays (integer buffers, PRNG
        keys) are skipped, as under ``eqx.filter_grad``: their statistic is None.
      batch_argnums: positional argument(s) holding examples on axis 0 of every leaf.
      keep_batch_dim: ``fn`` is written for a batch; each example is passed with
        a leading axis of size 1. False: ``fn`` is written for one example.
      has_aux: ``fn`` returns ``(loss, aux)``.
      chunk_size: process examples in chunks of this size (bounds the memory of the
        whole forward and backward pass); each chunk continues the running
        statistics exactly (variances as shifted sums, re-centred as their rounding
        bound requires). ``None``: the whole batch at once. ``"auto"`` (default): on
        CPU, where the allocator hands large freed buffers back to the OS (glibc's
        default malloc: every call then page-faults temporaries above 32 MiB afresh;
        measured once per process), chunks whose activations (estimated from the
        jaxpr) keep about 32 MiB of temporaries, holding at least 3 times the bytes
        of the running statistics; elsewhere, and on CPU where the allocator keeps
        freed memory, the whole batch. `explain` reports the choice.
      memory_budget_bytes: bytes per tile where a statistic needs per-example
        gradients of a layer (E[g²], signs, variance at token-axis sites): they are
        produced and reduced a tile of examples at a time, never for the whole batch.
        ``None``: 64 MiB. On CPU token-axis tiles hold one example.
      strict: raise ``NotImplementedError`` instead of falling back to exact
        per-example gradients for a leaf without a fast rule.
      axis_name: inside ``pmap``/``shard_map`` with the batch split over this
        axis, combine so that every device gets the statistic of all examples.
      check: first prove, from the jaxpr of the batch loss (one more trace of ``fn``
        on the whole batch; nothing runs), that the loss is a (weighted) mean of
        per-example terms. A loss whose examples interact (the batch's token count
        in a denominator, batch norm in training mode, in-batch negatives, a softmax
        over the batch) raises `CrossExampleError` naming the operation and its
        source line; where the jaxpr cannot decide (a gather across the batch axis
        by data) a `CrossExampleWarning` is emitted once per trace. Only the loss is
        checked, not ``aux``; a batch of one and ``keep_batch_dim=False`` are not
        checked. ``False``: compute the statistics of the batch-of-one losses
        without the check.

    Returns:
      A function with the signature of ``fn`` returning ``stat``'s structure
      filled with values.

    Examples:
      >>> import jax, jax.numpy as jnp, jaxpr_surgery as js
      >>> loss = lambda w, b: jnp.mean((b["x"] @ w - b["y"]) ** 2)
      >>> w = jnp.ones((3,)); b = {"x": jnp.eye(4, 3), "y": jnp.arange(4.0)}
      >>> m2 = js.per_example_stat(loss, js.stats.second_moment())(w, b)
      >>> m2.shape
      (3,)
    """
    opts = make_options(argnums, batch_argnums, keep_batch_dim, has_aux, chunk_size, strict,
                        axis_name, memory_budget_bytes, check)
    vfn = _value_and_stat(fn, stat, opts, "per_example_stat")

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        return vfn(*args, **kwargs)[1]

    return wrapped
