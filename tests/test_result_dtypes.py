"""Result dtypes, as documented (docs/statistics.md, docs/sharp_edges.md#mixed-precision).

Gradient-like results (``mean``, ``sum``, ``clipped_mean``, ``clipped_sum``) come back in
each parameter leaf's dtype, like ``jax.grad``; every other statistic in at least float32,
whatever the parameters' dtype; float64 parameters (x64) give float64.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from zoo import x64

import jaxpr_surgery as js

S = js.stats
GRADIENT_LIKE = ("mean", "sum", "clipped_mean", "clipped_sum")


def _stats(params):
    return {
        "mean": S.mean(), "sum": S.sum(),
        "clipped_mean": S.clipped_mean(1.0), "clipped_sum": S.clipped_sum(1.0),
        "second_moment": S.second_moment(), "variance": S.variance(),
        "sign_mean": S.sign_mean(), "abs_mean": S.abs_mean(),
        "elementwise": S.elementwise(jnp.cos, name="cos"),
        "fourth_moment": S.fourth_moment(), "kurtosis": S.kurtosis(),
        "sq_norms": S.sq_norms(), "norms": S.norms(), "norms_per_leaf": S.norms(per_leaf=True),
        "snr": S.snr(), "gradient_noise_scale": S.gradient_noise_scale(),
        "noise_scale_components": S.noise_scale_components(),
        "gradient_diversity": S.gradient_diversity(), "norm_quantiles": S.norm_quantiles(),
        "per_example_dots": S.per_example_dots(params),
        "per_example_cosines": S.per_example_cosines(params),
        "kron_moments": S.kron_moments(),
    }


def _loss(p, b):
    h = jnp.tanh(b["x"].astype(p["w"].dtype) @ p["w"] + p["b"])  # dense + scale-shift
    return jnp.mean(((h @ p["v"]).astype(jnp.float32) - b["y"]) ** 2)


def _problem(dtypes):
    r = np.random.default_rng(0)
    dw, db, dv = dtypes
    params = {"w": jnp.asarray(r.normal(size=(5, 6)), dw), "b": jnp.asarray(r.normal(size=6), db),
              "v": jnp.asarray(r.normal(size=6) / 2, dv)}
    batch = {"x": jnp.asarray(r.normal(size=(7, 5)), jnp.float32),
             "y": jnp.asarray(r.normal(size=7), jnp.float32)}
    return params, batch


def _check(out, params, floor):
    for name, value in out.items():
        if name in GRADIENT_LIKE:  # shaped like params, in each leaf's own dtype
            for k in params:
                assert value[k].dtype == params[k].dtype, (name, k, value[k].dtype)
        else:
            for leaf in jax.tree.leaves(value):
                want = jnp.promote_types(floor, leaf.dtype)
                assert leaf.dtype == want and jnp.finfo(leaf.dtype).bits >= 32, (
                    name, leaf.dtype)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
def test_result_dtypes_low_precision(dtype):
    params, batch = _problem((dtype, dtype, dtype))
    out = js.per_example_stat(_loss, _stats(params))(params, batch)
    _check(out, params, jnp.float32)
    for name in set(out) - set(GRADIENT_LIKE):  # not a float32 result rounded to the params'
        for leaf in jax.tree.leaves(out[name]):
            assert leaf.dtype == jnp.float32, (name, leaf.dtype)


def test_result_dtypes_mixed_leaves():
    """bf16, float16 and float32 leaves in one tree: each gradient-like leaf in its own dtype."""
    params, batch = _problem((jnp.bfloat16, jnp.float16, jnp.float32))
    out = js.per_example_stat(_loss, _stats(params))(params, batch)
    _check(out, params, jnp.float32)
    assert out["mean"]["w"].dtype == jnp.bfloat16 and out["mean"]["b"].dtype == jnp.float16
    assert out["second_moment"]["w"].dtype == jnp.float32


@pytest.mark.parametrize("dtype", ["float64", "float32", "bfloat16"])
def test_result_dtypes_under_x64(dtype):
    """float64 parameters give float64 everywhere; float32 and bf16 ones stay as without x64."""
    with x64():
        params, batch = _problem((dtype,) * 3)
        out = js.per_example_stat(_loss, _stats(params))(params, batch)
        _check(out, params, jnp.float32)
        want = jnp.float64 if dtype == "float64" else jnp.float32
        for name in set(out) - set(GRADIENT_LIKE):
            for leaf in jax.tree.leaves(out[name]):
                assert leaf.dtype == want, (name, leaf.dtype)


# --------------------------------------------------------------------------- #
# bfloat16 parameters
# --------------------------------------------------------------------------- #
def test_low_precision_result_dtypes():
    loss = lambda w, b: jnp.mean((b["x"] @ w) ** 2)  # noqa: E731
    w = jnp.ones(3, jnp.bfloat16)
    b = {"x": jnp.arange(12.0).reshape(4, 3).astype(jnp.bfloat16)}
    m, m2, n, s = js.per_example_stat(loss, (js.stats.mean(), js.stats.second_moment(),
                                             js.stats.norms(), js.stats.sign_mean()))(w, b)
    assert m.dtype == jnp.bfloat16  # gradient-like: the parameters' dtype, like jax.grad
    assert m2.dtype == jnp.float32 and n.dtype == jnp.float32 and s.dtype == jnp.float32
