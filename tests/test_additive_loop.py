"""Several plain sums in one tile loop (``tiling.additive_loop``).

On CPU, where a site's tile loop serves two or more `Reduction.additive` sums (the mean
beside E[g²], a sign mean, a user's sum of a function), it takes several examples a step
and keeps the sums stacked in one array. Checked against ``vmap(grad)`` with batches no
step divides, carried chunks, feature blocks and a tied table, and that the loop is the
one that ran; and that a reduction that only looks additive never takes it.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import zoo
from _models import assert_tree_close, per_example_grads

import jaxpr_surgery as js
from jaxpr_surgery._src import stats as S
from jaxpr_surgery._src import tiling


def _model(B, dtype, V=301, d=24, T=5, seed=0):
    """Token MLP on a tied table: dense sites with a token axis, an embedding and the
    table's transpose (its ``G`` in feature blocks under a small budget)."""
    k = jax.random.split(jax.random.PRNGKey(seed), 6)
    p = {
        "table": (0.5 * jax.random.normal(k[0], (V, d))).astype(dtype),
        "w1": (jax.random.normal(k[1], (d, 2 * d)) / np.sqrt(d)).astype(dtype),
        "b1": (0.1 * jax.random.normal(k[2], (2 * d,))).astype(dtype),
        "w2": (jax.random.normal(k[3], (2 * d, d)) / np.sqrt(2 * d)).astype(dtype),
    }
    batch = {"ids": jax.random.randint(k[4], (B, T), 0, V),
             "y": jax.random.randint(k[5], (B, T), 0, V)}

    def loss(p, b):
        h = p["table"][b["ids"]]
        h = h + jnp.tanh(h @ p["w1"] + p["b1"]) @ p["w2"]
        logp = jax.nn.log_softmax(h @ p["table"].T)
        return -jnp.mean(jnp.take_along_axis(logp, b["y"][..., None], -1))

    return loss, p, batch


def _cube(g):
    return g * g * g


STATS = {
    "mean": js.stats.mean(),
    "second_moment": js.stats.second_moment(),
    "sign_mean": js.stats.sign_mean(),
    "cube": js.stats.elementwise(_cube, name="cube"),
}


def _expected(loss, p, batch):
    g = per_example_grads(loss, p, batch)
    B = batch["ids"].shape[0]
    f = {"mean": lambda x: x, "second_moment": jnp.square, "sign_mean": jnp.sign,
         "cube": _cube}
    return {n: jax.tree.map(lambda x, f=f[n]: np.asarray(f(x)).sum(0) / B, g) for n in STATS}


@pytest.fixture
def steps(monkeypatch):
    """The unrolled steps every tile loop of the call took (``additive_unroll``)."""
    seen = []
    orig = tiling.additive_unroll

    def spy(*a, **k):
        out = orig(*a, **k)
        seen.append(out)
        return out

    monkeypatch.setattr(tiling, "additive_unroll", spy)
    return seen


@pytest.mark.parametrize("B,chunk,budget", [
    (2, None, None),  # one step of two
    (9, None, None),  # two steps of four and a remainder of one
    (7, 3, None),  # chunks of three: carried sums, a step of three and a chunk of one
    (6, None, 1),  # feature blocks of the tied table and of the dense weights
    (5, 2, 1),  # both
])
def test_sums_together_match_the_oracle(steps, B, chunk, budget):
    with zoo.x64():
        loss, p, batch = _model(B, jnp.float64)
        want = _expected(loss, p, batch)
        out = jax.jit(js.per_example_stat(loss, tuple(STATS.values()), chunk_size=chunk,
                                          memory_budget_bytes=budget))(p, batch)
    for name, v in zip(STATS, out):
        assert_tree_close(v, want[name], rtol=1e-10, atol=1e-12, err_msg=name)
    assert any(k > 1 for k in steps), f"no tile loop took several examples a step: {steps}"


def test_float32_and_each_sum_alone_agree():
    """The stacked loop in float32, against the same statistics asked one at a time
    (the plain tile loop: one sum each)."""
    loss, p, batch = _model(9, jnp.float32)
    with jax.default_matmul_precision("highest"):
        together = jax.jit(js.per_example_stat(loss, tuple(STATS.values())))(p, batch)
        for name, v in zip(STATS, together):
            alone = jax.jit(js.per_example_stat(loss, STATS[name]))(p, batch)
            assert_tree_close(v, alone, rtol=2e-5, atol=2e-6, err_msg=name)


def test_when_the_loop_is_taken(monkeypatch):
    f32 = jnp.float32
    two = [S.PhiSum(), S.PhiSum(jnp.square, multiplicative=True, name="sq")]
    monkeypatch.setattr(tiling, "prefer_per_example", lambda: True)
    assert tiling.additive_unroll(9, two, 1, (8, 8), f32) == tiling.ADDITIVE_UNROLL
    assert tiling.additive_unroll(3, two, 1, (8, 8), f32) == 3  # at most the batch
    assert tiling.additive_unroll(9, two[:1], 1, (8, 8), f32) == 1  # one sum: plain loop
    assert tiling.additive_unroll(9, two, 2, (8, 8), f32) == 1  # batched tiles
    big = (tiling.ADDITIVE_UNROLL_BYTES // 16, 2)  # two examples' G fill the bound
    assert tiling.additive_unroll(9, two, 1, big, f32) == 2
    assert tiling.additive_unroll(9, two + [S.Centered()], 1, (8, 8), f32) == 1
    monkeypatch.setattr(tiling, "prefer_per_example", lambda: False)  # GPU
    assert tiling.additive_unroll(9, two, 1, (8, 8), f32) == 1


@dataclasses.dataclass(frozen=True, eq=False)
class _Trimmed(S.PhiSum):
    """A sum of a function whose ``from_examples`` drops the largest term: a
    `PhiSum` by class, not additive by what it computes."""

    def from_examples(self, G):
        t = self.apply(G)
        return jnp.sum(t, axis=0) - jnp.max(t, axis=0)

    def _key(self):
        return ("trimmed",) + super()._key()


def test_a_subclass_that_changes_the_sum_is_not_additive():
    (sign,) = js.stats.sign_mean().reductions().values()
    assert S.is_additive(S.PhiSum()) and S.is_additive(sign)
    assert not S.is_additive(_Trimmed())
    assert not S.is_additive(S.Centered()) and not S.is_additive(S.SqNorms())

    @dataclasses.dataclass(frozen=True, eq=False)
    class Declared(_Trimmed):
        additive = True  # (a subclass may say so again, and then it is)

    assert S.is_additive(Declared())
