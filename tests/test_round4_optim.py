"""Issue 58 (round 4), the optimizers: `accumulate` compares every statistic's settings
with its request and refuses micro-batches with and without example weights in one step;
every optimizer's state can be donated; numpy integers are ints for every int
hyperparameter."""

from __future__ import annotations

import _models as M
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxpr_surgery as js
import jaxpr_surgery.optim as jso

KEY = jax.random.key(0)


def _finite(tree):
    return all(bool(np.all(np.isfinite(x))) for x in jax.tree.leaves(tree))


def _all_nan(tree):
    return all(bool(np.all(np.isnan(x))) for x in jax.tree.leaves(tree))


# --------------------------------------------------------------------------- #
# Item 2: a partial made for another DP configuration
# --------------------------------------------------------------------------- #
def test_accumulate_refuses_a_partial_of_other_settings():
    """A micro-batch partial computed for clip_norm=100 does not step an accumulated
    dp_sgd(clip_norm=1), eagerly or under jit (merge_partials and dp_sgd alone refuse
    it too); the partial of the optimizer's own request is accepted."""
    loss, params, batch = M.make_mlp(seed=31, batch_size=4)
    acc = jso.accumulate(jso.dp_sgd(0.1, clip_norm=1.0, noise_multiplier=1.0), every_k=2)
    state = acc.init(params)
    other = js.per_example_partial(
        loss, jso.stat_request(jso.dp_sgd(0.1, clip_norm=100.0, noise_multiplier=1.0))
    )(params, batch)
    own = js.per_example_partial(loss, jso.stat_request(acc, state))(params, batch)
    match = r"other statistics: .*clipped_sum\(clip_norm=100.0\) where the optimizer requests"
    with pytest.raises(ValueError, match=match):
        acc.update(other, state, params, key=KEY)
    with pytest.raises(ValueError, match=match):
        jax.jit(lambda p, s: acc.update(p, s, params, key=KEY))(other, state)
    with pytest.raises(ValueError, match="partial 1 holds other statistics"):
        js.merge_partials(own, other)
    _, state = acc.update(own, state, params, key=KEY)  # its own: accepted
    with pytest.raises(ValueError, match=match):  # also after a first micro-batch
        acc.update(other, state, params, key=KEY)


def test_accumulate_accepts_a_clip_norm_scheduled_under_jit():
    """A clip norm scheduled by inject_hyperparams is traced inside a jitted step, and
    each stat_request builds it afresh: it cannot be compared there, so accumulate leaves
    it to the DP update (which poisons a step whose clip norm differs) and steps."""
    loss, params, batch = M.make_mlp(seed=32, batch_size=4)
    inner = jso.inject_hyperparams(jso.dp_sgd)(
        learning_rate=0.1, clip_norm=optax.linear_schedule(1.0, 0.5, 4), noise_multiplier=0.5)
    acc = jso.accumulate(inner, every_k=2)

    @jax.jit
    def step(params, state):
        partial = js.per_example_partial(loss, jso.stat_request(acc, state))(params, batch)
        updates, state = acc.update(partial, state, params, key=KEY)
        return optax.apply_updates(params, updates), state

    state = acc.init(params)
    for _ in range(2):
        params, state = step(params, state)
    assert int(state.gradient_step) == 1 and _finite(params)


# --------------------------------------------------------------------------- #
# Item 3: weighted and unweighted micro-batches in one step
# --------------------------------------------------------------------------- #
def test_accumulate_refuses_weighted_and_unweighted_micro_batches():
    """Weights of 5 in one micro-batch, none in the other, max_example_weight=1: refused
    in either order (the state recorded the weights, the step read only the last
    micro-batch's); under jit the step is NaN. Micro-batches all weighted or all
    unweighted step as before."""
    loss, params, batch = M.make_mlp(seed=33, batch_size=4)
    acc = jso.accumulate(jso.dp_sgd(0.1, clip_norm=1.0, noise_multiplier=1.0), every_k=2)
    f = js.per_example_partial(loss, jso.stat_request(acc, acc.init(params)))
    weighted, plain = f(params, batch, example_weights=jnp.full(4, 5.0)), f(params, batch)
    for first, last, why in ((weighted, plain, "had them"), (plain, weighted, "had none")):
        _, state = acc.update(first, acc.init(params), params, key=KEY)
        with pytest.raises(ValueError, match=f"accumulated before it {why}.*to every micro"):
            acc.update(last, state, params, key=KEY)

    # under jit: weights of 0.5 (within the bound), so that only the mixing poisons
    half = f(params, batch, example_weights=jnp.full(4, 0.5))
    update = jax.jit(lambda p, s: acc.update(p, s, params, key=KEY))
    for pair, ok in (((half, plain), False), ((plain, half), False),
                     ((half, half), True), ((plain, plain), True)):
        state = acc.init(params)
        for partial in pair:
            updates, state = update(partial, state)
        assert int(state.gradient_step) == 1
        assert _finite(updates) if ok else _all_nan(updates), pair
        if not ok:  # the next step starts afresh
            for partial in (half, half):
                updates, state = update(partial, state)
            assert _finite(updates)


# --------------------------------------------------------------------------- #
# Item 5: every state can be donated
# --------------------------------------------------------------------------- #
_LABELS = {"l1": "a", "l2": "b"}

#: one (or more) of every transformation of js.optim, by factory name
TRANSFORMS = {
    "scale_by_adam": [lambda: jso.scale_by_adam()],
    "scale_by_micro_adam": [lambda: jso.scale_by_micro_adam()],
    "scale_by_micro_adam_var": [lambda: jso.scale_by_micro_adam_var()],
    "scale_by_micro_adam_msq": [lambda: jso.scale_by_micro_adam_msq()],
    "adam": [lambda: jso.adam(0.1)],
    "micro_adam": [lambda: jso.micro_adam(0.1)],
    "micro_adam_var": [lambda: jso.micro_adam_var(0.1)],
    "micro_adam_msq": [lambda: jso.micro_adam_msq(0.1)],
    "scale_by_shampoo": [lambda: jso.scale_by_shampoo(precondition_every=2)],
    "shampoo": [lambda: jso.shampoo(0.1, per_example=False)],
    "scale_by_per_example_sign": [lambda: jso.scale_by_per_example_sign()],
    "per_example_sign_sgd": [lambda: jso.per_example_sign_sgd(0.1, b1=0.9)],
    "sign_sgd": [lambda: jso.sign_sgd(0.1)],
    "ema_of_sign": [lambda: jso.ema_of_sign(0.1)],
    "sign_ema": [lambda: jso.sign_ema(0.1)],
    "dp_aggregate": [lambda: jso.dp_aggregate(1.0, 1.0)],
    "dp_sgd": [lambda: jso.dp_sgd(0.1, 1.0, 1.0, momentum=0.9)],
    "dp_adam": [lambda: jso.dp_adam(0.1, 1.0, 1.0, batch_size=4)],
    "track_gradient_statistics": [lambda: jso.track_gradient_statistics(),
                                  lambda: jso.track_gradient_statistics(per_coordinate=False)],
    "chain": [lambda: jso.chain(jso.track_gradient_statistics(), optax.adam(0.1))],
    "named_chain": [lambda: jso.named_chain(("t", jso.track_gradient_statistics()),
                                            ("a", jso.micro_adam(0.1)))],
    "masked": [lambda: jso.masked(jso.track_gradient_statistics(), {"l1": True, "l2": False})],
    "partition": [lambda: jso.partition({"a": jso.micro_adam(0.1),
                                         "b": jso.track_gradient_statistics()}, _LABELS)],
    "multi_transform": [lambda: jso.multi_transform({"a": jso.sign_ema(0.1),
                                                     "b": optax.sgd(0.1)}, _LABELS)],
    "inject_hyperparams": [lambda: jso.inject_hyperparams(jso.dp_sgd)(
        learning_rate=0.1, clip_norm=optax.constant_schedule(1.0), noise_multiplier=1.0)],
    "accumulate": [lambda: jso.accumulate(jso.adam(0.1), every_k=2),
                   lambda: jso.accumulate(jso.chain(jso.track_gradient_statistics(),
                                                    jso.micro_adam_var(0.1)), every_k=2),
                   lambda: jso.accumulate(jso.dp_sgd(0.1, 1.0, 1.0), every_k=2)],
}

#: the names of js.optim that are not transformations (or factories of them)
NOT_TRANSFORMS = {
    "PerExampleTransformation", "AccumulatingTransformation", "AccumulateState",
    "ScaleByMicroAdamState", "ScaleByShampooState", "TrackGradientStatisticsState",
    "example_count", "stat_request", "update_kwargs", "dp_sensitivity",
    "sqrt_batch_size_scaling", "adam_sqrt_scaling",
}


def test_every_transformation_is_tested_for_donation():
    assert set(TRANSFORMS) == set(jso.__all__) - NOT_TRANSFORMS


@pytest.fixture(scope="module")
def problem():
    """A small MLP, and every statistic any transformation requests (clip norm 1)."""
    loss, params, batch = M.make_mlp(seed=34, batch_size=4)
    request = {}
    for name in ("dp_sgd", "micro_adam", "micro_adam_var", "per_example_sign_sgd", "shampoo"):
        request.update(jso.stat_request(name, clip_norm=1.0))
    stats = jax.jit(js.per_example_stat(loss, request))(params, batch)
    return loss, params, batch, stats


@pytest.mark.parametrize("make", [(name, i) for name, makes in TRANSFORMS.items()
                                  for i in range(len(makes))], ids=str)
def test_state_can_be_donated(problem, make):
    """init, then two steps of a jitted update with the state donated (the usual
    training step: optax.MultiSteps' state donates too). A state whose fields share one
    buffer fails with "Attempt to donate the same buffer twice"."""
    loss, params, batch, stats = problem
    opt = TRANSFORMS[make[0]][make[1]]()
    state = opt.init(params)
    if isinstance(opt, jso.AccumulatingTransformation):
        request = jso.stat_request(opt, state)
        update = js.per_example_partial(loss, request)(params, batch)  # eager: no compile
        extra = {"key": KEY}
    else:
        kw = {k: stats[k] for k in jso.stat_request(opt, state)}
        update, extra = kw["mean"], jso.update_kwargs(kw, key=KEY)

    step = jax.jit(lambda s, u, kw: opt.update(u, s, params, **kw), donate_argnums=0)
    leaves = [x for x in jax.tree.leaves(state) if isinstance(x, jax.Array)]
    for _ in range(2):
        updates, state = step(state, update, extra)
    # donated (leaves returned unchanged, hyperparameters, are forwarded, not donated)
    assert not leaves or any(x.is_deleted() for x in leaves)
    assert jax.tree.structure(updates) == jax.tree.structure(params)


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


# --------------------------------------------------------------------------- #
# Float hyperparameters of the DP optimizers: numpy scalars, infinite noise
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("factory", [jso.dp_sgd, jso.dp_adam])
def test_dp_noise_multiplier_inf_and_numpy_floats_are_checked(factory):
    """``noise_multiplier=inf`` was accepted and made every update non-finite; numpy float
    scalars skipped the checks (``np.float32(-1)`` accepted) and ``np.float32(0)`` was not
    read as 'no noise' (a key still required)."""
    for z in (float("inf"), np.float32(np.inf), np.float32(-1), np.float64(np.nan)):
        with pytest.raises(ValueError, match="noise_multiplier"):
            factory(0.1, 1.0, z)
    with pytest.raises(ValueError, match="clip_norm"):
        factory(0.1, np.float32(-1.0), 1.0)
    g = {"w": jnp.array([[0.3, -0.4], [1.0, 2.0]])}
    kw = {"clipped_sum": g, "max_weight": jnp.ones(()), "clip_norm": 1.0}
    tx = factory(0.1, np.float32(1.0), np.float32(0.0), batch_size=4)
    u, _ = tx.update(g, tx.init(g), g, **kw)  # no noise: no key needed
    ref = factory(0.1, 1.0, 0.0, batch_size=4)
    want, _ = ref.update(g, ref.init(g), g, **kw)
    np.testing.assert_array_equal(u["w"], want["w"])
