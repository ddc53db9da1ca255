"""Models written by other people: Hugging Face Flax GPT-2, BERT, ViT and Gemma, and
DeepMind's recurrentgemma (Griffin), used as their authors wrote them, against vmap(grad)
in float32 and float64, with every leaf on a fast or materialised rule (no fallback).

transformers < 5 (the last with Flax models) is in the ``test`` extra, so the README's
test command runs this suite. recurrentgemma pins absl-py < 2, which conflicts with chex,
so it is not; install it with ``pip install --no-deps recurrentgemma einops jaxtyping``.
Each model is skipped when its library is missing. HF's Flax T5 is not here: it calls
``jnp.clip(a_max=...)``, which jax >= 0.10 removed.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import zoo

import jaxpr_surgery as js

pytestmark = pytest.mark.slow


def _ce(logits, y):
    lp = jax.nn.log_softmax(logits)
    return -jnp.mean(jnp.take_along_axis(lp, y[..., None], -1))


def _hf():
    return pytest.importorskip("transformers")


def _cast(tree, dtype):
    return jax.tree.map(lambda x: jnp.asarray(x, dtype), tree)


def _causal_lm(m, vocab, r, dtype):
    """Next-token loss, parameters and a batch of a Hugging Face causal LM ``m``."""
    b = {"ids": jnp.asarray(r.integers(0, vocab, (4, 8)))}
    loss = lambda p, b: _ce(m(b["ids"], params=p).logits[:, :-1], b["ids"][:, 1:])  # noqa: E731
    return loss, _cast(m.params, dtype), b


def gpt2(r, dtype):
    T = _hf()
    cfg = T.GPT2Config(vocab_size=50, n_positions=16, n_embd=16, n_layer=2, n_head=2)
    return _causal_lm(T.FlaxGPT2LMHeadModel(cfg, seed=0, dtype=dtype), 50, r, dtype)


def bert(r, dtype):
    T = _hf()
    cfg = T.BertConfig(vocab_size=40, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                       intermediate_size=32, max_position_embeddings=16, num_labels=3)
    m = T.FlaxBertForSequenceClassification(cfg, seed=0, dtype=dtype)
    b = {"ids": jnp.asarray(r.integers(0, 40, (4, 8))), "y": jnp.asarray(r.integers(0, 3, (4,)))}
    return (lambda p, b: _ce(m(b["ids"], params=p).logits, b["y"])), _cast(m.params, dtype), b


def vit(r, dtype):
    T = _hf()
    cfg = T.ViTConfig(image_size=8, patch_size=4, num_channels=3, hidden_size=16,
                      num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
                      num_labels=3)
    m = T.FlaxViTForImageClassification(cfg, seed=0, dtype=dtype)
    b = {"x": jnp.asarray(r.normal(size=(4, 3, 8, 8)), dtype),
         "y": jnp.asarray(r.integers(0, 3, (4,)))}
    return (lambda p, b: _ce(m(b["x"], params=p).logits, b["y"])), _cast(m.params, dtype), b


def gemma(r, dtype):
    T = _hf()
    cfg = T.GemmaConfig(vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                        num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                        max_position_embeddings=16)
    return _causal_lm(T.FlaxGemmaForCausalLM(cfg, seed=0, dtype=dtype), 50, r, dtype)


def griffin(r, dtype):
    rgj = pytest.importorskip("recurrentgemma.jax")
    cfg = rgj.GriffinConfig(
        vocab_size=50, width=16, mlp_expanded_width=32, num_heads=2,
        block_types=(rgj.TemporalBlockType.RECURRENT, rgj.TemporalBlockType.ATTENTION),
        embeddings_scale_by_sqrt_dim=True, attention_window_size=4, logits_soft_cap=30.0,
        scan_type=rgj.ScanType.LINEAR_NATIVE)
    m = rgj.Griffin(cfg)
    ids = jnp.asarray(r.integers(0, 50, (4, 8)))
    b = {"ids": ids, "pos": jnp.broadcast_to(jnp.arange(8), (4, 8))}
    params = _cast(m.init(jax.random.PRNGKey(0), b["ids"], b["pos"])["params"], dtype)

    def loss(p, b):
        logits, _ = m.apply({"params": p}, b["ids"], b["pos"], return_cache=False)
        return _ce(logits[:, :-1], b["ids"][:, 1:])

    return loss, params, b


MODELS = {"gpt2": gpt2, "bert": bert, "vit": vit, "gemma": gemma, "griffin": griffin}


@functools.cache
def _built(name, dtype):
    """``MODELS[name]`` built once per process (a model's construction runs its library's
    initialisation eagerly: seconds); the module's tests share one worker (conftest)."""
    with jax.enable_x64(dtype == jnp.float64):
        return MODELS[name](np.random.default_rng(0), dtype)


STATS = {"mean": js.stats.mean(), "sm": js.stats.second_moment(), "var": js.stats.variance(),
         "sign": js.stats.sign_mean(), "abs": js.stats.abs_mean(), "n": js.stats.sq_norms(),
         "clip": js.stats.clipped_mean(0.05)}
TOL = {jnp.float32: dict(rtol=1e-4, atol=1e-5), jnp.float64: dict(rtol=1e-9, atol=1e-12)}
#: HF's Flax Gemma computes its RMSNorm variance in float32 whatever the model's dtype, so
#: in float64 the batched and per-example programs agree to float32 rounding only
F64_TOL = {"gemma": dict(rtol=1e-5, atol=1e-7)}


#: the key of each statistic of STATS -> (its name, options) for the zoo's oracle
ORACLE = {"mean": ("mean", {}), "sm": ("second_moment", {}), "var": ("variance", {}),
          "abs": ("abs_mean", {}), "clip": ("clipped_mean", {"clip_norm": 0.05}),
          "n": ("sq_norms", {})}


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_statistics_match_vmap_grad(name, dtype):
    with jax.enable_x64(dtype == jnp.float64):
        loss, params, batch = _built(name, dtype)
        got = jax.jit(js.per_example_stat(loss, STATS))(params, batch)
        g = zoo.vmap_grads(loss, params, batch)
        want = {k: zoo.oracle_from_grads(g, n, **kw) for k, (n, kw) in ORACLE.items()}
        tol = F64_TOL.get(name, TOL[dtype]) if dtype == jnp.float64 else TOL[dtype]
        for k, w in want.items():
            top = max(float(np.max(np.abs(x))) for x in jax.tree.leaves(w))
            for a, b in zip(jax.tree.leaves(got[k]), jax.tree.leaves(w)):
                assert a.dtype == dtype, (k, a.dtype)
                np.testing.assert_allclose(a, b, rtol=tol["rtol"], atol=tol["atol"] * top,
                                           err_msg=f"{name} {k}")
        # sign: exact wherever no per-example coordinate is within rounding of 0 (attention
        # key biases have a zero gradient: their per-example values are rounding noise)
        scale = max(float(jnp.max(jnp.abs(x))) for x in jax.tree.leaves(g))
        sign = jax.tree.leaves(zoo.oracle_from_grads(g, "sign_mean"))
        for a, x, w in zip(jax.tree.leaves(got["sign"]), jax.tree.leaves(g), sign, strict=True):
            safe = jnp.all(jnp.abs(x) > 1e3 * jnp.finfo(dtype).eps * scale, 0)
            np.testing.assert_allclose(jnp.where(safe, a, 0), np.where(safe, w, 0), atol=1e-6)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_no_leaf_falls_back(name):
    """Every parameter of these models meets the data where a rule sees it: no leaf gets
    exact per-example gradients through the whole model."""
    with jax.enable_x64(True):  # (the float64 model of the oracle test: built once)
        loss, params, batch = _built(name, jnp.float64)
        rep = js.explain(loss, tuple(STATS.values()))(params, batch)
    assert not rep.fallback_leaves, str(rep)
