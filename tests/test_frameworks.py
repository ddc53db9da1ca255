"""Models written with flax (linen, nnx), equinox and haiku against the oracle.

Params are the framework's own pytrees: a linen ``params`` dict, an
``nnx.State`` from ``nnx.split`` (merged back inside the loss), an equinox
model's array part from ``eqx.partition`` (``None`` where static), a haiku
params mapping. Results must keep exactly that structure.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
import zoo
from conftest import (
    check_against_reference,
    check_matches_oracle,
    check_zoo_case_sane,
    combined_result,
    naive_stat,
    reference,
    run_stat,
)

pytestmark = pytest.mark.slow

FRAMEWORK_STATS = ["mean", "second_moment", "variance", "sq_norms", "clipped_mean",
                   "kron_moments", "kron_moments_diag", "per_example_dots_per_leaf",
                   "per_example_cosines"]
DTYPES = ["float32", "float64"]

_MODULE = {
    "flax_linen_mlp": "flax.linen",
    "flax_linen_transformer": "flax.linen",
    "flax_nnx_mlp": "flax.nnx",
    "equinox_mlp": "equinox",
    "haiku_mlp": "haiku",
}


def _need(case_name):
    pytest.importorskip(_MODULE[case_name])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case_name", zoo.FRAMEWORK_ZOO)
def test_framework_case_is_sane(case_name, dtype):
    _need(case_name)
    check_zoo_case_sane(case_name, dtype)


@pytest.mark.parametrize("case_name", zoo.FRAMEWORK_ZOO)
def test_tolerances_admit_naive_float32(case_name):
    _need(case_name)
    ref = reference(case_name)
    case = zoo.get_case(case_name, "float32")
    for sid in FRAMEWORK_STATS:
        check_against_reference(naive_stat(case, sid, ref), case_name, sid, "float32")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("stat_id", FRAMEWORK_STATS)
@pytest.mark.parametrize("case_name", zoo.FRAMEWORK_ZOO)
def test_framework_matches_oracle(case_name, stat_id, dtype):
    _need(case_name)
    check_matches_oracle(case_name, stat_id, dtype, FRAMEWORK_STATS)


@pytest.mark.parametrize("case_name", zoo.FRAMEWORK_ZOO)
def test_framework_result_structure(case_name):
    """The mean has exactly the params' tree structure (nnx.State, eqx module, ...)."""
    _need(case_name)
    case = zoo.get_case(case_name, "float32")
    status, value = combined_result(case_name, "float32", FRAMEWORK_STATS)
    mean = value["mean"] if status == "ok" else run_stat(case, reference(case_name).stat("mean"))
    assert jax.tree.structure(mean) == jax.tree.structure(case.params)
    for m, p in zip(jax.tree.leaves(mean), jax.tree.leaves(case.params), strict=True):
        assert np.shape(m) == np.shape(p)
