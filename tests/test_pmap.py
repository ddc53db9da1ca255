"""jax.pmap over 4 (fake CPU) devices with the batch split and axis_name='d':
every statistic equals the single-device full-batch result, on every device."""

from __future__ import annotations

import _models as M
import jax
import numpy as np
import pytest

import jaxpr_surgery as js

NDEV = M.NDEV

pytestmark = [pytest.mark.slow, M.needs_devices]


def _split(batch, n=NDEV):
    return jax.tree.map(lambda x: x.reshape((n, x.shape[0] // n) + x.shape[1:]), batch)


def _check_all(name, out, ref, ora):
    for k in M.STAT_NAMES:
        if k in M.PER_EXAMPLE:
            # per-example norms stay with the device holding the example
            got = np.asarray(out[k]).reshape(-1)
        else:
            # every device holds the same (replicated) value
            leaves = jax.tree.leaves(out[k])
            for x in leaves:
                x = np.asarray(x)
                for d in range(1, NDEV):
                    np.testing.assert_allclose(x[d], x[0], rtol=1e-6, atol=1e-7,
                                               err_msg=f"{name} {k}: device {d} differs")
            got = M.take(out[k], 0)
        M.assert_consistent(k, got, ref[k], rtol=1e-4, atol=1e-6, err_msg=f"{name} vs 1-device")
        M.assert_stat_close(k, got, ora[k])
        M.assert_not_all_zero(got, f"{name} {k}")


@pytest.mark.parametrize("name", ["mlp", "transformer"])
def test_pmap_every_statistic_equals_full_batch(name):
    loss, params, batch = M.get(name)
    fn = js.per_example_stat(loss, M.all_stats(), axis_name="d")
    out = jax.pmap(fn, axis_name="d", in_axes=(None, 0))(params, _split(batch))
    _check_all(name, out, M.result_of(name), M.oracle_of(name))


def test_pmap_value_and_stat_loss_is_global_mean():
    loss, params, batch = M.get("mlp")
    vfn = js.value_and_per_example_stat(loss, js.stats.variance(), axis_name="d")
    (l, var) = jax.pmap(vfn, axis_name="d", in_axes=(None, 0))(params, _split(batch))
    np.testing.assert_allclose(np.asarray(l), np.full(NDEV, loss(params, batch)), rtol=1e-6)
    M.assert_stat_close("variance", M.take(var, 0),
                        M.oracle_of("mlp")["variance"])


def test_pmap_with_chunking():
    """axis_name combined with chunk_size (2 local examples, chunks of 1)."""
    loss, params, batch = M.get("mlp")
    stat = {"variance": js.stats.variance(), "sq_norms": js.stats.sq_norms(),
            "clipped_sum": js.stats.clipped_sum(M.CLIP)}
    fn = js.per_example_stat(loss, stat, axis_name="d", chunk_size=1)
    out = jax.pmap(fn, axis_name="d", in_axes=(None, 0))(params, _split(batch))
    ora = M.oracle_of("mlp")
    M.assert_stat_close("variance", M.take(out["variance"], 0),
                        ora["variance"])
    M.assert_stat_close("clipped_sum", M.take(out["clipped_sum"], 0),
                        ora["clipped_sum"])
    M.assert_stat_close("sq_norms", np.asarray(out["sq_norms"]).reshape(-1), ora["sq_norms"])


def test_pmap_without_axis_name_gives_local_statistics():
    """Without axis_name each device describes only its own examples (documented)."""
    loss, params, batch = M.get("mlp")
    out = jax.pmap(js.per_example_stat(loss, js.stats.mean()), in_axes=(None, 0))(
        params, _split(batch))
    b = _split(batch)
    for d in (0, NDEV - 1):
        local = M.take(b, d)
        M.assert_tree_close(M.take(out, d), jax.grad(loss)(params, local),
                            err_msg=f"device {d}")
