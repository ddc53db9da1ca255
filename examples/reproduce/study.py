"""A study that can decide: the paper's claims on a byte-level LM, with paired seeds.

Roulet & Agarwala (arXiv 2510.00236) make two claims about optimizers fed by
per-example gradients, plus a batch-size rule:

* **sign** -- in the chain per-example gradients -> batch mean -> EMA -> update, the
  sign belongs as late as possible (``sign_ema``, Signum), because averaging raises
  the signal-to-noise ratio. Probed directly: at every evaluation, the agreement of
  each update's sign with the signs of two independent 512-example reference
  gradients (their agreement with each other is the ceiling). A ``sign_ema`` beta
  ablation checks that the EMA, not the placement alone, carries the effect.
* **adam** -- Adam works best when its preconditioner v is dominated by the squared
  mean: a dose-response over v = mu^2 + lambda sigma^2 with lambda ~ 0
  (``micro_adam_msq``, kappa-floored), 1/B (``adam``), 1 (``micro_adam``) and the
  variance alone (``micro_adam_var``).
* **sqrt_b** -- Malladi et al.'s square-root rule (learning rate x sqrt(kappa), EMA
  horizons and eps rescaled) should make Adam's loss curves collapse against
  *examples seen* across batch sizes; the control keeps every hyperparameter.

Design: every run of seed s starts from the same initialisation and sees the same
data order, whatever the optimizer, so differences are paired; each optimizer gets
a learning-rate grid, and the best rate is checked to be interior; paired
differences at each optimizer's best rate get bootstrap 95% intervals over seeds.
``summarize`` states, per claim, whether the intervals decide it.

    python -m examples.reproduce              # the full study (~1 h on 2 CPU cores)
    python -m examples.reproduce --quick      # a smoke test (about a minute)

Writes ``study.json`` (configuration, data, every run, the summaries) and PNG
figures into ``examples/results/`` (``--out`` to change).
"""

from __future__ import annotations

import dataclasses
import math
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxpr_surgery as js

from . import model

UNIFORM_LOSS = math.log(256)
SIGN = ("per_example_sign_sgd", "sign_sgd", "ema_of_sign", "sign_ema")
#: v = mu^2 + lambda sigma^2, in increasing lambda
ADAM = ("micro_adam_msq", "adam", "micro_adam", "micro_adam_var")
PLACEMENT = {"per_example_sign_sgd": "per-example", "sign_sgd": "batch mean",
             "ema_of_sign": "batch mean (EMA after)", "sign_ema": "EMA of batch means"}


@dataclasses.dataclass(frozen=True)
class Config:
    """Sizes of the study (the defaults are the full study)."""

    d: int = 64
    heads: int = 4
    layers: int = 2
    seq_len: int = 64
    batch_size: int = 16
    steps: int = 1000
    eval_every: int = 200
    eval_windows: int = 128
    seeds: tuple = (0, 1, 2)
    b1: float = 0.9
    b2: float = 0.95
    kappa: float = 1.0  # micro_adam_msq's floor
    sign_lrs: tuple = (1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 1e-1)
    adam_lrs: tuple = (1e-3, 3e-3, 1e-2, 3e-2)
    sign_ema_betas: tuple = (0.5,)  # ablation beside b1
    probe_examples: int = 512
    batch_sizes: tuple = (8, 16, 32)
    max_bytes: int = 2_000_000
    bootstrap: int = 10_000

    def model_cfg(self):
        return dict(vocab=256, seq_len=self.seq_len + 1, d=self.d, heads=self.heads,
                    layers=self.layers)


QUICK = Config(d=16, heads=2, layers=1, seq_len=16, batch_size=4, steps=6, eval_every=3,
               eval_windows=8, seeds=(0, 1), sign_lrs=(1e-3, 1e-2), adam_lrs=(1e-3, 1e-2),
               sign_ema_betas=(0.5,), probe_examples=8, batch_sizes=(2, 4), max_bytes=200_000,
               bootstrap=200)


# --------------------------------------------------------------------------- #
# Optimizers (a unit schedule: the peak rate multiplies the update in the step)
# --------------------------------------------------------------------------- #
def schedule(steps):
    return optax.warmup_cosine_decay_schedule(0.0, 1.0, max(1, steps // 20), max(steps, 2),
                                              end_value=0.1)


def build(label, cfg: Config, steps: int, hp: dict | None = None):
    """The optimizer of ``label`` (``name`` or ``name b1=x``) with a unit schedule."""
    name, _, beta = label.partition(" b1=")
    b1 = float(beta) if beta else cfg.b1
    jso = js.optim
    sched = schedule(steps)
    if name in ("per_example_sign_sgd", "ema_of_sign", "sign_ema"):
        return getattr(jso, name)(sched, b1=b1)
    if name == "sign_sgd":
        return jso.sign_sgd(sched)
    hp = hp or {}
    kw = dict(b1=hp.get("b1", b1), b2=hp.get("b2", cfg.b2), eps=hp.get("eps", 1e-8))
    if name == "micro_adam_msq":
        kw["kappa"] = cfg.kappa
    tx = getattr(jso, "scale_by_" + name)(**kw)
    return jso.chain(tx, optax.scale_by_learning_rate(sched))


class Runner:
    """Trains the LM; compiled steps cached per (label, steps, batch size, hp)."""

    def __init__(self, cfg: Config, corpus, previous_runs=()):
        self.cfg = cfg
        self.corpus = corpus
        #: finished runs of an earlier study of the same model, data and training length
        #: (``--resume`` after a grid was widened): a run with the same key is not redone
        self._previous = {run_key(r): r for r in previous_runs}
        self.reused = 0
        self.eval_batch = corpus.heldout_windows(cfg.eval_windows, cfg.seq_len)
        rng = np.random.default_rng(10_000)  # probes: training windows no run draws first
        probes = corpus.batches(rng, cfg.probe_examples, cfg.seq_len)
        self.probes = (next(probes), next(probes))
        self._steps = {}
        self._eval = jax.jit(model.loss_fn)
        self._fidelity = jax.jit(self._fidelity_fn)

    def _step(self, label, steps, B, hp):
        key = (label, steps, B, tuple(sorted((hp or {}).items())))
        if key not in self._steps:
            opt = build(label, self.cfg, steps, hp)
            stat_fn = js.value_and_per_example_stat(model.loss_fn, js.optim.stat_request(opt))

            @jax.jit
            def step(params, state, batch, lr):
                loss, stats = stat_fn(params, batch)
                u, state = opt.update(stats["mean"], state, params,
                                      **js.optim.update_kwargs(stats))
                u = jax.tree.map(lambda x: lr * x, u)
                return optax.apply_updates(params, u), state, loss, u

            self._steps[key] = (opt, step)
        return self._steps[key]

    @staticmethod
    def _fidelity_fn(params, u, probe_a, probe_b):
        """Sign agreement of the update with -grad of each probe set, and of the two
        probes' gradients with each other (coordinates where both signs are nonzero)."""
        grad = jax.grad(model.loss_fn)
        ga = jnp.concatenate([jnp.ravel(x) for x in jax.tree.leaves(grad(params, probe_a))])
        gb = jnp.concatenate([jnp.ravel(x) for x in jax.tree.leaves(grad(params, probe_b))])
        uu = jnp.concatenate([jnp.ravel(x) for x in jax.tree.leaves(u)])

        def agree(x, y):
            ok = (x != 0) & (y != 0)
            return jnp.sum(ok & (jnp.sign(x) == jnp.sign(y))) / jnp.maximum(jnp.sum(ok), 1)

        return agree(uu, -ga), agree(uu, -gb), agree(ga, gb)

    def run(self, label, lr, seed, *, batch_size=None, steps=None, hp=None, probes=False):
        cfg = self.cfg
        B = batch_size or cfg.batch_size
        steps = steps or cfg.steps
        old = self._previous.get(run_key(dict(label=label, lr=lr, seed=seed, batch_size=B,
                                              steps=steps, hp=hp or {})))
        if old is not None and (old["fidelity"] or not probes):
            self.reused += 1
            return old
        opt, step = self._step(label, steps, B, hp)
        params = model.init_params(jax.random.PRNGKey(seed), **cfg.model_cfg())
        state = opt.init(params)
        batches = self.corpus.batches(np.random.default_rng(seed), B, cfg.seq_len)
        every = max(1, round(cfg.eval_every * cfg.batch_size / B))
        limit = 1.5 * UNIFORM_LOSS
        evals, fid, pending, diverged = [], [], [], False
        t0 = time.perf_counter()
        for t in range(1, steps + 1):
            params, state, loss, u = step(params, state, next(batches), lr)
            pending.append(loss)
            if t % every == 0 or t == steps:
                vals = [float(x) for x in pending]
                pending = []
                if not all(math.isfinite(v) for v in vals) or np.mean(vals) > limit:
                    diverged = True
                    break
                ev = float(self._eval(params, self.eval_batch))
                evals.append({"step": t, "examples": t * B, "loss": round(ev, 5),
                              "train": round(float(np.mean(vals)), 5)})
                if probes:
                    a, b, ref = (float(x) for x in self._fidelity(params, u, *self.probes))
                    fid.append({"step": t, "update_vs_probe_a": a, "update_vs_probe_b": b,
                                "probe_a_vs_b": ref})
        return {"label": label, "lr": float(lr), "seed": int(seed), "batch_size": B,
                "steps": steps, "diverged": diverged,
                "final_eval_loss": None if diverged else evals[-1]["loss"],
                "eval": evals, "fidelity": fid, "hp": hp or {},
                "seconds": round(time.perf_counter() - t0, 2)}


#: Config fields that only widen or narrow the study (grids, seeds, bootstrap size): runs
#: of a study that differs from this one in these fields alone can be reused.
GRID_FIELDS = ("seeds", "sign_lrs", "adam_lrs", "sign_ema_betas", "batch_sizes", "bootstrap")


def run_key(r):
    """What makes two runs the same run (given the same model, data and training length)."""
    hp = tuple(sorted((k, float(v)) for k, v in (r.get("hp") or {}).items()))
    return (r["label"], float(r["lr"]), int(r["seed"]), int(r["batch_size"]), int(r["steps"]), hp)


def reusable_runs(old_doc, config, data):
    """The runs of ``old_doc`` that a study of ``config`` on ``data`` may reuse: all of them
    when the two configurations differ in :data:`GRID_FIELDS` alone, else none."""
    old = old_doc.get("config") or {}
    same = {k: v for k, v in config.items() if k not in GRID_FIELDS}
    if old_doc.get("data") != data or {k: old.get(k) for k in same} != same:
        return []
    return [r for e in old_doc.get("experiments", {}).values() for r in e.get("runs", [])]


# --------------------------------------------------------------------------- #
# Statistics over seeds
# --------------------------------------------------------------------------- #
def capped(x):
    """Final loss for summaries: a diverged run counts as the uniform predictor."""
    return UNIFORM_LOSS if x is None or not math.isfinite(x) else min(x, UNIFORM_LOSS)


def best_rates(runs, key="label"):
    """Per ``r[key]``: mean final loss over seeds per rate, the best rate, whether it is
    interior."""
    table = {}
    for r in runs:
        table.setdefault(r[key], {}).setdefault(r["lr"], {})[r["seed"]] = capped(
            r["final_eval_loss"])
    out = {}
    for label, by_lr in table.items():
        grid = sorted(by_lr)
        means = {lr: float(np.mean(list(v.values()))) for lr, v in by_lr.items()}
        lr = min(means, key=means.get)
        out[label] = {"lr": lr, "loss": means[lr], "interior": grid[0] < lr < grid[-1],
                      "by_lr": {repr(k): means[k] for k in grid}, "per_seed": by_lr[lr]}
    return out


def paired(a: dict, b: dict, n_boot: int, seed=0):
    """Mean over seeds of ``a[s] - b[s]`` with a bootstrap 95% interval over seeds."""
    seeds = sorted(set(a) & set(b))
    d = np.array([a[s] - b[s] for s in seeds])
    rng = np.random.default_rng(seed)
    boot = d[rng.integers(0, len(d), (n_boot, len(d)))].mean(1)
    lo, hi = np.percentile(boot, [2.5, 97.5])
    return {"mean": float(d.mean()), "per_seed": d.tolist(), "ci95": [float(lo), float(hi)],
            "decided": bool(hi < 0 or lo > 0)}


def differences(best, reference, n_boot):
    """Paired differences ``label - reference`` at each one's best rate."""
    ref = best[reference]["per_seed"]
    return {f"{k} - {reference}": paired(v["per_seed"], ref, n_boot)
            for k, v in best.items() if k != reference}


# --------------------------------------------------------------------------- #
# Experiments
# --------------------------------------------------------------------------- #
def sign_labels(cfg):
    return list(SIGN) + [f"sign_ema b1={b:g}" for b in cfg.sign_ema_betas]


def run_sign(runner, cfg, log=print):
    runs = []
    for seed in cfg.seeds:
        for label in sign_labels(cfg):
            for lr in cfg.sign_lrs:
                runs.append(runner.run(label, lr, seed, probes=True))
                log(_line(runs[-1]))
    best = best_rates(runs)
    fid = {}
    for label, b in best.items():
        rs = [r for r in runs if r["label"] == label and r["lr"] == b["lr"] and r["fidelity"]]
        late = [f for r in rs for f in r["fidelity"][len(r["fidelity"]) // 2:]]
        if late:
            fid[label] = {k: float(np.mean([f[k] for f in late]))
                          for k in ("update_vs_probe_a", "update_vs_probe_b", "probe_a_vs_b")}
    diffs = differences(best, "sign_ema", cfg.bootstrap)
    placements = [f"{k} - sign_ema" for k in SIGN[:-1]]
    claim = all(diffs[p]["ci95"][0] > 0 for p in placements)
    refuted = any(diffs[p]["ci95"][1] < 0 for p in placements)
    return {"runs": runs, "best": best, "differences": diffs, "fidelity": fid,
            "verdict": _verdict(claim, refuted, "sign_ema beats every earlier placement")}


def run_adam(runner, cfg, log=print):
    runs = []
    for seed in cfg.seeds:
        for label in ADAM:
            for lr in cfg.adam_lrs:
                runs.append(runner.run(label, lr, seed))
                log(_line(runs[-1]))
    best = best_rates(runs)
    diffs = differences(best, "adam", cfg.bootstrap)
    # dose-response: each step up in lambda costs loss (consecutive paired differences)
    steps = {f"{b} - {a}": paired(best[b]["per_seed"], best[a]["per_seed"], cfg.bootstrap)
             for a, b in zip(ADAM, ADAM[1:])}
    claim = all(v["ci95"][0] > 0 for v in steps.values())
    refuted = any(v["ci95"][1] < 0 for v in steps.values())
    return {"runs": runs, "best": best, "differences": diffs, "dose_response": steps,
            "verdict": _verdict(claim, refuted,
                                "loss rises with the weight of sigma^2 in the preconditioner")}


def run_sqrt_b(runner, cfg, adam_best, log=print):
    """Adam at each batch size for the same number of examples: the full sqrt rule from
    the base batch size's best rate, against the control (same hyperparameters)."""
    B0 = cfg.batch_size
    lr0 = adam_best["adam"]["lr"]
    runs = []
    for seed in cfg.seeds:
        for B in cfg.batch_sizes:
            steps = max(1, cfg.steps * B0 // B)
            for rule in ("sqrt", "constant"):
                if B == B0 and rule == "constant":
                    continue  # identical to the sqrt run at B0
                if rule == "sqrt":
                    hp = js.optim.adam_sqrt_scaling(B0, B, lr0, b1=cfg.b1, b2=cfg.b2)
                    lr = hp.pop("learning_rate")
                else:
                    hp, lr = {}, lr0
                r = runner.run("adam", lr, seed, batch_size=B, steps=steps,
                               hp={k: float(v) for k, v in hp.items()})
                r["rule"] = rule
                runs.append(r)
                log(_line(runs[-1]) + f" B={B} {rule}")
    spread = {}
    for rule in ("sqrt", "constant"):
        per_seed = {}
        for seed in cfg.seeds:
            vals = [capped(r["final_eval_loss"]) for r in runs if r["seed"] == seed and
                    (r["rule"] == rule or r["batch_size"] == B0)]
            per_seed[seed] = float(max(vals) - min(vals))
        spread[rule] = per_seed
    diff = paired(spread["sqrt"], spread["constant"], cfg.bootstrap)
    return {"runs": runs, "base_batch_size": B0, "base_lr": lr0,
            "spread_across_batch_sizes": {k: float(np.mean(list(v.values())))
                                          for k, v in spread.items()},
            "sqrt_minus_constant_spread": diff,
            "verdict": _verdict(diff["ci95"][1] < 0, diff["ci95"][0] > 0,
                                "the sqrt rule collapses the curves (against examples seen) "
                                "better than the control")}


def _verdict(claim, refuted, what):
    if claim:
        return f"reproduced: {what} (every 95% interval excludes 0)"
    if refuted:
        return f"contradicted: the opposite of '{what}' holds for at least one comparison"
    return f"undecided: the intervals do not decide whether {what}"


def _line(r):
    loss = r["final_eval_loss"]
    return (f"{r['label']:24s} lr={r['lr']:<8.3g} seed={r['seed']} B={r['batch_size']:<3d} "
            f"eval={'diverged' if loss is None else f'{loss:.4f}'} ({r['seconds']} s)")
