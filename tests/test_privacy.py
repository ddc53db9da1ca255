"""``jaxpr_surgery.privacy``: accounting, calibration, Poisson batches, ``clipped_grad``.

* ``epsilon`` equals ``dp_accounting``'s PLD / RDP accountant composed by hand, for
  several (z, q, steps) (and the truncated-Poisson event); ``calibrate_noise_multiplier``
  is tight both ways (its z meets the target, z / (1 + rtol) does not); a missing
  ``dp_accounting`` raises an ImportError naming the extra ``dp``.
* ``poisson_batches``: inclusion frequencies within binomial bounds, independence of
  examples and of steps, no example twice in a batch, padding slots marked and holding 0,
  reproducible from the key, the same under jit; the size rule and truncation.
* ``clipped_grad`` (jax-privacy's entry point): the same numbers as the main API
  (``per_example_stat`` with ``clipped_sum``) and as ``vmap(grad)`` clipped by hand, for
  every argument it takes; and as jax-privacy itself where it is installed.
"""

from __future__ import annotations

import doctest
import importlib
import io
import math
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import zoo

import jaxpr_surgery as js
from jaxpr_surgery._src.privacy import sampling

DELTA = 1e-5


def _dpa():
    return pytest.importorskip("dp_accounting")


# --------------------------------------------------------------------------- #
# Accounting
# --------------------------------------------------------------------------- #
def _by_hand(dpa, z, q, steps, accountant):
    acc = dpa.pld.PLDAccountant() if accountant == "pld" else dpa.rdp.RdpAccountant()
    event = dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(z))
    acc.compose(dpa.SelfComposedDpEvent(event, steps))
    return acc.get_epsilon(target_delta=DELTA)


@pytest.mark.parametrize("accountant", ["pld", "rdp"])
@pytest.mark.parametrize("z,q,steps", [(1.1, 256 / 60_000, 1_000), (0.8, 0.01, 300),
                                       (2.0, 0.05, 100), (4.0, 1.0, 10)])
def test_epsilon_equals_dp_accounting(accountant, z, q, steps):
    dpa = _dpa()
    got = js.privacy.epsilon(noise_multiplier=z, sampling_probability=q, steps=steps,
                             delta=DELTA, accountant=accountant)
    want = _by_hand(dpa, z, q, steps, accountant)
    assert isinstance(got, float)
    assert got == pytest.approx(want, rel=1e-12)
    assert 0 < got < math.inf


def test_epsilon_grows_with_steps_and_pld_below_rdp():
    _dpa()
    kw = dict(noise_multiplier=1.0, sampling_probability=0.01, delta=DELTA)
    e = [js.privacy.epsilon(steps=s, **kw) for s in (10, 100, 1000)]
    assert e[0] < e[1] < e[2]
    assert e[2] < js.privacy.epsilon(steps=1000, accountant="rdp", **kw)


def test_epsilon_edge_values():
    _dpa()
    kw = dict(sampling_probability=0.01, delta=DELTA)
    assert js.privacy.epsilon(noise_multiplier=1.0, steps=0, **kw) == 0.0
    assert js.privacy.epsilon(noise_multiplier=0.0, steps=5, **kw) == math.inf
    assert js.privacy.epsilon(noise_multiplier=1.0, steps=5, sampling_probability=0.0,
                              delta=DELTA) == 0.0


@pytest.mark.parametrize("accountant,truncated", [("pld", False), ("rdp", False),
                                                  ("pld", True)])
def test_epsilon_infinite_and_huge_noise(accountant, truncated):
    """Infinite noise spends nothing: epsilon 0 (the PLD accountant used to crash inside
    dp_accounting, "cannot convert float NaN to integer"). Above 1e100, where
    dp_accounting's arithmetic overflows, a closed-form bound on the total variation
    distance certifies epsilon 0, continuing the library's own 0 below it; where delta
    is too small for the bound, a ValueError names the argument."""
    _dpa()
    kw = dict(sampling_probability=0.01, steps=10, delta=DELTA, accountant=accountant)
    if truncated:
        kw.update(truncated_batch_size=5, num_examples=1_000)
    for z in (math.inf, np.float32(np.inf), jnp.asarray(jnp.inf), 1e300, 1e101, 1e100):
        got = js.privacy.epsilon(noise_multiplier=z, **kw)
        assert isinstance(got, float) and got == 0.0, (z, got)
    with pytest.raises(ValueError, match=r"epsilon\(noise_multiplier=1e\+101\).*delta"):
        js.privacy.epsilon(noise_multiplier=1e101, **{**kw, "delta": 1e-300})
    for bad in (-math.inf, math.nan, -1e300):
        with pytest.raises(ValueError, match=r"epsilon\(noise_multiplier="):
            js.privacy.epsilon(noise_multiplier=bad, **kw)


def test_epsilon_of_and_calibration_edge_noise():
    """epsilon_of takes the same noise multipliers as epsilon and names the config entry
    in its errors; calibrate_noise_multiplier refuses an infinite target with a message
    that says what it means (every noise multiplier meets it)."""
    _dpa()
    kw = dict(steps=10, num_examples=1_000, delta=DELTA)
    assert js.privacy.epsilon_of(dict(noise_multiplier=math.inf, batch_size=10), **kw) == 0.0
    assert js.privacy.epsilon_of(dict(noise_multiplier=0.0, batch_size=10), **kw) == math.inf
    for bad, exc in ((math.nan, ValueError), (-1.0, ValueError), ("1.0", TypeError)):
        with pytest.raises(exc, match=r"epsilon_of\(config\['noise_multiplier'\]"):
            js.privacy.epsilon_of(dict(noise_multiplier=bad, batch_size=10), **kw)
    cal = dict(delta=DELTA, sampling_probability=0.01, steps=10)
    with pytest.raises(ValueError, match=r"target_epsilon=inf.*every noise multiplier"):
        js.privacy.calibrate_noise_multiplier(target_epsilon=math.inf, **cal)
    for bad in (0.0, -math.inf, math.nan):
        with pytest.raises(ValueError, match="target_epsilon"):
            js.privacy.calibrate_noise_multiplier(target_epsilon=bad, **cal)


@pytest.mark.parametrize("kw,match", [
    (dict(noise_multiplier=-1.0), "noise_multiplier"),
    (dict(noise_multiplier=float("nan")), "noise_multiplier"),
    (dict(sampling_probability=1.5), "sampling_probability"),
    (dict(steps=-1), "steps"),
    (dict(steps=2.5), "steps"),
    (dict(delta=0.0), "delta"),
    (dict(delta=1.0), "delta"),
    (dict(accountant="moments"), "accountant"),
    (dict(truncated_batch_size=10), "num_examples"),
    (dict(truncated_batch_size=10, num_examples=100, accountant="rdp"), "PLD"),
])
def test_epsilon_bad_arguments(kw, match):
    args = dict(noise_multiplier=1.0, sampling_probability=0.01, steps=10, delta=DELTA)
    args.update(kw)
    with pytest.raises((ValueError, TypeError), match=match):
        js.privacy.epsilon(**args)


def test_truncated_epsilon_equals_dp_accounting():
    dpa = _dpa()
    n, q, k, z, steps = 2_000, 0.02, 50, 1.2, 20
    got = js.privacy.epsilon(noise_multiplier=z, sampling_probability=q, steps=steps,
                             delta=DELTA, truncated_batch_size=k, num_examples=n)
    acc = dpa.pld.PLDAccountant()
    acc.compose(dpa.SelfComposedDpEvent(dpa.TruncatedSubsampledGaussianDpEvent(
        dataset_size=n, sampling_probability=q, truncated_batch_size=k, noise_multiplier=z),
        steps))
    assert got == pytest.approx(acc.get_epsilon(target_delta=DELTA), rel=1e-12)


@pytest.mark.parametrize("target,q,steps,accountant", [
    (3.0, 0.01, 300, "rdp"), (1.0, 256 / 60_000, 2_000, "rdp"), (8.0, 0.05, 100, "rdp"),
    (0.5, 0.001, 5_000, "rdp"), (2.0, 0.02, 50, "pld"),
])
def test_calibration_is_tight_both_ways(target, q, steps, accountant):
    _dpa()
    kw = dict(sampling_probability=q, steps=steps, delta=DELTA, accountant=accountant)
    z = js.privacy.calibrate_noise_multiplier(target_epsilon=target, **kw)
    assert js.privacy.epsilon(noise_multiplier=z, **kw) <= target
    assert js.privacy.epsilon(noise_multiplier=z / 1.01, **kw) > target
    if accountant == "pld":
        return  # (the tighter tolerance below: with the fast accountant only)
    tighter = js.privacy.calibrate_noise_multiplier(target_epsilon=target, rtol=0.001, **kw)
    assert tighter <= z * 1.001  # (both within their tolerance of the smallest z)
    assert js.privacy.epsilon(noise_multiplier=tighter, **kw) <= target
    assert js.privacy.epsilon(noise_multiplier=tighter / 1.001, **kw) > target


def test_calibration_pld_needs_less_noise_than_rdp():
    _dpa()
    kw = dict(target_epsilon=2.0, sampling_probability=0.02, steps=50, delta=DELTA)
    z_pld = js.privacy.calibrate_noise_multiplier(**kw)
    z_rdp = js.privacy.calibrate_noise_multiplier(accountant="rdp", **kw)
    assert z_pld < z_rdp


def test_calibration_impossible_target():
    _dpa()
    kw = dict(delta=DELTA, sampling_probability=1.0, steps=10_000, accountant="rdp")
    with pytest.raises(ValueError, match="no noise multiplier up to"):
        js.privacy.calibrate_noise_multiplier(target_epsilon=1e-4, **kw)
    for bad in (0.0, -1.0, math.inf):
        with pytest.raises(ValueError, match="target_epsilon"):
            js.privacy.calibrate_noise_multiplier(target_epsilon=bad, **kw)
    assert js.privacy.calibrate_noise_multiplier(
        target_epsilon=1.0, delta=DELTA, sampling_probability=0.1, steps=0) == 0.0


def test_epsilon_of_an_optimizer_configuration():
    _dpa()
    config = dict(learning_rate=0.1, clip_norm=1.0, noise_multiplier=1.1, batch_size=256,
                  momentum=0.9)
    js.optim.dp_sgd(**config)  # a valid configuration
    got = js.privacy.epsilon_of(config, steps=500, num_examples=60_000, delta=DELTA)
    assert got == js.privacy.epsilon(noise_multiplier=1.1, sampling_probability=256 / 60_000,
                                     steps=500, delta=DELTA)
    adam = dict(learning_rate=1e-3, clip_norm=1.0, noise_multiplier=1.1, batch_size=256,
                b1=0.9, max_example_weight=2.0)
    js.optim.dp_adam(**adam)
    assert js.privacy.epsilon_of(adam, steps=500, num_examples=60_000, delta=DELTA) == got
    with pytest.raises(ValueError, match="batch_size"):
        js.privacy.epsilon_of(dict(noise_multiplier=1.1), steps=5, num_examples=100,
                              delta=DELTA)
    with pytest.raises(ValueError, match="learnig_rate"):
        js.privacy.epsilon_of(dict(noise_multiplier=1.1, batch_size=8, learnig_rate=0.1),
                              steps=5, num_examples=100, delta=DELTA)
    with pytest.raises(ValueError, match="larger than num_examples"):
        js.privacy.epsilon_of(dict(noise_multiplier=1.1, batch_size=800), steps=5,
                              num_examples=100, delta=DELTA)
    with pytest.raises(TypeError, match="dict"):
        js.privacy.epsilon_of(js.optim.dp_sgd(**config), steps=5, num_examples=100,
                              delta=DELTA)


def test_missing_dp_accounting_names_the_extra(monkeypatch):
    """Runs without dp_accounting too: its absence is simulated."""
    monkeypatch.setitem(sys.modules, "dp_accounting", None)  # import raises ImportError
    for call in (
        lambda: js.privacy.epsilon(noise_multiplier=1.0, sampling_probability=0.01, steps=10,
                                   delta=DELTA),
        lambda: js.privacy.calibrate_noise_multiplier(
            target_epsilon=1.0, sampling_probability=0.01, steps=10, delta=DELTA),
        lambda: js.privacy.epsilon_of(dict(noise_multiplier=1.0, batch_size=8), steps=10,
                                      num_examples=100, delta=DELTA),
    ):
        with pytest.raises(ImportError, match=r"jaxpr_surgery\[dp\]") as info:
            call()
        assert "dp-accounting" in str(info.value)


# --------------------------------------------------------------------------- #
# Poisson batches
# --------------------------------------------------------------------------- #
def _real_rows(idx, pad):
    idx, pad = np.asarray(idx), np.asarray(pad)
    return [row[~p] for row, p in zip(idx, pad)]


def _binomial_ok(count, n, p, z=5.0):
    sd = math.sqrt(n * p * (1 - p))
    return abs(count - n * p) <= z * sd + 1


def test_poisson_batch_structure():
    n, q, steps = 200, 0.1, 300
    k = js.privacy.min_max_batch_size(num_examples=n, sampling_probability=q, steps=steps)
    idx, pad = js.privacy.poisson_batches(jax.random.key(0), num_examples=n,
                                          sampling_probability=q, max_batch_size=k,
                                          steps=steps)
    assert idx.shape == pad.shape == (steps, k)
    assert idx.dtype == jnp.int32 and pad.dtype == jnp.bool_
    idx, pad = np.asarray(idx), np.asarray(pad)
    assert (idx[pad] == 0).all()  # padding slots hold a valid index
    assert ((idx >= 0) & (idx < n)).all()
    for row, p in zip(idx, pad):
        real = row[~p]
        assert len(set(real.tolist())) == len(real)  # no example twice
        assert not p[: len(real)].any() and p[len(real):].all()  # real slots first
    # the order within a batch is random, not by index
    assert any((np.diff(r) < 0).any() for r in _real_rows(idx, pad))


def test_poisson_frequencies_within_binomial_bounds():
    n, q, steps = 40, 0.25, 3_000
    idx, pad = js.privacy.poisson_batches(jax.random.key(1), num_examples=n,
                                          sampling_probability=q, max_batch_size=n,
                                          steps=steps)
    member = np.zeros((steps, n), bool)
    for t, real in enumerate(_real_rows(idx, pad)):
        member[t, real] = True
    # every example in about q of the batches
    for i in range(n):
        assert _binomial_ok(member[:, i].sum(), steps, q), (i, member[:, i].sum())
    # batch sizes: Binomial(n, q) (mean and variance)
    sizes = member.sum(1)
    assert abs(sizes.mean() - n * q) <= 5 * math.sqrt(n * q * (1 - q) / steps)
    assert 0.8 < sizes.var() / (n * q * (1 - q)) < 1.2
    # independence: of two examples within a step, and of one example across steps
    for i, j in [(0, 1), (5, 33), (17, 18)]:
        assert _binomial_ok((member[:, i] & member[:, j]).sum(), steps, q * q)
    assert _binomial_ok((member[1:, 3] & member[:-1, 3]).sum(), steps - 1, q * q)


def test_poisson_small_probability_is_not_rounded_up():
    """q far below float32's resolution of 1: a 64-bit comparison keeps P(include) = q
    (a float32 uniform < q would include with probability about 2^-23, 80x too often)."""
    n, q, steps = 100_000, 1e-7, 20
    idx, pad = js.privacy.poisson_batches(jax.random.key(2), num_examples=n,
                                          sampling_probability=q, max_batch_size=8,
                                          steps=steps)
    total = int((~np.asarray(pad)).sum())
    assert total <= 5  # expected n q steps = 0.2


def test_poisson_reproducible_and_jittable():
    kw = dict(num_examples=500, sampling_probability=0.05, max_batch_size=70, steps=7)
    a = js.privacy.poisson_batches(jax.random.key(3), **kw)
    b = js.privacy.poisson_batches(jax.random.key(3), **kw)
    c = js.privacy.poisson_batches(jax.random.key(4), **kw)
    jitted = jax.jit(lambda key: js.privacy.poisson_batches(key, **kw))(jax.random.key(3))
    raw = js.privacy.poisson_batches(jax.random.PRNGKey(3), **kw)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)
    for x, y in zip(a, jitted):
        np.testing.assert_array_equal(x, y)
    assert not np.array_equal(a[0], c[0])
    assert raw[0].shape == a[0].shape


def test_poisson_size_rule():
    n, q, steps = 1_000, 0.02, 100
    need = js.privacy.min_max_batch_size(num_examples=n, sampling_probability=q, steps=steps)
    # the rule: overflow probability over the run at most OVERFLOW_PROBABILITY
    assert sampling._overflow_probability(n, q, need, steps) <= js.privacy.OVERFLOW_PROBABILITY
    assert sampling._overflow_probability(n, q, need - 1, steps) > js.privacy.OVERFLOW_PROBABILITY
    sd = math.sqrt(n * q * (1 - q))
    assert n * q + 4 * sd < need < n * q + 10 * sd
    kw = dict(num_examples=n, sampling_probability=q, steps=steps)
    js.privacy.poisson_batches(jax.random.key(0), max_batch_size=need, **kw)
    with pytest.raises(ValueError, match=rf"max_batch_size=.* >= {need} .*truncate=True"):
        js.privacy.poisson_batches(jax.random.key(0), max_batch_size=need - 1, **kw)
    # at least n slots can never overflow
    js.privacy.poisson_batches(jax.random.key(0), max_batch_size=n, num_examples=n,
                               sampling_probability=0.9, steps=steps)


def test_poisson_truncation_is_reported_and_uniform():
    n, k, steps = 12, 3, 4_000
    idx, pad, dropped = js.privacy.poisson_batches(
        jax.random.key(5), num_examples=n, sampling_probability=1.0, max_batch_size=k,
        steps=steps, truncate=True)
    assert dropped.shape == (steps,) and dropped.dtype == jnp.int32
    np.testing.assert_array_equal(dropped, n - k)
    assert not np.asarray(pad).any()
    counts = np.bincount(np.asarray(idx).ravel(), minlength=n)
    for c in counts:  # a uniformly random subset of k of the n
        assert _binomial_ok(c, steps, k / n), counts
    # q < 1: dropped = max(0, included - k)
    idx, pad, dropped = js.privacy.poisson_batches(
        jax.random.key(6), num_examples=50, sampling_probability=0.3, max_batch_size=10,
        steps=200, truncate=True)
    real = (~np.asarray(pad)).sum(1)
    assert (real <= 10).all() and ((np.asarray(dropped) > 0) <= (real == 10)).all()
    assert np.asarray(dropped).sum() > 0


def test_poisson_more_slots_than_examples():
    idx, pad = js.privacy.poisson_batches(jax.random.key(7), num_examples=5,
                                          sampling_probability=1.0, max_batch_size=8, steps=2)
    np.testing.assert_array_equal(np.asarray(pad).sum(1), [3, 3])
    assert sorted(_real_rows(idx, pad)[0].tolist()) == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("kw,exc,match", [
    (dict(num_examples=0), ValueError, "num_examples"),
    (dict(num_examples=10.0), TypeError, "num_examples"),
    (dict(sampling_probability=-0.1), ValueError, "sampling_probability"),
    (dict(max_batch_size=0), ValueError, "max_batch_size"),
    (dict(steps=0), ValueError, "steps"),
    (dict(truncate=1), TypeError, "truncate"),
])
def test_poisson_bad_arguments(kw, exc, match):
    args = dict(num_examples=10, sampling_probability=0.5, max_batch_size=10, steps=3)
    args.update(kw)
    with pytest.raises(exc, match=match):
        js.privacy.poisson_batches(jax.random.key(0), **args)


def test_poisson_static_arguments_under_jit():
    with pytest.raises(TypeError, match="static"):
        jax.jit(lambda n: js.privacy.poisson_batches(
            jax.random.key(0), num_examples=n, sampling_probability=0.5, max_batch_size=4,
            steps=1))(10)


# --------------------------------------------------------------------------- #
# clipped_grad: the same numbers as the main API and as vmap(grad) clipped by hand
# --------------------------------------------------------------------------- #
def _per_example(loss, params, batch, argnums=0, extra=()):
    one = lambda p, ex, *e: loss(p, jax.tree.map(lambda a: a[None], ex), *e)  # noqa: E731
    return jax.jit(jax.vmap(jax.value_and_grad(one, argnums),
                            (None, 0) + (None,) * len(extra)))(params, batch, *extra)


def _flat_norms(g):
    leaves = jax.tree.leaves(g)
    B = leaves[0].shape[0]
    return jnp.sqrt(sum(jnp.sum(jnp.square(x.reshape(B, -1)), 1) for x in leaves))


def _clip_sum(g, C, keep=None):
    f = jnp.minimum(1.0, C / _flat_norms(g))
    if keep is not None:
        f = jnp.where(keep, f, 0.0)
    return jax.tree.map(lambda x: jnp.tensordot(f, x, 1), g)


def _close(a, b, rtol=2e-5, atol=1e-6):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(np.asarray(x, np.float64), np.asarray(y, np.float64),
                                   rtol=rtol, atol=atol)


def _median_norm(case):
    _, g = _per_example(case.loss_fn, case.params, case.batch)
    return float(jnp.median(_flat_norms(g)))


@pytest.mark.parametrize("name", ["mlp", "transformer"])
def test_clipped_grad_equals_main_api_and_oracle(name):
    case = zoo.get_case(name)
    C = _median_norm(case)
    got = js.privacy.clipped_grad(case.loss_fn, l2_clip_norm=C)(case.params, case.batch)
    main = js.per_example_stat(case.loss_fn, js.stats.clipped_sum(C))(case.params, case.batch)
    _close(got, main, rtol=1e-6, atol=1e-7)
    _, g = _per_example(case.loss_fn, case.params, case.batch)
    _close(got, _clip_sum(g, C))


def test_clipped_grad_float64_tight():
    with zoo.x64():
        case = zoo.get_case("mlp", jnp.float64)
        C = _median_norm(case)
        got = js.privacy.clipped_grad(case.loss_fn, l2_clip_norm=C)(case.params, case.batch)
        _, g = _per_example(case.loss_fn, case.params, case.batch)
        _close(got, _clip_sum(g, C), rtol=1e-10, atol=1e-12)


def test_clipped_grad_aux_outputs():
    case = zoo.get_case("mlp")
    C = _median_norm(case)

    def loss_aux(p, b):
        return case.loss_fn(p, b), {"x": b["x"], "s": jnp.sum(b["x"])}

    f = js.privacy.clipped_grad(loss_aux, has_aux=True, l2_clip_norm=C, return_values=True,
                                return_grad_norms=True)
    grad, aux = f(case.params, case.batch)
    assert isinstance(aux, js.privacy.AuxiliaryOutput) and type(aux).__name__ == "Aux"
    losses, g = _per_example(case.loss_fn, case.params, case.batch)
    _close(grad, _clip_sum(g, C))
    _close(aux.values, losses)
    _close(aux.grad_norms, _flat_norms(g))
    B = case.batch["x"].shape[0]
    assert aux.aux["x"].shape == case.batch["x"].shape  # axis 1 of size 1 squeezed
    assert aux.aux["s"].shape == (B,)
    assert f.has_aux
    only_norms = js.privacy.clipped_grad(case.loss_fn, l2_clip_norm=C, return_grad_norms=True)
    _, aux2 = only_norms(case.params, case.batch)
    assert aux2.values is None and aux2.aux is None
    plain = js.privacy.clipped_grad(case.loss_fn, l2_clip_norm=C)
    assert not plain.has_aux
    _close(plain(case.params, case.batch), grad)


def test_clipped_grad_padding_and_empty_batch():
    case = zoo.get_case("mlp")
    C = _median_norm(case)
    B = case.batch["x"].shape[0]
    pad = jnp.arange(B) % 3 == 1
    f = js.privacy.clipped_grad(case.loss_fn, l2_clip_norm=C, return_grad_norms=True)
    grad, aux = f(case.params, case.batch, is_padding_example=pad)
    _, g = _per_example(case.loss_fn, case.params, case.batch)
    _close(grad, _clip_sum(g, C, keep=~pad))
    np.testing.assert_array_equal(np.asarray(aux.grad_norms)[np.asarray(pad)], 0.0)
    # an empty Poisson batch (every slot padding) sums to zero, eagerly and under jit
    everything = jnp.ones((B,), bool)
    for run in (f, jax.jit(f)):
        grad, aux = run(case.params, case.batch, is_padding_example=everything)
        for x in jax.tree.leaves(grad):
            np.testing.assert_array_equal(x, 0.0)
        np.testing.assert_array_equal(aux.grad_norms, 0.0)
    with pytest.raises(ValueError, match="is_padding_example"):
        f(case.params, case.batch, is_padding_example=jnp.zeros((B,), jnp.float32))
    with pytest.raises(TypeError, match="example_weights"):
        f(case.params, case.batch, example_weights=jnp.ones((B,)))


def test_clipped_grad_with_poisson_batches():
    """The practitioner's step: sample, gather, clip with the padding mask."""
    case = zoo.get_case("mlp")
    C = _median_norm(case)
    data = case.batch
    n = data["x"].shape[0]
    idx, pad = js.privacy.poisson_batches(jax.random.key(8), num_examples=n,
                                          sampling_probability=0.4, max_batch_size=n, steps=4)
    f = js.privacy.clipped_grad(case.loss_fn, l2_clip_norm=C)

    @jax.jit
    def step(params, i, p):
        batch = jax.tree.map(lambda a: a[i], data)
        return f(params, batch, is_padding_example=p)

    for i, p in zip(idx, pad):
        got = step(case.params, i, p)
        real = np.asarray(i)[~np.asarray(p)]
        if not len(real):  # an empty batch sums to zero
            _close(got, jax.tree.map(jnp.zeros_like, case.params))
            continue
        _, g = _per_example(case.loss_fn, case.params, jax.tree.map(lambda a, r=real: a[r], data))
        _close(got, _clip_sum(g, C))


def test_clipped_grad_microbatch_and_jit():
    case = zoo.get_case("mlp")
    C = _median_norm(case)
    whole = js.privacy.clipped_grad(case.loss_fn, l2_clip_norm=C)(case.params, case.batch)
    for m in (1, 3):
        f = js.privacy.clipped_grad(case.loss_fn, l2_clip_norm=C, microbatch_size=m)
        _close(f(case.params, case.batch), whole, rtol=1e-5)
    _close(jax.jit(js.privacy.clipped_grad(case.loss_fn, l2_clip_norm=C))(
        case.params, case.batch), whole, rtol=1e-6)
    with pytest.raises(ValueError, match="microbatch_size"):
        js.privacy.clipped_grad(case.loss_fn, l2_clip_norm=C, microbatch_size=0)
    with pytest.raises(ValueError, match="not both"):
        js.privacy.clipped_grad(case.loss_fn, l2_clip_norm=C, microbatch_size=2, chunk_size=2)


def _dropout_loss(p, x, y, key):
    h = jnp.tanh(x @ p["w1"])
    h = jnp.where(jax.random.bernoulli(key, 0.6, h.shape), h / 0.6, 0.0)
    return jnp.mean((h @ p["w2"] - y) ** 2)


def _dropout_case():
    r = np.random.default_rng(0)
    p = {"w1": jnp.asarray(r.normal(size=(4, 6)), jnp.float32),
         "w2": jnp.asarray(r.normal(size=(6,)), jnp.float32)}
    x = jnp.asarray(r.normal(size=(9, 4)), jnp.float32)
    y = jnp.asarray(r.normal(size=(9,)), jnp.float32)
    return p, x, y


@pytest.mark.parametrize("make_key", [jax.random.key, jax.random.PRNGKey])
def test_clipped_grad_prng_argnum(make_key):
    p, x, y = _dropout_case()
    key = make_key(11)
    f = js.privacy.clipped_grad(_dropout_loss, l2_clip_norm=1.0, batch_argnums=(1, 2),
                                prng_argnum=3, return_values=True)
    grad, aux = f(p, x, y, key)
    keys = jax.random.split(key, 9)  # jax-privacy's per-example keys
    one = lambda p, x, y, k: _dropout_loss(p, x[None], y[None], k)  # noqa: E731
    losses, g = jax.vmap(jax.value_and_grad(one), (None, 0, 0, 0))(p, x, y, keys)
    _close(grad, _clip_sum(g, 1.0))
    _close(aux.values, losses)
    # the same with a per-example loss (keep_batch_dim=False) and micro-batches
    f1 = js.privacy.clipped_grad(one, l2_clip_norm=1.0, batch_argnums=(1, 2),
                                 keep_batch_dim=False, prng_argnum=3, microbatch_size=4)
    _close(f1(p, x, y, key), grad)
    with pytest.raises(ValueError, match="prng_argnum"):
        js.privacy.clipped_grad(_dropout_loss, l2_clip_norm=1.0, batch_argnums=(1, 2),
                                prng_argnum=2)


def test_clipped_grad_pre_clipping_transform():
    case = zoo.get_case("mlp")
    C = _median_norm(case)
    B = case.batch["x"].shape[0]
    scale = {"l1": 2.0, "l2": 0.5, "l3": 1.0}
    transform = lambda g: {k: jax.tree.map(lambda x, s=scale[k]: s * x, v)  # noqa: E731
                           for k, v in g.items()}
    pad = jnp.arange(B) == 0
    f = js.privacy.clipped_grad(case.loss_fn, l2_clip_norm=C, return_grad_norms=True,
                                return_values=True, pre_clipping_transform=transform,
                                microbatch_size=3)
    grad, aux = f(case.params, case.batch, is_padding_example=pad)
    losses, g = _per_example(case.loss_fn, case.params, case.batch)
    _close(grad, _clip_sum(transform(g), C, keep=~pad))
    _close(aux.grad_norms, jnp.where(pad, 0.0, _flat_norms(g)))  # norms before the transform
    _close(aux.values, losses)
    ident = js.privacy.clipped_grad(case.loss_fn, l2_clip_norm=C,
                                    pre_clipping_transform=lambda g: g)
    _close(ident(case.params, case.batch),
           js.privacy.clipped_grad(case.loss_fn, l2_clip_norm=C)(case.params, case.batch))


def test_clipped_grad_per_layer_bounds():
    case = zoo.get_case("mlp")
    bounds = {"l1": 0.3, "l2": 0.2, "l3": 0.5}
    f = js.privacy.clipped_grad(case.loss_fn, l2_clip_norm=bounds)
    main = js.per_example_stat(case.loss_fn, js.stats.clipped_sum(bounds))(
        case.params, case.batch)
    got = f(case.params, case.batch)
    _close(got, main, rtol=1e-6, atol=1e-7)
    _, g = _per_example(case.loss_fn, case.params, case.batch)
    want = {k: _clip_sum(g[k], C) for k, C in bounds.items()}
    _close(got, want)
    assert f.l2_norm_bound == pytest.approx(math.sqrt(0.3**2 + 0.2**2 + 0.5**2))
    with pytest.raises(NotImplementedError, match="rescale_to_unit_norm"):
        js.privacy.clipped_grad(case.loss_fn, l2_clip_norm=bounds, rescale_to_unit_norm=True)


def test_clipped_grad_nan_safe():
    case = zoo.get_case("mlp")
    C = _median_norm(case)
    B = case.batch["x"].shape[0]
    bad = (jnp.arange(B) % 4) == 2

    def loss(p, b):  # the examples flagged in the batch have a NaN gradient
        return case.loss_fn(p, b) * jnp.where(b["bad"][0], jnp.nan, 1.0)

    batch = {**case.batch, "bad": bad}
    got = js.privacy.clipped_grad(loss, l2_clip_norm=C)(case.params, batch)
    _, g = _per_example(case.loss_fn, case.params, case.batch)
    _close(got, _clip_sum(g, C, keep=~bad))
    _close(jax.jit(js.privacy.clipped_grad(loss, l2_clip_norm=C))(case.params, batch), got)
    unsafe = js.privacy.clipped_grad(loss, l2_clip_norm=C, nan_safe=False)(case.params, batch)
    assert all(np.isnan(np.asarray(x)).any() for x in jax.tree.leaves(unsafe))


def test_clipped_grad_normalize_rescale_dtype_argnums():
    case = zoo.get_case("mlp")
    C = _median_norm(case)
    base = js.privacy.clipped_grad(case.loss_fn, l2_clip_norm=C)(case.params, case.batch)
    f = js.privacy.clipped_grad(case.loss_fn, l2_clip_norm=C, normalize_by=8.0,
                                rescale_to_unit_norm=True)
    _close(f(case.params, case.batch), jax.tree.map(lambda x: x / (8.0 * C), base))
    assert f.l2_norm_bound == pytest.approx(1 / 8.0)
    inf = js.privacy.clipped_grad(case.loss_fn, l2_clip_norm=jnp.inf,
                                  rescale_to_unit_norm=True)(case.params, case.batch)
    assert all((np.asarray(x) == 0).all() for x in jax.tree.leaves(inf))
    low = js.privacy.clipped_grad(case.loss_fn, l2_clip_norm=C, dtype=jnp.bfloat16)(
        case.params, case.batch)
    assert {x.dtype for x in jax.tree.leaves(low)} == {jnp.dtype(jnp.bfloat16)}
    _close(low, base, rtol=1e-2, atol=1e-2)
    # two differentiated arguments: a tuple of gradients
    loss2 = lambda p, b, s: case.loss_fn(p, b) * s  # noqa: E731
    s = jnp.float32(1.7)
    g2 = js.privacy.clipped_grad(loss2, argnums=(0, 2), l2_clip_norm=C)(
        case.params, case.batch, s)
    assert isinstance(g2, tuple) and len(g2) == 2
    _, g = _per_example(loss2, case.params, case.batch, argnums=(0, 2), extra=(s,))
    _close(g2, _clip_sum(g, C))


def test_clipped_grad_sensitivity():
    case = zoo.get_case("mlp")
    f = js.privacy.clipped_grad(case.loss_fn, l2_clip_norm=2.0, normalize_by=4.0)
    assert f.sensitivity() == f.l2_norm_bound == 0.5
    assert f.sensitivity("REPLACE_ONE") == 1.0
    dpa = pytest.importorskip("dp_accounting")
    R = dpa.NeighboringRelation
    assert f.sensitivity(R.ADD_OR_REMOVE_ONE) == 0.5
    assert f.sensitivity(R.REPLACE_SPECIAL) == 0.5
    assert f.sensitivity(R.REPLACE_ONE) == 1.0


@pytest.mark.parametrize("kw,exc,match", [
    (dict(spmd_axis_name="data"), NotImplementedError, "spmd_axis_name"),
    (dict(l2_clip_norm=0.0), ValueError, "l2_clip_norm"),
    (dict(l2_clip_norm=-1.0), ValueError, "l2_clip_norm"),
    (dict(normalize_by=0.0), ValueError, "normalize_by"),
    (dict(argnums=1), ValueError, "overlap"),
    (dict(nonsense=1), TypeError, "nonsense"),
    (dict(pre_clipping_transform=3), TypeError, "pre_clipping_transform"),
])
def test_clipped_grad_refusals(kw, exc, match):
    case = zoo.get_case("mlp")
    args = dict(l2_clip_norm=1.0)
    args.update(kw)
    with pytest.raises(exc, match=match):
        js.privacy.clipped_grad(case.loss_fn, **args)


def _jax_privacy_clipping():
    """jax-privacy's ``clipping`` module, where it is installed."""
    try:
        return importlib.import_module("jax_privacy.clipping")
    except ImportError:
        pytest.skip("jax-privacy is not installed")


def test_clipped_grad_equals_jax_privacy():
    jpc = _jax_privacy_clipping()
    case = zoo.get_case("mlp")
    C = _median_norm(case)
    B = case.batch["x"].shape[0]
    pad = jnp.arange(B) % 3 == 0

    def loss_aux(p, b):
        return case.loss_fn(p, b), {"x": b["x"]}

    configs = [
        (case.loss_fn, dict(l2_clip_norm=C), {}),
        (loss_aux, dict(l2_clip_norm=C, has_aux=True, return_values=True,
                        return_grad_norms=True), {}),
        (case.loss_fn, dict(l2_clip_norm=C, normalize_by=3.0, rescale_to_unit_norm=True), {}),
        (case.loss_fn, dict(l2_clip_norm=C, return_values=True), {"is_padding_example": pad}),
    ]
    for fun, kw, call in configs:
        want = jpc.clipped_grad(fun, **kw)(case.params, case.batch, **call)
        got = js.privacy.clipped_grad(fun, **kw)(case.params, case.batch, **call)
        if isinstance(want, tuple):  # (the namedtuple Aux: the same name and fields)
            assert type(got[1]).__name__ == type(want[1]).__name__
            assert got[1]._fields == want[1]._fields
            got, want = (got[0], tuple(got[1])), (want[0], tuple(want[1]))
        _close(got, want)
    p, x, y = _dropout_case()
    kw = dict(l2_clip_norm=1.0, batch_argnums=(1, 2), prng_argnum=3)
    _close(js.privacy.clipped_grad(_dropout_loss, **kw)(p, x, y, jax.random.key(3)),
           jpc.clipped_grad(_dropout_loss, **kw)(p, x, y, jax.random.key(3)))


# --------------------------------------------------------------------------- #
# jax-privacy 2.0's own clipped_grad tests, mirrored
# --------------------------------------------------------------------------- #
# Each test below checks, against js.privacy, what one test of jax-privacy 2.0.0's
# tests/gradient_clipping_test.py (GradientClippingTest) or one example of its
# clipped_grad docstring checks, written here without jax-privacy (not a dependency).
# Run unchanged against js.privacy (a module jax_privacy.clipping re-exporting it), that
# file passes: at 2.0.0 and at its later revision (2.3.0.dev0).
def _quadratic(params, x):
    """Half the mean squared distance of the rows of x to params: per example,
    gradient params - x_b."""
    assert params.ndim == 1 and x.ndim == 2, (params.shape, x.shape)
    return 0.5 * jnp.mean((params - x) ** 2)


def _quadratic_aux(params, x):
    return _quadratic(params, x), {"key": jnp.mean(x, axis=0)}


_P2, _X147 = jnp.array([2.0]), jnp.array([[1.0], [4.0], [7.0]])  # gradients 1, -2, -5


def test_jax_privacy_tests_argument_checks():
    """test_validate_args_overlap, _empty_batch, _inconsistent_batch_size: ValueErrors
    with jax-privacy's words (its tests match them)."""
    with pytest.raises(ValueError, match="overlap"):
        js.privacy.clipped_grad(_quadratic, l2_clip_norm=1.0, argnums=0, batch_argnums=0)
    with pytest.raises(ValueError, match="Batch Argnums must not be empty"):
        js.privacy.clipped_grad(_quadratic, l2_clip_norm=1.0, argnums=0, batch_argnums=())
    with pytest.raises(ValueError, match=r"argnums=\(\)\): argnums must not be empty"):
        js.privacy.clipped_grad(_quadratic, l2_clip_norm=1.0, argnums=())
    f = js.privacy.clipped_grad(lambda p, x1, x2: _quadratic(p, x1), l2_clip_norm=1.0,
                                batch_argnums=(1, 2))
    for match in ("Batch axis", "same size along axis 0", r"argument 1: 10.*argument 2: 5"):
        with pytest.raises(ValueError, match=match):
            f(jnp.zeros(3), jnp.zeros((10, 3)), jnp.zeros(5))
    with pytest.raises(ValueError, match="scalar"):
        f(jnp.zeros(3), jnp.zeros((10, 3)), 1.0)


@pytest.mark.parametrize("microbatch_size", [None, 1, 3])
def test_jax_privacy_tests_sums(microbatch_size):
    """test_sum_clipped_grad_basic, _with_rescale, _with_padding_examples (under jit) and
    _return_metrics: clipped at 2.5, the gradients 1, -2, -5 sum to -3.5."""
    kw = dict(l2_clip_norm=2.5, microbatch_size=microbatch_size)
    _close(js.privacy.clipped_grad(_quadratic, **kw)(_P2, _X147), jnp.array([-3.5]))
    rescaled = jax.jit(js.privacy.clipped_grad(_quadratic, rescale_to_unit_norm=True, **kw))
    for pad, want in [([False] * 3, -3.5 / 2.5), ([True] * 3, 0.0),
                      ([False, True, True], 1.0 / 2.5)]:
        _close(rescaled(_P2, _X147, is_padding_example=jnp.array(pad)), jnp.array([want]))
    total, aux = js.privacy.clipped_grad(
        _quadratic, l2_clip_norm=10.0, return_grad_norms=True,
        microbatch_size=microbatch_size)(_P2, _X147)
    _close(total, jnp.array([-6.0]))
    _close(aux.grad_norms, jnp.array([1.0, 2.0, 5.0]))


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
def test_jax_privacy_tests_half_precision(dtype):
    """test_sum_clipped_grad_float16: the same sum in float16 and bfloat16, under jit."""
    f = jax.jit(js.privacy.clipped_grad(_quadratic, l2_clip_norm=2.5))
    got = f(_P2.astype(dtype), _X147.astype(dtype))
    _close(got, jnp.array([-3.5]))


def test_jax_privacy_tests_aux_and_values():
    """test_sum_clipped_grad_has_aux (micro-batched too), test_values_and_sum_per_example_
    clipped_grads and its _no_aux variant: unclipped, the sum over the batch size is
    jax.grad of the batch loss, and the per-example values and aux average to the batch's."""
    want_g, want_aux = jax.grad(_quadratic_aux, has_aux=True)(_P2, _X147)
    for m in (None, 1, 3):
        total, aux = js.privacy.clipped_grad(_quadratic_aux, has_aux=True, l2_clip_norm=10.0,
                                             microbatch_size=m)(_P2, _X147)
        _close(total / 3, want_g)
        _close(jax.tree.map(lambda a: a.mean(0), aux.aux), want_aux)
    total, aux = js.privacy.clipped_grad(_quadratic_aux, has_aux=True, l2_clip_norm=10.0,
                                         return_values=True)(_P2, _X147)
    _close(total, jnp.array([-6.0]))
    assert float(aux.values.mean()) == pytest.approx(float(_quadratic(_P2, _X147)))
    _close(jax.tree.map(lambda a: a.mean(0), aux.aux), want_aux)
    total, aux = js.privacy.clipped_grad(_quadratic, l2_clip_norm=10.0,
                                         return_values=True)(_P2, _X147)
    _close(aux.values, jnp.array([0.5, 2.0, 12.5]))
    _close(total, jnp.array([-6.0]))


@pytest.mark.parametrize("microbatch_size", [None, 1, 2])
def test_jax_privacy_tests_transform_and_groups(microbatch_size):
    """test_sum_clipped_grad_leaf_scales (a pre_clipping_transform scaling the leaves
    before clipping) and test_sum_clipped_grad_extra_batch_axis (keep_batch_dim=False:
    each entry of axis 0 is a user's group of examples, clipped together)."""
    def loss(p, x):
        return jnp.sum((p["w"] * x + p["b"] - x) ** 2)

    scales = {"w": jnp.array([0.1]), "b": jnp.array([1.0])}
    f = js.privacy.clipped_grad(
        loss, l2_clip_norm=1.0, microbatch_size=microbatch_size,
        pre_clipping_transform=lambda g: jax.tree.map(jnp.multiply, scales, g))
    got = f({"w": jnp.array([2.0]), "b": jnp.array([1.0])}, jnp.array([[1.0], [2.0]]))
    # per example (w, b) gradients (4, 4) and (12, 6), scaled to (0.4, 4) and (1.2, 6)
    n1, n2 = math.hypot(0.4, 4.0), math.hypot(1.2, 6.0)
    _close(got, {"w": jnp.array([0.4 / n1 + 1.2 / n2]), "b": jnp.array([4 / n1 + 6 / n2])},
           atol=1e-5)
    users = jnp.array([[[1.0], [2.0], [3.0]], [[3.0], [4.0], [5.0]]])  # 2 users, 3 examples
    total, _ = js.privacy.clipped_grad(
        _quadratic_aux, has_aux=True, l2_clip_norm=1000.0, keep_batch_dim=False,
        microbatch_size=microbatch_size)(_P2, users)
    assert total.shape == (1,)
    _close(total / 2, jax.grad(_quadratic)(_P2, users.reshape(6, 1)))


def test_jax_privacy_tests_python_float_params_and_pytrees():
    """test_sum_clipped_grad_prng_key (parameters given as Python floats, as jax.grad
    takes them) and test_sum_clipped_grad_pytree_params_and_data (two batch arguments,
    under jit): the gradients have the parameters' structure; checked here against
    vmap(grad) of jax itself. Python float parameters used to be refused ("hold no
    floating-point arrays")."""
    def noisy(p, x, key):
        y = p["w"] * x + p["b"]
        return jnp.mean(y + jax.random.normal(key, y.shape))

    params, data, key = {"w": 2.5, "b": 1.0}, jnp.array([10.0, 20.0, 30.0]), jax.random.key(0)
    for f in (js.privacy.clipped_grad(noisy, l2_clip_norm=1.0, prng_argnum=2),
              jax.jit(js.privacy.clipped_grad(noisy, l2_clip_norm=1.0, prng_argnum=2))):
        got = f(params, data, key)
        assert jax.tree.structure(got) == jax.tree.structure(params)
        one = lambda p, x, k: noisy(p, x[None], k)  # noqa: E731
        g = jax.vmap(jax.grad(one), (None, 0, 0))(params, data, jax.random.split(key, 3))
        _close(got, _clip_sum(g, 1.0))

    def logistic(p, inputs, targets):
        logp = jax.nn.log_softmax(inputs @ p["weights"] + p["bias"])
        return -jnp.mean(jnp.sum(logp * targets, axis=-1))

    p = {"weights": jnp.array([[1.0], [2.0]]), "bias": jnp.array([0.5])}
    inputs = jnp.array([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
    targets = jnp.array([[0.0, 1.0], [1.0, 0.0], [0.0, 1.0]])
    got = jax.jit(js.privacy.clipped_grad(logistic, l2_clip_norm=1.0, batch_argnums=(1, 2)))(
        p, inputs, targets)
    assert jax.tree.structure(got) == jax.tree.structure(p)


def test_jax_privacy_docstring_examples():
    """clipped_grad's docstring examples in jax-privacy 2.0: a Python float parameter and
    int data, the per-example values and norms, and per-user clipping."""
    f = lambda param, data: 0.5 * jnp.mean((data - param) ** 2)  # noqa: E731
    g = js.privacy.clipped_grad(f, l2_clip_norm=jnp.inf)
    _close(g(3.0, jnp.array([0, 7, -2])), jnp.array(4.0))
    _, aux = js.privacy.clipped_grad(f, l2_clip_norm=jnp.inf, return_values=True,
                                     return_grad_norms=True)(3.0, jnp.array([0, 7, -2]))
    _close(aux.values, jnp.array([4.5, 8.0, 12.5]))
    _close(aux.grad_norms, jnp.array([3.0, 4.0, 5.0]))
    per_user = js.privacy.clipped_grad(f, l2_clip_norm=jnp.inf, keep_batch_dim=False)
    _close(per_user(3.0, jnp.array([[1, -1], [2, 2], [0, 3]])), jnp.array(5.5))
    # 3.0 is differentiated (as by jax.grad), not held as a constant: a new value, a new sum
    _close(g(1.0, jnp.array([0, 7, -2])), jnp.array(-2.0))


# --------------------------------------------------------------------------- #
# Docstring examples
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("module", [
    "jaxpr_surgery.privacy",
    "jaxpr_surgery._src.privacy.accounting",
    "jaxpr_surgery._src.privacy.sampling",
    "jaxpr_surgery._src.privacy.clipped_grad",
])
def test_docstring_examples(module):
    if module.endswith("accounting"):
        _dpa()
    mod = importlib.import_module(module)
    finder = doctest.DocTestFinder(exclude_empty=True)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    report = io.StringIO()
    for test in finder.find(mod, module, globs={}):
        runner.run(test, out=report.write)
    assert runner.summarize(verbose=False).failed == 0, report.getvalue()


def test_public_names_have_docstrings():
    for name in js.privacy.__all__:
        obj = getattr(js.privacy, name)
        if callable(obj):
            assert (obj.__doc__ or "").strip(), name


def test_clipped_grad_switching_x64_with_closed_over_numpy_constants():
    """`clipped_grad` called eagerly with x64 off, then on, then off again, on a loss
    closing over a NumPy float64 array: its compiled functions are dropped when the mode
    changes (fingerprint.EagerCache), as the main API's are; JAX's conversion of the
    array, held by the first mode's function, made the second trace a TypeError."""
    import contextlib

    import zoo

    C = np.linspace(0.5, 1.5, 3)  # float64

    def loss(w, x, y):
        return jnp.mean((x @ (w * C) - y) ** 2)

    g = js.privacy.clipped_grad(loss, l2_clip_norm=1e6, batch_argnums=(1, 2))
    for x64 in (False, True, False):
        with zoo.x64() if x64 else contextlib.nullcontext():
            dt = np.float64 if x64 else np.float32
            r = np.random.default_rng(0)
            w = jnp.asarray(r.standard_normal(3), dt)
            x, y = jnp.asarray(r.standard_normal((4, 3)), dt), jnp.asarray(r.standard_normal(4), dt)
            want = np.sum([2 * (np.asarray(x[b], np.float64) @ (np.asarray(w, np.float64) * C)
                                - float(y[b])) * np.asarray(x[b], np.float64) * C
                           for b in range(4)], 0)
            np.testing.assert_allclose(np.asarray(g(w, x, y), np.float64), want, rtol=1e-4)
