"""per_example_dots / per_example_cosines against vmap(grad) on site kinds, under jit with
a traced reference, and their errors (the zoo: the oracle matrix, test_oracle.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import zoo
from jax.sharding import PartitionSpec as P

import jaxpr_surgery as js

pytestmark = pytest.mark.slow

def _reference(params, seed=0):
    """A random pytree shaped like the array leaves of ``params`` (None elsewhere)."""
    r = np.random.default_rng(seed)

    def one(x):
        if not hasattr(x, "shape") or not jnp.issubdtype(jnp.asarray(x).dtype, jnp.inexact):
            return None
        return jnp.asarray(r.normal(size=jnp.shape(x)), jnp.asarray(x).dtype)

    return jax.tree.map(one, params)


def _oracle(grads, ref):
    """The zoo's oracle: per-example dots per leaf, their sum and the global cosines."""
    o = zoo.oracle_from_grads
    return (jax.tree.leaves(o(grads, "per_example_dots", reference=ref, per_leaf=True)),
            o(grads, "per_example_dots", reference=ref),
            o(grads, "per_example_cosines", reference=ref))


# Every zoo case (core and frameworks, bf16 internals too) in float64 and float32: the
# oracle matrix ("per_example_dots*", "per_example_cosines" in conftest.STATS).


def _tied(p, b):
    x = p["emb"][b["tok"]]
    o = jnp.einsum("bthk,hkd->btd", jnp.tanh(jnp.einsum("btd,dhk->bthk", x, p["wq"])), p["wo"])
    z = o @ p["emb"].T
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(z), b["tgt"][..., None], -1))


def _tied_case(B=7):
    r = np.random.default_rng(1)
    p = {"emb": jnp.asarray(r.normal(size=(13, 8))), "wq": jnp.asarray(r.normal(size=(8, 2, 3))),
         "wo": jnp.asarray(r.normal(size=(2, 3, 8)))}
    b = {"tok": jnp.asarray(r.integers(0, 13, (B, 6))),
         "tgt": jnp.asarray(r.integers(0, 13, (B, 6)))}
    return p, b


def _check(loss, p, b, **kw):
    ref = _reference(p, 3)
    got = js.per_example_stat(loss, js.stats.per_example_dots(ref), **kw)(p, b)
    g = zoo.vmap_grads(loss, p, b)
    np.testing.assert_allclose(got, _oracle(g, ref)[1], rtol=1e-10)


def test_tied_chunks_budgets_scan_and_reshape():
    with zoo.x64():
        p, b = _tied_case()
        for kw in ({}, {"chunk_size": 3}, {"memory_budget_bytes": 1}):
            _check(_tied, p, b, **kw)
        r = np.random.default_rng(2)

        def scan_loss(p, b):
            h, _ = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), b["x"], p["ws"])
            return jnp.mean(h**2)

        _check(scan_loss, {"ws": jnp.asarray(r.normal(size=(3, 4, 4)))},
               {"x": jnp.asarray(r.normal(size=(5, 6, 4)))})

        def reshaped(p, b):
            return jnp.mean(jnp.sin(jnp.einsum("bnc,chk->bnhk", b["x"], p["w"].reshape(4, 2, 3))))

        _check(reshaped, {"w": jnp.asarray(r.normal(size=(4, 6)))},
               {"x": jnp.asarray(r.normal(size=(5, 3, 4)))})


def test_alignment_with_the_batch_gradient_is_positive_on_average():
    """Cosines with the batch's own mean gradient average to a positive number."""
    p, b = _tied_case(B=16)
    p = jax.tree.map(lambda x: x.astype(jnp.float32), p)
    g = jax.grad(_tied)(p, b)
    cos = js.per_example_stat(_tied, js.stats.per_example_cosines(g))(p, b)
    assert cos.shape == (16,) and float(jnp.mean(cos)) > 0 and bool(jnp.all(jnp.abs(cos) <= 1))


def test_under_jit_with_a_traced_reference_and_other_stats():
    p, b = _tied_case()
    p = jax.tree.map(lambda x: x.astype(jnp.float32), p)

    @jax.jit
    def f(p, b, ref):
        return js.per_example_stat(
            _tied, (js.stats.mean(), js.stats.per_example_cosines(ref), js.stats.sq_norms()))(p, b)

    ref = _reference(p, 4)
    mean, cos, sq = f(p, b, ref)
    np.testing.assert_allclose(cos, js.per_example_stat(_tied, js.stats.per_example_cosines(ref))(
        p, b), rtol=1e-5, atol=1e-6)
    assert sq.shape == cos.shape == (7,)


@pytest.mark.skipif(jax.device_count() < 4, reason="needs 4 (fake) devices: tests/conftest.py")
def test_shard_map_keeps_each_device_examples():
    p, b = _tied_case(B=8)
    p = jax.tree.map(lambda x: x.astype(jnp.float32), p)
    ref = _reference(p, 5)
    fn = js.per_example_stat(_tied, js.stats.per_example_dots(ref), axis_name="d")
    mesh = jax.make_mesh((4,), ("d",))
    sm = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(P(), P("d")), out_specs=P("d")))
    ns = lambda s: jax.sharding.NamedSharding(mesh, s)  # noqa: E731
    got = sm(jax.device_put(p, ns(P())), jax.device_put(b, ns(P("d"))))
    want = js.per_example_stat(_tied, js.stats.per_example_dots(ref))(p, b)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_bad_references_raise_clearly():
    p, b = _tied_case()
    with pytest.raises(ValueError, match="no arrays"):
        js.stats.per_example_dots({})
    with pytest.raises(TypeError, match="float arrays"):
        js.stats.per_example_dots({"emb": np.arange(3)})
    wrong = dict(p, emb=jnp.zeros((3, 3)))
    with pytest.raises(ValueError, match="shape"):
        js.per_example_stat(_tied, js.stats.per_example_dots(wrong))(p, b)
    with pytest.raises(ValueError, match="structure"):
        js.per_example_stat(_tied, js.stats.per_example_dots({"emb": p["emb"]}))(p, b)


def test_explain_names_the_rule():
    p, b = _tied_case()
    rep = js.explain(_tied, js.stats.per_example_dots(_reference(p)))(p, b)
    assert {leaf.rules["per_example_dots"] for leaf in rep.leaves} == {"streamed"}
