"""jax.vmap of per_example_stat over an ensemble of parameters equals a loop."""

from __future__ import annotations

import _models as M
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxpr_surgery as js

pytestmark = pytest.mark.slow

E = 3  # ensemble members


def _ensemble(make):
    members = [make(seed=s) for s in range(E)]
    loss, _, batch = members[0]
    params = jax.tree.map(lambda *xs: jnp.stack(xs), *[m[1] for m in members])
    return loss, params, batch, [m[1] for m in members]


def test_vmap_over_param_ensemble_equals_loop():
    loss, stacked, batch, members = _ensemble(M.make_mlp)
    fn = js.per_example_stat(loss, M.all_stats())
    vm = jax.jit(jax.vmap(fn, in_axes=(0, None)))(stacked, batch)
    one = jax.jit(fn)
    for e, p in enumerate(members):
        looped = one(p, batch)
        got = M.take(vm, e)
        for k in M.STAT_NAMES:
            M.assert_consistent(k, got[k], looped[k], err_msg=f"member {e}")
        # and each member against the oracle (members differ: no broadcasting bug)
        ora = M.oracle(loss, p, batch)
        for k in ("mean", "variance", "sq_norms", "clipped_mean"):
            M.assert_stat_close(k, got[k], ora[k])
    assert not np.allclose(vm["sq_norms"][0], vm["sq_norms"][1])


def test_vmap_over_batches_and_params():
    """vmap over both params and data (in_axes=(0, 0)): independent problems."""
    loss, stacked, _, members = _ensemble(M.make_mlp)
    batches = [M.make_mlp(seed=10 + e)[2] for e in range(E)]
    sbatch = jax.tree.map(lambda *xs: jnp.stack(xs), *batches)
    stat = {"mean": js.stats.mean(), "variance": js.stats.variance(),
            "norms": js.stats.norms()}
    vm = jax.jit(jax.vmap(js.per_example_stat(loss, stat)))(stacked, sbatch)
    for e in range(E):
        ora = M.oracle(loss, members[e], batches[e])
        for k in stat:
            M.assert_stat_close(k, M.take(vm[k], e), ora[k])


def test_vmap_tied_embedding_ensemble():
    """Multi-site (tied) embedding and scale-shift under vmap."""
    loss, stacked, batch, members = _ensemble(M.make_tied)
    stat = {"mean": js.stats.mean(), "second_moment": js.stats.second_moment(),
            "sq_norms": js.stats.sq_norms()}
    vm = jax.jit(jax.vmap(js.per_example_stat(loss, stat), in_axes=(0, None)))(stacked, batch)
    for e in (0, E - 1):
        ora = M.oracle(loss, members[e], batch)
        for k in stat:
            M.assert_stat_close(k, M.take(vm[k], e), ora[k])
