"""Is the batch loss a mean of per-example terms? Proved from its jaxpr at trace time.

`per_example_stat` defines per-example gradients by the batch-of-one convention,
``l_b = fn(params, batch[b:b+1])``. That describes the model being trained only when the
batch loss is a (weighted) sum of per-example terms: a loss that divides by the batch's
token count, batch norm in training mode, in-batch negatives or a softmax over the batch
make the examples interact, and every statistic would silently describe each example
alone in a batch of one. This module traces the *batch* loss once (``jax.make_jaxpr``:
nothing runs) and proves the property by abstract interpretation, following the batch
axis through the jaxpr. Every variable gets a tag:

* ``None`` -- does not depend on the examples (parameters, other arguments, constants,
  iota, keys);
* `Ex` ``(axis, outer, inner, perm)`` -- along ``axis`` (of size ``outer * B * inner``:
  the batch axis, possibly merged with its neighbours by reshapes) element ``i`` depends
  on example ``(i // inner) % B`` only; the other axes are free. Slices, ``rev``, ``pad``,
  ``concatenate`` and ``split`` along the batch axis move the examples: ``perm`` then
  names the example at each position (-1: none), so that ``jnp.roll(k, 1, axis=0)`` or
  ``x[::-1]`` meeting ``x`` pairs different examples, and a sum counting some examples
  more often than others (``losses[:k]``) is told from one counting each once;
* `Cur` -- inside the body of a scan over the batch axis (``lax.map`` over examples, or
  a ``fori_loop`` from 0 to B that reads ``x[i]``): it depends on the current example;
* `One` -- a single example taken out of the batch (``x[i]``, ``jnp.unstack``, a Python
  loop over the batch): every element depends on that example only;
* `Sum` -- a sum over examples of per-example terms (``reduce_sum`` over the batch axis,
  a contraction of it with a constant or with another example-aligned value), closed
  under the linear operations (+, -, multiplication or division by a constant, layout);
  `Acc` is the carry of such a loop that adds each example's term to it. Terms of
  examples taken out one by one (``sum(loss(x[i]) for i in range(B))``) make a *partial*
  sum: per term the weight of each example and a key of what computed it (`_Interp.key`:
  the same operations on each example's own values, the example's position left out).
  The loss is a mean of per-example terms when every term weighs all examples alike;
* `Cross` -- the examples interact: where it arose (an equation, and the reduction over
  the batch it combined with per-example values or used non-linearly);
* `Unknown` -- the jaxpr cannot decide (a gather or scatter across the batch axis by
  data, as in graph batching; a primitive without a rule; a psum over a named axis the
  call does not know, which is at least its operand: `Unknown.under`).

Beside the tags, values tagged None may be *lined up* with the batch (`Lined`): an axis
of size B whose entries differ by position (an argument outside ``batch_argnums``,
``jnp.arange(B)``, random bits of one key with the batch's shape). Where such an axis
meets the batch axis element by element, in a contraction or as the indices (or updates)
of a gather or scatter along it, example b meets entry b in the batch loss, but example b
alone in a batch of one meets all B entries: `Cross`, naming the value and its fix. A
value that merely has an axis of size B (a ``[d, B]`` weight) is never a signal; only its
meeting the batch axis is.

The loss must come out ``None`` or `Sum` (a partial one weighing every example alike):
`Cross` raises `CrossExampleError`, `Unknown` warns with `CrossExampleWarning`. Rules are
keyed by primitive objects; an unknown primitive touching the examples gives `Unknown`,
never a false alarm.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import warnings

import jax
import numpy as np

from jaxpr_surgery._src import compat, walker
from jaxpr_surgery._src.independence.interp import _Interp
from jaxpr_surgery._src.independence.tables import _leaf_lined
from jaxpr_surgery._src.independence.tags import (
    _ONE_BY_ONE_FIX,
    Cross,
    Ex,
    Lined,
    One,
    Sum,
    Unknown,
    _uneven,
)


class CrossExampleError(ValueError):
    """The examples of the batch loss interact, so per-example gradients are not defined.

    Raised by `per_example_stat` and `value_and_per_example_stat` at trace time when the
    jaxpr of the batch loss reduces across examples other than by the final (weighted)
    mean: a token count of the whole batch in a denominator, batch norm in training mode,
    in-batch negatives, a softmax over the batch. The message names the operation and
    its source line. Normalise per example, or pass ``check=False`` to opt out.
    """


class CrossExampleWarning(UserWarning):
    """The jaxpr could not prove that the batch loss is a mean of per-example terms.

    Emitted once per trace where the check cannot decide, e.g. a gather or scatter across
    the batch axis by data (graph batching, where the examples live on a node axis).
    Run `check_per_example` once on a real batch to check numerically; pass
    ``check=False`` to silence it.
    """


# --------------------------------------------------------------------------- #
# The verdict
# --------------------------------------------------------------------------- #
INDEPENDENT = "independent"
CROSS = "cross-example"
UNDECIDED = "undecided"
SKIPPED = "not checked"

# (the package: this file is jaxpr_surgery/_src/independence/__init__.py)
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _where(eqn, root):
    """``prim`` at the innermost user line, and the line in the user's function calling it.
    Equations traced inside a library's ``jit`` (``jnp.nanmean``) record no user frame:
    they are placed at the nearest enclosing call that does."""
    path = walker.path_to(root, eqn) or [eqn]
    what = f"`{eqn.primitive}`"
    for outer in reversed(path):
        frames = compat.user_frames(outer, _PACKAGE_DIR)
        if frames:
            name = outer.params.get("name") if outer is not eqn else None
            if isinstance(name, str):
                what += f" (in {name})"
            break
    if not frames:
        return what
    where = f"{what} at {frames[0]}"
    if len(frames) > 1:
        where += f", called from {frames[-1]}"
    return where


@dataclasses.dataclass(frozen=True)
class Verdict:
    """What the check found: ``kind`` is ``"independent"``, ``"cross-example"``,
    ``"undecided"`` or ``"not checked"``; ``detail`` says where and why."""

    kind: str
    detail: str = ""
    fix: str = ""  # for "cross-example": the fix, where not the usual one

    def __str__(self):
        return self.kind + (f": {self.detail}" if self.detail else "")


def _describe(tag, root):
    text = f"{_where(tag.eqn, root)} {tag.why}"
    via = getattr(tag, "via", None)
    if via is not None:
        text += f", {getattr(tag, 'how', 'computed by')} {_where(via, root)}"
    return text


def batch_loss_jaxpr(prep):
    """The jaxpr of the batch loss (the first output of ``fn``) on the call's arguments."""

    def loss_of(diff_leaves, ex_leaves, other_leaves):
        out = prep.fn(*prep.rebuild(diff_leaves, ex_leaves, other_leaves, one_example=False))
        return prep.split_out(out)[0]

    try:
        return jax.make_jaxpr(loss_of)(prep.diff_leaves, prep.ex_leaves, prep.other_leaves)
    except Exception as e:
        e.add_note(
            f"jaxpr_surgery: raised tracing fn on the whole batch (B={prep.B}), which the "
            "cross-example check of the loss does; fn must accept the batch, or pass "
            "check=False."
        )
        raise


def verdict(prep, data_axes=frozenset()) -> Verdict:
    """Traces the batch loss of ``prep`` (an arguments.Prepared) and decides whether it is a
    (weighted) mean of per-example terms."""
    if not prep.opts.keep_batch_dim:
        return Verdict(SKIPPED, "keep_batch_dim=False: fn is written for one example")
    if prep.B == 1:
        return Verdict(INDEPENDENT, "a batch of one example")
    closed = batch_loss_jaxpr(prep)
    tags = ([None] * len(prep.diff_leaves) + [Ex(0)] * len(prep.ex_leaves)
            + [None] * len(prep.other_leaves))
    it = _Interp(prep.B, frozenset(data_axes))
    for v, lined in zip(closed.jaxpr.invars, _leaf_lined(prep, prep.B)):
        if lined:
            it.lined[v] = lined
    for v, c in zip(closed.jaxpr.constvars, closed.consts):
        src = Lined(f"an array closed over by fn (shape {list(np.shape(c))})",
                    "pass it in the batch (batch_argnums) if it holds one entry per example")
        lined = {a: src for a, n in enumerate(np.shape(c)) if n == prep.B}
        if lined:
            it.lined[v] = lined
    (out,) = it.tags_of(closed.jaxpr, tags)[:1]
    if isinstance(out, One):  # the loss of one example taken out of the batch
        weights = np.zeros(prep.B)
        weights[out.example] = 1.0
        out = Sum(out.by, frozenset({(-1, tuple(weights))}))
    if out is None or (isinstance(out, Sum) and not out.terms):
        return Verdict(INDEPENDENT, "")
    if isinstance(out, Sum):
        cross = Cross(out.origin, _uneven(out), out.by, how="an example taken out by")
        return Verdict(CROSS, _describe(cross, closed.jaxpr), _ONE_BY_ONE_FIX)
    if isinstance(out, Cross):
        return Verdict(CROSS, _describe(out, closed.jaxpr), out.fix)
    if isinstance(out, Unknown):
        return Verdict(UNDECIDED, _describe(out, closed.jaxpr))
    # a scalar loss cannot keep the batch axis; anything else is a bug of this module
    return Verdict(UNDECIDED, f"the loss has an unexpected tag {out}")  # pragma: no cover


def check(prep, name, data_axes=frozenset()):
    """Raises `CrossExampleError` when the examples of the batch loss interact, warns
    `CrossExampleWarning` when the jaxpr cannot decide."""
    v = verdict(prep, data_axes)
    if v.kind == CROSS and v.fix:
        raise CrossExampleError(
            f"{name}: the loss is not a mean of per-example terms: {v.detail}. Per-example "
            "gradients are those of each example alone in a batch of one, whose loss is then "
            "not its term of the batch loss: every statistic would describe another loss, "
            f"and mean() would differ from jax.grad. Fix: {v.fix}; or pass check=False to "
            "compute the statistics of the batch-of-one losses anyway."
        )
    if v.kind == CROSS:
        raise CrossExampleError(
            f"{name}: the loss is not a mean of per-example terms: {v.detail}. The examples "
            "of the batch interact, so per-example gradients of this loss are not defined: "
            "every statistic would describe each example alone in a batch of one, and "
            "mean() would differ from jax.grad. Fix: normalise per example (e.g. divide each "
            "example's token sum by its own token count, take the mean over examples, and "
            "pass example_weights=<each example's token count> to the returned function: "
            "mean() is then jax.grad of the loss normalised by the batch's token count; run "
            "batch norm in inference mode; take negatives from outside the batch), or pass "
            "check=False to compute the statistics of the batch-of-one losses anyway."
        )
    if v.kind == UNDECIDED:
        warnings.warn(
            f"{name}: could not prove from the jaxpr that the loss is a mean of per-example "
            f"terms: {v.detail}. If the examples interact, every statistic describes each "
            "example alone in a batch of one. Run js.check_per_example(fn)(*args) once on "
            "a real batch to check numerically, and pass check=False to silence this warning.",
            CrossExampleWarning,
            stacklevel=_user_stacklevel(),
        )
    return v


def _user_stacklevel():
    """The stack level of the first frame outside this package and jax (the user's call)."""
    jax_dir = os.path.dirname(os.path.abspath(jax.__file__))
    f, level = sys._getframe(1), 1
    while f is not None:
        path = os.path.abspath(f.f_code.co_filename)
        if not (path.startswith(_PACKAGE_DIR) or path.startswith(jax_dir)):
            return level
        f, level = f.f_back, level + 1
    return 2
