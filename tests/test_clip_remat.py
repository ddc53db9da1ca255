"""Clipped sums on a loss with ``jax.checkpoint``: the norms come from the first pass,
the sum from a second, reweighted backward pass (plans.clips_by_recompute), so the
activations of every layer are never kept at once. Checked against vmap(grad)."""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import zoo
from _models import all_eqns
from jax.sharding import PartitionSpec as P

import jaxpr_surgery as js
from jaxpr_surgery._src import plans


def _grads(loss, params, batch):
    one = lambda p, ex: loss(p, jax.tree.map(lambda a: a[None], ex))  # noqa: E731
    return jax.jit(jax.vmap(jax.grad(one), (None, 0)))(params, batch)


def _clipped(g, C, mean=True):
    leaves = jax.tree.leaves(g)
    B = leaves[0].shape[0]
    sq = sum(jnp.sum(x.reshape(B, -1) ** 2, 1) for x in leaves)
    c = jnp.minimum(1.0, C / jnp.sqrt(sq))
    s = jax.tree.map(lambda x: jnp.tensordot(c.astype(x.dtype), x, 1), g)
    return jax.tree.map(lambda x: x / B, s) if mean else s, sq


def _remat_mlp(params, batch):
    @jax.checkpoint
    def layer(h, w):
        return jnp.tanh(h @ w["w"] + w["b"])

    h = layer(batch["x"], params["l1"])
    h = layer(h, params["l2"])
    return jnp.mean(jnp.sum((h - batch["y"]) ** 2, -1))


def _remat_mlp_case(dtype=jnp.float32, B=8):
    r = np.random.default_rng(0)
    n = lambda *s: jnp.asarray(r.standard_normal(s) * 0.7, dtype)  # noqa: E731
    params = {"l1": {"w": n(5, 6), "b": n(6)}, "l2": {"w": n(6, 3), "b": n(3)}}
    batch = {"x": n(B, 5), "y": n(B, 3)}
    return _remat_mlp, params, batch


def test_recompute_is_chosen_only_with_remat():
    case = zoo.make_transformer_scan_remat()
    jp = jax.make_jaxpr(case.loss_fn)(case.params, case.batch).jaxpr
    assert plans.clips_by_recompute(jp)
    plain = zoo.make_transformer()
    jp = jax.make_jaxpr(plain.loss_fn)(plain.params, plain.batch).jaxpr
    assert not plans.clips_by_recompute(jp)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64])
@pytest.mark.parametrize("chunk", [None, 3])
def test_remat_clipping_matches_oracle(dtype, chunk):
    def run():
        case = zoo.make_transformer_scan_remat(dtype)
        loss, p, b = case.loss_fn, case.params, case.batch
        g = _grads(loss, p, b)
        sq = sum(jnp.sum(x.reshape(x.shape[0], -1) ** 2, 1) for x in jax.tree.leaves(g))
        C = float(np.median(np.sqrt(np.asarray(sq))))  # about half the examples clipped
        want_mean, want_sq = _clipped(g, C)
        want_sum, _ = _clipped(g, 0.5 * C, mean=False)
        stats = (js.stats.clipped_mean(C), js.stats.clipped_sum(0.5 * C), js.stats.sq_norms(),
                 js.stats.second_moment())
        got = jax.jit(js.per_example_stat(loss, stats, chunk_size=chunk))(p, b)
        tol = dict(rtol=2e-4, atol=1e-6) if dtype == jnp.float32 else dict(rtol=1e-10, atol=1e-13)
        for a, w in zip(jax.tree.leaves(got[0]), jax.tree.leaves(want_mean)):
            np.testing.assert_allclose(a, w, **tol)
        for a, w in zip(jax.tree.leaves(got[1]), jax.tree.leaves(want_sum)):
            np.testing.assert_allclose(a, w, **tol)
        np.testing.assert_allclose(got[2], want_sq, **tol)
        want_sm = jax.tree.map(lambda x: (x**2).mean(0), g)
        for a, w in zip(jax.tree.leaves(got[3]), jax.tree.leaves(want_sm)):
            np.testing.assert_allclose(a, w, **tol)

    with zoo.x64() if dtype == jnp.float64 else contextlib.nullcontext():
        run()


def test_remat_clipping_is_differentiable():
    """grad through the clipped mean (a meta-learning use) equals grad through the oracle."""
    with jax.enable_x64(True):
        loss, p, b = _remat_mlp_case(jnp.float64)
        C = 0.8
        v = jax.tree.map(lambda x: jnp.cos(jnp.arange(x.size, dtype=x.dtype)).reshape(x.shape), p)

        def ours(p):
            out = js.per_example_stat(loss, js.stats.clipped_mean(C))(p, b)
            return sum(jnp.vdot(a, w) for a, w in zip(jax.tree.leaves(out), jax.tree.leaves(v)))

        def oracle(p):
            out, _ = _clipped(_grads(loss, p, b), C)
            return sum(jnp.vdot(a, w) for a, w in zip(jax.tree.leaves(out), jax.tree.leaves(v)))

        np.testing.assert_allclose(ours(p), oracle(p), rtol=1e-10)
        for a, w in zip(jax.tree.leaves(jax.grad(ours)(p)), jax.tree.leaves(jax.grad(oracle)(p))):
            np.testing.assert_allclose(a, w, rtol=1e-8, atol=1e-12)


@pytest.mark.skipif(jax.device_count() < 4, reason="needs 4 host devices (tests/conftest.py)")
@pytest.mark.parametrize("check_vma", [True, False])
@pytest.mark.parametrize("axis_name", ["d", None])
def test_remat_clipping_inside_shard_map(check_vma, axis_name):
    """Typed (check_vma) meshes keep the one-pass form; untyped ones recompute. Both give
    each device its own examples' sum without axis_name, the whole batch's with it."""
    loss, p, b = _remat_mlp_case(B=8)
    C = 0.8
    fn = js.per_example_stat(loss, (js.stats.clipped_mean(C), js.stats.sq_norms()),
                             axis_name=axis_name)
    if axis_name is None:  # per-device statistics of the local examples, stacked
        local = fn
        fn = lambda p, b: jax.tree.map(lambda x: x[None], local(p, b))  # noqa: E731
    mesh = jax.make_mesh((4,), ("d",))
    out_specs = (P(), P("d")) if axis_name else (P("d"), P("d"))
    sm = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(P(), P("d")), out_specs=out_specs,
                               check_vma=check_vma))
    rep = jax.sharding.NamedSharding(mesh, P())
    split = jax.sharding.NamedSharding(mesh, P("d"))
    got = sm(jax.device_put(p, rep), jax.device_put(b, split))
    g = _grads(loss, p, b)
    if axis_name:
        want, sq = _clipped(g, C)
    else:  # device k holds examples 2k, 2k+1
        parts = [_clipped(jax.tree.map(lambda x, k=k: x[2 * k : 2 * k + 2], g), C)
                 for k in range(4)]
        want = jax.tree.map(lambda *xs: jnp.stack(xs), *[m for m, _ in parts])
        sq = jnp.concatenate([s for _, s in parts])
    for a, w in zip(jax.tree.leaves(got[0]), jax.tree.leaves(want)):
        assert np.any(np.asarray(w) != 0)
        # (both float32: an entry that cancels is off by a few float32 ulps of the leaf's
        # largest, 4e-7 at 0.3 here, as the float32 oracle itself is at jax 0.12)
        np.testing.assert_allclose(a, w, rtol=1e-5, atol=2e-5 * np.abs(w).max())
    np.testing.assert_allclose(np.ravel(got[1]), sq, rtol=1e-5)


def test_explain_says_how_clipping_runs():
    loss, p, b = _remat_mlp_case()
    rep = js.explain(loss, js.stats.clipped_mean(1.0))(p, b)
    hows = [leaf.detail for leaf in rep.leaves]
    assert all("reweighted backward pass" in h for h in hows), hows
    plain = lambda p, b: jnp.mean(jnp.sum(  # noqa: E731
        (jnp.tanh(jnp.tanh(b["x"] @ p["l1"]["w"] + p["l1"]["b"]) @ p["l2"]["w"] + p["l2"]["b"])
         - b["y"]) ** 2, -1))
    rep = js.explain(plain, js.stats.clipped_mean(1.0))(p, b)
    assert all("weighted sum" in leaf.detail and "reweighted" not in leaf.detail
               for leaf in rep.leaves)


def _primitives(jaxpr):
    """The names of the primitives of ``jaxpr`` and of every jaxpr inside it."""
    return {eqn.primitive.name for eqn in all_eqns(jaxpr)}

def test_remat_clipping_is_one_masked_second_pass():
    """Clipped sums that drop the examples whose gradient is not finite (the default)
    take one second pass with the sites' example mask: no conditional third pass (a
    whole forward and backward pass more to trace and compile). A propagating sum beside
    a dropping one keeps its own unmasked pass (test_empty_batches checks the values)."""
    loss, p, b = _remat_mlp_case()
    jp = jax.make_jaxpr(js.per_example_stat(loss, js.stats.clipped_mean(1.0)))(p, b).jaxpr
    assert "cond" not in _primitives(jp)
    both = (js.stats.clipped_sum(1.0), js.stats.clipped_sum(1.0, nonfinite="propagate"))
    jp = jax.make_jaxpr(js.per_example_stat(loss, both))(p, b).jaxpr
    assert "cond" in _primitives(jp)
