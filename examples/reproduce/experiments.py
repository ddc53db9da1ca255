"""The three experiments, their configurations and summaries.

* ``sign``  -- learning-rate sweep of the four sign placements, with the SNR
  measured at each placement;
* ``adam``  -- learning-rate sweep of adam / micro_adam / micro_adam_var /
  micro_adam_msq, each without and with clipping of the update;
* ``batch`` -- the four Adam variants (each at its best sweep setting) across
  batch sizes with the square-root learning-rate rule and a fixed budget of
  training examples (so ``steps * B`` is constant), and as a control the same
  learning rate at every batch size.

A run is stopped and marked ``diverged`` when a training loss is not finite or
the mean training loss over an evaluation window (``eval_every`` steps)
exceeds 1.5 ln(256); in summaries its final held-out loss counts as ln(256)
(a uniform byte predictor). Single steps above 1.5 ln(256) from which training
recovers are counted in the run's ``spikes``.
"""

from __future__ import annotations

import dataclasses
import itertools
import math

import numpy as np

import jaxpr_surgery as js

from .train import ADAM_OPTIMIZERS, SIGN_OPTIMIZERS, SIGN_PLACEMENT, OptSpec, Trainer

__all__ = ["Config", "DEFAULT", "QUICK", "run_sign", "run_adam", "run_batch", "summarize"]

UNIFORM_LOSS = math.log(256)


@dataclasses.dataclass(frozen=True)
class Config:
    """Sizes of a full study. ``DEFAULT`` finishes in well under an hour on 2 CPU cores."""

    d: int = 64
    heads: int = 4
    layers: int = 2
    seq_len: int = 64  # tokens predicted per example (windows hold seq_len + 1 bytes)
    batch_size: int = 16
    steps: int = 200
    eval_every: int = 20
    eval_windows: int = 128
    seeds: tuple[int, ...] = (0, 1)
    sign_lrs: tuple[float, ...] = (3e-4, 1e-3, 3e-3, 1e-2, 3e-2)
    adam_lrs: tuple[float, ...] = (1e-3, 3e-3, 1e-2, 3e-2)
    batch_sizes: tuple[int, ...] = (8, 16, 32)
    batch_optimizers: tuple[str, ...] = ADAM_OPTIMIZERS
    batch_lr_rules: tuple[str, ...] = ("sqrt", "constant")  # "constant": the control
    max_bytes: int = 2_000_000
    clip_rms: float = 1.0  # update clipped to global norm clip_rms * sqrt(#params)

    def model_cfg(self) -> dict:
        return dict(vocab=256, seq_len=self.seq_len + 1, d=self.d, heads=self.heads,
                    layers=self.layers)

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


DEFAULT = Config()
QUICK = Config(d=16, heads=2, layers=1, seq_len=16, batch_size=4, steps=6, eval_every=3,
               eval_windows=8, seeds=(0,), sign_lrs=(3e-3, 3e-2), adam_lrs=(3e-3, 3e-2),
               batch_sizes=(2, 4), batch_optimizers=("micro_adam_var",),
               max_bytes=200_000)


def capped(loss) -> float:
    """Final held-out loss for summaries: diverged / NaN counts as the uniform predictor."""
    return UNIFORM_LOSS if (loss is None or not math.isfinite(loss)) else min(loss, UNIFORM_LOSS)


def summarize(runs: list[dict]) -> dict:
    """Per optimizer label and learning rate: mean/std over seeds; and each label's best lr."""
    table: dict = {}
    for r in runs:
        table.setdefault(r["label"], {}).setdefault(repr(r["lr"]), []).append(r)
    out = {"by_lr": {}, "best": {}}
    for label, by_lr in table.items():
        rows = {}
        for lr_key, rs in by_lr.items():
            vals = np.array([capped(r["final_eval_loss"]) for r in rs])
            rows[lr_key] = {
                "lr": rs[0]["lr"],
                "mean": float(vals.mean()),
                "std": float(vals.std()),
                "n": len(rs),
                "n_diverged": int(sum(r["diverged"] for r in rs)),
                "spikes": int(sum(r.get("spikes", 0) for r in rs)),
            }
        out["by_lr"][label] = rows
        best = min(rows.values(), key=lambda row: row["mean"])
        out["best"][label] = {"lr": best["lr"], "loss": best["mean"], "std": best["std"]}
    out["ranking"] = sorted(out["best"], key=lambda k: out["best"][k]["loss"])
    return out


def run_key(label: str, lr: float, seed: int, batch_size: int, steps: int) -> tuple:
    return (label, float(lr), int(seed), int(batch_size), int(steps))


def _run(trainer, spec, lr, seed, batch_size, steps, progress, previous):
    """``trainer.run``, or the identical run found in ``previous`` (``--resume``)."""
    old = (previous or {}).get(run_key(spec.label, lr, seed, batch_size, steps))
    if old is not None:
        if progress is not None:
            progress.update(steps)
        return old
    return trainer.run(spec, lr, seed, batch_size=batch_size, steps=steps, progress=progress)


def _sweep(trainer, specs, lrs, cfg, progress, previous=None):
    return [_run(trainer, spec, lr, seed, cfg.batch_size, cfg.steps, progress, previous)
            for spec, lr, seed in itertools.product(specs, lrs, cfg.seeds)]


def sweep_steps(cfg: Config, experiments) -> int:
    """Total training steps of the requested experiments (for the progress bar)."""
    n = 0
    per = len(cfg.seeds) * cfg.steps
    if "sign" in experiments:
        n += len(SIGN_OPTIMIZERS) * len(cfg.sign_lrs) * per
    if "adam" in experiments:
        n += 2 * len(ADAM_OPTIMIZERS) * len(cfg.adam_lrs) * per
    if "batch" in experiments:
        for B in cfg.batch_sizes:
            if B != cfg.batch_size or "adam" not in experiments:
                n += (len(cfg.batch_optimizers) * len(cfg.batch_lr_rules) * len(cfg.seeds)
                      * _steps_for(cfg, B))
    return n


def _steps_for(cfg: Config, B: int) -> int:
    return max(1, round(cfg.steps * cfg.batch_size / B))


def _snr_at_placement(runs: list[dict]) -> dict:
    """Per sign optimizer (at its best lr): the SNR where its sign acts, over training."""
    out = {}
    for r in runs:
        place = SIGN_PLACEMENT[r["optimizer"]]
        d = out.setdefault(r["label"], {}).setdefault(repr(r["lr"]), {
            "placement": place, "lr": r["lr"], "series": []})
        d["series"].append(r["snr"])
    res = {}
    for label, by_lr in out.items():
        res[label] = {}
        for lr_key, d in by_lr.items():
            place = d["placement"]
            med = [np.median([s[f"snr_median_{place}"] for s in series]) for series in d["series"]
                   if series]
            fid = [np.mean([s[f"sign_fidelity_{place}"] for s in series]) for series in d["series"]
                   if series]
            res[label][lr_key] = {
                "placement": place,
                "lr": d["lr"],
                "snr_median_at_placement": float(np.mean(med)) if med else float("nan"),
                "sign_fidelity_at_placement": float(np.mean(fid)) if fid else float("nan"),
            }
    return res


def run_sign(trainer: Trainer, cfg: Config, progress=None, previous=None) -> dict:
    """Experiment 1: the four sign placements over a learning-rate sweep."""
    specs = [OptSpec(n) for n in SIGN_OPTIMIZERS]
    runs = _sweep(trainer, specs, cfg.sign_lrs, cfg, progress, previous)
    summary = summarize(runs)
    snr = _snr_at_placement(runs)
    at_best = {label: {**snr[label][repr(summary["best"][label]["lr"])],
                       "final_eval_loss": summary["best"][label]["loss"]}
               for label in summary["best"]}
    return {
        "description": "sign placement: per-example -> batch mean -> EMA -> update",
        "placement": dict(SIGN_PLACEMENT),
        "b1": 0.9,
        "runs": runs,
        "summary": summary,
        "snr_at_placement": snr,
        "snr_vs_outcome": at_best,
        "latest_placement_wins": summary["ranking"][0] == "sign_ema",
    }


def run_adam(trainer: Trainer, cfg: Config, progress=None, previous=None) -> dict:
    """Experiment 2: Adam's preconditioner variants, without and with update clipping."""
    specs = [OptSpec(n, clip) for clip in (False, True) for n in ADAM_OPTIMIZERS]
    runs = _sweep(trainer, specs, cfg.adam_lrs, cfg, progress, previous)
    summary = summarize(runs)
    return {
        "description": "adam vs micro_adam vs micro_adam_var vs micro_adam_msq; "
                       "'+clip' clips the preconditioned update m/sqrt(v) to global norm "
                       "clip_rms*sqrt(#params) before the learning rate",
        "clip": {"where": "update (after the preconditioner, before the learning rate)",
                 "transform": "optax.clip_by_global_norm",
                 "max_norm": trainer.max_update_norm,
                 "clip_rms": cfg.clip_rms},
        "runs": runs,
        "summary": summary,
    }


def _best_setting(adam_result: dict | None, name: str, default_lr: float):
    """(clip, lr) of ``name``'s best setting in the adam sweep (either clip choice)."""
    if adam_result is None:
        return True, default_lr
    best = adam_result["summary"]["best"]
    cands = [(best[k]["loss"], k.endswith("+clip"), best[k]["lr"])
             for k in (name, name + " +clip") if k in best]
    _, clip, lr = min(cands)
    return clip, lr


def batch_lr(rule: str, base_lr: float, base_batch_size: int, batch_size: int) -> float:
    """The learning rate at ``batch_size`` under ``rule`` ("sqrt" or "constant")."""
    if rule == "sqrt":
        return float(js.optim.sqrt_batch_size_scaling(base_lr, base_batch_size, batch_size))
    if rule == "constant":
        return float(base_lr)
    raise ValueError(f"unknown learning-rate rule {rule!r}")


def run_batch(trainer: Trainer, cfg: Config, adam_result: dict | None, progress=None,
              previous=None) -> dict:
    """Experiment 3: batch sizes with lr = sqrt_batch_size_scaling(best lr, B0, B).

    Each of ``cfg.batch_optimizers`` runs at its best setting of the adam sweep
    (clipped or not, best lr at ``B0 = cfg.batch_size``) for ``cfg.batch_sizes``
    with ``steps * B`` constant. ``cfg.batch_lr_rules`` also holds the control
    ``"constant"`` (the same lr at every B). Runs carry ``lr_rule``.
    """
    B0 = cfg.batch_size
    runs, settings = [], {}
    for name in cfg.batch_optimizers:
        clip, base_lr = _best_setting(adam_result, name, default_lr=cfg.adam_lrs[0])
        spec = OptSpec(name, clip)
        settings[name] = {"label": spec.label, "base_lr": base_lr, "base_batch_size": B0}
        for rule in cfg.batch_lr_rules:
            for B in cfg.batch_sizes:
                lr = batch_lr(rule, base_lr, B0, B)
                steps = _steps_for(cfg, B)
                same = []
                if B == B0 and adam_result is not None:  # reuse the sweep's runs
                    same = [r for r in adam_result["runs"] if r["label"] == spec.label
                            and r["lr"] == base_lr and r["batch_size"] == B0
                            and r["steps"] == steps and r["seed"] in cfg.seeds]
                if len(same) == len(cfg.seeds):
                    runs.extend({**r, "lr_rule": rule} for r in same)
                    continue
                for seed in cfg.seeds:
                    r = _run(trainer, spec, lr, seed, B, steps, progress, previous)
                    runs.append({**r, "lr_rule": rule})
    table = {}
    for r in runs:
        by_name = table.setdefault(r["lr_rule"], {}).setdefault(r["optimizer"], {})
        by_name.setdefault(str(r["batch_size"]), []).append(capped(r["final_eval_loss"]))
    summary = {rule: {name: {B: {"mean": float(np.mean(v)), "std": float(np.std(v)),
                                 "n": len(v)} for B, v in by_b.items()}
                      for name, by_b in by_name.items()}
               for rule, by_name in table.items()}
    return {
        "description": "square-root learning-rate rule across batch sizes at a fixed "
                       "number of training examples (steps * B constant); control: the "
                       "same lr at every batch size ('constant')",
        "base_batch_size": B0,
        "batch_sizes": list(cfg.batch_sizes),
        "lr_rules": list(cfg.batch_lr_rules),
        "examples_budget": cfg.steps * B0,
        "settings": settings,
        "runs": runs,
        "summary": summary,
    }
