"""``explain``: which layers were detected, which rule each parameter leaf gets, and the cost."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from jaxpr_surgery._src import analysis as A
from jaxpr_surgery._src import stats as S
from jaxpr_surgery._src.api import Options, _flatten_stats, _Prepared
from jaxpr_surgery._src.engine import cross_layout
from jaxpr_surgery._src.sites import kernel_for
from jaxpr_surgery._src.sites.base import acc_dtype_for


@dataclasses.dataclass
class LeafReport:
    """What ``explain`` found for one parameter leaf."""

    path: str
    shape: tuple
    dtype: str
    kinds: list  # layer kind of every site, e.g. ["dense"] or ["embedding", "dense"]
    rule: str  # fast | multi-site | fallback | unused
    detail: str  # rule per reduction, or why it falls back
    reasons: list  # why a leaf falls back (empty otherwise)
    extra_flops: float | None  # estimated FLOPs of its statistics, beyond the plain gradient
    extra_bytes: float | None  # estimated extra temporary memory (materialised tensors)

    @property
    def fallback(self):
        return self.rule == "fallback"


@dataclasses.dataclass
class Report:
    """Result of `explain`: one `LeafReport` per parameter leaf.

    ``str(report)`` is a table; ``report.leaves`` and ``report.as_dict()`` are
    machine-readable.
    """

    leaves: list
    batch_size: int
    statistics: list
    primitives: list
    notes: list

    def as_dict(self):
        return dataclasses.asdict(self)

    @property
    def fallback_leaves(self):
        return [leaf.path for leaf in self.leaves if leaf.fallback]

    def __str__(self):
        head = ("leaf", "shape", "kind", "rule", "detail")
        rows = [
            (
                leaf.path,
                "x".join(map(str, leaf.shape)) or "()",
                "+".join(leaf.kinds) or "-",
                leaf.rule,
                leaf.detail,
            )
            for leaf in self.leaves
        ]
        widths = [max(len(str(r[k])) for r in rows + [head]) for k in range(4)]
        lines = [
            "  ".join(str(h).ljust(w) for h, w in zip(head[:4], widths)) + "  " + head[4],
            "  ".join("-" * w for w in widths) + "  " + "-" * 6,
        ]
        for r in rows:
            lines.append("  ".join(str(c).ljust(w) for c, w in zip(r[:4], widths)) + "  " + r[4])
        total = sum(leaf.extra_flops or 0 for leaf in self.leaves)
        fb = self.fallback_leaves
        lines.append("")
        lines.append(
            f"B={self.batch_size}; statistics: {', '.join(self.statistics)}; "
            f"estimated statistic FLOPs: {total:.3g}; fallback leaves: {len(fb)}"
        )
        lines.extend(self.notes)
        return "\n".join(lines)


def _default_stats():
    return (S.mean(), S.second_moment(), S.variance(), S.sq_norms())


def explain(
    fn,
    stat: Any = None,
    *,
    argnums: int | Sequence[int] = 0,
    batch_argnums: int | Sequence[int] = 1,
    keep_batch_dim: bool = True,
    has_aux: bool = False,
):
    r"""Reports, for every parameter leaf, the layer kind detected and the rule used.

    Args:
      fn: the loss, as for `per_example_stat`.
      stat: the statistics whose cost to estimate (default: mean, second
        moment, variance and squared norms).
      argnums: as for `per_example_stat`.
      batch_argnums: as for `per_example_stat`.
      keep_batch_dim: as for `per_example_stat`.
      has_aux: as for `per_example_stat`.

    Returns:
      A function of ``fn``'s arguments returning a `Report`.

    Note:
      A model whose examples interact (batch norm in training mode, in-batch
      negatives) has no per-example gradients: the per-example loss is the
      model applied to a batch of one. ``explain`` cannot see that from one
      example's trace; run `check_per_example` to test it.

    Examples:
      >>> import jax.numpy as jnp, jaxpr_surgery as js
      >>> loss = lambda p, b: jnp.mean((b["x"] @ p["w"] + p["b"] - b["y"]) ** 2)
      >>> p = {"w": jnp.ones((3, 2)), "b": jnp.zeros(2)}
      >>> b = {"x": jnp.ones((4, 3)), "y": jnp.ones((4, 2))}
      >>> rep = js.explain(loss)(p, b)
      >>> [(leaf.path, leaf.kinds, leaf.rule) for leaf in rep.leaves]
      [("['b']", ['scale-shift'], 'fast'), ("['w']", ['dense'], 'fast')]
    """
    stat = _default_stats() if stat is None else stat
    stat_leaves, _, _, reductions = _flatten_stats(stat)

    def run(*args):
        prep = _Prepared(
            fn,
            args,
            Options(argnums, batch_argnums, keep_batch_dim, has_aux, None, False, None),
            "explain",
        )
        closed, _ = prep.trace()
        n = len(prep.diff_leaves)
        tags = (
            [A.PView(i) for i in range(n)]
            + [A.DATA] * len(prep.ex_leaves)
            + [None] * len(prep.other_leaves)
        )
        an = A.analyse_jaxpr(closed.jaxpr, tags, n)
        B = prep.B
        leaves = []
        for i, x in enumerate(prep.diff_leaves):
            info = an.leaves[i]
            size = math.prod(jnp.shape(x))
            itemsize = jnp.dtype(acc_dtype_for(x.dtype)).itemsize
            if info.residual:
                leaves.append(
                    LeafReport(
                        prep.diff_paths[i],
                        tuple(jnp.shape(x)),
                        str(x.dtype),
                        [s.kind for s in info.sites],
                        "fallback",
                        "exact per-example gradients: " + "; ".join(info.reasons),
                        list(info.reasons),
                        float(2 * B * size),
                        float(B * size * itemsize),
                    )
                )
                continue
            if not info.sites:
                leaves.append(
                    LeafReport(
                        prep.diff_paths[i],
                        tuple(jnp.shape(x)),
                        str(x.dtype),
                        [],
                        "unused",
                        "does not affect the loss: zeros",
                        [],
                        0.0,
                        0.0,
                    )
                )
                continue
            kinds = [s.kind for s in info.sites]
            flops, mem, parts = 0.0, 0.0, []
            multi = len(info.sites) > 1
            ks = [kernel_for(s, acc_dtype_for(x.dtype)) for s in info.sites]
            ghost_cross = multi and all(
                cross_layout(info.sites[a], ks[a], info.sites[b], ks[b]) is not None
                for a in range(len(ks))
                for b in range(a + 1, len(ks))
            )
            for s, k in zip(info.sites, ks):
                reps = math.prod(s.scan_lengths) if s.scan_lengths else 1
                for r in reductions:
                    name, f = k.rule(r, B)
                    linear = isinstance(r, S.PhiSum) and r.phi is None
                    if multi and not linear:
                        if isinstance(r, (S.SqNorms, S.ClippedSum)) and ghost_cross:
                            name = f"{name} + ghost cross terms (shared leaf)"
                        else:
                            name, f = "materialise per-example (shared leaf)", 2.0 * B * size
                    parts.append(
                        f"{_rname(r)}[{s.kind}]: {name}" if multi else f"{_rname(r)}: {name}"
                    )
                    flops += (f or 0) * reps
                    if "materialise" in name:
                        mem = max(mem, B * size * itemsize)
            detail = "; ".join(dict.fromkeys(parts))
            leaves.append(
                LeafReport(
                    prep.diff_paths[i],
                    tuple(jnp.shape(x)),
                    str(x.dtype),
                    kinds,
                    "multi-site" if multi else "fast",
                    detail,
                    [],
                    flops,
                    mem,
                )
            )
        notes = [
            "Per-example gradients assume independent examples: run js.check_per_example(fn) "
            "to detect batch norm / in-batch negatives."
        ]
        return Report(
            leaves,
            B,
            [repr(s) for s in stat_leaves],
            sorted({str(p) for p in an.primitives}),
            notes,
        )

    return run


def _rname(r):
    if isinstance(r, S.PhiSum):
        return "sum" if r.phi is None else f"sum {r.name or getattr(r.phi, '__name__', 'phi')}"
    if isinstance(r, S.Centered):
        return "variance"
    if isinstance(r, S.SqNorms):
        return "sq_norms"
    if isinstance(r, S.ClippedSum):
        return "clipped"
    return type(r).__name__


jax  # noqa: B018 - keep import for doctest namespace
