"""Models written by other people: Hugging Face Flax GPT-2, BERT, ViT and Gemma, and
DeepMind's recurrentgemma (Griffin), against vmap(grad).

Optional: ``pip install -e ".[thirdparty]"`` (transformers < 5, the last with Flax
models). recurrentgemma pins absl-py < 2, which conflicts with chex, so it is not in
the extra; install it with ``pip install --no-deps recurrentgemma einops jaxtyping``.
Each model is skipped when its library is missing. HF's Flax T5 is not here: it calls
``jnp.clip(a_max=...)``, which jax >= 0.10 removed.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxpr_surgery as js


def _ce(logits, y):
    lp = jax.nn.log_softmax(logits)
    return -jnp.mean(jnp.take_along_axis(lp, y[..., None], -1))


def _hf():
    return pytest.importorskip("transformers")


def gpt2(r):
    T = _hf()
    cfg = T.GPT2Config(vocab_size=50, n_positions=16, n_embd=16, n_layer=2, n_head=2)
    m = T.FlaxGPT2LMHeadModel(cfg, seed=0)
    b = {"ids": jnp.asarray(r.integers(0, 50, (4, 8)))}
    return (lambda p, b: _ce(m(b["ids"], params=p).logits[:, :-1], b["ids"][:, 1:])), m.params, b


def bert(r):
    T = _hf()
    cfg = T.BertConfig(vocab_size=40, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                       intermediate_size=32, max_position_embeddings=16, num_labels=3)
    m = T.FlaxBertForSequenceClassification(cfg, seed=0)
    b = {"ids": jnp.asarray(r.integers(0, 40, (4, 8))), "y": jnp.asarray(r.integers(0, 3, (4,)))}
    return (lambda p, b: _ce(m(b["ids"], params=p).logits, b["y"])), m.params, b


def vit(r):
    T = _hf()
    cfg = T.ViTConfig(image_size=8, patch_size=4, num_channels=3, hidden_size=16,
                      num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
                      num_labels=3)
    m = T.FlaxViTForImageClassification(cfg, seed=0)
    b = {"x": jnp.asarray(r.normal(size=(4, 3, 8, 8)), jnp.float32),
         "y": jnp.asarray(r.integers(0, 3, (4,)))}
    return (lambda p, b: _ce(m(b["x"], params=p).logits, b["y"])), m.params, b


def gemma(r):
    T = _hf()
    cfg = T.GemmaConfig(vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                        num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                        max_position_embeddings=16)
    m = T.FlaxGemmaForCausalLM(cfg, seed=0)
    b = {"ids": jnp.asarray(r.integers(0, 50, (4, 8)))}
    return (lambda p, b: _ce(m(b["ids"], params=p).logits[:, :-1], b["ids"][:, 1:])), m.params, b


def griffin(r):
    rgj = pytest.importorskip("recurrentgemma.jax")
    cfg = rgj.GriffinConfig(
        vocab_size=50, width=16, mlp_expanded_width=32, num_heads=2,
        block_types=(rgj.TemporalBlockType.RECURRENT, rgj.TemporalBlockType.ATTENTION),
        embeddings_scale_by_sqrt_dim=True, attention_window_size=4, logits_soft_cap=30.0,
        scan_type=rgj.ScanType.LINEAR_NATIVE)
    m = rgj.Griffin(cfg)
    ids = jnp.asarray(r.integers(0, 50, (4, 8)))
    b = {"ids": ids, "pos": jnp.broadcast_to(jnp.arange(8), (4, 8))}
    params = m.init(jax.random.PRNGKey(0), b["ids"], b["pos"])["params"]

    def loss(p, b):
        logits, _ = m.apply({"params": p}, b["ids"], b["pos"], return_cache=False)
        return _ce(logits[:, :-1], b["ids"][:, 1:])

    return loss, params, b


MODELS = {"gpt2": gpt2, "bert": bert, "vit": vit, "gemma": gemma, "griffin": griffin}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_statistics_match_vmap_grad(name):
    loss, params, batch = MODELS[name](np.random.default_rng(0))
    stats = {"mean": js.stats.mean(), "sm": js.stats.second_moment(), "n": js.stats.sq_norms(),
             "var": js.stats.variance()}
    got = jax.jit(js.per_example_stat(loss, stats))(params, batch)
    g = jax.vmap(jax.grad(lambda p, ex: loss(p, jax.tree.map(lambda a: a[None], ex))),
                 (None, 0))(params, batch)
    want = {"mean": jax.tree.map(lambda x: x.mean(0), g),
            "sm": jax.tree.map(lambda x: jnp.mean(x**2, 0), g),
            "var": jax.tree.map(lambda x: jnp.var(x, 0, ddof=1), g)}
    for k, w in want.items():
        top = max(float(jnp.max(jnp.abs(x))) for x in jax.tree.leaves(w))
        for a, b in zip(jax.tree.leaves(got[k]), jax.tree.leaves(w)):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5 * top, err_msg=f"{name} {k}")
    n = sum(jnp.sum(x.reshape(x.shape[0], -1) ** 2, 1) for x in jax.tree.leaves(g))
    np.testing.assert_allclose(got["n"], n, rtol=1e-4)
    rep = js.explain(loss, js.stats.second_moment())(params, batch)
    assert sum(leaf.fallback for leaf in rep.leaves) <= 2  # position tables / custom_jvp gates
