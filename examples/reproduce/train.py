"""One training run: optimizer construction, the jitted step, evaluation and SNR logging.

Every training step is ONE ``js.value_and_per_example_stat`` call with the
optimizer's ``stat_request`` and ONE ``opt.update``, jitted together
(:func:`make_step`).

Every optimizer is chained after :func:`js.optim.track_gradient_statistics`
(an identity transform that keeps EMAs of the squared batch mean and of the
per-example variance per coordinate), so the gradient SNR is measured during
training from the statistics the step computes anyway, plus the variance.

The peak learning rate (and the clip bound of the Adam variants) is a
hyperparameter held in the optimizer state (``optax.inject_hyperparams``), so
one compiled step serves a whole learning-rate sweep, clipped or not; the
schedule is a linear warm-up then cosine decay to 10% of the peak.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxpr_surgery as js

from . import model

__all__ = [
    "OptSpec", "SIGN_OPTIMIZERS", "ADAM_OPTIMIZERS", "build_optimizer", "make_step",
    "set_hyperparams", "snr_summary", "Trainer",
]

#: decay of the EMA in the sign placements with momentum (ema_of_sign, sign_ema,
#: per_example_sign_sgd) and of Adam's first moment.
B1 = 0.9
#: decay of track_gradient_statistics' EMAs (about 20 steps).
TRACK_DECAY = 0.95


@dataclasses.dataclass(frozen=True)
class OptSpec:
    """An optimizer of the study: ``name`` and whether the update is clipped."""

    name: str
    clip: bool = False

    @property
    def label(self) -> str:
        return self.name + (" +clip" if self.clip else "")


SIGN_OPTIMIZERS = ("per_example_sign_sgd", "sign_sgd", "ema_of_sign", "sign_ema")
ADAM_OPTIMIZERS = ("adam", "micro_adam", "micro_adam_var", "micro_adam_msq")

#: where the sign is applied in the chain per-example -> batch mean -> EMA -> update
SIGN_PLACEMENT = {
    "per_example_sign_sgd": "per_example",
    "sign_sgd": "batch_mean",
    "ema_of_sign": "batch_mean",
    "sign_ema": "ema",
}


def _core(name: str, lr, max_update_norm):
    """The optimizer ``name`` with learning rate (schedule) ``lr``.

    The Adam variants are ``chain(scale_by_<name>, clip_by_global_norm(max_update_norm),
    scale_by_learning_rate(lr))``: with ``max_update_norm = inf`` the clip is the
    identity and this is exactly ``js.optim.<name>(lr)``; otherwise the
    *update* m/sqrt(v) (after the preconditioner, before the learning rate) is
    clipped. The bound is a hyperparameter in the state, so the clipped and
    unclipped runs share one compiled step.
    """
    jso = js.optim
    if name == "per_example_sign_sgd":
        return jso.per_example_sign_sgd(lr, b1=B1)  # sign -> batch mean -> EMA
    if name == "sign_sgd":
        return jso.sign_sgd(lr)  # batch mean -> sign (no EMA)
    if name == "ema_of_sign":
        return jso.ema_of_sign(lr, b1=B1)  # batch mean -> sign -> EMA
    if name == "sign_ema":
        return jso.sign_ema(lr, b1=B1)  # batch mean -> EMA -> sign
    if name in ADAM_OPTIMIZERS:
        return jso.chain(
            getattr(jso, "scale_by_" + name)(b1=B1),
            optax.clip_by_global_norm(max_update_norm),
            optax.scale_by_learning_rate(lr),
        )
    raise ValueError(f"unknown optimizer {name!r}")


def build_optimizer(name: str, *, steps: int, warmup_frac: float = 0.05):
    """``chain(track_gradient_statistics, inject_hyperparams(optimizer))``.

    The peak learning rate and the update-norm bound live in
    ``state[1].hyperparams`` (see :func:`set_hyperparams`); the schedule is a
    linear warm-up over ``warmup_frac * steps`` then cosine decay to 10%.
    """
    warmup = max(1, int(warmup_frac * steps))
    unit = optax.warmup_cosine_decay_schedule(0.0, 1.0, warmup, max(steps, warmup + 1),
                                              end_value=0.1)

    def factory(learning_rate, max_update_norm):
        return _core(name, lambda count: learning_rate * unit(count), max_update_norm)

    inner_request = js.optim.stat_request(factory(1.0, math.inf))
    injected = optax.inject_hyperparams(factory)(learning_rate=1.0, max_update_norm=math.inf)
    injected = js.optim.PerExampleTransformation(injected.init, injected.update, inner_request)
    return js.optim.chain(js.optim.track_gradient_statistics(TRACK_DECAY), injected)


def set_hyperparams(state, **values):
    """Returns ``state`` with the injected hyperparameters replaced by ``values``."""
    hp = dict(state[1].hyperparams)
    for k, v in values.items():
        hp[k] = jnp.asarray(v, hp[k].dtype)
    return (state[0], state[1]._replace(hyperparams=hp))


def make_step(opt, loss_fn: Callable = model.loss_fn):
    """The jitted training step: one statistic call, one update."""
    stat_fn = js.value_and_per_example_stat(loss_fn, js.optim.stat_request(opt))

    @jax.jit
    def step(params, state, batch):
        loss, stats = stat_fn(params, batch)
        updates, state = opt.update(stats["mean"], state, params,
                                    **js.optim.update_kwargs(stats))
        return optax.apply_updates(params, updates), state, loss

    return step


@jax.jit
def snr_summary(track_state, batch_size):
    """Summaries of the per-coordinate SNR tracked by ``track_gradient_statistics``.

    The tracker's ratio EMA[g_bar^2] / EMA[sigma_hat^2] estimates
    mu^2/sigma^2 + 1/B; the per-example SNR is ``max(ratio - 1/B, 0)``. The SNR
    of the batch mean is B times that, and of an EMA of batch means with decay
    beta (independent noise, slowly moving mean) ``(1+beta)/(1-beta) * B`` times.
    Coordinates whose variance is 0 (bytes never seen) are left out. The
    predicted *sign fidelity* E[sign(x) sign(mu)] of a Gaussian quantity x of
    power-SNR s is erf(sqrt(s/2)), averaged over coordinates.
    """
    B = jnp.asarray(batch_size, jnp.float32)
    ratio = jnp.concatenate([jnp.ravel(x) for x in jax.tree.leaves(track_state.snr)])
    var = jnp.concatenate([jnp.ravel(x) for x in jax.tree.leaves(track_state.variance)])
    valid = var > 0
    pe = jnp.where(valid, jnp.maximum(ratio - 1.0 / B, 0.0), jnp.nan)
    n_ema = (1 + B1) / (1 - B1)
    out = {}
    for key, factor in (("per_example", 1.0), ("batch_mean", B), ("ema", B * n_ema)):
        s = pe * factor
        out[f"snr_median_{key}"] = jnp.nanmedian(s)
        fid = jnp.where(valid, jax.scipy.special.erf(jnp.sqrt(jnp.nan_to_num(s) / 2)), 0.0)
        out[f"sign_fidelity_{key}"] = jnp.sum(fid) / jnp.maximum(jnp.sum(valid), 1)
    tr = track_state.trace_variance
    out["noise_scale"] = track_state.noise_scale  # tr(Sigma) / |g_bar|^2 (includes 1/B)
    out["snr_aggregate_per_example"] = jnp.maximum(track_state.sq_norm - tr / B, 0.0) / tr
    return out


class Trainer:
    """Trains the LM with cached compiled steps (one per optimizer / batch size / length)."""

    def __init__(self, corpus, model_cfg: dict, *, eval_windows: int, eval_every: int,
                 clip_rms: float = 1.0):
        self.corpus = corpus
        self.model_cfg = dict(model_cfg)
        self.seq_len = model_cfg["seq_len"]
        self.eval_batch = corpus.heldout_windows(eval_windows, self.seq_len)
        self.eval_every = eval_every
        self.clip_rms = clip_rms
        params = model.init_params(jax.random.PRNGKey(0), **self.model_cfg)
        self.n_params = model.n_params(params)
        self._eval = jax.jit(model.loss_fn)
        self._cache = {}

    def _compiled(self, name, steps, batch_size):
        key = (name, steps, batch_size)
        if key not in self._cache:
            opt = build_optimizer(name, steps=steps)
            self._cache[key] = (opt, make_step(opt))
        return self._cache[key]

    @property
    def max_update_norm(self) -> float:
        """The clip bound of ``+clip`` runs: RMS of the update <= clip_rms."""
        return self.clip_rms * math.sqrt(self.n_params)

    def run(self, spec: OptSpec, lr: float, seed: int, *, batch_size: int, steps: int,
            progress=None) -> dict:
        """One run; returns a JSON-able record. ``progress``: a tqdm bar, advanced per step."""
        opt, step = self._compiled(spec.name, steps, batch_size)
        params = model.init_params(jax.random.PRNGKey(seed), **self.model_cfg)
        state = set_hyperparams(opt.init(params), learning_rate=lr,
                                max_update_norm=self.max_update_norm if spec.clip else math.inf)
        batches = self.corpus.batches(np.random.default_rng(seed), batch_size, self.seq_len)
        # A window of eval_every steps whose mean training loss exceeds `limit`, or any
        # non-finite loss, stops the run as diverged. Single steps above `limit` from
        # which training recovers are counted as `spikes`, not as divergence.
        limit = 1.5 * math.log(model_vocab(self.model_cfg))
        losses, evals, snrs = [], [], []
        diverged = False
        t0 = time.perf_counter()
        pending = []
        for t in range(1, steps + 1):
            params, state, loss = step(params, state, next(batches))
            pending.append(loss)
            if t % self.eval_every == 0 or t == steps:
                vals = [float(x) for x in pending]
                pending = []
                losses.extend(vals)
                if not all(math.isfinite(v) for v in vals) or sum(vals) / len(vals) > limit:
                    diverged = True
                    break
                ev = float(self._eval(params, self.eval_batch))
                evals.append((t, ev))
                snr = {k: float(v) for k, v in snr_summary(state[0], batch_size).items()}
                snr["step"] = t
                snrs.append(snr)
                if progress is not None:
                    progress.set_postfix_str(f"{spec.label} lr={lr:.2g} s={seed} "
                                             f"eval={ev:.3f}", refresh=False)
            if progress is not None:
                progress.update(1)
        if diverged and progress is not None:
            progress.update(steps - t + 1)  # the steps this run skipped
        seconds = time.perf_counter() - t0
        final = evals[-1][1] if (evals and not diverged) else float("nan")
        return {
            "optimizer": spec.name,
            "clip": spec.clip,
            "label": spec.label,
            "lr": float(lr),
            "seed": int(seed),
            "batch_size": int(batch_size),
            "steps": int(steps),
            "diverged": diverged,
            "spikes": sum(1 for v in losses if not (math.isfinite(v) and v <= limit)),
            "final_eval_loss": final,
            "train_loss": [round(v, 5) if math.isfinite(v) else None for v in losses],
            "eval": [{"step": s, "loss": round(v, 5)} for s, v in evals],
            "snr": snrs,
            "seconds": round(seconds, 2),
        }


def model_vocab(cfg) -> int:
    return cfg.get("vocab", 256)
