"""jax.grad through per_example_stat (second order) against the vmap(grad) oracle.

Runs in float64 inside ``jax.enable_x64(True)`` blocks only, so the x64 mode
does not leak into other test files.
"""

from __future__ import annotations

import _models as M
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxpr_surgery as js

pytestmark = pytest.mark.slow


def _weights(params, seed=7):
    """Fixed random weights like params (so sums do not hide sign errors)."""
    leaves, tree = jax.tree.flatten(params)
    r = np.random.default_rng(seed)
    return jax.tree.unflatten(
        tree, [jnp.asarray(r.standard_normal(x.shape), x.dtype) for x in leaves]
    )


def _scalar(name, value, w):
    """A scalar function of a statistic's value."""
    if name in ("sq_norms", "norms"):
        return jnp.sum(value * jnp.arange(1, value.shape[0] + 1, dtype=value.dtype))
    if name == "gradient_noise_scale":
        return value
    pairs = zip(jax.tree.leaves(value), jax.tree.leaves(w), strict=True)
    return sum(jnp.sum(v * u) for v, u in pairs)


def _ours(loss, name, w):
    fn = js.per_example_stat(loss, M.STATS[name]())
    return lambda p, b: _scalar(name, fn(p, b), w)


def _reference(loss, name, w):
    def f(p, b):
        g = M.per_example_grads(loss, p, b)
        return _scalar(name, M.stats_of_grads(g, [name], xp=jnp)[name], w)

    return f


# one per reduction kind and finalize shape (abs_mean ~ second_moment, sq_norms ~
# norms, clipped_sum ~ clipped_mean differ only in finalize)
GRAD_STATS = ["mean", "second_moment", "variance", "norms", "clipped_mean",
              "gradient_noise_scale"]


def _jacobians(loss, params, batch, names):
    """d s_k / d params for the scalar s_k of every statistic k, ours and the oracle's.

    One ``jax.jacrev`` of the vector ``[s_1, ..., s_K]`` (one compilation each);
    row k of the Jacobian is the gradient of statistic k's scalar.
    """
    w = _weights(params)
    stat = {k: M.STATS[k]() for k in names}
    fn = js.per_example_stat(loss, stat)

    def ours(p, b):
        v = fn(p, b)
        return jnp.stack([_scalar(k, v[k], w) for k in names])

    def ref(p, b):
        v = M.stats_of_grads(M.per_example_grads(loss, p, b), names, xp=jnp)
        return jnp.stack([_scalar(k, v[k], w) for k in names])

    val, jac = jax.jit(lambda p, b: (ours(p, b), jax.jacrev(ours)(p, b)))(params, batch)
    val_ref, jac_ref = jax.jit(lambda p, b: (ref(p, b), jax.jacrev(ref)(p, b)))(params, batch)
    return val, jac, val_ref, jac_ref


def _check_rows(names, val, jac, val_ref, jac_ref, rtol, atol, model):
    failures = []
    for i, k in enumerate(names):
        try:
            np.testing.assert_allclose(val[i], val_ref[i], rtol=rtol, atol=atol)
            M.assert_tree_close(M.take(jac, i),
                                M.take(jac_ref, i),
                                rtol=rtol, atol=atol, err_msg=f"{model}: d {k} / d params")
            assert any(np.any(np.asarray(x[i]) != 0) for x in jax.tree.leaves(jac)), k
        except AssertionError as e:  # collect: report every failing statistic at once
            failures.append(f"{k}: {e}")
    assert not failures, "\n".join(failures)


def test_grad_of_statistics_mlp_float64():
    with M.x64():
        loss, params, batch = M.make_mlp(jnp.float64)
        out = _jacobians(loss, params, batch, GRAD_STATS)
        assert jax.tree.leaves(out[1])[0].dtype == jnp.float64
        _check_rows(GRAD_STATS, *out, rtol=1e-8, atol=1e-10, model="mlp")


def test_grad_through_jax_grad_mlp_float64():
    """Plain ``jax.grad`` of one scalar (the path users take)."""
    with M.x64():
        loss, params, batch = M.make_mlp(jnp.float64)
        w = _weights(params)
        for name in ("clipped_mean",):
            g = jax.jit(jax.grad(_ours(loss, name, w)))(params, batch)
            g_ref = jax.jit(jax.grad(_reference(loss, name, w)))(params, batch)
            M.assert_tree_close(g, g_ref, rtol=1e-8, atol=1e-10, err_msg=f"d {name} / d params")


def test_grad_of_statistics_tied_embedding_float64():
    """Multi-site (tied) embedding + scale-shift + dense."""
    with M.x64():
        loss, params, batch = M.make_tied(jnp.float64)
        names = ["second_moment", "variance", "sq_norms", "clipped_mean"]
        out = _jacobians(loss, params, batch, names)
        _check_rows(names, *out, rtol=1e-7, atol=1e-9, model="tied")


def test_grad_wrt_data_argument():
    """Differentiating a statistic w.r.t. the batch (e.g. for influence / data attribution)."""
    with M.x64():
        loss, params, batch = M.make_mlp(jnp.float64)
        fn = js.per_example_stat(loss, js.stats.sq_norms())

        def ours(x):
            return jnp.sum(fn(params, {"x": x, "y": batch["y"]}))

        def ref(x):
            g = M.per_example_grads(loss, params, {"x": x, "y": batch["y"]})
            return jnp.sum(M.stats_of_grads(g, ["sq_norms"], xp=jnp)["sq_norms"])

        np.testing.assert_allclose(
            jax.jit(jax.grad(ours))(batch["x"]), jax.jit(jax.grad(ref))(batch["x"]),
            rtol=1e-8, atol=1e-10,
        )


def test_x64_does_not_leak():
    assert jnp.zeros(()).dtype == jnp.float32 or jax.config.jax_enable_x64
    with M.x64():
        assert jnp.zeros(()).dtype == jnp.float64


def _zero_rows_model(form):
    """A token model some of whose per-example gradients or token cotangents are exactly
    zero: ``"branch"``, a layer ``jnp.where`` never takes for example 1 (its gradient of
    ``w2`` is zero); ``"padding"``, tokens masked out of the loss (their cotangents are
    zero); ``"tied"``, the same with the embedding table tied to the head (the ghost
    cross terms between its lookup and its dense use)."""
    r = np.random.default_rng(5)
    T, d, f = 3, 8, 8
    V = 64 if form == "tied" else 4  # (a vocabulary whose norms take the cross terms)
    params = {"w1": jnp.asarray(r.normal(size=(d, f)) / np.sqrt(d)),
              "w2": jnp.asarray(r.normal(size=(d, f)) / np.sqrt(d)),
              "wo": jnp.asarray(r.normal(size=(f, V)) / np.sqrt(f)),
              "emb": jnp.asarray(r.normal(size=(V, f)))}
    x = r.normal(size=(3, T, d))
    x[1, :, 0] = np.abs(x[1, :, 0]) + 0.1  # (example 1: every token takes w1's branch)
    mask = np.ones((3, T))
    mask[0, 2] = mask[2, 1:] = 0.0
    batch = {"x": jnp.asarray(x), "y": jnp.asarray(r.integers(0, V, (3, T))),
             "mask": jnp.asarray(mask)}

    def loss(p, b):
        h = b["x"]
        if form == "branch":
            h = jnp.where(h[..., :1] > 0, h @ p["w1"], jnp.tanh(h @ p["w2"]))
        else:
            h = jnp.tanh(h @ p["w1"]) + jnp.tanh(h @ p["w2"])
        if form == "tied":
            h = h + p["emb"][b["y"]]
        logp = jax.nn.log_softmax(h @ (p["emb"].T if form == "tied" else p["wo"]))
        terms = -jnp.take_along_axis(logp, b["y"][..., None], -1)[..., 0]
        if form != "branch":
            terms = terms * b["mask"]
        return jnp.mean(terms)

    return loss, params, batch


@pytest.mark.parametrize("form", ["branch", "padding", "tied"])
def test_grad_of_norms_where_gradients_or_token_cotangents_are_zero(form):
    """Per-example norms, and the clipped mean that divides by them, differentiated where
    a site's per-example gradient is zero (a branch never taken) or some of its tokens'
    cotangents are (padding): finite and equal to the oracle's. Before, the ghost form's
    rounding bound took square roots of those zero rows, and a zero gradient's exact norm
    (`norms.example_norm`) its own: NaN derivatives (found by random models)."""
    with M.x64():
        loss, params, batch = _zero_rows_model(form)
        names = ["sq_norms", "norms", "clipped_mean"]
        out = _jacobians(loss, params, batch, names)
        _check_rows(names, *out, rtol=1e-8, atol=1e-10, model=form)
