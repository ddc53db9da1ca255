"""Research statistics (fourth moment, kurtosis, gradient diversity, norm quantiles):
their values on known distributions, their arguments' validation and scalar levels; and the
gradient noise scale where it is not defined (its documented value, and the printed reason).

Every one of them is checked against the vmap(grad) oracle on every zoo model, in float64
and float32, by the oracle matrix (test_oracle.py, ``STATS`` in conftest.py)."""

from __future__ import annotations

import math

import jax
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


# --------------------------------------------------------------------------- #
# The gradient noise scale where it is not defined (issue 58, item 10)
# --------------------------------------------------------------------------- #
def _noise(z):
    """``gradient_noise_scale`` and ``noise_scale_components`` under ``jit`` of a batch
    whose per-example gradients are the rows of ``z``."""
    lin = lambda w, b: jnp.mean(b["z"] @ w)  # noqa: E731 - per-example gradient z_b
    stats = {"gns": js.stats.gradient_noise_scale(), "c": js.stats.noise_scale_components()}
    out = jax.jit(js.per_example_stat(lin, stats))(jnp.zeros(2), {"z": jnp.asarray(z)})
    np.testing.assert_array_equal(out["gns"], out["c"].noise_scale)  # one value, two ways
    return float(out["gns"]), out["c"]


def test_noise_scale_where_defined_prints_its_pieces():
    # mean [2, 0]: |g|^2 = 4, tr = 2/3 + 2/3, |G|^2 = 4 - (4/3)/4 = 11/3
    gns, c = _noise([[3.0, 0.0], [1.0, 0.0], [2.0, 1.0], [2.0, -1.0]])
    assert gns == pytest.approx(4 / 11, rel=1e-6)
    assert str(c) == ("noise scale 0.3636 = tr(Sigma) / |G|^2 = 1.333 / 3.667 "
                      "(unbiased pieces, B = 4)")
    assert repr(c).startswith("NoiseScaleComponents(grad_sq_norm=")  # repr stays the tuple's


def test_noise_scale_undefined_is_inf_and_says_why():
    """The mean is 0: the unbiased |G|^2 estimate is -tr/B < 0. Traced, the statistic cannot
    raise: it is inf (documented), and the components printed say why."""
    gns, c = _noise([[1.0, 0.0], [-1.0, 0.0], [0.0, 1.0], [0.0, -1.0]])
    assert gns == math.inf
    np.testing.assert_allclose([c.grad_sq_norm, c.trace_cov], [-1 / 3, 4 / 3], rtol=1e-6)
    text = str(c)
    assert text.startswith("noise scale inf (undefined): the unbiased |G|^2 estimate "), text
    assert "|g_mean|^2 - tr(Sigma)/B = 0 - 1.333/4 = -0.3333 is not positive" in text, text
    assert "Average the pieces over steps" in text, text
    # pieces averaged over steps by hand print the same way (python floats)
    avg = js.stats.NoiseScaleComponents(1.0, 4.0, 4.0)
    assert str(avg).startswith("noise scale 4 = tr(Sigma) / |G|^2 = 4 / 1 ("), str(avg)


def test_noise_scale_without_noise_and_nonfinite():
    gns, c = _noise([[1.0, 2.0]] * 3)  # every example the same gradient: no noise
    assert 0 <= gns < 1e-6  # (0 up to the rounding of the variance, which jax 0.10 shows)
    same = js.stats.NoiseScaleComponents(jnp.float32(5.0), jnp.float32(0.0), jnp.float32(3.0))
    assert same.noise_scale == 0 and str(same).startswith("noise scale 0: "), str(same)
    assert "no noise" in str(same)
    gns, c = _noise(np.zeros((3, 2), np.float32))  # 0 / 0: no noise either
    assert gns == 0 and "no noise" in str(c)
    gns, c = _noise([[1.0, 0.0], [np.nan, 0.0], [0.0, 1.0]])
    assert math.isnan(gns)
    assert str(c).startswith("noise scale nan: ") and "not finite" in str(c), str(c)


def test_noise_scale_components_traced_or_batched_print_as_the_tuple():
    lin = lambda w, b: jnp.mean(b["z"] @ w)  # noqa: E731
    comp = js.per_example_stat(lin, js.stats.noise_scale_components())
    z = jnp.asarray(np.random.default_rng(0).normal(size=(2, 5, 3)), jnp.float32)
    seen = []

    def traced(w, b):
        c = comp(w, b)
        seen.append(str(c))  # a tracer has no value: no sentence, and no error
        return c

    jax.jit(traced)(jnp.zeros(3), {"z": z[0]})
    assert seen[0].startswith("NoiseScaleComponents(grad_sq_norm="), seen[0]
    two = jax.vmap(comp, in_axes=(None, 0))(jnp.zeros(3), {"z": z})  # two batches at once
    assert two.trace_cov.shape == (2,) and str(two) == repr(two)


def test_gradient_diversity_where_the_summed_gradient_is_zero():
    """Its documented values where ``|sum_b g_b|^2`` is 0: ``inf`` where the per-example
    gradients cancel, 0 where every one is zero (the oracle's convention too: a random
    model whose gradients all vanished had the package's 0 against the oracle's NaN)."""
    lin = lambda w, b: jnp.mean(b["z"] @ w)  # noqa: E731 - per-example gradient z_b
    div = js.per_example_stat(lin, js.stats.gradient_diversity())
    z = jnp.array([[1.0, -2.0], [-1.0, 2.0], [0.5, 0.25], [-0.5, -0.25]])
    assert float(div(jnp.zeros(2), {"z": z})) == math.inf
    assert float(div(jnp.zeros(2), {"z": jnp.zeros((3, 2))})) == 0.0
    z = jnp.array([[1.0, -2.0], [3.0, 0.5], [0.5, 0.25]])  # and a value to compare with
    g = np.asarray(z, np.float64) / 3
    want = np.sum(g**2) / np.sum(g.sum(0) ** 2)
    np.testing.assert_allclose(float(div(jnp.zeros(2), {"z": z})), want, rtol=1e-6)
