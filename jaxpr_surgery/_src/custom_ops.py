"""Custom ops (``jax.custom_vjp``, ``jax.custom_jvp``) differentiated as a registered
reference function, or by a registered rule.

A custom op is opaque to the analysis: its derivative is the user's own function (a
``custom_vjp``'s backward pass, a ``custom_jvp``'s JVP), which the package cannot read,
so a parameter it touches gets the op's exact
per-example gradients (``materialised`` in ``explain``: ``jax.vmap`` of the op's VJP, the
cost of ``vmap(grad)``; ``fallback``, read per example, where the op takes several
parameters). A user who knows what the op computes
registers a *reference*, a JAX function with the op's operands and outputs whose
derivative is the op's backward pass (``jaxpr_surgery.extend.register_custom_op``). The
per-example jaxpr then has each call of the op replaced by a call of the reference
(`substitute`), before anything else reads it: the analysis finds the layers inside
(a fused dense layer is a dense site), and the statistics, the loss's value and the
other inputs' cotangents come from the reference, as ``jax.grad`` of the reference
would give them. ``extend.check_rule`` checks the declaration on the user's model: the
per-example gradients through the op's own backward against those through the
reference.

An equation is the op's when it binds the op's derivative function (the backward
function given to ``defvjp``, the JVP given to ``defjvp``; the equation keeps no
reference to the op object) and its primal function traces to the same program as the
op's at the same operands: two ops sharing one derivative function are told apart, and
an op not recognised keeps the exact route.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from typing import Any

import jax

from jaxpr_surgery._src import compat, walker

_BY_RULE: dict = {}  # the op's derivative function (`_rule_fn`) -> `_Entry`
# a primitive object -> the `_Entry` rules for its equations, in registration order
# (`register_primitive_rule`; each with its ``where``)
_BY_PRIM: dict = {}
# (registration, (argument tree, nondiff arguments), operand types) -> the printed jaxpr
# of the op's forward at those operands (dropped with the registration)
_PRIMAL_TEXT: dict = {}


def _rule_fn(op):
    """The function that names ``op`` in its calls' equations: a ``custom_vjp``'s
    backward function, a ``custom_jvp``'s JVP (None before ``defvjp`` / ``defjvp``)."""
    return getattr(op, "jvp" if isinstance(op, jax.custom_jvp) else "bwd", None)


@dataclasses.dataclass(frozen=True, eq=False)
class _Entry:
    op: Any  # the custom op, or the primitive object (``primitive``)
    reference: Callable | None  # (None: the op keeps its own calls, served by `rule`)
    name: str
    rule: Any = None  # a `CustomOpRule`
    primitive: bool = False  # a rule for a primitive's equations (`register_primitive_rule`)
    where: Callable | None = None  # (a primitive's) which of its equations the rule serves
    on_remove: Callable | None = None  # called once the registration is removed

    @property
    def describe(self) -> str:
        return f"primitive {self.name}" if self.primitive else f"custom op {self.name}"


class Registration:
    """What `register_custom_op` returns: the op and its reference while registered.

    ``remove()`` unregisters the op (traces made afterwards take the exact route again);
    as a context manager, the op is registered inside the ``with`` block only."""

    def __init__(self, entry: _Entry):
        self._entry = entry

    @property
    def op(self):
        return self._entry.op

    @property
    def reference(self) -> Callable | None:
        return self._entry.reference

    @property
    def rule(self):
        return self._entry.rule

    @property
    def active(self) -> bool:
        e = self._entry
        if e.primitive:
            return any(x is e for x in _BY_PRIM.get(e.op, ()))
        return _BY_RULE.get(_rule_fn(e.op)) is e

    def remove(self) -> None:
        e = self._entry
        if not self.active:
            return
        if e.primitive:
            left = [x for x in _BY_PRIM[e.op] if x is not e]
            if left:
                _BY_PRIM[e.op] = left
            else:
                del _BY_PRIM[e.op]
        else:
            del _BY_RULE[_rule_fn(e.op)]
        for key in [k for k in _PRIMAL_TEXT if k[0] is e]:
            del _PRIMAL_TEXT[key]
        if e.on_remove is not None:
            e.on_remove()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.remove()
        return False

    def __repr__(self):
        state = "registered" if self.active else "removed"
        return f"Registration({self._entry.describe}, {state})"


def _op_name(op) -> str:
    fun = getattr(op, "fun", None)
    return getattr(fun, "__name__", None) or repr(op)


def register_custom_op(op, reference: Callable | None = None, *, rule=None) -> Registration:
    """Registers what the ``jax.custom_vjp`` or ``jax.custom_jvp`` op ``op`` computes
    (``reference``), or how its parameter's per-example gradients are formed (``rule``).

    With a ``reference`` (for every trace made afterwards), the statistics treat each
    call of ``op`` as a call of ``reference``: the analysis looks inside it, so a fused
    dense layer gets the dense rules (streamed E[g²], ghost norms, ...), a fused norm
    layer the scale-shift ones. The loss's value, the other inputs' cotangents and the
    statistics are those of the model with ``reference`` in place of ``op``, exactly what
    ``jax.grad`` gives where ``op``'s derivative (its backward pass, or its JVP) is the
    derivative of ``reference``.

    With a ``rule`` (a `CustomOpRule`), the op's calls stay as they are (its forward and
    backward passes give the loss and the other cotangents) and its parameter's
    per-example gradients (squared norms, sums where the rule has them) come
    from the rule, read from the op's operands and output cotangents: for an op with no
    JAX reference (a Pallas kernel behind a ``custom_vjp``). The op's parameter must be
    one of its operands itself (no parameter-only step between, such as ``w.T``: that
    call keeps the exact route).

    `check_rule` checks either on your model; an approximate or straight-through
    derivative, or a rule that is not what the op's derivative gives, fails it. Without a
    registration, an op whose one parameter operand meets the data has its exact
    per-example gradients through ``jax.vmap`` of its own VJP (``materialised`` in
    `jaxpr_surgery.explain`, the cost of ``vmap(grad)``); one of several parameters
    reads them per example (``fallback``).

    Args:
      op: a ``jax.custom_vjp`` function with its rule given (``op.defvjp(fwd, bwd)``),
        or a ``jax.custom_jvp`` function with its JVP given (``op.defjvp(jvp)`` or
        ``op.defjvps``); with ``nondiff_argnums``, a reference only (it takes those
        arguments as the op does, each call's values). The op is recognised by its
        derivative function (the backward function, the JVP) and its forward program:
        two ops sharing one derivative function are told apart.
      reference: a function with the op's signature (``reference(w, x)`` for
        ``op(w, x)``; the same pytrees of arrays) returning its outputs (the same leaves
        in ``jax.tree.leaves`` order), written with ordinary JAX operations. ``None``
        (and no ``rule``): the op's own forward function (``op.fun``): declares that its
        custom derivative is the exact derivative of its forward (a memory-saving or
        numerically stabler backward, a JVP written by hand for speed).
      rule: a `CustomOpRule` instance, instead of a reference.

    Returns:
      A `Registration`: ``.remove()`` unregisters the op; used as a context manager,
      the op is registered inside the ``with`` block only.

    Raises:
      TypeError: ``op`` is not a ``jax.custom_vjp`` or ``jax.custom_jvp`` function,
        ``reference`` is not callable, or ``rule`` is not a `CustomOpRule` overriding
        ``per_example_grad``.
      ValueError: the op has no derivative rule yet, it (or an op sharing its
        derivative function) is already registered, or both a reference and a rule are
        given.
      NotImplementedError: a rule for an op with ``nondiff_argnums``.

    Examples:
      >>> import jax, jax.numpy as jnp, jaxpr_surgery as js
      >>> @jax.custom_vjp
      ... def fused_dense(w, x):
      ...     return x @ w
      >>> fused_dense.defvjp(
      ...     lambda w, x: (x @ w, (w, x)),
      ...     lambda r, dy: (jnp.einsum("...i,...j->ij", r[1], dy), dy @ r[0].T))
      >>> loss = lambda w, x: jnp.mean(jnp.tanh(fused_dense(w, x)) ** 2)
      >>> w, x = jnp.ones((3, 2)) / 4, jnp.arange(12.0).reshape(4, 3) / 12
      >>> js.explain(loss, js.stats.second_moment())(w, x).leaves[0].rule
      'materialised'
      >>> reg = js.extend.register_custom_op(fused_dense, lambda w, x: x @ w)
      >>> js.explain(loss, js.stats.second_moment())(w, x).leaves[0].rule
      'streamed'
      >>> reg.remove()
    """
    where = "register_custom_op"
    jvp = isinstance(op, jax.custom_jvp)
    if not jvp and not isinstance(op, jax.custom_vjp):
        raise TypeError(
            f"{where}: op must be a jax.custom_vjp or jax.custom_jvp function (decorated "
            "with @jax.custom_vjp and given its rule with .defvjp, or @jax.custom_jvp "
            f"and .defjvp), got {type(op).__name__}."
        )
    if _rule_fn(op) is None:
        how = "op.defjvp(jvp) (or op.defjvps(...))" if jvp else "op.defvjp(fwd, bwd)"
        raise ValueError(
            f"{where}: op {_op_name(op)} has no derivative rule yet; call {how} before "
            "registering it."
        )
    if _nondiff(op) and rule is not None:
        raise NotImplementedError(
            f"{where}: op {_op_name(op)} has nondiff_argnums={_nondiff(op)}: a rule reads "
            "the op's operands only, not its non-differentiable arguments. Register a "
            "reference (it takes them, as the op does), or define the op and its rule "
            "inside a function of those arguments."
        )
    if rule is not None:
        if reference is not None:
            raise ValueError(
                f"{where}: {_op_name(op)}: give either a reference or a rule, not both (a "
                "reference makes the op's calls its reference's; a rule keeps them)."
            )
        _check_rule_object(where, rule)
    elif reference is None:
        reference = op.fun
    if rule is None and not callable(reference):
        raise TypeError(
            f"{where}: reference must be a function of the op's operands, got "
            f"{type(reference).__name__}."
        )
    held = _BY_RULE.get(_rule_fn(op))
    if held is not None:
        fn = "JVP" if jvp else "backward function"
        what = "op" if held.op is op else f"op {held.name}, which shares its {fn},"
        raise ValueError(
            f"{where}: {_op_name(op)}: the {what} is already registered; call .remove() on "
            "its registration first (or register it in a `with` block)."
        )
    entry = _Entry(op, reference, _op_name(op), rule)
    _BY_RULE[_rule_fn(op)] = entry
    return Registration(entry)


def _check_rule_object(where, rule):
    if not isinstance(rule, CustomOpRule):
        raise TypeError(
            f"{where}: rule must be a js.extend.CustomOpRule instance, got "
            f"{rule!r}" + (" (a class: instantiate it)" if isinstance(rule, type) else "")
            + "."
        )
    if not rule.has("per_example_grad"):
        raise TypeError(
            f"{where}: {type(rule).__name__} must override per_example_grad (the one "
            "method a CustomOpRule requires)."
        )


def add_primitive_rule(primitive, rule, where, on_remove) -> Registration:
    """Registers ``rule`` for the equations of ``primitive`` that ``where`` accepts (all
    where None); `sites.custom.register_primitive_rule` checks the primitive and anchors
    the kernel. ``on_remove``: called when the registration is removed."""
    _check_rule_object("register_primitive_rule", rule)
    if where is not None and not callable(where):
        raise TypeError(
            "register_primitive_rule: where must be a function of an equation returning "
            f"whether the rule serves it, got {type(where).__name__}."
        )
    held = _BY_PRIM.get(primitive, [])
    if where is None and any(e.where is None for e in held):
        raise ValueError(
            f"register_primitive_rule: primitive {primitive.name} already has a rule for "
            "all its equations; call .remove() on its registration first (or pass where= "
            "to serve some of its equations)."
        )
    entry = _Entry(primitive, None, primitive.name, rule, primitive=True, where=where,
                   on_remove=on_remove)
    _BY_PRIM[primitive] = [*held, entry]
    return Registration(entry)


def has_primitive_rules(primitive) -> bool:
    """Whether any rule is registered for ``primitive``'s equations."""
    return primitive in _BY_PRIM


# id(equation) -> (the equation, its `primitive_entry`) while `asked_once` holds
_ASKED: dict | None = None


@contextlib.contextmanager
def asked_once():
    """Within: each equation's `primitive_entry` is found once (a rule's ``where`` is a
    user's function: the analysis, the kernel's match and the kernel ask about the same
    equation, and ask it once). A call's analysis and plan run within one."""
    global _ASKED
    outer = _ASKED
    _ASKED = {} if outer is None else outer
    try:
        yield
    finally:
        _ASKED = outer


def primitive_entry(eqn):
    """The first `_Entry` registered for ``eqn``'s primitive whose ``where`` accepts
    ``eqn``, or None."""
    held = _BY_PRIM.get(eqn.primitive, ())
    if not held:
        return None
    if _ASKED is not None:
        hit = _ASKED.get(id(eqn))
        if hit is not None and hit[0] is eqn:
            return hit[1]
    found = next((e for e in held if e.where is None or e.where(eqn)), None)
    if _ASKED is not None:
        _ASKED[id(eqn)] = (eqn, found)  # (the equation held: its id stays its own)
    return found


def registered() -> bool:
    """Whether any op or primitive rule is registered."""
    return bool(_BY_RULE) or bool(_BY_PRIM)


def _types(avals) -> tuple:
    return tuple((tuple(a.shape), str(a.dtype)) for a in avals)


def _structs(avals):
    return [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in avals]


def _nondiff(op) -> tuple:
    return tuple(getattr(op, "nondiff_argnums", ()) or ())


@dataclasses.dataclass(frozen=True)
class _Call:
    """How one call of an op passes its arguments: the tree of the differentiable ones
    (the call's operands are its leaves) and the values of the others, at the positions
    ``nondiff`` (the op's ``nondiff_argnums``: static, not operands)."""

    in_tree: Any
    static: tuple = ()
    nondiff: tuple = ()

    def on_leaves(self, fn):
        """``fn`` of the op's arguments as a function of the call's operands, returning
        its outputs' leaves (named as ``fn``, for the jaxpr and explain)."""

        def flat(*leaves):
            dyn = tuple(jax.tree.unflatten(self.in_tree, leaves))
            n, it, static = len(dyn) + len(self.static), iter(dyn), iter(self.static)
            args = [next(static) if i in self.nondiff else next(it) for i in range(n)]
            return jax.tree.leaves(fn(*args))

        flat.__name__ = getattr(fn, "__name__", "reference")
        return flat

    def key(self):
        """A key of the call's arguments for caches, or None (unhashable static ones)."""
        try:
            hash(self.static)
        except TypeError:
            return None
        return self.in_tree, self.static


def entry_of(eqn):
    """``(registration, call)`` serving ``eqn`` (the `_Call` of its arguments), or None
    (not a registered op's call, or one whose arguments this jax does not record)."""
    if not _BY_RULE or eqn.primitive not in compat.custom_prims:
        return None
    fn, in_tree = compat.custom_jvp_rule(eqn)
    if fn is None:
        fn = compat.custom_vjp_bwd(eqn)
    entry = _BY_RULE.get(fn) if fn is not None else None
    if entry is None or compat.custom_call_consts(eqn):
        return None  # (constants hoisted out of its function: not the op's own call)
    if in_tree is None:
        in_tree = compat.custom_vjp_in_tree(eqn)
    nondiff, static = _nondiff(entry.op), compat.custom_static_args(eqn)
    if in_tree is None or static is None or len(static) != len(nondiff):
        return None
    call = _Call(in_tree, static, nondiff)
    avals = [v.aval for v in eqn.invars]
    key = None if call.key() is None else (entry, call.key(), _types(avals))
    text = _PRIMAL_TEXT.get(key) if key is not None else None
    if text is None:
        try:
            primal = jax.make_jaxpr(call.on_leaves(entry.op.fun))(*_structs(avals))
            text = compat.jaxpr_text(primal, vma=False)
        except Exception:  # noqa: BLE001 - not the op's operands: not its call
            text = ""
        if key is not None:
            _PRIMAL_TEXT[key] = text
    if text != compat.jaxpr_text(walker.nested(eqn).jaxpr, vma=False):
        return None  # another op sharing the backward function
    return entry, call


def _reference_eqn(eqn, entry, op_call):
    avals = [v.aval for v in eqn.invars]
    where = f"register_custom_op: the reference of {entry.name}"
    call = compat.call_eqn_of(op_call.on_leaves(entry.reference), avals, where)
    want = [(tuple(v.aval.shape), v.aval.dtype) for v in eqn.outvars]
    got = [(tuple(v.aval.shape), v.aval.dtype) for v in call.outvars]
    if want != got:
        def fmt(ts):
            return ", ".join(f"{d}{list(s)}" for s, d in ts)

        raise ValueError(
            f"{where} returns ({fmt(got)}) where the op returns ({fmt(want)}) on operands "
            f"({fmt([(tuple(a.shape), a.dtype) for a in avals])}). The reference takes the "
            "op's arguments and returns its outputs (the same leaves, in jax.tree.leaves "
            "order)."
        )
    return compat.replace_eqn_vars(call, eqn.invars, eqn.outvars)


def _substitute_jaxpr(jaxpr, only):
    def step(eqn):
        found = entry_of(eqn)
        if (found is not None and found[0].reference is not None
                and (only is None or found[0] is only)):
            return _reference_eqn(eqn, *found)
        return compat.map_subjaxprs(eqn, lambda j: _substitute_jaxpr(j, only))

    return walker.rewrite(jaxpr, step)


def substitute(closed, only=None):
    """``closed`` (a ``ClosedJaxpr``) with every call of a registered op (``only``: of
    that `_Entry`'s op), at any depth, replaced by a call of its reference; ``closed``
    itself where there is none."""
    if not _BY_RULE:
        return closed
    new = _substitute_jaxpr(closed.jaxpr, only)
    return closed if new is closed.jaxpr else compat.ClosedJaxpr(new, closed.consts)


def ops_in(closed) -> list:
    """The registered ops (`_Entry`) called anywhere in ``closed``, in first-use order."""
    found: dict = {}

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            hit = ruled_entry(eqn)
            if hit is not None:
                found.setdefault(id(hit), hit)
            for sub in walker.bodies(eqn):
                walk(sub)

    walk(closed.jaxpr)
    return list(found.values())


# --------------------------------------------------------------------------- #
# Rules for an op without a reference: the per-example gradient from the op's operands
# and output cotangents (the kernel: sites/custom.py)
# --------------------------------------------------------------------------- #
@dataclasses.dataclass(frozen=True)
class OpSite:
    """What a `CustomOpRule` reads at one call of its op, for the batch's ``B`` examples.

    Attributes:
      operands: the op's operands (the leaves of its arguments, in ``jax.tree.leaves``
        order). Those that depend on the example have a leading example axis ``B``, each
        example's operand after it as the op saw it (with ``keep_batch_dim=True``, the
        default, on a batch of one: ``x [B, 1, T, d]`` for an op called on ``x [b, T,
        d]``); the others (the parameter among them) are as the op saw them.
      batched: for each operand, whether it has the example axis.
      param_index: the position of the parameter among ``operands``.
      cotangents: the cotangents of the op's outputs (their leaves), each ``[B, ...]``.

    A pytree (its arrays are the leaves).
    """

    operands: tuple
    batched: tuple
    param_index: int
    cotangents: tuple

    @property
    def param(self):
        """The parameter operand (not batched)."""
        return self.operands[self.param_index]

    @property
    def batch_size(self) -> int:
        return jax.tree.leaves(self.cotangents)[0].shape[0]

    def with_cotangents(self, cotangents) -> OpSite:
        return dataclasses.replace(self, cotangents=tuple(cotangents))


# (a pytree: the arrays are its leaves, which operands are batched and where the
# parameter is are static)
jax.tree_util.register_dataclass(
    OpSite, data_fields=["operands", "cotangents"], meta_fields=["batched", "param_index"])


class CustomOpRule:
    """A layer rule for a ``jax.custom_vjp`` op without a JAX reference (a Pallas kernel,
    a fused call): what the op's parameter's per-example gradients are, from the op's
    operands and output cotangents (`OpSite`).

    Subclass it and override `per_example_grad` (required); override `sq_norms` and
    `summed_grad` where you have a cheaper form (each states its law; what a rule does
    not override is derived from `per_example_grad`, and `explain` says so). Register it
    with ``register_custom_op(op, rule=MyRule())``. Every method is called inside the
    backward pass, traced once per call of the op, and must be **linear in the
    cotangents, example by example** (the package scales them: constant factors of the
    parameter, example weights, clipping coefficients).
    """

    def per_example_grad(self, site: OpSite):
        """``[B, *param.shape]``: example ``b``'s gradient with respect to the parameter
        operand, as the op's backward pass gives it for cotangents ``site.cotangents[b]``
        (law: ``check_rule`` compares it with ``jax.vmap`` of the op's own VJP)."""
        raise NotImplementedError(
            f"{type(self).__name__}: a CustomOpRule must override per_example_grad.")

    def sq_norms(self, site: OpSite):
        """``[B]``: each example's squared gradient norm (law: equal to
        ``jnp.sum(per_example_grad(site) ** 2)`` over every axis but the first). Optional:
        override where it is cheaper than forming the gradients (a ghost norm)."""
        raise NotImplementedError

    def summed_grad(self, site: OpSite):
        """``param.shape``: the examples' gradients summed (law: equal to
        ``per_example_grad(site).sum(0)``), as the op's own backward pass computes the
        parameter's gradient. Optional: override where it is cheaper (a contraction).
        It serves every sum of the gradients (the mean; weighted and clipped sums read it
        with the cotangents scaled example by example)."""
        raise NotImplementedError

    def has(self, name: str) -> bool:
        """Whether the rule overrides the optional method ``name``."""
        return getattr(type(self), name) is not getattr(CustomOpRule, name)


def ruled_entry(eqn):
    """The `_Entry` serving ``eqn``: a registered custom op's (with a reference or a
    rule), or a rule registered for its primitive; None without one."""
    hit = entry_of(eqn)
    if hit is not None:
        return hit[0]
    return primitive_entry(eqn) if _BY_PRIM else None


def rule_of(eqn):
    """The `CustomOpRule` registered for the op ``eqn`` calls, or for its primitive, or
    None."""
    hit = ruled_entry(eqn)
    return None if hit is None else hit.rule
