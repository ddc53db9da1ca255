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
    """The zoo's oracle (tests/zoo.py) of each research statistic, as lists per leaf."""
    o = zoo.oracle_from_grads
    leaves = [np.asarray(x, np.float64) for x in jax.tree.leaves(g)]
    per_leaf = [np.sqrt(np.sum(x.reshape(B, -1) ** 2, 1)) for x in leaves]
    glob = np.sqrt(sum(np.sum(x.reshape(B, -1) ** 2, 1) for x in leaves))
    return (jax.tree.leaves(o(g, "fourth_moment")), jax.tree.leaves(o(g, "kurtosis")),
            o(g, "gradient_diversity"), per_leaf, glob)


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
    for bad in (-0.1, float("nan"), (), (0.5, float("nan"))):
        with pytest.raises(ValueError, match="levels must lie in"):
            js.stats.norm_quantiles(bad)
    for bad in ("0.5", True, [[0.5]], [0.5, "a"], None):
        with pytest.raises(TypeError, match=r"norm_quantiles\(q=...\)"):
            js.stats.norm_quantiles(bad)
    assert js.stats.norm_quantiles(np.float32(0.5)).q == 0.5
    assert jnp.all(js.stats.norm_quantiles((0.5,)).q == (0.5,))


def test_norm_quantiles_scalar_level_gives_scalars():
    """Regression: a scalar level raised TypeError ('float' object is not iterable); like
    jnp.quantile it gives a scalar per leaf (and a scalar of the global norms)."""
    with zoo.x64():
        r = np.random.default_rng(3)
        p = {"w": jnp.asarray(r.normal(size=(3, 2))), "b": jnp.asarray(r.normal(size=2))}
        b = {"x": jnp.asarray(r.normal(size=(5, 3))), "y": jnp.asarray(r.normal(size=(5, 2)))}
        loss = lambda p, b: jnp.mean((jnp.tanh(b["x"] @ p["w"] + p["b"]) - b["y"]) ** 2)  # noqa: E731
        g = jax.vmap(jax.grad(lambda p, ex: loss(p, jax.tree.map(lambda a: a[None], ex))),
                     (None, 0))(p, b)
        per_leaf = {k: np.sqrt(np.sum(np.asarray(v).reshape(5, -1) ** 2, 1)) for k, v in g.items()}
        glob = np.sqrt(sum(n**2 for n in per_leaf.values()))
        for q in (0.5, np.float32(0.25), jnp.asarray(0.9), 1):
            both = (js.stats.norm_quantiles(q), js.stats.norm_quantiles(q, per_leaf=False))
            leafwise, whole = js.per_example_stat(loss, both)(p, b)
            for k in p:
                assert leafwise[k].shape == ()
                np.testing.assert_allclose(leafwise[k], np.quantile(per_leaf[k], float(q)),
                                           rtol=1e-12)
            assert whole.shape == ()
            np.testing.assert_allclose(whole, np.quantile(glob, float(q)), rtol=1e-12)
        # a one-level sequence keeps its axis
        assert js.per_example_stat(loss, js.stats.norm_quantiles([0.5], per_leaf=False))(
            p, b).shape == (1,)
