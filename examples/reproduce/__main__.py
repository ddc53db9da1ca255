"""Command line of the reproduction study (see :mod:`examples.reproduce.study`).

    python -m examples.reproduce [--quick] [--out DIR] [--experiments sign adam sqrt_b]
                                 [--resume] [--replot] [files ...]

Writes ``<out>/study.json`` (configuration, data, every run, the summaries; saved
after every experiment) and the figures of :mod:`examples.reproduce.plots`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import platform
import tempfile
import time
from pathlib import Path

from .. import quick_xla_flags

EXPERIMENTS = ("sign", "adam", "sqrt_b")


def clean(x):
    """JSON-safe copy: NaN/inf -> None, tuples -> lists, keys -> str."""
    if isinstance(x, dict):
        return {str(k): clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [clean(v) for v in x]
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


def main(argv=None) -> dict:
    """Runs the study as the command line ``argv`` asks; returns its document."""
    args = _parser().parse_args(argv)
    quick_xla_flags(args.quick)  # (--quick: XLA's lower CPU optimisation level)

    from . import study
    from .data import load_corpus

    cfg = _config(args, study)
    out = _out_dir(args)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "study.json"
    if args.replot:
        doc = json.loads(path.read_text())
        _figures(doc, out)
        return doc

    corpus = load_corpus(args.files or None, cfg.max_bytes)
    doc, previous, earlier_seconds = _start(args, cfg, corpus, path)
    runner = study.Runner(cfg, corpus, previous)
    t0 = time.perf_counter()
    _run_experiments(doc, args.experiments, cfg, runner, path)
    if runner.reused:
        print(f"reused {runner.reused} runs of the earlier study")
    doc["seconds"] = round(time.perf_counter() - t0 + earlier_seconds, 1)
    path.write_text(json.dumps(doc, indent=1) + "\n")
    _figures(doc, out)
    return doc


def _parser():
    ap = argparse.ArgumentParser(
        prog="python -m examples.reproduce",
        description="Test the optimizer claims of Roulet & Agarwala (arXiv 2510.00236) on a "
                    "byte-level LM with paired seeds, tuned rates and bootstrap intervals.")
    ap.add_argument("files", nargs="*",
                    help="text files to train on (default: the Python standard library)")
    ap.add_argument("--quick", action="store_true", help="tiny everything: a smoke test")
    ap.add_argument("--out", type=Path, default=None,
                    help="output folder (default: examples/results, or a temporary folder "
                         "with --quick)")
    ap.add_argument("--experiments", nargs="+", choices=EXPERIMENTS, default=list(EXPERIMENTS))
    ap.add_argument("--steps", type=int, default=None, help="override the number of steps")
    ap.add_argument("--seeds", type=int, default=None, help="override the number of seeds")
    ap.add_argument("--resume", action="store_true",
                    help="keep the experiments of --out/study.json run with this configuration; "
                         "after a grid or seed change, reuse its finished runs")
    ap.add_argument("--replot", action="store_true", help="only redraw the figures")
    return ap


def _config(args, study):
    """The study's configuration (quick or full) with the command line's overrides."""
    cfg = study.QUICK if args.quick else study.Config()
    if args.steps is not None:
        cfg = dataclasses.replace(cfg, steps=args.steps)
    if args.seeds is not None:
        cfg = dataclasses.replace(cfg, seeds=tuple(range(args.seeds)))
    return cfg


def _out_dir(args):
    here = Path(__file__).resolve().parent.parent / "results"
    return args.out or (Path(tempfile.gettempdir()) / "jaxpr_surgery_reproduce_quick"
                        if args.quick else here)


def _figures(doc, out):
    try:
        from . import plots
    except ImportError:  # matplotlib is an optional extra
        print("matplotlib not installed: no figures")
        return
    for name in plots.plot_all(doc, out):
        print(f"wrote {out / name}")


def _start(args, cfg, corpus, path):
    """The document to fill: the earlier one at ``path`` under ``--resume`` where its
    configuration is this one, else a new one. Returns it with the earlier runs to reuse
    (after a grid or seed change) and the seconds they took."""
    import jax

    from . import study

    config = clean(dataclasses.asdict(cfg))
    doc, previous, earlier_seconds = {}, [], 0.0
    if args.resume and path.exists():
        old = json.loads(path.read_text())
        if old.get("config") == config:
            doc = old  # finished experiments are kept whole
        else:  # a widened grid: experiments are summarised again, finished runs reused
            previous = study.reusable_runs(old, config, corpus.info())
            earlier_seconds = old.get("seconds", 0.0) if previous else 0.0
    doc.update({
        "config": config,
        "data": corpus.info(),
        "environment": {"jax": jax.__version__, "python": platform.python_version(),
                        "backend": jax.default_backend()},
    })
    doc.setdefault("experiments", {})
    return doc, previous, earlier_seconds


def _run_experiments(doc, names, cfg, runner, path):
    """Runs each experiment of ``names`` not yet in ``doc``, saving ``doc`` after each."""
    from . import study

    for name in EXPERIMENTS:
        if name not in names or name in doc["experiments"]:
            continue
        if name == "sign":
            res = study.run_sign(runner, cfg)
        elif name == "adam":
            res = study.run_adam(runner, cfg)
        else:
            if "adam" not in doc["experiments"]:
                print("sqrt_b needs the adam experiment's best rate: run it first")
                continue
            best = doc["experiments"]["adam"]["best"]
            res = study.run_sqrt_b(runner, cfg, best)
        doc["experiments"][name] = clean(res)
        print(f"{name}: {res['verdict']}")
        path.write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
