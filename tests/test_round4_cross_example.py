"""Cross-example checks that only warned (issue 58, item 9), now decided from the jaxpr:

* examples taken out of the batch one by one (``x[i]`` in a Python loop, iterating over the
  batch, ``jnp.unstack``, ``lax.dynamic_index_in_dim``): a loop that adds up one term per
  example, each computed alike, is a mean of per-example terms (no alarm, and ``mean()``
  is the oracle and ``jax.grad``); terms that combine examples, weigh them unequally, or
  are not computed alike raise `js.CrossExampleError` naming the operation, a line of
  this file and what to do;
* a ``psum`` over a named axis the call does not know (``pmap`` or an untyped
  ``shard_map`` without ``axis_name``): warned, naming the axis and ``axis_name=``;
* scatters and gathers of the batch axis by indices (or updates) outside the batch that
  line up with it: refused, naming the argument; ``x[jnp.arange(B)]`` is no alarm;
* parts of the batch computed differently and concatenated back: warned.
"""

from __future__ import annotations

import functools
import warnings

import _models as M
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as PS

import jaxpr_surgery as js

B, T, D, V = 4, 3, 3, 5
HERE = "test_round4_cross_example.py:"


def _params(dtype=jnp.float32):
    r = np.random.default_rng(0)
    return {"w": jnp.asarray(r.normal(size=(D, V)) / 2, dtype),
            "v": jnp.asarray(r.normal(size=(D, D)) / 2, dtype)}


def _batch(dtype=jnp.float32):
    r = np.random.default_rng(1)
    return {"x": jnp.asarray(r.normal(size=(B, T, D)), dtype),
            "y": jnp.asarray(r.integers(0, V, (B, T)), jnp.int32)}


def _one(p, x, y):  # the loss of one example: x [T, D], y [T]
    lp = jax.nn.log_softmax(jnp.tanh(x @ p["v"]) @ p["w"])
    return -jnp.mean(jnp.take_along_axis(lp, y[:, None], -1))


def _batch_loss(p, b):  # the same, vectorised: a mean over [B, T]
    lp = jax.nn.log_softmax(jnp.tanh(b["x"] @ p["v"]) @ p["w"])
    return -jnp.mean(jnp.take_along_axis(lp, b["y"][..., None], -1))


def _per_example(p, b):  # [B]
    return jax.vmap(_one, in_axes=(None, 0, 0))(p, b["x"], b["y"])


def _n(b):
    return b["x"].shape[0]


def _line_of(fn, needle):
    import inspect

    lines, start = inspect.getsourcelines(fn)
    return f"{HERE}{start + next(i for i, ln in enumerate(lines) if needle in ln)}"


# --------------------------------------------------------------------------- #
# One term per example, computed alike: a mean of per-example terms
# --------------------------------------------------------------------------- #
_jitted_one = jax.jit(_one)


def loop_over_x_i(p, b):
    return sum(_one(p, b["x"][i], b["y"][i]) for i in range(_n(b))) / _n(b)


def loop_over_rows(p, b):  # iterating over the batch (jnp.unstack in jax 0.12)
    return sum(_one(p, x, y) for x, y in zip(b["x"], b["y"])) / _n(b)


def loop_over_batches_of_one(p, b):  # the batch loss of b[i:i + 1], the batch axis kept
    return sum(_batch_loss(p, jax.tree.map(lambda a, i=i: a[i : i + 1], b))
               for i in range(_n(b))) / _n(b)


def stack_of_terms(p, b):
    return jnp.mean(jnp.stack([_one(p, b["x"][i], b["y"][i]) for i in range(_n(b))]))


def jitted_terms_scaled_each(p, b):
    return sum(_jitted_one(p, b["x"][i], b["y"][i]) / _n(b) for i in range(_n(b)))


def unstacked_per_example(p, b):
    return sum(jnp.unstack(_per_example(p, b))) / _n(b)


def dynamic_index(p, b):
    def pick(a, i):
        return lax.dynamic_index_in_dim(a, i, keepdims=False)

    return sum(_one(p, pick(b["x"], i), pick(b["y"], i)) for i in range(_n(b))) / _n(b)


ONE_BY_ONE = [loop_over_x_i, loop_over_rows, loop_over_batches_of_one, stack_of_terms,
              jitted_terms_scaled_each, unstacked_per_example, dynamic_index]


@pytest.mark.parametrize("loss", ONE_BY_ONE, ids=lambda f: f.__name__)
def test_loop_adding_one_term_per_example_is_a_per_example_mean(loss):
    """Warned ("takes a single example out of the batch"): now proved, and mean() equals
    both the vmap(grad) oracle and jax.grad."""
    with jax.enable_x64(True):
        M.assert_independent_and_exact(loss, _params(jnp.float64), _batch(jnp.float64))


def _rnn_one(p, x, y):  # a scan over the tokens of one example
    del y
    _, ys = lax.scan(lambda h, xt: (jnp.tanh(h @ p["v"] + xt), h @ p["w"]), jnp.zeros(D), x)
    return jnp.mean(ys ** 2)


def _terms(p, b, one=_one):
    return [one(p, b["x"][i], b["y"][i]) for i in range(_n(b))]


NO_ALARM = {
    "checkpointed_terms": lambda p, b: sum(_terms(p, b, jax.checkpoint(_one))) / _n(b),
    "scan_in_each_term": lambda p, b: sum(_terms(p, b, _rnn_one)) / _n(b),
    "running_total_from_zeros": lambda p, b: functools.reduce(
        lambda tot, term: tot + term, _terms(p, b), jnp.zeros(())) / _n(b),
    "regulariser_added_once": lambda p, b: (sum(_terms(p, b)) + jnp.sum(p["w"] ** 2)) / _n(b),
    "halves_each_halved": lambda p, b: (sum(_terms(p, b)[:2]) / 2 + sum(_terms(p, b)[2:]) / 2),
    "token_vectors_summed": lambda p, b: jnp.mean(sum(  # [T, V] per example, added up
        jnp.tanh(b["x"][i] @ p["v"]) @ p["w"] for i in range(_n(b)))),
}


@pytest.mark.parametrize("name", sorted(NO_ALARM))
def test_more_loops_over_the_examples_are_no_alarm(name):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert js.explain(NO_ALARM[name])(_params(), _batch()).independence == "independent"


# --------------------------------------------------------------------------- #
# Terms that combine examples, weigh them unequally or differ: refused
# --------------------------------------------------------------------------- #
def product_of_two_examples(p, b):
    return _one(p, b["x"][0] * b["x"][1], b["y"][0])


def normalised_by_another_example(p, b):
    first = lax.stop_gradient(_one(p, b["x"][0], b["y"][0]))
    return sum(_one(p, b["x"][i], b["y"][i]) / first for i in range(_n(b))) / _n(b)


def normalised_by_the_batch_mean(p, b):
    scale = lax.stop_gradient(jnp.mean(_per_example(p, b)))
    return sum(_one(p, b["x"][i], b["y"][i]) / scale for i in range(_n(b))) / _n(b)


def first_two_examples(p, b):
    return (_one(p, b["x"][0], b["y"][0]) + _one(p, b["x"][1], b["y"][1])) / 2


def weighted_by_position(p, b):
    return sum((i + 1) * _one(p, b["x"][i], b["y"][i]) for i in range(_n(b))) / _n(b)


def first_example_only(p, b):
    return _one(p, b["x"][0], b["y"][0])


def stacked_unlike(p, b):
    terms = _terms(p, b)
    return jnp.mean(jnp.stack([2.0 * terms[0], *terms[1:]]))


def first_half_without_gradient(p, b):
    terms = _terms(p, b)
    return (lax.stop_gradient(terms[0] + terms[1]) + terms[2] + terms[3]) / 4


_WEIGHTS = np.array([1.0, 2.0, 1.0, 1.0], np.float32)


def weighted_by_a_closed_over_array(p, b):
    return sum(_WEIGHTS[i] * term for i, term in enumerate(_terms(p, b)))


def halves_scaled_differently(p, b):
    terms = _terms(p, b)
    return (terms[0] + terms[1]) * 2.0 + (terms[2] + terms[3])


PAIRED = "from that example alone (x[i] with x[i], never with x[j]"
REFUSED = {
    product_of_two_examples: ("mul", "combines example 0 with example 1", PAIRED),
    normalised_by_another_example: ("div", "combines example 1 with example 0", PAIRED),
    normalised_by_the_batch_mean: ("div", "combines per-example values with a sum",
                                   "normalise per example"),
    first_two_examples: ("add", "examples 0, 1 count 0.5 more than examples 2, 3", "vmap"),
    weighted_by_position: ("add", "not computed alike", "example_weights="),
    first_example_only: ("slice", "example 0 counts 1 more than examples 1, 2, 3", "vmap"),
    stacked_unlike: ("stack|concatenate", "not computed alike", "vmap"),
    first_half_without_gradient: ("add", "not computed alike", "vmap"),
    weighted_by_a_closed_over_array: ("add", "not computed alike", "example_weights="),
    halves_scaled_differently: ("add", "examples 0, 1 count 1 more than examples 2, 3",
                                "vmap"),
}


@pytest.mark.parametrize("loss", list(REFUSED), ids=lambda f: f.__name__)
def test_loop_terms_that_cross_or_weigh_examples_unequally_raise(loss):
    """Were warned ("takes a single example out of the batch"): each raises, naming the
    operation, a line of this file and what to do."""
    import re

    op, why, fix = REFUSED[loss]
    with pytest.raises(js.CrossExampleError) as e:
        js.per_example_stat(loss, js.stats.mean())(_params(), _batch())
    msg = str(e.value)
    assert re.search(f"`({op})` at {HERE}", msg) and why in msg, msg
    assert f"({loss.__name__}" in msg and "check=False" in msg and fix in msg, msg


def test_message_names_the_line_taking_the_example_out():
    with pytest.raises(js.CrossExampleError) as e:
        js.per_example_stat(first_two_examples, js.stats.mean())(_params(), _batch())
    line = _line_of(first_two_examples, "return")
    assert f"`add` at {line}" in str(e.value) and "taken out by `slice` at " + line in str(
        e.value), str(e.value)


# --------------------------------------------------------------------------- #
# A psum over a named axis the call does not know: warned
# --------------------------------------------------------------------------- #
def _pmean_of_the_loss(p, b):
    return lax.pmean(jnp.mean(_per_example(p, b)), "d")


def _centred_by_the_devices_mean(p, b):
    per = _per_example(p, b)
    return jnp.mean(per - lax.pmean(jnp.mean(per), "d"))


def _split(b, n):
    return jax.tree.map(lambda a: a.reshape(n, a.shape[0] // n, *a.shape[1:]), b)


def test_psum_over_a_named_axis_the_call_does_not_know_warns():
    """In pmap (and untyped shard_map) without axis_name, the check cannot tell a data
    axis from a model axis: a pmean of the loss over it went unnoticed (every statistic
    off by the device count where 'd' splits the batch). Warned, naming the axis and the
    fix; a loss that is cross-example whichever the axis still raises."""
    if jax.device_count() < 2:
        pytest.skip("needs 2 devices (tests/conftest.py sets XLA_FLAGS)")
    p, b = _params(), _split(_batch(), 2)
    pmap = lambda fn: jax.pmap(fn, axis_name="d", in_axes=(None, 0), devices=jax.devices()[:2])  # noqa: E731
    with pytest.warns(js.CrossExampleWarning) as w:
        pmap(js.per_example_stat(_pmean_of_the_loss, js.stats.mean()))(p, b)
    msg = str(next(x.message for x in w if issubclass(x.category, js.CrossExampleWarning)))
    assert "`psum` at " + HERE in msg and "named axis 'd'" in msg, msg
    assert "axis_name='d'" in msg and "check_vma=True" in msg, msg
    with pytest.raises(js.CrossExampleError, match="over 'd'"):
        pmap(js.per_example_stat(_pmean_of_the_loss, js.stats.mean(), axis_name="d"))(p, b)
    with pytest.raises(js.CrossExampleError, match="`sub` at " + HERE):
        pmap(js.per_example_stat(_centred_by_the_devices_mean, js.stats.mean()))(p, b)


def test_psum_in_untyped_shard_map_without_axis_name_warns():
    if jax.device_count() < 2:
        pytest.skip("needs 2 devices (tests/conftest.py sets XLA_FLAGS)")
    mesh = jax.make_mesh((2,), ("d",))
    p = jax.device_put(_params(), jax.sharding.NamedSharding(mesh, PS()))
    b = jax.device_put(_batch(), jax.sharding.NamedSharding(mesh, PS("d")))

    def run(check_vma):
        fn = js.per_example_stat(_pmean_of_the_loss, js.stats.mean())
        return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(PS(), PS("d")), out_specs=PS(),
                                     check_vma=check_vma))(p, b)

    with pytest.warns(js.CrossExampleWarning, match="named axis 'd'"):
        run(False)
    with pytest.raises(js.CrossExampleError, match="the mesh axis the batch is split over"):
        run(True)  # typed: the batch varies over 'd', so the check knows


# --------------------------------------------------------------------------- #
# Scatters and gathers by indices outside the batch that line up with it: refused
# --------------------------------------------------------------------------- #
def _logits(p, b):  # [B, V]
    return jnp.tanh(b["x"][:, 0] @ p["v"]) @ p["w"]


def scatter_at_labels(p, b, labels):
    return jnp.mean(_logits(p, b).at[jnp.arange(_n(b)), labels].add(-1.0) ** 2)


def scatter_of_updates(p, b, bonus):
    return jnp.mean(_logits(p, b).at[jnp.arange(_n(b)), 0].add(bonus) ** 2)


def scatter_in_order(p, b, order):  # the examples' losses placed by an order
    return jnp.mean(jnp.zeros(_n(b)).at[order].set(_per_example(p, b)) ** 2)


def gather_in_order(p, b, order):
    return jnp.mean(jnp.cumsum(_per_example(p, b)[order]) ** 2)


LINED = {
    scatter_at_labels: ("scatter-add", jnp.asarray([1, 4, 0, 2], jnp.int32)),
    scatter_of_updates: ("scatter-add", jnp.asarray([0.5, -1.0, 2.0, 0.0], jnp.float32)),
    scatter_in_order: ("scatter", jnp.asarray([2, 0, 3, 1], jnp.int32)),
    gather_in_order: ("gather", jnp.asarray([2, 0, 3, 1], jnp.int32)),
}


@pytest.mark.parametrize("loss", list(LINED), ids=lambda f: f.__name__)
def test_indices_outside_the_batch_lined_up_with_it_raise(loss):
    """Went unnoticed (a scatter at jnp.arange(B) by labels passed outside the batch) or
    were warned as scatters and gathers "by data": example b meets entry b of the argument
    in the batch, all of it alone. Refused naming the argument and the fix."""
    op, arg = LINED[loss]
    p, b = _params(), _batch()
    with pytest.raises(js.CrossExampleError) as e:
        js.per_example_stat(loss, js.stats.mean())(p, b, arg)
    msg = str(e.value)
    assert f"`{op}` at {HERE}" in msg and "argument 2" in msg, msg
    assert "batch_argnums=(1, 2)" in msg, msg


@pytest.mark.parametrize("loss", [scatter_at_labels, scatter_of_updates],
                         ids=lambda f: f.__name__)
def test_labels_passed_in_the_batch_are_exact(loss):
    _, arg = LINED[loss]
    p, b = _params(), _batch()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mean = js.per_example_stat(loss, js.stats.mean(), batch_argnums=(1, 2))(p, b, arg)
    one = lambda p, e, a: loss(p, jax.tree.map(lambda x: x[None], e), a[None])  # noqa: E731
    oracle = jax.vmap(jax.grad(one), in_axes=(None, 0, 0))(p, b, arg)
    for k in p:
        np.testing.assert_allclose(mean[k], oracle[k].mean(0), rtol=1e-5, atol=1e-6)


def test_indexing_the_batch_by_its_own_positions_is_no_alarm():
    """``per[jnp.arange(B)]`` was refused ("lines up each example with ... jnp.arange")."""
    p, b = _params(), _batch()
    for loss in (lambda p, b: jnp.mean(_per_example(p, b)[jnp.arange(_n(b))]),
                 lambda p, b: jnp.mean(jnp.zeros(_n(b)).at[jnp.arange(_n(b))].set(
                     _per_example(p, b)))):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert js.explain(loss)(p, b).independence == "independent"


# --------------------------------------------------------------------------- #
# Parts of the batch computed differently, concatenated back: warned
# --------------------------------------------------------------------------- #
def test_parts_of_the_batch_computed_differently_warn():
    """Went unnoticed: the concatenation gave every position one example, as if the
    halves were computed alike (the second half's examples count twice)."""
    p, b = _params(), _batch()

    def halves(p, b):
        h = jnp.split(_per_example(p, b), [_n(b) // 2])
        return jnp.mean(jnp.concatenate([h[0], 2.0 * h[1]]))

    with pytest.warns(js.CrossExampleWarning, match="`concatenate` at " + HERE):
        js.per_example_stat(halves, js.stats.mean())(p, b)

    def alike(p, b):  # the halves computed alike and swapped: no alarm
        h = jnp.split(_per_example(p, b), [_n(b) // 2])
        return jnp.mean(jnp.concatenate([2.0 * h[1], 2.0 * h[0]]))

    def two_ways(p, b):  # the whole batch computed two ways in one pass: no alarm
        per = jnp.concatenate([_per_example(p, b), jnp.mean(b["x"] @ p["v"], (1, 2))])
        return jnp.mean(per ** 2)

    for loss in (alike, two_ways):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert js.explain(loss)(p, b).independence == "independent"
