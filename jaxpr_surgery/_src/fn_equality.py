"""Equality of the functions and values a reduction is built from (its trace key and
``__eq__``): two closures are the same function when their code, defaults and cells are.
"""

from __future__ import annotations

import functools

import numpy as np


# --------------------------------------------------------------------------- #
# Functions compared for `PhiSum.clash`
# --------------------------------------------------------------------------- #
def function_name(f) -> str:
    """A short readable name of a function for messages (``cos``, ``<lambda>``)."""
    name = getattr(f, "__qualname__", None) or getattr(f, "__name__", None)
    return name if isinstance(name, str) else repr(f)


def same_function(f, g, _seen=None) -> bool:
    """``f`` and ``g`` are the same function: one object, equal objects, or one code
    with the same environment (a lambda built afresh by each ``reductions()`` call),
    also through ``functools.partial`` and wrappers (``__wrapped__``). When in doubt:
    not the same."""
    if f is g or equal_as_bool(f, g):
        return True
    seen = set() if _seen is None else _seen
    if (id(f), id(g)) in seen:  # a closure that refers to itself
        return True
    seen.add((id(f), id(g)))
    if isinstance(f, functools.partial) and isinstance(g, functools.partial):
        return (
            same_function(f.func, g.func, seen)
            and len(f.args) == len(g.args)
            and all(_same_value(a, b, seen) for a, b in zip(f.args, g.args))
            and f.keywords.keys() == g.keywords.keys()
            and all(_same_value(f.keywords[k], g.keywords[k], seen) for k in f.keywords)
        )
    wf, wg = getattr(f, "__wrapped__", None), getattr(g, "__wrapped__", None)
    if wf is not None and wg is not None and type(f) is type(g):
        return same_function(wf, wg, seen)
    code_f, code_g = getattr(f, "__code__", None), getattr(g, "__code__", None)
    if code_f is None or code_f != code_g:
        return False
    if getattr(f, "__globals__", None) is not getattr(g, "__globals__", None):
        return False
    env_f = (f.__defaults__ or (), tuple((f.__kwdefaults__ or {}).items()),
             tuple(c.cell_contents if _filled(c) else _EMPTY for c in f.__closure__ or ()))
    env_g = (g.__defaults__ or (), tuple((g.__kwdefaults__ or {}).items()),
             tuple(c.cell_contents if _filled(c) else _EMPTY for c in g.__closure__ or ()))
    return all(
        len(a) == len(b) and all(_same_value(x, y, seen) for x, y in zip(a, b))
        for a, b in zip(env_f, env_g)
    )


_EMPTY = object()  # the contents of a closure cell not yet assigned


def _filled(cell) -> bool:
    try:
        cell.cell_contents  # noqa: B018 - raises ValueError when empty
    except ValueError:
        return False
    return True


def equal_as_bool(a, b) -> bool:
    """``a == b`` as a bool, False where that is not a bool (arrays) or raises."""
    try:
        eq = a == b
        return bool(eq) if isinstance(eq, (bool, np.bool_)) else False
    except Exception:  # noqa: BLE001 - an object whose == raises is not equal
        return False


def _same_value(a, b, seen) -> bool:
    if isinstance(a, tuple) and isinstance(b, tuple):  # a keyword default: (name, value)
        return len(a) == len(b) and all(_same_value(x, y, seen) for x, y in zip(a, b))
    return (a is b or equal_as_bool(a, b)
            or (callable(a) and callable(b) and same_function(a, b, seen)))
