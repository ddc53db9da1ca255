"""The `Reduction` protocol: a reduction a user defines in one class, with a merge that
is not a sum, is exact through tiles of examples, feature blocks, chunks of the
batch, layers inside ``lax.scan``, a tied (shared) leaf and devices.

Two toy reductions registered from this test (nothing in the package knows them):
the elementwise running max of ``|g_b|`` (merge: ``maximum``), and each example's
largest ``|g_b|`` entry of a leaf (a per-example ``[B]`` value). A tile loop or chunk
merge that added values instead of merging them would double the maxima.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxpr_surgery as js

B, T, V, D, L = 8, 5, 11, 6, 2
NDEV = 4


@dataclasses.dataclass(frozen=True)
class MaxAbs(js.stats.Reduction):
    """``max_b |g_b|`` elementwise."""

    feature_blocks: ClassVar[str] = "place"  # elementwise: blocks go to their place

    def aval(self, shape, dtype, B):
        return jax.ShapeDtypeStruct(tuple(shape), dtype)

    def from_examples(self, G):
        return jnp.max(jnp.abs(G), axis=0)

    def merge(self, a, na, b, nb):
        return jnp.maximum(a, b)


@dataclasses.dataclass(frozen=True)
class ExampleMaxAbs(js.stats.Reduction):
    """``max |g_b|`` over a leaf's entries, per example: ``[B]``."""

    per_example: ClassVar[bool] = True
    carries: ClassVar[bool] = False

    def aval(self, shape, dtype, B):
        return jax.ShapeDtypeStruct((B,), dtype)

    def from_examples(self, G):
        return jnp.max(jnp.abs(G).reshape(G.shape[0], -1), axis=1)

    def merge(self, a, na, b, nb):
        return jnp.concatenate([a, b])

    def to_leaf(self, value, site, B):  # the layers of a scan: one leaf
        return value.reshape((-1, B)).max(0) if site.depth else value

    def combine_shards(self, value, axes):
        return jax.lax.pmax(value, axes)


class MaxStats(js.stats.Statistic):
    def reductions(self):
        return {"m": MaxAbs(), "e": ExampleMaxAbs()}

    def finalize(self, values, count):
        return {"max_abs": values["m"], "example_max": values["e"]}


def _loss(p, batch):
    """A tied embedding (gather and output projection share ``E``), token-axis dense
    layers in a ``lax.scan`` over stacked weights, a bias used elementwise."""
    h = p["E"][batch["ids"]]  # [b, T, D]

    def layer(h, w):
        return jnp.tanh(h @ w + p["b"]), None

    h, _ = jax.lax.scan(layer, h, p["W"])
    logits = h @ p["E"].T  # [b, T, V]
    nll = -jnp.take_along_axis(jax.nn.log_softmax(logits), batch["y"][..., None], -1)
    return jnp.mean(nll)


def _case(dtype):
    r = np.random.default_rng(0)
    p = {
        "E": jnp.asarray(r.normal(size=(V, D)), dtype),
        "W": jnp.asarray(r.normal(size=(L, D, D)) / np.sqrt(D), dtype),
        "b": jnp.asarray(r.normal(size=(D,)) * 0.1, dtype),
    }
    batch = {"ids": jnp.asarray(r.integers(0, V, (B, T)), jnp.int32),
             "y": jnp.asarray(r.integers(0, V, (B, T)), jnp.int32)}
    return p, batch


def _oracle(p, batch):
    one = lambda p, ex: _loss(p, jax.tree.map(lambda a: a[None], ex))  # noqa: E731
    g = jax.jit(jax.vmap(jax.grad(one), (None, 0)))(p, batch)
    g = {k: np.abs(np.asarray(v, np.float64)) for k, v in g.items()}
    return {"max_abs": {k: v.max(0) for k, v in g.items()},
            "example_max": {k: v.reshape(B, -1).max(1) for k, v in g.items()}}


def _assert_close(out, want, rtol):
    for name in want:
        for k in want[name]:
            np.testing.assert_allclose(np.asarray(out[name][k], np.float64), want[name][k],
                                       rtol=rtol, atol=0, err_msg=f"{name}[{k}]")


OPTIONS = {
    "default": {},
    "tiles_of_one_and_feature_blocks": {"memory_budget_bytes": 64},
    "chunks_with_remainder": {"chunk_size": 3},
    "chunks_and_tiny_tiles": {"chunk_size": 3, "memory_budget_bytes": 64},
}


@pytest.mark.parametrize("options", list(OPTIONS))
def test_non_additive_reduction_exact_float64(options):
    with jax.enable_x64(True):
        p, batch = _case(jnp.float64)
        out = jax.jit(js.per_example_stat(_loss, MaxStats(), **OPTIONS[options]))(p, batch)
        _assert_close(out, _oracle(p, batch), rtol=1e-12)


def test_non_additive_reduction_float32():
    p, batch = _case(jnp.float32)
    out = jax.jit(js.per_example_stat(_loss, MaxStats(), chunk_size=3))(p, batch)
    _assert_close(out, _oracle(p, batch), rtol=2e-5)


def test_maxima_are_not_sums():
    """The test can fail: the sum of |g_b| is far from their max on this model."""
    p, batch = _case(jnp.float32)
    want = _oracle(p, batch)["max_abs"]["W"]
    total = js.per_example_stat(_loss, js.stats.abs_mean())(p, batch)["W"] * B
    assert np.max(np.asarray(total) / np.maximum(want, 1e-30)) > 2


@pytest.mark.skipif(len(jax.devices()) < NDEV, reason=f"needs {NDEV} devices")
@pytest.mark.parametrize("chunk", [None, 1])
def test_non_additive_reduction_across_devices(chunk):
    """Every device's maxima merge in the devices' order (`Reduction.combine_axis`'s
    default: gathered, then folded with `merge`); per-example values stay with the
    device holding the example."""
    p, batch = _case(jnp.float32)
    want = _oracle(p, batch)
    fn = js.per_example_stat(_loss, MaxStats(), axis_name="d", chunk_size=chunk)
    mesh = jax.make_mesh((NDEV,), ("d",), devices=jax.devices()[:NDEV])
    specs = {"max_abs": P(), "example_max": P("d")}
    sm = jax.shard_map(fn, mesh=mesh, in_specs=(P(), P("d")), out_specs=specs, check_vma=True)
    out = jax.jit(sm)(jax.device_put(p, NamedSharding(mesh, P())),
                      jax.device_put(batch, NamedSharding(mesh, P("d"))))
    _assert_close(out, want, rtol=2e-5)
    split = jax.tree.map(lambda x: x.reshape((NDEV, -1) + x.shape[1:]), batch)
    out = jax.pmap(fn, axis_name="d", in_axes=(None, 0), devices=jax.devices()[:NDEV])(p, split)
    for k in want["max_abs"]:
        got = np.asarray(out["max_abs"][k])
        for d in range(NDEV):  # the same on every device
            np.testing.assert_allclose(got[d], want["max_abs"][k], rtol=2e-5, err_msg=k)
        np.testing.assert_allclose(np.asarray(out["example_max"][k]).reshape(B),
                                   want["example_max"][k], rtol=2e-5, err_msg=k)


@pytest.mark.skipif(len(jax.devices()) < NDEV, reason=f"needs {NDEV} devices")
def test_shard_map_parameter_cast_to_varying_inside_scan():
    """Regression: inside ``shard_map`` a replicated parameter used in a ``lax.scan``
    body is cast to varying (``pvary``) there; the interpreter's per-example copy of it
    varies already, and binding the cast raised. Built-in statistics, against
    vmap(grad)."""
    p, batch = _case(jnp.float32)
    one = lambda p, ex: _loss(p, jax.tree.map(lambda a: a[None], ex))  # noqa: E731
    g = jax.jit(jax.vmap(jax.grad(one), (None, 0)))(p, batch)
    stats = {"mean": js.stats.mean(), "sq": js.stats.sq_norms(per_leaf=True)}
    fn = js.per_example_stat(_loss, stats, axis_name="d")
    mesh = jax.make_mesh((NDEV,), ("d",), devices=jax.devices()[:NDEV])
    sm = jax.shard_map(fn, mesh=mesh, in_specs=(P(), P("d")),
                       out_specs={"mean": P(), "sq": P("d")}, check_vma=True)
    out = jax.jit(sm)(jax.device_put(p, NamedSharding(mesh, P())),
                      jax.device_put(batch, NamedSharding(mesh, P("d"))))
    for k, v in g.items():
        v = np.asarray(v, np.float64)
        np.testing.assert_allclose(out["mean"][k], v.mean(0), rtol=2e-5, atol=1e-7, err_msg=k)
        np.testing.assert_allclose(out["sq"][k], np.sum(v.reshape(B, -1) ** 2, 1), rtol=2e-5,
                                   err_msg=k)


def test_feature_blocks_is_typed_and_a_misspelt_one_named():
    """`Reduction.feature_blocks` is read as a `FeatureBlocks` (the strings of the
    documented protocol, ``"place"`` / ``"add"``, still work); any other value is refused
    naming the class and the choices, not read as one of them."""
    from jaxpr_surgery._src import stats as S

    @dataclasses.dataclass(frozen=True)
    class Misspelt(MaxAbs):
        feature_blocks: ClassVar[str] = "Place"

    assert S.feature_blocks_of(MaxAbs()) is S.FeatureBlocks.PLACE
    assert S.feature_blocks_of(S.SqNorms()) is S.FeatureBlocks.ADD
    assert S.feature_blocks_of(ExampleMaxAbs()) is None
    with pytest.raises(ValueError, match=r"Misspelt.feature_blocks is 'Place': give 'place'"):
        S.feature_blocks_of(Misspelt())
