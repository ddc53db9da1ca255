"""Every zoo model x every statistic x dtype against the ``vmap(grad)`` oracle.

Speed: one jitted call of ``js.per_example_stat`` with *all* statistics as a dict
is made per (case, dtype) and cached; each parametrised test checks its own
entry. When that combined call raises, each test falls back to a call with its
statistic alone (so the failure is attributed to the statistic that breaks);
when an entry of the combined call is wrong, the test re-runs the statistic
alone and says whether the lone call is right (a bug in combining statistics)
or wrong too. ``test_multi_stat_*`` checks nested requests (tuples, lists) against
the flat one.
Set ``JS_TEST_SINGLE=1`` to call every statistic separately (slow, thorough).

Tolerances: see ``conftest.py`` (float64 ~1e-9, float32 ~1e-5 against the
float64 oracle of the same model, bf16 internals ~1e-2).
"""

from __future__ import annotations

import os

import jax
import numpy as np
import pytest
import zoo
from conftest import (
    REDUCTION_STAT_IDS,
    STAT_IDS,
    check_against_reference,
    check_matches_oracle,
    check_zoo_case_sane,
    combined_result,
    naive_stat,
    reference,
    run_stat,
)

import jaxpr_surgery as js

pytestmark = pytest.mark.slow

CASES = zoo.CORE_ZOO
DTYPES = ["float32", "float64"]
SINGLE = os.environ.get("JS_TEST_SINGLE", "") not in ("", "0")


# --------------------------------------------------------------------------- #
# The zoo itself
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case_name", CASES)
def test_zoo_case_is_sane(case_name, dtype):
    """Per-example convention holds, oracle finite and non-zero (no engine involved)."""
    check_zoo_case_sane(case_name, dtype)


@pytest.mark.parametrize("case_name", CASES)
def test_tolerances_admit_naive_float32(case_name):
    """float32 ``vmap(grad)`` passes the float32 tolerances (so they are not too tight)."""
    ref = reference(case_name)
    case = zoo.get_case(case_name, "float32")
    for sid in STAT_IDS:
        check_against_reference(naive_stat(case, sid, ref), case_name, sid, "float32")


# --------------------------------------------------------------------------- #
# The implementation against the oracle
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("stat_id", STAT_IDS)
@pytest.mark.parametrize("case_name", CASES)
def test_matches_oracle(case_name, stat_id, dtype):
    check_matches_oracle(case_name, stat_id, dtype, STAT_IDS, single=SINGLE)


# --------------------------------------------------------------------------- #
# Several statistics at once
# --------------------------------------------------------------------------- #
MULTI_CASES = ["mlp", "cnn1d", "weight_decay_lora"]


@pytest.mark.parametrize("case_name", MULTI_CASES)
def test_multi_stat_equals_separate(case_name):
    """A dict / tuple / list of statistics equals the statistics computed in another
    request (the flat dict of every statistic of the matrix: ``combined_result``)."""
    case = zoo.get_case(case_name, "float32")
    ref = reference(case_name)
    c = ref.clip("clipped_mean")
    request = {
        "m": js.stats.mean(),
        "pair": (js.stats.second_moment(), js.stats.variance()),
        "lst": [js.stats.sq_norms(), js.stats.clipped_mean(c)],
    }
    together = run_stat(case, request)
    assert set(together) == {"m", "pair", "lst"}
    assert isinstance(together["pair"], tuple) and len(together["pair"]) == 2
    assert isinstance(together["lst"], list) and len(together["lst"]) == 2
    status, flat = combined_result(case_name, "float32", STAT_IDS)
    assert status == "ok", flat
    separate = {
        "m": flat["mean"],
        "pair": (flat["second_moment"], flat["variance"]),
        "lst": [flat["sq_norms"], flat["clipped_mean"]],
    }
    assert jax.tree.structure(together) == jax.tree.structure(separate)
    for (path, a), b in zip(
        jax.tree_util.tree_flatten_with_path(together)[0], jax.tree.leaves(separate), strict=True
    ):
        scale = float(np.max(np.abs(b))) if b.size else 0.0
        np.testing.assert_allclose(
            a, b, rtol=1e-5, atol=1e-6 * scale, err_msg=jax.tree_util.keystr(path)
        )
    # and both against the oracle
    check_against_reference(together["m"], case_name, "mean", "float32")
    check_against_reference(together["pair"][0], case_name, "second_moment", "float32")
    check_against_reference(together["pair"][1], case_name, "variance", "float32")
    check_against_reference(together["lst"][0], case_name, "sq_norms", "float32")
    check_against_reference(together["lst"][1], case_name, "clipped_mean", "float32")


def test_multi_stat_tuple_unpacks():
    """The api.md example: ``mean, m2 = per_example_stat(fn, (mean(), second_moment()))``."""
    case = zoo.get_case("mlp", "float32")
    mean, m2 = run_stat(case, (js.stats.mean(), js.stats.second_moment()))
    check_against_reference(mean, "mlp", "mean", "float32")
    check_against_reference(m2, "mlp", "second_moment", "float32")


def test_duplicate_statistics_in_one_request():
    """The same statistic twice (shared work) gives the same value in both places."""
    case = zoo.get_case("transformer", "float32")
    a, b, c = run_stat(case, (js.stats.variance(), js.stats.variance(), js.stats.mean()))
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(x, y)
    check_against_reference(a, "transformer", "variance", "float32")
    check_against_reference(c, "transformer", "mean", "float32")


def test_mean_equals_jax_grad_transformer():
    """api.md: for a batch-mean loss, ``mean`` equals ``jax.grad(fn)`` (tied embedding model)."""
    case = zoo.get_case("transformer", "float64")
    with zoo.x64():
        g = jax.tree.map(np.asarray, jax.jit(jax.grad(case.loss_fn))(case.params, case.batch))
    status, value = combined_result("transformer", "float64", STAT_IDS)
    m = value["mean"] if status == "ok" else run_stat(case, js.stats.mean())
    for (path, a), b in zip(
        jax.tree_util.tree_flatten_with_path(m)[0], jax.tree.leaves(g), strict=True
    ):
        np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-12, err_msg=jax.tree_util.keystr(path))


def test_result_dtypes_follow_params():
    """Pytree-like-params results have the params' dtype (float32 params -> float32)."""
    case = zoo.get_case("mlp", "float32")
    out = run_stat(case, {"m": js.stats.mean(), "v": js.stats.variance()})
    for x in jax.tree.leaves(out):
        assert x.dtype == np.float32, x.dtype
    case = zoo.get_case("mlp", "float64")
    out = run_stat(case, {"m": js.stats.mean(), "v": js.stats.variance()})
    for x in jax.tree.leaves(out):
        assert x.dtype == np.float64, x.dtype


# --------------------------------------------------------------------------- #
# Chunks with a remainder and the smallest tiles, float32 under x64
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("case_name", CASES)
def test_chunked_tiny_tiles_float32_under_x64_match_oracle(case_name):
    """Statistics with ``chunk_size=3`` (a remainder chunk: B is 4..8) and
    ``memory_budget_bytes=1`` (one example and the smallest feature block per tile),
    for a float32 model with ``jax_enable_x64`` on: chunk merges, tile remainders and
    one-pass centred groups all run, and every value keeps the float32 dtype it has
    without x64 (a traced float64 count once promoted the merged sums).

    One statistic per kind of reduction on every case (the merges and loops are per
    reduction); every statistic on the MLP (each finalize sees the traced count)."""
    ref = reference(case_name)
    case = zoo.get_case(case_name, "float32")
    sids = STAT_IDS if case_name == "mlp" else REDUCTION_STAT_IDS
    request = {sid: ref.stat(sid) for sid in sids}
    with zoo.x64():
        out = run_stat(case, request, chunk_size=3, memory_budget_bytes=1)
    plain = combined_result(case_name, "float32", STAT_IDS)
    for sid in sids:
        check_against_reference(out[sid], case_name, sid, "float32")
        if plain[0] == "ok":
            got = [np.asarray(x).dtype for x in jax.tree.leaves(out[sid])]
            want = [np.asarray(x).dtype for x in jax.tree.leaves(plain[1][sid])]
            assert got == want, (sid, got, want)
