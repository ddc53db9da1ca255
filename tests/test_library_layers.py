"""Common layers of Equinox, Flax (linen and nnx) and Haiku, used as their authors
document them: each parameter's layer kind and rule (explain), the statistics
against the vmap(grad) oracle, and the docs table generated from the same
registry (``python tests/test_library_layers.py --write`` rewrites it).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxpr_surgery as js

pytestmark = pytest.mark.slow

B, T, D, V = 4, 6, 8, 40
DOC = Path(__file__).resolve().parent.parent / "docs" / "howto" / "frameworks.md"
START, END = "<!-- layer-table:start -->", "<!-- layer-table:end -->"


def _data(ids=False):
    r = np.random.default_rng(0)
    if ids:
        return {"ids": jnp.asarray(r.integers(0, V, (B, T)), jnp.int32)}
    return {"x": jnp.asarray(r.standard_normal((B, T, D)), jnp.float32)}


def _head(h):
    return jnp.mean(jnp.sum(jnp.tanh(h) ** 2, axis=tuple(range(1, h.ndim))))


# --------------------------------------------------------------------------- #
# Builders: name -> () -> (loss, params, batch); Equinox models are passed whole
# --------------------------------------------------------------------------- #
def _eqx(layer_fn, ids=False, per_token=True):
    def build():
        import equinox as eqx

        model = layer_fn(eqx, jax.random.PRNGKey(0))
        key = "ids" if ids else "x"

        def loss(m, b):
            x = b[key]
            if per_token:
                f = jax.vmap(jax.vmap(m))
            else:
                f = jax.vmap(m)
            return _head(f(x))

        return loss, model, _data(ids)

    return build


def _eqx_mha(eqx, key):
    mha = eqx.nn.MultiheadAttention(2, D, key=key, use_query_bias=True, use_output_bias=True)
    drop = eqx.nn.Dropout(0.1, inference=True)

    class Block(eqx.Module):
        mha: eqx.nn.MultiheadAttention
        drop: eqx.nn.Dropout

        def __call__(self, x):
            return self.drop(self.mha(x, x, x))

    return Block(mha, drop)


def _eqx_conv(eqx, key):
    conv = eqx.nn.Conv1d(D, D, kernel_size=3, padding=1, key=key)
    return lambda_module(eqx, conv, lambda c, x: c(x.T).T)


def lambda_module(eqx, inner, fn):
    class Wrap(eqx.Module):
        inner: object

        def __call__(self, x):
            return fn(self.inner, x)

    return Wrap(inner)


def _linen(make, ids=False):
    def build():
        import flax.linen as nn

        mod = make(nn)
        batch = _data(ids)
        x = batch["ids" if ids else "x"]
        params = mod.init(jax.random.PRNGKey(0), x)["params"]

        def loss(p, b):
            return _head(mod.apply({"params": p}, b["ids" if ids else "x"]))

        return loss, params, batch

    return build


def _nnx(make, ids=False):
    def build():
        from flax import nnx

        mod = make(nnx, nnx.Rngs(0))
        graphdef, params = nnx.split(mod, nnx.Param)

        def loss(p, b):
            m = nnx.merge(graphdef, p)
            return _head(m(b["ids" if ids else "x"]))

        return loss, params, _data(ids)

    return build


def _haiku(make, ids=False):
    def build():
        import haiku as hk

        net = hk.without_apply_rng(hk.transform(lambda x: make(hk)(x)))
        batch = _data(ids)
        params = net.init(jax.random.PRNGKey(0), batch["ids" if ids else "x"])

        def loss(p, b):
            return _head(net.apply(p, b["ids" if ids else "x"]))

        return loss, params, batch

    return build


def _hk_mha(hk):
    mha = hk.MultiHeadAttention(num_heads=2, key_size=D // 2, model_size=D,
                                w_init=hk.initializers.VarianceScaling(1.0))
    return lambda x: mha(x, x, x)


LAYERS = {
    # (framework, layer): builder
    ("Equinox", "Linear"): _eqx(lambda eqx, k: eqx.nn.Linear(D, D, key=k)),
    ("Equinox", "Embedding"): _eqx(lambda eqx, k: eqx.nn.Embedding(V, D, key=k), ids=True),
    ("Equinox", "MultiheadAttention + Dropout"): _eqx(_eqx_mha, per_token=False),
    ("Equinox", "LayerNorm"): _eqx(lambda eqx, k: eqx.nn.LayerNorm(D)),
    ("Equinox", "RMSNorm"): _eqx(lambda eqx, k: eqx.nn.RMSNorm(D)),
    ("Equinox", "Conv1d"): _eqx(_eqx_conv, per_token=False),
    ("Flax linen", "Dense"): _linen(lambda nn: nn.Dense(D)),
    ("Flax linen", "Embed"): _linen(lambda nn: nn.Embed(V, D), ids=True),
    ("Flax linen", "MultiHeadDotProductAttention"): _linen(
        lambda nn: nn.SelfAttention(num_heads=2, qkv_features=D)),
    ("Flax linen", "LayerNorm"): _linen(lambda nn: nn.LayerNorm()),
    ("Flax linen", "RMSNorm"): _linen(lambda nn: nn.RMSNorm()),
    ("Flax linen", "Conv"): _linen(lambda nn: nn.Conv(D, (3,))),
    ("Flax nnx", "Linear"): _nnx(lambda nnx, r: nnx.Linear(D, D, rngs=r)),
    ("Flax nnx", "Embed"): _nnx(lambda nnx, r: nnx.Embed(V, D, rngs=r), ids=True),
    ("Flax nnx", "MultiHeadAttention"): _nnx(
        lambda nnx, r: nnx.MultiHeadAttention(num_heads=2, in_features=D, decode=False,
                                              rngs=r)),
    ("Flax nnx", "LayerNorm"): _nnx(lambda nnx, r: nnx.LayerNorm(D, rngs=r)),
    ("Flax nnx", "RMSNorm"): _nnx(lambda nnx, r: nnx.RMSNorm(D, rngs=r)),
    ("Flax nnx", "Conv"): _nnx(lambda nnx, r: nnx.Conv(D, D, (3,), rngs=r)),
    ("Haiku", "Linear"): _haiku(lambda hk: hk.Linear(D)),
    ("Haiku", "Embed"): _haiku(lambda hk: hk.Embed(V, D), ids=True),
    ("Haiku", "MultiHeadAttention"): _haiku(_hk_mha),
    ("Haiku", "LayerNorm"): _haiku(
        lambda hk: hk.LayerNorm(axis=-1, create_scale=True, create_offset=True)),
    ("Haiku", "RMSNorm"): _haiku(lambda hk: hk.RMSNorm(axis=-1)),
    ("Haiku", "Conv1D"): _haiku(lambda hk: hk.Conv1D(D, 3)),
}

# What each parameter role must get: (kind, rule of second_moment).
EXPECTED = {
    "weight": ("dense", "streamed"),
    "embedding": ("embedding", "streamed"),
    "bias": ("scale-shift", "materialised"),
    "scale": ("scale-shift", "materialised"),
    "conv": ("conv", "streamed"),
}


def _role(layer, path, kinds):
    names = [n for n in re.findall(r"[A-Za-z_0-9]+", path) if n != "value"]
    last = names[-1].lower()
    if "Embed" in layer:
        return "embedding"
    if kinds == ["conv"]:
        return "conv"
    if last in ("b", "bias", "offset"):
        return "bias"
    if last in ("scale", "g") or (last == "weight" and "Norm" in layer):
        return "scale"
    return "weight"


def _report(key):
    try:
        loss, params, batch = LAYERS[key]()
    except ImportError as e:  # pragma: no cover - frameworks are in the test extra
        pytest.skip(f"{key}: {e}")
    rep = js.explain(loss, js.stats.second_moment())(params, batch)
    return rep, (loss, params, batch)


def table_rows():
    rows = []
    for key in LAYERS:
        rep, _ = _report(key)
        parts = []
        for leaf in rep.leaves:
            parts_ = re.findall(r"\['([^']*)'\]|\.(\w+)|\[(\d+)\]", leaf.path)
            name = "/".join(next(x for x in t if x) for t in parts_ if t != ("", "value", ""))
            parts.append(f"`{name}`: {'+'.join(leaf.kinds) or '-'}, {leaf.rule}")
        rows.append((key[0], key[1], "; ".join(parts)))
    return rows


def table_markdown():
    lines = ["| library | layer | parameter: kind, rule of `second_moment` |", "|---|---|---|"]
    lines += [f"| {a} | {b} | {c} |" for a, b, c in table_rows()]
    return "\n".join(lines)


@pytest.mark.parametrize("key", list(LAYERS), ids=lambda k: f"{k[0]}-{k[1]}")
def test_layer_kinds_rules_and_oracle(key):
    rep, (loss, params, batch) = _report(key)
    assert rep.fallback_leaves == [], str(rep)
    for leaf in rep.leaves:
        role = _role(key[1], leaf.path, leaf.kinds)
        kind, rule = EXPECTED[role]
        assert leaf.kinds and all(k == kind for k in leaf.kinds), (key, leaf.path, str(rep))
        assert leaf.rule == rule, (key, leaf.path, str(rep))
    # and the numbers: second moment and norms against vmap(grad)
    m2, sq = js.per_example_stat(loss, (js.stats.second_moment(), js.stats.sq_norms()))(
        params, batch)
    arr = lambda t: [x for x in jax.tree.leaves(t) if hasattr(x, "shape")]  # noqa: E731
    one = lambda p, ex: loss(p, jax.tree.map(lambda a: a[None], ex))  # noqa: E731
    if isinstance(params, dict) or not callable(params):
        g = jax.jit(jax.vmap(jax.grad(one), in_axes=(None, 0)))(params, batch)
    else:  # an Equinox model: differentiate its inexact arrays
        import equinox as eqx

        g = jax.vmap(eqx.filter_grad(one), in_axes=(None, 0))(params, batch)
    gl = [x for x in jax.tree.leaves(g) if hasattr(x, "shape") and x.ndim >= 1]
    ml = arr(m2)
    assert len(gl) == len(ml)
    for a, e in zip(ml, gl, strict=True):
        np.testing.assert_allclose(a, jnp.mean(e**2, 0), rtol=2e-4, atol=1e-7)
    np.testing.assert_allclose(sq, sum(jnp.sum(e.reshape(B, -1) ** 2, 1) for e in gl),
                               rtol=2e-4)


def test_equinox_embedding_costs_like_flax_embed():
    """eqx.nn.Embedding's statistics form no [B, V, d] tensor (as Flax's nn.Embed)."""
    reps = {k: _report(k)[0] for k in [("Equinox", "Embedding"), ("Flax linen", "Embed")]}
    b_eqx = reps[("Equinox", "Embedding")].leaves[0].extra_bytes
    b_flax = reps[("Flax linen", "Embed")].leaves[0].extra_bytes
    assert b_eqx <= b_flax and b_eqx < B * V * D * 4


def test_docs_table_is_generated():
    text = DOC.read_text()
    assert START in text and END in text, f"{DOC} lacks the layer table markers"
    shown = text.split(START)[1].split(END)[0].strip()
    assert shown == table_markdown(), (
        "docs/howto/frameworks.md's layer table is out of date: run "
        "`python tests/test_library_layers.py --write`"
    )


if __name__ == "__main__" and "--write" in sys.argv:
    text = DOC.read_text()
    head, rest = text.split(START)
    _, tail = rest.split(END)
    DOC.write_text(f"{head}{START}\n{table_markdown()}\n{END}{tail}")
    print("wrote", DOC)
