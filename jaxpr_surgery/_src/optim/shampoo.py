r"""Shampoo with per-example Kronecker moments (and classic Shampoo).

For a leaf with \(k \ge 1\) axes Shampoo keeps one statistic per axis,

\[ L_j \leftarrow \beta_2 L_j + (1-\beta_2) S_j,\qquad L_j = 0 \text{ at start}, \]

and updates by \(\bar g\) multiplied along each axis \(j\) by
\((L_j/(1-\beta_2^t) + \varepsilon I)^{-1/(2k)}\). Classic Shampoo takes
\(S_j = U_j(\bar g)U_j(\bar g)^\top\) of the batch-mean gradient; the
per-example variant takes \(S_j = \frac1B\sum_b U_j(g_b)U_j(g_b)^\top\), entry
\(j\) of `jaxpr_surgery.stats.kron_moments`: the matrix analogue of MicroAdam's
\(E_b[g_b^2]\) against Adam's \(\bar g^2\) (Roulet & Agarwala ask which one a
preconditioner should follow). An axis longer than ``max_dim`` keeps a diagonal
(a vector) and its power is elementwise.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxpr_surgery._src import stats as _stats
from jaxpr_surgery._src.optim.requests import (
    PerExampleTransformation,
    positive_int,
    register_request,
    register_static_hyperparams,
    require_like,
)
from jaxpr_surgery._src.optim.wrappers import chain

__all__ = ["ScaleByShampooState", "scale_by_shampoo", "shampoo"]


class ScaleByShampooState(NamedTuple):
    """State of `scale_by_shampoo`.

    Attributes:
      count: number of updates so far (int32 scalar).
      stats: per leaf, a tuple over its axes of the EMA ``L_j`` (``[n, n]``, or
        ``[n]`` for an axis longer than ``max_dim``); ``()`` for a 0-d leaf.
      roots: per leaf, the inverse roots in use (recomputed every
        ``precondition_every`` steps).
    """

    count: jax.Array
    stats: optax.Updates
    roots: optax.Updates


def _unfold(g, j):
    return jnp.moveaxis(g, j, 0).reshape(g.shape[j], -1)


def _outer_stats(g, max_dim, dtype):
    """``U_j(g) U_j(g)^T`` per axis (the diagonal for long axes) of one array."""
    g = g.astype(dtype)
    out = []
    for j, n in enumerate(g.shape):
        u = _unfold(g, j)
        out.append(u @ u.T if n <= max_dim else jnp.sum(u * u, axis=1))
    return tuple(out)


def _inv_root(a, p, eps):
    """``(a + eps I)^(-1/p)`` of a symmetric PSD matrix, or elementwise of a vector."""
    tiny = jnp.finfo(a.dtype).tiny
    if isinstance(eps, float):
        floor = eps if eps > 0 else tiny
    else:  # injected (an array, maybe traced)
        eps = jnp.asarray(eps).astype(a.dtype)
        floor = jnp.where(eps > 0, eps, tiny)
    if a.ndim == 1:
        return jnp.maximum(a + eps, floor) ** (-1.0 / p)
    w, v = jnp.linalg.eigh(a + eps * jnp.eye(a.shape[0], dtype=a.dtype))
    w = jnp.maximum(w, floor) ** (-1.0 / p)
    return (v * w) @ v.T


def _apply(g, roots, dtype):
    """``g`` multiplied along each axis ``j`` by ``roots[j]``."""
    out = g.astype(dtype)
    for j, r in enumerate(roots):
        if r.ndim == 1:
            shape = [1] * out.ndim
            shape[j] = -1
            out = out * r.reshape(shape)
        else:
            out = jnp.moveaxis(jnp.tensordot(r, out, axes=((1,), (j,))), 0, j)
    return out


def scale_by_shampoo(
    b2: float = 0.999,
    eps: float = 1e-8,
    per_example: bool = True,
    max_dim: int = 1024,
    precondition_every: int = 1,
) -> PerExampleTransformation:
    r"""Rescales updates by Shampoo's Kronecker preconditioner.

    For a leaf with \(k \ge 1\) axes, one statistic per axis \(j\):
    \(L_j \leftarrow \beta_2 L_j + (1-\beta_2) S_j\) (zero at start), and the
    update is \(\bar g\) multiplied along each axis \(j\) by
    \((L_j/(1-\beta_2^t) + \varepsilon I)^{-1/(2k)}\) (elementwise for an axis
    longer than ``max_dim``, whose statistic is a diagonal). For a matrix at step 1
    the update is \((M_0+\varepsilon I)^{-1/4}\,\bar g\,(M_1+\varepsilon I)^{-1/4}\).
    0-d leaves pass through unchanged. No grafting.

    With ``per_example=True``, \(S_j\) is entry \(j\) of
    `jaxpr_surgery.stats.kron_moments`, \(\frac1B\sum_b U_j(g_b)U_j(g_b)^\top\)
    (extra arg ``kron_moments``); with ``per_example=False`` it is
    \(U_j(\bar g)U_j(\bar g)^\top\) of the batch mean (classic Shampoo). With one
    example per batch the two coincide.

    Args:
      b2: decay of the EMA of the statistics, in [0, 1).
      eps: added to the diagonal before the inverse root (> 0 recommended).
      per_example: whether the statistics average per-example outer products.
      max_dim: axes longer than this keep a diagonal statistic (must match the
        ``kron_moments(max_dim)`` passed in; the request does).
      precondition_every: recompute the inverse roots (a symmetric
        eigendecomposition, in at least float32) every this many steps.

    Returns:
      A `PerExampleTransformation` requesting ``mean`` (and ``kron_moments`` when
      ``per_example``).

    Examples:
      >>> import jax.numpy as jnp, numpy as np
      >>> import jaxpr_surgery.optim as jso
      >>> tx = jso.scale_by_shampoo(per_example=False, eps=0.0)
      >>> g = jnp.array([[2.0, 0.0], [0.0, -2.0]])  # L_0 = L_1 = 4 I at step 1
      >>> state = tx.init(g)
      >>> u, state = tx.update(g, state)  # 4^(-1/4) g 4^(-1/4) = g / 2
      >>> print(np.asarray(u).round(4))
      [[ 1.  0.]
       [ 0. -1.]]

    References:
      Gupta, Koren & Singer, Shampoo: Preconditioned Stochastic Tensor Optimization
      <https://arxiv.org/abs/1802.09568>, 2018
    """
    eps, max_dim, precondition_every = _checked_hyperparams(b2, eps, max_dim,
                                                           precondition_every)
    stat = _stats.kron_moments(max_dim)

    def init_fn(params):
        return _init_state(params, max_dim)

    def update_fn(updates, state, params=None, *, kron_moments=None, **extra_args):
        del params, extra_args
        if per_example:
            if kron_moments is None:
                raise ValueError(
                    "scale_by_shampoo(per_example=True).update: missing the keyword extra arg "
                    "kron_moments= (the statistic js.stats.kron_moments(max_dim) of the "
                    "batch; js.optim.stat_request(opt) requests it)."
                )
            new = require_like(kron_moments, updates, "kron_moments", "scale_by_shampoo", True)
        else:
            new = jax.tree.map(lambda g: _outer_stats(g, max_dim, _acc_dtype(g)), updates)
        g_leaves, treedef = jax.tree.flatten(updates)
        s_leaves = treedef.flatten_up_to(state.stats)
        r_leaves = treedef.flatten_up_to(state.roots)
        n_leaves = treedef.flatten_up_to(new)
        count = optax.safe_increment(state.count)
        refresh = (state.count % precondition_every) == 0
        outs = [
            _leaf_update(g, s, r, tuple(m), b2, eps, max_dim, count, refresh)
            for g, s, r, m in zip(g_leaves, s_leaves, r_leaves, n_leaves)
        ]
        out_g, out_s, out_r = zip(*outs) if outs else ((), (), ())
        return treedef.unflatten(out_g), ScaleByShampooState(
            count, treedef.unflatten(out_s), treedef.unflatten(out_r)
        )

    request = {"mean": _stats.mean()}
    if per_example:
        request["kron_moments"] = stat
    return PerExampleTransformation(init_fn, update_fn, request)


def _checked_hyperparams(b2, eps, max_dim, precondition_every):
    """Raises on a bad hyperparameter of `scale_by_shampoo` (arrays injected by
    ``optax.inject_hyperparams`` pass unchecked); returns ``eps``, a Python float where
    it is a number, and ``max_dim`` and ``precondition_every`` as Python ints."""
    if isinstance(b2, (int, float)) and not 0 <= b2 < 1:
        raise ValueError(f"scale_by_shampoo(b2=...): must be in [0, 1), got {b2!r}.")
    injected = (jax.Array, np.ndarray, np.generic)
    if isinstance(eps, bool) or not isinstance(eps, (int, float, *injected)):
        raise ValueError(f"scale_by_shampoo(eps=...): must be a number >= 0, got {eps!r}.")
    if isinstance(eps, (int, float)):
        if not eps >= 0:
            raise ValueError(f"scale_by_shampoo(eps=...): must be a number >= 0, got {eps!r}.")
        eps = float(eps)
    if isinstance(max_dim, (jax.Array, np.ndarray)):
        raise TypeError(
            "scale_by_shampoo(max_dim=...): must be a Python int (it fixes the shapes of the "
            f"state), got {max_dim!r}. optax.inject_hyperparams injects ints as arrays: use "
            "js.optim.inject_hyperparams, which keeps max_dim static, or pass "
            "static_args=('max_dim', 'precondition_every')."
        )
    max_dim = positive_int(max_dim, "max_dim", "scale_by_shampoo",
                           "the largest axis kept as a full matrix")
    precondition_every = positive_int(precondition_every, "precondition_every",
                                      "scale_by_shampoo", "steps between inverse roots")
    return eps, max_dim, precondition_every


def _acc_dtype(p):
    return jnp.result_type(jnp.float32, p.dtype)


def _init_state(params, max_dim):
    """Zero statistics and identity roots per axis (vectors for axes over ``max_dim``)."""

    def stats(p):
        dt = _acc_dtype(p)
        return tuple(jnp.zeros((n, n) if n <= max_dim else (n,), dt) for n in jnp.shape(p))

    def roots(p):
        dt = _acc_dtype(p)
        return tuple(
            jnp.eye(n, dtype=dt) if n <= max_dim else jnp.ones((n,), dt) for n in jnp.shape(p)
        )

    return ScaleByShampooState(
        jnp.zeros([], jnp.int32), jax.tree.map(stats, params), jax.tree.map(roots, params)
    )


def _leaf_update(g, s, r, m, b2, eps, max_dim, count, refresh):
    """``(update, statistics, roots)`` of one leaf: the EMA of its statistics ``s`` with
    the batch's ``m``, the inverse roots recomputed when ``refresh``, and ``g``
    preconditioned by them."""
    if len(m) != len(s) or any(jnp.shape(a) != jnp.shape(b) for a, b in zip(m, s)):
        raise ValueError(
            f"scale_by_shampoo.update: kron_moments of a leaf of shape {jnp.shape(g)} "
            f"has shapes {[jnp.shape(a) for a in m]}, expected "
            f"{[jnp.shape(b) for b in s]}: compute it with "
            f"js.stats.kron_moments(max_dim={max_dim})."
        )
    if not s:  # 0-d leaf
        return g, s, r
    dt = s[0].dtype
    s = tuple(b2 * a + (1 - b2) * x.astype(dt) for a, x in zip(s, m))
    k = len(s)
    corr = 1 - b2 ** count.astype(dt)

    def fresh():
        return tuple(_inv_root(a / corr, 2 * k, eps) for a in s)

    kept = tuple(r)
    r = jax.lax.cond(refresh, fresh, lambda: kept)
    return _apply(g, r, dt).astype(g.dtype), s, r


def shampoo(
    learning_rate: optax.ScalarOrSchedule,
    b2: float = 0.999,
    eps: float = 1e-8,
    per_example: bool = True,
    max_dim: int = 1024,
    precondition_every: int = 1,
) -> PerExampleTransformation:
    r"""Shampoo: `scale_by_shampoo` then a step of ``-learning_rate``.

    ``per_example=True`` (the default) preconditions with per-example Kronecker
    moments (`jaxpr_surgery.stats.kron_moments`); ``False`` is classic Shampoo
    (outer products of the batch-mean gradient).

    Examples:
      >>> import jax, jax.numpy as jnp, optax
      >>> import jaxpr_surgery as js
      >>> loss = lambda w, b: jnp.mean((b["x"] @ w - b["y"]) ** 2)
      >>> batch = {"x": jnp.eye(3)[:, :2] + 0.5, "y": jnp.array([1.0, 2.0, 3.0])}
      >>> opt = js.optim.shampoo(0.1)
      >>> sorted(js.optim.stat_request(opt))
      ['kron_moments', 'mean']
      >>> w = jnp.zeros(2); state = opt.init(w)
      >>> stats = js.per_example_stat(loss, js.optim.stat_request(opt))(w, batch)
      >>> u, state = opt.update(stats["mean"], state, w, **js.optim.update_kwargs(stats))
      >>> w = optax.apply_updates(w, u)
    """
    return chain(
        scale_by_shampoo(b2, eps, per_example, max_dim, precondition_every),
        optax.scale_by_learning_rate(learning_rate),
    )


register_request("shampoo", ("kron_moments",))
register_request("scale_by_shampoo", ("kron_moments",))
register_static_hyperparams(shampoo, ("max_dim", "precondition_every"))
register_static_hyperparams(scale_by_shampoo, ("max_dim", "precondition_every"))
