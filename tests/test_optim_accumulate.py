"""``js.optim.accumulate``: ``every_k`` micro-batch updates equal one update of the inner
optimizer on the concatenated batch (float64, exact up to rounding), under ``jit``, in a
``lax.scan`` over micro-batches, with micro-batches of different sizes; and its errors."""

from __future__ import annotations

import _models as M
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxpr_surgery as js
import jaxpr_surgery.optim as jso

OPTIMIZERS = {
    # per-example variance and the batch size (Chan's rule, a count)
    "micro_adam_msq": lambda: jso.micro_adam_msq(0.05),
    # clipped sums, the batch size, a noise key passed through extra_args
    "dp_sgd": lambda: jso.dp_sgd(0.1, clip_norm=0.5, noise_multiplier=0.7),
    # Kronecker moments, inside a chain with an optax transform and the monitor
    "shampoo_chain": lambda: jso.chain(jso.track_gradient_statistics(),
                                       optax.clip_by_global_norm(10.0),
                                       jso.shampoo(0.05, max_dim=8, eps=1e-2)),
    # a plain optax optimizer (the mean only)
    "optax_sgd": lambda: optax.sgd(0.1, momentum=0.9),
}


def _one_step(inner, loss, params, batch, state, key):
    stats = js.per_example_stat(loss, jso.stat_request(inner, state))(params, batch)
    updates, state = inner.update(stats["mean"], state, params,
                                  **jso.update_kwargs(stats, key=key))
    return optax.apply_updates(params, updates), state


def _micro_step(acc, loss, params, state, micro, key):
    partial = js.per_example_partial(loss, jso.stat_request(acc, state))(params, micro)
    updates, state = acc.update(partial, state, params, key=key)
    return optax.apply_updates(params, updates), state


def _assert_trees_close(a, b, what, rtol=1e-10):
    la, ta = jax.tree.flatten(a)
    lb, tb = jax.tree.flatten(b)
    assert ta == tb, (what, ta, tb)
    for x, y in zip(la, lb, strict=True):
        np.testing.assert_allclose(np.asarray(x, np.float64), np.asarray(y, np.float64),
                                   rtol=rtol, atol=rtol * 1e-2, err_msg=what)


def _plain(inner, name):
    """Extra args for the inner update: the DP noise key (the other optimizers take none,
    but optax's sgd refuses unknown extra args, so it gets none)."""
    return name != "optax_sgd"


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_scan_over_micro_batches_equals_one_step_on_their_concatenation(name):
    """Two optimizer steps of 3 equal micro-batches each, in a lax.scan under jit, against
    two steps of the inner optimizer on the concatenated batches."""
    k, micro_size = 3, 2
    with M.x64():
        loss, params, batch = M.make_mlp(dtype=jnp.float64, seed=11, batch_size=2 * k * micro_size)
        inner = OPTIMIZERS[name]()
        acc = jso.accumulate(inner, every_k=k)
        key = jax.random.key(0)
        kw = _plain(inner, name)

        @jax.jit
        def train(params, batch):
            state = acc.init(params)
            micro = jax.tree.map(lambda x: x.reshape((2 * k, micro_size) + x.shape[1:]), batch)

            def body(carry, b):
                params, state = carry
                # one key per optimizer step: the DP noise of one step on the whole batch
                step_key = jax.random.fold_in(key, state.gradient_step)
                partial = js.per_example_partial(loss, jso.stat_request(acc, state))(params, b)
                extra = {"key": step_key} if kw else {}
                updates, state = acc.update(partial, state, params, **extra)
                return (optax.apply_updates(params, updates), state), (state.mini_step,
                                                                       state.gradient_step)

            (params, state), steps = jax.lax.scan(body, (params, state), micro)
            return params, state, steps

        got, state, (mini, gstep) = train(params, batch)
        np.testing.assert_array_equal(mini, [1, 2, 0, 1, 2, 0])
        np.testing.assert_array_equal(gstep, [0, 0, 1, 1, 1, 2])
        assert int(state.num_examples) == 0 and float(state.total_weight) == 0.0

        want, inner_state = params, inner.init(params)
        for s in range(2):
            b = jax.tree.map(lambda x, s=s: x[s * k * micro_size : (s + 1) * k * micro_size],
                             batch)
            step_key = jax.random.fold_in(key, s)
            if kw:
                want, inner_state = _one_step(inner, loss, want, b, inner_state, step_key)
            else:
                stats = js.per_example_stat(loss, jso.stat_request(inner))(want, b)
                u, inner_state = inner.update(stats["mean"], inner_state, want)
                want = optax.apply_updates(want, u)
        _assert_trees_close(got, want, f"{name}: parameters")
        if name == "shampoo_chain":  # the monitor forms its averages in float32
            _assert_trees_close(state.inner_state[0], inner_state[0], "monitor", rtol=1e-6)
            _assert_trees_close(state.inner_state[1:], inner_state[1:], f"{name}: inner state")
        else:
            _assert_trees_close(state.inner_state, inner_state, f"{name}: inner state")


def test_uneven_micro_batches_under_jit():
    """Micro-batches of 3, 4 and 1 examples (one jitted step per size): the step is the
    inner optimizer's on all 8 together, weighing every example alike."""
    with M.x64():
        loss, params, batch = M.make_mlp(dtype=jnp.float64, seed=12, batch_size=8)
        inner = jso.micro_adam_var(0.05)
        acc = jso.accumulate(inner, every_k=3)
        state = acc.init(params)
        step = jax.jit(lambda p, s, b: _micro_step(acc, loss, p, s, b, None))
        got, at = params, 0
        for n in (3, 4, 1):
            before = got
            got, state = step(got, state, jax.tree.map(lambda x, a=at, n=n: x[a : a + n], batch))
            at += n
            if n != 1:  # no step before the k-th micro-batch: zero updates
                _assert_trees_close(got, before, "waiting")
        want, inner_state = _one_step(inner, loss, params, batch, inner.init(params), None)
        _assert_trees_close(got, want, "parameters")
        _assert_trees_close(state.inner_state, inner_state, "inner state")
        assert int(state.gradient_step) == 1 and int(state.mini_step) == 0


def test_inject_hyperparams_request_from_the_state():
    """A request that depends on the state (a clip norm in state.hyperparams) is read
    through the accumulator's state; every_k=1 is one step per micro-batch."""
    loss, params, batch = M.make_mlp(seed=13, batch_size=4)
    inner = jso.inject_hyperparams(jso.dp_sgd)(learning_rate=0.1, clip_norm=0.3,
                                               noise_multiplier=0.0)
    acc = jso.accumulate(inner, every_k=1)
    state = acc.init(params)
    assert float(jso.stat_request(acc, state)["clipped_sum"].clip_norm) == pytest.approx(0.3)
    with pytest.raises(ValueError, match=r"depend on its state"):
        jso.stat_request(acc)
    key = jax.random.key(1)
    got, state = jax.jit(lambda p, s, b: _micro_step(acc, loss, p, s, b, key))(params, state,
                                                                               batch)
    want, _ = _one_step(inner, loss, params, batch, inner.init(params), key)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def test_errors():
    loss, params, batch = M.make_mlp(seed=14, batch_size=3)
    with pytest.raises(ValueError, match=r"every_k=...\): expected a positive int"):
        jso.accumulate(jso.adam(0.1), every_k=0)
    with pytest.raises(TypeError, match=r"expected an optax transformation"):
        jso.accumulate("adam", every_k=2)
    # per-example statistics cannot live in a state of fixed shape
    sq = jso.PerExampleTransformation(optax.identity().init, lambda u, s, p=None, **kw: (u, s),
                                      {"mean": js.stats.mean(), "n": js.stats.sq_norms()})
    with pytest.raises(ValueError, match=r"per-example statistics \(SqNorms"):
        jso.accumulate(sq, every_k=2).init(params)
    acc = jso.accumulate(jso.micro_adam(0.1), every_k=2)
    state = acc.init(params)
    grads = js.per_example_stat(loss, js.stats.mean())(params, batch)
    with pytest.raises(TypeError, match=r"takes the partial of a micro-batch"):
        acc.update(grads, state, params)
    other = js.per_example_partial(loss, jso.stat_request(jso.micro_adam_var(0.1)))(params, batch)
    with pytest.raises(ValueError, match=r"the optimizer requests \['mean', 'second_moment'\]"):
        acc.update(other, state, params)
    # the request of the wrapped optimizer, and MultiSteps' error points here
    assert sorted(jso.stat_request(acc, state)) == ["mean", "second_moment"]
    with pytest.raises(ValueError, match=r"js.optim.accumulate"):
        jso.stat_request(optax.MultiSteps(jso.micro_adam(0.1), 2))


def _recorder(request, like=None):
    """An identity optimizer whose state is the statistics it was given (every key of
    ``request`` but the mean; ``like``: statistics of that structure, zeros at init):
    what accumulate hands the inner update, compared."""
    keys = sorted(k for k in request if k != "mean")

    def init(params):
        del params
        return {k: jax.tree.map(jnp.zeros_like, like[k]) if like else None for k in keys}

    def update(updates, state, params=None, **kw):
        del state, params
        return updates, {k: kw[k] for k in keys}

    return jso.PerExampleTransformation(init, update, request)


@pytest.mark.parametrize("chunk", [None, 2])
def test_token_weighted_accumulation_equals_one_weighted_step(chunk):
    """Micro-batches with example_weights (token counts; a padded example of weight 0
    whose per-example loss is NaN): every_k updates give the inner optimizer the weighted
    statistics of the concatenated micro-batches and weights, the effective batch size
    of the noise scale included (the state keeps the weights' sum of squares)."""
    from test_example_weights import _tiny, _token_mean_per_example

    params, batch = _tiny()
    counts = jnp.sum(batch["mask"], -1)  # example 3: no tokens (weight 0, NaN loss)
    request = {"mean": js.stats.mean(), "variance": js.stats.variance(),
               "m2": js.stats.second_moment(), "noise": js.stats.noise_scale_components(),
               "snr": js.stats.snr(bias_corrected=True)}
    ref = js.per_example_stat(_token_mean_per_example, request)(params, batch,
                                                                 example_weights=counts)
    for inner in (_recorder(request, ref), jso.micro_adam_var(0.05)):
        acc = jso.accumulate(inner, every_k=3)
        state = acc.init(params)
        f = jax.jit(js.per_example_partial(_token_mean_per_example, jso.stat_request(acc, state),
                                           chunk_size=chunk))
        got = params
        for a, b in ((0, 2), (2, 4), (4, 5)):  # (the middle one holds the padded example)
            micro = jax.tree.map(lambda x, a=a, b=b: x[a:b], batch)
            partial = f(got, micro, example_weights=counts[a:b])
            updates, state = acc.update(partial, state, got)
            got = optax.apply_updates(got, updates)
        stats = js.per_example_stat(_token_mean_per_example, jso.stat_request(inner))(
            params, batch, example_weights=counts)
        u, want_state = inner.update(stats["mean"], inner.init(params), params,
                                     **jso.update_kwargs(stats))
        want = optax.apply_updates(params, u)
        _assert_trees_close(got, want, "parameters", rtol=2e-5)
        _assert_trees_close(state.inner_state, want_state, "inner state", rtol=2e-5)
        assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves(state.inner_state))
        assert int(state.gradient_step) == 1 and float(state.total_weight) == 0.0


def test_weighted_accumulation_refuses_a_statistic_of_every_weight():
    """With example_weights the state keeps the weights' total, sum of squares and
    largest; a statistic that reads every weight (uses_weights, no weight_summary)
    cannot be accumulated and says so."""

    class EveryWeight(js.stats.Statistic):
        uses_weights = True

        def reductions(self):
            return {"s": js.stats.PhiSum()}

        def finalize(self, values, count, weights=None):
            return weights

    loss, params, batch = M.make_mlp(seed=15, batch_size=4)
    acc = jso.accumulate(_recorder({"mean": js.stats.mean(), "w": EveryWeight()}), every_k=2)
    state = acc.init(params)
    partial = js.per_example_partial(loss, jso.stat_request(acc, state))(
        params, batch, example_weights=jnp.ones(4))
    with pytest.raises(ValueError, match=r"reads every example weight of the batch"):
        acc.update(partial, state, params)
    # without weights it is accumulated (weights=None)
    partial = js.per_example_partial(loss, jso.stat_request(acc, state))(params, batch)
    acc.update(partial, state, params)


@pytest.mark.parametrize("jit", [False, True])
def test_dp_sgd_accumulates_weighted_micro_batches_against_their_largest_weight(jit):
    """DP-SGD over micro-batches with example_weights: the state keeps their largest
    weight, so the check of the noise's sensitivity (``max_weight`` against
    ``max_example_weight``) reads the concatenated batch's (it was refused as a
    statistic of every weight). Two micro-batches equal one weighted DP step with the
    same key; a weight above the bound in the first micro-batch, not the one that
    steps, still poisons the step (NaN) rather than noise sized for a smaller bound."""
    with M.x64():
        loss, params, batch = M.make_mlp(dtype=jnp.float64, seed=16, batch_size=6)
        inner = jso.dp_sgd(0.1, clip_norm=0.5, noise_multiplier=0.7, max_example_weight=2.0)
        key = jax.random.key(3)
        good = jnp.array([2.0, 0.5, 1.0, 1.5, 0.0, 1.0])
        bad = good.at[1].set(2.5)
        for w, ok in ((good, True), (bad, False)):
            acc = jso.accumulate(inner, every_k=2)
            state = acc.init(params)
            f = js.per_example_partial(loss, jso.stat_request(acc, state))
            f = jax.jit(f) if jit else f
            got = params
            for a, b in ((0, 2), (2, 6)):
                micro = jax.tree.map(lambda x, a=a, b=b: x[a:b], batch)
                partial = f(got, micro, example_weights=w[a:b])
                updates, state = acc.update(partial, state, got, key=key)
                got = optax.apply_updates(got, updates)
            assert int(state.gradient_step) == 1
            stats = js.per_example_stat(loss, jso.stat_request(inner))(
                params, batch, example_weights=w)
            assert float(stats["max_weight"]) == float(jnp.max(w))
            if not ok:  # (one eager step on the whole batch refuses it outright)
                assert all(np.all(np.isnan(x)) for x in jax.tree.leaves(got))
                with pytest.raises(ValueError, match="above max_example_weight=2"):
                    inner.update(stats["mean"], inner.init(params), params,
                                 **jso.update_kwargs(stats, key=key))
                continue
            u, _ = inner.update(stats["mean"], inner.init(params), params,
                                **jso.update_kwargs(stats, key=key))
            _assert_trees_close(got, optax.apply_updates(params, u), "parameters")
