"""Benchmark suite: per-example gradient statistics vs ``jax.grad``, ``vmap(grad)``
and ``optax.microbatching.micro_grad``.

Usage::

    python -m benchmarks.run                      # -> benchmarks/results/<platform>.json/.csv
    python -m benchmarks.run --quick --out /tmp/q.json
    python -m benchmarks.run --regimes mlp short  # a subset of regimes
    python -m benchmarks.plot                     # PNGs in docs/img/, table in docs/benchmarks.md

Protocol (the project's benchmarking protocol, docs/benchmarks.md): every method is compiled with
``jax.jit(...).lower(...).compile()`` in this one process and the compiled
executable is what is timed; methods of one (regime, batch size) are run
*interleaved* (A B C A B C ...) and we report medians and ratios to plain
``jax.grad`` of the same batch loss. Besides wall time we record XLA's compiled
FLOPs (``compiled.cost_analysis()``) and temporary memory
(``compiled.memory_analysis().temp_size_in_bytes``), which are stable on a
noisy machine. Caveat: ``cost_analysis`` counts the body of a ``while`` loop
(``lax.fori_loop`` in ``micro_grad`` with microbatching, ``lax.scan`` over
layers or chunks) once, so FLOPs of looped programs are under-counted; each
row records ``has_loop`` so such numbers can be discounted.

Methods (``method`` x ``statistic``):

* ``grad`` -- ``jax.grad(loss)(params, batch)``, the baseline (statistic ``grad``).
* ``js`` -- ``jaxpr_surgery.per_example_stat(loss, stat)``.
* ``vmap`` -- ``jax.vmap(jax.grad(per_example_loss))`` then the same reduction.
* ``micro_grad`` -- ``optax.microbatching.micro_grad(loss, transform_fn=...,
  metrics_fn=..., accumulator=MEAN)`` without microbatching (one vmap).
* ``micro_grad_mb`` -- the same with ``microbatch_size=B // 4`` (a
  ``fori_loop`` over 4 microbatches): memory traded for time.

Statistics: ``mean, second_moment, variance, sign_mean, sq_norms,
clipped_mean`` and ``mean+second_moment`` (a tuple, one pass).

Also recorded: the largest batch whose temporary memory fits a budget (found by
compiling at abstract shapes only -- a bracketing secant/bisection search on
``memory_analysis``, no execution), and for the ``short`` transformer the
temporary memory (and time) of ``second_moment`` against ``chunk_size``, and
the trace+lower time of a 12-layer unrolled transformer and of a 48-layer one
(``--no-tracing`` skips them).

Each row also records ``minor_faults_per_call``: the process's minor page faults
per timed call. With glibc's default malloc, a freed buffer above its mmap
threshold (at most 32 MiB) goes back to the OS, so a program whose XLA temporary
buffer is larger page-faults all of it on every call; on the 2-core machine of
docs/benchmarks.md a fault costs about 1 microsecond, so 100 MiB of temporary
memory adds about 25 ms a call. ``--allocator steady`` runs the suite with malloc
keeping freed memory (`STEADY_ALLOCATOR_ENV`) and writes
``<platform>_steady_alloc.json``; docs/benchmarks.md sets the two side by side.

A method that fails records its error in the JSON; the run goes on.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import platform
import sys
import time

import jax

from benchmarks import protocol
from benchmarks.methods import ALL_STATS, BASELINES, CLIP_NORM, N_MICROBATCHES
from benchmarks.output import (
    SCHEMA_VERSION,
    STEADY_ALLOCATOR_ENV,
    allocator_info,
    default_out,
    machine_info,
    write_outputs,
)
from benchmarks.protocol import _err, log, run_config, settings
from benchmarks.regimes import EVERYTHING_PLAN, QUICK_DEFAULT_REGIMES, regimes
from benchmarks.sweeps import run_chunk_curve, run_maxbatch, run_tracing
from benchmarks.targets import evaluate_targets

# the notes of every results file (settings.* are the fields of `protocol.Settings`)
NOTES = [
    "time_ratio / flops_ratio / temp_ratio are relative to method 'grad' "
    "(jax.grad of the batch loss) at the same regime and batch size.",
    "XLA cost_analysis counts while-loop bodies (lax.fori_loop in micro_grad_mb, "
    "lax.scan over layers or chunks) once: FLOPs of rows with has_loop=true are "
    "under-counted.",
    "micro_grad_mb uses microbatch_size = B // 4 (4 microbatches); in the max-batch "
    "search its microbatch size is fixed to (largest benchmarked B) // 4.",
    "Wall times on a shared CPU are noisy; temp memory and FLOPs are deterministic.",
    "grad_chunk is jax.grad run over chunks of B // 4 examples in a lax.scan (the "
    "chunk of js_chunk and micro_grad_mb): the time any method at that memory spends "
    "running the model, before any statistic; equal_mem_time targets carry it as "
    "grad_chunk_vs_micro_grad and js_chunk_vs_grad_chunk.",
    "Statistics per method (time budget): js every statistic at every batch size; "
    "vmap every statistic at the smallest batch size of a regime and second_moment, "
    "sq_norms at larger ones; micro_grad and micro_grad_mb second_moment and "
    "sq_norms at the smallest batch size and second_moment at larger ones "
    "(--all-baseline-stats: everything everywhere). Quick mode runs a reduced set.",
    "A warmup call slower than settings.slow_s counts as a timing sample (slow "
    "methods get fewer repeats); repeats stop after settings.time_cap_s per method "
    "once settings.min_reps are taken. A sample of a faster method is the mean of "
    "calls_per_sample calls (about 20 ms of them, each waited for), so sub-millisecond "
    "programs are not timed one call at a time.",
]


def main(argv=None):
    """Runs the suite as the command line ``argv`` asks; returns the results document."""
    ap = _parser()
    args = ap.parse_args(argv)
    if args.allocator == "steady" and allocator_info()["mode"] != "steady":
        if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
            ap.error("--allocator steady sets glibc malloc's environment variables; this "
                     f"process runs on {platform.system()} {platform.libc_ver()[0] or ''}.")
        raise SystemExit(_reexec_steady(list(sys.argv[1:] if argv is None else argv)))

    st = settings(args.quick, args)
    protocol.set_compiler_options(st.compiler_options)
    regs = regimes(args.quick)
    names = args.regimes or (QUICK_DEFAULT_REGIMES if args.quick else list(regs))
    bad = [n for n in names if n not in regs]
    if bad:
        ap.error(f"unknown regime(s) {bad}; choose from {list(regs)}")
    out_path = args.out or default_out(args.allocator)

    t_start = time.perf_counter()
    doc = _new_doc(args, st)
    for name in names:
        if not _run_regime(doc, name, regs[name], args, st):
            continue
        doc["targets"] = evaluate_targets(doc["results"], doc["tracing"])
        doc["total_wall_s"] = time.perf_counter() - t_start
        write_outputs(doc, out_path)
        jax.clear_caches()
        gc.collect()

    if not args.no_tracing and not args.regimes:
        log("== tracing cost")
        try:
            doc["tracing"] = run_tracing(st)
        except Exception as e:  # noqa: BLE001
            doc["tracing"] = {"error": _err(e)}
    _finish(doc, out_path, t_start)
    return doc


def _parser():
    ap = argparse.ArgumentParser(prog="python -m benchmarks.run",
                                 description=" ".join(__doc__.split("\n\n")[0].split()))
    ap.add_argument("--quick", action="store_true", help="tiny models, one batch size, 1-2 repeats")
    ap.add_argument("--out", default=None, help="JSON path (CSV written next to it)")
    ap.add_argument("--regimes", nargs="+", default=None,
                    help="subset of: mlp cnn short long vocab scan_remat matrix")
    ap.add_argument("--reps", type=int, default=None, help="max repeats per method")
    ap.add_argument("--budget-mib", type=float, default=None, help="memory budget, MiB")
    ap.add_argument("--compiler-options", default=None,
                    help="JSON dict of XLA compile options, e.g. "
                         '\'{"xla_backend_optimization_level": 0}\'')
    ap.add_argument("--no-maxbatch", action="store_true")
    ap.add_argument("--no-chunk", action="store_true")
    ap.add_argument("--no-tracing", action="store_true",
                    help="skip the trace+lower timing of a deep unrolled transformer")
    ap.add_argument("--all-baseline-stats", action="store_true",
                    help="run every statistic for vmap/micro_grad at every batch size")
    ap.add_argument("--allocator", choices=["default", "steady"], default="default",
                    help="steady: run with glibc malloc keeping freed memory (one arena, no "
                         "mmap, no trim), so that no call page-faults its temporary buffers; "
                         "results go to <platform>_steady_alloc.json unless --out is given")
    return ap


def _reexec_steady(argv):
    """Runs this command again in a process with `STEADY_ALLOCATOR_ENV` (malloc reads
    it at start-up) and returns its exit code."""
    import subprocess

    env = dict(os.environ, **STEADY_ALLOCATOR_ENV)
    return subprocess.call([sys.executable, "-m", "benchmarks.run", *argv], env=env)


def _new_doc(args, st):
    """The results document before any measurement."""
    return {
        "schema_version": SCHEMA_VERSION,
        "quick": args.quick,
        "machine": machine_info(),
        "settings": {k: v for k, v in dataclasses.asdict(st).items()},
        "statistics": ALL_STATS,
        "methods": ["grad", "js"] + BASELINES + ["grad_chunk"],
        "clip_norm": CLIP_NORM,
        "n_microbatches": N_MICROBATCHES,
        "notes": list(NOTES),
        "regimes": {},
        "results": [],
        "max_batch": [],
        "chunk_curve": None,
        "tracing": None,
        "targets": [],
    }


def _run_regime(doc, name, reg, args, st):
    """Every batch size of one regime, then its largest batch and chunk_size curve, into
    ``doc``; ``False`` where its model could not be built."""
    t_reg = time.perf_counter()
    log(f"== regime {name}: {reg.description}, batches {reg.batches}")
    try:
        model = reg.build()
    except Exception as e:  # noqa: BLE001
        doc["regimes"][name] = {"description": reg.description, "error": _err(e)}
        return False
    doc["regimes"][name] = {"description": reg.description, "batches": reg.batches,
                            "info": model.info}
    reg_rows = []
    if args.all_baseline_stats:
        reg.plan = EVERYTHING_PLAN
    for i, B in enumerate(reg.batches):
        reg_rows += run_config(model, reg, B, reg.entries(i), st)
    doc["results"] += reg_rows
    if not args.no_maxbatch and reg.maxbatch:
        doc["max_batch"] += run_maxbatch(model, reg, reg_rows, st)
    if not args.no_chunk and name == st.chunk_regime:
        try:
            doc["chunk_curve"] = run_chunk_curve(model, reg, st)
        except Exception as e:  # noqa: BLE001
            doc["chunk_curve"] = {"error": _err(e)}
    doc["regimes"][name]["wall_s"] = time.perf_counter() - t_reg
    log(f"== regime {name} done in {doc['regimes'][name]['wall_s']:.1f}s")
    return True


def _finish(doc, out_path, t_start):
    """The load average at the end, the targets and the files; a one-line summary."""
    try:
        doc["machine"]["loadavg_end"] = list(os.getloadavg())
    except OSError:
        pass
    doc["targets"] = evaluate_targets(doc["results"], doc["tracing"])
    doc["total_wall_s"] = time.perf_counter() - t_start
    csv_path = write_outputs(doc, out_path)
    n_err = sum(1 for r in doc["results"] if not r["ok"])
    met = [t for t in doc["targets"] if t["met"] is True]
    missed = [t for t in doc["targets"] if t["met"] is False]
    log(f"wrote {out_path} and {csv_path}: {len(doc['results'])} rows ({n_err} errors), "
        f"targets met {len(met)}, missed {len(missed)}, total {doc['total_wall_s']:.1f}s")


if __name__ == "__main__":
    main()
