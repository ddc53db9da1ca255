"""Every js.optim optimizer through optax's wrappers, under jit.

Like optax's own list of optimizers in its tests: each (optimizer x wrapper)
pair either gives exactly the update of the equivalent unwrapped computation,
computed independently (the unwrapped optimizer on the whole tree, on the
masked sub-tree, on the accumulated batch; DP-SGD with a scheduled clip norm by
hand with a fixed key), or is refused with a clear error that names the
wrapper, why, and the js.optim alternative.

Statistics come from materialised per-example gradients (random, never zero),
reduced here by the definitions of api.md, read off the request the optimizer
asks for (so a frozen clip norm in the request shows); the update is jitted
together with ``stat_request(opt, state)``. The regression tests of issue 39
(items 2, 3, 7, 11) follow the list.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import inspect
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import zoo

import jaxpr_surgery as js
import jaxpr_surgery.optim as jso
from jaxpr_surgery._src import optim as _optim_pkg

B = 4
STEPS = 3
MASK = {"w": True, "b": False}
LABELS = {"w": "opt", "b": "sgd"}


# --------------------------------------------------------------------------- #
# Problem: per-example gradients drawn at random, and their statistics
# --------------------------------------------------------------------------- #
@functools.cache
def _params(dtype=np.float32):
    rng = np.random.default_rng(0)
    return {"w": rng.normal(size=(2, 3)).astype(dtype), "b": rng.normal(size=(3,)).astype(dtype)}


@functools.cache
def _per_example(step, dtype=np.float32, batch=B):
    """Per-example gradients of micro-batch ``step``: ``{"w": [B, 2, 3], "b": [B, 3]}``."""
    rng = np.random.default_rng(100 + step)
    return {
        "w": (0.4 * rng.normal(size=(batch, 2, 3)) + 0.1).astype(dtype),
        "b": (0.4 * rng.normal(size=(batch, 3)) - 0.05).astype(dtype),
    }


def _key(t):
    """The PRNG key of step ``t``."""
    return jax.random.fold_in(jax.random.key(7), t)


def _clipped_sum(per_ex, clip_norm):
    n = jax.tree.leaves(per_ex)[0].shape[0]
    sq = sum(jnp.sum(g.reshape(n, -1) ** 2, axis=1) for g in jax.tree.leaves(per_ex))
    scale = jnp.minimum(1.0, clip_norm / jnp.sqrt(sq))
    return jax.tree.map(lambda g: jnp.einsum("b,b...->...", scale.astype(g.dtype), g), per_ex)


def _kron(g):
    """``(1/B) sum_b U_j(g_b) U_j(g_b)^T`` for each axis ``j`` of one leaf."""
    out = []
    for j in range(1, g.ndim):
        u = jnp.moveaxis(g, j, 1).reshape(g.shape[0], g.shape[j], -1)
        out.append(jnp.einsum("bik,bjk->ij", u, u).astype(jnp.float32) / g.shape[0])
    return tuple(out)


def _oracle(per_ex, request):
    """The statistics of ``request`` from per-example gradients (api.md's definitions).

    Parameters of the statistics (the clip norm) are read from the request, as
    the engine does: a request built from a stale state shows in the result.
    """
    n = jax.tree.leaves(per_ex)[0].shape[0]
    out = {}
    for k, stat in request.items():
        if k == "mean":
            out[k] = jax.tree.map(lambda g: g.mean(0), per_ex)
        elif k == "second_moment":
            out[k] = jax.tree.map(lambda g: (g**2).mean(0), per_ex)
        elif k == "variance":
            out[k] = jax.tree.map(lambda g: g.var(0, ddof=1), per_ex)
        elif k == "sign_mean":
            out[k] = jax.tree.map(lambda g: jnp.sign(g).mean(0), per_ex)
        elif k == "clipped_sum":
            out[k] = _clipped_sum(per_ex, stat.clip_norm)
        elif k == "clip_norm":
            out[k] = jnp.asarray(stat.clip_norm)
        elif k == "max_weight":  # the largest example weight (unweighted: 1)
            out[k] = jnp.asarray(1.0)
        elif k == "batch_size":
            out[k] = jnp.asarray(n)
        elif k == "kron_moments":
            out[k] = jax.tree.map(_kron, per_ex)
        else:
            raise AssertionError(f"no oracle for {k!r}")
    return out


def _run(opt, seq, params):
    """Updates of ``opt`` over the per-example gradients ``seq`` (one per step), as numpy.

    ``init`` and the steps (``stat_request(opt, state)``, the statistics, ``update``
    with the PRNG key of step t) run in one jitted scan: one compile per run, and
    no eager op (each would compile too).
    """

    @jax.jit
    def run(params, stacked):
        def step(state, xs):
            t, per_ex = xs
            stats = _oracle(per_ex, jso.stat_request(opt, state))
            updates, state = opt.update(
                stats["mean"], state, params, **jso.update_kwargs(stats, key=_key(t))
            )
            return state, updates

        return jax.lax.scan(step, opt.init(params), (jnp.arange(len(seq)), stacked))

    stacked = jax.tree.map(lambda *xs: np.stack(xs), *seq)
    state, updates = run(params, stacked)
    updates = jax.tree.map(np.asarray, updates)
    return [jax.tree.map(lambda u, t=t: u[t], updates) for t in range(len(seq))], state


def _sub(tree, names=("w",)):
    return {k: tree[k] for k in names}


# --------------------------------------------------------------------------- #
# The optimizers
# --------------------------------------------------------------------------- #
def _sched(a, b):
    return optax.linear_schedule(a, b, STEPS)


@dataclasses.dataclass(frozen=True)
class Entry:
    factory: Callable
    kwargs: dict
    scheduled: dict = dataclasses.field(default_factory=dict)  # for inject_hyperparams

    def make(self, **override):
        return self.factory(**{**self.kwargs, **override})

    @property
    def mean_only(self):
        return set(jso.stat_request(self.make())) == {"mean"}

    @property
    def dp(self):
        return "clipped_sum" in jso.stat_request(self.make())


LR = {"learning_rate": 0.05}
LR_SCHED = {"learning_rate": _sched(0.05, 0.01)}
DP = {"clip_norm": 1.0, "noise_multiplier": 0.5}
DP_SCHED = {"learning_rate": _sched(0.1, 0.02), "clip_norm": _sched(1.0, 0.2)}

OPTIMIZERS = {
    "adam": Entry(jso.adam, LR, LR_SCHED),
    "micro_adam": Entry(jso.micro_adam, LR, LR_SCHED),
    "micro_adam_var": Entry(jso.micro_adam_var, LR, LR_SCHED),
    "micro_adam_msq": Entry(jso.micro_adam_msq, LR, LR_SCHED),
    "sign_sgd": Entry(jso.sign_sgd, LR, LR_SCHED),
    "ema_of_sign": Entry(jso.ema_of_sign, {**LR, "b1": 0.5}, LR_SCHED),
    "sign_ema": Entry(jso.sign_ema, {**LR, "b1": 0.5}, LR_SCHED),
    "per_example_sign_sgd": Entry(jso.per_example_sign_sgd, {**LR, "b1": 0.5}, LR_SCHED),
    "shampoo": Entry(jso.shampoo, {**LR, "b2": 0.5, "eps": 1e-3}, LR_SCHED),
    "shampoo_classic": Entry(
        jso.shampoo, {**LR, "b2": 0.5, "eps": 1e-3, "per_example": False}, LR_SCHED
    ),
    "dp_sgd": Entry(jso.dp_sgd, {**DP, "learning_rate": 0.1, "momentum": 0.5}, DP_SCHED),
    "dp_adam": Entry(jso.dp_adam, {**DP, **LR}, DP_SCHED),
    "track_gradient_statistics": Entry(jso.track_gradient_statistics, {"decay": 0.5}),
}


def test_every_optimizer_is_listed():
    """A new optimizer of js.optim must join the list (as in optax's tests)."""
    listed = {e.factory.__name__ for e in OPTIMIZERS.values()}
    public = {
        name for name in _optim_pkg.requests._REGISTRY if not name.startswith("scale_by")
    } - {"dp_aggregate"}  # the first part of dp_sgd / dp_adam, run there
    assert set(public) <= set(jso.__all__)
    assert public <= listed, public - listed


# --------------------------------------------------------------------------- #
# The wrappers, and what each pair must give
# --------------------------------------------------------------------------- #
def _scale_half(outs):
    return [jax.tree.map(lambda u: u * u.dtype.type(0.5), o) for o in outs]


def _expect_full_half(entry, seq, params):
    outs, _ = _run(entry.make(), seq, params)
    return _scale_half(outs)


def _expect_masked(entry, seq, params, rest):
    """The unwrapped optimizer on the masked leaves; ``rest`` gives the others."""
    outs, _ = _run(entry.make(), [_sub(s) for s in seq], _sub(params))
    return [
        {"w": o["w"], "b": rest(t, s)["b"]} for t, (o, s) in enumerate(zip(outs, seq, strict=True))
    ]


def _mean(per_ex):
    return jax.tree.map(lambda g: np.mean(g, axis=0, dtype=g.dtype), per_ex)


def _expect_multisteps(entry, seq, params):
    """Every second call, the unwrapped update on the two micro-batches together."""
    merged = [jax.tree.map(lambda a, b: np.concatenate([a, b]), seq[i], seq[i + 1])
              for i in range(0, len(seq), 2)]
    outs, _ = _run(entry.make(), merged, params)  # keys of steps 0, 1: unused (mean only)
    zeros = jax.tree.map(np.zeros_like, params)
    return [x for o in outs for x in (zeros, o)]


def _dp_by_hand(entry, seq, params, keys):
    """DP-SGD / DP-Adam with scheduled clip norm and learning rate, from the definition."""
    z = entry.kwargs["noise_multiplier"]
    lr, clip = entry.scheduled["learning_rate"], entry.scheduled["clip_norm"]
    private = []
    for t, (per_ex, key) in enumerate(zip(seq, keys, strict=True)):
        c = jnp.asarray(clip(t), jnp.float32)
        s = _clipped_sum(per_ex, c)
        ks = optax.tree.split_key_like(key, s)
        noise = jax.tree.map(
            lambda x, k, c=c: z * c * jax.random.normal(k, x.shape, x.dtype), s, ks
        )
        private.append(jax.tree.map(lambda a, e: (a + e) / B, s, noise))
    if entry.factory is jso.dp_adam:  # Adam's hyperparameters as injected: float32 arrays
        f32 = {k: jnp.asarray(v, jnp.float32) for k, v in dict(b1=0.9, b2=0.999, eps=1e-8).items()}
        adam = optax.adam(lr, **f32)
        state, outs = adam.init(params), []
        for g in private:
            u, state = adam.update(g, state, params)
            outs.append(u)
        return outs
    momentum, outs = jax.tree.map(jnp.zeros_like, params), []
    for t, g in enumerate(private):
        momentum = jax.tree.map(lambda m, x: x + entry.kwargs["momentum"] * m, momentum, g)
        outs.append(jax.tree.map(lambda m, t=t: -lr(t) * m, momentum))
    return outs


def _expect_scheduled(entry, seq, params):
    if entry.dp:
        return _dp_by_hand(entry, seq, params, [_key(t) for t in range(len(seq))])
    # inject_hyperparams holds numbers as arrays of the parameters' dtype: so does
    # the unwrapped optimizer here (Python floats round differently in float32,
    # e.g. 1 - 0.999 against 1 - float32(0.999), a relative 1e-5 in Adam's v).
    dtype = jax.tree.leaves(params)[0].dtype
    bound = inspect.signature(entry.factory).bind(**entry.kwargs)
    bound.apply_defaults()
    arrays = {
        k: jnp.asarray(v, dtype) for k, v in bound.arguments.items() if isinstance(v, float)
    }
    outs, _ = _run(entry.make(**{**arrays, **entry.scheduled}), seq, params)
    return outs


@dataclasses.dataclass(frozen=True)
class Wrapper:
    build: Callable[[Entry], object]
    expect: Callable  # (entry, seq, params) -> list of updates
    plain: bool = False  # optax's own wrapper: refused unless the optimizer needs only the mean
    refuse: Callable[[Entry], bool] = lambda e: False  # refused even as js.optim's version
    match: str = ""  # in the refusal message
    steps: int = STEPS


def _sgd_rest(t, per_ex):
    return jax.tree.map(lambda m: m * m.dtype.type(-0.1), _mean(per_ex))


def _expect_masked_mean(entry, seq, params):  # the other leaves pass through
    return _expect_masked(entry, seq, params, lambda t, s: _mean(s))


def _expect_partition(entry, seq, params):  # the other leaves: SGD
    return _expect_masked(entry, seq, params, _sgd_rest)


WRAPPERS = {
    "js.chain": Wrapper(lambda e: jso.chain(e.make(), optax.scale(0.5)), _expect_full_half),
    "optax.chain": Wrapper(
        lambda e: optax.chain(e.make(), optax.scale(0.5)),
        _expect_full_half,
        plain=True,
        match=r"optax.chain .*Use js.optim.chain",
    ),
    "js.named_chain": Wrapper(
        lambda e: jso.named_chain(("opt", e.make()), ("half", optax.scale(0.5))),
        _expect_full_half,
    ),
    "optax.named_chain": Wrapper(
        lambda e: optax.named_chain(("opt", e.make()), ("half", optax.scale(0.5))),
        _expect_full_half,
        plain=True,
        match=r"optax.named_chain .*Use js.optim.named_chain",
    ),
    "js.masked": Wrapper(
        lambda e: jso.masked(e.make(), MASK),
        _expect_masked_mean,
        refuse=lambda e: e.dp,
        match=r"masked: cannot mask a DP optimizer.*argnums",
    ),
    "optax.masked": Wrapper(
        lambda e: optax.masked(e.make(), MASK),
        _expect_masked_mean,
        plain=True,
        match=r"optax.masked .*Use js.optim.masked",
    ),
    "js.partition": Wrapper(
        lambda e: jso.partition({"opt": e.make(), "sgd": optax.sgd(0.1)}, LABELS),
        _expect_partition,
        refuse=lambda e: e.dp,
        match=r"partition \(label 'opt'\): cannot mask a DP optimizer",
    ),
    "optax.multi_transform": Wrapper(
        lambda e: optax.multi_transform({"opt": e.make(), "sgd": optax.sgd(0.1)}, LABELS),
        _expect_partition,
        plain=True,
        match=r"optax.partition / optax.multi_transform .*Use js.optim.partition",
    ),
    "js.inject_hyperparams": Wrapper(
        lambda e: jso.inject_hyperparams(e.factory)(**{**e.kwargs, **e.scheduled}),
        _expect_scheduled,
    ),
    "optax.inject_hyperparams": Wrapper(
        lambda e: optax.inject_hyperparams(e.factory)(**{**e.kwargs, **e.scheduled}),
        _expect_scheduled,
        plain=True,
        # shampoo: optax injects max_dim as an array, refused at init already
        match=r"(optax.inject_hyperparams|max_dim).*js.optim.inject_hyperparams",
    ),
    "optax.MultiSteps": Wrapper(
        lambda e: optax.MultiSteps(e.make(), 2).gradient_transformation(),
        _expect_multisteps,
        plain=True,
        match=r"optax.MultiSteps .*last micro-batch.*chunk_size",
        steps=4,
    ),
}


def _refused_plain(entry, wrapper_name):
    if wrapper_name == "optax.inject_hyperparams":
        # Looked up by the factory's name: shampoo may need kron_moments.
        return set(jso.stat_request(entry.factory.__name__, clip_norm=1.0)) != {"mean"}
    return not entry.mean_only


def _assert_updates_equal(got, want, rtol=2e-6, atol=1e-7):
    assert len(got) == len(want)
    for t, (g, w) in enumerate(zip(got, want, strict=True)):
        assert jax.tree.structure(g) == jax.tree.structure(w), t
        for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(w), strict=True):
            assert a.dtype == b.dtype, (t, a.dtype, b.dtype)
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=rtol, atol=atol,
                                       err_msg=f"step {t}")


_EXPECTED: dict = {}


def _expected(opt_name, wrapper_name, dtype, seq, params):
    """The wrapper's expectation; wrappers of one kind share it (fewer compiles)."""
    wrapper = WRAPPERS[wrapper_name]
    key = (opt_name, wrapper.expect, np.dtype(dtype).name, len(seq))
    if key not in _EXPECTED:
        _EXPECTED[key] = wrapper.expect(OPTIMIZERS[opt_name], seq, params)
    return _EXPECTED[key]


def _check_pair(opt_name, wrapper_name, dtype=np.float32):
    entry, wrapper = OPTIMIZERS[opt_name], WRAPPERS[wrapper_name]
    params = _params(dtype)
    seq = [_per_example(t, dtype) for t in range(wrapper.steps)]
    refused = _refused_plain(entry, wrapper_name) if wrapper.plain else wrapper.refuse(entry)
    if refused:
        error = (ValueError, TypeError) if wrapper.plain else NotImplementedError
        with pytest.raises(error, match=wrapper.match):
            _run(wrapper.build(entry), seq, params)  # raises at build or in stat_request
        return
    got, _ = _run(wrapper.build(entry), seq, params)
    want = _expected(opt_name, wrapper_name, dtype, seq, params)
    _assert_updates_equal(got, want, **({} if dtype == np.float32 else {"rtol": 1e-12}))


# ~150 small compiles (~25 s on 2 cores): in the full suite, out of the quick subset
# (-m "not slow"), which keeps the float64 pairs and the regression tests below.
@pytest.mark.slow
@pytest.mark.parametrize("wrapper_name", sorted(WRAPPERS))
@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
def test_conformance(opt_name, wrapper_name):
    _check_pair(opt_name, wrapper_name)


@pytest.mark.parametrize(
    "opt_name,wrapper_name",
    [
        ("micro_adam_msq", "js.masked"),
        ("shampoo", "js.partition"),
        ("dp_sgd", "js.inject_hyperparams"),
        ("dp_adam", "js.chain"),
    ],
)
def test_conformance_float64(opt_name, wrapper_name):
    with zoo.x64():
        _check_pair(opt_name, wrapper_name, np.float64)


def test_track_gradient_statistics_state_under_masked():
    """The monitor in a mask sees the statistics of its own leaves only."""
    entry = OPTIMIZERS["track_gradient_statistics"]
    params, seq = _params(), [_per_example(t) for t in range(STEPS)]
    _, state = _run(jso.masked(entry.make(), MASK), seq, params)
    _, want = _run(entry.make(), [_sub(s) for s in seq], _sub(params))
    np.testing.assert_allclose(float(state.inner_state.noise_scale), float(want.noise_scale),
                               rtol=1e-6)
    np.testing.assert_allclose(state.inner_state.snr["w"], want.snr["w"], rtol=1e-6)
    assert isinstance(state.inner_state.snr["b"], optax.MaskedNode)


def test_multi_transform_is_partition():
    entry = OPTIMIZERS["micro_adam"]
    params, seq = _params(), [_per_example(t) for t in range(STEPS)]
    a, _ = _run(jso.multi_transform({"opt": entry.make(), "sgd": optax.sgd(0.1)}, LABELS), seq,
                params)
    b, _ = _run(jso.partition({"opt": entry.make(), "sgd": optax.sgd(0.1)}, LABELS), seq, params)
    _assert_updates_equal(a, b, rtol=0, atol=0)


# --------------------------------------------------------------------------- #
# Issue 39, item 2: a scheduled clip norm clips at the value of the step
# --------------------------------------------------------------------------- #
def _linear_loss(w, b):
    return jnp.mean(b @ w)


LINEAR_BATCH = jnp.array([[1.0, 1.0], [1.0, 1.0]])  # per-example gradients [1, 1], norm sqrt 2


def test_scheduled_clip_norm_clips_at_the_current_value():
    """Through the engine: at step t the update is DP-SGD at C_t (noise 0 to read it)."""
    sched = optax.linear_schedule(1.0, 0.01, 10)
    opt = jso.inject_hyperparams(jso.dp_sgd)(
        learning_rate=1.0, clip_norm=sched, noise_multiplier=0.0
    )
    w = jnp.zeros(2)
    with pytest.raises(ValueError, match=r"depend on its state.*stat_request\(opt, state\)"):
        jso.stat_request(opt)  # the step-0 request would freeze C_0
    with pytest.raises(ValueError, match=r"stat_request\(opt, state\)"):
        opt.stat_request  # noqa: B018 - the attribute refuses too

    @jax.jit
    def step(state):
        stats = js.per_example_stat(_linear_loss, jso.stat_request(opt, state))(w, LINEAR_BATCH)
        return opt.update(
            stats["mean"], state, w, **jso.update_kwargs(stats, key=jax.random.key(0))
        )

    state = opt.init(w)
    for t in range(11):
        u, state = step(state)
        c = float(sched(t))
        np.testing.assert_allclose(u, -min(1.0, c / math.sqrt(2)) * np.ones(2), rtol=1e-6)
    np.testing.assert_allclose(u, [-0.01 / math.sqrt(2)] * 2, rtol=1e-6)  # not C_0's 0.707


def test_stale_request_is_refused_not_silent():
    """A request built once from the initial state: eagerly an error, under jit NaN."""
    sched = optax.linear_schedule(1.0, 0.1, 4)
    opt = jso.inject_hyperparams(jso.dp_sgd)(
        learning_rate=1.0, clip_norm=sched, noise_multiplier=1.0
    )
    w = jnp.zeros(2)
    state = opt.init(w)
    stale = jso.stat_request(opt, state)
    stats = js.per_example_stat(_linear_loss, stale)(w, LINEAR_BATCH)
    kw = jso.update_kwargs(stats, key=jax.random.key(0))
    _, state1 = opt.update(stats["mean"], state, w, **kw)  # step 0: the same clip norm
    with pytest.raises(ValueError, match=r"clipped at clip_norm=1, but .* 0.775"):
        opt.update(stats["mean"], state1, w, **kw)
    u, _ = jax.jit(lambda s: opt.update(stats["mean"], s, w, **kw))(state1)
    assert np.isnan(np.asarray(u)).all()
    # statistics computed without the clip norm they used: refused for an injected one
    with pytest.raises(ValueError, match=r"`clip_norm`"):
        opt.update(stats["mean"], state1, w, **{k: v for k, v in kw.items() if k != "clip_norm"})


def test_clip_norm_of_statistics_must_match_a_fixed_clip_norm():
    opt = jso.dp_sgd(0.1, clip_norm=1.0, noise_multiplier=1.0)
    w = jnp.zeros(2)
    stats = js.per_example_stat(_linear_loss, jso.stat_request("dp_sgd", clip_norm=2.0))(
        w, LINEAR_BATCH
    )
    with pytest.raises(ValueError, match="noise would not match the clipping"):
        opt.update(stats["mean"], opt.init(w), w, **jso.update_kwargs(stats, key=jax.random.key(0)))
    # hand-built statistics without the clip norm stay accepted for a fixed one
    u, _ = opt.update(stats["mean"], opt.init(w), w, clipped_sum=stats["clipped_sum"],
                      batch_size=2, key=jax.random.key(0))
    assert u.shape == (2,)


def test_state_dependent_request_through_js_wrappers():
    sched = optax.linear_schedule(1.0, 0.5, 2)
    inj = jso.inject_hyperparams(jso.dp_sgd)(learning_rate=0.1, clip_norm=sched,
                                             noise_multiplier=1.0)
    params, seq = _params(), [_per_example(t) for t in range(3)]
    for opt, inner in (
        (jso.chain(jso.track_gradient_statistics(), inj), lambda s: s[1]),
        (jso.named_chain(("track", jso.track_gradient_statistics()), ("dp", inj)),
         lambda s: s["dp"]),
    ):
        with pytest.raises(ValueError, match=r"stat_request\(opt, state\)"):
            jso.stat_request(opt)
        for other in (copy.copy(opt), copy.deepcopy(opt)):
            assert other.request_fn is not None
        _, state = _run(opt, seq, params)
        request = jso.stat_request(opt, state)
        assert {"variance", "clipped_sum", "clip_norm"} <= set(request)
        assert float(request["clipped_sum"].clip_norm) == pytest.approx(0.5)  # sched(3)
        # a hyperparameter changed by hand in the state is followed too
        inner(state).hyperparams["clip_norm"] = jnp.asarray(0.25)
        hps = inner(state).hyperparams_states
        hps["clip_norm"] = hps["clip_norm"]._replace(count=jnp.asarray(0))
        assert float(jso.stat_request(opt, state)["clip_norm"].clip_norm) == pytest.approx(1.0)
    with pytest.raises(TypeError, match="InjectStatefulHyperparamsState"):
        jso.stat_request(inj, opt.init(params))
    with pytest.raises(NotImplementedError, match="cannot mask a DP optimizer"):
        jso.masked(inj, MASK)


def test_injected_fixed_clip_norm_can_be_changed_in_the_state():
    opt = jso.inject_hyperparams(jso.dp_sgd)(learning_rate=0.1, clip_norm=1.0,
                                             noise_multiplier=1.0)
    state = opt.init(jnp.zeros(2))
    state.hyperparams["clip_norm"] = jnp.asarray(0.3)
    assert float(jso.stat_request(opt, state)["clipped_sum"].clip_norm) == pytest.approx(0.3)


# --------------------------------------------------------------------------- #
# Issue 39, item 3: optax.MultiSteps
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("make", [lambda: jso.dp_sgd(1.0, 1.0, 0.0), lambda: jso.micro_adam(0.1)])
def test_multisteps_is_refused(make):
    ms = optax.MultiSteps(make(), 2)
    for request in (
        lambda: jso.stat_request(ms),
        lambda: jso.stat_request(ms.gradient_transformation()),
        lambda: jso.chain(ms.gradient_transformation()),
    ):
        with pytest.raises(ValueError, match=r"optax.MultiSteps .*last micro-batch.*chunk_size"):
            request()
    assert set(jso.stat_request(optax.MultiSteps(jso.adam(0.1), 2))) == {"mean"}


# --------------------------------------------------------------------------- #
# Issue 39, item 7: optax.masked / optax.multi_transform
# --------------------------------------------------------------------------- #
def test_optax_masking_wrappers_are_refused_clearly():
    params = {"w": jnp.ones(2), "b": jnp.ones(3)}
    g = jax.tree.map(lambda x: 0.5 * x, params)
    stats = {"mean": g, "second_moment": jax.tree.map(jnp.square, g)}
    for tx, alt in (
        (optax.masked(jso.micro_adam(0.1), MASK), "js.optim.masked"),
        (optax.multi_transform({"opt": jso.micro_adam(0.1), "sgd": optax.sgd(0.1)}, LABELS),
         "js.optim.partition"),
    ):
        with pytest.raises(ValueError, match=f"does not carry the request.*Use {alt}"):
            jso.stat_request(tx)
        with pytest.raises(ValueError, match=f"Use {alt}"):
            jso.chain(tx, optax.scale(1.0))
        # the update itself: a clear error, not optax's TypeError
        with pytest.raises(ValueError, match=r"`second_moment` is not: use js.optim.masked"):
            tx.update(g, tx.init(params), params, **jso.update_kwargs(stats))


def test_dp_inside_optax_masked_is_refused_at_update():
    tx = optax.masked(jso.dp_sgd(0.1, 1.0, 1.0), MASK, mask_compatible_extra_args=True)
    params = {"w": jnp.ones(2), "b": jnp.ones(3)}
    with pytest.raises(NotImplementedError, match="dp_aggregate inside optax.masked.*argnums"):
        tx.update(params, tx.init(params), params, clipped_sum=params, batch_size=2, clip_norm=1.0,
                  key=jax.random.key(0))


def test_masked_mask_forms_and_errors():
    entry = OPTIMIZERS["micro_adam_msq"]
    params, seq = _params(), [_per_example(t) for t in range(STEPS)]
    a, _ = _run(jso.masked(entry.make(), MASK), seq, params)
    b, _ = _run(jso.masked(entry.make(), lambda p: {"w": True, "b": False}), seq, params)
    _assert_updates_equal(a, b, rtol=0, atol=0)
    opt = jso.masked(entry.make(), MASK)
    g = {"w": jnp.ones((2, 3))}  # statistics of other parameters than the updates
    with pytest.raises(ValueError, match="not a prefix of the extra argument `variance`"):
        opt.update(_params(), opt.init(_params()), variance=g, batch_size=4)
    bad = jso.partition({"opt": entry.make()}, LABELS)
    with pytest.raises(ValueError, match=r"labelled 'sgd' have no transformation"):
        bad.init(params)


def test_plain_optax_transformations_are_not_refused():
    sched = jso.sqrt_batch_size_scaling(optax.constant_schedule(1.0), 4, 8)
    for tx in (
        optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3)),
        optax.chain(optax.scale_by_learning_rate(sched)),
        optax.inject_hyperparams(optax.adam)(learning_rate=1e-3),
        optax.masked(optax.add_decayed_weights(1e-4), MASK),
        optax.MultiSteps(optax.sgd(0.1), 2),
        optax.chain(jso.adam(1e-3), jso.sign_ema(1e-3)),  # js.optim, mean only
    ):
        assert set(jso.stat_request(tx)) == {"mean"}
    own = optax.masked(jso.micro_adam(0.1), MASK, mask_compatible_extra_args=True)
    mine = jso.PerExampleTransformation(own.init, own.update, jso.stat_request("micro_adam"))
    assert set(jso.stat_request(mine)) == {"mean", "second_moment"}


# --------------------------------------------------------------------------- #
# Issue 39, item 11: inject_hyperparams(shampoo)
# --------------------------------------------------------------------------- #
def test_inject_hyperparams_shampoo():
    opt = jso.inject_hyperparams(jso.shampoo)(learning_rate=_sched(0.1, 0.01), eps=1e-3)
    params = {"w": jnp.ones((2, 3))}
    state = opt.init(params)
    assert state.hyperparams["eps"].dtype == jnp.float32  # injected as an array
    assert "max_dim" not in state.hyperparams  # static: it fixes the state's shapes
    assert set(jso.stat_request(opt)) == {"mean", "kron_moments"}
    with pytest.raises(TypeError, match="max_dim.*js.optim.inject_hyperparams"):
        optax.inject_hyperparams(jso.shampoo)(learning_rate=0.1).init(params)
