"""Command line of the reproduction.

    python -m examples.reproduce [--quick] [--out DIR] [--experiments ...] [files ...]

Writes ``<out>/<experiment>.json`` for each experiment, ``<out>/results.json``
(configuration, data, timings, the summaries of every experiment) and the PNG
figures of :mod:`examples.reproduce.plots`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import re
import sys
import tempfile
import time
from pathlib import Path

# jax is imported in main(), after the arguments: --quick lowers XLA's CPU
# optimisation level (compilation dominates a quick run; set XLA_FLAGS to override).
QUICK_XLA_FLAGS = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"

EXPERIMENTS = ("sign", "adam", "batch")


def _clean(x):
    """JSON-safe copy: NaN/inf -> None, tuples -> lists."""
    if isinstance(x, dict):
        return {str(k): _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


_NUMBER_LIST = re.compile(r"\[\s+([-+0-9.eE,\snul]+?)\s+\]")


def _write(path: Path, obj) -> None:
    """Indented JSON with lists of numbers kept on one line."""
    text = json.dumps(_clean(obj), indent=1)
    text = _NUMBER_LIST.sub(lambda m: "[" + ", ".join(m.group(1).split()).replace(",,", ",")
                            + "]", text)
    path.write_text(text + "\n")


def _load(path: Path):
    """Reads a JSON written by :func:`_write` (non-finite numbers are ``None`` there)."""
    return json.loads(path.read_text())


def _own_runs(name: str, res: dict) -> list:
    """The runs of an experiment that it trained (batch reuses the adam sweep at B0)."""
    if name != "batch":
        return res["runs"]
    own, seen = [], set()
    for r in res["runs"]:  # B0 runs come from the adam sweep; the rules share them
        key = (r["label"], r["lr"], r["seed"], r["batch_size"], r["steps"])
        if r["batch_size"] != res["base_batch_size"] and key not in seen:
            seen.add(key)
            own.append(r)
    return own


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(
        prog="python -m examples.reproduce",
        description="Reproduce the sign-placement and Adam-preconditioner findings of "
                    "Roulet & Agarwala (arXiv 2510.00236) on a byte-level LM.")
    ap.add_argument("files", nargs="*",
                    help="text files to train on (default: the Python standard library)")
    ap.add_argument("--quick", action="store_true",
                    help="tiny everything (1 seed, 2 learning rates, a few steps): < 1 min")
    ap.add_argument("--out", type=Path, default=None,
                    help="output folder (default: examples/results, or "
                         "<tmp>/jaxpr_surgery_reproduce_quick with --quick)")
    ap.add_argument("--experiments", nargs="+", choices=EXPERIMENTS, default=list(EXPERIMENTS))
    ap.add_argument("--steps", type=int, default=None, help="override the number of steps")
    ap.add_argument("--seeds", type=int, default=None, help="override the number of seeds")
    ap.add_argument("--max-bytes", type=int, default=None, help="override the byte cap")
    ap.add_argument("--batch-size", type=int, default=None, help="override the sweep batch size")
    ap.add_argument("--sign-lrs", type=float, nargs="+", default=None,
                    help="override the sign learning-rate grid")
    ap.add_argument("--adam-lrs", type=float, nargs="+", default=None,
                    help="override the Adam learning-rate grid")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    ap.add_argument("--resume", action="store_true",
                    help="reuse the runs already in --out/<experiment>.json that this "
                         "configuration would repeat identically (same model, data, steps, "
                         "batch size, lr, seed); run only the missing ones")
    ap.add_argument("--replot", action="store_true",
                    help="only redraw the figures from the JSON files already in --out")
    args = ap.parse_args(argv)
    if args.quick and "XLA_FLAGS" not in os.environ and "jax" not in sys.modules:
        os.environ["XLA_FLAGS"] = QUICK_XLA_FLAGS

    import jax
    from tqdm.auto import tqdm

    from . import plots
    from .data import load_corpus
    from .experiments import (
        DEFAULT,
        QUICK,
        run_adam,
        run_batch,
        run_key,
        run_sign,
        sweep_steps,
    )
    from .train import Trainer

    cfg = QUICK if args.quick else DEFAULT
    if args.steps is not None:
        cfg = dataclasses.replace(cfg, steps=args.steps)
    if args.seeds is not None:
        cfg = dataclasses.replace(cfg, seeds=tuple(range(args.seeds)))
    for field in ("max_bytes", "batch_size", "sign_lrs", "adam_lrs"):
        value = getattr(args, field)
        if value is not None:
            cfg = dataclasses.replace(cfg, **{field: tuple(value) if isinstance(value, list)
                                              else value})
    here = Path(__file__).resolve().parent.parent / "results"
    quick_out = Path(tempfile.gettempdir()) / "jaxpr_surgery_reproduce_quick"
    out = args.out or (quick_out if args.quick else here)
    out.mkdir(parents=True, exist_ok=True)
    experiments = [e for e in EXPERIMENTS if e in args.experiments]
    if args.replot:
        for name in experiments:
            if (out / f"{name}.json").exists():
                figs = getattr(plots, f"plot_{name}")(_load(out / f"{name}.json"), out)
                print(f"{name}: wrote {', '.join(figs)}")
        return {}

    t_start = time.perf_counter()
    corpus = load_corpus(args.files or None, max_bytes=cfg.max_bytes)
    trainer = Trainer(corpus, cfg.model_cfg(), eval_windows=cfg.eval_windows,
                      eval_every=cfg.eval_every, clip_rms=cfg.clip_rms)
    meta = {
        "command": "python -m examples.reproduce " + " ".join(argv if argv is not None
                                                              else sys.argv[1:]),
        "quick": args.quick,
        "config": cfg.to_json(),
        "data": corpus.info(),
        "model": {**cfg.model_cfg(), "n_params": trainer.n_params},
        "platform": {"python": platform.python_version(), "jax": jax.__version__,
                     "backend": jax.default_backend(), "machine": platform.machine()},
        "experiments": {},
    }
    print(f"data: {corpus.info()}\nmodel: {trainer.n_params} parameters; experiments: "
          f"{experiments}; output: {out}", flush=True)

    previous = {name: {} for name in EXPERIMENTS}
    if args.resume and (out / "results.json").exists():
        old = _load(out / "results.json")
        same = ("steps", "batch_size", "eval_every", "eval_windows", "max_bytes", "clip_rms")
        if (old.get("model") != _clean(meta["model"]) or old.get("data") != meta["data"]
                or any(old["config"][k] != meta["config"][k] for k in same)):
            raise SystemExit(f"--resume: {out}/results.json was written with another model, "
                             "data or schedule; use another --out.")
        for name in experiments:
            if (out / f"{name}.json").exists():
                for r in _load(out / f"{name}.json")["runs"]:
                    if r["diverged"]:
                        continue  # re-run: cheap (stopped early), and the stopping rule changed
                    if "spikes" not in r:  # written before spikes were counted: none occurred
                        r["spikes"] = 0
                    key = run_key(r["label"], r["lr"], r["seed"], r["batch_size"], r["steps"])
                    previous[name][key] = r
        meta["invocations"] = old.get("invocations", [])
        meta["experiments"] = {k: v for k, v in old.get("experiments", {}).items()
                               if k not in experiments}  # kept as they were
        print(f"--resume: reusing {sum(map(len, previous.values()))} runs", flush=True)

    bar = tqdm(total=sweep_steps(cfg, experiments), unit="step", disable=args.no_progress,
               dynamic_ncols=True, mininterval=2.0)
    results = {}
    for name in experiments:
        t0 = time.perf_counter()
        bar.set_description(name)
        if name == "sign":
            res = run_sign(trainer, cfg, bar, previous["sign"])
        elif name == "adam":
            res = run_adam(trainer, cfg, bar, previous["adam"])
        else:
            adam = results.get("adam")
            if adam is None and (out / "adam.json").exists():
                adam = _load(out / "adam.json")
            res = run_batch(trainer, cfg, adam, bar, previous["batch"])
        res["seconds"] = round(time.perf_counter() - t0, 1)
        results[name] = res
        _write(out / f"{name}.json", res)
        figs = getattr(plots, f"plot_{name}")(res, out)
        meta["experiments"][name] = {
            "json": f"{name}.json",
            "figures": figs,
            "seconds": res["seconds"],
            "sum_of_run_seconds": round(sum(r["seconds"] for r in _own_runs(name, res)), 1),
            "summary": res["summary"],
            **({"snr_vs_outcome": res["snr_vs_outcome"],
                "latest_placement_wins": res["latest_placement_wins"]} if name == "sign" else {}),
        }
        _write(out / "results.json", {**meta, "seconds": round(time.perf_counter() - t_start, 1)})
    bar.close()
    meta["seconds"] = round(time.perf_counter() - t_start, 1)
    new_runs = sum(run_key(r["label"], r["lr"], r["seed"], r["batch_size"], r["steps"])
                   not in previous[n] for n in experiments for r in _own_runs(n, results[n]))
    meta["invocations"] = meta.get("invocations", []) + [
        {"command": meta["command"], "seconds": meta["seconds"], "new_runs": new_runs}]
    _write(out / "results.json", meta)
    print(f"done in {meta['seconds']:.0f} s; results in {out}", flush=True)
    for name in experiments:
        s = results[name]["summary"]
        if "ranking" in s:
            best = s["best"]
            print(f"{name}: " + ", ".join(f"{k} {best[k]['loss']:.3f} (lr {best[k]['lr']:g})"
                                          for k in s["ranking"]))
    return meta


if __name__ == "__main__":
    main()
