"""Small self-contained models (plain JAX) and a vmap(grad) oracle for the
composition tests (jit, grad, vmap, pmap, shard_map, sharded jit, chunking,
errors, primitive coverage, explain).

Every model is ``make_<name>(dtype=jnp.float32, seed=...) -> (loss, params, batch)``
with ``loss(params, batch)`` a scalar *mean* over ``B = 8`` examples that do not
interact. ``oracle(loss, params, batch)`` returns every statistic of ``STATS``
computed from ``jax.vmap(jax.grad(per_example_loss))`` by the zoo's oracle
(``zoo.oracle_from_grads``: reductions in numpy float64), and ``STATS`` pairs each
statistic's name with its constructor.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
import zoo

import jaxpr_surgery as js

#: the fake CPU devices of the multi-device tests (tests/conftest.py sets the flag)
NDEV = 4
needs_devices = pytest.mark.skipif(
    jax.device_count() < NDEV,
    reason=f"needs {NDEV} devices: run with XLA_FLAGS=--xla_force_host_platform_device_count="
    f"{NDEV} set before jax initialises (tests/conftest.py does this)",
)

#: the checkout, and the folder of the tests' scripts
TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)


def subprocess_env():
    """This process's environment for a script under tests/ that sets its own device
    count: the checkout importable, CPU only, no inherited ``XLA_FLAGS``."""
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env["JAX_PLATFORMS"] = "cpu"
    env.pop("XLA_FLAGS", None)
    return env


def run_cases(script, cases, timeout):
    """``{case: row}`` of the JSON lines that ``script`` (under tests/) prints for
    ``cases``, run in a subprocess (`subprocess_env`)."""
    out = subprocess.run([sys.executable, os.path.join(TESTS, script), *cases],
                         env=subprocess_env(), capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    return {r["case"]: r for r in rows}


B = 8
CLIP = 0.5  # clip norm used throughout; below most per-example norms of the models


def cast_to_varying(w, axis):
    """A loss's own cast of ``w`` to varying over ``axis`` inside shard_map (JAX refuses it
    on a value that varies over ``axis`` already)."""
    if hasattr(jax.lax, "pcast"):
        return jax.lax.pcast(w, axis, to="varying")
    return jax.lax.pvary(w, axis)  # (jax 0.10)


def x64():
    """Context manager enabling float64 locally (``jax.enable_x64(True)`` in jax 0.10)."""
    enable = getattr(jax, "enable_x64", None)
    if enable is not None:
        return enable(True)
    from jax.experimental import enable_x64  # pragma: no cover - older jax

    return enable_x64()


def _keys(seed, n):
    """``n`` independent numpy generators (numpy: building a model compiles nothing)."""
    return [np.random.default_rng((seed, i)) for i in range(n)]


def _normal(key, shape, scale, dtype, offset=0.0):
    x = (key.standard_normal(shape) * scale + offset).astype(np.float32)
    return jnp.asarray(x, dtype=dtype)


def _randint(key, shape, high):
    return jnp.asarray(key.integers(0, high, shape), dtype=jnp.int32)


# --------------------------------------------------------------------------- #
# MLP with bias
# --------------------------------------------------------------------------- #
def mlp_loss(params, batch):
    h = jnp.tanh(batch["x"] @ params["l1"]["w"] + params["l1"]["b"])
    logits = h @ params["l2"]["w"] + params["l2"]["b"]
    logp = jax.nn.log_softmax(logits, axis=-1)
    nll = -jnp.take_along_axis(logp, batch["y"][:, None], axis=-1)[:, 0]
    return jnp.mean(nll)


def make_mlp(dtype=jnp.float32, seed=0, batch_size=B):
    D, H, C = 5, 7, 3
    k = _keys(seed, 6)
    params = {
        "l1": {"w": _normal(k[0], (D, H), 1 / math.sqrt(D), dtype),
               "b": _normal(k[1], (H,), 0.3, dtype)},
        "l2": {"w": _normal(k[2], (H, C), 1 / math.sqrt(H), dtype),
               "b": _normal(k[3], (C,), 0.3, dtype)},
    }
    batch = {
        "x": _normal(k[4], (batch_size, D), 1.0, dtype),
        "y": _randint(k[5], (batch_size,), C),
    }
    return mlp_loss, params, batch


# --------------------------------------------------------------------------- #
# Tiny 1-layer transformer: embedding, einsum attention, layernorm, tied output
# --------------------------------------------------------------------------- #
T, V, D_MODEL, HEADS, D_HEAD = 5, 11, 8, 2, 4


def _layernorm(x, g, b, eps=1e-5):
    mu = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x - mu), axis=-1, keepdims=True)
    return (x - mu) * jax.lax.rsqrt(var + eps) * g + b


def transformer_loss(params, batch):
    ids = batch["ids"]
    table = params["embed"]
    h = table[ids]  # [b, T, D]
    a = _layernorm(h, params["ln1"]["g"], params["ln1"]["b"])
    q = jnp.einsum("btd,dhk->bthk", a, params["wq"])
    k = jnp.einsum("btd,dhk->bthk", a, params["wk"])
    v = jnp.einsum("btd,dhk->bthk", a, params["wv"])
    s = jnp.einsum("bthk,bshk->bhts", q, k) / math.sqrt(D_HEAD)
    t = ids.shape[1]
    causal = jnp.tril(jnp.ones((t, t), dtype=bool))
    s = jnp.where(causal, s, jnp.asarray(-1e9, s.dtype))
    w = jax.nn.softmax(s, axis=-1)
    o = jnp.einsum("bhts,bshk->bthk", w, v)
    h = h + jnp.einsum("bthk,hkd->btd", o, params["wo"])
    h = _layernorm(h, params["lnf"]["g"], params["lnf"]["b"])
    logits = h @ table.T  # tied output embedding
    logp = jax.nn.log_softmax(logits, axis=-1)
    nll = -jnp.take_along_axis(logp, batch["targets"][..., None], axis=-1)[..., 0]
    return jnp.mean(nll)


def make_transformer(dtype=jnp.float32, seed=1, batch_size=B):
    k = _keys(seed, 12)
    D, H, K = D_MODEL, HEADS, D_HEAD
    params = {
        "embed": _normal(k[0], (V, D), 0.5, dtype),
        "ln1": {"g": _normal(k[1], (D,), 0.1, dtype, 1.0), "b": _normal(k[2], (D,), 0.1, dtype)},
        "wq": _normal(k[3], (D, H, K), 1 / math.sqrt(D), dtype),
        "wk": _normal(k[4], (D, H, K), 1 / math.sqrt(D), dtype),
        "wv": _normal(k[5], (D, H, K), 1 / math.sqrt(D), dtype),
        "wo": _normal(k[6], (H, K, D), 1 / math.sqrt(H * K), dtype),
        "lnf": {"g": _normal(k[7], (D,), 0.1, dtype, 1.0), "b": _normal(k[8], (D,), 0.1, dtype)},
    }
    ids = _randint(k[9], (batch_size, T + 1), V)
    batch = {"ids": ids[:, :-1], "targets": ids[:, 1:]}
    return transformer_loss, params, batch


# --------------------------------------------------------------------------- #
# DoRA-style LoRA + weight decay: leaves without a fast rule (fallback). The merged
# weight is normalised per column before it meets the data (a merged ``W + A @ B`` alone
# is served: sites/lora.py)
# --------------------------------------------------------------------------- #
def lora_loss(params, batch):
    w = params["W"] + params["A"] @ params["B"]
    w = w / jnp.sqrt(jnp.sum(jnp.square(w), axis=0, keepdims=True))
    h = jnp.tanh(batch["x"] @ w + params["b"])
    pred = h @ params["head"]
    return jnp.mean(jnp.square(pred[:, 0] - batch["y"])) + 1e-2 * jnp.sum(jnp.square(params["W"]))


def make_lora(dtype=jnp.float32, seed=2, batch_size=B):
    D, H, R = 4, 5, 2
    k = _keys(seed, 7)
    params = {
        "W": _normal(k[0], (D, H), 0.5, dtype),
        "A": _normal(k[1], (D, R), 0.3, dtype),
        "B": _normal(k[2], (R, H), 0.3, dtype),
        "b": _normal(k[3], (H,), 0.3, dtype),
        "head": _normal(k[4], (H, 1), 0.5, dtype),
    }
    batch = {"x": _normal(k[5], (batch_size, D), 1.0, dtype),
             "y": _normal(k[6], (batch_size,), 1.0, dtype)}
    return lora_loss, params, batch


MODELS = {"mlp": make_mlp, "transformer": make_transformer}


def lin_case():
    """A linear least-squares model's ``(w, batch)``, float32, B = 6 (for the API tests)."""
    r = np.random.default_rng(5)
    w = jnp.asarray(r.standard_normal(3), jnp.float32)
    b = {"x": jnp.asarray(r.standard_normal((6, 3)), jnp.float32),
         "y": jnp.asarray(r.standard_normal(6), jnp.float32)}
    return w, b


# --------------------------------------------------------------------------- #
# Statistics and the oracle
# --------------------------------------------------------------------------- #
STATS = {
    "mean": js.stats.mean,
    "sum": js.stats.sum,
    "second_moment": js.stats.second_moment,
    "variance": js.stats.variance,
    "sign_mean": js.stats.sign_mean,
    "abs_mean": js.stats.abs_mean,
    "sq_norms": js.stats.sq_norms,
    "norms": js.stats.norms,
    "clipped_mean": lambda: js.stats.clipped_mean(CLIP),
    "clipped_sum": lambda: js.stats.clipped_sum(CLIP),
    "snr": js.stats.snr,
    "gradient_noise_scale": js.stats.gradient_noise_scale,
}
STAT_NAMES = tuple(STATS)
# statistics that return one value per example (not reduced over examples)
PER_EXAMPLE = ("sq_norms", "norms")


def all_stats():
    """A dict of every built-in statistic (one pass computes them all)."""
    return {name: make() for name, make in STATS.items()}


def all_eqns(jaxpr):
    """Every equation of ``jaxpr`` (a Jaxpr or ClosedJaxpr) and, depth first, of the
    jaxprs in its equations' params (scan, cond, pjit, custom rules, ...)."""
    for e in getattr(jaxpr, "jaxpr", jaxpr).eqns:
        yield e
        for sub in jax.extend.core.jaxprs_in_params(e.params):
            yield from all_eqns(sub)


def per_example_loss(loss):
    def per_example(params, example):
        return loss(params, jax.tree.map(lambda x: x[None], example))

    return per_example


def per_example_grads(loss, params, batch):
    """``vmap(grad(per_example_loss))``: pytree like params with leaves ``[B, ...]``."""
    return jax.jit(jax.vmap(jax.grad(per_example_loss(loss)), in_axes=(None, 0)))(params, batch)


def oracle_kwargs(name, clip_norm=CLIP):
    """The options of statistic ``name`` of :data:`STATS` for ``zoo.oracle_from_grads``."""
    return {"clip_norm": clip_norm} if name.startswith("clipped_") else {}


def stats_of_grads(g, names=STAT_NAMES, clip_norm=CLIP, xp=np):
    """``{name: zoo.oracle_from_grads(g, name)}`` for the statistics of :data:`STATS`:
    numpy float64, or ``xp=jnp`` in JAX (differentiable, for the second-order tests)."""
    return {k: zoo.oracle_from_grads(g, k, xp=xp, **oracle_kwargs(k, clip_norm)) for k in names}


def oracle(loss, params, batch, clip_norm=CLIP):
    """Every statistic of :data:`STATS` from ``jax.vmap(jax.grad(per_example_loss))``
    (the zoo's oracle, tests/zoo.py: numpy float64)."""
    g = jax.jit(per_example_grads, static_argnums=0)(loss, params, batch)
    return stats_of_grads(g, clip_norm=clip_norm)


# --------------------------------------------------------------------------- #
# Comparison
# --------------------------------------------------------------------------- #
def assert_tree_close(actual, expected, rtol=1e-4, atol=1e-5, err_msg=""):
    """Structure and values equal; NaN must match NaN, inf must match inf.

    ``atol`` is relative to the leaf's largest finite magnitude (rounding errors
    scale with the leaf, not with each element), plus 1e-7 absolute.
    """
    a_leaves, a_tree = jax.tree.flatten(actual)
    e_leaves, e_tree = jax.tree.flatten(expected)
    assert a_tree == e_tree, f"{err_msg}: structure {a_tree} != {e_tree}"
    for a, e in zip(a_leaves, e_leaves, strict=True):
        a = np.asarray(a, dtype=np.float64)
        e = np.asarray(e, dtype=np.float64)
        assert a.shape == e.shape, f"{err_msg}: shape {a.shape} != {e.shape}"
        finite = e[np.isfinite(e)]
        scale = float(np.max(np.abs(finite))) if finite.size else 0.0
        np.testing.assert_allclose(a, e, rtol=rtol, atol=atol * scale + 1e-7, err_msg=err_msg)


def assert_stat_close(name, actual, expected, rtol=1e-4, atol=1e-5):
    """Like :func:`assert_tree_close` with tolerances per statistic.

    ``sign_mean`` is discontinuous where a per-example gradient is within
    rounding of 0 (the tied embedding has such entries): an entry may differ by
    one sign flip (2/B), and at most 1% of the entries may differ at all.
    ``snr`` is a ratio with a variance in the denominator: 1% relative.
    """
    if name == "sign_mean":
        assert_tree_close(actual, expected, rtol=0, atol=2.0 / B + 1e-6, err_msg=name)
        a = np.concatenate([np.ravel(x) for x in jax.tree.leaves(actual)]).astype(np.float64)
        e = np.concatenate([np.ravel(x) for x in jax.tree.leaves(expected)]).astype(np.float64)
        off = np.sum(~(np.abs(a - e) <= 1e-6) & ~(np.isnan(a) & np.isnan(e)))
        assert off <= 0.01 * a.size, f"sign_mean: {off} of {a.size} entries differ"
        return
    if name == "snr":
        assert_tree_close(actual, expected, rtol=1e-2, atol=1e-3, err_msg=name)
        return
    assert_tree_close(actual, expected, rtol=rtol, atol=atol, err_msg=name)


def assert_not_all_zero(tree, err_msg=""):
    """Guards against the shard_map trap: a silently missed site returns zeros."""
    leaves = [np.asarray(x) for x in jax.tree.leaves(tree)]
    assert leaves, err_msg
    for x in leaves:
        assert np.any(x != 0), f"{err_msg}: a leaf is all zeros (missed site?)"


# --------------------------------------------------------------------------- #
# Cached cases (compilation dominates test time on CPU: compute each once)
# --------------------------------------------------------------------------- #
_CASES: dict = {}
_ORACLES: dict = {}
_RESULTS: dict = {}


def get(name):
    """``(loss, params, batch)`` of model ``name`` in float32 (cached)."""
    if name not in _CASES:
        _CASES[name] = {**MODELS, "lora": make_lora, "tied": make_tied}[name]()
    return _CASES[name]


def oracle_of(name):
    """:func:`oracle` of model ``name`` (cached; per-example grads under jit)."""
    if name not in _ORACLES:
        loss, params, batch = get(name)
        _ORACLES[name] = oracle(loss, params, batch)
    return _ORACLES[name]


def result_of(name):
    """``jit(per_example_stat(loss, all_stats()))`` on model ``name``, full batch (cached)."""
    if name not in _RESULTS:
        loss, params, batch = get(name)
        _RESULTS[name] = jax.jit(js.per_example_stat(loss, all_stats()))(params, batch)
    return _RESULTS[name]


# --------------------------------------------------------------------------- #
# Tied embedding (cheap multi-site model): table[ids] -> scale-shift -> @ table.T
# --------------------------------------------------------------------------- #
def tied_loss(params, batch):
    table = params["embed"]
    h = jnp.tanh(table[batch["ids"]] * params["g"] + params["b"])  # [b, T, D]
    logits = h @ table.T
    logp = jax.nn.log_softmax(logits, axis=-1)
    nll = -jnp.take_along_axis(logp, batch["targets"][..., None], axis=-1)[..., 0]
    return jnp.mean(nll)


def make_tied(dtype=jnp.float32, seed=3, batch_size=B):
    Vt, D, Tt = 7, 4, 3
    k = _keys(seed, 4)
    params = {
        "embed": _normal(k[0], (Vt, D), 0.7, dtype),
        "g": _normal(k[1], (D,), 0.1, dtype, 1.0),
        "b": _normal(k[2], (D,), 0.1, dtype),
    }
    ids = _randint(k[3], (batch_size, Tt + 1), Vt)
    return tied_loss, params, {"ids": ids[:, :-1], "targets": ids[:, 1:]}


def assert_consistent(name, actual, reference, rtol=1e-5, atol=1e-6, err_msg=""):
    """Two implementations' values of statistic ``name`` (e.g. sharded vs one device).

    Tight, except for sign_mean (a near-zero gradient may flip sign: see
    :func:`assert_stat_close`) and snr (a ratio: 10x the tolerance).
    """
    if name == "sign_mean":
        assert_stat_close(name, actual, reference)
    elif name == "snr":
        assert_tree_close(actual, reference, rtol=10 * rtol, atol=10 * atol,
                          err_msg=f"{err_msg} {name}")
    else:
        assert_tree_close(actual, reference, rtol=rtol, atol=atol, err_msg=f"{err_msg} {name}")


def take(tree, i):
    """Entry ``i`` of the leading axis of every leaf."""
    return jax.tree.map(lambda x: x[i], tree)


def assert_independent_and_exact(loss, params, batch):
    """``loss`` (float64 ``params`` and ``batch``) is proved a mean of per-example terms
    with no warning, and ``mean()`` equals both the vmap(grad) oracle and ``jax.grad``
    (the cross-example tests' check that a loss is served, not only let through)."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert js.explain(loss)(params, batch).independence == "independent"
        mean = jax.jit(js.per_example_stat(loss, js.stats.mean()))(params, batch)
    grad = jax.grad(loss)(params, batch)
    oracle = zoo.vmap_grads(loss, params, batch)
    for k in params:
        np.testing.assert_allclose(mean[k], oracle[k].mean(0), rtol=1e-9, atol=1e-12)
        np.testing.assert_allclose(mean[k], grad[k], rtol=1e-9, atol=1e-12)
