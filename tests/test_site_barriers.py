"""Sites finish their statistics before the backward pass goes on (site_fns.make_site_fn).

In a loss without ``jax.checkpoint`` each site outside a scan passes its input and
cotangent through one ``lax.optimization_barrier`` before its statistics and its
cotangent with the statistics through another before its data cotangents, so XLA can
neither hoist work on the input ahead nor keep the site's input and cotangent alive
into the layers below; with remat it does not (measured worse there). The barriers
change scheduling only: the values stay the oracle's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _models import all_eqns, x64

import jaxpr_surgery as js


def _count_barriers(jaxpr) -> int:
    return sum(e.primitive.name == "optimization_barrier" for e in all_eqns(jaxpr))


def _mlp(remat):
    r = np.random.default_rng(0)
    p = {"w1": jnp.asarray(r.standard_normal((5, 7)) * 0.5),
         "w2": jnp.asarray(r.standard_normal((7, 3)) * 0.5)}
    b = {"x": jnp.asarray(r.standard_normal((6, 5))), "y": jnp.asarray(r.standard_normal((6, 3)))}

    def layer(w, h):
        return jnp.tanh(h @ w)

    def loss(p, b):
        f = jax.checkpoint(layer) if remat else layer
        return jnp.mean(jnp.sum((f(p["w2"], f(p["w1"], b["x"])) - b["y"]) ** 2, axis=1))

    return loss, p, b


@pytest.mark.parametrize("remat", [False, True])
def test_barrier_only_without_remat_and_values_unchanged(remat):
    with x64():
        loss, p, b = _mlp(remat)
        stats = (js.stats.second_moment(), js.stats.variance(), js.stats.sq_norms())
        f = js.per_example_stat(loss, stats)
        # (sq_norms' sum over the leaves has a barrier of its own, stats._SqNorms: count
        # the sites' only)
        site_only = js.per_example_stat(loss, stats[:2])
        n = _count_barriers(jax.make_jaxpr(site_only)(p, b).jaxpr)
        assert (n == 0) if remat else (n >= 4), n  # two per site (two dense sites)
        one = lambda p, ex: loss(p, jax.tree.map(lambda a: a[None], ex))  # noqa: E731
        g = jax.jit(jax.vmap(jax.grad(one), in_axes=(None, 0)))(p, b)
        m2, var, sq = jax.jit(f)(p, b)
        for k in p:
            np.testing.assert_allclose(m2[k], (g[k] ** 2).mean(0), rtol=1e-10)
            np.testing.assert_allclose(var[k], g[k].var(0, ddof=1), rtol=1e-10)
        want = sum((g[k] ** 2).reshape(6, -1).sum(1) for k in p)
        np.testing.assert_allclose(sq, want, rtol=1e-10)
