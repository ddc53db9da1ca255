"""per_example_stat under jax.jit: equals eager and the vmap(grad) oracle;
static non-array arguments; jit (and checkpoint) nested inside the loss."""

from __future__ import annotations

import functools

import _models as M
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxpr_surgery as js


@pytest.mark.parametrize("name", ["mlp", "transformer"])
def test_jit_matches_oracle_every_statistic(name):
    res = M.result_of(name)  # jit(per_example_stat(loss, all_stats()))
    ora = M.oracle_of(name)
    for stat in M.STAT_NAMES:
        M.assert_stat_close(stat, res[stat], ora[stat])


def test_jit_equals_eager():
    loss, params, batch = M.get("mlp")
    # eager mode dispatches op by op (slow): two statistics covering the direct
    # path (Centered) and the ingredients path (global norms, clipping)
    stat = {"variance": js.stats.variance(), "clipped_mean": js.stats.clipped_mean(M.CLIP)}
    fn = js.per_example_stat(loss, stat)
    eager = fn(params, batch)
    jitted = jax.jit(fn)(params, batch)
    M.assert_tree_close(jitted, eager, rtol=1e-5, atol=1e-6, err_msg="jit vs eager")
    ora = M.oracle_of("mlp")
    for k in stat:
        M.assert_stat_close(k, eager[k], ora[k])


def test_jit_value_and_stat_loss_and_aux():
    loss, params, batch = M.get("mlp")

    def loss_aux(p, b):
        per = jax.vmap(lambda x, y: M.mlp_loss(p, {"x": x[None], "y": y[None]}))(b["x"], b["y"])
        return jnp.mean(per), {"per": per, "first_x": b["x"][:, 0]}

    vfn = jax.jit(js.value_and_per_example_stat(loss_aux, js.stats.mean(), has_aux=True))
    (l, aux), mean = vfn(params, batch)
    per = jax.vmap(M.per_example_loss(loss), in_axes=(None, 0))(params, batch)
    np.testing.assert_allclose(l, jnp.mean(per), rtol=1e-6)
    np.testing.assert_allclose(l, loss(params, batch), rtol=1e-6)
    # aux: per-example outputs stacked on axis 0
    np.testing.assert_allclose(aux["per"][:, 0], per, rtol=1e-6)
    np.testing.assert_allclose(aux["first_x"][:, 0], batch["x"][:, 0])
    M.assert_tree_close(mean, jax.grad(loss)(params, batch), err_msg="mean")


def _scaled_loss(params, batch, scale, activation):
    act = {"tanh": jnp.tanh, "relu": jax.nn.relu}[activation]
    h = act(batch["x"] @ params["l1"]["w"] + params["l1"]["b"])
    logits = h @ params["l2"]["w"] + params["l2"]["b"]
    logp = jax.nn.log_softmax(logits, axis=-1)
    nll = -jnp.take_along_axis(logp, batch["y"][:, None], axis=-1)[:, 0]
    return scale * jnp.mean(nll)


@pytest.mark.parametrize("activation", ["tanh", "relu"])
def test_jit_static_non_array_args(activation):
    _, params, batch = M.get("mlp")
    stat = {"mean": js.stats.mean(), "sq_norms": js.stats.sq_norms()}
    fn = js.per_example_stat(_scaled_loss, stat)
    # scale (python float) and activation (str) static under jit
    jitted = jax.jit(fn, static_argnums=(2, 3))
    res = jitted(params, batch, 2.5, activation)
    loss = functools.partial(_scaled_loss, scale=2.5, activation=activation)
    ora = M.oracle(lambda p, b: loss(p, b), params, batch)
    M.assert_stat_close("mean", res["mean"], ora["mean"])
    M.assert_stat_close("sq_norms", res["sq_norms"], ora["sq_norms"])
    # a traced array for the non-batch, non-param argument gives the same
    res2 = jax.jit(fn, static_argnums=(3,))(params, batch, jnp.float32(2.5), activation)
    M.assert_tree_close(res2, res, rtol=1e-5, atol=1e-7, err_msg="traced scale")


_inner_calls = []


@jax.jit
def _inner_dense(x, w, b):
    _inner_calls.append(1)
    return jnp.tanh(x @ w + b)


def _nested_loss(params, batch):
    h = _inner_dense(batch["x"], params["l1"]["w"], params["l1"]["b"])

    @jax.checkpoint
    def head(h, w, b):
        return h @ w + b

    logits = jax.jit(head)(h, params["l2"]["w"], params["l2"]["b"])
    logp = jax.nn.log_softmax(logits, axis=-1)
    nll = -jnp.take_along_axis(logp, batch["y"][:, None], axis=-1)[:, 0]
    return jnp.mean(nll)


def test_nested_jit_inside_loss():
    _, params, batch = M.get("mlp")
    # the same model as M.mlp_loss, written with jit and checkpoint inside
    np.testing.assert_allclose(_nested_loss(params, batch), M.mlp_loss(params, batch), rtol=1e-6)
    stat = {k: M.STATS[k]() for k in ("mean", "second_moment", "variance", "sq_norms",
                                      "clipped_mean")}
    res = jax.jit(js.per_example_stat(_nested_loss, stat))(params, batch)
    ora = M.oracle_of("mlp")
    for k in stat:
        M.assert_stat_close(k, res[k], ora[k])
    # the analysis sees through the nested jit / checkpoint: no fallback
    rep = js.explain(_nested_loss)(params, batch)
    assert rep.fallback_leaves == [], str(rep)
    kinds = {leaf.path: leaf.kinds for leaf in rep.leaves}
    assert kinds["['l1']['w']"] == ["dense"], str(rep)
    assert kinds["['l2']['w']"] == ["dense"], str(rep)


def test_jit_keep_batch_dim_false():
    """fn written for one example without a batch axis."""
    loss, params, batch = M.get("mlp")

    def one_example_loss(p, ex):
        return M.mlp_loss(p, jax.tree.map(lambda x: x[None], ex))

    stat = {"mean": js.stats.mean(), "norms": js.stats.norms()}
    out = jax.jit(js.per_example_stat(one_example_loss, stat, keep_batch_dim=False))(params, batch)
    ora = M.oracle_of("mlp")
    for k in stat:
        M.assert_stat_close(k, out[k], ora[k])


# --------------------------------------------------------------------------- #
# Keyword arguments; eager calls trace once per signature
# --------------------------------------------------------------------------- #
def test_keyword_arguments_pass_through():
    def loss(w, b, scale=1.0):
        return scale * jnp.mean((b["x"] @ w) ** 2)

    w, b = jnp.ones(3), {"x": jnp.arange(12.0).reshape(4, 3)}
    m = js.per_example_stat(loss, js.stats.mean())(w, b, scale=2.0)
    np.testing.assert_allclose(m, jax.grad(loss)(w, b, scale=2.0), rtol=1e-6)
    (l, ), _ = (js.value_and_per_example_stat(loss, js.stats.mean())(w, b, scale=3.0)[0],), None
    np.testing.assert_allclose(l, loss(w, b, scale=3.0), rtol=1e-6)


def test_eager_calls_trace_once_per_signature(monkeypatch):
    """A second call with new values of the same shapes neither traces the loss again
    nor repeats the package's analysis and planning (eagerly, and under one jit)."""
    from jaxpr_surgery._src import analysis, plans

    w, b = M.lin_case()
    count = {"n": 0, "analysis": 0, "plan": 0}

    def loss(w, b):
        count["n"] += 1
        return jnp.mean((b["x"] @ w - b["y"]) ** 2)

    def counted(name, fn):
        def wrapper(*a, **k):
            count[name] += 1
            return fn(*a, **k)
        return wrapper

    monkeypatch.setattr(analysis, "analyse_jaxpr", counted("analysis", analysis.analyse_jaxpr))
    monkeypatch.setattr(plans, "make_plan", counted("plan", plans.make_plan))
    f = js.per_example_stat(loss, js.stats.second_moment())
    first = f(w, b)
    seen = dict(count)
    assert seen["analysis"] >= 1 and seen["plan"] >= 1
    second = f(w + 1.0, b)  # same signature: no new trace, analysis or plan
    assert count == seen
    assert not np.allclose(first, second)
    g = jax.jit(f)
    g(w, b)
    seen = dict(count)
    g(w - 1.0, b)
    assert count == seen
    f(w, {"x": b["x"][:4], "y": b["y"][:4]})  # new shape: traced again
    assert count["n"] > seen["n"] and count["analysis"] > seen["analysis"]


def test_eager_grad_and_vmap_of_a_statistic_are_compiled_once():
    """Under ``jax.grad`` / ``jax.vmap`` applied eagerly (no jit around them) the
    statistic's program is compiled, not run one operation at a time: a second call
    neither re-traces the loss nor re-analyses it; values equal the jitted ones, also
    with a tracer closed over by the loss (a scale differentiated through)."""
    w, b = M.lin_case()
    count = {"n": 0}

    def loss(w, b, s=1.0):
        count["n"] += 1
        return s * jnp.mean((b["x"] @ w - b["y"]) ** 2)

    f = js.per_example_stat(loss, js.stats.variance())

    def obj(w, s):
        return jnp.sum(f(w, b, s=s) ** 2)

    g = jax.grad(obj, argnums=(0, 1))
    first = g(w, 1.5)
    n = count["n"]
    second = g(w + 0.5, 1.5)  # same signature: no new trace of the loss
    assert count["n"] == n
    for a, e in zip(first, jax.jit(g)(w, 1.5)):
        np.testing.assert_allclose(a, e, rtol=1e-5, atol=1e-7)
    for a, e in zip(second, jax.jit(g)(w + 0.5, 1.5)):
        np.testing.assert_allclose(a, e, rtol=1e-5, atol=1e-7)

    # a loss closing over a tracer of the eager grad
    def closed(s):
        return jnp.sum(js.per_example_stat(lambda w, b: s * loss(w, b), js.stats.mean())(w, b))

    np.testing.assert_allclose(jax.grad(closed)(2.0), jax.jit(jax.grad(closed))(2.0), rtol=1e-5)

    # eager vmap over a stack of weights (an ensemble)
    ws = jnp.stack([w, 2 * w, -w])
    v = jax.vmap(lambda w: f(w, b))
    out = v(ws)
    n = count["n"]
    v(ws + 1.0)
    assert count["n"] == n
    np.testing.assert_allclose(out, jax.jit(v)(ws), rtol=1e-5, atol=1e-7)
    for i in range(3):
        np.testing.assert_allclose(out[i], f(ws[i], b), rtol=1e-5, atol=1e-7)
