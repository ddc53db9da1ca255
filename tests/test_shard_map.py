"""jax.shard_map over a 4-device mesh, batch split on 'd', axis_name='d':
every statistic equals the single-device full-batch result (check_vma=True).

Known trap: inside shard_map JAX inserts ``pvary`` on replicated parameters; a
matcher that misses the sites silently returns zeros. Every result is checked
to be non-zero as well as equal to the oracle.
"""

from __future__ import annotations

import _models as M
import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jaxpr_surgery as js

NDEV = 4

pytestmark = pytest.mark.skipif(
    jax.device_count() < NDEV,
    reason=f"needs {NDEV} devices: run with XLA_FLAGS=--xla_force_host_platform_device_count="
    f"{NDEV} set before jax initialises (tests/conftest.py does this)",
)


def _mesh(axis_type=None):
    if axis_type is None:
        return jax.make_mesh((NDEV,), ("d",))
    return jax.make_mesh((NDEV,), ("d",), axis_types=(axis_type,))


def _place(mesh, params, batch):
    """Params replicated, batch split on 'd' (explicit-sharding meshes require it)."""
    rep = jax.sharding.NamedSharding(mesh, P())
    split = jax.sharding.NamedSharding(mesh, P("d"))
    return jax.device_put(params, rep), jax.device_put(batch, split)


def _out_specs(stat_names):
    return {k: (P("d") if k in M.PER_EXAMPLE else P()) for k in stat_names}


def _check(name, out, names):
    ref, ora = M.result_of(name), M.oracle_of(name)
    for k in names:
        M.assert_not_all_zero(out[k], f"{name} {k}")
        M.assert_consistent(k, out[k], ref[k], rtol=1e-4, atol=1e-6, err_msg=f"{name} vs 1-device")
        M.assert_stat_close(k, out[k], ora[k])


@pytest.mark.parametrize("name", ["mlp", "transformer"])
def test_shard_map_every_statistic_equals_full_batch(name):
    loss, params, batch = M.get(name)
    fn = js.per_example_stat(loss, M.all_stats(), axis_name="d")
    mesh = _mesh()
    sm = jax.shard_map(fn, mesh=mesh, in_specs=(P(), P("d")),
                       out_specs=_out_specs(M.STAT_NAMES), check_vma=True)
    out = jax.jit(sm)(*_place(mesh, params, batch))
    _check(name, out, M.STAT_NAMES)


@pytest.mark.parametrize("axis_type", ["Auto", "Explicit"])
def test_shard_map_mesh_axis_types(axis_type):
    loss, params, batch = M.get("mlp")
    names = ("mean", "variance", "sq_norms", "clipped_mean")
    fn = js.per_example_stat(loss, {k: M.STATS[k]() for k in names}, axis_name="d")
    mesh = _mesh(getattr(jax.sharding.AxisType, axis_type))
    sm = jax.shard_map(fn, mesh=mesh, in_specs=(P(), P("d")), out_specs=_out_specs(names))
    out = jax.jit(sm)(*_place(mesh, params, batch))
    _check("mlp", out, names)


def test_shard_map_value_and_stat_and_aux():
    loss, params, batch = M.get("mlp")

    def loss_aux(p, b):
        return M.mlp_loss(p, b), {"x0": b["x"][:, 0]}

    vfn = js.value_and_per_example_stat(loss_aux, js.stats.mean(), has_aux=True, axis_name="d")
    mesh = _mesh()
    sm = jax.shard_map(vfn, mesh=mesh, in_specs=(P(), P("d")),
                       out_specs=((P(), {"x0": P("d")}), P()))
    (l, aux), mean = jax.jit(sm)(*_place(mesh, params, batch))
    np.testing.assert_allclose(l, loss(params, batch), rtol=1e-6)
    np.testing.assert_allclose(aux["x0"][:, 0], batch["x"][:, 0])  # aux of a batch of 1
    M.assert_tree_close(mean, jax.grad(loss)(params, batch), err_msg="mean")


def test_shard_map_check_vma_false():
    loss, params, batch = M.get("mlp")
    names = ("mean", "variance", "sq_norms", "clipped_sum")
    fn = js.per_example_stat(loss, {k: M.STATS[k]() for k in names}, axis_name="d")
    mesh = _mesh()
    sm = jax.shard_map(fn, mesh=mesh, in_specs=(P(), P("d")), out_specs=_out_specs(names),
                       check_vma=False)
    out = jax.jit(sm)(*_place(mesh, params, batch))
    _check("mlp", out, names)
