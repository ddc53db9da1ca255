"""Statistics that reduce per-example values over the batch (norm quantiles, gradient
diversity, a user's ``whole_batch`` statistic) see the whole batch under ``axis_name``.

The batch is split over 2 (fake CPU) devices with very different gradients on each, so
a device's own quantiles or diversity are far from the whole batch's. Per-example
outputs (norms, cosines) stay with the device holding the example.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import zoo
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxpr_surgery as js

NDEV = 2
B = 10  # 5 examples per device

pytestmark = pytest.mark.skipif(
    jax.device_count() < NDEV,
    reason=f"needs {NDEV} devices: run with XLA_FLAGS=--xla_force_host_platform_device_count="
    f"{NDEV} set before jax initialises (tests/conftest.py does this)",
)

Q = (0.0, 0.3, 0.5, 0.9, 1.0)


def _loss(p, b):
    h = jnp.tanh(b["x"] @ p["w"] + p["b"])
    return jnp.mean((h @ p["v"] - b["y"]) ** 2)


def _case():
    r = np.random.default_rng(11)
    p = {"w": r.normal(size=(3, 4)) / 2, "b": r.normal(size=4) / 4, "v": r.normal(size=4)}
    x = r.normal(size=(B, 3))
    y = r.normal(size=B)
    # the second device's examples: larger inputs and targets, so larger gradients
    x[B // 2:] *= 4.0
    y[B // 2:] *= 30.0
    f32 = lambda t: jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), t)  # noqa: E731
    return f32(p), f32({"x": x, "y": y})


class _Gathered(js.stats.Statistic):
    """A user's statistic returning the per-example squared norms it is given."""

    def __init__(self, whole_batch):
        self.whole_batch = whole_batch

    def reductions(self):
        return {"n": js.stats.SqNorms()}

    def finalize(self, values, count):
        return sum(jax.tree.leaves(values["n"]))


class _DuckMeanNorm:
    """Not a Statistic subclass: the mean per-example norm, declaring whole_batch."""

    whole_batch = True

    def reductions(self):
        return {"n": js.stats.SqNorms()}

    def finalize(self, values, count):
        return jnp.sum(jnp.sqrt(sum(jax.tree.leaves(values["n"])))) / count


def _stats(params):
    ref = jax.tree.map(jnp.ones_like, params)
    return {
        "q_leaf": js.stats.norm_quantiles(Q),
        "q_glob": js.stats.norm_quantiles(Q, per_leaf=False),
        "q_scalar": js.stats.norm_quantiles(0.5),
        "diversity": js.stats.gradient_diversity(),
        "gathered": _Gathered(True),
        "duck": _DuckMeanNorm(),
        # per example: stay with the device holding the example
        "norms": js.stats.norms(),
        "norms_leaf": js.stats.norms(per_leaf=True),
        "local": _Gathered(False),
        "cos": js.stats.per_example_cosines(ref),
        "variance": js.stats.variance(),
    }


PER_EXAMPLE = ("norms", "norms_leaf", "local", "cos")


@pytest.fixture(scope="module")
def reference():
    p, b = _case()
    one = jax.jit(js.per_example_stat(_loss, _stats(p)))(p, b)
    one = jax.tree.map(np.asarray, one)
    # the one-device values against vmap(grad)
    g = zoo.vmap_grads(_loss, p, b)
    sq = {k: np.sum(np.asarray(v, np.float64).reshape(B, -1) ** 2, 1) for k, v in g.items()}
    tot = sum(sq.values())
    np.testing.assert_allclose(one["q_glob"], np.quantile(np.sqrt(tot), Q), rtol=1e-5)
    np.testing.assert_allclose(one["q_scalar"]["w"], np.quantile(np.sqrt(sq["w"]), 0.5),
                               rtol=1e-5)
    div = tot.sum() / sum(np.sum(np.asarray(v, np.float64).sum(0) ** 2) for v in g.values())
    np.testing.assert_allclose(one["diversity"], div, rtol=1e-4)
    np.testing.assert_allclose(one["gathered"], tot, rtol=1e-5)
    # the devices' own quantiles are far from the whole batch's (the test can fail)
    half = np.sqrt(tot[: B // 2])
    assert np.max(np.abs(np.quantile(half, Q) - one["q_glob"])) > 0.1 * one["q_glob"].max()
    return p, b, one


def _check(out, one, on_device):
    """``on_device(x)``: the value every device holds (checking they agree)."""
    for k, want in one.items():
        got = out[k]
        if k in PER_EXAMPLE:
            # [NDEV, B/NDEV] per device (pmap) or [B] (shard_map out_specs P("d"))
            got = jax.tree.map(lambda a: np.asarray(a).reshape((B,) + np.shape(a)[2:])
                               if np.ndim(a) >= 2 and np.shape(a)[0] == NDEV
                               and np.shape(a)[1] == B // NDEV else np.asarray(a), got)
        else:
            got = jax.tree.map(on_device, got)
        for a, e in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            assert np.shape(a) == np.shape(e), (k, np.shape(a), np.shape(e))
            np.testing.assert_allclose(a, e, rtol=2e-5, atol=1e-6, err_msg=k)


def _same_on_every_device(a):
    a = np.asarray(a)
    for d in range(1, NDEV):
        np.testing.assert_array_equal(a[d], a[0])
    return a[0]


@pytest.mark.parametrize("chunk", [None, 2])
def test_pmap_reductions_over_examples_see_the_whole_batch(reference, chunk):
    p, b, one = reference
    fn = js.per_example_stat(_loss, _stats(p), axis_name="d", chunk_size=chunk)
    split = jax.tree.map(lambda x: x.reshape((NDEV, -1) + x.shape[1:]), b)
    out = jax.pmap(fn, axis_name="d", in_axes=(None, 0), devices=jax.devices()[:NDEV])(p, split)
    _check(out, one, _same_on_every_device)


@pytest.mark.parametrize("chunk", [None, 2])
def test_shard_map_reductions_over_examples_see_the_whole_batch(reference, chunk):
    """check_vma=True: the gathered statistics are replicated (out_specs P())."""
    p, b, one = reference
    mesh = jax.make_mesh((NDEV,), ("d",), devices=jax.devices()[:NDEV])
    stats = _stats(p)
    fn = js.per_example_stat(_loss, stats, axis_name="d", chunk_size=chunk)
    specs = {k: P("d") if k in PER_EXAMPLE else P() for k in stats}
    sm = jax.shard_map(fn, mesh=mesh, in_specs=(P(), P("d")), out_specs=specs, check_vma=True)
    out = jax.jit(sm)(jax.device_put(p, NamedSharding(mesh, P())),
                      jax.device_put(b, NamedSharding(mesh, P("d"))))
    _check(out, one, np.asarray)


def test_shard_map_over_two_mesh_axes():
    """axis_name a tuple of mesh axes: the batch split over both, gathered in their order."""
    if jax.device_count() < 4:
        pytest.skip("needs 4 devices")
    p, b = _case()
    b = jax.tree.map(lambda a: jnp.concatenate([a, a[::-1] * 0.5]), b)  # 20 examples, 5 each
    stats = {"q": js.stats.norm_quantiles(Q, per_leaf=False), "gathered": _Gathered(True),
             "diversity": js.stats.gradient_diversity()}
    one = jax.jit(js.per_example_stat(_loss, stats))(p, b)
    mesh = jax.make_mesh((2, 2), ("a", "b"), devices=jax.devices()[:4])
    fn = js.per_example_stat(_loss, stats, axis_name=("a", "b"))
    sm = jax.shard_map(fn, mesh=mesh, in_specs=(P(), P(("a", "b"))),
                       out_specs={k: P() for k in stats})
    out = jax.jit(sm)(p, jax.device_put(b, NamedSharding(mesh, P(("a", "b")))))
    for k in stats:
        np.testing.assert_allclose(out[k], one[k], rtol=2e-5, atol=1e-6, err_msg=k)



def test_vmap_with_an_axis_name(reference):
    """vmap(..., axis_name=) splits the batch the same way (collectives, one device)."""
    p, b, one = reference
    stats = {k: v for k, v in _stats(p).items() if k in ("q_glob", "diversity", "norms")}
    fn = js.per_example_stat(_loss, stats, axis_name="d")
    split = jax.tree.map(lambda x: x.reshape((NDEV, -1) + x.shape[1:]), b)
    out = jax.vmap(fn, in_axes=(None, 0), axis_name="d")(p, split)
    _check(out, {k: one[k] for k in stats}, _same_on_every_device)
