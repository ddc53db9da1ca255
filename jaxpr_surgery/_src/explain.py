"""``explain``: which layers were detected, which rule each parameter leaf gets, and the cost."""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxpr_surgery._src import (
    chunking,
    compat,
    custom_ops,
    cuts,
    devices,
    dots,
    explain_table,
    explicit,
    independence,
    kron,
    meshes,
    segments,
    tiling,
    walker,
)
from jaxpr_surgery._src import example_weights as ew
from jaxpr_surgery._src import stats as S
from jaxpr_surgery._src.api import chunk_for, collector_paused, front_half
from jaxpr_surgery._src.arguments import Options, Prepared, flatten_stats
from jaxpr_surgery._src.ghost_cross import shared_norm_candidates, shared_norms_by_ghost
from jaxpr_surgery._src.leaves import leaf_feature_tile, multi_site_routes
from jaxpr_surgery._src.plans import Mode, clips_by_recompute, needs_norms
from jaxpr_surgery._src.sites.base import (
    FALLBACK,
    MATERIALISED,
    RULE_ORDER,
    STREAMED,
    UNUSED,
    Rule,
    acc_dtype_for,
)

SKIPPED = "skipped"  # a non-float array leaf: not differentiated, its statistics None


@dataclasses.dataclass
class LeafReport:
    """What ``explain`` found for one parameter leaf.

    ``rule`` and the values of ``rules`` are words of a small vocabulary that says
    what a leaf costs (docs/explain.md): ``"streamed"`` (no per-example tensor of
    the leaf: contraction, rank-one, ghost norms, segment sums, tiled products),
    ``"materialised"`` (a ``[B, *leaf]`` per-example tensor of the leaf),
    ``"fallback"`` (exact per-example gradients of the leaf through the whole
    model), ``"unused"`` or ``"skipped"`` (a non-float array such as an integer
    buffer or a PRNG key: not differentiated, every statistic is None for it, as
    under ``eqx.filter_grad``). ``rule`` is the dearest over the requested statistics.
    ``hows`` says, per statistic, how its rule runs (``"contraction"``, ``"ghost
    norm"``, ...); ``detail`` is the same for every statistic in one string.
    ``clip_groups`` says, for each statistic that clips per group of leaves (a tree of
    clip bounds), the path of the leaf's group in that tree and its bound.
    """

    path: str
    shape: tuple
    dtype: str
    kinds: list  # layer kind of every site, e.g. ["dense"] or ["embedding", "dense"]
    rule: str  # streamed | materialised | fallback | unused | skipped (the dearest)
    rules: dict  # statistic's public name -> its rule word
    detail: str  # per statistic: rule word and how, or why the leaf falls back
    reasons: list  # why a leaf falls back (empty otherwise)
    extra_flops: float | None  # estimated FLOPs of its statistics, beyond the plain gradient
    extra_bytes: float | None  # estimated extra temporary memory (per-example tensors, tiles)
    hows: dict = dataclasses.field(default_factory=dict)  # statistic's public name -> how
    # per-layer clipping: statistic's public name -> (path, bound) of the leaf's group
    # (the bound None where it is traced)
    clip_groups: dict = dataclasses.field(default_factory=dict)
    # statistic's public name -> the forms the cost model weighed for it (`Candidate`s:
    # how, FLOPs, bytes moved, temporary bytes; per site, the chosen one first), where
    # it had a choice (per-example norms: ghost form or products, a shared leaf's cross
    # terms or tiles)
    candidates: dict = dataclasses.field(default_factory=dict)

    @property
    def fallback(self):
        return self.rule == FALLBACK


@dataclasses.dataclass
class Report:
    """Result of `explain`: one `LeafReport` per parameter leaf.

    ``str(report)`` is a table that fits a 100-column terminal (`Report.format`
    for another width, or none); ``report.leaves`` and ``report.as_dict()`` are
    machine-readable; ``report.jaxpr()`` prints the per-example jaxpr with every
    site annotated.
    """

    leaves: list
    batch_size: int
    statistics: list
    primitives: list
    notes: list
    memory_budget_bytes: int
    grad_flops: float | None = None  # XLA's estimate for jax.grad (explain(compare_grad=True))
    grad_temp_bytes: float | None = None
    chunk_size: int | None = None  # examples per chunk the call runs (None: the whole batch)
    activation_bytes_per_example: int | None = None  # the estimate chunk_size="auto" uses
    _annotated: Any = dataclasses.field(default=None, repr=False, compare=False)
    # whether the batch loss is a mean of per-example terms: "independent",
    # "cross-example", "undecided" or "not checked" (the notes say where and why)
    independence: str = independence.SKIPPED

    def as_dict(self):
        d = dataclasses.asdict(self)
        d.pop("_annotated", None)
        d["total_extra_flops"] = self.total_extra_flops
        d["total_extra_bytes"] = self.total_extra_bytes
        return d

    @property
    def fallback_leaves(self):
        return [leaf.path for leaf in self.leaves if leaf.fallback]

    @property
    def skipped_leaves(self):
        """Paths of the non-float leaves (integer, bool, PRNG keys): not differentiated,
        their statistics are None."""
        return [leaf.path for leaf in self.leaves if leaf.rule == SKIPPED]

    @property
    def total_extra_flops(self) -> float:
        return float(sum(leaf.extra_flops or 0 for leaf in self.leaves))

    @property
    def total_extra_bytes(self) -> float:
        """Leaves' statistics run one after another: the largest leaf's extra bytes,
        plus every fallback leaf's per-example gradient (alive together)."""
        fb = sum(leaf.extra_bytes or 0 for leaf in self.leaves if leaf.fallback)
        other = max([leaf.extra_bytes or 0 for leaf in self.leaves if not leaf.fallback] + [0])
        return float(fb + other)

    @property
    def predicted_temp_bytes(self) -> float | None:
        """With ``compare_grad=True``: XLA's temporary memory of ``jax.grad`` plus the
        predicted extra, i.e. the predicted temporary memory of `per_example_stat`."""
        if self.grad_temp_bytes is None:
            return None
        return float(self.grad_temp_bytes + self.total_extra_bytes)

    def jaxpr(self) -> str:
        """The per-example jaxpr, each site annotated with its leaf, kind and rules."""
        return self._annotated() if self._annotated is not None else ""

    def format(self, width: int | None = explain_table.DEFAULT_WIDTH) -> str:
        """The report as text, every line at most ``width`` columns.

        One line per leaf (path, shape, kind, rule, a footnote, predicted extra
        memory), then footnotes that say once, for every group of leaves that run
        the same way, each statistic's rule and how it runs, or why a leaf falls
        back; then the totals and notes. Paths too long for ``width`` lose the
        prefix every leaf shares (named above the table), then entries from the
        middle.

        Args:
          width: the most columns a line may take (at least 80); ``None``
            abbreviates and wraps nothing (full paths, one line per footnote).

        Returns:
          The text; ``str(report)`` is ``report.format()``.
        """
        return explain_table.render(self, width)

    def __str__(self):
        return self.format()


def _cost_text(cands):
    """`` (cost model: chosen's cost vs the other's)`` for explain's table, or ``""``
    where there was no choice."""
    if len(cands) < 2:
        return ""
    return f" (cost model: {cands[0].cost:.2g} vs {cands[1].how} {cands[1].cost:.2g})"


def _mib(b):
    return f"{b / 2**20:.3g} MiB"


def _default_stats():
    return (S.mean(), S.second_moment(), S.variance(), S.sq_norms())


def stat_name(s) -> str:
    """A statistic's public name (``second_moment``, ``sq_norms``, ...)."""
    name = getattr(s, "_name", None)
    if name == "elementwise":
        red = getattr(s, "reduction", None)
        if red is not None and red.name:
            return f"elementwise({red.name})"
    return name or type(s).__name__


def _dearest(words):
    words = list(words)
    return max(words, key=RULE_ORDER.index) if words else UNUSED


def explain(
    fn,
    stat: Any = None,
    *,
    argnums: int | Sequence[int] = 0,
    batch_argnums: int | Sequence[int] = 1,
    keep_batch_dim: bool = True,
    has_aux: bool = False,
    memory_budget_bytes: int | None = None,
    chunk_size: int | str | None = "auto",
    compare_grad: bool = False,
    check: bool = True,
):
    r"""Reports, for every parameter leaf, the layer kind detected and the rule that runs.

    Args:
      fn: the loss, as for `per_example_stat`.
      stat: the statistics whose cost to report (default: mean, second
        moment, variance and squared norms).
      argnums: as for `per_example_stat`.
      batch_argnums: as for `per_example_stat`.
      keep_batch_dim: as for `per_example_stat`.
      has_aux: as for `per_example_stat`.
      memory_budget_bytes: as for `per_example_stat` (sizes the tiles reported).
      chunk_size: as for `per_example_stat`; the report states the chunk the call
        runs with (``"auto"``: chosen from the estimated activations per example).
      compare_grad: also compile ``jax.grad(fn)`` once and report the predicted
        extra FLOPs and memory as ratios to XLA's estimates for it.
      check: also trace the batch loss and report whether it is a mean of
        per-example terms, as `per_example_stat` checks it (``Report.independence``
        and a note naming the operation where examples interact); never raises.

    Returns:
      A function of ``fn``'s arguments returning a `Report`.

    Note:
      A model whose examples interact (batch norm in training mode, in-batch
      negatives) has no per-example gradients: the per-example loss is the
      model applied to a batch of one. With ``check=True`` the report says
      whether the batch loss was proved a mean of per-example terms, where
      `per_example_stat` would raise, or where the jaxpr cannot decide (run
      `check_per_example` then).

    Examples:
      >>> import jax.numpy as jnp, jaxpr_surgery as js
      >>> loss = lambda p, b: jnp.mean((b["x"] @ p["w"] + p["b"] - b["y"]) ** 2)
      >>> p = {"w": jnp.ones((3, 2)), "b": jnp.zeros(2)}
      >>> b = {"x": jnp.ones((4, 3)), "y": jnp.ones((4, 2))}
      >>> rep = js.explain(loss)(p, b)
      >>> [(leaf.path, leaf.kinds, leaf.rule) for leaf in rep.leaves]
      [("['b']", ['scale-shift'], 'materialised'), ("['w']", ['dense'], 'streamed')]
      >>> sorted(set(rep.leaves[1].rules.values()))
      ['streamed']
    """
    stat = _default_stats() if stat is None else stat
    chunking.validate(chunk_size, "explain")
    stat_leaves, _, reqs, reductions = flatten_stats(stat)
    names = [stat_name(s) for s in stat_leaves]
    budget = (
        tiling.DEFAULT_MEMORY_BUDGET_BYTES
        if memory_budget_bytes is None
        else int(memory_budget_bytes)
    )

    def run(*args, **kwargs):
        kwargs, spec = ew.pop(kwargs, "explain")
        f = functools.partial(fn, **kwargs) if kwargs else fn
        opts = Options(argnums, batch_argnums, keep_batch_dim, has_aux, None, False, None)
        opts = dataclasses.replace(opts, chunk_size=chunk_size, memory_budget_bytes=budget)
        # traced with the collector paused, as the entries trace (api.collector_paused)
        with collector_paused():
            prep = Prepared(f, args, opts, "explain")
            if prep.explicit is None:
                found = analyse(prep, opts, spec)
            else:  # (in Auto mode, the loss's annotations dropped, as the entries run: api.py)
                held = {}
                untyped = explicit.untyped(f, prep.explicit[0], "explain", args,
                                           prep.batch_argnums)

                def held_analysis(*a):
                    held["found"] = analyse(Prepared(untyped, a, opts, "explain"), opts, spec)
                    return jnp.zeros(())

                meshes.in_auto_mode(held_analysis, args, *prep.explicit)
                found = held["found"]
        prep, an, B, chunk, act, leaves, notes, verdict, closed, site_notes = found
        gflops = gmem = None
        if compare_grad:
            gflops, gmem = _grad_cost(f, args, prep)

        def annotated():
            return _annotate(closed.jaxpr, site_notes)

        return Report(
            leaves,
            B,
            names,
            sorted({str(p) for p in an.primitives}),
            notes,
            budget,
            gflops,
            gmem,
            chunk,
            act,
            annotated,
            independence=verdict.kind,
        )

    def analyse(prep, opts, spec):
        """The report's parts for the call `Prepared` as ``prep`` (example weights
        ``spec``)."""
        front = front_half(prep, reductions, opts, "explain", check_budget=False)
        closed, an, B, chunk = front.closed, front.analysis, prep.B, front.chunk
        act = front.activation_bytes()
        D = devices.split_count(prep, opts)
        split_note = None
        seg_note = None
        if D > 1:  # (a batch sharded by XLA: the call runs in parts, api.py)
            chunk, split_note = _split(prep, opts, D, front, reductions)
            seg_note = _segments_note(prep, D, front.plan)
        recompute = not prep.data_axes and clips_by_recompute(closed.jaxpr)
        site_notes = {}
        at = [k for k, a in enumerate(prep.diff_is_arr) if a]  # flat index of each float leaf
        by_index = {
            at[i]: _leaf_report(
                prep, front.plan, i, x, B, names, reqs, reductions, budget, site_notes,
                recompute,
            )
            for i, x in enumerate(prep.diff_leaves)
        }
        for (k, path, dtype), x in zip(prep.skipped, prep.other_leaves[prep.n_other :]):
            by_index[k] = _skipped_report(path, tuple(jnp.shape(x)), dtype, names)
        leaves = [by_index[k] for k in sorted(by_index)]  # in the order of the tree
        verdict = (independence.verdict(prep, prep.data_axes) if check
                   else independence.Verdict(independence.SKIPPED, "check=False"))
        notes = _notes(verdict, spec, prep, front.plan, reductions, names, reqs,
                       chunking.whole_for_the_allocator(chunk_size, B, act))
        notes.extend(_custom_op_notes(prep))
        if split_note:
            notes.insert(1, split_note)
        if seg_note:
            notes.insert(2, seg_note)
        return prep, an, B, chunk, act, leaves, notes, verdict, closed, site_notes

    return run


def _split(prep, opts, D, front, reductions):
    """``(chunk, note)`` of a call whose batch XLA's partitioner shards (devices.py): it
    runs as ``D`` parts, each part's chunks sized as the call sizes them."""
    part, n = devices.part_options(opts, D), devices.auto_mesh_size(
        [*prep.ex_leaves, *prep.diff_leaves])
    b = prep.B // D
    with cuts.split_over(D, devices.AXIS):
        chunk = chunk_for(part.chunk_size, b, front.activation_bytes, reductions,
                          front.leaf_avals)
    how = f"in chunks of {chunk} example{'s' * (chunk != 1)}" if chunk else "whole"
    return chunk, (
        f"Batch sharded by XLA's partitioner over a mesh of {n} devices: the call runs as "
        f"{D} parts of {b} examples, each part's examples reduced on its device ({how}; "
        "the tiles above are per part) and the parts' values combined across the devices, "
        "as jax.grad combines its gradients.")


def _segments_note(prep, D, plan):
    """A note naming the scan layers' sites whose clipped sums recompute their inner
    values under the split (segments.py), or None."""
    if not plan.has_clip or not devices.recomputes(prep, D):
        return None
    with cuts.split_over(D, devices.AXIS):
        found, kept = segments.find(dataclasses.replace(plan, keep_for_clip=True), Mode.DIRECT,
                                    Mode.INGREDIENTS)
    if not found:
        return None
    name = lambda p: prep.diff_paths[plan.analysis.sites[p].leaf]  # noqa: E731
    parts = []
    for seg in found:
        held = [name(p) for p in seg.members if kept[p] is segments.K.Kept.X]
        if seg.target is None:
            parts.append(f"{', '.join(name(p) for p in seg.members)} (the loss's tail: keeping "
                         f"the input of {' and '.join(held)}, its cotangent recomputed from "
                         "the loss after the backward pass)")
            continue
        parts.append(f"{', '.join(name(p) for p in seg.members)} (keeping the input of "
                     f"{' and '.join(held)} and the output cotangent of {name(seg.target)})")
    return ("Clipped sums recompute, one scan layer at a time, what sites would otherwise "
            "keep for every layer until each example's norm is known: "
            + "; ".join(parts) + ". Under tensor parallelism the kept values are those "
            "each device holds whole; the recomputed ones its own heads' and hidden units'.")


def _custom_op_notes(prep):
    """A note naming the registered custom ops the loss calls (`custom_ops`)."""
    if not custom_ops.registered():
        return []
    entries = custom_ops.ops_in(prep.trace(substitute=False)[0])
    if not entries:
        return []
    how = [f"{e.name} (by its reference: the layers inside get their rules)"
           if e.reference is not None else
           f"{e.describe if e.primitive else e.name} (by its rule {type(e.rule).__name__})"
           for e in entries]
    return ["Custom ops registered with js.extend: " + ", ".join(how) + "; their "
            "statistics are those of the op where js.extend.check_rule passes on this model."]


def _notes(verdict, spec, prep, plan, reductions, names, reqs, whole_for_allocator):
    """The report's notes: independence, weights, the allocator's chunk, clip groups."""
    notes = [_independence_note(verdict)]
    if spec is not None:
        notes.append(_weights_note(spec, prep, reductions))
    if whole_for_allocator:
        notes.append(
            'chunk_size="auto" runs the batch whole although its activations pass '
            f"{_mib(chunking.CPU_CHUNK_BYTES)}: this process's allocator keeps freed "
            "memory, so large temporaries are not page-faulted on every call and the "
            "whole batch was the fastest (pass an int chunk_size to bound the memory)."
        )
    notes.extend(clip_group_notes(plan, names, reqs, prep.diff_paths))
    return notes


def _independence_note(v):
    """One line on whether the examples of the batch loss interact."""
    if v.kind == independence.INDEPENDENT and v.detail:
        return f"Examples independent ({v.detail})."
    if v.kind == independence.INDEPENDENT:
        return ("Examples independent: the batch loss is a mean of per-example terms "
                "(proved from its jaxpr).")
    if v.kind == independence.CROSS:
        return (f"Cross-example loss: {v.detail}; per_example_stat raises (check=False "
                "computes the statistics of the batch-of-one losses).")
    if v.kind == independence.UNDECIDED:
        return (f"Examples not proved independent: {v.detail}; run js.check_per_example(fn) "
                "once on a real batch.")
    return (f"Examples not checked for independence ({v.detail}): run "
            "js.check_per_example(fn) once on a real batch.")


def _weights_note(spec, prep, reductions):
    """What ``example_weights`` / ``is_padding_example`` change (checked as the
    statistics' function checks them)."""
    ew.check_concrete(spec, "explain")
    w = ew.as_weights(spec, prep.B, "explain")
    kind = spec[0]
    text = f"{kind}: every statistic over the weighted examples"
    if not isinstance(w, jax.core.Tracer):
        wn = np.asarray(w, np.float64)
        text += (f" (W = {wn.sum():g}, {int((wn > 0).sum())} of {prep.B} examples weighted, "
                 f"effective batch size {wn.sum() ** 2 / np.sum(wn ** 2):.3g})")
    del reductions
    return text + ("; the examples of weight 0 are read as zeros at every layer. The rules "
                   "above run weighted: homogeneous reductions on scaled cotangents, signs "
                   "and centred moments by weighted rank-one and segment-sum forms, tile "
                   "loops weighing each example.")


def _skipped_report(path, shape, dtype, names):
    """A non-float array of the differentiated argument(s): not differentiated, as under
    ``eqx.filter_grad``; every statistic holds None for it."""
    how = f"non-float leaf ({dtype})"
    return LeafReport(
        path,
        shape,
        dtype,
        [],
        SKIPPED,
        {n: SKIPPED for n in names},
        f"{SKIPPED}: {how}; its statistics are None",
        [],
        0.0,
        0.0,
        {n: how for n in names},
    )


def _leaf_report(prep, plan, i, x, B, names, reqs, reductions, budget, site_notes, recompute):
    """Leaf ``i``'s report from the `plans.Plan` the statistics run (its analysis,
    modes and kernels). ``recompute``: clipped sums by a second backward pass
    (plans.clips_by_recompute)."""
    info = plan.analysis.leaves[i]
    path, shape, dtype = prep.diff_paths[i], tuple(jnp.shape(x)), str(x.dtype)
    kinds = [s.kind for s in info.sites]
    if info.residual or not info.sites:
        return _trivial_report(info, path, shape, dtype, kinds, names, B,
                               jnp.dtype(acc_dtype_for(x.dtype)).itemsize)
    leaf = _LeafRules(plan, i, info, B, shape, acc_dtype_for(x.dtype), budget, reductions,
                      recompute)
    rules, hows, parts, flops, mem = {}, {}, [], 0.0, 0.0
    per_red = {r: leaf.rule_of(r) for r in reductions}
    clip_groups, cands = {}, {}
    for name, req in zip(names, reqs):
        entries = [e for r in req.values() for e in per_red[r]]
        word = _dearest(e[0] for e in entries)
        rules[name] = word
        hows[name] = ", ".join(dict.fromkeys(e[1] for e in entries))
        cands[name] = list(dict.fromkeys(c for e in entries for c in e[4]))
        groups = [_group_of(plan.bound(r, i)) for r in req.values() if _per_group(r)]
        if groups:
            clip_groups[name] = groups[0]
        where = f"; clipped in the group at {groups[0][0]}, bound {_bound_text(groups[0][1])}" \
            if groups else ""
        parts.append(f"{name}: {word} ({hows[name]}{where})")
    for entries in per_red.values():
        flops += sum(e[2] for e in entries)
        mem = max([mem] + [e[3] for e in entries])
    # what each site sees of the leaf where that is more than the leaf itself (a
    # scale, a slice): the fast rule runs on that view
    views = [(s.kind, s.describe_view()) for s in info.sites]
    views = [(k, v) for k, v in views if v]
    if views:
        parts.append(
            "view (the rules run on it): "
            + "; ".join(f"[{k}] {v}" if leaf.multi else v for k, v in dict.fromkeys(views))
        )
    for s in info.sites:
        site_notes.setdefault(s.at, []).append({"leaf": path, "kind": s.kind, "rules": rules})
    return LeafReport(
        path, shape, dtype, kinds, _dearest(rules.values()), rules, "; ".join(parts), [],
        float(flops), float(mem), hows, clip_groups, {k: v for k, v in cands.items() if v},
    )


def _trivial_report(info, path, shape, dtype, kinds, names, B, itemsize):
    """The report of a leaf computed from exact per-example gradients (no site rule
    serves it), or of one that does not affect the loss."""
    if info.residual:
        size = math.prod(shape)
        return LeafReport(
            path, shape, dtype, kinds, FALLBACK, {n: FALLBACK for n in names},
            "exact per-example gradients: " + "; ".join(info.reasons), list(info.reasons),
            float(2 * B * size), float(B * size * itemsize),
            {n: "exact per-example gradients" for n in names},
        )
    return LeafReport(
        path, shape, dtype, [], UNUSED, {n: UNUSED for n in names},
        "does not affect the loss: zeros", [], 0.0, 0.0,
        {n: "does not affect the loss: zeros" for n in names},
    )


class _LeafRules:
    """How the engine computes each reduction over one leaf's sites: its kernels, and
    for a leaf with several sites the routes the engine decides (`multi_site_routes`,
    the tied norms' cost model). `rule_of` gives ``(word, how, flops, bytes,
    candidates)`` entries, one per site (or one for the leaf)."""

    def __init__(self, plan, i, info, B, shape, acc, budget, reductions, recompute):
        self.plan, self.i, self.info, self.B, self.shape = plan, i, info, B, shape
        self.size, self.acc, self.budget = math.prod(shape), acc, budget
        self.itemsize = jnp.dtype(acc).itemsize
        self.recompute = recompute
        self.ks = ks = [plan.kernels[s.path] for s in info.sites]  # what the engine runs
        self.multi = multi = len(info.sites) > 1
        norms = multi and needs_norms(reductions)
        self.ghost_cross = norms and shared_norms_by_ghost(info.sites, ks, B, shape, acc)
        self.leaf_tile = tiling.leaf_tile(B, shape, acc, budget, ks)  # as the engine sizes it
        self.leaf_ft = leaf_feature_tile(B, shape, acc, budget, ks) if multi else None
        # which reductions the engine reads from tiles of the leaf's summed G, and whether
        # the plain sums ride in that loop: the engine's own decision
        self.tiled, self.sum_rides = set(), False
        if multi:
            reds = list(reductions)
            idx, self.sum_rides = multi_site_routes(
                reds, self.ghost_cross, self.kron_streams(), self.leaf_ft)
            self.tiled = {reds[j] for j in idx if j is not None}
        self.shared_cands = (
            shared_norm_candidates(info.sites, ks, B, shape, acc) if norms else ())
        # reductions with a rule of their own over the leaf's sites, keyed by type
        self.leaf_rules = {S.KronSum: self.kron_rule, dots.DotWith: self.dots_rule}

    def kron_streams(self):
        """Token grams serve `KronSum` (every site's token factors line up in leaf axes)."""
        multi, ks = self.multi, self.ks
        ok = all(
            (kron.leaf_axes(s) if multi else kron.leaf_map(s)) is not None
            and hasattr(k, "kron_meta")
            for s, k in zip(self.info.sites, ks)
        ) and (not multi or len({k.kron_meta()[1] for k in ks}) == 1)
        return ok and (not multi or all(not k.kron_meta()[0][1] for k in ks))  # no block dims

    def rule_of(self, r):
        """The entries of one reduction over the leaf's sites."""
        own = S.lookup(self.leaf_rules, r)
        if own is not None:
            return [own(r)]
        return [self._site_rule(r, n, s, k)
                for n, (s, k) in enumerate(zip(self.info.sites, self.ks))]

    def _site_rule(self, r, n, s, k):
        B, multi, itemsize = self.B, self.multi, self.itemsize
        reps = math.prod(s.scan_lengths) if s.scan_lengths else 1
        shared_text = _cost_text(self.shared_cands) if n == 0 else ""  # once per leaf
        rl = k.rule(S.SqNorms() if r == S.Norms() else r, B)  # same rule
        rl = dataclasses.replace(rl, how=rl.how + _cost_text(rl.candidates))
        norms = S.is_norms(r) or r.weighted_by_norm
        if multi and norms and self.ghost_cross:
            rl = dataclasses.replace(
                rl, how=rl.how + " + ghost cross terms" + shared_text,
                candidates=rl.candidates + self.shared_cands,
            )
        elif multi and (r in self.tiled or (r.linear and self.sum_rides) or norms):
            t, ft, shape = self.leaf_tile, self.leaf_ft, self.shape
            rl = Rule(
                STREAMED,
                f"tiled products of the shared leaf ({tiling.describe(t, ft, shape)})"
                + (shared_text if norms else ""),
                2.0 * B * self.size,
                float(tiling.tile_bytes(t, ft, shape, self.acc)),
                self.shared_cands if norms else (),
            )
        by = " per clip group" if _per_group(r) else ""
        if r.weighted_by_norm and self.recompute:  # loss with remat
            rl = dataclasses.replace(
                rl, how=rl.how + " then a reweighted backward pass (remat: nothing kept)" + by
            )
        elif (r.weighted_by_norm and self.plan.modes[self.i] is Mode.DIRECT
              and k.keeps_products_for_clip()):
            # the norms' products G_b are kept for the weighted sum (plans.site_request)
            rl = dataclasses.replace(
                rl, how=rl.how + ", kept for the weighted sum" + by,
                bytes=rl.bytes + B * math.prod(s.view_shape) * itemsize,
            )
        elif r.weighted_by_norm:  # ingredients x and dy are kept until the norms
            ing = sum(math.prod(v.aval.shape) for v in s.eqn.outvars) + sum(
                math.prod(v.aval.shape) for v, batched in zip(s.ext_vars, s.ext_batched)
                if batched
            )
            rl = dataclasses.replace(
                rl, how=rl.how + " then weighted sum" + by, bytes=rl.bytes + B * ing * itemsize
            )
        shared = rl.how.startswith("tiled products of the shared leaf")
        label = f" [{s.kind}]" if multi and not shared else ""
        return (rl.word, rl.how + label, rl.flops * reps, rl.bytes, rl.candidates)

    def dots_rule(self, r):
        """Each site's contraction of the reference where its view permutes the leaf;
        else tiles of the leaf's exact per-example gradients (leaves.leaf_dots)."""
        if all(kron.leaf_map(s) is not None for s in self.info.sites):
            fl = sum(k.rule(S.SUM, self.B).flops for k in self.ks)  # one more per site
            return (STREAMED, "contraction with the reference", fl, 0.0, ())
        t = self.leaf_tile
        return (MATERIALISED, f"exact per-example gradients of the leaf ({t} "
                f"example{'s' if t > 1 else ''}/tile)", 2.0 * self.B * self.size,
                float(t * self.size * self.itemsize), ())

    def kron_rule(self, r):
        """Token grams where every site has token factors lining up in leaf axes (one
        site, or a tied embedding); else tiles of the leaf's exact per-example gradients."""
        B, multi, ks = self.B, self.multi, self.ks
        if self.kron_streams():
            metas = [k.kron_meta()[0] for k in ks]
            tok = sum(m[0] for m in metas)
            it_bytes = self.itemsize * (
                2 * sum(m[0] * math.prod(m[2]) * math.prod(m[1])
                        + m[0] * math.prod(m[3]) * math.prod(m[1]) for m in metas)
                + 4 * tok * tok
            )
            per_ex = tiling.prefer_per_example() and tok > 1
            t = tiling.tile_size(B, it_bytes, self.budget, batched_ok=not per_ex)
            how = "token grams" + (" of the tied sites" if multi else "")
            how += f" ({t} example{'s' if t > 1 else ''}/tile)"
            return (STREAMED, how, kron.flops(metas, r, B), float(t * it_bytes), ())
        if not multi and kron.leaf_map(self.info.sites[0]) is not None:
            rl = ks[0].rule(r, B)  # a generic site: its own per-example VJP
            return (rl.word, rl.how, rl.flops, rl.bytes, ())
        t = self.leaf_tile
        why = "a layer inside lax.scan or a reshaped view" if not multi else "sites do not line up"
        return (
            MATERIALISED,
            f"exact per-example gradients of the leaf ({t} example{'s' if t > 1 else ''}/tile; "
            f"{why})",
            2.0 * B * self.size * (1 + sum(min(n, r.max_dim) for n in self.shape)),
            float(t * self.size * self.itemsize),
            (),
        )


def _per_group(r) -> bool:
    """``r`` clips per group of leaves (a tree of bounds), not by the global norm."""
    return bool(getattr(r, "per_group", False))


def _group_of(bound):
    """``(path, bound)`` of a leaf's clip group (`stats.GroupClip`): the bound a float, or
    None where it is traced."""
    C = bound.clip_norm
    return (bound.path or "<root>", float(C) if isinstance(C, (int, float)) else None)


def _bound_text(C):
    return "traced" if C is None else f"{C:g}"


def clip_group_notes(plan, names, reqs, paths):
    """One line per statistic with per-layer clipping: its groups in the order of their
    bounds, each with its bound and leaves, and the sensitivity of the clipped sum."""
    notes = []
    for name, req in zip(names, reqs):
        for r in req.values():
            if not _per_group(r):
                continue
            groups = {}
            for i in range(len(paths)):
                b = plan.bound(r, i)
                groups.setdefault(b.group, (_group_of(b), []))[1].append(paths[i])
            parts = []
            for (path, C), leaves in (groups[k] for k in sorted(groups)):
                n = len(leaves)
                parts.append(f"{path} {_bound_text(C)} ({n} lea{'ves' if n != 1 else 'f'})")
            bounds = [C for (_, C), _ in groups.values()]
            sens = (f"; sensitivity sqrt(sum C_k^2) = {math.hypot(*bounds):.4g}"
                    if None not in bounds else "")
            notes.append(f"{name}: per-layer clipping, {len(groups)} group"
                         f"{'s' if len(groups) != 1 else ''} (bound, leaves): "
                         + ", ".join(parts) + sens + ".")
    return notes


def _annotate(jaxpr, site_notes):
    """The per-example jaxpr as text, each site line followed by its annotation."""
    lines = []
    pp = compat.EqnPrinter()

    def walk(j, path, indent):
        for k, eqn in enumerate(j.eqns):
            p = path + (k,)
            text = pp(eqn).replace("\n", "\n" + " " * indent)
            notes = site_notes.get(p, ())
            src = compat.source_line(eqn)
            for note in notes:  # (several: the sites of a merged weight's leaves)
                rules = ", ".join(f"{n}={w}" for n, w in note["rules"].items())
                text += f"    # site: {note['leaf']} {note['kind']}: {rules}"
            if notes and src:
                text += f" [{src}]"
            lines.append(" " * indent + text)
            for sub in walker.bodies(eqn):
                if any(q[: len(p)] == p and len(q) > len(p) for q in site_notes):
                    lines.append(" " * (indent + 2) + f"-- inside {eqn.primitive}:")
                    walk(sub, p, indent + 4)

    walk(jaxpr, (), 0)
    return "\n".join(lines)


def _grad_cost(f, args, prep):
    """XLA's FLOPs and temporary bytes of ``jax.grad`` of the loss (one compile)."""
    nums = prep.argnums[0] if prep.single else prep.argnums

    def loss_only(*a):
        out = f(*a)
        return out[0] if prep.opts.has_aux else out

    try:
        compiled = jax.jit(jax.grad(loss_only, argnums=nums)).lower(*args).compile()
        cost = compiled.cost_analysis()
        cost = cost[0] if isinstance(cost, (list, tuple)) else cost
        flops = float(cost.get("flops", 0.0)) or None
        mem = float(compiled.memory_analysis().temp_size_in_bytes) or None
        return flops, mem
    except Exception:  # noqa: BLE001 - no estimate on this backend
        return None, None
