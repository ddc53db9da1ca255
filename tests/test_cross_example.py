"""Cross-example losses are refused by default (issue 36): `per_example_stat` proves from the
jaxpr of the batch loss, at trace time, that it is a mean of per-example terms.

* Every cross-example form raises `js.CrossExampleError` (a ValueError) naming the operation
  and a source line of this file, eagerly and under jit, through both entry points;
  ``check=False`` computes the batch-of-one statistics anyway.
* No alarm (no error, no warning) on the ordinary forms of a loss.
* Where the jaxpr cannot decide (a gather or scatter across the batch axis by data, as in
  jraph-style graph batching) a `js.CrossExampleWarning`, once per trace.
"""

from __future__ import annotations

import re
import warnings

import _models as M
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import zoo
from jax import lax

import jaxpr_surgery as js
from jaxpr_surgery._src import independence as ind
from jaxpr_surgery._src.independence import tags

B, T, D, V = 4, 5, 3, 6
HERE = "test_cross_example.py:"


def _params(dtype=jnp.float32):
    r = np.random.default_rng(0)
    return {"w": jnp.asarray(r.normal(size=(D, V)) / 2, dtype),
            "v": jnp.asarray(r.normal(size=(D, D)) / 2, dtype)}


def _batch(dtype=jnp.float32, b=B):
    r = np.random.default_rng(1)
    lengths = np.array([5, 2, 4, 1, 3, 5, 2, 4])[:b]
    return {"x": jnp.asarray(r.normal(size=(b, T, D)), dtype),
            "y": jnp.asarray(r.integers(0, V, (b, T)), jnp.int32),
            "mask": jnp.asarray(np.arange(T) < lengths[:, None], dtype)}


def _nll(p, b):  # [B, T]
    lp = jax.nn.log_softmax(jnp.tanh(b["x"] @ p["v"]) @ p["w"])
    return -jnp.take_along_axis(lp, b["y"][..., None], -1)[..., 0]


# --------------------------------------------------------------------------- #
# Cross-example forms: each raises, naming the operation and its line here
# --------------------------------------------------------------------------- #
def token_normalised(p, b):
    return jnp.sum(_nll(p, b) * b["mask"]) / jnp.sum(b["mask"])


def token_normalised_guarded(p, b):
    return jnp.sum(_nll(p, b) * b["mask"]) / jnp.maximum(jnp.sum(b["mask"]), 1.0)


def batch_norm(p, b):  # hand-written, training mode
    h = b["x"] @ p["v"]
    mu = jnp.mean(h, axis=(0, 1))
    var = jnp.mean((h - mu) ** 2, axis=(0, 1))
    return jnp.mean(((h - mu) / jnp.sqrt(var + 1e-5)) @ p["w"])


def in_batch_negatives(p, b):  # contrastive: every other example is a negative
    q, k = b["x"][:, 0] @ p["v"], b["x"][:, 1] @ p["v"]
    logits = q @ k.T
    return -jnp.mean(jnp.diagonal(jax.nn.log_softmax(logits, axis=-1)))


def softmax_over_batch(p, b):
    return jnp.sum(jax.nn.softmax(jnp.mean(_nll(p, b), 1), axis=0) * jnp.arange(B))


def logsumexp_over_examples(p, b):
    return jax.nn.logsumexp(jnp.mean(_nll(p, b), 1)) - jnp.log(B)


def divided_by_own_mean(p, b):
    per_example = jnp.mean(_nll(p, b), 1)
    return jnp.mean(per_example) / lax.stop_gradient(jnp.mean(per_example))


def rolled_negatives(p, b):  # in-batch negatives: example b against example b - 1
    q, k = b["x"][:, 0] @ p["v"], b["x"][:, 1] @ p["v"]
    neg = jnp.roll(k, 1, axis=0)
    return jnp.mean(jax.nn.softplus(jnp.sum(q * neg, -1)) - jnp.sum(q * k, -1))


def mixup_reversed(p, b):  # mixup of each example with the batch reversed
    x = 0.7 * b["x"] + 0.3 * b["x"][::-1]
    return jnp.mean(jnp.tanh(x @ p["v"]) @ p["w"])


def consecutive_differences(p, b):  # each example against the next
    per = jnp.mean(_nll(p, b), 1)
    return jnp.sum((per[1:] - per[:-1]) ** 2) / b["x"].shape[0]


CROSS = {
    token_normalised: ("div", "divides by a sum over the batch"),
    token_normalised_guarded: ("max", "applies max to a sum over the batch"),
    batch_norm: ("sub", "combines per-example values with a sum over the batch"),
    in_batch_negatives: ("dot_general", "pairs different examples"),
    softmax_over_batch: ("reduce_max", "reduces over the batch axis"),
    logsumexp_over_examples: ("reduce_max", "reduces over the batch axis"),
    divided_by_own_mean: ("div", "divides by a sum over the batch"),
    rolled_negatives: ("mul", "combines values of different examples"),
    mixup_reversed: ("add", "combines values of different examples"),
    consecutive_differences: ("sub", "combines values of different examples, reordered by "
                                     "`slice` at " + HERE),
}


def _line_of(fn, needle):
    """``test_cross_example.py:<line>`` of the first line of ``fn`` containing ``needle``."""
    import inspect

    lines, start = inspect.getsourcelines(fn)
    k = next(i for i, ln in enumerate(lines) if needle in ln)
    return f"{HERE}{start + k}"


@pytest.mark.parametrize("loss", list(CROSS), ids=lambda f: f.__name__)
def test_cross_example_losses_raise_naming_the_operation(loss):
    op, why = CROSS[loss]
    p, b = _params(), _batch()
    with pytest.raises(js.CrossExampleError) as e:
        js.per_example_stat(loss, js.stats.mean())(p, b)
    msg = str(e.value)
    assert isinstance(e.value, ValueError)
    assert f"`{op}` at {HERE}" in msg and why in msg, msg
    assert f"({loss.__name__})" in msg, msg
    assert "normalise per example" in msg and "check=False" in msg, msg
    # under jit, through the other entry point: the same error at trace time
    with pytest.raises(js.CrossExampleError, match=op):
        jax.jit(js.value_and_per_example_stat(loss, js.stats.second_moment()))(p, b)


def test_message_names_the_line_of_the_division_and_of_the_batch_sum():
    p, b = _params(), _batch()
    with pytest.raises(js.CrossExampleError) as e:
        js.per_example_stat(token_normalised, js.stats.mean())(p, b)
    line = _line_of(token_normalised, "jnp.sum(b[\"mask\"])")
    assert f"`div` at {line} (token_normalised)" in str(e.value)
    assert f"computed by `reduce_sum` at {line}" in str(e.value)


@pytest.mark.parametrize("loss", list(CROSS), ids=lambda f: f.__name__)
def test_check_false_computes_the_batch_of_one_statistics(loss):
    p, b = _params(), _batch()
    out = jax.jit(js.value_and_per_example_stat(loss, js.stats.mean(), check=False))(p, b)
    (value, mean) = out
    per = zoo.vmap_grads(loss, p, b)
    for got, g in zip(jax.tree.leaves(mean), jax.tree.leaves(per)):
        np.testing.assert_allclose(got, g.mean(0), rtol=2e-5, atol=1e-6)
    assert np.isfinite(float(value))


def test_token_normalised_loss_was_silently_wrong():
    """The issue: statistics of the token-normalised loss are not those of its gradient
    (mean() differs from jax.grad), so it must not pass unnoticed."""
    with jax.enable_x64(True):
        p, b = _params(jnp.float64), _batch(jnp.float64)
        mean = js.per_example_stat(token_normalised, js.stats.mean(), check=False)(p, b)
        grad = jax.grad(token_normalised)(p, b)
        rel = float(jnp.linalg.norm(mean["w"] - grad["w"]) / jnp.linalg.norm(grad["w"]))
        assert rel > 0.1
        with pytest.raises(js.CrossExampleError):
            js.per_example_stat(token_normalised, js.stats.mean())(p, b)


def test_library_jit_is_placed_at_the_users_call():
    """Inside a library's jit (jnp.nanmean) equations record no user frame: the message
    names the function and the user's line calling it."""
    def loss(p, b):
        return jnp.nanmean(_nll(p, b))

    with pytest.raises(js.CrossExampleError) as e:
        js.per_example_stat(loss, js.stats.mean())(_params(), _batch())
    line = _line_of(loss, "nanmean")
    assert f"`div` (in nanmean) at {line}" in str(e.value), str(e.value)


def test_fully_padded_example_raises_instead_of_nan():
    """A fully padded example made every statistic NaN (0/0 in its batch of one)."""
    p, b = _params(), _batch()
    b = {**b, "mask": b["mask"].at[2].set(0.0)}
    assert np.isnan(np.asarray(
        js.per_example_stat(token_normalised, js.stats.mean(), check=False)(p, b)["w"])).all()
    with pytest.raises(js.CrossExampleError, match="div"):
        js.per_example_stat(token_normalised, js.stats.mean())(p, b)


def test_flax_batch_norm_in_training_mode_raises():
    nn = pytest.importorskip("flax.linen")

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = nn.Dense(D)(x)
            h = nn.BatchNorm(use_running_average=False)(h)
            return nn.Dense(V)(h)

    net = Net()
    b = _batch()
    variables = net.init(jax.random.key(0), b["x"])

    def loss(params, batch):
        logits, _ = net.apply({"params": params, "batch_stats": variables["batch_stats"]},
                              batch["x"], mutable=["batch_stats"])
        return jnp.mean(logits ** 2)

    with pytest.raises(js.CrossExampleError) as e:
        jax.jit(js.per_example_stat(loss, js.stats.mean()))(variables["params"], b)
    assert "normalization.py" in str(e.value)  # flax's line, called from the loss here
    assert f"called from {HERE}" in str(e.value) and ".loss)" in str(e.value)


# --------------------------------------------------------------------------- #
# No alarm on ordinary losses
# --------------------------------------------------------------------------- #
def _per_example_token_mean(p, b):
    tokens = jnp.sum(_nll(p, b) * b["mask"], 1)
    return jnp.mean(tokens / jnp.maximum(jnp.sum(b["mask"], 1), 1.0))


def _attention(p, b):
    h = b["x"] @ p["v"]  # [B, T, D]
    s = jnp.einsum("btd,bsd->bts", h, h) / np.sqrt(D)
    causal = jnp.tril(jnp.ones((T, T), bool))
    keep = causal[None] & (b["mask"][:, None, :] > 0)
    a = jax.nn.softmax(jnp.where(keep, s, -1e9), axis=-1)
    pos = jnp.broadcast_to(jnp.arange(T), (b["x"].shape[0], T))  # position ids from iota
    out = jnp.einsum("bts,bsd->btd", a, h) + 0.1 * pos[..., None]
    return jnp.mean((out @ p["w"]) ** 2)


def _flattened(p, b):
    n = b["x"].shape[0]
    h = jnp.tanh(b["x"].reshape(n * T, D) @ p["v"]).reshape(n, T, D)
    return jnp.sum(jnp.sum(h @ p["w"], axis=(1, 2)) ** 2) / n


def _arange_labels(p, b):
    logp = jax.nn.log_softmax(b["x"][:, 0] @ p["w"])
    return -jnp.mean(logp[jnp.arange(b["x"].shape[0]), b["y"][:, 0]])


def _map_over_examples(p, b):
    return jnp.mean(lax.map(lambda e: jnp.sum(jnp.tanh(e["x"] @ p["v"]) @ p["w"]), b))


def _scan_over_time(p, b):
    def step(h, x):
        h = jnp.tanh(h @ p["v"] + x)
        return h, h @ p["w"]

    _, ys = lax.scan(step, jnp.zeros((b["x"].shape[0], D)), jnp.swapaxes(b["x"], 0, 1))
    return jnp.mean(ys ** 2)


def _vmapped_while(p, b):  # a per-example trip count (jax batches the predicate)
    def shrink(x):
        return lax.while_loop(lambda c: jnp.sum(c ** 2) > 1.0, lambda c: 0.5 * c, x)

    return jnp.mean(jax.vmap(shrink)(b["x"][:, 0] @ p["v"]) @ p["w"])


def _masked_while(p, b):  # the same by hand: while any, each example frozen when done
    def body(c):
        big = jnp.sum(c ** 2, axis=-1, keepdims=True) > 1.0
        return jnp.where(big, 0.5 * c, c)

    x = lax.while_loop(lambda c: jnp.any(jnp.sum(c ** 2, axis=-1) > 1.0), body, b["x"][:, 0])
    return jnp.mean(x @ p["v"] @ p["w"])


def _conv_pool(p, b):
    x = b["x"][:, None]  # [B, 1, T, D]
    y = lax.conv_general_dilated(x, p["v"][None, None, :2, :], (1, 1), "SAME")
    y = lax.reduce_window(y, -jnp.inf, lax.max, (1, 1, 2, 1), (1, 1, 1, 1), "VALID")
    return jnp.mean(y)


ORDINARY = {
    "mean_over_B_T": lambda p, b: jnp.mean(_nll(p, b)),
    "sum_over_B": lambda p, b: jnp.sum(_nll(p, b)) / b["x"].shape[0],
    "mask_inside_example": lambda p, b: jnp.mean(_nll(p, b) * b["mask"]),
    "per_example_token_mean": _per_example_token_mean,
    "flattened_and_back": _flattened,
    "attention_masks_and_position_ids": _attention,
    "param_only_regulariser": lambda p, b: jnp.mean(_nll(p, b)) + 1e-2 * jnp.sum(p["w"] ** 2),
    "one_hot": lambda p, b: -jnp.mean(jnp.sum(
        jax.nn.one_hot(b["y"], V) * jax.nn.log_softmax(b["x"] @ p["w"]), -1)),
    "arange_labels": _arange_labels,
    "map_over_examples": _map_over_examples,
    "scan_over_time": _scan_over_time,
    "vmapped_while": _vmapped_while,
    "masked_while": _masked_while,
    "conv_pool": _conv_pool,
    "scatter_at_arange_labels": lambda p, b: jnp.mean(
        (b["x"][:, 0] @ p["w"]).at[jnp.arange(b["x"].shape[0]), b["y"][:, 0]].add(1.0) ** 2),
    "tile_tokens": lambda p, b: jnp.mean(jnp.tile(b["x"] @ p["v"], (1, 2, 1)) ** 2),
    "sort_and_top_k_tokens": lambda p, b: jnp.mean(
        jnp.sort(b["x"] @ p["v"], axis=1)[:, :2]) + jnp.mean(lax.top_k(b["x"] @ p["v"], 2)[0]),
    "sum_of_products": lambda p, b: jnp.einsum("bd,bd->", b["x"][:, 0] @ p["v"],
                                               b["x"][:, 1]) / b["x"].shape[0],
    "dot_batch_dims_at_other_axes": lambda p, b: jnp.mean(lax.dot_general(  # [B,T,D], [T,B,D]
        b["x"] @ p["v"], jnp.swapaxes(b["x"], 0, 1), (((2,), (2,)), ((0,), (1,)))) ** 2),
}


@pytest.mark.parametrize("name", sorted(ORDINARY))
def test_no_alarm_on_ordinary_losses(name):
    p, b = _params(), _batch()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rep = js.explain(ORDINARY[name], js.stats.mean())(p, b)
    assert rep.independence == "independent", rep.notes


@pytest.mark.parametrize("name", ["mask_inside_example", "per_example_token_mean", "masked_while",
                                  "map_over_examples"])
def test_ordinary_losses_match_grad(name):
    loss = ORDINARY[name]
    with jax.enable_x64(True):
        p, b = _params(jnp.float64), _batch(jnp.float64)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            mean = jax.jit(js.per_example_stat(loss, js.stats.mean()))(p, b)
        grad = jax.grad(loss)(p, b)
        for k in p:
            np.testing.assert_allclose(mean[k], grad[k], rtol=1e-10, atol=1e-12)


def test_optax_losses_and_batch_level_aux_are_fine():
    optax = pytest.importorskip("optax")
    p, b = _params(), _batch()

    def loss(p, b):
        logits = jnp.tanh(b["x"] @ p["v"]) @ p["w"]
        acc = jnp.mean(jnp.argmax(logits, -1) == b["y"])  # a batch-level metric: aux
        nll = optax.softmax_cross_entropy_with_integer_labels(logits, b["y"]).mean()
        return nll, {"accuracy": acc, "tokens": jnp.sum(b["mask"]) / jnp.sum(b["mask"])}

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        (value, aux), mean = js.value_and_per_example_stat(loss, js.stats.mean(),
                                                           has_aux=True)(p, b)
    grad = jax.grad(lambda p, b: loss(p, b)[0])(p, b)
    np.testing.assert_allclose(mean["w"], grad["w"], rtol=1e-5, atol=1e-7)
    assert aux["accuracy"].shape == (B,)


@pytest.mark.parametrize("typed", [True, False], ids=["key", "uint32"])
def test_dropout_with_one_key_per_example_in_the_batch(typed):
    """Keys as batch leaves, typed or raw (random_wrap, random_bits per example)."""
    split = jax.random.split(jax.random.key(0) if typed else jax.random.PRNGKey(0), B)
    b = {**_batch(), "key": split}

    def loss(p, b):
        h = jnp.tanh(b["x"][:, 0] @ p["v"])
        keep = jax.vmap(lambda k, x: jax.random.bernoulli(k, 0.5, x.shape))(b["key"], h)
        return jnp.mean(jnp.where(keep, h, 0.0) @ p["w"])

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert js.explain(loss)(_params(), b).independence == "independent"


def test_every_primitive_of_the_rules_exists_in_this_jax():
    """The rules name primitives by attribute (compat.prims); one that moved in a new jax
    would silently lose its rule (and warn on every model using it)."""
    import re
    from pathlib import Path

    src = "".join(p.read_text() for p in sorted(Path(ind.__file__).parent.glob("*.py")))
    names = sorted(set(re.findall(r"\bP\.([a-z_0-9]+)", src)))
    missing = [n for n in names if getattr(tags.P, n) is None]
    assert not missing, missing
    assert len(names) > 40


def test_batch_of_one_and_one_example_functions_are_not_checked():
    p, b = _params(), _batch(b=1)
    mean = js.per_example_stat(token_normalised, js.stats.mean())(p, b)  # B=1: exact
    np.testing.assert_allclose(mean["w"], jax.grad(token_normalised)(p, b)["w"], rtol=1e-5)

    def one_example(p, e):  # keep_batch_dim=False: fn never sees the batch axis
        return jax.nn.logsumexp(jnp.sum(jnp.tanh(e["x"] @ p["v"]) @ p["w"], -1))

    js.per_example_stat(one_example, js.stats.mean(), keep_batch_dim=False)(p, _batch())


# --------------------------------------------------------------------------- #
# Undecidable: a warning, once per trace
# --------------------------------------------------------------------------- #
def _graph_loss(p, b):
    """jraph-style: the examples' nodes on one node axis, edges by global node ids."""
    n = b["x"].shape[0]
    nodes = jnp.tanh(b["x"].reshape(n * T, D) @ p["v"])  # [B*T, D]
    senders = (b["y"] % T + T * jnp.arange(n)[:, None]).reshape(-1)  # within each graph
    messages = nodes[senders]
    received = jax.ops.segment_sum(messages, senders, num_segments=n * T)
    per_graph = jnp.sum((received @ p["w"]).reshape(n, T, V), axis=(1, 2))
    return jnp.mean(per_graph)


def test_gather_across_the_batch_axis_by_data_warns_once():
    p, b = _params(), _batch()
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        mean = js.per_example_stat(_graph_loss, js.stats.mean())(p, b)
    ours = [x for x in w if issubclass(x.category, js.CrossExampleWarning)]
    assert len(ours) == 1, [str(x.message) for x in w]
    msg = str(ours[0].message)
    assert issubclass(js.CrossExampleWarning, UserWarning)
    assert f"`gather` at {HERE}" in msg and "by data" in msg, msg
    assert "check_per_example" in msg and "check=False" in msg, msg
    assert ours[0].filename.endswith("test_cross_example.py"), ours[0].filename
    # the nodes of a graph only meet their own graph's: the statistics are right
    np.testing.assert_allclose(mean["w"], jax.grad(_graph_loss)(p, b)["w"], rtol=1e-5,
                               atol=1e-7)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        js.per_example_stat(_graph_loss, js.stats.mean(), check=False)(p, b)


def _any_loop(body, use_counter=False):
    def loss(p, b):
        def cond(c):
            return jnp.any(jnp.sum(c[0] ** 2, -1) > 1.0)

        x, i = lax.while_loop(cond, lambda c: (body(c[0]), c[1] + 1), (b["x"][:, 0], 0))
        return jnp.mean(x @ p["v"] @ p["w"]) + (0.01 * i if use_counter else 0.0)

    return loss


def _frozen_when_done(c, limit=1.0):
    return jnp.where(jnp.sum(c ** 2, -1, keepdims=True) > limit, 0.5 * c, c)


@pytest.mark.parametrize("loss", [
    _any_loop(lambda c: 0.5 * c),  # moves finished examples too
    _any_loop(lambda c: _frozen_when_done(c, 2.0)),  # freezes by another test than the loop's
    _any_loop(_frozen_when_done, use_counter=True),  # the trip count itself is used
], ids=["unmasked", "other_predicate", "counter_used"])
def test_loop_over_a_batch_dependent_trip_count_is_undecided(loss):
    """``while jnp.any(...)``: a batch of one stops at its own trip count; the batch at
    the largest. Undecided unless every example is frozen by the loop's own test."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert js.explain(_any_loop(_frozen_when_done))(_params(), _batch()).independence == (
            "independent")
    rep = js.explain(loss, js.stats.mean())(_params(), _batch())
    assert rep.independence == "undecided"
    assert "`while`" in rep.notes[0] and "depends on the examples" in rep.notes[0]


# --------------------------------------------------------------------------- #
# explain reports the verdict
# --------------------------------------------------------------------------- #
def test_explain_reports_the_verdict():
    p, b = _params(), _batch()
    rep = js.explain(token_normalised, js.stats.mean())(p, b)
    assert rep.independence == "cross-example"
    assert "`div` at " + HERE in rep.notes[0] and "check=False" in rep.notes[0]
    assert rep.as_dict()["independence"] == "cross-example"
    assert js.explain(token_normalised, check=False)(p, b).independence == "not checked"
    rep = js.explain(ORDINARY["mean_over_B_T"])(p, b)
    assert rep.independence == "independent" and "independent" in str(rep)


# --------------------------------------------------------------------------- #
# The interpreter's pieces
# --------------------------------------------------------------------------- #
def test_reshape_follows_merged_and_split_batch_axes():
    ex = tags.Ex(0)
    merged = tags.reshape_axis((B, T, D), (B * T, D), ex, B)
    assert merged == tags.Ex(0, 1, T)
    assert tags.reshape_axis((B * T, D), (B, T, D), merged, B) == tags.Ex(0)
    assert tags.reshape_axis((T, B, D), (T * B * D,), tags.Ex(1), B) == tags.Ex(0, T, D)
    assert tags.reshape_axis((1, B, 1), (B,), tags.Ex(1), B) == tags.Ex(0)
    assert tags.reshape_axis((B,), (2, B // 2), ex, B) is None  # split across two axes


def test_unknown_primitive_on_the_examples_warns_not_raises():
    p, b = _params(), _batch()

    def loss(p, b):
        h = jnp.tanh(b["x"][:, 0] @ p["v"])
        h = jax.pure_callback(lambda a: np.asarray(a), jax.ShapeDtypeStruct(h.shape, h.dtype), h)
        return jnp.mean(h @ p["w"])

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rep = js.explain(loss, js.stats.mean())(p, b)  # explain reports, never warns
    assert rep.independence == "undecided" and "pure_callback" in rep.notes[0]
    with pytest.warns(js.CrossExampleWarning, match="pure_callback"):
        ind.check(_prep(loss, p, b), "per_example_stat")


def _prep(loss, p, b):
    from jaxpr_surgery._src.arguments import Options, Prepared

    return Prepared(loss, (p, b), Options(0, 1, True, False, None, False, None), "t")


def test_inside_shard_map_each_device_checks_its_examples():
    if jax.device_count() < 2:
        pytest.skip("needs 2 devices (tests/conftest.py sets XLA_FLAGS)")
    from jax.sharding import PartitionSpec as PS

    mesh = jax.make_mesh((2,), ("d",))
    p = jax.device_put(_params(), jax.sharding.NamedSharding(mesh, PS()))
    b = jax.device_put(_batch(), jax.sharding.NamedSharding(mesh, PS("d")))
    want = jax.grad(_per_example_token_mean)(_params(), _batch())

    def run(loss):
        fn = js.per_example_stat(loss, js.stats.mean(), axis_name="d")
        return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(PS(), PS("d")),
                                     out_specs=PS()))(p, b)

    with pytest.raises(js.CrossExampleError, match="`div` at " + HERE):
        run(token_normalised)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mean = run(_per_example_token_mean)
    np.testing.assert_allclose(mean["w"], want["w"], rtol=1e-5, atol=1e-7)


# --------------------------------------------------------------------------- #
# Values outside the batch that line up with it (issue 51, item 2)
# --------------------------------------------------------------------------- #
def _reg_params(dtype=jnp.float32):
    r = np.random.default_rng(2)
    return {"v": jnp.asarray(r.normal(size=(D, D)) / 2, dtype),
            "u": jnp.asarray(r.normal(size=(D,)), dtype)}


def _reg_data(dtype=jnp.float32):  # B = 4 differs from D = 3, T = 5, V = 6
    r = np.random.default_rng(3)
    return jnp.asarray(r.normal(size=(B, D)), dtype), jnp.asarray(r.normal(size=(B,)), dtype)


def _predict(p, x):
    return jnp.tanh(x @ p["v"]) @ p["u"]


def regression(p, x, y):  # y is the target of each example
    return jnp.mean((_predict(p, x) - y) ** 2)


def weighted_by_argument(p, x, w):  # w: one weight per example, passed outside the batch
    return jnp.sum(w * _predict(p, x) ** 2) / jnp.sum(w)


def weighted_by_arange(p, x):
    n = x.shape[0]
    return jnp.mean(jnp.arange(1, n + 1) * _predict(p, x) ** 2)


def dropout_one_key(p, x, key):  # one key for the whole batch: one mask over [B, D]
    h = jnp.tanh(x @ p["v"])
    keep = jax.random.bernoulli(key, 0.5, h.shape)
    return jnp.mean((jnp.where(keep, h, 0.0) @ p["u"]) ** 2)


def dropout_keys_split_inside(p, x):  # keys split inside fn: a batch of one splits 1
    keys = jax.random.split(jax.random.key(0), x.shape[0])
    h = jnp.tanh(x @ p["v"])
    keep = jax.vmap(lambda k, e: jax.random.bernoulli(k, 0.5, e.shape))(keys, h)
    return jnp.mean((jnp.where(keep, h, 0.0) @ p["u"]) ** 2)


def regression_over_time(p, x, y):  # y: [B, T] targets, scanned over time with x
    xs = jnp.swapaxes(jnp.broadcast_to(x[:, None], (x.shape[0], T, D)), 0, 1)

    def step(h, xy):
        h = jnp.tanh(h @ p["v"] + xy[0])
        return h, (h @ p["u"] - xy[1]) ** 2

    _, err = lax.scan(step, jnp.zeros_like(x), (xs, jnp.swapaxes(y, 0, 1)))
    return jnp.mean(err)


def labels_outside_the_batch(p, x, labels):  # take_along_axis: a gather, not elementwise
    logp = jax.nn.log_softmax(jnp.tanh(x @ p["v"]) * p["u"])
    return -jnp.mean(jnp.take_along_axis(logp, labels[:, None], axis=-1))


_CLOSED_WEIGHTS = np.linspace(0.5, 2.0, B)


def weights_closed_over(p, x):
    return jnp.mean(jnp.asarray(_CLOSED_WEIGHTS, x.dtype) * _predict(p, x) ** 2)


def _third(dtype=jnp.float32):
    r = np.random.default_rng(4)
    return {regression: _reg_data(dtype)[1],
            weighted_by_argument: jnp.asarray(r.uniform(0.5, 2.0, B), dtype),
            dropout_one_key: jax.random.key(1),
            regression_over_time: jnp.asarray(r.normal(size=(B, T)), dtype),
            labels_outside_the_batch: jnp.asarray([0, 2, 1, 2], jnp.int32)}


LINED_UP = {  # loss -> (operation, what it lines up with)
    regression: ("sub", "argument 2"),
    regression_over_time: ("sub", "argument 2"),
    labels_outside_the_batch: ("gather", "argument 2"),
    weights_closed_over: ("mul", "an array closed over by fn (shape [4])"),
    weighted_by_argument: ("mul", "argument 2"),
    weighted_by_arange: ("mul", "computed by `iota` at " + HERE),
    dropout_one_key: ("select_n", "computed by `random_bits`"),
    dropout_keys_split_inside: ("select_n", "computed by `random_split` at " + HERE),
}


def _lined_up_args(loss, dtype=jnp.float32):
    x = _reg_data(dtype)[0]
    third = _third(dtype).get(loss)
    return (_reg_params(dtype), x) + (() if third is None else (third,))


@pytest.mark.parametrize("loss", list(LINED_UP), ids=lambda f: f.__name__)
def test_values_lined_up_with_the_batch_outside_it_raise(loss):
    """Each example of the batch meets the entry at its own position of a value that is
    not split into examples; each example alone (a batch of one) meets all B entries,
    so its gradient is another loss's. Refused, naming the operation, the line, the
    value and the fix."""
    op, what = LINED_UP[loss]
    with pytest.raises(js.CrossExampleError) as e:
        js.per_example_stat(loss, js.stats.mean())(*_lined_up_args(loss))
    msg = str(e.value)
    # jnp.where's select_n is named with the library function around it: (in _where)
    assert re.search(rf"`{op}`( \(in \w+\))? at {HERE}\d+ \({loss.__name__}[.)]", msg), msg
    assert what in msg and f"size B={B}" in msg and "check=False" in msg, msg
    with pytest.raises(js.CrossExampleError, match=op):
        jax.jit(js.value_and_per_example_stat(loss, js.stats.second_moment()))(
            *_lined_up_args(loss))


@pytest.mark.parametrize("loss", list(LINED_UP), ids=lambda f: f.__name__)
def test_values_lined_up_with_the_batch_were_silently_wrong(loss):
    """With check=False (what ran before): mean() is not jax.grad."""
    with jax.enable_x64(True):
        args = _lined_up_args(loss, jnp.float64)
        mean = js.per_example_stat(loss, js.stats.mean(), check=False)(*args)
        grad = jax.grad(loss)(*args)
        rel = float(jnp.linalg.norm(mean["v"] - grad["v"]) / jnp.linalg.norm(grad["v"]))
        assert rel > 0.05, rel


def test_argument_outside_the_batch_names_it_and_the_fix():
    p, (x, y) = _reg_params(), _reg_data()
    with pytest.raises(js.CrossExampleError) as e:
        js.per_example_stat(regression, js.stats.mean())(p, x, y)
    msg = str(e.value)
    line = _line_of(regression, "return")
    assert f"`sub` at {line} (regression)" in msg, msg
    assert "argument 2 (shape [4]), which is not in batch_argnums=1" in msg, msg
    assert "batch_argnums=(1, 2)" in msg, msg
    # the fix: y is split into examples with x, and mean() is jax.grad
    with jax.enable_x64(True):
        p, (x, y) = _reg_params(jnp.float64), _reg_data(jnp.float64)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            mean = js.per_example_stat(regression, js.stats.mean(), batch_argnums=(1, 2))(p, x, y)
        grad = jax.grad(regression)(p, x, y)
        oracle = jax.vmap(jax.grad(lambda p, x, y: regression(p, x[None], y[None])),
                          in_axes=(None, 0, 0))(p, x, y)
        for k in p:
            np.testing.assert_allclose(mean[k], grad[k], rtol=1e-10, atol=1e-12)
            np.testing.assert_allclose(mean[k], oracle[k].mean(0), rtol=1e-10, atol=1e-12)


def test_parameter_lined_up_with_the_batch_raises_naming_the_leaf():
    p, (x, _) = _reg_params(), _reg_data()
    p = {**p, "per_example_scale": jnp.linspace(0.5, 2.0, B)}

    def loss(p, x):
        return jnp.mean(p["per_example_scale"] * _predict(p, x) ** 2)

    with pytest.raises(js.CrossExampleError) as e:
        js.per_example_stat(loss, js.stats.mean())(p, x)
    assert "['per_example_scale']" in str(e.value) and "`mul` at " + HERE in str(e.value)


def test_key_closed_over_for_the_whole_batch_raises():
    """sharp_edges' "Randomness": a closed-over dropout key gives every example alone
    the same mask."""
    key = jax.random.key(3)

    def loss(p, x):
        h = jnp.tanh(x @ p["v"])
        return jnp.mean(jnp.where(jax.random.bernoulli(key, 0.5, h.shape), h, 0.0) @ p["u"])

    with pytest.raises(js.CrossExampleError, match="random_bits"):
        js.per_example_stat(loss, js.stats.mean())(_reg_params(), _reg_data()[0])


ADV = 4  # the batch size, also every other dimension of the adversarial model


def _adversarial_params(dtype):
    r = np.random.default_rng(5)
    f = lambda *s: jnp.asarray(r.normal(size=s) / 2, dtype)  # noqa: E731
    return {"w": f(ADV, ADV), "b": f(ADV), "scale": f(ADV), "emb": f(ADV, ADV), "out": f(ADV)}


def _adversarial_batch(dtype):
    r = np.random.default_rng(6)
    return {"x": jnp.asarray(r.normal(size=(ADV, ADV)), dtype),
            "ids": jnp.asarray(r.integers(0, ADV, (ADV, ADV)), jnp.int32)}


def adversarial(p, b, feature_mask, mixing):
    """B == D == V == T: parameters [D, D], [D], a table [V, D], a feature mask [D] and a
    mixing matrix [D, D] passed outside the batch, a causal [T, T] mask, one_hot over V,
    all of them with axes of size B, none lined up with the examples."""
    h = jnp.tanh(b["x"] @ p["w"] + p["b"]) * p["scale"] * feature_mask
    h = h @ mixing + jnp.mean(p["emb"][b["ids"]], axis=1)  # [B, T, D] -> [B, D]
    causal = jnp.tril(jnp.ones((ADV, ADV)))
    h = h + (causal[None] * h[:, None, :]).sum(-1) * 0.1
    logits = h @ p["emb"].T  # [B, V]
    onehot = jax.nn.one_hot(b["ids"][:, 0], ADV)
    pos = jnp.arange(ADV)  # positions along the feature axis
    return jnp.mean(-jnp.sum(onehot * jax.nn.log_softmax(logits + 0.01 * pos), -1)
                    + (h @ p["out"]) ** 2)


def test_no_false_alarm_when_other_dimensions_equal_the_batch_size():
    with jax.enable_x64(True):
        p, b = _adversarial_params(jnp.float64), _adversarial_batch(jnp.float64)
        r = np.random.default_rng(7)
        mask = jnp.asarray(r.uniform(size=ADV) > 0.3, jnp.float64)
        mixing = jnp.asarray(r.normal(size=(ADV, ADV)), jnp.float64)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert js.explain(adversarial)(p, b, mask, mixing).independence == "independent"
            mean = js.per_example_stat(adversarial, js.stats.mean())(p, b, mask, mixing)
        grad = jax.grad(adversarial)(p, b, mask, mixing)
        one = lambda p, e: adversarial(p, jax.tree.map(lambda a: a[None], e), mask, mixing)  # noqa: E731
        oracle = jax.vmap(jax.grad(one), in_axes=(None, 0))(p, b)
        for k in p:
            np.testing.assert_allclose(mean[k], grad[k], rtol=1e-10, atol=1e-12)
            np.testing.assert_allclose(mean[k], oracle[k].mean(0), rtol=1e-10, atol=1e-12)
    # the same mask lined up with the examples instead of the features is refused
    with pytest.raises(js.CrossExampleError, match="argument 2"):
        js.per_example_stat(lambda p, b, m, mix: adversarial(p, b, 1.0, mix)
                            + jnp.mean(m * b["x"][:, 0]), js.stats.mean())(
            _adversarial_params(jnp.float32), _adversarial_batch(jnp.float32),
            jnp.ones(ADV), jnp.eye(ADV))


# --------------------------------------------------------------------------- #
# More cross-example forms the jaxpr decides (issue 51, item 5)
# --------------------------------------------------------------------------- #
def top_k_of_the_batch(p, b):  # the mean of the 2 largest per-example losses
    return jnp.mean(lax.top_k(jnp.mean(_nll(p, b), 1), 2)[0])


def vmap_batch_norm(p, b):  # batch norm written per example, pmean over the vmap axis
    def one(x):
        h = x @ p["v"]  # [T, D]
        mu = lax.pmean(jnp.mean(h, 0), "batch")
        return jnp.mean(((h - mu) @ p["w"]) ** 2)

    return jnp.mean(jax.vmap(one, axis_name="batch")(b["x"]))


def vmap_pmax(p, b):
    def one(x):
        s = jnp.sum(jnp.tanh(x @ p["v"]) @ p["w"])
        return s - lax.stop_gradient(lax.pmax(s, "batch"))

    return jnp.mean(jax.vmap(one, axis_name="batch")(b["x"]) ** 2)


DECIDED = {
    top_k_of_the_batch: ("top_k", "top k along the batch axis"),
    vmap_batch_norm: ("sub", "combines per-example values with a sum over the batch, "
                             "computed by `psum` at " + HERE),
    vmap_pmax: ("pmax", "reduces over the batch axis"),
}


@pytest.mark.parametrize("loss", list(DECIDED), ids=lambda f: f.__name__)
def test_more_cross_example_forms_raise(loss):
    """Were warned about (vmap's axis_name "reduces across the devices") or failed with
    JAX's own error on one example (top_k of k=2 over a batch of one)."""
    op, why = DECIDED[loss]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(js.CrossExampleError) as e:
            js.per_example_stat(loss, js.stats.mean())(_params(), _batch())
    msg = str(e.value)
    assert f"`{op}` at {HERE}" in msg and why in msg and f"({loss.__name__}" in msg, msg
    assert "device" not in msg, msg


def test_pmean_of_the_loss_over_the_data_axis_inside_shard_map_raises():
    """lax.pmean(loss, "d") inside shard_map with axis_name="d": the statistics already
    combine the devices, so each was off by the device count."""
    if jax.device_count() < 2:
        pytest.skip("needs 2 devices (tests/conftest.py sets XLA_FLAGS)")
    from jax.sharding import PartitionSpec as PS

    mesh = jax.make_mesh((2,), ("d",))
    p = jax.device_put(_params(), jax.sharding.NamedSharding(mesh, PS()))
    b = jax.device_put(_batch(), jax.sharding.NamedSharding(mesh, PS("d")))

    def loss(p, b):
        return lax.pmean(_per_example_token_mean(p, b), "d")

    fn = js.per_example_stat(loss, js.stats.mean(), axis_name="d")
    with pytest.raises(js.CrossExampleError) as e:
        jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(PS(), PS("d")), out_specs=PS()))(p, b)
    msg = str(e.value)
    assert re.search(f"`psum(_invariant)?` at {HERE}", msg), msg  # pmean; 0.12: psum_invariant
    assert "over 'd'" in msg and "axis_name='d'" in msg, msg


# --------------------------------------------------------------------------- #
# No false alarm on exact per-example losses (issue 51, item 6)
# --------------------------------------------------------------------------- #
def _per_example(p, b):  # [B]
    return jnp.mean(_nll(p, b) * b["mask"], 1)


def _logits(p, b):  # [B, T, V]
    return jnp.tanh(b["x"] @ p["v"]) @ p["w"]


def _stack_logsumexp(p, b):
    z = _logits(p, b)
    return jnp.mean(jax.nn.logsumexp(jnp.stack([z, -z], axis=-1), axis=-1))


def _unstack_sum(p, b):
    return jnp.mean(sum(jnp.unstack(_logits(p, b), axis=1)) ** 2)


def _focal(p, b):
    optax = pytest.importorskip("optax")
    labels = jax.nn.one_hot(b["y"], V)
    return jnp.mean(optax.sigmoid_focal_loss(_logits(p, b), labels))


def _rfft_over_time(p, b):
    return jnp.mean(jnp.abs(jnp.fft.rfft(_logits(p, b), axis=1)) ** 2)


def _gram(p, b):  # one [D, D] matrix per example
    h = jnp.tanh(b["x"] @ p["v"])
    return jnp.einsum("btd,bte->bde", h, h) + 2.0 * jnp.eye(D)


def _qr_per_example(p, b):
    return jnp.mean(jnp.linalg.qr(_gram(p, b))[1] ** 2)


def _cholesky_solve_per_example(p, b):
    c = jnp.linalg.cholesky(_gram(p, b))
    rhs = jnp.ones((b["x"].shape[0], D, 1))
    return jnp.mean(jax.scipy.linalg.solve_triangular(c, rhs, lower=True) ** 2)


def _scan_carry_sum(p, b):
    total, _ = lax.scan(lambda c, l: (c + l, None), 0.0, _per_example(p, b))
    return total / b["x"].shape[0]


def _fori_loop_sum(p, b):
    per, n = _per_example(p, b), b["x"].shape[0]
    return lax.fori_loop(0, n, lambda i, c: c + per[i], 0.0) / n


def _fori_loop_over_rows(p, b):  # the loop reads the batch itself, row by row
    n = b["x"].shape[0]

    def body(i, c):
        e = jax.tree.map(lambda a: a[i][None], b)
        return c + _per_example(p, e)[0]

    return lax.fori_loop(0, n, body, 0.0) / n


EXACT = {
    "stack": _stack_logsumexp,
    "unstack": _unstack_sum,
    "optax_sigmoid_focal_loss": _focal,
    "rfft_over_time": _rfft_over_time,
    "qr_per_example": _qr_per_example,
    "cholesky_solve_per_example": _cholesky_solve_per_example,
    "scan_carry_sum": _scan_carry_sum,
    "fori_loop_sum": _fori_loop_sum,
    "fori_loop_over_rows": _fori_loop_over_rows,
}


@pytest.mark.parametrize("name", sorted(EXACT))
def test_no_alarm_on_exact_losses_and_mean_is_the_oracle(name):
    """Warned on every trace though exact (a false alarm teaches check=False): now silent,
    and mean() equals both the vmap(grad) oracle and jax.grad."""
    loss = EXACT[name]
    with jax.enable_x64(True):
        M.assert_independent_and_exact(loss, _params(jnp.float64), _batch(jnp.float64))


def _running_max(p, b):
    m, _ = lax.scan(lambda c, l: (jnp.maximum(c, l), None), -jnp.inf, _per_example(p, b))
    return m


def _running_product(p, b):
    per, n = _per_example(p, b), b["x"].shape[0]
    return lax.fori_loop(0, n, lambda i, c: c * per[i], 1.0)


def _decayed_sum(p, b):  # an exponential moving sum weighs the examples unequally
    total, _ = lax.scan(lambda c, l: (0.5 * c + l, None), 0.0, _per_example(p, b))
    return total


def _running_sums_used(p, b):  # the per-step running sums (a cumulative sum)
    _, ys = lax.scan(lambda c, l: (c + l, c + l), 0.0, _per_example(p, b))
    return jnp.mean(ys)


def _fft_over_the_batch(p, b):
    return jnp.mean(jnp.abs(jnp.fft.fft(_per_example(p, b))) ** 2)


def _qr_of_the_batch(p, b):  # rows of the matrix are examples
    return jnp.mean(jnp.linalg.qr(jnp.tanh(b["x"][:, 0] @ p["v"]))[0] ** 2)


def _subset_mean(p, b):
    return jnp.mean(_per_example(p, b)[: b["x"].shape[0] // 2])


def _carried_state(p, b):  # a state threaded through the examples (an RNN over them)
    per = _per_example(p, b)
    h, _ = lax.scan(lambda c, l: (jnp.tanh(p["v"][:2, :2] @ c + l), None), jnp.zeros(2), per)
    return jnp.sum(h)


STILL_CROSS = {
    _running_max: ("max", "other than as a running sum"),
    _running_product: ("mul", "other than as a running sum"),
    _decayed_sum: ("mul", "other than as a running sum"),
    _carried_state: ("dot_general", "other than as a running sum"),
    _running_sums_used: ("scan", "accumulates along the batch axis"),
    _fft_over_the_batch: ("fft", "along the batch axis"),
    _qr_of_the_batch: ("qr", "along the batch axis"),
    _subset_mean: ("reduce_sum", "unequal weights"),
}


@pytest.mark.parametrize("loss", list(STILL_CROSS), ids=lambda f: f.__name__)
def test_loops_and_transforms_across_the_examples_still_raise(loss):
    op, why = STILL_CROSS[loss]
    with pytest.raises(js.CrossExampleError) as e:
        js.per_example_stat(loss, js.stats.mean())(_params(), _batch())
    msg = str(e.value)
    assert f"`{op}`" in msg and why in msg, msg


def test_stack_and_split_along_the_batch_axis_follow_the_examples():
    """jnp.stack / jnp.unstack (jax 0.12's own primitives, compat.stack_p / unstack_p;
    older jax writes them as broadcast + concatenate and split + squeeze) and jnp.split
    along the batch axis: the examples are followed to where they end up."""
    p, b = _params(), _batch()

    def stacked_twice(p, b):  # [2, B]: every example counted twice, as in a batch of one
        return jnp.mean(jnp.stack([_per_example(p, b), 2.0 * _per_example(p, b)]))

    def halves(p, b):  # microbatches by split along the batch axis, concatenated back
        h = jnp.split(jnp.tanh(b["x"] @ p["v"]), [b["x"].shape[0] // 2])
        return jnp.mean(jnp.concatenate([h[1] @ p["w"], h[0] @ p["w"]][::-1]) ** 2)

    for loss in (stacked_twice, halves):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            mean = js.per_example_stat(loss, js.stats.mean())(p, b)
        np.testing.assert_allclose(mean["w"], zoo.vmap_grads(loss, p, b)["w"].mean(0),
                                   rtol=1e-5, atol=1e-7)

    def stacked_with_neighbours(p, b):
        per = _per_example(p, b)
        return jnp.mean(jnp.prod(jnp.stack([per, jnp.roll(per, 1)], axis=1), axis=1))

    def halves_swapped(p, b):  # the first half's examples against the second half's
        h = jnp.split(jnp.tanh(b["x"] @ p["v"]), [b["x"].shape[0] // 2])
        return jnp.mean(h[0] * h[1])

    for loss in (stacked_with_neighbours, halves_swapped):
        with pytest.raises(js.CrossExampleError, match="different examples"):
            js.per_example_stat(loss, js.stats.mean())(p, b)

    def unstacked(p, b):  # single examples out of the batch, one term each (issue 58)
        return sum(jnp.unstack(_per_example(p, b))) / b["x"].shape[0]

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mean = js.per_example_stat(unstacked, js.stats.mean())(p, b)
    np.testing.assert_allclose(mean["w"], jax.grad(unstacked)(p, b)["w"], rtol=1e-5, atol=1e-7)


# --------------------------------------------------------------------------- #
# check_per_example (issue 51, item 13)
# --------------------------------------------------------------------------- #
def test_check_per_example_on_a_bfloat16_model():
    """A float32 loss of a model computing in bfloat16 (zoo's mlp_bf16) failed the gradient
    comparison at float32's tolerance (1e-4; the gradients agree to ~1e-2): the default
    tolerance follows the least precise float the loss computes in. A cross-example form
    still fails."""
    case = zoo.get_case("mlp_bf16")
    assert js.check_per_example(case.loss_fn)(case.params, case.batch) is None

    def centred(p, b):  # the same model, centred by the batch's mean logit
        q = jax.tree.map(lambda w: w.astype(jnp.bfloat16), p)
        h = jnp.tanh(b["x"].astype(jnp.bfloat16) @ q["l1"]["w"] + q["l1"]["b"])
        z = (h @ q["l2"]["w"] + q["l2"]["b"]).astype(jnp.float32)
        return jnp.mean((z - jnp.mean(z, 0)) ** 2)

    with pytest.raises(ValueError, match="interact"):
        js.check_per_example(centred)(case.params, case.batch)


@jax.custom_vjp
def _straight_through_round(x):
    return jnp.round(x)


_straight_through_round.defvjp(lambda x: (jnp.round(x), None), lambda _, g: (g,))


def test_check_per_example_and_the_check_on_custom_vjp_models():
    """custom_vjp ops (a straight-through estimator; jax.checkpoint and lax.scan around
    one): check_per_example compares reverse-mode gradients (forward mode raised on
    custom_vjp), and the jaxpr check follows the primal function."""
    p, b = _params(), _batch()

    def loss(p, b):
        h = jax.checkpoint(lambda x: _straight_through_round(4.0 * jnp.tanh(x)) / 4.0)(
            b["x"] @ p["v"])
        h, _ = lax.scan(lambda c, _: (_straight_through_round(c * 2.0) / 2.0, None), h, None,
                        length=2)
        return jnp.mean(_nll({**p, "v": jnp.eye(D)}, {**b, "x": h}))

    assert js.check_per_example(loss)(p, b) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mean = js.per_example_stat(loss, js.stats.mean())(p, b)
    np.testing.assert_allclose(mean["w"], zoo.vmap_grads(loss, p, b)["w"].mean(0), rtol=1e-5,
                               atol=1e-7)
    np.testing.assert_allclose(mean["v"], jax.grad(loss)(p, b)["v"], rtol=1e-5, atol=1e-7)
