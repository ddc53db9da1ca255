"""DP-SGD's noise covers the clipped sum's real sensitivity (issue 51, round 3):

* with ``example_weights`` the weighted clipped sum moves by up to ``max(w) C`` when one
  example is removed: the noise is scaled to a declared ``max_example_weight`` (data
  independent), and weights above it raise (concrete) or make the update NaN (traced);
* a parameter leaf that is not differentiated (an integer buffer: its statistics are
  None) needs no clip bound and adds none to the noise;
* ``inject_hyperparams(dp_sgd)`` with a tree of bounds holding a schedule clips with the
  bounds of the current step and noises for them.

Every noise check measures the standard deviation of the DP update over many keys."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxpr_surgery as js
import jaxpr_surgery.optim as jso

B, D, K = 6, 3, 2
C, Z = 0.5, 1.3
NKEYS = 4000


def loss(params, batch):
    scale = 1.0 + 0.1 * params["step"].astype(batch["x"].dtype) if "step" in params else 1.0
    pred = (batch["x"] @ params["w"] + params["b"]) * scale
    return jnp.mean(jnp.sum((pred - batch["y"]) ** 2, -1))


def make(seed=0, step=False):
    r = np.random.default_rng(seed)
    params = {"w": jnp.asarray(r.normal(size=(D, K)), jnp.float32),
              "b": jnp.asarray(r.normal(size=(K,)), jnp.float32)}
    if step:
        params["step"] = jnp.int32(3)  # a non-float leaf: skipped, its statistics None
    # large targets: every example's gradient norm is far above the bounds (all clipped)
    batch = {"x": jnp.asarray(r.normal(size=(B, D)), jnp.float32),
             "y": jnp.asarray(20.0 + r.normal(size=(B, K)), jnp.float32)}
    return params, batch


def per_example_grads(params, batch):
    floats = {k: v for k, v in params.items() if k != "step"}
    rest = {k: v for k, v in params.items() if k == "step"}

    def one(p, ex):
        return jax.grad(lambda q: loss({**q, **rest}, jax.tree.map(lambda a: a[None], ex)))(p)

    return jax.vmap(one, in_axes=(None, 0))(floats, batch)


def oracle_clipped_sum(g, bounds, weights=None):
    """``sum_b w_b min(1, C_k / |g_b,k|) g_b,k`` per group ``k`` (a key of ``bounds``)."""
    w = np.ones(B) if weights is None else np.asarray(weights, np.float64)
    out = {}
    for group, Ck in bounds.items():
        leaves = {group: g[group]} if group in g else g  # "all": one group of every leaf
        norm = np.sqrt(sum(np.sum(np.asarray(x, np.float64).reshape(B, -1) ** 2, 1)
                           for x in leaves.values()))
        f = w * np.minimum(1.0, Ck / norm)
        for k, x in leaves.items():
            out[k] = np.tensordot(f, np.asarray(x, np.float64), axes=1)
    return out


def flat(tree):
    return np.concatenate([np.asarray(x, np.float64).ravel()
                           for x in jax.tree.leaves(tree)])


def noise_std(opt, state, params, stats, scale):
    """The standard deviation over ``NKEYS`` keys of the DP update's noise, in units of the
    clipped sum (``scale``: what the update multiplies the noised sum by)."""
    keys = jax.random.split(jax.random.key(0), NKEYS)
    kw = jso.update_kwargs(stats)

    @jax.jit
    def updates(keys):
        return jax.vmap(lambda k: flat_jnp(opt.update(stats["mean"], state, params,
                                                       **kw, key=k)[0]))(keys)

    u = np.asarray(updates(keys), np.float64) / scale
    return float(np.std(u - u.mean(0), axis=0).mean())


def flat_jnp(tree):
    return jnp.concatenate([x.ravel() for x in jax.tree.leaves(tree)])


# --------------------------------------------------------------------------- #
# Item 1: example weights above 1
# --------------------------------------------------------------------------- #
WEIGHTS = jnp.asarray([1.0, 4.0, 0.5, 2.0, 3.0, 0.0])


def _sensitivity(params, batch, weights):
    """max over examples of |S(D) - S(D without b)|, S the weighted clipped sum (removing
    an example: its weight 0, exact)."""
    f = jax.jit(js.per_example_stat(loss, js.stats.clipped_sum(C)))
    full = flat(f(params, batch, example_weights=weights))
    return max(np.linalg.norm(full - flat(f(params, batch,
                                            example_weights=weights.at[i].set(0.0))))
               for i in range(B) if float(weights[i]) > 0)


def test_weighted_sensitivity_is_measured_as_max_weight_times_clip_norm():
    params, batch = make()
    sens = _sensitivity(params, batch, WEIGHTS)
    assert sens == pytest.approx(4.0 * C, rel=1e-4)  # the example of weight 4


@pytest.mark.parametrize("factory", [jso.dp_sgd, jso.dp_adam])
def test_dp_noise_covers_the_weighted_sensitivity(factory):
    """With weights up to 4, a DP optimizer either refuses the weights or adds noise of
    std at least z times the measured sensitivity (4 C): never z C."""
    params, batch = make()
    sens = _sensitivity(params, batch, WEIGHTS)
    covered = 0
    for kw in ({}, {"max_example_weight": 4.0}, {"max_example_weight": 8.0}):
        try:
            opt = factory(1.0, clip_norm=C, noise_multiplier=Z, batch_size=B, **kw)
        except TypeError:  # (no max_example_weight before the fix)
            continue
        state = opt.init(params)
        stats = js.per_example_stat(loss, jso.stat_request(opt))(
            params, batch, example_weights=WEIGHTS)
        try:
            u, _ = opt.update(stats["mean"], state, params,
                              **jso.update_kwargs(stats, key=jax.random.key(1)))
        except ValueError as e:
            assert "max_example_weight" in str(e) and "4" in str(e)
            continue
        if factory is jso.dp_adam:  # (Adam's first step is a sign: no noise scale to read)
            covered += 1
            continue
        std = noise_std(opt, state, params, stats, -1.0 / B)
        assert std >= 0.97 * Z * sens, (kw, std, Z * sens)
        assert std == pytest.approx(Z * C * kw["max_example_weight"], rel=0.04)  # not more
        covered += 1
    assert covered == 2


def test_weights_above_the_declared_bound_raise_or_poison():
    params, batch = make()
    opt = jso.dp_sgd(1.0, clip_norm=C, noise_multiplier=Z, batch_size=B)
    state = opt.init(params)
    request = jso.stat_request(opt)
    assert "max_weight" in request
    f = js.per_example_stat(loss, request)
    stats = f(params, batch, example_weights=WEIGHTS)
    assert float(stats["max_weight"]) == 4.0
    kw = jso.update_kwargs(stats, key=jax.random.key(1))
    with pytest.raises(ValueError, match=r"largest example weight of this call is 4, above "
                                         r"max_example_weight=1"):
        opt.update(stats["mean"], state, params, **kw)

    @jax.jit
    def step(weights, key):
        stats = f(params, batch, example_weights=weights)
        return opt.update(stats["mean"], state, params, **jso.update_kwargs(stats, key=key))[0]

    assert all(np.isnan(x).all() for x in jax.tree.leaves(step(WEIGHTS, jax.random.key(2))))
    # 0/1 weights (padding) and weights within the bound give numbers
    for w in (jnp.asarray([1.0, 0, 1, 1, 0, 1]), jnp.full(B, 0.25)):
        assert all(np.isfinite(x).all() for x in jax.tree.leaves(step(w, jax.random.key(3))))
    pad = jnp.asarray([False, True, False, False, True, False])
    stats = f(params, batch, is_padding_example=pad)
    assert float(stats["max_weight"]) == 1.0
    u, _ = opt.update(stats["mean"], state, params,
                      **jso.update_kwargs(stats, key=jax.random.key(1)))
    assert all(np.isfinite(x).all() for x in jax.tree.leaves(u))
    # unweighted: the largest weight is 1
    assert float(js.per_example_stat(loss, request)(params, batch)["max_weight"]) == 1.0
    # no noise: no privacy to calibrate, the weighted clipped mean is computed as asked
    opt0 = jso.dp_sgd(1.0, clip_norm=C, noise_multiplier=0.0, batch_size=B)
    stats = js.per_example_stat(loss, jso.stat_request(opt0))(params, batch,
                                                              example_weights=WEIGHTS)
    u, _ = opt0.update(stats["mean"], opt0.init(params), params, **jso.update_kwargs(stats))
    want = oracle_clipped_sum(per_example_grads(params, batch), {"all": C}, WEIGHTS)
    np.testing.assert_allclose(flat(u), -flat(want) / B, rtol=1e-5, atol=1e-6)


def test_max_example_weight_is_validated_and_in_the_request_by_name():
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match=r"max_example_weight"):
            jso.dp_sgd(0.1, clip_norm=C, noise_multiplier=1.0, max_example_weight=bad)
    with pytest.raises(ValueError, match=r"max_example_weight=inf"):
        jso.dp_aggregate(C, 1.0, max_example_weight=float("inf"))
    with pytest.raises(TypeError, match=r"max_example_weight"):
        jso.dp_adam(0.1, clip_norm=C, noise_multiplier=1.0, max_example_weight=True)
    assert "max_weight" in jso.stat_request("dp_sgd", clip_norm=1.0)
    assert set(jso.stat_request("dp_adam", clip_norm=1.0)) == set(
        jso.stat_request(jso.dp_adam(0.1, 1.0, 1.0)))


def test_injected_max_example_weight():
    """Under inject_hyperparams the declared bound is a traced hyperparameter: the noise
    follows it and weights above it make the update NaN."""
    params, batch = make()
    opt = jso.inject_hyperparams(jso.dp_sgd)(learning_rate=1.0, clip_norm=C,
                                             noise_multiplier=Z, batch_size=B,
                                             max_example_weight=4.0)
    state = opt.init(params)
    stats = js.per_example_stat(loss, jso.stat_request(opt, state))(
        params, batch, example_weights=WEIGHTS)
    assert noise_std(opt, state, params, stats, -1.0 / B) == pytest.approx(4 * Z * C, rel=0.04)
    state = state._replace(hyperparams={**state.hyperparams,
                                        "max_example_weight": jnp.asarray(2.0)})
    u, _ = jax.jit(lambda s, k: opt.update(stats["mean"], s, params,
                                           **jso.update_kwargs(stats, key=k)))(
        state, jax.random.key(0))
    assert all(np.isnan(x).all() for x in jax.tree.leaves(u))


# --------------------------------------------------------------------------- #
# Item 7: skipped (non-float) leaves need no bound and add no noise
# --------------------------------------------------------------------------- #
def test_skipped_leaf_needs_no_bound():
    params, batch = make(step=True)
    g = per_example_grads(params, batch)
    for bounds in ({"w": 0.3, "b": 0.2}, {"w": 0.3, "b": 0.2, "step": 5.0}):
        got = js.per_example_stat(loss, js.stats.clipped_sum(bounds))(params, batch)
        assert got["step"] is None
        want = oracle_clipped_sum(g, {"w": 0.3, "b": 0.2})
        for k in ("w", "b"):
            np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-6)
    # a float leaf still needs one
    with pytest.raises(ValueError, match=r"the parameter leaf \['b'\] has no bound above it"):
        js.per_example_stat(loss, js.stats.clipped_sum({"w": 0.3}))(params, batch)
    # nested: a sub-dict holding only a skipped leaf, and a skipped leaf beside float ones
    nested = {"lin": {"w": params["w"], "b": params["b"], "n": jnp.int32(1)},
              "buf": {"idx": jnp.arange(3)}}

    def loss2(p, b):
        return loss({"w": p["lin"]["w"], "b": p["lin"]["b"]}, b)

    got = js.per_example_stat(loss2, js.stats.clipped_sum({"lin": {"w": 0.3, "b": 0.2}}))(
        nested, batch)
    g = per_example_grads({"w": params["w"], "b": params["b"]}, batch)  # (no step scale)
    want = oracle_clipped_sum(g, {"w": 0.3, "b": 0.2})
    assert got["lin"]["n"] is None and got["buf"]["idx"] is None
    for k in ("w", "b"):
        np.testing.assert_allclose(got["lin"][k], want[k], rtol=1e-5, atol=1e-6)


def test_dp_sensitivity_counts_only_bounds_of_differentiated_leaves():
    params, _ = make(step=True)
    bounds = jax.tree.map(lambda _: C, params)
    assert jso.dp_sensitivity(bounds) == pytest.approx(math.sqrt(3) * C)  # no tree given
    assert jso.dp_sensitivity(bounds, params) == pytest.approx(math.sqrt(2) * C)
    assert jso.dp_sensitivity({"w": C, "b": C}, params) == pytest.approx(math.sqrt(2) * C)
    assert jso.dp_sensitivity(C, params) == C


@pytest.mark.parametrize("bounds", ["per_leaf_recipe", "skipped_omitted"])
def test_skipped_leaf_bound_adds_no_noise(bounds):
    """The recipe ``jax.tree.map(lambda _: C, params)`` gives the integer leaf a bound: the
    noise is that of the two float leaves' bounds, z sqrt(2) C, not z sqrt(3) C."""
    params, batch = make(step=True)
    tree = jax.tree.map(lambda _: C, params) if bounds == "per_leaf_recipe" else {"w": C, "b": C}
    opt = jso.dp_sgd(1.0, clip_norm=tree, noise_multiplier=Z, batch_size=B)
    state = opt.init(params)
    stats = js.per_example_stat(loss, jso.stat_request(opt))(params, batch)
    want = oracle_clipped_sum(per_example_grads(params, batch), {"w": C, "b": C})
    for k in ("w", "b"):
        np.testing.assert_allclose(stats["clipped_sum"][k], want[k], rtol=1e-5, atol=1e-6)
    std = noise_std(opt, state, params, stats, -1.0 / B)
    assert std == pytest.approx(Z * math.sqrt(2) * C, rel=0.04)


# --------------------------------------------------------------------------- #
# Item 10: inject_hyperparams with a scheduled per-layer bound
# --------------------------------------------------------------------------- #
SCHED = optax.linear_schedule(0.8, 0.2, 3)


@pytest.mark.parametrize("z", [0.0, Z])
def test_inject_hyperparams_scheduled_per_layer_bound(z):
    params, batch = make()
    opt = jso.inject_hyperparams(jso.dp_sgd)(
        learning_rate=1.0, clip_norm={"w": SCHED, "b": 0.5}, noise_multiplier=z, batch_size=B)
    state = opt.init(params)
    with pytest.raises(ValueError, match=r"depend on its state"):
        jso.stat_request(opt)
    stale = jso.stat_request(opt, state)

    @jax.jit
    def stats_at(state, params):
        return js.per_example_stat(loss, jso.stat_request(opt, state))(params, batch)

    key = jax.random.key(0)
    for t in range(3):
        bounds = {"w": float(SCHED(t)), "b": 0.5}
        request = jso.stat_request(opt, state)
        used = request["clipped_sum"].clip_norm
        assert {k: float(v) for k, v in used.items()} == pytest.approx(bounds)
        stats = stats_at(state, params)
        want = oracle_clipped_sum(per_example_grads(params, batch), bounds)
        for k in ("w", "b"):
            np.testing.assert_allclose(stats["clipped_sum"][k], want[k], rtol=1e-5, atol=1e-6)
        if z:
            std = noise_std(opt, state, params, stats, -1.0 / B)
            assert std == pytest.approx(z * math.hypot(bounds["w"], bounds["b"]), rel=0.04)
        else:
            # (an injected noise multiplier is traced: a key is needed even for 0)
            u, _ = opt.update(stats["mean"], state, params, **jso.update_kwargs(stats, key=key))
            for k in ("w", "b"):
                np.testing.assert_allclose(u[k], -want[k] / B, rtol=1e-5, atol=1e-6)
        if t == 2:  # statistics clipped with the bounds of step 0: refused
            old = js.per_example_stat(loss, stale)(params, batch)
            with pytest.raises(ValueError, match=r"clip_norm=0.8 \(the bound at \['w'\]\)"):
                opt.update(old["mean"], state, params, **jso.update_kwargs(old, key=key))
        key, k = jax.random.split(key)
        u, state = jax.jit(lambda s, st, k: opt.update(st["mean"], s, params,
                                                       **jso.update_kwargs(st, key=k)))(
            state, stats, k)
        assert all(np.isfinite(x).all() for x in jax.tree.leaves(u))
