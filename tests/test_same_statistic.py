"""``stats.same_statistic``: when two statistics compute the same thing — the one rule
by which partials merge and optimizers' requests share a statistic under one name."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import zoo

import jaxpr_surgery as js
import jaxpr_surgery.optim as jso
from jaxpr_surgery._src.stats import same_statistic


def _pow(k):
    return js.stats.elementwise(lambda g: g**k, multiplicative=True, name="pow")


@pytest.mark.parametrize("a,b,same", [
    (js.stats.variance(), js.stats.variance(1), True),
    (js.stats.variance(), js.stats.variance(0), False),
    (js.stats.variance(), js.stats.second_moment(), False),
    (js.stats.clipped_mean(1.0), js.stats.clipped_mean(1), True),
    (js.stats.clipped_mean(1.0), js.stats.clipped_mean(1.5), False),
    (js.stats.clipped_mean(np.float32(2.0)), js.stats.clipped_mean(jnp.asarray(2.0)), True),
    (js.stats.clipped_mean({"w": 1.0, "b": 2.0}), js.stats.clipped_mean({"w": 1.0, "b": 2.0}),
     True),
    (js.stats.clipped_mean({"w": 1.0, "b": 2.0}), js.stats.clipped_mean({"w": 1.0, "b": 3.0}),
     False),
    (js.stats.clipped_mean({"w": 1.0, "b": 2.0}), js.stats.clipped_mean({"w": 1.0}), False),
    (_pow(4), _pow(4), True),  # a lambda built afresh, one code and environment
    (_pow(4), _pow(3), False),
    (js.stats.norm_quantiles((0.1, 0.9)), js.stats.norm_quantiles((0.1, 0.9)), True),
    (js.stats.norm_quantiles((0.1, 0.9)), js.stats.norm_quantiles((0.1, 0.5)), False),
])
def test_same_statistic(a, b, same):
    assert same_statistic(a, b) is same
    assert same_statistic(b, a) is same


def test_traced_values_are_the_same_only_when_one():
    def f(c):
        one = js.stats.clipped_mean(c)
        assert same_statistic(one, one)
        assert same_statistic(one, js.stats.clipped_mean(c))  # the same traced value
        assert not same_statistic(one, js.stats.clipped_mean(c + 0.0))
        return c

    jax.jit(f)(1.0)


def test_requests_and_partials_follow_it():
    """Optimizers sharing a request name: equal array bounds share, other bounds raise;
    partials of statistics built twice merge, of other ones refuse."""
    jso.chain(jso.dp_aggregate(jnp.asarray(1.0), 1.0), jso.dp_aggregate(np.float32(1.0), 1.0))
    with pytest.raises(ValueError, match="different statistics"):
        jso.chain(jso.dp_aggregate(1.0, 1.0), jso.dp_aggregate(2.0, 1.0))
    case = zoo.get_case("mlp")
    a = js.per_example_partial(case.loss_fn, {"p": _pow(4)})(case.params, case.batch)
    b = js.per_example_partial(case.loss_fn, {"p": _pow(4)})(case.params, case.batch)
    js.merge_partials(a, b)
    c = js.per_example_partial(case.loss_fn, {"p": _pow(3)})(case.params, case.batch)
    with pytest.raises(ValueError, match="other statistics"):
        js.merge_partials(a, c)
