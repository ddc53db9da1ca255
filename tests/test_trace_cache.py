"""Repeated layers are traced once (fingerprint.py), and only layers that really are the
same share a trace: layers differing in one literal, one layout, one input or whether an
input depends on the example each get their own, checked against vmap(grad)."""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import zoo
from _models import all_eqns

import jaxpr_surgery as js
from jaxpr_surgery._src import compat, interpreter
from jaxpr_surgery._src import fingerprint as fp
from jaxpr_surgery._src.sites import dense

D, T = 6, 5


def _grads(loss, params, batch):
    one = lambda p, ex: loss(p, jax.tree.map(lambda a: a[None], ex))  # noqa: E731
    return jax.jit(jax.vmap(jax.grad(one), (None, 0)))(params, batch)


def _oracle(g, names):
    """``(statistics, expected values)`` for ``names`` from per-example gradients ``g``
    (leaves [B, ...]) by the zoo's oracle; clipping at the median per-example norm."""
    C = float(np.median(np.sqrt(zoo.oracle_from_grads(g, "sq_norms"))))
    kw = {"clipped_mean": {"clip_norm": C}}
    stats = tuple(getattr(js.stats, n)(**kw.get(n, {})) for n in names)
    return stats, tuple(zoo.oracle_from_grads(g, n, **kw.get(n, {})) for n in names)


def _stack(L, loss_layer):
    def loss(params, batch):
        h = batch["x"]
        for i in range(L):
            h = loss_layer(h, params[f"l{i}"])
        return jnp.mean(jnp.sum((h - batch["y"]) ** 2, axis=(-2, -1)))

    return loss


def _case(L, dtype, B=7, seed=0):
    r = np.random.default_rng(seed)
    n = lambda *s: jnp.asarray(r.standard_normal(s) / np.sqrt(s[0]), dtype)  # noqa: E731
    params = {f"l{i}": {"w": n(D, D), "b": n(D)} for i in range(L)}
    batch = {"x": n(B, T, D), "y": n(B, T, D)}
    return params, batch


def _layer(h, p):
    return jnp.tanh(h @ p["w"] + p["b"])


def test_identical_layers_trace_their_site_once(monkeypatch):
    calls = {"prepare": 0, "segments": 0}
    prepare, segment_fn = dense.DenseKernel.prepare, interpreter._segment_fn

    def counting_prepare(self, *a, **k):
        calls["prepare"] += 1
        return prepare(self, *a, **k)

    def counting_segment_fn(*a, **k):
        calls["segments"] += 1
        return segment_fn(*a, **k)

    monkeypatch.setattr(dense.DenseKernel, "prepare", counting_prepare)
    monkeypatch.setattr(interpreter, "_segment_fn", counting_segment_fn)
    L = 6
    params, batch = _case(L, jnp.float32)
    jax.jit(js.per_example_stat(_stack(L, _layer), js.stats.second_moment())).lower(params, batch)
    # one dense site kind (all layers alike); the bias add + tanh of every layer is
    # one run of ordinary equations, traced once; the loss tail is another
    assert calls["prepare"] == 1, calls
    assert calls["segments"] <= 3, calls


def _twins(params, batch):
    """Consecutive layers identical but for one thing each that the key must see."""
    x = batch["x"]
    c = jnp.linspace(0.5, 1.5, D, dtype=x.dtype)  # an example-independent input
    x0, c0 = x[:, 0], c[None]  # alike but for depending on the example or not
    h = jnp.tanh(x @ params["a"] * 2.0)
    h = jnp.tanh(h @ params["b"] * 3.0)  # another literal in the run after the site
    h = jnp.tanh(h @ (params["c"] * 2.0))  # a literal inside the site (absorbed pre-op)
    h = jnp.tanh(h @ (params["d"] * 3.0))
    h = jnp.tanh(h @ params["e"].T)  # the same shapes through a transposed view
    h = jnp.tanh(jnp.einsum("btd,ed->bte", h, params["f"]))  # other dimension numbers
    h = jnp.tanh(h * params["g"] + params["h"])  # scale-shift sites
    h = jnp.tanh(h * params["k"] + c * params["m"])  # ... one with a constant input
    h = jnp.tanh(h @ params["n"] + x0)  # a second batched input
    h = jnp.tanh(h @ params["o"] + c0)  # ... an unbatched one of the same shape
    h = jnp.tanh(h @ params["p"])
    return jnp.mean(jnp.sum((h - batch["y"]) ** 2, axis=(-2, -1)))


def _twins_case(dtype, B=7):
    r = np.random.default_rng(3)
    n = lambda *s: jnp.asarray(r.standard_normal(s) / np.sqrt(s[0]), dtype)  # noqa: E731
    params = {k: n(D, D) for k in "abcdefnop"}
    params.update({k: 1.0 + 0.3 * n(D) for k in "gk"})
    params.update({k: n(D) for k in "hm"})
    batch = {"x": n(B, T, D), "y": n(B, T, D)}
    return params, batch


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64])
@pytest.mark.parametrize("chunk", [None, 3])
def test_near_identical_layers_keep_their_own_statistics(dtype, chunk):
    def run():
        params, batch = _twins_case(dtype)
        names = ("mean", "second_moment", "variance", "sign_mean", "sq_norms", "clipped_mean")
        stats, want = _oracle(_grads(_twins, params, batch), names)
        # x0 = x[:, 0] is added along T: the model runs on one example only, not on the
        # whole batch (which the cross-example check traces): check=False
        got = jax.jit(js.per_example_stat(_twins, stats, chunk_size=chunk, check=False))(
            params, batch)
        tol = dict(rtol=2e-4, atol=2e-6) if dtype == jnp.float32 else dict(rtol=1e-10, atol=1e-13)
        for k, (a, w) in enumerate(zip(got, want)):
            if k == 3 and dtype == jnp.float32:
                continue  # signs of near-zero float32 entries; float64 checks them exactly
            for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(w)):
                np.testing.assert_allclose(x, y, **tol, err_msg=f"stat {k} {path}")

    with zoo.x64() if dtype == jnp.float64 else contextlib.nullcontext():
        run()


def test_value_keys_are_exact():
    assert fp.value_key(1) != fp.value_key(1.0) != fp.value_key(True)
    assert fp.value_key((1, 2)) != fp.value_key([1, 2])
    assert fp.value_key(np.arange(3)) == fp.value_key(np.arange(3))
    assert fp.value_key(np.arange(3)) != fp.value_key(np.arange(3).astype(np.float32))
    assert fp.value_key(np.array([1, 2])) != fp.value_key(np.array([1, 3]))
    assert fp.value_key({"a": 1, "b": (2,)}) == fp.value_key({"b": (2,), "a": 1})
    with pytest.raises(fp.Unkeyable):
        fp.value_key(jnp.ones(3))  # a device array: no exact key, never cached
    with pytest.raises(fp.Unkeyable):
        fp.value_key({"a": [np.ones(2), jnp.zeros(2)]})
    assert fp.keyed(lambda: fp.value_key(jnp.ones(3))) is None


def test_traced_parameter_values_are_not_cached():
    """A closure over a traced value (here a hyper-parameter under jit) lands in the
    jaxpr as an input, never in a key; the statistic still follows it."""
    params, batch = _case(3, jnp.float32)

    def loss(p, b, s):
        return _stack(3, lambda h, q: jnp.tanh(s * (h @ q["w"]) + q["b"]))(p, b)

    @jax.jit
    def f(p, b, s):
        return js.per_example_stat(lambda p, b: loss(p, b, s), js.stats.second_moment())(p, b)

    for s in (0.5, 2.0):
        g = _grads(lambda p, b, s=s: loss(p, b, s), params, batch)
        want = zoo.oracle_from_grads(g, "second_moment")
        for a, w in zip(jax.tree.leaves(f(params, batch, s)), jax.tree.leaves(want)):
            np.testing.assert_allclose(a, w, rtol=2e-4, atol=1e-6)


# --------------------------------------------------------------------------- #
# Blocks: a repeated layer of an unrolled model is one cached jit
# --------------------------------------------------------------------------- #
def _top_level_runs(monkeypatch, L, layer=_layer):
    """The runs ``(start, stop)`` of top-level equations the interpreter walks (traces)
    for an L-layer stack."""
    runs = []
    walk = interpreter.Evaluator.walk

    def counting(self, jaxpr, env, path, start, stop, sinks):
        if path == ():
            runs.append((start, stop))
        return walk(self, jaxpr, env, path, start, stop, sinks)

    monkeypatch.setattr(interpreter.Evaluator, "walk", counting)
    params, batch = _case(L, jnp.float32)
    jax.jit(js.per_example_stat(_stack(L, layer), js.stats.second_moment())).lower(params, batch)
    return runs


def test_tracing_work_does_not_grow_with_depth(monkeypatch):
    """The second and later layers bind the first layer's block: the equations the
    interpreter walks are the same for 4 and for 9 layers."""
    walked = [sum(b - a for a, b in _top_level_runs(monkeypatch, L)) for L in (4, 9)]
    assert walked[0] == walked[1], walked


def _blocky(params, batch):
    """Repeated layers with what a block must not get wrong: a value read far after
    its layer (a skip to the head), a layer that differs from its neighbours only in
    its activation, a weight shared by two layers (a multi-site leaf across blocks),
    and a layer whose input is the same array for every example."""
    h = batch["x"]
    c = jnp.linspace(-1.0, 1.0, T * D, dtype=h.dtype).reshape(T, D)
    outs = []
    for i in range(6):
        p = params[f"l{i}"]
        w = params["l1"]["w"] if i == 4 else p["w"]  # tied with layer 1
        act = jax.nn.relu if i == 3 else jnp.tanh
        h = act(h @ w + p["b"]) + 0.5 * h
        outs.append(h)
    h = h + outs[0] * outs[2]  # read long after their blocks
    h = h + jnp.tanh(c @ params["l5"]["w"])  # an example-independent site input
    return jnp.mean(jnp.sum((h - batch["y"]) ** 2, axis=(-2, -1)))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64])
@pytest.mark.parametrize("chunk", [None, 3])
def test_blocks_keep_every_statistic_exact(dtype, chunk):
    def run():
        params, batch = _case(6, dtype, B=5, seed=4)
        names = ("mean", "second_moment", "variance", "sq_norms", "clipped_mean")
        stats, want = _oracle(_grads(_blocky, params, batch), names)
        tol = dict(rtol=2e-4, atol=2e-6) if dtype == jnp.float32 else dict(rtol=1e-10, atol=1e-13)
        # every statistic alone (each its own plan: direct sites, clipping's kept
        # ingredients) and all together (ingredients)
        singles = tuple(
            jax.jit(js.per_example_stat(_blocky, s, chunk_size=chunk))(params, batch)
            for s in stats
        )
        together = jax.jit(js.per_example_stat(_blocky, stats, chunk_size=chunk))(params, batch)
        for got in (singles, together):
            for k, (a, w) in enumerate(zip(got, want)):
                for (path, x), y in zip(
                    jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(w)
                ):
                    np.testing.assert_allclose(x, y, **tol, err_msg=f"stat {k} {path}")

    with zoo.x64() if dtype == jnp.float64 else contextlib.nullcontext():
        run()


def test_blocks_of_as_many_equations_with_other_outputs():
    """Two repeated spans of as many equations whose outputs differ in number (a site and
    ``tanh``; the same site and a ``fori_loop`` of two outputs, after an embedding) are
    blocks that return their own outputs: matched by position across blocks of one
    length, the loop's second output was looked up in the first block (an IndexError,
    found by a fuzz run of the random models). Against the oracle, the weight used in
    both blocks."""
    def loss(p, b):
        h = jnp.tanh(p["e"][b["ids"]] @ p["a"])
        h = jax.lax.fori_loop(0, 2, lambda i, h: jnp.tanh(h @ p["b"]), h @ p["a"])
        return jnp.mean((h @ p["c"])[:, 0] ** 2)

    with zoo.x64():
        r = np.random.default_rng(0)
        params = {k: jnp.asarray(r.normal(size=s)) for k, s in
                  (("e", (7, 5)), ("a", (5, 5)), ("b", (5, 5)), ("c", (5, 1)))}
        batch = {"ids": jnp.asarray([1, 4, 6], jnp.uint8)}
        stats, want = _oracle(_grads(loss, params, batch), ("second_moment", "sq_norms"))
        got = jax.jit(js.per_example_stat(loss, stats))(params, batch)
        for a, w in zip(got, want):
            for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(w)):
                np.testing.assert_allclose(x, y, rtol=1e-10, atol=1e-13)


@pytest.mark.parametrize("name", zoo.CORE_ZOO)
def test_static_ingredient_shapes_match_the_traced_ones(name, monkeypatch):
    """Kernels that size their ingredients without tracing (`ingredient_avals`) give
    exactly what tracing ``prepare`` gives, on every model of the zoo."""
    from jaxpr_surgery._src import engine
    from jaxpr_surgery._src import sink_keys as K
    from jaxpr_surgery._src.sites import base

    sink_avals = engine._sink_avals
    checked = []

    def both(plan, site, B, cache):
        static = sink_avals(plan, site, B, cache)
        kernel = plan.kernels[site.path]
        with monkeypatch.context() as m:
            m.setattr(type(kernel), "ingredient_avals", base.Kernel.ingredient_avals)
            traced = sink_avals(plan, site, B, fp.TraceCache())
        assert jax.tree.structure(static) == jax.tree.structure(traced), site.kind
        for a, b in zip(jax.tree.leaves(static), jax.tree.leaves(traced)):
            assert (a.shape, a.dtype) == (b.shape, b.dtype), (site.kind, a, b)
        if K.INGREDIENTS in static and base.Kernel.ingredient_avals is not type(
            kernel
        ).ingredient_avals:
            checked.append(site.kind)
        return static

    monkeypatch.setattr(engine, "_sink_avals", both)
    case = zoo.get_case(name)
    # one-pass clipping keeps every site's ingredients (variance too, on multi-site leaves)
    stat = (js.stats.clipped_mean(1.0), js.stats.variance())
    jax.jit(js.per_example_stat(case.loss_fn, stat)).lower(case.params, case.batch)
    if name in ("mlp", "transformer"):
        assert checked, "no kernel sized its ingredients statically"


# --------------------------------------------------------------------------- #
# Per-leaf epilogues traced once per leaf type (fingerprint.traced_once)
# --------------------------------------------------------------------------- #
def test_traced_once_traces_once_per_leaf_type_and_keys_what_it_reads():
    traces = []

    @fp.traced_once
    def f(x, n, flag):
        traces.append((x.shape, n, flag))
        return x * n if flag else x - n

    def body(xs):
        return [f(x, 2, True) for x in xs] + [f(xs[0], 3, True), f(xs[0], 2, False)]

    xs = [jnp.arange(4.0) + i for i in range(5)] + [jnp.ones((2, 2))]
    out = jax.jit(body)(xs)
    # one trace per shape and per static argument value, not one per call
    assert sorted(traces, key=str) == sorted(
        [((4,), 2, True), ((2, 2), 2, True), ((4,), 3, True), ((4,), 2, False)], key=str)
    want = [x * 2 for x in xs] + [xs[0] * 3, xs[0] - 2]
    for o, w in zip(out, want):
        np.testing.assert_array_equal(o, w)
    # eagerly (no tracer) it runs as it is: nothing traced, nothing cached
    traces.clear()
    np.testing.assert_array_equal(f(xs[0], 2, True), xs[0] * 2)
    assert traces == [((4,), 2, True)]


def test_traced_once_keys_the_example_weight_state_and_skips_unkeyable_arguments():
    from jaxpr_surgery._src import example_weights as ew

    @fp.traced_once
    def f(x, obj):
        return x + (1.0 if ew.is_open() else 0.0) + obj.c

    class Obj:  # no exact key (not a frozen dataclass): no cache, never a wrong hit
        def __init__(self, c):
            self.c = c

    def body(x):
        a = f(x, Obj(1.0))
        b = f(x, Obj(2.0))
        with ew.opened():
            c = f(x, Obj(1.0))
        return a, b, c

    a, b, c = jax.jit(body)(jnp.zeros(3))
    np.testing.assert_array_equal(a, np.ones(3))
    np.testing.assert_array_equal(b, 2 * np.ones(3))
    np.testing.assert_array_equal(c, 2 * np.ones(3))


def test_many_leaves_of_a_few_types_trace_the_epilogue_once_per_type(monkeypatch):
    """A 12-layer model's variance and kurtosis: the centred moments' finish runs its
    equations once per leaf type, however many leaves; and the values stay exact."""
    from jaxpr_surgery._src import stats_research

    L = 12
    loss = _stack(L, _layer)
    calls = []
    inner = stats_research.CentralMoments.finish.__wrapped__

    def counting(self, acc, n):
        calls.append(jnp.shape(acc.s1))
        return inner(self, acc, n)

    monkeypatch.setattr(stats_research.CentralMoments, "finish", fp.traced_once(counting))
    with zoo.x64():
        params, batch = _case(L, jnp.float64, B=5)
        g = _grads(loss, params, batch)
        stats, want = _oracle(g, ("variance", "kurtosis"))
        got = jax.jit(js.per_example_stat(loss, stats))(params, batch)
    assert len(set(calls)) <= 2 and len(calls) <= 2 * 2, calls  # (w [D, D] and b [D])
    for s, w in zip(got, want):
        for a, b in zip(jax.tree.leaves(s), jax.tree.leaves(w)):
            np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-12)


def test_clipped_sums_read_finite_inputs_once_per_layer_type(monkeypatch):
    """A clipped sum that drops the examples whose gradient is not finite reads each
    site's kept inputs with their non-finite entries as zeros: those selects are traced
    with the site's weighted sum, once per layer type, not once per leaf (3 and 12
    layers trace as many); the values stay exact."""
    from jaxpr_surgery._src import clipping

    inner = clipping._finite_only
    counts = {}
    for L in (3, 12):
        calls = []

        def counting(x, zero=0, calls=calls):
            calls.append(jnp.shape(x))
            return inner(x, zero)

        monkeypatch.setattr(clipping, "_finite_only", counting)
        loss = _stack(L, _layer)
        with zoo.x64():
            params, batch = _case(L, jnp.float64, B=5)
            g = _grads(loss, params, batch)
            stats, want = _oracle(g, ("clipped_mean",))
            got = jax.jit(js.per_example_stat(loss, stats, chunk_size=None))(params, batch)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-12)
        counts[L] = len(calls)
    assert 0 < counts[3] == counts[12], counts


@pytest.mark.parametrize("name", ["clipped_mean", "nonfinite_count"])
def test_per_example_flag_over_many_leaves_is_one_reduction(name):
    """Whether an example's gradient is finite, over a model's leaves: one reduction over
    the stacked leaves (`norms.stacked_parts`), not a chain of ``and``s that XLA copied
    into each of the leaves' consumers (quadratic: GPT-2 small's 148 leaves gave 22,000
    is-finite ops and 5x grad's compile time)."""
    L, D = 16, 8
    r = np.random.default_rng(0)
    params = [{"w": jnp.asarray(r.standard_normal((D, D)) / 3, jnp.float32),
               "b": jnp.asarray(r.standard_normal(D), jnp.float32)} for _ in range(L)]
    batch = {"x": jnp.asarray(r.standard_normal((1, 4, D)), jnp.float32)}  # (B = 1: XLA
    # then fused the chain into every consumer)

    def loss(params, batch):
        h = batch["x"]
        for p in params:
            h = jnp.tanh(h @ p["w"] + p["b"])
        return jnp.mean(jnp.sum(h**2, axis=(-2, -1)))

    stat = js.stats.clipped_mean(1.0) if name == "clipped_mean" else js.stats.nonfinite_count()
    f = jax.jit(js.per_example_stat(loss, stat))
    hlo = f.lower(params, batch).compile().as_text()
    n_leaves = 2 * L
    assert hlo.count("is-finite(") <= 4 * n_leaves, hlo.count("is-finite(")  # (chain: 1104)


def test_traced_once_runs_concrete_arrays_as_they_are_and_keeps_a_bounded_cache(monkeypatch):
    seen = []

    @fp.traced_once
    def f(x, n):
        seen.append(type(n))
        return x * (2.0 if float(n) > 0 else -1.0)  # reads n's value: must stay concrete

    monkeypatch.setattr(fp, "_ONCE", type(fp._ONCE)())
    monkeypatch.setattr(fp, "_ONCE_SIZE", 3)
    one, minus = jnp.asarray(1.0), jnp.asarray(-1.0)  # (concrete: made outside the trace)
    out = jax.jit(lambda x: [f(x, one), f(x, minus)])(jnp.ones(2))
    np.testing.assert_array_equal(out[0], 2 * np.ones(2))
    np.testing.assert_array_equal(out[1], -np.ones(2))
    assert len(fp._ONCE) == 0  # (no key: run as they are)
    jax.jit(lambda x: [f(x, k) for k in range(1, 8)])(jnp.ones(2))
    assert len(fp._ONCE) == 3, len(fp._ONCE)


@pytest.mark.parametrize("weighted", [False, True])
def test_chunked_variance_carries_mean_and_m2_only(weighted):
    """The centred moments between chunks are about their own mean (``s1 = 0``): the loop
    over chunks carries the running mean and centred sum of squares of each leaf, not a
    third array of zeros that every chunk's Chan merge reads (GPT-2 small: 148 leaves,
    4,000 more lines of optimised HLO, variance's compile 3x grad's). Against the oracle,
    float64, with and without example weights."""
    D2, B = 5, 7
    r = np.random.default_rng(3)
    with zoo.x64():
        params = {"w": jnp.asarray(r.standard_normal((D2, 3))),
                  "b": jnp.asarray(r.standard_normal(3))}
        batch = {"x": jnp.asarray(r.standard_normal((B, 4, D2))),
                 "y": jnp.asarray(r.standard_normal((B, 4, 3)))}

        def loss(p, b):
            return jnp.mean(jnp.sum((jnp.tanh(b["x"] @ p["w"] + p["b"]) - b["y"]) ** 2, (-2, -1)))

        w = jnp.asarray(r.uniform(0.5, 2.0, B)) if weighted else None
        f = js.per_example_stat(loss, js.stats.variance(ddof=0), chunk_size=3)
        call = (lambda p, b: f(p, b, example_weights=w)) if weighted else f
        closed = jax.make_jaxpr(call)(params, batch)
        from jaxpr_surgery._src import api

        found = [e for e in all_eqns(closed.jaxpr)  # (with weights: under a vjp rule)
                 if e.primitive is jax.lax.scan_p
                 and api.CHUNK_LOOP in str(e.source_info.name_stack)]
        assert found
        for e in found:  # (the loop's outputs: its carry and the per-example losses)
            n_w = sum(v.aval.shape == (D2, 3) for v in e.outvars)
            assert n_w == 2, (n_w, [v.aval for v in e.outvars])  # mean, m2 (s1 of zeros: 3)
        got = jax.jit(call)(params, batch)
        g = _grads(loss, params, batch)
        wn = np.ones(B) if w is None else np.asarray(w)
        for k in params:
            x = np.asarray(g[k])
            wb = wn.reshape((-1,) + (1,) * (x.ndim - 1))
            mu = (wb * x).sum(0) / wn.sum()
            ref = (wb * (x - mu) ** 2).sum(0) / wn.sum()
            np.testing.assert_allclose(np.asarray(got[k]), ref, rtol=1e-10, atol=1e-13)


def test_tile_loop_traces_its_tile_once_outside_named_axes():
    """A tile loop's accumulators are typed without tracing a tile a second time where no
    named axis is bound (its type varies over no manual axis there; under shard_map it
    is traced for them: test_shard_map.py). Values against the whole batch's."""
    from jaxpr_surgery._src import stats as S
    from jaxpr_surgery._src import tiling

    B, shape = 6, (4, 3)
    G = np.random.default_rng(1).normal(size=(B,) + shape).astype(np.float32) + 2.0
    calls = []

    def run(Gj):
        def make(b0, size):
            calls.append(size)
            return jax.lax.dynamic_slice_in_dim(Gj, b0, size, 0)

        return tiling.reduce_tiles(make, B, [S.SQUARE, S.Centered()], 2, shape=shape,
                                   dtype=Gj.dtype)

    sq, mom = jax.jit(run)(jnp.asarray(G))
    assert calls == [2], calls  # the loop body's trace only (typed by eval_shape: [2, 2])
    np.testing.assert_allclose(np.asarray(sq), (G.astype(np.float64) ** 2).sum(0), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(mom.m2), ((G - G.mean(0)) ** 2).sum(0), rtol=1e-4)


@pytest.mark.parametrize("names", [("kurtosis",), ("variance", "mean")])
def test_chunks_of_one_example_take_its_values_directly(monkeypatch, names):
    """With chunks of one example (the CPU's choice on large models), a site's centred
    sums are the example's own (its mean, zero about it): no tile's running sums to
    finish and merge (GPT-2 small's kurtosis: 55k -> 39k lines of optimised HLO, compile
    4.9 -> 3.1 s). Float64 oracle, every leaf, with the running sums across chunks."""
    from jaxpr_surgery._src import stats_research

    calls = []
    finish = stats_research.CentralMoments.finish
    monkeypatch.setattr(stats_research.CentralMoments, "finish",
                        lambda self, *a: calls.append(1) or finish(self, *a))
    with zoo.x64():
        params, batch = _case(3, jnp.float64, B=5, seed=4)
        loss = _stack(3, _layer)
        stats, want = _oracle(_grads(loss, params, batch), names)
        got = jax.jit(js.per_example_stat(loss, stats, chunk_size=1))(params, batch)
    if names == ("kurtosis",):  # the statistic's own finish per leaf, no site's (before: 7)
        assert len(calls) == len(jax.tree.leaves(params)), len(calls)
    for g, w in zip(got, want):
        for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(w)):
            np.testing.assert_allclose(np.asarray(a), b, rtol=1e-9, atol=1e-12)


def test_tile_and_chunk_slices_stage_no_wraparound_of_negative_starts():
    """The package's dynamic slices start at loop offsets, never negative: they stage no
    wrap-around (``lax.dynamic_slice_in_dim``'s default adds a compare, an add and a
    select per traced start, each a traced ``jax.numpy`` operator: 88 of the 954
    equations of a 4-layer transformer's ``second_moment``). Tiles of one example in
    feature blocks (a tiny memory budget), chunks of 3 with a remainder; values against
    the oracle."""
    params, batch = _case(3, jnp.float32, B=7, seed=4)
    loss = _stack(3, _layer)
    f = js.per_example_stat(loss, js.stats.second_moment(), chunk_size=3,
                            memory_budget_bytes=256)
    seen = [e.primitive for e in all_eqns(jax.make_jaxpr(f)(params, batch).jaxpr)]
    assert compat.dynamic_slice_p in seen  # (the tiles and chunks are there)
    names = [str(p) for p in seen]
    assert names.count("select_n") == 0 and names.count("lt") == 0, (
        names.count("select_n"), names.count("lt"))  # (with the wrap-around: 6 and 6)
    stats, want = _oracle(_grads(loss, params, batch), ("second_moment",))
    got = jax.jit(f)(params, batch)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want[0])):
        np.testing.assert_allclose(np.asarray(a), b, rtol=2e-5, atol=1e-7)


@pytest.mark.parametrize("jit", [False, True])
def test_trace_runs_with_the_cyclic_collector_paused_and_restores_it(jit):
    """A trace allocates many short-lived objects: the collector's passes over every
    object of the process were 10-27% of a GPT-2-sized statistic's time to lower. The
    loss is traced with it paused; afterwards it is as it was (also after an error, and
    left paused where the caller paused it); the values are the oracle's."""
    import gc

    seen = []

    def loss(params, batch):
        seen.append(gc.isenabled())
        return _stack(2, _layer)(params, batch)

    with zoo.x64():
        params, batch = _case(2, jnp.float64)
        f = js.per_example_stat(loss, js.stats.variance())
        f = jax.jit(f) if jit else f
        assert gc.isenabled()
        got = f(params, batch)
        assert seen and not any(seen), seen  # every trace of the loss ran paused
        assert gc.isenabled()
        (_,), (want,) = _oracle(_grads(_stack(2, _layer), params, batch), ["variance"])
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-13)

        def bad(params, batch):
            raise RuntimeError("the loss failed")

        with pytest.raises(RuntimeError, match="the loss failed"):
            js.per_example_stat(bad, js.stats.variance())(params, batch)
        assert gc.isenabled()
        gc.disable()
        try:
            js.per_example_stat(loss, js.stats.second_moment())(params, batch)
            assert not gc.isenabled()  # the caller's choice stands
        finally:
            gc.enable()


def test_explain_traces_with_the_cyclic_collector_paused_and_restores_it():
    """explain traces the loss (per example, and the batch for its check) as the entries
    do: with the collector paused, restored after, also after an error."""
    import gc

    seen = []

    def loss(params, batch):
        seen.append(gc.isenabled())
        return _stack(2, _layer)(params, batch)

    params, batch = _case(2, jnp.float32)
    assert gc.isenabled()
    report = js.explain(loss, js.stats.variance(), check=True)(params, batch)
    assert report.leaves and len(seen) >= 2 and not any(seen), seen
    assert gc.isenabled()

    def bad(params, batch):
        raise RuntimeError("the loss failed")

    with pytest.raises(RuntimeError, match="the loss failed"):
        js.explain(bad, js.stats.variance())(params, batch)
    assert gc.isenabled()


def test_residual_leaves_trace_no_norms_that_no_statistic_reads(monkeypatch):
    """A leaf without a fast rule (its per-example gradients materialised) traced its
    norms, overflow-safe recomputation included, for every statistic though only
    clipping reads them (jit's dead-code elimination dropped them after the trace: a
    trace-time cost). Now only where a statistic clips; values are the oracle's."""
    from jaxpr_surgery._src import reductions

    calls = []
    orig = reductions.Norms.from_examples
    monkeypatch.setattr(reductions.Norms, "from_examples",
                        lambda self, G: calls.append(G.shape) or orig(self, G))

    def loss(params, batch):
        w = params["l0"]["w"]
        h = jnp.tanh(batch["x"] @ (w @ w.T) + params["l0"]["b"])  # (no fast rule for w)
        return jnp.mean(jnp.sum((h - batch["y"]) ** 2, axis=(-2, -1)))

    with zoo.x64():
        params, batch = _case(1, jnp.float64)
        g = _grads(loss, params, batch)
        for names, clips in ((("second_moment", "variance"), False), (("clipped_mean",), True)):
            stats, want = _oracle(g, names)
            calls.clear()
            got = js.per_example_stat(loss, stats, chunk_size=None)(params, batch)
            assert bool(calls) == clips, (names, calls)  # (the residual leaf w: [B, D, D])
            for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
                np.testing.assert_allclose(x, y, rtol=1e-10, atol=1e-13)


_CACHE_RUN = """
import sys
import jax
jax.config.update("jax_compilation_cache_dir", sys.argv[1])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
import zoo
import jaxpr_surgery as js
case = zoo.get_case("transformer", "float32")  # (repeated layers: their cached blocks)
stats = {"v": js.stats.variance(), "c": js.stats.clipped_mean(0.5), "sq": js.stats.sq_norms()}
f = js.per_example_stat(case.loss_fn, stats, chunk_size=3)  # (and a chunk loop)
jax.jit(f).lower(case.params, case.batch).compile()
"""


def test_programs_are_the_same_in_every_process_so_jax_caches_them_across_runs(tmp_path):
    """A statistic's program is a function of the model and the call alone (no object
    ids, hash orders or counters of the process in it), so jax's persistent compilation
    cache serves it to the next run of a script: a second process (another hash seed)
    writes no new entry. (docs/benchmarks.md: the first step of a re-run.)"""
    import os
    import subprocess
    import sys
    from pathlib import Path

    cache = tmp_path / "cache"
    cache.mkdir()
    tests = Path(__file__).resolve().parent

    def run(seed):
        env = dict(os.environ, PYTHONHASHSEED=str(seed), JAX_PLATFORMS="cpu",
                   PYTHONPATH=os.pathsep.join(filter(None, [str(tests), str(tests.parent),
                                                            os.environ.get("PYTHONPATH")])))
        env.pop("JS_TEST_COMPILATION_CACHE", None)
        proc = subprocess.run([sys.executable, "-c", _CACHE_RUN, str(cache)], env=env,
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return set(os.listdir(cache))

    first = run(1)
    assert len(first) >= 2, first  # (the cache is on: the statistics' programs were written)
    assert run(2) == first


def _const_case(dtype, B=6):
    r = np.random.default_rng(5)
    w = r.standard_normal(3).astype(dtype)
    b = {"x": r.standard_normal((B, 3)).astype(dtype), "y": r.standard_normal(B).astype(dtype)}
    return w, b


def test_eager_calls_switching_x64_with_closed_over_numpy_constants():
    """A loss closing over NumPy float64 and int64 arrays, called eagerly with x64 off,
    then on (float32 and float64 inputs), then off again: each call's values are the
    oracle's. JAX converts such an array to the mode's dtype once, by its identity, for
    as long as the conversion is alive, and the compiled function of the first call held
    it: the trace under x64 got float32 constants in float64 operations (TypeError).
    Another entry point on the same arrays, called first, held them as well."""
    C = np.linspace(0.5, 1.5, 3)  # float64
    IDX = np.array([2, 0, 1])  # int64

    def loss(w, b):
        return jnp.mean((b["x"][:, IDX] @ (w * C) - b["y"]) ** 2)

    def oracle(w, b):
        x = np.asarray(b["x"], np.float64)[:, IDX]
        r = x @ (np.asarray(w, np.float64) * C) - b["y"]
        G = 2 * r[:, None] * x * C
        return G.mean(0), (G**2).mean(0), (G**2).sum(1)

    f = js.per_example_stat(loss, (js.stats.mean(), js.stats.second_moment()))
    g = js.per_example_stat(loss, js.stats.sq_norms())
    for x64, dtype in ((False, np.float32), (True, np.float32), (True, np.float64),
                       (False, np.float32)):
        with zoo.x64() if x64 else contextlib.nullcontext():
            w, b = _const_case(dtype)
            want = oracle(w, b)
            tol = dict(rtol=1e-11, atol=1e-13) if dtype == np.float64 else dict(rtol=2e-5,
                                                                                atol=1e-6)
            sq = g(w, b)  # (another entry point: its compiled functions hold them too)
            got = (*f(w, b), sq)
            # the mean like jax.grad (the parameters' dtype); the moments in the data's
            # (float64 under x64: the float64 constant's, a float32 one with it off)
            dtypes = (dtype, *[np.float64 if x64 else np.float32] * 2)
            for a, e, dt in zip(got, want, dtypes):
                assert a.dtype == dt, (x64, dtype, a.dtype)
                np.testing.assert_allclose(a, e, **tol, err_msg=f"x64={x64} {dtype.__name__}")


def _no_promotion_loss(params, batch):  # (no rank promotion, one dtype)
    h = jnp.tanh(batch["x"] @ params["l0"]["w"] + params["l0"]["b"][None, None])
    return jnp.mean(jnp.sum((h - batch["y"]) ** 2, axis=(-2, -1)))


def _bf16_loss(params, batch):  # (promotes bfloat16 with float32)
    h = jnp.tanh(batch["x"].astype(jnp.bfloat16) @ params["l0"]["w"])
    return jnp.mean(jnp.sum((h - batch["y"]) ** 2, axis=(-2, -1)))


# config option -> (its context manager, another value than the tests' own; the precision
# "float32" is as exact as conftest's "highest", so the values match on every backend)
_SETTINGS = {
    "jax_default_matmul_precision": (jax.default_matmul_precision, "float32"),
    "jax_numpy_rank_promotion": (jax.numpy_rank_promotion, "raise"),
    "jax_numpy_dtype_promotion": (jax.numpy_dtype_promotion, "strict"),
    "jax_default_device": (jax.default_device, lambda: jax.devices()[-1]),
}


@pytest.mark.parametrize("setting", list(_SETTINGS))
def test_eager_calls_are_traced_under_each_calls_configuration(setting):
    """An eager call under another default matmul precision, rank or dtype promotion rule
    or default device than the first call's is traced anew under it (jax.jit keys jax's
    trace context; `fingerprint.EagerCache` the arguments' structure), and it shows:
    values on that device, the loss's own promotions refused; back under the first
    setting, the first trace serves."""
    ctx, value = _SETTINGS[setting]
    if setting == "jax_default_device":
        if len(jax.devices()) < 2:
            pytest.skip("needs two devices (XLA_FLAGS=--xla_force_host_platform_device_count=2)")
        value = value()
    seen = []

    def loss(params, batch):
        seen.append(getattr(jax.config, setting))
        return _no_promotion_loss(params, batch)

    params, batch = _case(1, jnp.float32)
    f = js.per_example_stat(loss, js.stats.second_moment())
    want = f(params, batch)
    assert value not in seen, seen
    with ctx(value):
        got = f(params, batch)
    assert seen[-1] == value, seen  # traced anew, under the call's setting
    n = len(seen)
    again = f(params, batch)
    assert len(seen) == n, seen  # the first trace serves the first setting
    for a, b, c in zip(jax.tree.leaves(got), jax.tree.leaves(want), jax.tree.leaves(again)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
        np.testing.assert_array_equal(b, c)
        if setting == "jax_default_device":
            assert a.devices() == {value} and b.devices() == {jax.devices()[0]}
    offending = {"jax_numpy_rank_promotion": _stack(1, _layer),  # (a bias of rank 1)
                 "jax_numpy_dtype_promotion": _bf16_loss}.get(setting)
    if offending is not None:
        g = js.per_example_stat(offending, js.stats.second_moment())
        g(params, batch)
        with ctx(value), pytest.raises(ValueError, match=value):
            g(params, batch)
