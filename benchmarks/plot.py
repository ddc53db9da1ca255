"""Render benchmark results: PNG plots into ``docs/img/`` and ``docs/benchmarks.md``.

Usage::

    python -m benchmarks.plot                                  # benchmarks/results/cpu.json
    python -m benchmarks.plot benchmarks/results/a.json b.json # merged (results concatenated)
    python -m benchmarks.plot --md docs/benchmarks.md --img-dir docs/img

Targets are re-evaluated from the merged rows with ``benchmarks.targets.evaluate_targets``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import defaultdict

from benchmarks.methods import ALL_STATS
from benchmarks.targets import evaluate_targets

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
METHOD_STYLE = {"js": "-", "js_chunk": "-", "vmap": "--", "micro_grad": ":",
                "micro_grad_mb": "-."}
METHOD_MARK = {"js": "o", "js_chunk": "D", "vmap": "s", "micro_grad": "^", "micro_grad_mb": "v"}
STAT_COLOR = {s: f"C{i}" for i, s in enumerate(ALL_STATS)}
REGIME_ORDER = ["mlp", "cnn", "short", "long", "vocab", "scan_remat"]


def load(paths):
    docs = []
    for p in paths:
        with open(p) as f:
            docs.append(json.load(f))
    if not docs:
        raise SystemExit("no input")
    doc = dict(docs[0])
    doc["results"] = [r for d in docs for r in d.get("results", [])]
    doc["max_batch"] = [r for d in docs for r in d.get("max_batch", [])]
    doc["regimes"] = {}
    for d in docs:
        doc["regimes"].update(d.get("regimes", {}))
    doc["chunk_curve"] = next((d["chunk_curve"] for d in docs if d.get("chunk_curve")), None)
    doc["tracing"] = next((d["tracing"] for d in docs if d.get("tracing")), None)
    doc["targets"] = evaluate_targets(doc["results"], doc["tracing"])
    doc["sources"] = [os.path.relpath(p, ROOT) for p in paths]
    doc["total_wall_s"] = sum(d.get("total_wall_s") or 0 for d in docs)
    return doc


def _regimes(doc):
    present = {r["regime"] for r in doc["results"]}
    return [r for r in REGIME_ORDER if r in present] + sorted(present - set(REGIME_ORDER))


# --------------------------------------------------------------------------- #
# Plots
# --------------------------------------------------------------------------- #
def plot_regimes(doc, img_dir):
    """Writes the PNG plots of ``doc`` into ``img_dir``: one per regime (time and memory
    ratios against B), the largest batches and the chunk_size curve where measured.

    Returns:
      ``{key: path}``: a regime's name, ``"max_batch"`` or ``"chunk"``.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(img_dir, exist_ok=True)
    paths = {reg: _plot_regime(plt, doc, reg, img_dir) for reg in _regimes(doc)}
    for key, plot in (("max_batch", _plot_max_batch), ("chunk", _plot_chunk_curve)):
        p = plot(plt, doc, img_dir)
        if p is not None:
            paths[key] = p
    return paths


def _save(plt, fig, img_dir, name):
    p = os.path.join(img_dir, name)
    fig.savefig(p, dpi=90)
    plt.close(fig)
    return p


def _plot_regime(plt, doc, reg, img_dir):
    """Time and temp-memory ratios to grad against B, one line per (method, statistic)."""
    rows = [r for r in doc["results"] if r["regime"] == reg and r["ok"]
            and r["method"] != "grad"]
    fig, axes = plt.subplots(1, 2, figsize=(13, 5))
    for ax, key, title in [(axes[0], "time_ratio", "wall time / grad"),
                           (axes[1], "temp_ratio", "XLA temp memory / grad")]:
        _plot_ratio(ax, rows, key)
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("batch size B")
        ax.set_ylabel(title)
        ax.set_title(f"{reg}: {title}")
        ax.grid(True, which="both", alpha=0.3)
    h, lab = axes[0].get_legend_handles_labels()
    fig.legend(h, lab, loc="center right", fontsize=7, frameon=False)
    desc = doc["regimes"].get(reg, {}).get("description", "")
    fig.suptitle(f"{reg} -- {desc}", fontsize=10)
    fig.tight_layout(rect=(0, 0, 0.83, 0.95))
    return _save(plt, fig, img_dir, f"bench_{reg}.png")


def _plot_ratio(ax, rows, key):
    series = defaultdict(list)
    for r in rows:
        if r.get(key) is not None:
            series[(r["method"], r["statistic"])].append((r["batch"], r[key]))
    for (m, s), pts in sorted(series.items()):
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], METHOD_STYLE.get(m, "-"),
                marker=METHOD_MARK.get(m, "o"), color=STAT_COLOR.get(s, "k"),
                label=f"{m}:{s}", alpha=0.85)


def _plot_max_batch(plt, doc, img_dir):
    """The largest batch within the budget, one bar per method, a panel per regime."""
    if not doc.get("max_batch"):
        return None
    recs = [r for r in doc["max_batch"] if r.get("max_batch") is not None]
    regs = [g for g in _regimes(doc) if any(r["regime"] == g for r in recs)]
    if not regs:
        return None
    fig, axes = plt.subplots(1, len(regs), figsize=(4 * len(regs), 4), squeeze=False)
    for ax, g in zip(axes[0], regs):
        rr = [r for r in recs if r["regime"] == g]
        ax.barh([r["label"] for r in rr], [max(r["max_batch"], 1) for r in rr],
                color=["C2" if r["capped"] else "C0" for r in rr])
        ax.set_xscale("log")
        ax.set_title(f"{g}: largest B, temp <= "
                     f"{rr[0]['budget_bytes'] / 2**30:.3g} GiB", fontsize=9)
        ax.tick_params(axis="y", labelsize=7)
    fig.tight_layout()
    return _save(plt, fig, img_dir, "bench_max_batch.png")


def _plot_chunk_curve(plt, doc, img_dir):
    """Temp memory (and wall time) of js second_moment against chunk_size."""
    cc = doc.get("chunk_curve")
    if not (cc and cc.get("points")):
        return None
    pts = [p for p in cc["points"] if p.get("temp_bytes") is not None]
    if not pts:
        return None
    B = cc["batch"]
    xs = [p["chunk_size"] or B for p in pts]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(xs, [p["temp_bytes"] / 2**20 for p in pts], "o-", color="C0")
    ax.set_xscale("log", base=2)
    ax.set_xlabel(f"chunk_size (B={B}; None = B)")
    ax.set_ylabel("XLA temp memory (MiB)", color="C0")
    tp = [(x, p["time_median_s"]) for x, p in zip(xs, pts) if p.get("time_median_s")]
    if tp:
        ax2 = ax.twinx()
        ax2.plot([t[0] for t in tp], [t[1] * 1e3 for t in tp], "s--", color="C1")
        ax2.set_ylabel("wall time (ms)", color="C1")
    ax.set_title(f"{cc['regime']}: js second_moment vs chunk_size", fontsize=10)
    fig.tight_layout()
    return _save(plt, fig, img_dir, "bench_chunk_size.png")


# --------------------------------------------------------------------------- #
# Markdown
# --------------------------------------------------------------------------- #
def _f(x, fmt="{:.2f}"):
    if x is None:
        return "–"
    if fmt == "{:.2f}" and 0 < abs(x) < 0.01:
        return f"{x:.2g}"
    return fmt.format(x)


def _mib(b):
    return "–" if b is None else f"{b / 2**20:.1f}"


def _ms(s):
    return "–" if s is None else (f"{s * 1e3:.1f}" if s < 10 else f"{s:.1f} s")


def _mark(met):
    return {True: "met", False: "**MISSED**", None: "not measured"}[met]


def _side_table(intro, head, rows, cells):
    """An explanatory paragraph, then a table of target rows: ``cells(t)`` gives each
    row's values (formatted by `_f`) after its regime and batch; a status column ends it."""
    L = [intro, "", "| regime | B | " + " | ".join(head) + " | status |",
         "|---|---|" + "---|" * (len(head) + 1)]
    for t in rows:
        L.append(f"| {t['regime']} | {t['batch']} | "
                 + " | ".join(_f(v) if not isinstance(v, str) else v for v in cells(t))
                 + f" | {_mark(t['met'])} |")
    L.append("")
    return L


def _equal_memory_floor(targets):
    """The equal-memory time rows beside the plain gradient in the same chunks."""
    rows = [t for t in targets if t["target"] == "equal_mem_time"
            and t.get("grad_chunk_vs_micro_grad") is not None]
    if not rows:
        return []
    L = _side_table(
        "Equal memory: the floor. Any method at micro_grad's memory runs the model one "
        "chunk of B/4 examples at a time; `grad_chunk` is `jax.grad` alone doing that (no "
        "statistic). Its time over micro_grad's is the best ratio any such method can "
        "reach; js's time over it is what the statistics add.",
        ["statistic", "js_chunk / micro_grad", "grad_chunk / micro_grad",
         "js_chunk / grad_chunk"],
        rows,
        lambda t: [t["what"], t["value"], t["grad_chunk_vs_micro_grad"],
                   t["js_chunk_vs_grad_chunk"]],
    )
    missed = [t for t in rows if t["met"] is False]
    floor = [t for t in missed if t["grad_chunk_vs_micro_grad"] > t["threshold"]]
    if missed:
        L.append(f"Of the {len(missed)} missed rows, {len(floor)} have the chunked gradient "
                 f"alone above the {missed[0]['threshold']}x threshold: there micro_grad "
                 "itself adds little to running the model in chunks, so no method computing "
                 "the gradient at that memory can meet the target.")
        L.append("")
    return L


def _fused_floor(targets):
    """mean+second_moment beside each statistic alone (the mean alone is the gradient)."""
    rows = [t for t in targets if t["target"] == "fused_vs_single"
            and t.get("mean_vs_second_moment") is not None]
    if not rows:
        return []
    return _side_table(
        "mean+second_moment against each alone: both at once cannot cost less than the "
        "slower of the two, and on some models js's mean alone (the gradient, through "
        "the same chunks and tile loops) costs more than second_moment alone.",
        ["mean+second_moment / second_moment", "mean / second_moment",
         "mean+second_moment / slower alone"],
        rows,
        lambda t: [t["value"], t["mean_vs_second_moment"], t["vs_slower_alone"]],
    )


def _target_counts(targets):
    """``{description: [met, missed, not measured]}`` in the order targets come."""
    counts = defaultdict(lambda: [0, 0, 0])
    for t in targets:
        counts[t["description"]][0 if t["met"] else (1 if t["met"] is False else 2)] += 1
    return counts


def _targets_side_by_side(doc, other, la, lb):
    """Target counts of ``doc`` (labelled ``la``) beside ``other``'s (``lb``), and every
    target row whose status differs between the two."""
    L = []
    ca, cb = _target_counts(doc["targets"]), _target_counts(other["targets"])
    L.append(f"| target | met / missed, {la} | met / missed, {lb} |")
    L.append("|---|---|---|")
    for d in dict.fromkeys([*ca, *cb]):
        L.append(f"| {d} | {ca[d][0]} / {ca[d][1]} | {cb[d][0]} / {cb[d][1]} |")
    tot = [sum(c[d][i] for d in c) for c in (ca, cb) for i in (0, 1)]
    L.append(f"| **all** | {tot[0]} / {tot[1]} | {tot[2]} / {tot[3]} |")
    L.append("")
    key = lambda t: (t["target"], t["regime"], t["batch"], t["what"])  # noqa: E731
    theirs = {key(t): t for t in other["targets"]}
    diff = [(t, theirs[key(t)]) for t in doc["targets"]
            if key(t) in theirs and t["met"] is not None and theirs[key(t)]["met"] is not None
            and t["met"] != theirs[key(t)]["met"]]
    if diff:
        L.append("Rows whose status differs:")
        L.append("")
        L.append(f"| target | regime | B | what | {la} | {lb} | threshold |")
        L.append("|---|---|---|---|---|---|---|")
        for a, b in diff:
            L.append(f"| {a['description']} | {a['regime']} | {a['batch']} | {a['what']} | "
                     f"{_f(a['value'])} ({_mark(a['met'])}) | {_f(b['value'])} "
                     f"({_mark(b['met'])}) | ≤ {a['threshold']} |")
        L.append("")
    return L


def _compare_section(doc, other, md_dir):
    """Target summary of ``doc`` beside ``other`` (the same suite on another jax)."""
    ja, jb = doc["machine"].get("jax", "?"), other["machine"].get("jax", "?")
    L = [f"## The same targets on jax {jb}", ""]
    src = os.path.relpath(other["_path"], md_dir)
    L.append(f"The suite as above, run on jax {jb} in the same way ([{os.path.basename(src)}]"
             f"({src})). Wall-time ratios move between jax versions (XLA:CPU changes), "
             "FLOPs and temporary memory much less.")
    L.append("")
    return L + _targets_side_by_side(doc, other, f"jax {ja}", f"jax {jb}")


def _lora_section(lora, md_dir):
    """LoRA adapters merged into the weight (``x @ (W + A @ B)``) beside the unmerged form
    (``x @ W + (x @ A) @ B``), run in one process: ratios to each form's own grad."""
    src = os.path.relpath(lora["_path"], md_dir)
    m = lora["machine"]
    rows = {(r["regime"], r["method"], r["statistic"]): r for r in lora["results"] if r["ok"]}
    info = lora["regimes"].get("merged_lora", {})
    L = ["## Merged LoRA", ""]
    L.append(" ".join([
        f"Regime `merged_lora`: {info.get('description', '')}, batch 32.",
        "It multiplies the data by the merged weight `W + (alpha/r) A @ B` (each adapter a",
        "`merged-lora` site: a dense site of the data and the cotangent projected through the",
        "other factor); `lora` is the same function unmerged, `x @ W + (alpha/r) (x @ A) @ B`",
        f"(two dense sites). Both regimes ran in one process ([{os.path.basename(src)}]({src}),",
        "`python -m benchmarks.run --regimes merged_lora lora`); each ratio is to `grad` of its",
        "own form (time / FLOPs / temporary memory). The issue's target: every statistic at",
        "most 1.2x grad for the merged form (before: 1.8-3.2x, exact per-example gradients of",
        "both adapters).",
    ]))
    load = m.get("loadavg_start")
    if load and load[0] > (m.get("cpu_count") or 1):
        L.append("")
        L.append(f"The machine was shared during the run (load average {load[0]:.1f} at the "
                 f"start, {m.get('loadavg_end', [0])[0]:.1f} at the end, on "
                 f"{m.get('cpu_count')} cores): wall-time ratios are noisy; FLOPs and memory "
                 "are exact.")
    L.append("")
    L.append("| method | merged_lora | lora (unmerged) |")
    L.append("|---|---|---|")

    def cell(regime, method, stat):
        r = rows.get((regime, method, stat))
        if r is None:
            return "-"
        if method == "grad":
            return (f"{r['time_median_s'] * 1e3:.1f} ms / {_mib(r['temp_bytes'])} MiB / "
                    f"{r['flops'] / 1e9:.2f} GF")
        return f"{r['time_ratio']:.2f} / {r['flops_ratio']:.2f} / {r['temp_ratio']:.2f}"

    keys = sorted({(r["method"], r["statistic"]) for r in lora["results"]},
                  key=lambda k: (k[0] != "grad", k[0] != "js", k[0], k[1]))
    for method, stat in keys:
        label = "grad" if method == "grad" else f"{method}:{stat}"
        L.append(f"| {label} | {cell('merged_lora', method, stat)} | "
                 f"{cell('lora', method, stat)} |")
    L.append("")
    return L


# methods set side by side under the two allocators (largest batch of each regime)
_ALLOC_COLS = [("js", "second_moment"), ("js", "variance"), ("js", "mean+second_moment"),
               ("js_chunk", "second_moment"), ("micro_grad_mb", "second_moment")]


def _allocator_section(doc, steady, md_dir):
    """The suite under glibc's default malloc (``doc``) beside the same suite with malloc
    keeping freed memory (``steady``): page faults per call, times and targets."""
    src = os.path.relpath(steady["_path"], md_dir)
    L = ["## Page faults: the same suite with a steady allocator", ""]
    L.append(
        "With glibc's default malloc, a freed block above its mmap threshold (which adapts "
        "up to 32 MiB) is returned to the OS, so an XLA:CPU program whose temporary buffer "
        "is larger maps it afresh and page-faults every page of it on every call. The "
        "suite above runs that way (the default of a Python process on Linux). "
        f"[{os.path.basename(src)}]({src}) is the same suite run with "
        "`python -m benchmarks.run --allocator steady` (`MALLOC_ARENA_MAX=1 "
        "MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=2^40`: freed memory stays in the process), "
        "where a call after the first faults next to nothing. On this machine a fault costs "
        "about a microsecond, so the faults are a large part of the time of every program "
        "with more than 32 MiB of temporaries -- `grad` on the transformers above all. "
        "Ratios to `grad` under the default allocator are therefore kinder to the methods "
        "with less temporary memory (js, and js in chunks) than the same computation is on "
        "a machine where memory is reused; the steady run is the fairer compute comparison, "
        "the default run what a user gets without setting anything. In the steady run "
        "`chunk_size=\"auto\"` finds that memory is kept (a probe counting page faults, "
        "once per process) and runs every batch whole, which was the fastest there; "
        "`js_chunk` is still `chunk_size=B/4`."
    )
    L.append("")
    L.append("Largest batch of each regime. Per method: median ms (minor page faults per call, "
             "thousands) under the default allocator → under the steady one; then the ratio to "
             "`grad` of the same run.")
    L.append("")
    heads = ["grad"] + [f"{m}:{s}" for m, s in _ALLOC_COLS]
    L.append("| regime | B | " + " | ".join(heads) + " |")
    L.append("|---|---|" + "---|" * len(heads))

    def find(d, reg, B, m, s):
        return next((r for r in d["results"] if r["regime"] == reg and r["batch"] == B
                     and r["method"] == m and r["statistic"] == s and r["ok"]), None)

    def cell(a, b, ratio):
        if a is None or b is None or a.get("time_median_s") is None:
            return "–"
        fa, fb = a.get("minor_faults_per_call"), b.get("minor_faults_per_call")
        flt = lambda f: "?" if f is None else f"{f / 1e3:.1f}k"  # noqa: E731
        txt = (f"{_ms(a['time_median_s'])} ({flt(fa)}) → "
               f"{_ms(b['time_median_s'])} ({flt(fb)})")
        if ratio:
            txt += f"; {_f(a.get('time_ratio'))}x → {_f(b.get('time_ratio'))}x"
        return txt

    for reg in _regimes(doc):
        Bs = [r["batch"] for r in doc["results"] if r["regime"] == reg]
        B = max(Bs)
        cells = [cell(find(doc, reg, B, "grad", "grad"), find(steady, reg, B, "grad", "grad"),
                      False)]
        cells += [cell(find(doc, reg, B, m, s), find(steady, reg, B, m, s), True)
                  for m, s in _ALLOC_COLS]
        L.append(f"| {reg} | {B} | " + " | ".join(cells) + " |")
    L.append("")
    L.append("Targets under the two allocators:")
    L.append("")
    return L + _targets_side_by_side(doc, steady, "default malloc", "steady malloc")


def render_md(doc, img_paths, md_path, compare=None, steady=None, lora=None):
    """Writes the markdown report of ``doc`` to ``md_path``.

    Args:
      doc: the merged results (`load`).
      img_paths: ``{key: path}`` of the plots (`plot_regimes`), linked relative to the page.
      md_path: the page to write.
      compare: the same suite on another jax (`load` with ``"_path"``), or ``None``.
      steady: the same suite with the steady allocator, or ``None``.
      lora: the ``merged_lora`` and ``lora`` regimes (LoRA adapters, merged and not), or
        ``None``.

    Returns:
      ``md_path``.
    """
    md_dir = os.path.dirname(os.path.abspath(md_path))
    rel = {k: os.path.relpath(v, md_dir) for k, v in img_paths.items()}
    L = (_header_section() + _protocol_section(doc) + _machine_section(doc)
         + _summary_section(doc) + _targets_section(doc) + _per_regime_section(doc, rel)
         + _max_batch_section(doc, rel) + _chunk_curve_section(doc, rel)
         + _tracing_section(doc))
    if lora is not None:
        L += _lora_section(lora, md_dir)
    if steady is not None:
        L += _allocator_section(doc, steady, md_dir)
    if compare is not None:
        L += _compare_section(doc, compare, md_dir)
    L += _long_sequences_section()
    L += _hand_section(TIME_TO_FIRST_STEP_MD)
    L += _errors_section(doc)
    with open(md_path, "w") as f:
        f.write("\n".join(L))
    return md_path


LONG_SEQUENCES_MD = os.path.join(ROOT, "benchmarks", "results", "long_sequences.md")


TIME_TO_FIRST_STEP_MD = os.path.join(ROOT, "benchmarks", "results", "time_to_first_step.md")


def _long_sequences_section():
    """The long-sequence profile (issue 40), written by hand from the shared scale check
    and XLA's cost analysis (it needs presets too slow for this suite), kept in
    `LONG_SEQUENCES_MD`."""
    return _hand_section(LONG_SEQUENCES_MD)


def _hand_section(path):
    """A section written by hand beside its own results (the long-sequence profile,
    the time to the first step: `benchmarks.compile_time`), kept at ``path``."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [f.read().rstrip(), ""]


def _header_section():
    """The title, what is compared and how to reproduce it."""
    L = []
    L.append("# Benchmarks")
    L.append("")
    L.append("<!-- generated by `python -m benchmarks.plot`; edit benchmarks/plot.py, "
             "not this file -->")
    L.append("")
    L.append("Per-example gradient statistics from `jaxpr_surgery.per_example_stat` (`js`) "
             "against plain `jax.grad` of the batch loss (the baseline, ratio 1), "
             "`jax.vmap(jax.grad(per_example_loss))` + the same reduction (`vmap`), and "
             "`optax.microbatching.micro_grad` with `transform_fn`/`metrics_fn` computing the "
             "same statistic, without microbatching (`micro_grad`) and with 4 microbatches "
             "(`micro_grad_mb`, a `fori_loop`); `js_chunk` is `js` with `chunk_size=B/4`, the "
             "same memory trade as `micro_grad_mb`; `js_fused` (GPU runs only) is `js` with "
             "the fused Pallas tile kernel (`JAXPR_SURGERY_TILE_KERNEL=pallas`).")
    L.append("")
    L.append("Reproduce: `python -m benchmarks.run [--quick] [--regimes ...] "
             "[--out benchmarks/results/NAME.json]`, then `python -m benchmarks.plot "
             "[benchmarks/results/NAME.json ...]`.")
    L.append("")
    return L


def _protocol_section(doc):
    """How the numbers are measured, and the run's notes."""
    L = []
    L.append("## Protocol")
    L.append("")
    L.append("* Every method is compiled with `jax.jit(f).lower(params, batch).compile()` in one "
             "process; the compiled executable is timed with `block_until_ready`. Methods of one "
             "(regime, batch size) run interleaved (A B C A B C ...); we report the median.")
    L.append("* FLOPs: `compiled.cost_analysis()['flops']`; memory: "
             "`compiled.memory_analysis().temp_size_in_bytes` (XLA temporaries, excluding "
             "arguments and outputs). Both are deterministic, unlike wall time on this shared "
             "machine. **`cost_analysis` counts a `while` body once**: rows with a loop "
             "(`micro_grad_mb`'s `fori_loop`, every `scan_remat` program, chunked `js`) "
             "under-count FLOPs; they are marked † below.")
    L.append("* Largest batch within a memory budget: compile only (abstract shapes), "
             "secant/bisection search on temp memory; no execution.")
    for n in doc.get("notes", []):
        L.append(f"* {n}")
    L.append("")
    return L


def _machine_section(doc):
    """The machine and software versions of the run."""
    m = doc["machine"]
    L = []
    L.append("## Machine")
    L.append("")
    keys = ["date", "platform", "cpu_model", "cpu_count", "backend", "device_kind", "python",
            "jax", "jaxlib", "optax", "numpy", "jaxpr_surgery", "loadavg_start", "loadavg_end",
            "xla_flags"]
    for k in keys:
        if k in m:
            L.append(f"* {k}: `{m[k]}`")
    L.append(f"* total benchmark wall time: {doc.get('total_wall_s', 0):.0f} s"
             f"{' (quick mode)' if doc.get('quick') else ''}")
    L.append(f"* sources: {', '.join('`' + s + '`' for s in doc.get('sources', []))}")
    if m.get("loadavg_start") and m["loadavg_start"][0] > (m.get("cpu_count") or 1):
        L.append(f"* **Note:** the machine was oversubscribed (load average "
                 f"{m['loadavg_start'][0]:.1f} on {m.get('cpu_count')} cores) -- wall-time "
                 "ratios are noisy (interleaving keeps them comparable, but expect ±20–30%); "
                 "memory and FLOPs are exact.")
    L.append("")
    return L


def _summary_section(doc):
    """Ratios to grad at the largest batch of each regime."""
    L = []
    L.append("## Summary (largest batch size of each regime)")
    L.append("")
    L.append("Wall-time ratios to `grad` (temp-memory ratio in parentheses).")
    L.append("")
    cols = [("js", "second_moment"), ("vmap", "second_moment"), ("js", "sign_mean"),
            ("js", "variance"), ("js", "sq_norms"), ("js", "clipped_mean"),
            ("js", "mean+second_moment"), ("js_chunk", "second_moment"),
            ("micro_grad_mb", "second_moment")]
    L.append("| regime | B | grad ms | " + " | ".join(f"{m}:{s}" for m, s in cols) + " |")
    L.append("|---|---|---|" + "---|" * len(cols))
    for reg in _regimes(doc):
        rows = [r for r in doc["results"] if r["regime"] == reg]
        B = max(r["batch"] for r in rows)
        g = next((r for r in rows if r["batch"] == B and r["method"] == "grad"), None)
        cells = []
        for m_, s_ in cols:
            r = next((x for x in rows if x["batch"] == B and x["method"] == m_
                      and x["statistic"] == s_), None)
            if r is None:
                cells.append("")
            elif not r["ok"]:
                cells.append("ERROR")
            else:
                cells.append(f"{_f(r['time_ratio'])} ({_f(r['temp_ratio'])})")
        L.append(f"| {reg} | {B} | {_ms(g['time_median_s']) if g else '–'} | "
                 + " | ".join(cells) + " |")
    L.append("")
    return L


# why some targets are missed, printed after the targets table
_TARGET_NOTES = (
    (
        "Why the variance and mean+second_moment rows of the token-free MLP "
        "miss: a dense layer's statistic is one matmul "
        "of the weight gradient's size (`(x²)ᵀ(dy²)` for E[g²], `xᵀdy` for the mean), and "
        "the forward matmul is the only "
        "other large cost. Two different bilinear forms of the batch need two matmuls, so "
        "mean+second_moment costs about 3/2 of second_moment alone, and so does the variance "
        "where its raw form `(x²)ᵀ(dy²) - (xᵀdy)²/B` provably keeps its digits (checked "
        "at run time; a float32 batch over 128 examples takes it in groups of at most 128 "
        "merged exactly, so B=256 here costs the same two matmuls plus the merge). On "
        "token-axis layers "
        "the mean rides in the tile loop and the variance takes the same single loop "
        "(shifted by a running mean), so both cost about second_moment alone; so do the "
        "cnn's convolutions, tiled over patches formed one example at a time."
    ),
    (
        "Why some transformer rows of variance or mean+second_moment against "
        "second_moment alone miss, mostly on the large-vocabulary model: on token-axis "
        "sites all three take one tile loop, but the variance updates two running sums "
        "per example (the shifted one-pass sums) where E[g²] updates one. On CPU, under "
        "glibc's default malloc (the run above), the default `chunk_size=\"auto\"` runs a "
        "batch whose temporaries would pass about 32 MiB in chunks, and each chunk "
        "continues the running statistics, which streams them through memory: a chunk "
        "is kept at least 3 times their bytes, so a "
        "statistic with two accumulators (the variance; mean+second_moment) takes larger "
        "chunks, or the whole batch, where second_moment alone takes small ones. The "
        "tied vocabulary-sized table merges each chunk's values afterwards (continuing "
        "them in its feature-blocked tile loop measured slower), a pass over its "
        "accumulators per chunk."
    ),
    (
        "Why the tracing row of clipped_mean costs the most: one-pass clipping needs "
        "every example's norm, and a dense site with tokens takes it as a ghost norm "
        "guarded against cancellation (a loop over the flagged examples alone, which "
        "recomputes their norms exactly; traced and lowered once per distinct dense "
        "site); after the backward pass each leaf then adds its reweighted sum. The guard "
        "was a `lax.cond` around a loop over every example with a `lax.cond` inside "
        "(1.52x grad); the loop over flagged examples alone measured 1.45x. The deeper "
        "model in the tracing table shows the cost per added layer staying close to "
        "grad's."
    ),
)


def _targets_section(doc):
    """Every target row, their counts, the floors beside them and why some miss."""
    L = []
    L.append("## Targets from the issue")
    L.append("")
    L.append("| target | regime | B | what | value | threshold | status |")
    L.append("|---|---|---|---|---|---|---|")
    for t in doc["targets"]:
        L.append(f"| {t['description']} | {t['regime']} | {t['batch']} | {t['what']} | "
                 f"{_f(t['value'])} | ≤ {t['threshold']} | {_mark(t['met'])} |")
    L.append("")
    summ = _target_counts(doc["targets"])
    L.append("Summary (met / missed / not measured):")
    L.append("")
    for d, (a, b, c) in summ.items():
        L.append(f"* {d}: {a} / {b} / {c}")
    L.append("")
    L.extend(_equal_memory_floor(doc["targets"]))
    L.extend(_fused_floor(doc["targets"]))
    for note in _TARGET_NOTES:
        L += [note, ""]
    return L


def _per_regime_section(doc, rel):
    """A table of every method and batch size per regime, with its plot."""
    L = []
    L.append("## Results per regime")
    L.append("")
    L.append("Each cell: wall-time ratio / temp-memory ratio / FLOPs ratio to `grad`; the "
             "`grad` row gives absolute median time (ms), temp memory (MiB) and GFLOPs. "
             "† = program has a `while` loop (FLOPs under-counted).")
    L.append("")
    for reg in _regimes(doc):
        L += _regime_section(doc, reg, rel)
    return L


def _regime_section(doc, reg, rel):
    """One regime: its description, plot, table and compile times."""
    L = []
    rows = [r for r in doc["results"] if r["regime"] == reg]
    info = doc["regimes"].get(reg, {})
    batches = sorted({r["batch"] for r in rows})
    L.append(f"### {reg}")
    L.append("")
    L.append(f"{info.get('description', '')}; "
             f"{info.get('info', {}).get('n_params', '?')} parameters.")
    L.append("")
    if reg in rel:
        L.append(f"![{reg}]({rel[reg]})")
        L.append("")
    L += _regime_table(rows, batches)
    L += _compile_times(rows)
    return L


def _regime_table(rows, batches):
    """Ratios to grad per method (rows) and batch size (columns); grad's row absolute."""
    L = []
    L.append("| method | " + " | ".join(f"B={b}" for b in batches) + " |")
    L.append("|---|" + "---|" * len(batches))
    labels = []
    for r in rows:
        if r["label"] not in labels:
            labels.append(r["label"])
    for lab in labels:
        cells = []
        for b in batches:
            r = next((x for x in rows if x["label"] == lab and x["batch"] == b), None)
            if r is None:
                cells.append("")
            elif not r["ok"]:
                cells.append("ERROR")
            elif r["method"] == "grad":
                cells.append(f"{_ms(r['time_median_s'])} ms / {_mib(r['temp_bytes'])} MiB / "
                             f"{_f((r['flops'] or 0) / 1e9, '{:.3g}')} GF"
                             + (" †" if r.get("has_loop") else ""))
            else:
                cells.append(f"{_f(r['time_ratio'])} / {_f(r['temp_ratio'])} / "
                             f"{_f(r['flops_ratio'])}" + (" †" if r.get("has_loop") else ""))
        L.append(f"| {lab} | " + " | ".join(cells) + " |")
    L.append("")
    return L


def _compile_times(rows):
    """The mean compile time of grad and js in one regime, where both were measured."""
    comp = [r for r in rows if r["ok"] and r.get("compile_s") is not None]
    g = [r for r in comp if r["method"] == "grad"]
    j = [r for r in comp if r["method"] == "js"]
    if not (g and j):
        return []
    gt = sum(r["compile_s"] + r["trace_lower_s"] for r in g) / len(g)
    jt = sum(r["compile_s"] + r["trace_lower_s"] for r in j) / len(j)
    jl = sum(r["trace_lower_s"] for r in j) / len(j)
    return [f"Compile time (trace+lower+compile), mean: grad {gt:.2f} s, js {jt:.2f} s "
            f"(of which trace+lower {jl:.2f} s).", ""]


def _max_batch_section(doc, rel):
    """The largest batch within the memory budget, per regime and method."""
    if not doc.get("max_batch"):
        return []
    L = []
    L.append("## Largest batch within a memory budget")
    L.append("")
    if "max_batch" in rel:
        L.append(f"![max batch]({rel['max_batch']})")
        L.append("")
    L.append("| regime | method | budget (GiB) | largest B | compiles | note |")
    L.append("|---|---|---|---|---|---|")
    for r in doc["max_batch"]:
        note = []
        if r.get("capped"):
            note.append("≥ search cap")
        if r.get("microbatch_size"):
            note.append(f"microbatch {r['microbatch_size']}")
        if r.get("error"):
            note.append("ERROR: " + r["error"].splitlines()[0][:120])
        L.append(f"| {r['regime']} | {r['label']} | {r['budget_bytes'] / 2**30:.3g} | "
                 f"{r['max_batch'] if r['max_batch'] is not None else '–'} | "
                 f"{r['n_compiles']} | {'; '.join(note)} |")
    L.append("")
    return L


def _chunk_curve_section(doc, rel):
    """Temp memory, time and FLOPs of js second_moment against chunk_size."""
    cc = doc.get("chunk_curve")
    if not (cc and cc.get("points")):
        return []
    L = []
    L.append("## `chunk_size` memory curve")
    L.append("")
    L.append(f"`js` second_moment on `{cc['regime']}` at B={cc['batch']}.")
    L.append("")
    if "chunk" in rel:
        L.append(f"![chunk]({rel['chunk']})")
        L.append("")
    L.append("| chunk_size | temp MiB | wall ms | GFLOPs |")
    L.append("|---|---|---|---|")
    for p in cc["points"]:
        L.append(f"| {p['chunk_size']} | {_mib(p.get('temp_bytes'))} | "
                 f"{_ms(p.get('time_median_s'))} | "
                 f"{_f((p.get('flops') or 0) / 1e9, '{:.3g}')}"
                 f"{' †' if p.get('has_loop') else ''}"
                 f"{' ERROR' if p.get('error') else ''} |")
    L.append("")
    return L


def _tracing_section(doc):
    """Trace+lower time of a deep unrolled transformer, per method."""
    L = []
    tr = doc.get("tracing")
    if tr and tr.get("points"):
        L.append("## Tracing cost")
        L.append("")
        L.append(f"`jax.jit(f).lower(params, batch)` of a {tr['layers']}-layer transformer "
                 f"(Python loop over identical layers, {tr['n_leaves']} leaves, B={tr['batch']}), "
                 f"every function built afresh for each of {tr['reps']} interleaved repetitions; "
                 "the fastest is reported. Repeated layers are traced once: each layer-sized "
                 "block of equations is a `jax.jit` cached by its structure, so the later "
                 "layers reuse the first one's trace, linearization, transposition and "
                 "lowering.")
        L.append("")
        L.append("| layers | method | statistic | trace+lower s | ratio to grad |")
        L.append("|---|---|---|---|---|")
        for t in (tr, tr.get("deeper")):
            for p in (t or {}).get("points", []):
                L.append(f"| {t['layers']} | {p['method']} | {p['statistic']} | "
                         f"{p['trace_lower_s']:.3f} | {p['ratio']:.2f}x |")
        L.append("")
    elif tr and tr.get("error"):
        L.append("## Tracing cost")
        L.append("")
        L.append("ERROR: " + tr["error"].splitlines()[0][:300])
        L.append("")
    return L


def _errors_section(doc):
    """The first line of every failed row's error."""
    errs = [r for r in doc["results"] if not r["ok"]]
    if not errs:
        return []
    L = []
    L.append("## Errors")
    L.append("")
    for r in errs:
        first = (r.get("error") or "").splitlines()[0][:300]
        L.append(f"* {r['regime']} B={r['batch']} `{r['label']}`: {first}")
    L.append("")
    return L


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m benchmarks.plot", description=__doc__)
    ap.add_argument("inputs", nargs="*",
                    default=[os.path.join(HERE, "results", "cpu.json")])
    ap.add_argument("--img-dir", default=os.path.join(ROOT, "docs", "img"))
    ap.add_argument("--md", default=os.path.join(ROOT, "docs", "benchmarks.md"))
    ap.add_argument("--no-png", action="store_true")
    ap.add_argument("--compare", default=os.path.join(HERE, "results", "cpu_jax0.10.json"),
                    help="results of the same suite on another jax: its targets are summarised "
                         "beside these (skipped where the file does not exist)")
    ap.add_argument("--steady", default=os.path.join(HERE, "results", "cpu_steady_alloc.json"),
                    help="results of the same suite with --allocator steady: page faults and "
                         "targets set beside these (skipped where the file does not exist)")
    ap.add_argument("--lora", default=os.path.join(HERE, "results", "cpu_lora.json"),
                    help="results of `--regimes merged_lora lora`: a section of their own "
                         "(skipped where the file does not exist)")
    args = ap.parse_args(argv)
    doc = load(args.inputs)

    def side(path):
        if not path or not os.path.exists(path):
            return None
        d = load([path])
        d["_path"] = path
        return d

    paths = {} if args.no_png else plot_regimes(doc, args.img_dir)
    md = render_md(doc, paths, args.md, side(args.compare), side(args.steady), side(args.lora))
    print(f"wrote {md}" + (f" and {len(paths)} PNG(s) in {args.img_dir}" if paths else ""),
          file=sys.stderr)


if __name__ == "__main__":
    main()
