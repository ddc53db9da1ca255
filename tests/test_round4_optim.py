"""Issue 58 (round 4), the optimizers: `accumulate` compares every statistic's settings
with its request and refuses micro-batches with and without example weights in one step;
every optimizer's state can be donated; numpy integers are ints for every int
hyperparameter."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxpr_surgery.optim as jso

KEY = jax.random.key(0)


def _finite(tree):
    return all(bool(np.all(np.isfinite(x))) for x in jax.tree.leaves(tree))


def _all_nan(tree):
    return all(bool(np.all(np.isnan(x))) for x in jax.tree.leaves(tree))


# --------------------------------------------------------------------------- #
# Item 6: numpy integers are ints
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("n", [np.int64(4), np.int32(4), np.uint8(4)], ids=repr)
def test_numpy_integers_are_int_hyperparameters(n):
    """dp_sgd, dp_adam and dp_aggregate's batch_size, Shampoo's max_dim and
    precondition_every, accumulate's every_k and the batch sizes of the schedules take
    numpy integers (an array's shape, a config read back), as the privacy helpers do."""
    g = {"w": jnp.array([[0.3, -0.4], [1.0, 2.0]])}
    kw = {"clipped_sum": g, "max_weight": jnp.ones(()), "clip_norm": 1.0}
    for factory in (jso.dp_sgd, jso.dp_adam):
        u, _ = factory(0.1, 1.0, 0.0, batch_size=n).update(g, factory(0.1, 1.0, 0.0).init(g), g,
                                                            **kw)
        want, _ = factory(0.1, 1.0, 0.0, batch_size=4).update(g, factory(0.1, 1.0, 0.0).init(g),
                                                              g, **kw)
        np.testing.assert_array_equal(u["w"], want["w"])
    u, _ = jso.dp_aggregate(1.0, 0.0, n).update(g, (), **kw)
    np.testing.assert_allclose(u["w"], g["w"] / 4)

    tx = jso.scale_by_shampoo(per_example=False, max_dim=n // 2, precondition_every=n)
    ref = jso.scale_by_shampoo(per_example=False, max_dim=2, precondition_every=4)
    a, b = tx.init(g), ref.init(g)
    for _ in range(2):
        (ua, a), (ub, b) = tx.update(g, a), ref.update(g, b)
    np.testing.assert_array_equal(ua["w"], ub["w"])
    assert jso.stat_request(jso.shampoo(0.1, max_dim=n))["kron_moments"].max_dim == 4

    assert jso.accumulate(jso.adam(0.1), every_k=n).every_k == 4
    assert jso.sqrt_batch_size_scaling(1.0, n, 16) == pytest.approx(2.0)
    assert jso.adam_sqrt_scaling(n, 8, 1e-3)["b2"] == pytest.approx(0.998)


@pytest.mark.parametrize("bad", [True, np.bool_(True), 4.0, np.float64(4.0), "4", 0,
                                 np.int64(-2)], ids=repr)
def test_int_hyperparameters_refuse_bools_floats_and_non_positive(bad):
    for make, name in (
        (lambda: jso.dp_sgd(0.1, 1.0, 1.0, batch_size=bad), r"dp_aggregate\(batch_size="),
        (lambda: jso.dp_adam(0.1, 1.0, 1.0, batch_size=bad), r"dp_aggregate\(batch_size="),
        (lambda: jso.accumulate(jso.adam(0.1), every_k=bad), r"accumulate\(every_k="),
        (lambda: jso.shampoo(0.1, max_dim=bad), r"scale_by_shampoo\(max_dim="),
        (lambda: jso.shampoo(0.1, precondition_every=bad),
         r"scale_by_shampoo\(precondition_every="),
    ):
        with pytest.raises(ValueError, match=name + r"...\): expected a positive int"):
            make()
