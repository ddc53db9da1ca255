"""Embedding ids: narrow integer dtypes into tables with more rows than their range,
canonical ids (``take`` modes), ids packed into floats exactly, and ids above 2**24 into
a tied leaf, each checked against the vmap(grad) oracle."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import zoo

import jaxpr_surgery as js
from jaxpr_surgery._src.sites.embedding import canonical_ids, pack_ids, unpack_ids

_o = zoo.oracle_from_grads  # the oracle (tests/zoo.py), numpy float64


def _per_example_grads(loss, params, batch):
    one = lambda p, ex: loss(p, jax.tree.map(lambda a: a[None], ex))  # noqa: E731
    return jax.jit(jax.vmap(jax.grad(one), in_axes=(None, 0)))(params, batch)


# --------------------------------------------------------------------------- #
# Narrow integer ids into a table with more rows than the dtype's range
# --------------------------------------------------------------------------- #
V_NARROW = 300


def _lookup(kind):
    def loss(table, b):
        ids = b["ids"]
        if kind == "index":
            e = table[ids]
        elif kind == "onehot":
            e = jax.nn.one_hot(ids, V_NARROW, dtype=table.dtype) @ table
        else:
            e = jnp.take(table, ids, axis=0, mode=kind)
        return jnp.mean(jnp.sum(jnp.tanh(e) * b["y"], axis=(-1, -2)))

    return loss


@pytest.mark.parametrize("kind", ["index", "fill", "clip", "onehot"])
@pytest.mark.parametrize("id_dtype", [jnp.uint8, jnp.int8, jnp.int16])
def test_narrow_ids(kind, id_dtype):
    r = np.random.default_rng(0)
    info = np.iinfo(id_dtype)
    B, T, d = 6, 7, 3
    ids = r.integers(max(info.min, -3), info.max + 1, (B, T))
    ids[0, :3] = [info.max, 0, 1]
    table = jnp.asarray(r.standard_normal((V_NARROW, d)), jnp.float32)
    b = {"ids": jnp.asarray(ids, id_dtype), "y": jnp.asarray(r.standard_normal((B, T, d)),
                                                           jnp.float32)}
    loss = _lookup(kind)
    if kind == "index" and info.min < 0:
        pytest.skip("negative ids wrap around in table[ids]; covered by take(mode=...)")
    m, m2, sq = js.per_example_stat(
        loss, (js.stats.mean(), js.stats.second_moment(), js.stats.sq_norms()))(table, b)
    g = _per_example_grads(loss, table, b)
    np.testing.assert_allclose(m, jax.grad(loss)(table, b), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(m, _o(g, "mean"), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(m2, _o(g, "second_moment"), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(sq, _o(g, "sq_norms"), rtol=1e-5, atol=1e-6)


def test_canonical_ids_keep_meaning():
    ids = jnp.asarray([0, 5, 255, 200], jnp.uint8)
    np.testing.assert_array_equal(canonical_ids(ids, 300), [0, 5, 255, 200])
    np.testing.assert_array_equal(canonical_ids(ids, 100), [0, 5, 100, 100])
    ids = jnp.asarray([-128, -1, 0, 127], jnp.int8)
    np.testing.assert_array_equal(canonical_ids(ids, 300), [-1, -1, 0, 127])


# --------------------------------------------------------------------------- #
# Large vocabularies: ids stay integral end to end
# --------------------------------------------------------------------------- #
def test_ids_pack_exactly():
    ids = jnp.asarray([-1, 0, 1, 4095, 4096, 2**24 + 1, 2**24 + 3, 2**31 - 1], jnp.int32)
    for dt in (jnp.float32, jnp.float64) if jax.config.jax_enable_x64 else (jnp.float32,):
        np.testing.assert_array_equal(unpack_ids(pack_ids(ids, dt)), ids)


def test_tied_leaf_large_ids_exact():
    """Ids above 2**24 into a tied (embedding x unembedding) leaf whose statistics go
    through ingredients, on a narrow table seen through a huge-id offset."""
    r = np.random.default_rng(1)
    V, d, B, T = 2**24 + 6, 1, 3, 4
    table = jnp.asarray(r.standard_normal((V, d)) * 0.1, jnp.float32)
    ids = jnp.asarray(r.integers(2**24 - 2, V, (B, T)), jnp.int32)

    def loss(t, b):
        h = t[b["ids"]]  # [B, T, 1]
        z = h[:, :, :, None] * t[2**24 - 2:, 0]  # tied use: last rows as a dense weight
        return jnp.mean(jnp.sum(jnp.tanh(z), axis=(-1, -2, -3)))

    rep = js.explain(loss)(table, {"ids": ids})
    assert not rep.fallback_leaves, str(rep)
    m, sq = js.per_example_stat(loss, (js.stats.mean(), js.stats.sq_norms()))(
        table, {"ids": ids})
    g = _per_example_grads(loss, table, {"ids": ids})
    rows = np.arange(2**24 - 2, V)
    np.testing.assert_allclose(np.asarray(m)[rows], _o(g, "mean")[rows], rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(sq, _o(g, "sq_norms"), rtol=1e-4)
