"""``check_per_example``: checks numerically, on one concrete batch, that a loss is a
mean (or sum) of independent per-example losses.

Two comparisons against the losses of the examples alone in a batch of one: the
value (`_reduction`), then the derivative along one random direction, by reverse
mode (`_Probe.derivative`, `_check_gradient`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxpr_surgery._src import compat, walker
from jaxpr_surgery._src.arguments import is_array, norm_nums

_NAME = "check_per_example"
# the per-example gradients are formed a few examples at a time, at most this many bytes
_GRAD_BYTES = 64 << 20


def check_per_example(
    fn: Callable[..., Any],
    *,
    argnums: int | Sequence[int] = 0,
    batch_argnums: int | Sequence[int] = 1,
    has_aux: bool = False,
    rtol: float | None = None,
    atol: float | None = None,
    seed: int = 0,
) -> Callable[..., None]:
    r"""Checks that ``fn`` is a mean (or sum) of independent per-example losses; raises if not.

    Two comparisons, both against the per-example losses
    \(l_b = \mathrm{fn}(\ldots, \mathrm{batch}[b{:}b{+}1])\):

    * the value: ``fn(*args)`` must equal \(\frac1B\sum_b l_b\) (a mean loss) or
      \(\sum_b l_b\) (a sum loss);
    * the gradient: the derivative of ``fn`` along a random direction of the
      differentiated arguments (``argnums``) must equal the mean (or sum) of the
      per-example derivatives. This catches examples that interact only through
      the gradient, such as a ``stop_gradient``-ed batch statistic or a custom
      backward pass that normalises over the batch. The derivatives are gradients
      (reverse mode) projected on the direction, so models with ``jax.custom_vjp``
      ops are checked too; the per-example gradients are formed a few examples at
      a time (at most 64 MiB of them).

    Models whose examples interact (batch norm in training mode, in-batch
    negatives, normalising by the whole batch's token count) fail: their
    per-example gradients are not defined, and every statistic computed with
    the batch-of-one convention would silently describe a different model.
    It is a one-off check on concrete values: call it outside ``jit``.
    `per_example_stat` already refuses the cross-example forms it can prove from
    the jaxpr at trace time (``check=True``); this numerical check covers what the
    jaxpr cannot decide.

    Args:
      fn: the loss, ``fn(*args) -> scalar`` (or ``(scalar, aux)`` with ``has_aux``).
      argnums: the positional argument(s) the gradient check differentiates (their
        float leaves).
      batch_argnums: the positional argument(s) holding the batch; every leaf has the
        examples on its leading axis.
      has_aux: whether ``fn`` returns ``(loss, aux)``; ``aux`` is not checked.
      rtol: relative tolerance of both comparisons; ``None``: by the least precise
        floating dtype the loss computes in (a float32 loss of a bfloat16 model agrees
        only to bfloat16's precision): ``1e-9`` for float64, ``1e-4`` for float32, four
        times the machine epsilon for 16-bit floats (``3e-2`` for bfloat16).
      atol: absolute tolerance; ``None``: ``1e-12`` for float64, ``1e-6`` for float32,
        ``eps / 16`` for 16-bit floats.
      seed: seed of the random direction of the gradient check.

    Returns:
      A function of ``fn``'s arguments that returns ``None`` or raises ``ValueError``.

    Examples:
      >>> import jax.numpy as jnp, jaxpr_surgery as js
      >>> loss = lambda w, b: jnp.mean((b["x"] @ w - b["y"]) ** 2)
      >>> w = jnp.ones((3,)); b = {"x": jnp.eye(4, 3), "y": jnp.arange(4.0)}
      >>> js.check_per_example(loss)(w, b)  # None: the examples are independent
      >>> def centred(w, b):  # subtracts the batch's mean prediction
      ...     z = b["x"] @ w
      ...     return jnp.mean((z - jnp.mean(z) - b["y"]) ** 2)
      >>> js.check_per_example(centred)(w, b)
      Traceback (most recent call last):
      ...
      ValueError: check_per_example: fn(batch) = ... the examples of this model interact ...
    """

    def check(*args):
        nums = norm_nums(batch_argnums, "batch_argnums", len(args))
        dnums = norm_nums(argnums, "argnums", len(args))
        batch = _Batch.of(args, nums)
        probe = _Probe.of(fn, args, batch, dnums, has_aux, seed)
        full = probe.value(args)
        per = _over_examples(lambda ex: probe.value(probe.one(ex)), batch.leaves, batch.size)
        tol = _Tolerance.for_dtype(_least_precise(probe, jnp.result_type(full)), rtol, atol)
        per = np.asarray(per, np.float64)
        kind, reduce = _reduction(float(full), per, batch.size, tol)
        _check_gradient(probe, batch, kind, reduce, tol, argnums)

    return check


# --------------------------------------------------------------------------- #
# Argument handling
# --------------------------------------------------------------------------- #
@dataclasses.dataclass(frozen=True)
class _Batch:
    """The batch arguments of one call: their positions, flat leaves, treedef and size."""

    nums: tuple[int, ...]
    leaves: list
    tree: Any
    size: int

    @classmethod
    def of(cls, args, nums):
        """Reads the batch (the arguments at positions ``nums``) out of ``args``; raises
        on traced values, on leaves without a common leading example axis and on an
        empty batch."""
        if any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(args)):
            raise TypeError(
                f"{_NAME}: called on traced values (inside jit, vmap or grad). It is a one-off "
                "check on concrete values: call it once outside jit, e.g. on the first batch."
            )
        leaves, tree = jax.tree.flatten(tuple(args[i] for i in nums))
        sizes = {int(np.shape(x)[0]) for x in leaves if np.ndim(x) > 0}
        if not leaves or len(sizes) != 1 or any(np.ndim(x) == 0 for x in leaves):
            raise ValueError(
                f"{_NAME}: every batch leaf needs the same leading example axis; got "
                f"shapes {[np.shape(x) for x in leaves]}."
            )
        (size,) = sizes
        if size == 0:
            raise ValueError(f"{_NAME}: the batch is empty (0 examples); nothing to check.")
        return cls(nums, leaves, tree, size)

    def replace(self, args, ex_leaves):
        """``args`` with the batch arguments rebuilt from ``ex_leaves``."""
        args = list(args)
        parts = jax.tree.unflatten(self.tree, ex_leaves)
        for k, i in enumerate(self.nums):
            args[i] = parts[k]
        return args


# --------------------------------------------------------------------------- #
# fn's value and its derivative along a random direction
# --------------------------------------------------------------------------- #
@dataclasses.dataclass(frozen=True)
class _Probe:
    """Evaluates ``fn`` (its loss, without ``aux``) and its derivative along one random
    direction of the float leaves of the differentiated arguments."""

    fn: Callable[..., Any]
    has_aux: bool
    args: tuple
    batch: _Batch
    dnums: tuple[int, ...]
    dflat: list  # the leaves of the differentiated arguments
    dtree: Any
    is_float: list  # which of them the direction moves
    base: list  # their float leaves
    tangent: list  # the direction, one array per float leaf

    @classmethod
    def of(cls, fn, args, batch, dnums, has_aux, seed):
        """The probe of ``fn`` at ``args``, differentiating the arguments at ``dnums``
        along a direction drawn from ``seed``."""
        dflat, dtree = jax.tree.flatten(tuple(args[i] for i in dnums))
        is_float = [
            is_array(x) and jnp.issubdtype(jnp.result_type(x), jnp.floating) for x in dflat
        ]
        rng = np.random.default_rng(seed)
        tangent = [
            jnp.asarray(rng.standard_normal(np.shape(x)), jnp.result_type(x))
            for x, f in zip(dflat, is_float)
            if f
        ]
        base = [x for x, f in zip(dflat, is_float) if f]
        return cls(fn, has_aux, args, batch, dnums, dflat, dtree, is_float, base, tangent)

    def value(self, a):
        """The loss ``fn(*a)`` (without ``aux``)."""
        out = self.fn(*a)
        return out[0] if self.has_aux else out

    def one(self, ex):
        """The call's arguments with the batch replaced by the one example ``ex``."""
        return self.batch.replace(self.args, [x[None] for x in ex])

    def _value_at(self, a, floats):
        it = iter(floats)
        leaves = [next(it) if f else x for x, f in zip(self.dflat, self.is_float)]
        d = jax.tree.unflatten(self.dtree, leaves)
        a2 = list(a)
        for k, i in enumerate(self.dnums):
            a2[i] = d[k]
        return self.value(a2)

    def derivative(self, a):
        """fn's derivative along the random direction at ``a``, by reverse mode (a
        custom_vjp op has no forward mode): the gradient projected on the direction."""
        if not self.base:
            return jnp.zeros(())
        grads = jax.grad(lambda floats: self._value_at(a, floats))(self.base)
        acc = jnp.result_type(jnp.float32, *[x.dtype for x in grads])
        return sum(jnp.sum(x.astype(acc) * t.astype(acc)) for x, t in zip(grads, self.tangent))

    def examples_per_map(self):
        """How many examples' gradients are formed at once (they fit in `_GRAD_BYTES`)."""
        grad_bytes = sum(
            np.size(x) * jnp.dtype(jnp.result_type(x)).itemsize for x in self.base
        )
        return max(1, min(self.batch.size, _GRAD_BYTES // max(1, grad_bytes)))


# --------------------------------------------------------------------------- #
# The two comparisons
# --------------------------------------------------------------------------- #
@dataclasses.dataclass(frozen=True)
class _Tolerance:
    rtol: float
    atol: float

    @classmethod
    def for_dtype(cls, dtype, rtol, atol):
        """The given tolerances, or defaults for ``dtype`` (`_least_precise`)."""
        eps = float(jnp.finfo(dtype).eps)
        if eps <= float(jnp.finfo(jnp.float64).eps):
            r, a = 1e-9, 1e-12
        elif eps <= float(jnp.finfo(jnp.float32).eps):
            r, a = 1e-4, 1e-6
        else:  # 16-bit (and narrower) floats
            r, a = 4 * eps, eps / 16
        return cls(rtol if rtol is not None else r, atol if atol is not None else a)

    def close(self, x, y, scale):
        return abs(x - y) <= self.atol + self.rtol * scale


def _least_precise(probe, loss_dtype):
    """The least precise floating dtype ``fn`` computes in on the call's arguments (its
    loss's at least), read from its jaxpr: a float32 loss of a model that computes in
    bfloat16 matches the per-example losses and gradients only to bfloat16's precision."""
    worst = jnp.dtype(loss_dtype)
    if not jnp.issubdtype(worst, jnp.floating):
        worst = jnp.dtype(jnp.float32)
    leaves, tree = jax.tree.flatten(probe.args)
    is_arr = [is_array(x) for x in leaves]

    def loss(arrays):  # non-array leaves (static settings, modules' functions) stay put
        it = iter(arrays)
        return probe.value(jax.tree.unflatten(tree, [next(it) if a else x
                                                    for x, a in zip(leaves, is_arr)]))

    try:
        closed = jax.make_jaxpr(loss)([x for x, a in zip(leaves, is_arr) if a])
    except Exception:  # noqa: BLE001 - the loss ran on these arguments; keep its dtype
        return worst

    def visit(jaxpr):
        nonlocal worst
        for eqn in jaxpr.eqns:
            for v in eqn.outvars:
                dt = getattr(v.aval, "dtype", None)
                if (dt is not None and jnp.issubdtype(dt, jnp.floating)
                        and jnp.finfo(dt).eps > jnp.finfo(worst).eps):
                    worst = jnp.dtype(dt)
            for sub in walker.bodies(eqn):
                visit(sub)

    visit(closed.jaxpr)
    return worst


def _reduction(full_v, per, size, tol):
    """The value check: ``("mean", np.mean)`` or ``("sum", np.sum)``, whichever the
    per-example losses ``per`` reduce by to the batch's loss ``full_v``; raises if neither."""
    mean_v, sum_v = per.mean(), per.sum()
    if tol.close(full_v, mean_v, abs(mean_v) + np.abs(per).mean()):
        return "mean", np.mean
    if size > 1 and tol.close(full_v, sum_v, abs(sum_v) + np.abs(per).sum()):
        return "sum", np.sum
    raise ValueError(_value_message(full_v, mean_v, sum_v))


def _over_examples(f, leaves, per_map):
    """``f`` of every example, ``per_map`` of them vectorised at a time; one at a time
    where jax cannot vectorise ``fn`` (``jax.vmap`` of a ``ragged_dot`` with weights
    shared by the examples raises NotImplementedError)."""
    try:
        return jax.lax.map(f, leaves, batch_size=per_map if per_map > 1 else None)
    except NotImplementedError:
        return jax.lax.map(f, leaves)


def _check_gradient(probe, batch, kind, reduce, tol, argnums):
    """The gradient check: fn's derivative along the probe's direction against the
    ``kind`` (mean or sum, by ``reduce``) of the per-example derivatives."""
    dfull_v = float(probe.derivative(probe.args))
    # one example's gradient at a time, a few examples vectorised
    dper = _over_examples(
        lambda ex: probe.derivative(probe.one(ex)), batch.leaves, probe.examples_per_map()
    )
    dper = np.asarray(dper, np.float64)
    dref, dscale = reduce(dper), reduce(np.abs(dper))
    if not tol.close(dfull_v, dref, abs(dref) + dscale):
        raise ValueError(_gradient_message(kind, argnums, dfull_v, dref))


# --------------------------------------------------------------------------- #
# Messages
# --------------------------------------------------------------------------- #
def _value_message(full_v, mean_v, sum_v):
    return (
        f"{_NAME}: fn(batch) = {full_v:.8g} but the mean of the per-example losses "
        f"fn(batch[b:b+1]) is {mean_v:.8g} (their sum {sum_v:.8g}): the examples of "
        "this model interact (batch norm, in-batch negatives, normalising by the batch's "
        "token count, ...). Per-example gradients of such a model are not defined; "
        "statistics computed by jaxpr_surgery would describe each example alone in a "
        "batch of one. Make the loss a mean of independent per-example terms (e.g. batch "
        "norm in inference mode, per-example normalisation)."
    )


def _gradient_message(kind, argnums, dfull_v, dref):
    return (
        f"{_NAME}: the loss values agree ({kind} of per-example losses), but the "
        f"gradients do not: along a random direction of argnums={argnums}, fn's "
        f"derivative is {dfull_v:.8g} and the {kind} of the per-example derivatives is "
        f"{dref:.8g}. The examples interact through the gradient only (e.g. a "
        "stop_gradient-ed batch statistic, or a batch-dependent weight); per-example "
        "gradients of such a model describe a different function."
    )


# --------------------------------------------------------------------------- #
# check_rule: a registered custom op against its reference, on the user's model
# --------------------------------------------------------------------------- #
_RULE = "check_rule"


def check_rule(
    fn: Callable[..., Any],
    *,
    argnums: int | Sequence[int] = 0,
    batch_argnums: int | Sequence[int] = 1,
    keep_batch_dim: bool = True,
    has_aux: bool = False,
    rtol: float | None = None,
    atol: float | None = None,
) -> Callable[..., list]:
    r"""Checks, on ``fn``'s own model and batch, each registered custom op it calls
    against the reference or the rule it was registered with (`register_custom_op`);
    raises if one disagrees.

    Statistics of a registered op's parameters come from its reference or its rule. This
    check makes sure they are those of the op the model trains with, on every example
    alone in a batch of one (as the statistics see it), against the per-example
    gradients through the op's own backward pass (``jax.vmap(jax.grad(per_example_loss))``,
    as JAX differentiates the op):

    * an op with a reference: the loss with the op and with the op replaced by its
      reference must agree (the forward), and so must every differentiated leaf's
      per-example gradient through the op's backward and through the reference. An
      approximate or straight-through backward, a backward that rescales, or a reference
      of another layout fails, with the op, the leaf and the error named;
    * an op with a rule (`CustomOpRule`): the statistics computed with the rule (mean,
      second moment, per-leaf squared norms, a clipped mean) must equal those of the
      op's per-example gradients; a failure names the rule's method whose law breaks
      (``per_example_grad``, ``sq_norms`` or ``summed_grad``).

    Args:
      fn: the loss, ``fn(*args) -> scalar`` (or ``(scalar, aux)`` with ``has_aux``),
        as given to `per_example_stat`.
      argnums, batch_argnums, keep_batch_dim, has_aux: as for `per_example_stat`.
      rtol: relative tolerance (of each leaf's largest per-example gradient entry);
        ``None``: ``1e-9`` in float64, ``1e-4`` in float32, four machine epsilons in
        16-bit floats.
      atol: absolute tolerance; ``None``: ``1e-12`` / ``1e-6`` / ``eps / 16``.

    Returns:
      A function of ``fn``'s arguments that returns the names of the ops checked, or
      raises ``ValueError`` (an op disagrees with its reference, or ``fn`` calls no
      registered op).

    Examples:
      >>> import jax, jax.numpy as jnp, jaxpr_surgery as js
      >>> @jax.custom_vjp
      ... def dense(w, x):
      ...     return x @ w
      >>> dense.defvjp(lambda w, x: (x @ w, (w, x)),
      ...              lambda r, dy: (jnp.einsum("...i,...j->ij", r[1], dy), dy @ r[0].T))
      >>> loss = lambda w, b: jnp.mean(dense(w, b) ** 2)
      >>> with js.extend.register_custom_op(dense, lambda w, x: x @ w):
      ...     js.extend.check_rule(loss)(jnp.ones((3, 2)), jnp.ones((4, 3)))
      ['dense']
    """
    from jaxpr_surgery._src import api, arguments, custom_ops

    def check(*args):
        opts = api.make_options(argnums, batch_argnums, keep_batch_dim, has_aux, None, False, None,
                                 None, False)
        prep = arguments.Prepared(fn, args, opts, _RULE)
        closed, _ = prep.trace(substitute=False)
        entries = custom_ops.ops_in(closed)
        if not entries:
            raise ValueError(
                f"{_RULE}: fn calls no registered custom op on these arguments "
                "(register_custom_op(op, reference) first; only jax.custom_vjp ops called "
                "with the registered op object are recognised)."
            )
        mine = _per_example_values(closed, prep)
        dtypes = [x.dtype for x in prep.diff_leaves] + [closed.out_avals[0].dtype]
        tol = _Tolerance.for_dtype(jnp.result_type(*dtypes), rtol, atol)
        for entry in entries:
            if entry.reference is not None:
                theirs = _per_example_values(custom_ops.substitute(closed, only=entry), prep)
                _compare_rule(entry.name, prep, mine, theirs, tol)
        rules = [e for e in entries if e.rule is not None]
        if rules:
            _check_rules(fn, args, prep, mine, tol, rules, opts)
        return [e.name for e in entries]

    return check


def _per_example_values(closed, prep):
    """``(losses [B], per-example gradients [[B, *leaf]])`` of the per-example jaxpr
    ``closed``, a few examples vectorised at a time."""
    f = compat.jaxpr_as_fun(closed)

    def one(ex):
        def loss(diff):
            return f(*diff, *ex, *prep.other_leaves)[0]

        return jax.value_and_grad(loss)(list(prep.diff_leaves))

    per_grad = sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in prep.diff_leaves)
    per_map = max(1, min(prep.B, _GRAD_BYTES // max(per_grad, 1)))
    losses, grads = jax.jit(lambda ex: _over_examples(one, ex, per_map))(list(prep.ex_leaves))
    return np.asarray(losses, np.float64), [np.asarray(g, np.float64) for g in grads]


def _off_leaves(paths, got, want, tol):
    """``[(path, max error, max |want|)]`` of the leaves where ``got`` is not within
    ``tol`` of ``want`` (relative to the leaf's largest entry of ``want``)."""
    bad = []
    for path, a, b in zip(paths, got, want):
        scale = float(np.max(np.abs(b))) if b.size else 0.0
        err = float(np.max(np.abs(a - b))) if b.size else 0.0
        if not tol.close(err, 0.0, scale):
            bad.append((path or "(params)", err, scale))
    return bad


def _compare_rule(name, prep, mine, theirs, tol):
    (l_op, g_op), (l_ref, g_ref) = mine, theirs
    scale = float(np.max(np.abs(l_op))) if l_op.size else 0.0
    err = float(np.max(np.abs(l_op - l_ref))) if l_op.size else 0.0
    if not tol.close(err, 0.0, scale):
        raise ValueError(
            f"{_RULE}: custom op {name}: the per-example losses with the op and with its "
            f"reference differ by up to {err:.3g} (losses up to {scale:.3g}; rtol={tol.rtol}, "
            f"atol={tol.atol}): the reference does not compute what the op computes."
        )
    bad = [f"{path}: up to {err:.3g} off (entries up to {scale:.3g})"
           for path, err, scale in _off_leaves(prep.diff_paths, g_ref, g_op, tol)]
    if bad:
        raise ValueError(
            f"{_RULE}: custom op {name}: the per-example gradients through the op's own "
            "backward pass and through its reference differ (rtol="
            f"{tol.rtol}, atol={tol.atol}) at " + "; ".join(bad) + ". The op's backward "
            "is not the derivative of the reference (an approximate, straight-through or "
            "rescaled backward?), so statistics from the reference would describe another "
            "model. Remove the registration: the op's parameters then take the exact "
            "per-example route through its own backward."
        )


def _check_rules(fn, args, prep, mine, tol, entries, opts):
    """The statistics of ``fn`` with the ops' rules (mean, second moment, per-leaf squared
    norms, a clipped mean) against those of the per-example gradients through the ops'
    own backward passes (``mine``); raises naming the rule's method whose law fails."""
    from jaxpr_surgery._src import api
    from jaxpr_surgery._src import stats as S

    _, g_op = mine
    B = prep.B
    sq = [np.sum(g.reshape(B, -1) ** 2, axis=1) for g in g_op]
    norms = np.sqrt(np.sum(sq, axis=0))
    clip = float(np.median(norms)) or 1.0
    coef = np.minimum(1.0, clip / np.where(norms > 0, norms, 1.0))
    want = {
        "mean": [g.mean(0) for g in g_op],
        "second_moment": [(g**2).mean(0) for g in g_op],
        "sq_norms": sq,
        "clipped_mean": [np.tensordot(coef, g, 1) / B for g in g_op],
    }
    stats = {"mean": S.mean(), "second_moment": S.second_moment(),
             "sq_norms": S.sq_norms(per_leaf=True), "clipped_mean": S.clipped_mean(clip)}
    got = api.per_example_stat(fn, stats, argnums=opts.argnums,
                               batch_argnums=opts.batch_argnums,
                               keep_batch_dim=opts.keep_batch_dim, has_aux=opts.has_aux,
                               check=False)(*args)  # (a check of rules, not of the loss)
    if opts.has_aux:
        got = got[0]
    bad = {}
    for name, ws in want.items():
        gs = [np.asarray(x, np.float64) for x in prep.flatten_like_diff(got[name])]
        off = _off_leaves(prep.diff_paths, gs, ws, tol)
        if off:
            bad[name] = [f"{path} up to {err:.3g} off (values up to {scale:.3g})"
                         for path, err, scale in off]
    if not bad:
        return
    which = ("per_example_grad" if "second_moment" in bad
             else "sq_norms" if "sq_norms" in bad else "summed_grad")
    names = ", ".join(e.describe for e in entries)
    raise ValueError(
        f"{_RULE}: the rules of {names}: the statistics with the rule and those "
        "of the per-example gradients through the op's own backward pass differ (rtol="
        f"{tol.rtol}, atol={tol.atol}): "
        + "; ".join(f"{k}: " + ", ".join(v) for k, v in bad.items())
        + f". The rule's {which} "
        + ("does not give the op's per-example gradients (its backward pass, for the "
           "cotangents given)." if which == "per_example_grad" else
           "breaks its law (equal to what per_example_grad gives: "
           + ("the squares summed per example)." if which == "sq_norms" else
              "the gradients summed).")))
