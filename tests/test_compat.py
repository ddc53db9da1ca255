"""The JAX-internal surface the package reads, on the installed jax.

Every primitive param the analysis and the interpreter rely on is read here
through `compat`'s normalised views; a jax that renames or restructures one
fails these tests by name instead of giving a wrong statistic.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jaxpr_surgery as js
from jaxpr_surgery._src import compat, versions


def _eqn(fn, *args, prim):
    jaxpr = jax.make_jaxpr(fn)(*args).jaxpr
    found = [e for e in jaxpr.eqns if e.primitive is prim]
    assert found, f"{prim} not found in {jaxpr}"
    return found[-1]


# --------------------------------------------------------------------------- #
# Normalised views
# --------------------------------------------------------------------------- #
def test_site_params_present():
    """Params of site primitives read by the analysis and the kernels."""
    d = _eqn(lambda x, w: jnp.einsum("bd,de->be", x, w), jnp.ones((2, 3)), jnp.ones((3, 4)),
             prim=compat.dot_general_p)
    (lc, rc), (lb, rb) = d.params["dimension_numbers"]
    assert tuple(lc) == (1,) and tuple(rc) == (0,)
    g = _eqn(lambda t, i: t[i], jnp.ones((5, 3)), jnp.array([1, 2]), prim=compat.gather_p)
    dn = g.params["dimension_numbers"]
    for attr in ("offset_dims", "collapsed_slice_dims", "start_index_map"):
        assert hasattr(dn, attr), attr
    assert "mode" in g.params and tuple(g.params["slice_sizes"]) == (1, 3)
    b = _eqn(lambda x: jnp.broadcast_to(x, (2, 3)), jnp.ones(3), prim=compat.broadcast_p)
    assert tuple(b.params["broadcast_dimensions"]) == (1,)
    t = _eqn(lambda x: x.T, jnp.ones((2, 3)), prim=compat.transpose_p)
    assert tuple(t.params["permutation"]) == (1, 0)


# --------------------------------------------------------------------------- #
# End to end on this jax: scan, remat, cond and custom_vjp models
# --------------------------------------------------------------------------- #
def test_scan_cond_custom_vjp_end_to_end():
    @jax.custom_vjp
    def soft(x):
        return jnp.tanh(x)

    soft.defvjp(lambda x: (jnp.tanh(x), x), lambda x, g: (g * (1 - jnp.tanh(x) ** 2),))

    def loss(p, b):
        def body(h, xt):
            h = jax.checkpoint(lambda h: jnp.tanh(h @ p["u"] + xt @ p["w"]))(h)
            return h, h

        h0 = jnp.zeros((b["x"].shape[0], 4))
        h, _ = lax.scan(body, h0, jnp.swapaxes(b["x"], 0, 1))
        h = lax.cond(jnp.sum(h) > 0, lambda: soft(h), lambda: h)
        return jnp.mean((h @ p["v"] - b["y"]) ** 2)

    r = np.random.default_rng(0)
    p = {k: jnp.asarray(r.standard_normal(s), jnp.float32) * 0.5
         for k, s in (("u", (4, 4)), ("w", (3, 4)), ("v", (4,)))}
    b = {"x": jnp.asarray(r.standard_normal((6, 5, 3)), jnp.float32),
         "y": jnp.asarray(r.standard_normal(6), jnp.float32)}
    # the cond's predicate sums over the batch (a cross-example loss, refused by default):
    # the statistics of the batch-of-one losses, as the oracle below computes them
    m, m2 = js.per_example_stat(
        loss, (js.stats.mean(), js.stats.second_moment()), check=False)(p, b)
    g = jax.jit(jax.vmap(jax.grad(lambda p, x, y: loss(p, {"x": x[None], "y": y[None]})),
                 in_axes=(None, 0, 0)))(p, b["x"], b["y"])
    for k in p:
        np.testing.assert_allclose(m[k], g[k].mean(0), rtol=1e-4, atol=1e-6)
        np.testing.assert_allclose(m2[k], (g[k] ** 2).mean(0), rtol=1e-4, atol=1e-6)


# --------------------------------------------------------------------------- #
# The declared range
# --------------------------------------------------------------------------- #
def test_installed_jax_is_tested():
    assert versions.jax_version_status() is None, versions.jax_version_status()


@pytest.mark.parametrize(
    "version,ok",
    [("0.10.0", True), ("0.10.2", True), ("0.11.1", True), ("0.12.0.1", True),
     ("0.12.7", True), ("0.13.0", False), ("0.13.0rc1", False), ("1.0.0", False),
     ("0.9.2", False)],
)
def test_version_policy(version, ok):
    msg = versions.jax_version_status(version)
    assert (msg is None) == ok
    if not ok:
        assert versions.TESTED_JAX[0] in msg and versions.TESTED_JAX[1] in msg and version in msg


def test_warning_on_untested(monkeypatch):
    monkeypatch.setattr(jax, "__version__", "0.99.0")
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        versions.warn_if_untested()
    assert len(w) == 1 and issubclass(w[0].category, js.UntestedJaxWarning)
    assert "0.99.0" in str(w[0].message)


def test_pyproject_declares_tested_range():
    import pathlib
    import re

    text = (pathlib.Path(__file__).parents[1] / "pyproject.toml").read_text()
    m = re.search(r'"jax>=([0-9.]+),<([0-9.]+)"', text)
    assert m, "pyproject.toml must bound jax on both sides"
    lo, hi = m.groups()
    assert lo == versions.TESTED_JAX[0]
    hi_t = versions._version_tuple(hi)
    top = versions._version_tuple(versions.TESTED_JAX[1])
    assert hi_t == (top[0], top[1] + 1), (hi, versions.TESTED_JAX)


@pytest.mark.skipif(jax.device_count() < 4, reason="needs 4 devices (tests/conftest.py)")
def test_ordering_barrier_keeps_each_operands_axes():
    """Inside shard_map jax 0.10's optimization_barrier gives every output the union
    of its operands' varying axes (jax 0.12 keeps each); `ordering_barrier` keeps them
    on both, or example data tied to model-sharded statistics would change type."""
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((2, 2), ("data", "model"))
    seen = []

    def f(x, w):
        a, (b,) = compat.ordering_barrier((x, [w]))
        seen.append([compat.vma_of(v) for v in (x, w, a, b)])
        return a * 2, b * 3

    put = lambda v, s: jax.device_put(v, jax.sharding.NamedSharding(mesh, s))  # noqa: E731
    out = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(P("data"), P("model")),
                                out_specs=(P("data"), P("model"))))(
        put(jnp.arange(4.0), P("data")), put(jnp.arange(4.0), P("model")))
    x, w, a, b = seen[0]
    assert (a, b) == (x, w) == (frozenset({"data"}), frozenset({"model"}))
    np.testing.assert_allclose(out[0], 2 * np.arange(4.0))
    np.testing.assert_allclose(out[1], 3 * np.arange(4.0))


def test_under_eager_transformations_reads_the_trace_stack():
    """True only where every trace evaluates as it goes (eager grad / jvp / vmap / vjp);
    False under jit, make_jaxpr, jit of grad, a scan body."""
    seen = []

    def f(x):
        seen.append(compat.under_eager_transformations())
        return x

    one = jnp.ones(2)
    f(1.0)
    jax.grad(f)(1.0)
    jax.jvp(f, (1.0,), (1.0,))
    jax.vmap(f)(one)
    jax.vmap(jax.grad(f))(one)
    jax.vjp(f, 1.0)
    assert seen == [True] * 6, seen
    seen.clear()
    jax.make_jaxpr(f)(1.0)
    jax.jit(lambda x: f(x))(2.0)
    jax.jit(jax.grad(lambda x: f(x)))(3.0)
    jax.vmap(jax.jit(lambda x: f(x)))(one)
    lax.scan(lambda c, x: (f(c), None), 1.0, one)
    assert seen == [False] * 5, seen
