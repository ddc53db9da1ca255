"""`js.extend.check_reduction`: the laws of the `Reduction` protocol, checked on a
reduction. Every built-in reduction keeps them (float64 and float32); a reduction that
breaks one is caught, the method named: merges, running accumulators, zeros, the
combination across devices, shares (`combined_share`: the law a custom reduction could
break silently under a batch sharded by XLA, docs/howto/sharded.md), copies
(`combine_copies`) and example weights."""

from __future__ import annotations

import contextlib
import dataclasses

import _models as M
import jax
import jax.numpy as jnp
import pytest
from test_reduction_protocol import MaxAbs  # (the docs' reduction: docs/extending.md)

import jaxpr_surgery as js
from jaxpr_surgery._src import reductions as R
from jaxpr_surgery._src import stats_research as SR
from jaxpr_surgery._src.kron_sum import KronSum

BUILT_IN = {
    "sum": lambda: R.PhiSum(),
    "sum_of_squares": lambda: R.PhiSum(jnp.square),
    "centered": lambda: R.Centered(),
    "sq_norms": lambda: R.SqNorms(),
    "norms": lambda: R.Norms(),
    "central_moments": lambda: SR.CentralMoments(),
    "kron": lambda: KronSum(8),
}


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("name", list(BUILT_IN))
def test_built_in_reductions_keep_the_laws(name, dtype):
    with M.x64() if dtype == "float64" else contextlib.nullcontext():
        laws = js.extend.check_reduction(BUILT_IN[name](), shape=(3, 5), B=8,
                                         dtype=getattr(jnp, dtype))
    assert laws[:5] == ["aval", "merge", "add_examples", "zeros", "combine_axis"], laws
    if name in ("centered", "central_moments"):  # (centred values: shares and copies)
        assert {"combined_share", "combine_copies", "from_weighted"} <= set(laws), laws


@dataclasses.dataclass(frozen=True)
class Sum(js.stats.Reduction):
    """A plain sum with each combination written out (each test breaks one)."""

    def aval(self, shape, dtype, B):
        return jax.ShapeDtypeStruct(tuple(shape), dtype)

    def from_examples(self, G):
        return jnp.sum(G, axis=0)

    def merge(self, a, na, b, nb):
        return a + b

    def from_weighted(self, G, w):
        return jnp.tensordot(w, G, 1)

    def combine_axis(self, value, n_local, N, axis_name):
        return jax.lax.psum(value, axis_name)

    def combined_share(self, value, n_local, axis_name, parts):
        return jax.lax.psum(value, axis_name) / parts

    def combine_copies(self, value, parts):
        return value * parts


def test_a_reduction_keeping_every_law_passes():
    assert js.extend.check_reduction(MaxAbs()) == [
        "aval", "merge", "add_examples", "zeros", "combine_axis"]
    assert js.extend.check_reduction(Sum()) == [
        "aval", "merge", "add_examples", "zeros", "combine_axis", "combined_share",
        "combine_copies", "from_weighted"]


@dataclasses.dataclass(frozen=True)
class AddedMaxAbs(MaxAbs):
    def merge(self, a, na, b, nb):  # a sum where the merge is a maximum
        return a + b


@dataclasses.dataclass(frozen=True)
class ForgetfulAccumulator(Sum):
    def accumulate(self, acc, n, value, m):  # drops the running value
        return value


@dataclasses.dataclass(frozen=True)
class OneZeros(Sum):
    def zeros(self, shape, dtype, B):
        return jnp.ones(shape, dtype)


@dataclasses.dataclass(frozen=True)
class LocalCombine(Sum):
    def combine_axis(self, value, n_local, N, axis_name):  # each device's own examples only
        return value

    def combined_share(self, value, n_local, axis_name, parts):
        return None


@dataclasses.dataclass(frozen=True)
class WholeShare(Sum):
    def combined_share(self, value, n_local, axis_name, parts):  # the whole, not a share
        return jax.lax.psum(value, axis_name)


@dataclasses.dataclass(frozen=True)
class OneCopy(Sum):
    def combined_share(self, value, n_local, axis_name, parts):
        return None

    def combine_copies(self, value, parts):  # one copy where there are parts
        return value


@dataclasses.dataclass(frozen=True)
class UnweightedSum(Sum):
    def from_weighted(self, G, w):  # the weights ignored
        return jnp.sum(G, axis=0)


@pytest.mark.parametrize("reduction,law", [
    (AddedMaxAbs(), "merge"),
    (ForgetfulAccumulator(), "add_examples"),
    (OneZeros(), "zeros"),
    (LocalCombine(), "combine_axis"),
    (WholeShare(), "combined_share"),
    (OneCopy(), "combine_copies"),
    (UnweightedSum(), "from_weighted"),
], ids=lambda x: x if isinstance(x, str) else type(x).__name__)
def test_a_broken_law_is_named(reduction, law):
    with pytest.raises(ValueError, match=rf"\.{law} breaks its law"):
        js.extend.check_reduction(reduction)


def test_bad_arguments_refused():
    with pytest.raises(TypeError, match="must be a js.stats.Reduction"):
        js.extend.check_reduction(js.stats.mean())
    with pytest.raises(ValueError, match="multiple of parts"):
        js.extend.check_reduction(Sum(), B=6, parts=4)


def test_a_wrong_aval_is_named():
    @dataclasses.dataclass(frozen=True)
    class Flat(MaxAbs):
        def aval(self, shape, dtype, B):
            return jax.ShapeDtypeStruct((int(jnp.prod(jnp.asarray(shape))),), dtype)

    with pytest.raises(ValueError, match=r"Flat\.aval gives"):
        js.extend.check_reduction(Flat())
