"""Research statistics (fourth moment, kurtosis, gradient diversity, norm quantiles)
against the vmap(grad) oracle on zoo models, in float64 and float32."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import zoo

import jaxpr_surgery as js

CASES = ["mlp", "transformer", "transformer_scan_remat", "embedding_modes", "cnn"]


def _oracle(g, B):
    leaves = [np.asarray(x, np.float64) for x in jax.tree.leaves(g)]
    fourth = [np.mean(x**4, 0) for x in leaves]
    kurt = []
    for x in leaves:
        c = x - x.mean(0)
        var = np.mean(c**2, 0)
        with np.errstate(divide="ignore", invalid="ignore"):
            kurt.append(np.where(var > 0, np.mean(c**4, 0) / var**2, np.nan))
    sq = sum(np.sum(x.reshape(B, -1) ** 2, 1) for x in leaves)
    div = sq.sum() / sum(np.sum(x.sum(0) ** 2) for x in leaves)
    per_leaf = [np.sqrt(np.sum(x.reshape(B, -1) ** 2, 1)) for x in leaves]
    return fourth, kurt, div, per_leaf, np.sqrt(sq)


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("name", CASES)
def test_research_stats_match_oracle(name, dtype):
    case = zoo.get_case(name, dtype)
    B = jax.tree.leaves(case.batch)[0].shape[0]
    q = (0.0, 0.25, 0.5, 1.0)
    stats = (js.stats.fourth_moment(), js.stats.kurtosis(), js.stats.gradient_diversity(),
             js.stats.norm_quantiles(q), js.stats.norm_quantiles(q, per_leaf=False))
    with zoo._maybe_x64(case.params):
        out = jax.jit(js.per_example_stat(case.loss_fn, stats))(case.params, case.batch)
        out = jax.tree.map(np.asarray, out)
    g = zoo.per_example_grads(case)
    fourth, kurt, div, per_leaf, glob = _oracle(g, B)
    tol = dict(rtol=1e-9, atol=1e-12) if dtype == "float64" else dict(rtol=2e-3, atol=1e-6)
    for a, e in zip(jax.tree.leaves(out[0]), fourth, strict=True):
        np.testing.assert_allclose(a, e, rtol=tol["rtol"], atol=tol["atol"] * np.abs(e).max())
    for a, e in zip(jax.tree.leaves(out[1]), kurt, strict=True):
        finite = np.isfinite(a)
        # NaN only where the oracle is undefined or the raw moments cancel
        assert finite.mean() > 0.5 or not np.isfinite(e).any()
        np.testing.assert_allclose(a[finite], e[finite], rtol=10 * tol["rtol"] + 1e-6 * 0,
                                   atol=1e-6 if dtype == "float64" else 5e-2)
    np.testing.assert_allclose(out[2], div, rtol=tol["rtol"] * 10)
    for a, e in zip(jax.tree.leaves(out[3]), per_leaf, strict=True):
        np.testing.assert_allclose(a, np.quantile(e, q), rtol=tol["rtol"] * 10, atol=1e-12)
    np.testing.assert_allclose(out[4], np.quantile(glob, q), rtol=tol["rtol"] * 10)


def test_kurtosis_of_gaussian_and_cancellation():
    r = np.random.default_rng(0)
    z = jnp.asarray(r.standard_normal((4096, 3)), jnp.float32)
    lin = lambda w, b: jnp.mean(b["z"] @ w)  # noqa: E731 - per-example gradient z_b
    k = js.per_example_stat(lin, js.stats.kurtosis())(jnp.zeros(3), {"z": z})
    np.testing.assert_allclose(k, 3.0, atol=0.25)
    # mean 1e4 x the spread: float32 raw moments cancel: NaN, not a wrong number
    k = js.per_example_stat(lin, js.stats.kurtosis())(jnp.zeros(3), {"z": 1e4 + z})
    assert np.all(np.isnan(np.asarray(k)))


def test_norm_quantiles_bad_levels():
    with pytest.raises(ValueError, match="levels"):
        js.stats.norm_quantiles((0.5, 1.5))
    assert jnp.all(js.stats.norm_quantiles((0.5,)).q == (0.5,))
