"""Numerics: float64 models with float32 constants (a Flax BatchNorm's running statistics),
clipping in float64 models, and float32 squared norms past the float32 range.

Float64 results are compared with the jitted ``vmap(grad)`` oracle (zoo.py) at about
1e-12: a float32 step inside the transformation shows as 1e-7.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import zoo

import jaxpr_surgery as js

STATS = {
    "mean": (js.stats.mean(), {}),
    "sum": (js.stats.sum(), {}),
    "second_moment": (js.stats.second_moment(), {}),
    "variance": (js.stats.variance(), {}),
    "abs_mean": (js.stats.abs_mean(), {}),
    "sq_norms": (js.stats.sq_norms(), {}),
    "norms": (js.stats.norms(), {}),
}


def _all_stats(clip):
    stats = {k: s for k, (s, _) in STATS.items()}
    stats["clipped_mean"] = js.stats.clipped_mean(clip)
    stats["clipped_sum"] = js.stats.clipped_sum(0.5 * clip)
    return stats


def _median_norm(case):
    return float(np.median(np.sqrt(zoo.oracle(case, "sq_norms"))))


def _check_all(case, got, clip, rtol=1e-12):
    """Every entry of ``got`` (from `_all_stats`) against the oracle, relative to the
    oracle's scale of each leaf."""
    kws = {"clipped_mean": {"clip_norm": clip}, "clipped_sum": {"clip_norm": 0.5 * clip}}
    for name, value in got.items():
        kw = kws.get(name, {})
        want = zoo.oracle(case, name, **kw)
        scale = zoo.oracle_scale(case, name, **kw)
        scales = [scale] if isinstance(scale, float) else jax.tree.leaves(scale)
        assert len(scales) == len(jax.tree.leaves(want)) == len(jax.tree.leaves(value))
        leaves = zip(jax.tree.leaves(value), jax.tree.leaves(want), scales)
        for k, (a, w, s) in enumerate(leaves):
            err = float(np.max(np.abs(np.asarray(a, np.float64) - w)))
            assert err <= rtol * s, f"{name} leaf {k}: error {err:.3g} = {err / s:.3g} x scale"


# --------------------------------------------------------------------------- #
# Float32 constants in a float64 model
# --------------------------------------------------------------------------- #
def _bn_resnet_case(B=5):
    """A small Flax ResNet (conv, BatchNorm in inference mode, two identical residual
    blocks, dense head) in float64 whose running statistics stay float32, as Flax's
    default ``param_dtype`` makes them."""
    nn = pytest.importorskip("flax.linen")

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x):
            y = nn.Conv(4, (3, 3), use_bias=False)(x)
            y = nn.relu(nn.BatchNorm(use_running_average=True)(y))
            y = nn.Conv(4, (3, 3), use_bias=False)(y)
            return nn.relu(x + nn.BatchNorm(use_running_average=True)(y))

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.Conv(4, (3, 3), use_bias=False)(x)
            x = nn.relu(nn.BatchNorm(use_running_average=True)(x))
            x = Block()(Block()(x))
            return nn.Dense(3)(jnp.mean(x, axis=(1, 2)))

    model = Net()
    r = np.random.default_rng(0)
    x = jnp.asarray(r.standard_normal((B, 6, 6, 2)), jnp.float64)
    y = jnp.asarray(r.integers(0, 3, B))
    variables = model.init(jax.random.key(1), x[:1].astype(jnp.float32))
    # running statistics away from their initial 0 and 1, in float32
    stats = jax.tree.map(
        lambda a: jnp.asarray(a + 0.3 + r.uniform(0, 0.5, a.shape), jnp.float32),
        variables["batch_stats"],
    )
    params = jax.tree.map(lambda a: a.astype(jnp.float64), variables["params"])

    def loss(p, b):
        logits = model.apply({"params": p, "batch_stats": stats}, b["x"])
        logp = jax.nn.log_softmax(logits)
        return -jnp.mean(jnp.take_along_axis(logp, b["y"][:, None], 1))

    return zoo.ZooCase("bn_resnet", loss, params, {"x": x, "y": y})


def test_float32_running_statistics_in_a_float64_resnet():
    """Every statistic, clipping included, to 1e-12 of vmap(grad); ``mean`` equals
    ``jax.jit(jax.grad)``. The running statistics' ``rsqrt(var + eps)`` runs in float32:
    inside the transformation's nested jits XLA folded it to other float32 values than
    in the user's program (one ulp: 1e-7 relative on every leaf)."""
    with zoo.x64():
        case = _bn_resnet_case()
        clip = _median_norm(case)
        got = jax.jit(js.per_example_stat(case.loss_fn, _all_stats(clip)))(case.params, case.batch)
        _check_all(case, got, clip)
        g = jax.jit(jax.grad(case.loss_fn))(case.params, case.batch)
        for a, w in zip(jax.tree.leaves(got["mean"]), jax.tree.leaves(g)):
            np.testing.assert_allclose(a, w, rtol=1e-12, atol=1e-14 * float(np.max(np.abs(w))))


def _constants_case(remat=False, B=4):
    """A float64 MLP of three identical layers (repeated layers are traced once) mixing
    float32 constants through transcendental functions (rsqrt, exp, tanh) into the
    activations, and a float32 literal into a gain."""
    r = np.random.default_rng(1)
    d = 6
    n = lambda *s: jnp.asarray(r.standard_normal(s) * 0.6, jnp.float64)  # noqa: E731
    params = [{"w": n(d, d), "b": n(d), "g": 1.0 + n(d)} for _ in range(3)]
    consts = [jnp.asarray(r.uniform(0.3, 2.0, d), jnp.float32) for _ in range(3)]

    def layer(h, p, c):
        h = h @ p["w"] + p["b"]
        h = (h - jnp.tanh(c)) * jax.lax.rsqrt(c + np.float32(1e-5))
        h = h * (p["g"] * jnp.exp(-c))
        return jnp.tanh(h)

    if remat:
        layer = jax.checkpoint(layer)

    def loss(ps, b):
        h = b["x"]
        for p, c in zip(ps, consts):
            h = layer(h, p, c)
        return jnp.mean(jnp.sum((h - b["y"]) ** 2, -1))

    batch = {"x": n(B, d), "y": n(B, d)}
    return zoo.ZooCase("constants", loss, params, batch)


@pytest.mark.parametrize("remat", [False, True])
def test_float32_constants_in_a_float64_model(remat):
    with zoo.x64():
        case = _constants_case(remat)
        clip = _median_norm(case)
        got = jax.jit(js.per_example_stat(case.loss_fn, _all_stats(clip)))(case.params, case.batch)
        _check_all(case, got, clip)
