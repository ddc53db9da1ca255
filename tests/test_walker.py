"""The one jaxpr walker (jaxpr_surgery/_src/walker.py): the kinds of nesting keyed by
primitive objects, their typed views, the passes built on it, and the paths they share
(a site's path in the analysis is where the interpreter and any walker find it)."""

from __future__ import annotations

import contextlib
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import zoo
from jax import lax
from jax.sharding import PartitionSpec as P
from test_compat import _eqn

import jaxpr_surgery as js
from jaxpr_surgery._src import analysis, compat, interpreter, walker
from jaxpr_surgery._src.independence import control
from jaxpr_surgery._src.independence import interp as ind_interp


@jax.custom_vjp
def _scaled(x):
    return 2.0 * x


_scaled.defvjp(lambda x: (2.0 * x, None), lambda _, g: (2.0 * g,))


@jax.custom_jvp
def _soft(x):
    return jnp.tanh(x)


_soft.defjvp(lambda p, t: (jnp.tanh(p[0]), t[0] * (1 - jnp.tanh(p[0]) ** 2)))


def _every_nest(x):
    y = jax.jit(lambda a: a + 1.0)(x)
    y = jax.checkpoint(lambda a: jnp.sin(a))(y)
    y = _scaled(y) + _soft(y)
    y, _ = jax.lax.scan(lambda c, a: (c + a, c), y, jnp.ones((3,) + y.shape))
    y = jax.lax.while_loop(lambda c: c[0] < 3.0, lambda c: (c[0] + 1.0, c[1] * 0.5), (0.0, y))[1]
    mesh = jax.make_mesh((1,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
    y = jax.shard_map(lambda a: a * 2.0, mesh=mesh, in_specs=P(), out_specs=P())(y)
    return jax.lax.cond(x.sum() > 0, jnp.cos, jnp.sin, y)


def test_nests_are_keyed_by_primitive_objects():
    assert walker.NESTS
    for prim, nest in walker.NESTS.items():
        assert isinstance(prim, compat.Primitive), prim
        assert isinstance(nest, walker.Nest)
    assert set(walker.NESTS.values()) == set(walker.Nest)  # every kind has a primitive
    assert set(walker._VIEWS) == set(walker.Nest)  # and a view


def test_each_nest_has_its_typed_view():
    jaxpr = jax.make_jaxpr(_every_nest)(jnp.arange(4.0)).jaxpr
    seen = {}
    for eqn in walker.equations(jaxpr):
        nest = walker.nest_of(eqn)
        if nest is None:
            continue
        view = walker.nested(eqn)
        seen[nest] = view
        if isinstance(view, walker.Once):
            assert view.nest is nest
            assert len(view.jaxpr.invars) == len(eqn.invars)
            assert len(view.jaxpr.outvars) == len(eqn.outvars)
            assert walker.body(eqn) is view.jaxpr
        elif nest is walker.Nest.SCAN:
            assert view.length == 3 and view.num_carry == 1
        elif nest is walker.Nest.WHILE:
            assert len(eqn.invars) == view.cond_nconsts + view.body_nconsts + 2
        elif nest is walker.Nest.SHARD_MAP:
            assert view.in_specs == (P(),) and view.out_specs == (P(),) and view.check_vma
            assert len(view.jaxpr.invars) == len(eqn.invars)
        else:
            assert nest is walker.Nest.COND and len(view.jaxprs) == 2
            assert all(len(b.invars) == len(eqn.invars) - 1 for b in view.jaxprs)
    assert set(seen) == set(walker.Nest)
    # a body's equations are found at depth (the jit's add, the branches' cos / sin)
    prims = {e.primitive.name for e in walker.equations(jaxpr)}
    assert {"add", "sin", "cos", "tanh"} <= prims
    assert {e.primitive.name for e in walker.equations(jaxpr, enter=lambda e: False)}.isdisjoint(
        {"cos"})


# (the views' params at both ends of jax's range)
def test_scan_params_split_operands():
    w = jnp.arange(4.0)

    def f(x, xs):
        def body(c, y):
            h, k = c
            return (jnp.tanh(h * y["a"] + w.sum()), k + 1.0), h + y["b"]

        return lax.scan(body, (x, x), xs)

    xs = {"a": jnp.ones(3), "b": jnp.arange(3.0)}
    eqn = _eqn(f, 1.0, xs, prim=compat.scan_p)
    sp = walker.nested(eqn)
    assert sp.length == 3 and sp.reverse is False
    # two scanned inputs; both carries change in the body (none forwarded)
    assert len(eqn.invars) == sp.num_consts + sp.num_carry + 2
    assert sp.num_carry == 2
    assert len(eqn.outvars) == sp.num_carry + 1
    assert len(sp.jaxpr.invars) == len(eqn.invars)
    # the view evaluates to the eqn's own result
    ins = [np.ones(v.aval.shape, v.aval.dtype) for v in eqn.invars]
    out = compat.eval_jaxpr(sp.jaxpr, sp.consts, *ins)
    assert len(out) == len(eqn.outvars)


def test_scan_params_reverse_and_unroll():
    eqn = _eqn(
        lambda x: lax.scan(lambda c, y: (c * y, c), x, jnp.ones(5), reverse=True, unroll=2),
        1.0,
        prim=compat.scan_p,
    )
    sp = walker.nested(eqn)
    assert sp.reverse is True and sp.length == 5 and sp.unroll == 2


def test_remat_and_call_params():
    pol = jax.checkpoint_policies.nothing_saveable
    eqn = _eqn(lambda x: jax.checkpoint(jnp.sin, policy=pol)(x), 1.0, prim=compat.remat_p)
    rp = walker.nested(eqn)
    assert rp.policy is pol and isinstance(rp.prevent_cse, bool)
    assert isinstance(rp.jaxpr, compat.Jaxpr)
    eqn = _eqn(lambda x: jax.jit(lambda y: jnp.sin(y) * 2)(x), 1.0, prim=compat.jit_p)
    view = walker.nested(eqn)
    jaxpr = view.jaxpr
    assert isinstance(view, walker.Once) and view.nest is walker.Nest.CALL
    assert isinstance(jaxpr, compat.Jaxpr) and len(jaxpr.invars) == 1


def test_unknown_layout_raises_by_name():
    eqn = _eqn(lambda x: lax.scan(lambda c, y: (c * y, c), x, jnp.ones(2)), 1.0,
               prim=compat.scan_p)
    fake = types.SimpleNamespace(primitive=eqn.primitive, invars=eqn.invars,
                                 outvars=eqn.outvars, params={"jaxpr": None, "length": 2})
    with pytest.raises(compat.UnsupportedJaxError, match="scan"):
        walker.nested(fake)
    with pytest.raises(compat.UnsupportedJaxError, match="jit"):  # (a primitive bound
        # under an intercepting trace: no equation yet, its binding)
        walker.view_of(walker.Binding(compat.jit_p, {}, 0, 0))


def test_path_to_finds_a_nested_equation():
    jaxpr = jax.make_jaxpr(_every_nest)(jnp.arange(4.0)).jaxpr
    cos = next(e for e in walker.equations(jaxpr) if e.primitive.name == "cos")
    path = walker.path_to(jaxpr, cos)
    assert path[-1] is cos and walker.nest_of(path[0]) is walker.Nest.COND
    assert walker.path_to(jaxpr, object()) is None


def test_every_pass_is_a_walker():
    for cls in (analysis._Analyzer, interpreter.Evaluator, ind_interp._Interp,
                control._Numbering):
        assert issubclass(cls, walker.Walker), cls
        assert cls.ENTER and set(cls.ENTER) <= set(walker.Nest), cls


class _Recorder(walker.Walker):
    """Records the equation at every path it walks; enters what ``ENTER`` says."""

    def __init__(self):
        self.at = {}

    def step(self, eqn, ins, path):
        self.at[path] = eqn
        return super().step(eqn, ins, path)

    def equation(self, eqn, ins, path):
        return [None] * len(eqn.outvars)

    def once(self, eqn, view, ins, path):
        return self.run(view.jaxpr, ins, path)

    def loop(self, eqn, prm, ins, path):
        self.run(prm.jaxpr, ins, path)
        return [None] * len(eqn.outvars)

    ENTER = {walker.Nest.CALL: once, walker.Nest.REMAT: once, walker.Nest.SCAN: loop}


def test_a_kind_without_a_hook_is_an_equation():
    jaxpr = jax.make_jaxpr(_every_nest)(jnp.arange(4.0)).jaxpr
    opaque = type("Opaque", (_Recorder,), {"ENTER": {}})()
    opaque.run(jaxpr, [None] * len(jaxpr.invars))
    assert all(len(p) == 1 for p in opaque.at)  # nothing entered
    rec = _Recorder()
    rec.run(jaxpr, [None] * len(jaxpr.invars))
    deep = {p: e for p, e in rec.at.items() if len(p) > 1}
    assert {e.primitive.name for e in deep.values()} >= {"add", "sin"}
    assert "cos" not in {e.primitive.name for e in rec.at.values()}  # cond: not entered


def _layered_loss(params, batch):
    """Dense layers in a scan, each a jitted matmul under checkpoint, then a head."""

    @jax.jit
    def dense(w, h):
        return jnp.tanh(h @ w)

    def layer(h, w):
        return jax.checkpoint(dense)(w, h), None

    h, _ = jax.lax.scan(layer, batch["x"], params["ws"])
    return jnp.mean((h @ params["head"] - batch["y"]) ** 2)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_sites_sit_at_the_walkers_paths(monkeypatch, dtype):
    """Every site the analysis records is, at its path, the equation the walker finds
    there, through scan, checkpoint and jit; and the statistic those paths serve equals
    the oracle's."""
    found = []
    real = analysis.analyse_jaxpr

    def spy(jaxpr, *a, **k):
        out = real(jaxpr, *a, **k)
        found.append((jaxpr, out))
        return out

    monkeypatch.setattr(analysis, "analyse_jaxpr", spy)
    rng = np.random.default_rng(0)
    params = {"ws": rng.normal(size=(3, 5, 5)).astype(dtype) * 0.5,
              "head": rng.normal(size=(5, 2)).astype(dtype)}
    batch = {"x": rng.normal(size=(7, 4, 5)).astype(dtype),
             "y": rng.normal(size=(7, 4, 2)).astype(dtype)}
    with zoo.x64() if dtype == np.float64 else contextlib.nullcontext():
        got = js.per_example_stat(_layered_loss, js.stats.second_moment())(params, batch)
        per = jax.vmap(jax.grad(lambda p, x, y: _layered_loss(p, {"x": x[None], "y": y[None]})),
                       in_axes=(None, 0, 0))(params, batch["x"], batch["y"])
    want = jax.tree.map(lambda g: np.mean(np.asarray(g, np.float64) ** 2, 0), per)
    tol = 1e-10 if dtype == np.float64 else 2e-5
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=tol, atol=tol)
    jaxpr, an = found[-1]
    rec = _Recorder()
    rec.run(jaxpr, [None] * len(jaxpr.invars))
    assert an.sites and any(len(p) >= 3 for p in an.sites)  # scan > checkpoint > jit
    for p, site in an.sites.items():
        assert rec.at[p] is site.eqn, p


def test_every_walker_keeps_runs_signature():
    """`walker.Walker.run(jaxpr, ins, path, *ctx, consts=)` means the same in every pass
    (one may add keyword arguments): the evaluator's and the proof's entry points, which
    take other arguments, are named otherwise (`Evaluator.evaluate`, `_Interp.tags_of`);
    they shadowed `run` with other parameters (the walkers' leftover of issue 60)."""
    import inspect

    import jaxpr_surgery._src.analysis  # noqa: F401 - every pass, imported
    import jaxpr_surgery._src.explicit  # noqa: F401
    import jaxpr_surgery._src.independence  # noqa: F401
    import jaxpr_surgery._src.interpreter  # noqa: F401
    from jaxpr_surgery._src import walker

    def subclasses(c):
        for s in c.__subclasses__():
            yield s
            yield from subclasses(s)

    passes = sorted({c for c in subclasses(walker.Walker)}, key=lambda c: c.__qualname__)
    assert {c.__name__ for c in passes} >= {"_Analyzer", "Evaluator", "_Interp", "_Numbering"}
    for cls in passes:
        inspect.signature(cls.run).bind(None, "jaxpr", [], (), consts=None)
