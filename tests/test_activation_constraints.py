"""Sharding constraints on activations, as MaxText writes them (``with_sharding_constraint(h,
P(batch_axes, None, None))`` by logical axis rules), in the per-example jaxpr.

Traced on one example, such a constraint names the batch's mesh axes on the example's axis
of size one. Bound as written for a batch split by device, it kept that unit axis split and
the examples replicated: every activation moved between the devices (E[g^2] 3.6x jax.grad's
collective bytes on 8 devices; test_gspmd's ``comms:constrained:tp``). The per-example
jaxpr now leaves such unit axes unconstrained (`devices.release_unit_constraints`) and the
split puts the named axes on its parts (`devices.spmd_axes`). Here, on one device: the
rewrite at every depth, the choice of the parts' axes, and unchanged values.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxpr_surgery as js
from jaxpr_surgery._src import compat, devices, walker

UNC = P.UNCONSTRAINED


def _mesh():
    return jax.make_mesh((1, 1), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)


def _constraints(closed):
    return [e for e in walker.equations(closed.jaxpr)
            if e.primitive is compat.sharding_constraint_p]


def test_unit_axes_released_at_every_depth():
    """The example's unit axis, wherever a constraint names mesh axes on it (top level, a
    jitted call, a scan body, a checkpointed block, a cond branch), is left unconstrained;
    the constraint's other axes (the hidden features on 'model') stay as written."""
    mesh = _mesh()
    act = NamedSharding(mesh, P("data", None, None))
    hid = NamedSharding(mesh, P("data", None, "model"))
    c = jax.lax.with_sharding_constraint

    @jax.jit
    def inner(h):
        return c(jnp.tanh(h), act)

    def f(x, w):  # x: [1, T, d], one example kept as a batch of one
        h = c(x, act)
        h = inner(h)
        h, _ = jax.lax.scan(lambda h, _: (jax.checkpoint(lambda h: c(h * 2.0, act))(h), None),
                            h, None, length=2)
        h = jax.lax.cond(jnp.sum(x) > 0, lambda h: c(h + 1.0, act), lambda h: h, h)
        return jnp.sum(c(h @ w, hid))

    closed = jax.make_jaxpr(f)(jnp.ones((1, 4, 8)), jnp.ones((8, 6)))
    assert len(_constraints(closed)) == 5
    new, found = devices.release_unit_constraints(closed)
    specs = [tuple(e.params["sharding"].spec) for e in _constraints(new)]
    assert len(specs) == 5 and all(s[0] is UNC for s in specs), specs
    assert specs[-1][2] == "model" and specs[-1][1] is None
    dims = [e.params["unconstrained_dims"] for e in _constraints(new)]
    assert all(0 in d for d in dims)
    assert found.unit_axes == frozenset({("data",)})
    assert found.other_axes == frozenset({"model"})
    x, w = np.random.default_rng(0).normal(size=(2, 1, 4, 8)), np.ones((8, 6))
    for xb in x:  # (the values are the constraint's operand's: unchanged)
        np.testing.assert_allclose(compat.jaxpr_as_fun(new)(xb, w)[0],
                                   compat.jaxpr_as_fun(closed)(xb, w)[0], rtol=1e-6)


def test_only_constraints_on_the_examples_name_the_batchs_axes():
    """A unit axis of a value computed from the parameters alone (a ``[1, d]`` row) is
    released too, but what its constraint names is not read as the batch's axes: only
    constraints on values computed from the example, or inside a call or loop that reads
    one, are."""
    mesh = _mesh()
    c = jax.lax.with_sharding_constraint

    def f(w, x):  # invars: the parameter, then the example
        row = c(w[:1], NamedSharding(mesh, P("model", None)))  # [1, d], from w alone
        h = c(x @ w, NamedSharding(mesh, P("data", None, None)))  # [1, T, d]
        return jnp.sum(h + row)

    closed = jax.make_jaxpr(f)(jnp.ones((8, 8)), jnp.ones((1, 4, 8)))
    new, found = devices.release_unit_constraints(closed, examples=[1])
    assert all(tuple(e.params["sharding"].spec)[0] is UNC for e in _constraints(new))
    assert found.unit_axes == frozenset({("data",)})
    _, every = devices.release_unit_constraints(closed)  # (None: every constraint)
    assert every.unit_axes == frozenset({("data",), ("model",)})
    _, none = devices.release_unit_constraints(closed, examples=[])
    assert not none.unit_axes


def test_a_jaxpr_without_unit_constraints_is_returned_as_is():
    mesh = _mesh()
    f = lambda x: jnp.sum(jax.lax.with_sharding_constraint(  # noqa: E731
        x, NamedSharding(mesh, P(None, "model"))))
    closed = jax.make_jaxpr(f)(jnp.ones((3, 4)))
    new, found = devices.release_unit_constraints(closed)
    assert new is closed and not found.unit_axes and found.other_axes == {"model"}


@pytest.mark.parametrize("unit,other,D,want", [
    ({("data", "fsdp")}, set(), 8, ("data", "fsdp")),
    ({("data",)}, {"model"}, 8, ("data",)),
    ({("data",)}, set(), 4, ("data",)),
    # the examples' axes named twice, differently: left to XLA's propagation
    ({("data",), ("data", "fsdp")}, set(), 8, None),
    # the batch's axis named on another axis too (a folded batch): vmap would refuse it
    ({("data",)}, {"data"}, 8, None),
    # the named devices do not divide the parts
    ({("data", "fsdp")}, set(), 4, None),
    (set(), set(), 8, None),
])
def test_parts_go_where_the_constraints_put_the_examples(unit, other, D, want):
    found = devices.BatchConstraints(frozenset(unit), frozenset(other),
                                     (("data", 2), ("fsdp", 4), ("model", 4)))
    assert devices.spmd_axes(found, D) == want
    assert devices.spmd_axes(None, D) is None


def test_statistics_of_a_constrained_model_equal_the_oracle():
    """On one device, a model constraining its activations: every statistic as without
    the constraints (the oracle: vmap(grad))."""
    mesh = _mesh()
    act = NamedSharding(mesh, P("data", None, None))
    r = np.random.default_rng(1)
    params = {"w1": jnp.asarray(r.normal(size=(8, 16)) / 3),
              "w2": jnp.asarray(r.normal(size=(16, 8)) / 4)}
    batch = {"x": jnp.asarray(r.normal(size=(6, 5, 8))),
             "y": jnp.asarray(r.normal(size=(6, 5, 8)))}

    def loss(p, b):
        h = jax.lax.with_sharding_constraint(jnp.tanh(b["x"] @ p["w1"]), act)
        out = jax.lax.with_sharding_constraint(h @ p["w2"], act)
        return jnp.mean((out - b["y"]) ** 2)

    one = lambda p, ex: loss(p, jax.tree.map(lambda v: v[None], ex))  # noqa: E731
    G = jax.vmap(jax.grad(one), (None, 0))(params, batch)
    got = js.per_example_stat(loss, {"m2": js.stats.second_moment(),
                                     "sq": js.stats.sq_norms()})(params, batch)
    for k in params:
        np.testing.assert_allclose(got["m2"][k], np.mean(np.asarray(G[k]) ** 2, 0), rtol=1e-5)
    sq = sum(np.sum(np.asarray(g).reshape(6, -1) ** 2, 1) for g in jax.tree.leaves(G))
    np.testing.assert_allclose(got["sq"], sq, rtol=1e-5)
