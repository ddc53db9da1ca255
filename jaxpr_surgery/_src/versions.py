"""The range of jax the package is tested with (kept in sync with pyproject.toml and CI),
and the warning on import outside it.
"""

from __future__ import annotations

import warnings

import jax

TESTED_JAX = ("0.10.0", "0.12.0.1")  # oldest and newest jax the test suite runs on in CI


def _version_tuple(v: str) -> tuple:
    out = []
    for part in v.split("."):
        digits = "".join(ch for ch in part if ch.isdigit())
        if not digits:
            break
        out.append(int(digits))
        if digits != part:  # e.g. "0rc1", "dev2026": a pre-release of this number
            break
    return tuple(out)


# XLA:CPU of jax 0.12 fuses a product over the examples and its sum into one reduction
# (no temporary), and compiles a contraction of length B against one vector as an
# elemental loop nest of its own (about 5 ms each); XLA:CPU of jax 0.10 materialises the
# product (perf_check's MLP clipped mean: 1.39x -> 2.00x grad's temporary memory) and
# runs the contraction as a library call (`reductions.weighted_examples`).
FUSES_PRODUCT_SUMS = _version_tuple(jax.__version__)[:2] >= (0, 12)


def jax_version_status(version: str | None = None) -> str | None:
    """None if ``version`` (default: the installed jax) is in the tested range, else a message.

    A newer release of a tested minor series (0.12.x) counts as tested: jax keeps
    primitive params stable within a minor series.
    """
    v = _version_tuple(version or jax.__version__)
    lo, hi = (_version_tuple(t) for t in TESTED_JAX)
    if v[:2] > hi[:2] or v < lo:
        return (
            f"jaxpr_surgery was tested with jax {TESTED_JAX[0]} to {TESTED_JAX[1]} (any "
            f"{hi[0]}.{hi[1]}.x), but jax {version or jax.__version__} is installed. The "
            "transformation reads JAX-internal primitive params; on an untested jax it raises "
            "an error where it finds a layout it does not know, but run "
            "js.check_per_example and compare a statistic with jax.vmap(jax.grad(...)) once "
            "before relying on it, or install a tested jax (pip install 'jax<0.13')."
        )
    return None


def warn_if_untested():
    msg = jax_version_status()
    if msg is not None:
        warnings.warn(msg, UntestedJaxWarning, stacklevel=3)


class UntestedJaxWarning(UserWarning):
    """The installed jax is outside the range jaxpr_surgery is tested with."""
