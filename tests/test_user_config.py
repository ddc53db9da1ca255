"""The user's jax configuration: a codebase that sets ``jax_numpy_rank_promotion="raise"``
(to catch unintended broadcasting in its own code) gets every statistic, `explain` and the
optimizers' steps as under the default; its model's own rank promotion still raises, as
it does under ``jax.grad``."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxpr_surgery as js
import jaxpr_surgery.optim as jso


def _case():
    r = np.random.default_rng(0)
    f = lambda *s: jnp.asarray(r.normal(size=s) / 2, jnp.float32)  # noqa: E731
    params = {"emb": f(11, 4), "w": f(4, 3), "b": f(3), "g": 1 + f(3)}
    batch = {"ids": jnp.asarray(r.integers(0, 11, (6, 5))), "y": f(6, 5, 3)}
    return params, batch


def _loss(p, b):  # (every broadcast by rank written out: the model runs under "raise")
    h = jnp.tanh(p["emb"][b["ids"]] @ p["w"] + p["b"][None, None, :])
    mu = jnp.mean(h, -1, keepdims=True)
    h = (h - mu) * p["g"][None, None, :]
    return jnp.mean(jnp.sum((h - b["y"]) ** 2, -1))


STATS = {
    "mean": js.stats.mean(), "second_moment": js.stats.second_moment(),
    "variance": js.stats.variance(), "sign_mean": js.stats.sign_mean(),
    "sq_norms": js.stats.sq_norms(), "norms": js.stats.norms(per_leaf=True),
    "clipped_mean": js.stats.clipped_mean(0.3), "snr": js.stats.snr(),
    "gradient_noise_scale": js.stats.gradient_noise_scale(),
    "kurtosis": js.stats.kurtosis(), "fourth_moment": js.stats.fourth_moment(),
    "norm_quantiles": js.stats.norm_quantiles((0.5,)),
    "gradient_diversity": js.stats.gradient_diversity(),
}


def test_statistics_under_rank_promotion_raise():
    params, batch = _case()
    want = jax.jit(js.per_example_stat(_loss, STATS, chunk_size=2))(params, batch)
    with jax.numpy_rank_promotion("raise"):
        got = jax.jit(js.per_example_stat(_loss, STATS, chunk_size=2))(params, batch)
        rep = js.explain(_loss, STATS)(params, batch)
    assert rep.leaves
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b),
                                      err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize("make", [lambda: jso.dp_sgd(0.1, 0.5, 1.0),
                                  lambda: jso.dp_adam(0.1, 0.5, 1.0),
                                  lambda: jso.micro_adam(0.05)],
                         ids=["dp_sgd", "dp_adam", "micro_adam"])
def test_optimizer_steps_under_rank_promotion_raise(make):
    params, batch = _case()
    tx = make()

    def step(params, batch, key):
        stats = js.per_example_stat(_loss, jso.stat_request(tx))(params, batch)
        updates, _ = tx.update(stats["mean"] if "mean" in stats else None, tx.init(params),
                               params, **jso.update_kwargs(stats, key=key))
        return optax.apply_updates(params, updates)

    key = jax.random.PRNGKey(3)
    want = jax.jit(step)(params, batch, key)
    with jax.numpy_rank_promotion("raise"):
        got = jax.jit(step)(params, batch, key)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_the_model_own_rank_promotion_still_raises():
    params, batch = _case()

    def loose(p, b):  # a bias added by rank promotion
        return jnp.mean((jnp.tanh(p["emb"][b["ids"]] @ p["w"] + p["b"]) - b["y"]) ** 2)

    with jax.numpy_rank_promotion("raise"):
        with pytest.raises(ValueError, match="rank_promotion"):
            jax.grad(loose)(params, batch)
        with pytest.raises(ValueError, match="rank_promotion"):
            js.per_example_stat(loose, js.stats.variance())(params, batch)
