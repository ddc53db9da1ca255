"""The paper's preconditioner question asked of Shampoo: per-example vs classic.

Roulet & Agarwala find Adam trains best when its diagonal preconditioner follows
the mean gradient (mu^2) rather than the per-example spread (mu^2 + sigma^2,
MicroAdam). Shampoo's Kronecker factors admit the same two choices:
``js.optim.shampoo(per_example=False)`` (classic: outer products of the batch
mean) and ``per_example=True`` (``kron_moments``: the mean of per-example outer
products, the matrix analogue of MicroAdam). This study trains the byte-level LM
of ``examples.reproduce`` with both, and with Adam and MicroAdam as references:

* paired seeds: seed s fixes the initialisation and the data order of every
  optimizer's run, so differences are paired;
* a learning-rate grid per optimizer, with a check that each best rate is
  interior (not at an end of its grid);
* at each optimizer's best rate, the paired difference of final held-out loss
  (per-example minus classic Shampoo; MicroAdam minus Adam) with a bootstrap 95%
  interval over seeds.

    python -m examples.reproduce.shampoo            # the study (~15 min on 2 CPU cores)
    python -m examples.reproduce.shampoo --quick    # a smoke test (seconds)

Results: ``examples/results/shampoo.json`` (with the configuration) and the
"Shampoo" section of ``docs/results.md``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import tempfile
import time
from pathlib import Path

import jax
import numpy as np
import optax

import jaxpr_surgery as js

from .. import quick_xla_flags
from . import model
from .data import load_corpus
from .study import best_rates, paired

OPTIMIZERS = ("shampoo_per_example", "shampoo_classic", "adam", "micro_adam")
PAIRS = (("shampoo_per_example", "shampoo_classic"), ("micro_adam", "adam"))


@dataclasses.dataclass(frozen=True)
class Config:
    d: int = 64
    heads: int = 4
    layers: int = 2
    seq_len: int = 64
    batch_size: int = 16
    steps: int = 400
    eval_windows: int = 128
    seeds: tuple = (0, 1, 2)
    shampoo_lrs: tuple = (1e-3, 3e-3, 1e-2, 3e-2)
    adam_lrs: tuple = (1e-3, 3e-3, 1e-2, 3e-2)
    b1: float = 0.9  # Adam's first moment; Shampoo runs get the same momentum (optax.trace)
    b2: float = 0.95
    eps: float = 1e-4  # Shampoo's; Adam's is optax's default 1e-8
    eps_ablation: tuple = (1e-6,)  # both Shampoos again at these eps
    precondition_every: int = 10
    max_bytes: int = 2_000_000
    bootstrap: int = 10_000

    def lrs(self, name):
        return self.shampoo_lrs if name.startswith("shampoo") else self.adam_lrs


QUICK = Config(d=16, heads=2, layers=1, seq_len=16, batch_size=4, steps=6, eval_windows=8,
               seeds=(0, 1), shampoo_lrs=(1e-2, 3e-2), adam_lrs=(1e-3, 1e-2),
               precondition_every=2, max_bytes=200_000, bootstrap=200, eps_ablation=())


def labels(cfg: Config):
    """Every optimizer of the study: the four, then both Shampoos at each ablation eps."""
    out = list(OPTIMIZERS)
    for e in cfg.eps_ablation:
        out += [f"{n} eps={e:g}" for n in OPTIMIZERS[:2]]
    return out


def pairs(cfg: Config):
    out = list(PAIRS)
    for e in cfg.eps_ablation:
        out.append((f"{OPTIMIZERS[0]} eps={e:g}", f"{OPTIMIZERS[1]} eps={e:g}"))
    return out


def build(name, cfg: Config):
    """The optimizer ``name`` with a unit warm-up + cosine schedule (the peak learning
    rate multiplies the update in the step, so one compiled step serves the grid)."""
    name, _, eps = name.partition(" eps=")
    eps = float(eps) if eps else cfg.eps
    steps = cfg.steps
    sched = optax.warmup_cosine_decay_schedule(0.0, 1.0, max(1, steps // 20), max(steps, 2),
                                               end_value=0.1)
    jso = js.optim
    if name.startswith("shampoo"):
        return jso.chain(
            jso.scale_by_shampoo(b2=cfg.b2, eps=eps, per_example=name.endswith("example"),
                                 precondition_every=cfg.precondition_every),
            optax.trace(decay=cfg.b1),
            optax.scale_by_learning_rate(sched),
        )
    scale = {"adam": jso.scale_by_adam, "micro_adam": jso.scale_by_micro_adam}[name]
    return jso.chain(scale(b1=cfg.b1, b2=cfg.b2), optax.scale_by_learning_rate(sched))


_STEPS = {}


def _step(name, cfg):
    if (name, cfg) not in _STEPS:
        opt = build(name, cfg)
        stat_fn = js.value_and_per_example_stat(model.loss_fn, js.optim.stat_request(opt))

        @jax.jit
        def step(params, state, batch, lr):
            loss, stats = stat_fn(params, batch)
            u, state = opt.update(stats["mean"], state, params, **js.optim.update_kwargs(stats))
            u = jax.tree.map(lambda x: lr * x, u)
            return optax.apply_updates(params, u), state, loss

        _STEPS[(name, cfg)] = (opt, step)
    return _STEPS[(name, cfg)]


def train(name, lr, seed, cfg: Config, corpus, eval_batch) -> dict:
    mcfg = dict(vocab=256, seq_len=cfg.seq_len + 1, d=cfg.d, heads=cfg.heads, layers=cfg.layers)
    opt, step = _step(name, cfg)
    params = model.init_params(jax.random.PRNGKey(seed), **mcfg)
    state = opt.init(params)
    batches = corpus.batches(np.random.default_rng(seed), cfg.batch_size, cfg.seq_len)
    t0 = time.perf_counter()
    losses = []
    for _ in range(cfg.steps):
        params, state, loss = step(params, state, next(batches), lr)
        losses.append(loss)
    losses = [float(x) for x in losses]
    final = float(_eval(params, eval_batch))
    ok = math.isfinite(final) and all(math.isfinite(x) for x in losses)
    return {"optimizer": name, "lr": lr, "seed": seed, "final_eval_loss": final if ok else None,
            "train_loss_last50": float(np.mean(losses[-50:])) if ok else None,
            "seconds": round(time.perf_counter() - t0, 2)}


_eval = jax.jit(model.loss_fn)


def summarize(runs, cfg: Config) -> dict:
    """Best rate per optimizer and the paired differences (study.py's statistics)."""
    best = best_rates(runs, key="optimizer")
    diffs = {f"{a} - {b}": paired(best[a]["per_seed"], best[b]["per_seed"], cfg.bootstrap)
             for a, b in pairs(cfg) if a in best and b in best}
    return {"best": best, "paired_differences": diffs}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m examples.reproduce.shampoo",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny everything: a smoke test")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--resume", action="store_true",
                    help="keep the runs of --out/shampoo.json made with this configuration")
    args = ap.parse_args(argv)
    quick_xla_flags(args.quick)  # (before the first computation)
    cfg = QUICK if args.quick else Config()
    if args.steps:
        cfg = dataclasses.replace(cfg, steps=args.steps)
    here = Path(__file__).resolve().parent.parent / "results"
    out = args.out or (Path(tempfile.gettempdir()) / "jaxpr_surgery_shampoo_quick"
                       if args.quick else here)
    out.mkdir(parents=True, exist_ok=True)
    corpus = load_corpus(None, cfg.max_bytes)
    eval_batch = corpus.heldout_windows(cfg.eval_windows, cfg.seq_len)
    path = out / "shampoo.json"
    config = dataclasses.asdict(cfg)
    runs = []
    if args.resume and path.exists():
        old = json.loads(path.read_text())
        if old["config"] == json.loads(json.dumps(config)):
            runs = old["runs"]
    done = {(r["optimizer"], r["lr"], r["seed"]) for r in runs}
    for seed in cfg.seeds:
        for name in labels(cfg):
            for lr in cfg.lrs(name):
                if (name, lr, seed) in done:
                    continue
                r = train(name, lr, seed, cfg, corpus, eval_batch)
                runs.append(r)
                path.write_text(json.dumps({"config": config, "runs": runs}, indent=1))
                print(f"{name:30s} lr={lr:<7g} seed={seed} eval={r['final_eval_loss']} "
                      f"({r['seconds']} s)", flush=True)
    result = {"config": config, "data": corpus.info(), "runs": runs,
              "summary": summarize(runs, cfg)}
    path.write_text(json.dumps(result, indent=1))
    for k, v in result["summary"]["paired_differences"].items():
        print(f"{k}: {v['mean']:+.4f} nats, 95% CI [{v['ci95'][0]:+.4f}, {v['ci95'][1]:+.4f}]")
    for k, v in result["summary"]["best"].items():
        print(f"{k}: best lr {v['lr']:g} ({'interior' if v['interior'] else 'AT AN END'}), "
              f"loss {v['loss']:.4f}")
    return result


if __name__ == "__main__":
    main()
