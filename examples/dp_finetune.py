"""A private fine-tune end to end: LoRA adapters trained under DP on held-out text.

1. **Pre-train** (public data, not private): the byte-level LM of
   :mod:`examples.reproduce` on Python code (the standard library's source, no
   download), briefly, with Adam.
2. **The private data set**: text held out of pre-training and of another kind, English
   prose: the Python language reference that ships with the interpreter
   (``pydoc_data.topics``). ``private_examples`` windows of 80% of its topics are the
   private training set; windows of the other topics are the evaluation set.
3. **DP fine-tune**: rank-``rank`` LoRA adapters on the attention (``wq``, ``wv``) and
   MLP (``w1``) weights, the base model frozen, trained with ``js.optim.dp_adam`` on
   Poisson batches (``js.privacy.poisson_batches``, the padding passed as
   ``is_padding_example``); the clipped sum comes from ``per_example_stat`` in one pass.
   The clip norm is the median per-example gradient norm of the adapters on a *public*
   batch (``norm_quantiles``: free of privacy cost); the noise multiplier is calibrated to
   the target epsilon (``js.privacy.calibrate_noise_multiplier``, PLD accountant), and the
   epsilon spent is printed along the run (``js.privacy.epsilon_of``).
4. **Baseline**: the same adapters fine-tuned without privacy (Adam, same steps and
   expected batch size).

    python -m examples.dp_finetune                 # a few minutes on 2 CPU cores
    python -m examples.dp_finetune --quick         # a smoke test, well under a minute
    python -m examples.dp_finetune --clipping per-layer --target-epsilon 3

Writes ``dp_finetune.json`` (configuration, calibration, every evaluation) and
``dp_finetune.png`` (held-out perplexity of both fine-tunes and the epsilon spent, per
step) into ``examples/results/`` (``--out`` to change). Needs ``dp-accounting`` (the extra
``dp``), and ``matplotlib`` / ``tqdm`` (the extra ``examples``) for the figure and the
progress bar.
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
from .reproduce.data import default_files, load_corpus

#: the weights of each block that get a LoRA adapter
ADAPTED = ("wq", "wv", "w1")


@dataclasses.dataclass(frozen=True)
class Config:
    d: int = 64
    heads: int = 4
    layers: int = 2
    seq_len: int = 64
    pretrain_steps: int = 300
    pretrain_batch: int = 32
    pretrain_lr: float = 3e-3
    private_examples: int = 4_000  # windows of the held-out split: the private data set
    eval_windows: int = 256
    rank: int = 8
    expected_batch: int = 128  # Poisson sampling: q = expected_batch / private_examples
    finetune_steps: int = 150
    lr: float = 3e-3
    target_epsilon: float = 8.0
    delta: float = 1e-5
    clipping: str = "global"  # or "per-layer": one bound per adapted weight
    eval_every: int = 15
    seed: int = 0
    max_bytes: int = 2_000_000

    def model_cfg(self):
        return dict(vocab=256, seq_len=self.seq_len + 1, d=self.d, heads=self.heads,
                    layers=self.layers)


QUICK = Config(d=16, heads=2, layers=1, seq_len=16, pretrain_steps=20, pretrain_batch=8,
               private_examples=400, eval_windows=32, rank=2, expected_batch=32,
               finetune_steps=8, eval_every=4, max_bytes=300_000)


# --------------------------------------------------------------------------- #
# The LM with LoRA adapters (unmerged: h @ W + (h @ A) @ B, B = 0 at the start)
# --------------------------------------------------------------------------- #
def init_adapters(key, base, rank):
    """Per block and adapted weight ``W`` (``[d, ...]``), ``A [d, r]`` (small random) and
    ``B [r, ...]`` (zeros): the adapted model starts as the base model."""
    out = []
    for p in base["blocks"]:
        blk = {}
        for name in ADAPTED:
            key, k = jax.random.split(key)
            w = p[name]
            blk[name] = {"A": jax.random.normal(k, (w.shape[0], rank), jnp.float32)
                         / math.sqrt(w.shape[0]),
                         "B": jnp.zeros((rank, *w.shape[1:]), jnp.float32)}
        out.append(blk)
    return {"blocks": out}


def _apply(h, w, lora):
    """``h @ w`` (contracting ``h``'s last axis with ``w``'s first) plus the LoRA term."""
    base = jnp.tensordot(h, w, axes=1)
    if lora is None:
        return base
    return base + jnp.tensordot(h @ lora["A"], lora["B"], axes=1)


def _block(x, p, lora):
    T = x.shape[1]
    h = model._layernorm(x, p["ln1"])
    q = _apply(h, p["wq"], lora["wq"])
    k = jnp.einsum("btd,dhk->bthk", h, p["wk"])
    v = _apply(h, p["wv"], lora["wv"])
    s = jnp.einsum("bthk,bshk->bhts", q, k) / np.sqrt(q.shape[-1])
    s = jnp.where(jnp.tril(jnp.ones((T, T), bool)), s, -1e9)
    a = jnp.einsum("bhts,bshk->bthk", jax.nn.softmax(s, axis=-1), v)
    x = x + jnp.einsum("bthk,hkd->btd", a, p["wo"])
    h = model._layernorm(x, p["ln2"])
    return x + jax.nn.gelu(_apply(h, p["w1"], lora["w1"]) + p["b1"]) @ p["w2"] + p["b2"]


def logits_fn(adapters, ids, base):
    x = base["embed"][ids[:, :-1]] + base["pos"][: ids.shape[1] - 1]
    for p, lora in zip(base["blocks"], adapters["blocks"]):
        x = _block(x, p, lora)
    return model._layernorm(x, base["ln_f"]) @ base["embed"].T


def lora_loss(adapters, batch, base):
    """Mean over examples of each example's mean next-byte cross-entropy (nats); only the
    adapters are trained (``base``: the frozen pre-trained model)."""
    ids = batch["ids"]
    logp = jax.nn.log_softmax(logits_fn(adapters, ids, base))
    return -jnp.mean(jnp.take_along_axis(logp, ids[:, 1:, None], axis=-1)[..., 0])


def evaluate_fn():
    @jax.jit
    def evaluate(adapters, base, ids):
        logits = logits_fn(adapters, ids, base)
        logp = jax.nn.log_softmax(logits)
        nll = -jnp.take_along_axis(logp, ids[:, 1:, None], axis=-1)[..., 0]
        acc = jnp.mean(jnp.argmax(logits, -1) == ids[:, 1:])
        return jnp.mean(nll), acc

    def run(adapters, base, ids):
        loss, acc = jax.device_get(evaluate(adapters, base, ids))
        return {"loss": float(loss), "perplexity": float(np.exp(loss)), "accuracy": float(acc)}

    return run


# --------------------------------------------------------------------------- #
# The run
# --------------------------------------------------------------------------- #
def pretrain(cfg, corpus, log):
    params = model.init_params(jax.random.PRNGKey(cfg.seed), **cfg.model_cfg())
    opt = optax.adam(optax.warmup_cosine_decay_schedule(
        0.0, cfg.pretrain_lr, max(1, cfg.pretrain_steps // 20), max(cfg.pretrain_steps, 2),
        end_value=0.1 * cfg.pretrain_lr))
    state = opt.init(params)

    @jax.jit
    def step(params, state, batch):
        loss, g = jax.value_and_grad(model.loss_fn)(params, batch)
        u, state = opt.update(g, state, params)
        return optax.apply_updates(params, u), state, loss

    batches = corpus.batches(np.random.default_rng(cfg.seed), cfg.pretrain_batch, cfg.seq_len)
    loss = math.nan
    for _ in range(cfg.pretrain_steps):
        params, state, loss = step(params, state, next(batches))
    log(f"pre-trained {cfg.pretrain_steps} steps on public data: loss {float(loss):.3f}")
    return params


def public_corpus(cfg):
    """The standard library's code without ``pydoc_data`` (the private text's source)."""
    _, files = default_files()
    return load_corpus([f for f in files if "pydoc_data" not in f.parts], cfg.max_bytes)


def private_text():
    """``(train bytes, eval bytes)``: the topics of the language reference
    (``pydoc_data.topics``), every fifth topic (sorted by name) held out for evaluation."""
    from pydoc_data.topics import topics

    names = sorted(topics)
    train = [topics[k] for i, k in enumerate(names) if i % 5 != 4]
    test = [topics[k] for i, k in enumerate(names) if i % 5 == 4]
    enc = lambda parts: np.frombuffer("\n\n".join(parts).encode(), np.uint8)  # noqa: E731
    return enc(train), enc(test)


def private_data(cfg):
    """``(train ids [N, T+1], eval ids [E, T+1])``: ``private_examples`` windows of the
    private training text (random offsets) and ``eval_windows`` evenly spaced windows of
    the held-out topics."""
    train, test = private_text()
    T = cfg.seq_len + 1
    rng = np.random.default_rng(1_000 + cfg.seed)
    start = rng.integers(0, train.size - T, size=cfg.private_examples)
    ids = train[start[:, None] + np.arange(T)].astype(np.int32)
    ev = np.linspace(0, test.size - T - 1, cfg.eval_windows).astype(np.int64)
    return jnp.asarray(ids), jnp.asarray(test[ev[:, None] + np.arange(T)].astype(np.int32))


def clip_bounds(cfg, adapters, base, public_batch):
    """The clip norm: the median per-example gradient norm of the adapters on a public
    batch (no privacy cost). ``per-layer``: one bound per adapted weight, each the median
    of that weight's norms scaled so that the bounds' L2 norm is the global median."""
    q = js.stats.norm_quantiles(0.5, per_leaf=False)
    med = float(js.per_example_stat(lora_loss, q)(adapters, public_batch, base))
    if cfg.clipping == "global":
        return med
    per = js.per_example_stat(lora_loss, js.stats.norms(per_leaf=True))(
        adapters, public_batch, base)
    # a group per adapted weight: the norm of (A, B) together
    meds = [{n: float(jnp.median(jnp.sqrt(per_blk[n]["A"] ** 2 + per_blk[n]["B"] ** 2)))
             for n in ADAPTED} for per_blk in per["blocks"]]
    scale = med / math.sqrt(sum(v**2 for blk in meds for v in blk.values()))
    return {"blocks": [{n: v * scale for n, v in blk.items()} for blk in meds]}


def finetune(cfg, base, data, eval_ids, *, private, bounds=None, z=None, log=print):
    adapters = init_adapters(jax.random.PRNGKey(100 + cfg.seed), base, cfg.rank)
    evaluate = evaluate_fn()
    N = data.shape[0]
    q = cfg.expected_batch / N
    records = []
    if private:
        config = dict(learning_rate=cfg.lr, clip_norm=bounds, noise_multiplier=z,
                      batch_size=cfg.expected_batch)
        opt = js.optim.dp_adam(**config)
        request = js.optim.stat_request(opt)
        max_B = js.privacy.min_max_batch_size(num_examples=N, sampling_probability=q,
                                              steps=cfg.finetune_steps)
        idx, pad = js.privacy.poisson_batches(
            jax.random.key(200 + cfg.seed), num_examples=N, sampling_probability=q,
            max_batch_size=max_B, steps=cfg.finetune_steps)

        @jax.jit
        def step(adapters, state, t):
            batch = {"ids": data[idx[t]]}
            loss, stats = js.value_and_per_example_stat(lora_loss, request)(
                adapters, batch, base, is_padding_example=pad[t])
            key = jax.random.fold_in(jax.random.key(300 + cfg.seed), t)
            u, state = opt.update(stats["mean"], state, adapters,
                                  **js.optim.update_kwargs(stats, key=key))
            return optax.apply_updates(adapters, u), state, loss
    else:
        opt = optax.adam(cfg.lr)
        rng = np.random.default_rng(400 + cfg.seed)
        fixed = jnp.asarray(rng.integers(0, N, size=(cfg.finetune_steps, cfg.expected_batch)))

        @jax.jit
        def step(adapters, state, t):
            loss, g = jax.value_and_grad(lora_loss)(adapters, {"ids": data[fixed[t]]}, base)
            u, state = opt.update(g, state, adapters)
            return optax.apply_updates(adapters, u), state, loss

    state = opt.init(adapters)
    label = "DP" if private else "non-private"
    bar = _progress(cfg.finetune_steps, f"{label} fine-tune")
    rec = {"step": 0, **evaluate(adapters, base, eval_ids)}
    if private:
        rec["epsilon"] = 0.0
    records.append(rec)
    for t in range(cfg.finetune_steps):
        adapters, state, loss = step(adapters, state, t)
        done = t + 1
        if done % cfg.eval_every == 0 or done == cfg.finetune_steps:
            rec = {"step": done, **evaluate(adapters, base, eval_ids)}
            if private:
                rec["epsilon"] = js.privacy.epsilon_of(config, steps=done, num_examples=N,
                                                       delta=cfg.delta)
            records.append(rec)
            post = {"loss": f"{float(loss):.3f}", "eval ppl": f"{rec['perplexity']:.2f}"}
            if private:
                post["eps"] = f"{rec['epsilon']:.2f}"
            bar.set_postfix(post)
            if bar.silent:
                log(f"  {label} step {done}: " + ", ".join(f"{k} {v}" for k, v in post.items()))
        bar.update(1)
    bar.close()
    return records


class _NoBar:
    silent = True

    def set_postfix(self, *_):
        pass

    def update(self, *_):
        pass

    def close(self):
        pass


def _progress(total, desc):
    try:
        from tqdm import tqdm
    except ImportError:  # tqdm is an optional extra: print instead
        return _NoBar()
    bar = tqdm(total=total, desc=desc, leave=True)
    bar.silent = False
    return bar


def run(cfg: Config, log=print) -> dict:
    t0 = time.perf_counter()
    corpus = public_corpus(cfg)
    base = pretrain(cfg, corpus, log)
    data, eval_ids = private_data(cfg)
    N = data.shape[0]
    q = cfg.expected_batch / N
    adapters0 = init_adapters(jax.random.PRNGKey(100 + cfg.seed), base, cfg.rank)
    public = next(corpus.batches(np.random.default_rng(500 + cfg.seed), cfg.expected_batch,
                                 cfg.seq_len))
    bounds = clip_bounds(cfg, adapters0, base, public)
    z = js.privacy.calibrate_noise_multiplier(
        target_epsilon=cfg.target_epsilon, delta=cfg.delta, sampling_probability=q,
        steps=cfg.finetune_steps)
    log(f"private set: {N} windows, Poisson q = {q:.4f}; clip norm "
        f"{js.optim.dp_sensitivity(bounds):.3g} ({cfg.clipping}); noise multiplier "
        f"{z:.3f} for epsilon = {cfg.target_epsilon} at delta = {cfg.delta:g}")
    pre = evaluate_fn()(adapters0, base, eval_ids)
    log(f"pre-trained model on the held-out prose: perplexity {pre['perplexity']:.2f}")
    dp = finetune(cfg, base, data, eval_ids, private=True, bounds=bounds, z=z, log=log)
    plain = finetune(cfg, base, data, eval_ids, private=False, log=log)
    final = {"pretrained": pre, "dp": dp[-1], "non_private": plain[-1]}
    log(f"held-out perplexity: pre-trained {pre['perplexity']:.2f}, DP fine-tune "
        f"{dp[-1]['perplexity']:.2f} (epsilon {dp[-1]['epsilon']:.2f}), non-private "
        f"fine-tune {plain[-1]['perplexity']:.2f}")
    train_text, test_text = private_text()
    data_info = {"public": {**corpus.info(), "source": "the Python standard library's code "
                            "(*.py, without pydoc_data)"},
                 "private": {"source": "the Python language reference (pydoc_data.topics)",
                             "train_bytes": int(train_text.size),
                             "eval_bytes": int(test_text.size)}}
    return {"config": dataclasses.asdict(cfg), "data": data_info,
            "environment": {"jax": jax.__version__, "backend": jax.default_backend()},
            "private_examples": N, "sampling_probability": q,
            "clip_norm": bounds, "sensitivity": float(js.optim.dp_sensitivity(bounds)),
            "noise_multiplier": z, "dp": dp, "non_private": plain, "final": final,
            "seconds": round(time.perf_counter() - t0, 1)}


def plot(doc, path: Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cfg = doc["config"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for key, label in (("dp", "DP fine-tune"), ("non_private", "non-private fine-tune")):
        recs = doc[key]
        a.plot([r["step"] for r in recs], [r["perplexity"] for r in recs], "o-", label=label)
    a.axhline(doc["final"]["pretrained"]["perplexity"], color="k", ls=":",
              label="pre-trained")
    a.set(xlabel="fine-tuning step", ylabel="held-out perplexity (bytes)",
          title=f"LoRA rank {cfg['rank']}, {doc['private_examples']} private examples")
    a.legend(fontsize=8)
    recs = doc["dp"]
    b.plot([r["step"] for r in recs], [r["epsilon"] for r in recs], "o-", color="C0")
    b.axhline(cfg["target_epsilon"], color="C3", ls="--", label="target")
    b.set(xlabel="fine-tuning step", ylabel="epsilon spent (PLD)",
          title=f"delta = {cfg['delta']:g}, noise multiplier {doc['noise_multiplier']:.2f}")
    b.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m examples.dp_finetune", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny everything: a smoke test")
    ap.add_argument("--clipping", choices=("global", "per-layer"), default=None)
    ap.add_argument("--target-epsilon", type=float, default=None)
    ap.add_argument("--out", type=Path, default=None,
                    help="output folder (default: examples/results, or a temporary folder "
                         "with --quick)")
    args = ap.parse_args(argv)
    quick_xla_flags(args.quick)  # (before the first computation)
    cfg = QUICK if args.quick else Config()
    if args.clipping is not None:
        cfg = dataclasses.replace(cfg, clipping=args.clipping)
    if args.target_epsilon is not None:
        cfg = dataclasses.replace(cfg, target_epsilon=args.target_epsilon)
    here = Path(__file__).resolve().parent / "results"
    out = args.out or (Path(tempfile.gettempdir()) / "jaxpr_surgery_dp_finetune_quick"
                       if args.quick else here)
    out.mkdir(parents=True, exist_ok=True)
    doc = run(cfg)
    (out / "dp_finetune.json").write_text(json.dumps(doc, indent=1) + "\n")
    try:
        plot(doc, out / "dp_finetune.png")
        print(f"wrote {out / 'dp_finetune.png'}")
    except ImportError:  # matplotlib is an optional extra
        print("matplotlib not installed: no figure")
    print(f"wrote {out / 'dp_finetune.json'}")
    return doc


if __name__ == "__main__":
    main()
