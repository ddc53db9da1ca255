"""Research statistics (fourth moment, kurtosis, gradient diversity, norm quantiles):
their values on known distributions, their arguments' validation and scalar levels.

Every one of them is checked against the vmap(grad) oracle on every zoo model, in float64
and float32, by the oracle matrix (test_oracle.py, ``STATS`` in conftest.py)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import zoo

import jaxpr_surgery as js


def test_kurtosis_of_gaussian_and_cancellation():
    r = np.random.default_rng(0)
    z = jnp.asarray(r.standard_normal((4096, 3)), jnp.float32)
    lin = lambda w, b: jnp.mean(b["z"] @ w)  # noqa: E731 - per-example gradient z_b
    k = js.per_example_stat(lin, js.stats.kurtosis())(jnp.zeros(3), {"z": z})
    np.testing.assert_allclose(k, 3.0, atol=0.25)
    # mean 1e4 x the spread: float32 raw moments would cancel; the centred sums do not
    # (the float64 kurtosis of the same float32 gradients)
    zs = 1e4 + z
    k = js.per_example_stat(lin, js.stats.kurtosis())(jnp.zeros(3), {"z": zs})
    c = np.asarray(zs, np.float64) - np.mean(np.asarray(zs, np.float64), 0)
    np.testing.assert_allclose(k, np.mean(c**4, 0) / np.mean(c**2, 0) ** 2, rtol=1e-4)


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
        g = zoo.vmap_grads(loss, p, b)
        for q in (0.5, np.float32(0.25), jnp.asarray(0.9), 1):
            both = (js.stats.norm_quantiles(q), js.stats.norm_quantiles(q, per_leaf=False))
            leafwise, whole = js.per_example_stat(loss, both)(p, b)
            for k in p:
                assert leafwise[k].shape == ()
                np.testing.assert_allclose(
                    leafwise[k], zoo.oracle_from_grads(g, "norm_quantiles", q=float(q))[k],
                    rtol=1e-12)
            assert whole.shape == ()
            np.testing.assert_allclose(
                whole, zoo.oracle_from_grads(g, "norm_quantiles", q=float(q), per_leaf=False),
                rtol=1e-12)
        # a one-level sequence keeps its axis
        assert js.per_example_stat(loss, js.stats.norm_quantiles([0.5], per_leaf=False))(
            p, b).shape == (1,)
