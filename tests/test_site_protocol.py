"""A layer kind is one class plus one registration (docs/extending.md): a toy kernel
registered from this test serves the sites it matches, with a fast rule of its own
keyed by a reduction class, and every statistic is exact against vmap(grad).

The toy kind: a per-feature gain ``w [d]`` multiplying tokens ``x [T, d]`` of each
example, whose per-example gradient is ``G_b = sum_t x_bt * dy_bt`` (formed from the
site's inputs, no per-example VJP) and whose plain sum is one contraction.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxpr_surgery as js
from jaxpr_surgery._src import compat
from jaxpr_surgery._src.sites import base

B, T, D = 5, 4, 3


class TokenGainKernel(base.Kernel):
    """``x [T, d] * broadcast(w [d])``: ``G_b = sum_t x_bt * dy_bt``."""

    kind = "toy-token-gain"
    anchors = (compat.mul_p,)
    priority = 10  # asked before the package's scale-shift kernel

    @classmethod
    def matches(cls, eqn, tag, pos, patterns):
        # (the per-example jaxpr keeps a batch axis of 1: the view is [1, 1, d])
        w, out = tag.base.aval.shape, eqn.outvars[0].aval.shape
        return (
            len(pos) == 1
            and len(out) >= 2
            and math.prod(w) == w[-1] == out[-1]
            and all(e.primitive is compat.broadcast_p for e in tag.pre)
        )

    def prepare(self, w, ext, ext_batched, dy):
        (x,) = ext  # the data operand, [B, ..., d]
        (d,) = dy if isinstance(dy, tuple) else (dy,)
        flat = lambda a: a.reshape(a.shape[0], -1, a.shape[-1]).astype(self.acc)  # noqa: E731
        return flat(x), flat(d)

    def scale(self, ctx, c):
        x, d = ctx
        return x, d * c

    def materialise(self, ctx):
        x, d = ctx
        G = jnp.einsum("btd,btd->bd", x, d)
        return G.reshape((G.shape[0],) + tuple(self.site.view_shape))

    FAST = {
        js.stats.PhiSum: base.Fast(
            lambda k, ctx, r: jnp.einsum("btd,btd->d", *ctx).reshape(k.site.view_shape),
            lambda k, r: r.linear,
        ),
    }


@pytest.fixture
def toy_kind(monkeypatch):
    """Registers the toy kernel for the test only (the registry's tables restored)."""
    monkeypatch.setattr(base, "KERNELS", dict(base.KERNELS))
    rules = {p: list(v) for p, v in base.SITE_RULES.items()}
    monkeypatch.setattr(base, "SITE_RULES", rules)
    base.register(TokenGainKernel)
    yield TokenGainKernel


def _loss(p, batch):
    h = jnp.tanh(batch["x"] * p["g"])  # [b, T, D] * [D]: the toy site
    return jnp.mean(jnp.sum((h @ p["w"]) ** 2, axis=(1, 2)))


def _case():
    r = np.random.default_rng(0)
    p = {"g": jnp.asarray(r.normal(size=(D,)) + 1.0), "w": jnp.asarray(r.normal(size=(D, 2)))}
    return p, {"x": jnp.asarray(r.normal(size=(B, T, D)))}


STATS = {
    "mean": js.stats.mean(),
    "second_moment": js.stats.second_moment(),
    "variance": js.stats.variance(),
    "sq_norms": js.stats.sq_norms(per_leaf=True),
    "clipped_mean": js.stats.clipped_mean(0.5),
}


def _oracle(p, batch):
    one = lambda p, ex: _loss(p, jax.tree.map(lambda a: a[None], ex))  # noqa: E731
    g = jax.jit(jax.vmap(jax.grad(one), (None, 0)))(p, batch)
    g = {k: np.asarray(v, np.float64) for k, v in g.items()}
    sq = {k: np.sum(v.reshape(B, -1) ** 2, 1) for k, v in g.items()}
    c = np.minimum(1, 0.5 / np.sqrt(sum(sq.values())))
    return {
        "mean": {k: v.mean(0) for k, v in g.items()},
        "second_moment": {k: (v**2).mean(0) for k, v in g.items()},
        "variance": {k: v.var(0, ddof=1) for k, v in g.items()},
        "sq_norms": sq,
        "clipped_mean": {k: np.tensordot(c, v, 1) / B for k, v in g.items()},
    }


def test_a_registered_kind_serves_its_sites_exactly(toy_kind):
    with jax.enable_x64(True):
        p, batch = _case()
        rep = js.explain(_loss, STATS)(p, batch)
        kinds = {str(leaf.path): leaf.kinds for leaf in rep.leaves}
        assert any(toy_kind.kind in k for k in kinds.values()), kinds
        out = jax.jit(js.per_example_stat(_loss, STATS))(p, batch)
        want = _oracle(p, batch)
        for name in STATS:
            for k in want[name]:
                np.testing.assert_allclose(np.asarray(out[name][k]), want[name][k],
                                           rtol=1e-12, atol=1e-14, err_msg=f"{name}[{k}]")


def test_without_the_registration_the_package_serves_the_site():
    """The same model without the toy kind: another kernel, the same values."""
    with jax.enable_x64(True):
        p, batch = _case()
        rep = js.explain(_loss, STATS)(p, batch)
        assert all(TokenGainKernel.kind not in leaf.kinds for leaf in rep.leaves)
        out = js.per_example_stat(_loss, STATS)(p, batch)
        np.testing.assert_allclose(out["variance"]["g"], _oracle(p, batch)["variance"]["g"],
                                   rtol=1e-12)


def test_the_fast_rule_is_taken(toy_kind, monkeypatch):
    """The plain sum comes from the kernel's fast rule, not from `materialise`."""
    calls = []
    orig = TokenGainKernel.materialise
    monkeypatch.setattr(TokenGainKernel, "materialise",
                        lambda self, ctx: calls.append(1) or orig(self, ctx))
    p, batch = _case()
    js.per_example_stat(_loss, js.stats.mean())(p, batch)
    assert not calls
    js.per_example_stat(_loss, js.stats.second_moment())(p, batch)
    assert calls  # no fast rule: from the per-example gradients
