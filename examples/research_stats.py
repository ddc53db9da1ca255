"""Research statistics of per-example gradients along a training run, with figures.

Trains the byte-level LM of :mod:`examples.reproduce` with Adam and, every few steps,
measures in **one** ``per_example_stat`` pass (no per-example gradient of the whole
model is ever formed):

* per-layer quantiles of the per-example gradient norms (``norm_quantiles``);
* per-example cosines with a large-batch reference gradient (``per_example_cosines``),
  the alignment of single examples with the direction the optimizer is after;
* gradient diversity (``gradient_diversity``) and the unbiased pieces of the gradient
  noise scale (``noise_scale_components``), averaged over the run before dividing;
* per-coordinate kurtosis of the per-example gradients (``kurtosis``): heavy tails
  are what separates a sign or per-example-clipped update from a mean one.

    python -m examples.research_stats            # ~3 minutes on 2 CPU cores
    python -m examples.research_stats --quick    # a smoke test

Writes ``research_stats.json`` (configuration, every measurement) and
``research_stats.png`` into ``examples/results/`` (``--out`` to change).
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
import jax.numpy as jnp
import numpy as np
import optax

import jaxpr_surgery as js

from . import quick_xla_flags
from .reproduce import model
from .reproduce.data import load_corpus

Q = (0.1, 0.5, 0.9)
#: layers whose statistics are plotted: (label, path into the parameters)
LAYERS = (("embedding (tied)", ("embed",)), ("block 0 wq", ("blocks", 0, "wq")),
          ("block 0 w1", ("blocks", 0, "w1")), ("last block w2", ("blocks", -1, "w2")),
          ("final LN gain", ("ln_f", "g")))


@dataclasses.dataclass(frozen=True)
class Config:
    d: int = 64
    heads: int = 4
    layers: int = 2
    seq_len: int = 64
    batch_size: int = 32
    steps: int = 600
    measure_every: int = 50
    reference_examples: int = 512  # the reference gradient's batch
    lr: float = 3e-3
    seed: int = 0
    max_bytes: int = 2_000_000

    def model_cfg(self):
        return dict(vocab=256, seq_len=self.seq_len + 1, d=self.d, heads=self.heads,
                    layers=self.layers)


QUICK = Config(d=16, heads=2, layers=1, seq_len=16, batch_size=8, steps=6, measure_every=3,
               reference_examples=16, max_bytes=200_000)


def _at(tree, path):
    for k in path:
        tree = tree[k]
    return tree


def measure_fn(cfg: Config):
    """``(params, batch, reference) -> dict`` of every statistic and the batch's loss
    (``"loss"``), in one pass."""

    def measure(params, batch, reference):
        stats = {
            "norms": js.stats.norm_quantiles(Q),
            "global_norms": js.stats.norm_quantiles(Q, per_leaf=False),
            "cosines": js.stats.per_example_cosines(reference),
            "diversity": js.stats.gradient_diversity(),
            "noise": js.stats.noise_scale_components(),
            "kurtosis": js.stats.kurtosis(),
        }
        loss, out = js.value_and_per_example_stat(model.loss_fn, stats)(params, batch)
        out["loss"] = loss
        # kurtosis is per coordinate: keep its median per leaf (NaN where undefined)
        out["kurtosis"] = jax.tree.map(jnp.nanmedian, out["kurtosis"])
        return out

    return jax.jit(measure)


def run(cfg: Config, log=print) -> dict:
    corpus = load_corpus(None, cfg.max_bytes)
    params = model.init_params(jax.random.PRNGKey(cfg.seed), **cfg.model_cfg())
    opt = optax.adam(optax.warmup_cosine_decay_schedule(0.0, cfg.lr, max(1, cfg.steps // 20),
                                                        max(cfg.steps, 2), end_value=0.1 * cfg.lr))
    state = opt.init(params)
    rng = np.random.default_rng(cfg.seed)
    batches = corpus.batches(rng, cfg.batch_size, cfg.seq_len)
    ref_batches = corpus.batches(np.random.default_rng(10_000 + cfg.seed),
                                 cfg.reference_examples, cfg.seq_len)

    @jax.jit
    def step(params, state, batch):
        loss, g = jax.value_and_grad(model.loss_fn)(params, batch)
        u, state = opt.update(g, state, params)
        return optax.apply_updates(params, u), state, loss

    grad = jax.jit(jax.grad(model.loss_fn))
    measure = measure_fn(cfg)
    records = []
    t0 = time.perf_counter()
    for t in range(cfg.steps + 1):
        batch = next(batches)
        if t % cfg.measure_every == 0 or t == cfg.steps:
            reference = grad(params, next(ref_batches))  # an independent large batch
            m = jax.device_get(measure(params, batch, reference))
            noise = m["noise"]
            rec = {
                "step": t,
                "loss": float(m["loss"]),
                "global_norm_quantiles": [float(x) for x in m["global_norms"]],
                "norm_quantiles": {name: [float(x) for x in _at(m["norms"], path)]
                                   for name, path in LAYERS},
                "kurtosis_median": {name: float(_at(m["kurtosis"], path))
                                    for name, path in LAYERS},
                "cosines": [float(x) for x in m["cosines"]],
                "diversity": float(m["diversity"]),
                "grad_sq_norm": float(noise.grad_sq_norm),
                "trace_cov": float(noise.trace_cov),
            }
            records.append(rec)
            log(f"step {t:5d} loss {rec['loss']:.3f} median |g_b| "
                f"{rec['global_norm_quantiles'][1]:.3g} mean cos "
                f"{np.mean(rec['cosines']):+.3f} diversity {rec['diversity']:.3g}")
        if t < cfg.steps:
            params, state, _ = step(params, state, batch)
    return {"config": dataclasses.asdict(cfg), "data": corpus.info(),
            "environment": {"jax": jax.__version__, "backend": jax.default_backend()},
            "records": records,
            "noise_scale_late": noise_scale_late(records),
            "seconds": round(time.perf_counter() - t0, 1)}


def noise_scale_late(records):
    """B_simple from its unbiased pieces averaged over the second half of the run
    (McCandlish et al.: average, then divide), past the transient of the first steps."""
    late = records[len(records) // 2:]
    g2 = float(np.mean([r["grad_sq_norm"] for r in late]))
    tr = float(np.mean([r["trace_cov"] for r in late]))
    return tr / g2 if g2 > 0 else math.inf


def plot(doc, path: Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = doc["records"]
    steps = [r["step"] for r in recs]
    fig, ax = plt.subplots(2, 2, figsize=(11, 8))
    a = ax[0, 0]
    for i, (name, _) in enumerate(LAYERS):
        qs = np.array([r["norm_quantiles"][name] for r in recs])
        a.plot(steps, qs[:, 1], color=f"C{i}", label=name)
        a.fill_between(steps, qs[:, 0], qs[:, 2], color=f"C{i}", alpha=0.2)
    a.set(yscale="log", xlabel="step", ylabel="per-example gradient norm",
          title="per-layer norms: median, 10-90% band")
    a.legend(fontsize=8)
    a = ax[0, 1]
    picks = sorted({0, len(recs) // 2, len(recs) - 1})
    for i in picks:
        a.hist(recs[i]["cosines"], bins=20, alpha=0.5, label=f"step {recs[i]['step']}")
    a.axvline(0, color="k", lw=0.5)
    a.set(xlabel="cos(g_b, large-batch gradient)", ylabel="examples",
          title=f"alignment with a {doc['config']['reference_examples']}-example gradient")
    a.legend(fontsize=8)
    a = ax[1, 0]
    b_simple = [r["trace_cov"] / r["grad_sq_norm"] if r["grad_sq_norm"] > 0 else np.nan
                for r in recs]
    a.plot(steps, b_simple, "o-", label="B_simple (one batch)")
    a.axhline(doc["noise_scale_late"], ls="--", color="C0",
              label=f"B_simple, pieces averaged over the 2nd half: {doc['noise_scale_late']:.0f}")
    a.plot(steps, [r["diversity"] * doc["config"]["batch_size"] for r in recs], "s-",
           color="C1", label="B x gradient diversity")
    a.set(yscale="log", xlabel="step", title="noise scale and diversity (batch sizes)")
    a.legend(fontsize=8)
    a = ax[1, 1]
    for i, (name, _) in enumerate(LAYERS):
        a.plot(steps, [r["kurtosis_median"][name] for r in recs], color=f"C{i}", label=name)
    a.axhline(3, color="k", lw=0.5, ls=":", label="Gaussian (3)")
    a.set(yscale="log", xlabel="step", ylabel="median kurtosis over coordinates",
          title="tails of per-example gradients")
    a.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m examples.research_stats", description=__doc__)
    ap.add_argument("--quick", action="store_true", help="tiny everything: a smoke test")
    ap.add_argument("--out", type=Path, default=None,
                    help="output folder (default: examples/results, or a temporary folder "
                         "with --quick)")
    args = ap.parse_args(argv)
    quick_xla_flags(args.quick)  # (before the first computation)
    cfg = QUICK if args.quick else Config()
    here = Path(__file__).resolve().parent / "results"
    out = args.out or (Path(tempfile.gettempdir()) / "jaxpr_surgery_research_quick"
                       if args.quick else here)
    out.mkdir(parents=True, exist_ok=True)
    doc = run(cfg)
    (out / "research_stats.json").write_text(json.dumps(doc, indent=1) + "\n")
    try:
        plot(doc, out / "research_stats.png")
        print(f"wrote {out / 'research_stats.png'}")
    except ImportError:  # matplotlib is an optional extra
        print("matplotlib not installed: no figure")
    print(f"wrote {out / 'research_stats.json'}")
    return doc


if __name__ == "__main__":
    main()
