"""The one jaxpr walker: how each structured primitive nests a jaxpr, and the walk that
the analysis, the batched interpreter and the independence proof each extend.

The three passes read the same jaxpr for different ends: the analysis tags each variable
with how it depends on the parameters and the data (`analysis`), the interpreter
evaluates it for the batch with the sites rewired (`interpreter`), the independence
proof tags each variable with how it depends on the examples (`independence`). What a
variable holds and how an ordinary equation is read differ; how a structured equation
nests a jaxpr does not, and is said here once:

* `Nest`, the kinds of nesting, and `NESTS`, the table from primitive objects to them
  (``jit``/``pjit``, ``closed_call`` and ``call``; ``checkpoint``; ``custom_vjp`` and
  ``custom_jvp`` calls; ``scan``; ``while``; ``cond``; ``shard_map``, which only the
  independence proof enters);
* `nested`: the typed view of an equation's nested jaxpr (`Once`, `Loop`, `While`,
  `Branches`, `Mapped`), read from its params at both ends of jax's range (here alone);
* `Walker`: an environment per jaxpr run, the equations in order, each at its *path*
  (the positions of the equations that enclose it, then its own: the key the analysis
  gives sites and the interpreter finds them by), each structured equation handed to
  the walker's hook for its kind (`Walker.ENTER`, keyed by `Nest`), every other one,
  and a kind the walker has no hook for, to its `Walker.equation`;
* `bodies` and `equations`: the open jaxprs of any equation (also those no pass enters:
  a custom rule's) and every equation at any depth, for read-only
  scans (dtypes, collectives, FLOPs); `rewrite`: a jaxpr with its equations replaced
  one by one, at any depth (a registered op by its reference, a constraint released).
"""

from __future__ import annotations

import abc
import dataclasses
import enum
from collections.abc import Callable, Iterator
from typing import Any, ClassVar, NamedTuple

from jaxpr_surgery._src import compat


class Nest(enum.Enum):
    """How a structured equation runs the jaxpr it holds."""

    CALL = "a call (jit, closed_call, call): its body once, on its operands"
    REMAT = "jax.checkpoint: its body once, recomputed for the backward pass"
    CUSTOM = "a custom_vjp / custom_jvp call: its primal body once, on its operands"
    SCAN = "lax.scan: its body once per step, over consts, carry and xs"
    WHILE = "lax.while_loop: its body while its condition holds, on consts and carry"
    COND = "lax.cond / lax.switch: one of its branches, on the operands after the index"
    SHARD_MAP = "shard_map: its body on every device, each operand's block by its in_spec"


def _table(entries) -> dict:
    out = {}
    for prims, nest in entries:
        for p in prims:
            if p is not None:  # a primitive this jax does not have
                out[p] = nest
    return out


#: primitive object -> `Nest`
NESTS: dict = _table([
    ((compat.jit_p, compat.closed_call_p, compat.call_p), Nest.CALL),
    ((compat.remat_p,), Nest.REMAT),
    (tuple(compat.custom_prims), Nest.CUSTOM),
    ((compat.scan_p,), Nest.SCAN),
    ((compat.while_p,), Nest.WHILE),
    ((compat.cond_p,), Nest.COND),
    ((compat.shard_map_p,), Nest.SHARD_MAP),
])


# --------------------------------------------------------------------------- #
# Typed views of the nested jaxprs. jax <= 0.11 stores sub-jaxprs as ``ClosedJaxpr``
# and scan's operand split as ``num_consts``/``num_carry``; jax 0.12 stores open
# ``Jaxpr`` (constants hoisted into operands) and the split as flat trees ``ft_in``
# (consts, carry, xs). Each reader detects the layout by feature, never by version
# number, and raises `compat.UnsupportedJaxError` naming the primitive where neither
# is found.
# --------------------------------------------------------------------------- #
@dataclasses.dataclass(frozen=True)
class Once:
    """The body of an equation that runs it once (`Nest.CALL`, `Nest.REMAT`,
    `Nest.CUSTOM`): the equation's operand k binds ``jaxpr.invars[k]``, its output k is
    ``jaxpr.outvars[k]``. ``consts`` bind ``jaxpr.constvars``; ``prevent_cse`` and
    ``policy`` are a checkpoint's (defaults elsewhere)."""

    nest: Nest
    jaxpr: Any
    consts: tuple = ()
    prevent_cse: bool = True
    policy: Any = None


@dataclasses.dataclass(frozen=True)
class Loop:
    """A ``scan``: operands ``consts + carry + xs``, outputs ``carry + ys``; ``jaxpr``
    is the open body, ``consts`` its bound constants."""

    jaxpr: Any
    consts: tuple
    num_consts: int
    num_carry: int
    length: int
    reverse: bool
    unroll: Any


@dataclasses.dataclass(frozen=True)
class While:
    """A ``while``: operands ``cond_consts + body_consts + carry``."""

    cond: Any  # open Jaxpr
    cond_consts: tuple
    cond_nconsts: int
    body: Any
    body_consts: tuple
    body_nconsts: int


@dataclasses.dataclass(frozen=True)
class Branches:
    """A ``cond``'s branches (open jaxprs); the operands are the index, then each
    branch's inputs."""

    jaxprs: tuple


@dataclasses.dataclass(frozen=True)
class Mapped:
    """A ``shard_map``'s open body, run on each device's blocks: operand k's block by
    ``in_specs[k]`` (a ``PartitionSpec``: the mesh axes each dimension is split over),
    output k assembled by ``out_specs[k]``; ``check_vma``: the body is typed with the
    manual axes each value varies over."""

    jaxpr: Any
    in_specs: tuple
    out_specs: tuple
    check_vma: bool


class Binding(NamedTuple):
    """What the views read of an equation: its primitive, params and arity (`binding`).
    A primitive bound while a trace intercepts it has no equation yet: its view is
    `view_of` its binding."""

    primitive: Any
    params: dict
    n_in: int
    n_out: int


def binding(eqn) -> Binding:
    return Binding(eqn.primitive, eqn.params, len(eqn.invars), len(eqn.outvars))


def _param(eqn, *keys):
    """The first of the params ``keys`` that ``eqn`` (a `Binding`) has (a jaxpr), split
    by `compat.closed_parts`."""
    for key in keys:
        j = eqn.params.get(key)
        if j is not None:
            return compat.closed_parts(j)
    raise compat.unsupported(eqn, "no " + " or ".join(repr(k) for k in keys))


def _once_call(eqn):
    return Once(Nest.CALL, *_param(eqn, "jaxpr", "call_jaxpr"))


def _once_remat(eqn):
    jaxpr, consts = _param(eqn, "jaxpr")
    if consts:  # pragma: no cover - remat jaxprs are open in every tested jax
        raise compat.unsupported(eqn, "a closed remat jaxpr")
    return Once(Nest.REMAT, jaxpr, (), eqn.params.get("prevent_cse", True),
                eqn.params.get("policy"))


def _once_custom(eqn):  # (the primal function of a custom_jvp / custom_vjp call)
    return Once(Nest.CUSTOM, *_param(eqn, "call_jaxpr", "fun_jaxpr"))


def _loop(eqn) -> Loop:
    prm = eqn.params
    if "num_consts" in prm and "num_carry" in prm:  # jax <= 0.11
        nc, ncar = int(prm["num_consts"]), int(prm["num_carry"])
    elif "ft_in" in prm:  # jax 0.12: flat trees (consts, carry, xs)
        try:
            c, k, x = prm["ft_in"].unpack()
            nc, ncar = len(c), len(k)
        except Exception as e:  # noqa: BLE001
            raise compat.unsupported(
                eqn, f"ft_in does not unpack to (consts, carry, xs): {e}") from e
        if nc + ncar + len(x) != eqn.n_in:
            raise compat.unsupported(eqn, "ft_in does not cover the operands")
    else:
        raise compat.unsupported(eqn, "neither num_consts/num_carry nor ft_in")
    jaxpr, consts = _param(eqn, "jaxpr")
    if len(jaxpr.invars) != eqn.n_in or len(jaxpr.outvars) != eqn.n_out:
        raise compat.unsupported(eqn, "the body's arity differs from the eqn's")
    return Loop(jaxpr, consts, nc, ncar, int(prm["length"]), bool(prm["reverse"]),
                prm.get("unroll", 1))


def _while(eqn) -> While:
    prm = eqn.params
    if not {"cond_jaxpr", "body_jaxpr", "cond_nconsts", "body_nconsts"} <= set(prm):
        raise compat.unsupported(eqn, "no cond_jaxpr/body_jaxpr/cond_nconsts/body_nconsts")
    cj, cc = compat.closed_parts(prm["cond_jaxpr"])
    bj, bc = compat.closed_parts(prm["body_jaxpr"])
    return While(cj, cc, int(prm["cond_nconsts"]), bj, bc, int(prm["body_nconsts"]))


def _branches(eqn) -> Branches:
    if "branches" not in eqn.params:
        raise compat.unsupported(eqn, "no 'branches'")
    return Branches(tuple(compat.closed_parts(b)[0] for b in eqn.params["branches"]))


def _mapped(eqn) -> Mapped:
    prm = eqn.params
    if not {"jaxpr", "in_specs", "out_specs"} <= set(prm):
        raise compat.unsupported(eqn, "no jaxpr/in_specs/out_specs")
    jaxpr, consts = compat.closed_parts(prm["jaxpr"])
    if consts or len(prm["in_specs"]) != eqn.n_in or len(prm["out_specs"]) != eqn.n_out:
        raise compat.unsupported(eqn, "specs that do not match the operands")
    return Mapped(jaxpr, tuple(prm["in_specs"]), tuple(prm["out_specs"]),
                  bool(prm.get("check_vma", prm.get("check_rep", False))))


_VIEWS: dict = {
    Nest.CALL: _once_call,
    Nest.REMAT: _once_remat,
    Nest.CUSTOM: _once_custom,
    Nest.SCAN: _loop,
    Nest.WHILE: _while,
    Nest.COND: _branches,
    Nest.SHARD_MAP: _mapped,
}


def nest_of(eqn) -> Nest | None:
    """The `Nest` of ``eqn``, or None (an ordinary equation, or one whose jaxprs no pass
    enters)."""
    return NESTS.get(eqn.primitive)


def nested(eqn):
    """The typed view of ``eqn``'s nested jaxpr by its `Nest` (`Once`, `Loop`, `While`,
    `Branches`, `Mapped`); ``eqn`` must have one."""
    return view_of(binding(eqn))


def view_of(b: Binding):
    """The typed view of the nested jaxpr of a primitive bound as ``b`` (`nested`)."""
    return _VIEWS[NESTS[b.primitive]](b)


def body(eqn):
    """The open body of an equation that runs one once (`Once`), else None."""
    nest = NESTS.get(eqn.primitive)
    if nest in (Nest.CALL, Nest.REMAT, Nest.CUSTOM):
        return _VIEWS[nest](binding(eqn)).jaxpr
    return None


def bodies(eqn) -> list:
    """The open jaxprs in ``eqn``'s params, of any primitive (also those no pass enters:
    a custom derivative's rules)."""
    return [compat.closed_parts(j)[0] for j in compat.subjaxprs(eqn)]


def equations(jaxpr, enter: Callable[[Any], bool] | None = None) -> Iterator:
    """Every equation of the open ``jaxpr`` and, depth first, of the jaxprs inside them
    (`bodies`); ``enter(eqn)`` False keeps out of ``eqn``'s."""
    for eqn in jaxpr.eqns:
        yield eqn
        if enter is None or enter(eqn):
            for sub in bodies(eqn):
                yield from equations(sub, enter)


def rewrite(jaxpr, step: Callable[[Any], Any]):
    """The open ``jaxpr`` with each equation, in order, replaced by ``step(eqn)`` (``eqn``
    itself: kept), or ``jaxpr`` itself where none changed. ``step`` rewrites the jaxprs
    inside an equation it enters by `rewrite` again (``compat.map_subjaxprs``), each with
    the step its depth asks for."""
    eqns = [step(eqn) for eqn in jaxpr.eqns]
    if all(new is old for new, old in zip(eqns, jaxpr.eqns)):
        return jaxpr
    return compat.replace_eqns(jaxpr, eqns)


def path_to(jaxpr, target) -> list | None:
    """The equations from ``jaxpr``'s down to ``target`` (found by identity), or None."""
    for eqn in jaxpr.eqns:
        if eqn is target:
            return [eqn]
        for sub in bodies(eqn):
            inner = path_to(sub, target)
            if inner is not None:
                return [eqn, *inner]
    return None


class Walker(abc.ABC):
    """A walk of a jaxpr, one value per variable.

    `run` binds a jaxpr's inputs and walks its equations (`walk`); `step` gives each its
    outputs' values: a structured equation goes to the hook `ENTER` holds for its
    `Nest` (called ``hook(walker, eqn, view, ins, path, *ctx)``, ``view`` from
    `nested`), which runs the nested jaxpr by `run` as its kind requires; any other
    equation, and a kind without a hook, goes to `equation`. ``ctx`` is what a walker
    threads through a run besides the values (the analysis: the enclosing scans'
    lengths; the interpreter: the run's environment and sinks), passed through as given.
    A pass overrides `step` to look at every equation first, `read` for what a literal
    holds, `walk` to evaluate several equations at once (the interpreter's runs of
    ordinary equations). `run` keeps its signature in every walker (a pass may add
    keyword arguments); one whose entry takes other arguments names it otherwise
    (`interpreter.Evaluator.evaluate`, the proof's `_Interp.tags_of`)."""

    #: `Nest` -> hook; a kind absent is an ordinary equation to this walker
    ENTER: ClassVar[dict] = {}

    def read(self, env, v):
        """What ``v`` holds in ``env`` (a literal: None)."""
        return None if isinstance(v, compat.Literal) else env.get(v)

    def run(self, jaxpr, ins, path=(), *ctx, consts=None):
        """The values of ``jaxpr``'s outputs from its inputs' ``ins`` (and its
        constants' ``consts``, where given)."""
        env = dict(zip(jaxpr.invars, ins))
        if consts is not None:
            env.update(zip(jaxpr.constvars, consts))
        self.walk(jaxpr, env, path, 0, len(jaxpr.eqns), *ctx)
        return [self.read(env, v) for v in jaxpr.outvars]

    def walk(self, jaxpr, env, path, start, stop, *ctx):
        """``jaxpr.eqns[start:stop]`` into ``env``."""
        read = self.read
        for i in range(start, stop):
            eqn = jaxpr.eqns[i]
            outs = self.step(eqn, [read(env, v) for v in eqn.invars], path + (i,), *ctx)
            env.update(zip(eqn.outvars, outs))

    def enters(self, eqn) -> bool:
        """Whether this walker has a hook for ``eqn``'s kind of nesting."""
        nest = NESTS.get(eqn.primitive)
        return nest is not None and nest in self.ENTER

    def step(self, eqn, ins, path, *ctx):
        """The values of ``eqn``'s outputs from its inputs' ``ins``."""
        nest = NESTS.get(eqn.primitive)
        hook = self.ENTER.get(nest) if nest is not None else None
        if hook is None:
            return self.equation(eqn, ins, path, *ctx)
        return hook(self, eqn, _VIEWS[nest](binding(eqn)), ins, path, *ctx)

    @abc.abstractmethod
    def equation(self, eqn, ins, path, *ctx):
        """The values of an ordinary equation's outputs (or one whose kind of nesting
        this walker does not enter)."""
