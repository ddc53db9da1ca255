r"""Privacy accounting of DP-SGD through Google's ``dp_accounting`` library.

One training step of DP-SGD with Poisson sampling (each example in the batch
independently with probability \(q\)), per-example clipping to \(C\) and Gaussian
noise of standard deviation \(zC\) is the event
``PoissonSampledDpEvent(q, GaussianDpEvent(z))``; ``steps`` of them are its
``SelfComposedDpEvent``. `epsilon` composes it in ``dp_accounting``'s PLD (privacy loss
distributions, tight) or RDP (Rényi DP, a looser upper bound, faster) accountant, under
the add-or-remove-one neighbouring relation, and `calibrate_noise_multiplier` inverts it.
With truncated Poisson batches (`poisson_batches(..., truncate=True)`) the event is
``TruncatedSubsampledGaussianDpEvent`` (PLD only).

``dp_accounting`` is an optional dependency: ``pip install 'jaxpr_surgery[dp]'``.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import math
import numbers
from collections.abc import Mapping

import numpy as np

__all__ = ["epsilon", "calibrate_noise_multiplier", "epsilon_of"]

ACCOUNTANTS = ("pld", "rdp")

#: The largest noise multiplier `calibrate_noise_multiplier` tries before it declares
#: a target out of reach.
MAX_NOISE_MULTIPLIER = 1e4

#: Above this noise multiplier ``dp_accounting``'s arithmetic overflows (from about
#: 1e154, the square root of the largest float; earlier for truncated batches), so
#: `epsilon` does not call it: \(\varepsilon = 0\) is certified in closed form instead.
_MAX_ACCOUNTED_NOISE = 1e100


def dp_accounting_module(owner: str):
    """``import dp_accounting``, or an ImportError naming the extra that installs it."""
    try:
        import dp_accounting
    except ImportError as e:
        raise ImportError(
            f"jaxpr_surgery.privacy.{owner} needs Google's privacy accounting library "
            "dp-accounting, an optional dependency of jaxpr_surgery. Install it with the "
            "extra `dp`: pip install 'jaxpr_surgery[dp]' (or pip install dp-accounting)."
        ) from e
    return dp_accounting


def _is_real(x) -> bool:
    """A real Python or NumPy number, or a 0-d real array (not a bool)."""
    if isinstance(x, (bool, np.bool_)):
        return False
    if isinstance(x, numbers.Real):
        return True
    dtype = getattr(x, "dtype", None)
    return dtype is not None and np.ndim(x) == 0 and (
        np.issubdtype(dtype, np.integer) or np.issubdtype(dtype, np.floating))


def _real(x, what: str, owner: str) -> float:
    if not _is_real(x):
        raise TypeError(f"{owner}({what}=...): expected a number, got {x!r}.")
    x = float(x)
    if math.isnan(x):
        raise ValueError(f"{owner}({what}=...): got NaN.")
    return x


def _int(x, what: str, owner: str, minimum: int) -> int:
    if isinstance(x, bool) or not hasattr(x, "__index__"):
        raise TypeError(f"{owner}({what}=...): expected an int, got {x!r}.")
    x = int(x)
    if x < minimum:
        raise ValueError(f"{owner}({what}=...): must be >= {minimum}, got {x}.")
    return x


def _check_common(owner, sampling_probability, steps, delta, accountant, truncated_batch_size,
                  num_examples):
    q = _real(sampling_probability, "sampling_probability", owner)
    if not 0 <= q <= 1:
        raise ValueError(
            f"{owner}(sampling_probability=...): must be in [0, 1] (the probability that "
            f"an example is in a batch: expected batch size / dataset size), got {q!r}."
        )
    steps = _int(steps, "steps", owner, 0)
    d = _real(delta, "delta", owner)
    if not 0 < d < 1:
        raise ValueError(
            f"{owner}(delta=...): must be in (0, 1) (typically below 1 / dataset size), "
            f"got {d!r}."
        )
    if accountant not in ACCOUNTANTS:
        raise ValueError(
            f"{owner}(accountant=...): must be 'pld' (privacy loss distributions, tight) or "
            f"'rdp' (Rényi DP, looser and faster), got {accountant!r}."
        )
    if (truncated_batch_size is None) != (num_examples is None):
        raise ValueError(
            f"{owner}: truncated Poisson sampling needs both truncated_batch_size= and "
            "num_examples= (the dataset size), or neither."
        )
    if truncated_batch_size is not None:
        truncated_batch_size = _int(truncated_batch_size, "truncated_batch_size", owner, 1)
        num_examples = _int(num_examples, "num_examples", owner, 1)
        if accountant != "pld":
            raise ValueError(
                f"{owner}: truncated Poisson sampling (truncated_batch_size=...) is accounted "
                "by dp_accounting's PLD accountant only; pass accountant='pld'."
            )
    return q, steps, d, truncated_batch_size, num_examples


@contextlib.contextmanager
def _quiet_exploration():
    """Silences ``dp_accounting``'s RDP warnings (an order whose series did not converge is
    left out, at the small noise multipliers a search tries on its way) during a search."""
    logger = logging.getLogger("absl")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def _total_variation_bound(z, q, steps, truncated):
    r"""An upper bound on the total variation distance between the outputs of ``steps``
    steps on two neighbouring datasets: \(\varepsilon = 0\) holds at every
    \(\delta\) above it.

    One step moves the clipped sum by at most \(sC\) (\(s = 1\); \(s = 2\) with
    truncation, where adding an example can push another out), and only when the example
    is sampled (probability \(q\)); the noise has standard deviation \(zC\). So one
    step's distance is at most \(q \operatorname{erf}(s / (2\sqrt{2} z)) \le
    q s / (z \sqrt{2\pi})\), and distances add up under (adaptive) composition.
    """
    s = 2.0 if truncated else 1.0
    return steps * q * s / (z * math.sqrt(2 * math.pi))


def _epsilon(dpa, z, q, steps, delta, accountant, truncated_batch_size, num_examples,
             owner="epsilon", what="noise_multiplier"):
    if steps == 0 or q == 0 or z == math.inf:
        return 0.0  # (infinite noise: the output does not depend on the data)
    if z == 0:
        return math.inf
    if z > _MAX_ACCOUNTED_NOISE:
        # beyond dp_accounting's range: the closed form certifies (0, delta)-DP
        if _total_variation_bound(z, q, steps, truncated_batch_size is not None) <= delta:
            return 0.0
        raise ValueError(
            f"{owner}({what}={z!r}): a noise multiplier above {_MAX_ACCOUNTED_NOISE:g} is "
            "beyond dp_accounting's arithmetic (it overflows), and at this delta the "
            "closed-form bound does not reach epsilon = 0. Pass a noise multiplier up to "
            f"{_MAX_ACCOUNTED_NOISE:g} (or math.inf: epsilon 0), or a larger delta."
        )
    if truncated_batch_size is None:
        event = dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(z))
    else:
        if not hasattr(dpa, "TruncatedSubsampledGaussianDpEvent"):
            raise ImportError(
                "truncated Poisson sampling (truncated_batch_size=...) needs a dp-accounting "
                "with TruncatedSubsampledGaussianDpEvent (0.6 or newer): pip install -U "
                "dp-accounting.")
        event = dpa.TruncatedSubsampledGaussianDpEvent(
            dataset_size=num_examples, sampling_probability=q,
            truncated_batch_size=truncated_batch_size, noise_multiplier=z)
    acc = dpa.pld.PLDAccountant() if accountant == "pld" else dpa.rdp.RdpAccountant()
    acc.compose(dpa.SelfComposedDpEvent(event, steps))
    return float(acc.get_epsilon(target_delta=delta))


def epsilon(
    *,
    noise_multiplier: float,
    sampling_probability: float,
    steps: int,
    delta: float,
    accountant: str = "pld",
    truncated_batch_size: int | None = None,
    num_examples: int | None = None,
) -> float:
    r"""The \(\varepsilon\) of ``steps`` steps of DP-SGD with Poisson sampling, at ``delta``.

    Each step samples every example independently with probability
    \(q\) = ``sampling_probability``, clips, and adds Gaussian noise of standard deviation
    \(z\) times the clipped sum's sensitivity (\(z\) = ``noise_multiplier``, as in
    `jaxpr_surgery.optim.dp_sgd`). The value is ``dp_accounting``'s: the accountant
    composes ``SelfComposedDpEvent(PoissonSampledDpEvent(q, GaussianDpEvent(z)), steps)``
    and returns ``get_epsilon(delta)``, under add-or-remove-one adjacency.

    Args:
      noise_multiplier: \(z \ge 0\) (0: no noise, \(\varepsilon = \infty\);
        ``math.inf``: the noise drowns the data, \(\varepsilon = 0\)). Above
        \(10^{100}\), beyond ``dp_accounting``'s arithmetic, \(\varepsilon = 0\) comes
        from a closed-form bound on the total variation distance (a ``ValueError`` where
        ``delta`` is too small for it).
      sampling_probability: \(q \in [0, 1]\): expected batch size / dataset size.
      steps: the number of steps (0: \(\varepsilon = 0\)).
      delta: \(\delta \in (0, 1)\).
      accountant: ``"pld"`` (``dp_accounting.pld.PLDAccountant``, tight; about a second
        for thousands of steps, longer for \(z < 0.5\)) or ``"rdp"``
        (``dp_accounting.rdp.RdpAccountant``: an upper bound, milliseconds).
      truncated_batch_size: for batches truncated to this many examples
        (`poisson_batches` with ``truncate=True``): the event is then
        ``TruncatedSubsampledGaussianDpEvent`` (PLD only). Needs ``num_examples``.
      num_examples: the dataset size, with ``truncated_batch_size``.

    Returns:
      \(\varepsilon\), a float (``inf`` without noise, 0 with infinite noise).

    Raises:
      ImportError: ``dp_accounting`` is not installed (``pip install
        'jaxpr_surgery[dp]'``).

    Examples:
      >>> import jaxpr_surgery as js
      >>> eps = js.privacy.epsilon(noise_multiplier=1.1, sampling_probability=256 / 60_000,
      ...                          steps=1_000, delta=1e-5)
      >>> round(eps, 2)
      0.6
    """
    return _checked_epsilon("epsilon", "noise_multiplier", noise_multiplier,
                            sampling_probability, steps, delta, accountant,
                            truncated_batch_size, num_examples)


def _checked_epsilon(owner, what, noise_multiplier, sampling_probability, steps, delta,
                     accountant, truncated_batch_size, num_examples):
    """`epsilon` with its errors naming ``owner`` and the noise multiplier as ``what``."""
    q, steps, delta, tbs, n = _check_common(owner, sampling_probability, steps, delta,
                                            accountant, truncated_batch_size, num_examples)
    z = _real(noise_multiplier, what, owner)
    if not z >= 0:
        raise ValueError(
            f"{owner}({what}=...): must be >= 0 (0: no noise; math.inf: epsilon 0), got "
            f"{z!r}."
        )
    dpa = dp_accounting_module(owner)
    return _epsilon(dpa, z, q, steps, delta, accountant, tbs, n, owner, what)


def calibrate_noise_multiplier(
    *,
    target_epsilon: float,
    delta: float,
    sampling_probability: float,
    steps: int,
    accountant: str = "pld",
    rtol: float = 0.01,
    truncated_batch_size: int | None = None,
    num_examples: int | None = None,
) -> float:
    r"""The smallest noise multiplier whose `epsilon` is at most ``target_epsilon``,
    to a relative tolerance ``rtol``.

    Returns \(z\) with ``epsilon(noise_multiplier=z, ...) <= target_epsilon`` and
    ``epsilon(noise_multiplier=z / (1 + rtol), ...) > target_epsilon``: the target is met,
    and no noise multiplier 1% (by default) smaller meets it. Found by bisection on
    `epsilon` (\(\varepsilon\) decreases with \(z\)); with ``accountant="pld"`` the bracket
    comes from the RDP accountant first (an upper bound: its \(z\) meets the target), so the
    slow PLD accountant is evaluated about eight times.

    Args:
      target_epsilon: \(\varepsilon > 0\) to reach.
      delta: \(\delta \in (0, 1)\).
      sampling_probability: \(q \in [0, 1]\): expected batch size / dataset size.
      steps: the number of steps.
      accountant: ``"pld"`` or ``"rdp"``, as in `epsilon`.
      rtol: the relative tolerance on \(z\) (default 1%).
      truncated_batch_size: as in `epsilon`.
      num_examples: as in `epsilon`.

    Returns:
      \(z\), a float; 0.0 when no step uses data (``steps=0`` or \(q = 0\)).

    Raises:
      ValueError: a target that no noise multiplier up to ``MAX_NOISE_MULTIPLIER``
        (\(10^4\)) reaches, or a target that is not a positive finite number.
      ImportError: ``dp_accounting`` is not installed.

    Examples:
      >>> import jaxpr_surgery as js
      >>> z = js.privacy.calibrate_noise_multiplier(
      ...     target_epsilon=3.0, delta=1e-5, sampling_probability=0.01, steps=500,
      ...     accountant="rdp")
      >>> eps = js.privacy.epsilon(noise_multiplier=z, sampling_probability=0.01,
      ...                          steps=500, delta=1e-5, accountant="rdp")
      >>> eps <= 3.0
      True
    """
    owner = "calibrate_noise_multiplier"
    q, steps, delta, tbs, n = _check_common(owner, sampling_probability, steps, delta,
                                            accountant, truncated_batch_size, num_examples)
    target = _real(target_epsilon, "target_epsilon", owner)
    if target == math.inf:
        raise ValueError(
            f"{owner}(target_epsilon=inf): every noise multiplier meets it, 0 (no noise, no "
            "privacy) included; pass the finite epsilon you mean to spend."
        )
    if not target > 0:
        raise ValueError(
            f"{owner}(target_epsilon=...): must be a positive finite number, got {target!r} "
            "(epsilon is never negative, and 0 is not a calibration target): pass the "
            "epsilon you mean to spend."
        )
    rtol = _real(rtol, "rtol", owner)
    if not 0 < rtol < 1:
        raise ValueError(f"{owner}(rtol=...): must be in (0, 1), got {rtol!r}.")
    dpa = dp_accounting_module(owner)
    if steps == 0 or q == 0:
        return 0.0

    def eps(z, acc=accountant):
        return _epsilon(dpa, z, q, steps, delta, acc, tbs, n)

    with _quiet_exploration():
        if accountant == "pld" and tbs is None:
            # the looser RDP bound's answer meets the target under PLD too: a close bracket
            guess = _bisect(lambda z: eps(z, "rdp"), 1.0, rtol / 4, owner, target)
            return _bisect(eps, guess, rtol, owner, target, step=1.2)
        return _bisect(eps, 1.0, rtol, owner, target)


def _bisect(eps, guess, rtol, owner, target, step=1.5):
    """The smallest ``z`` with ``eps(z) <= target`` to ``rtol`` (``eps`` decreasing in
    ``z``), from ``guess``: a bracket ``lo < hi`` (``eps(hi) <= target < eps(lo)``) by
    factors of ``step``, then steps interpolated in log-log, each followed by a probe
    ``rtol`` below, so that a good interpolation ends the search in two evaluations."""
    seen = {}

    def e(z):
        if z not in seen:
            seen[z] = eps(z)
        return seen[z]

    hi = guess
    if e(hi) <= target:
        lo = hi / step
        while e(lo) <= target:
            hi, lo = lo, lo / step
            if lo < 1e-6:  # (a target met with next to no noise)
                return hi
    else:
        lo, hi = hi, hi * step
        while e(hi) > target:
            if hi > MAX_NOISE_MULTIPLIER:
                raise ValueError(
                    f"{owner}: no noise multiplier up to {MAX_NOISE_MULTIPLIER:g} reaches "
                    f"target_epsilon={target!r} at this delta, sampling probability and "
                    "number of steps. Raise the target (or delta), or lower the sampling "
                    "probability or the number of steps."
                )
            lo, hi = hi, hi * step
    while hi / lo > 1 + rtol:
        a, b = math.log(lo), math.log(hi)
        ea, eb = e(lo), e(hi)
        if math.isfinite(ea) and ea > 0 and eb > 0 and ea != eb:
            t = (math.log(ea) - math.log(target)) / (math.log(ea) - math.log(eb))
            t = min(max(t, 0.1), 0.9)
        else:
            t = 0.5
        m = math.exp(a + t * (b - a)) * math.sqrt(1 + rtol)  # just above the estimate
        m = min(m, math.exp(a + 0.9 * (b - a)))
        if e(m) <= target:
            hi = m
            probe = hi / (1 + rtol)
            if probe > lo:
                if e(probe) <= target:
                    hi = probe
                else:
                    lo = probe
        else:
            lo = m
    return hi


def _optimizer_keys():
    from jaxpr_surgery._src.optim import dp

    keys = set()
    for f in (dp.dp_sgd, dp.dp_adam, dp.dp_aggregate):
        keys |= set(inspect.signature(f).parameters)
    return keys


def epsilon_of(
    config: Mapping,
    *,
    steps: int,
    num_examples: int,
    delta: float,
    accountant: str = "pld",
    truncated_batch_size: int | None = None,
) -> float:
    r"""The \(\varepsilon\) spent after ``steps`` steps of a `jaxpr_surgery.optim.dp_sgd`,
    ``dp_adam`` or ``dp_aggregate`` built from the keyword arguments ``config``.

    ``config`` is the dict of the optimizer's arguments (``js.optim.dp_sgd(**config)``);
    its ``noise_multiplier`` and ``batch_size`` count. ``batch_size`` is the fixed
    denominator of the noisy mean: with Poisson sampling, the *expected* batch size, so the
    sampling probability is ``batch_size / num_examples``. The other arguments (learning
    rate, clip norm, momentum, ``max_example_weight``: the noise scales with the
    sensitivity, so \(z\) is the same) do not change \(\varepsilon\). Every step must
    sample a Poisson batch of the ``num_examples`` examples (`poisson_batches`).

    Args:
      config: the optimizer's keyword arguments, with ``noise_multiplier`` and an int
        ``batch_size``.
      steps: the number of steps taken.
      num_examples: the dataset size.
      delta: \(\delta\).
      accountant: ``"pld"`` or ``"rdp"``, as in `epsilon`.
      truncated_batch_size: the ``max_batch_size`` of batches sampled with
        ``truncate=True``, as in `epsilon`.

    Returns:
      \(\varepsilon\), as `epsilon` computes it.

    Examples:
      >>> import jaxpr_surgery as js
      >>> config = dict(learning_rate=0.1, clip_norm=1.0, noise_multiplier=1.1,
      ...               batch_size=256)
      >>> opt = js.optim.dp_sgd(**config)
      >>> eps = js.privacy.epsilon_of(config, steps=1_000, num_examples=60_000, delta=1e-5)
      >>> round(eps, 2)
      0.6
    """
    owner = "epsilon_of"
    if not isinstance(config, Mapping):
        raise TypeError(
            f"{owner}(config): expected the dict of the DP optimizer's keyword arguments "
            f"(js.optim.dp_sgd(**config)), got {type(config).__name__}."
        )
    unknown = sorted(set(config) - _optimizer_keys())
    if unknown:
        raise ValueError(
            f"{owner}(config): {unknown} are not arguments of js.optim.dp_sgd, dp_adam or "
            "dp_aggregate; pass the optimizer's keyword arguments."
        )
    missing = [k for k in ("noise_multiplier", "batch_size") if config.get(k) is None]
    if missing:
        raise ValueError(
            f"{owner}(config): needs {' and '.join(missing)}. With Poisson sampling the "
            "optimizer must divide by the fixed expected batch size: build it with "
            "batch_size=expected batch size (a batch's own size depends on the data), and "
            "the sampling probability is batch_size / num_examples."
        )
    B = _int(config["batch_size"], "config['batch_size']", owner, 1)
    n = _int(num_examples, "num_examples", owner, 1)
    if B > n:
        raise ValueError(
            f"{owner}: batch_size={B} is larger than num_examples={n}; the sampling "
            "probability batch_size / num_examples must be at most 1."
        )
    return _checked_epsilon(
        owner, "config['noise_multiplier']", config["noise_multiplier"], B / n, steps,
        delta, accountant, truncated_batch_size,
        None if truncated_batch_size is None else n,
    )
