"""Stacks that cannot be split before they are traced train as unstacked tables (issue 40).

A stack is split per model and trainability before its first traced use
(tests/cluster/test_table_stacking_resume.py); after that, a table frozen
later, a second model training some of its tables, a new optimizer that
stacking does not know, or a custom loop with a user's legacy optimizer
must still end as unstacked, never with an error (`stacked_updates`: rows
written back, per-table applies, or the tables split apart at the step's
first trace), and the placement report says which fallback each stack
took. A recompile with such a legacy optimizer after a traced `fit` splits
the stack all the same (the first fit's function, which Keras keeps, still
reads it: its storage is emptied, and scheduling it again is refused,
naming why, rather than training stale rows). Functions traced before a
split and called on the chief after it, outside the coordinator
(`model.predict`, a user's tf.function forward and lookup), are traced anew
and return what unstacked tables return (`predict_after_split`). Each case of
tests/cluster/scripts/stacked_fallback.py runs stacked and unstacked on one
cluster; every weight, and every slot Keras's new optimizers list, must be
the same (1e-6), the frozen table's rows exactly as before.
"""

import os

import numpy as np
import pytest

from tests.cluster import _cluster_util as cu

SCRIPT = os.path.join(os.path.dirname(__file__), "scripts", "stacked_fallback.py")
CASES = ("frozen_after", "frozen_after_legacy", "second_model", "custom_after", "legacy_loop",
         "legacy_recompile", "step_after_split", "slots_split_legacy", "slots_split_keras",
         "predict_after_split")
# Asynchronous mode (the stock coordinator's schedule) splits through the same
# path; with one worker its steps run one after another, so it is exact too.
ASYNC_CASES = ("legacy_loop", "legacy_recompile", "step_after_split", "slots_split_legacy",
               "slots_split_keras", "predict_after_split")
RUNS = {"stacked": CASES, "unstacked": CASES, "stacked-async": ASYNC_CASES,
        "unstacked-async": ASYNC_CASES}

pytestmark = [pytest.mark.cluster]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """{run: {case: weights}} and each run's log and placement report, on one cluster."""
    from tf_psplugin.launch import LocalCluster

    root = tmp_path_factory.mktemp("stacked_fallback")
    tracker = cu.ProcessTracker()
    cluster = LocalCluster(1, 2, env=tracker.env())
    try:
        cluster.start_servers()
        out, seen = {}, 0
        for stacking, cases in RUNS.items():
            (root / stacking).mkdir()
            result = cluster.run_chief(
                [cu.PYTHON, SCRIPT, stacking, str(root / stacking)] + list(cases), timeout=600)
            log, seen = result.stdout[seen:], len(result.stdout)  # The cluster's log so far.
            out[stacking] = {"error": log[-6000:]} if "DONE" not in log else {}
            out[stacking + "_log"] = log
            for case in cases:
                path = root / stacking / f"{case}.npz"
                if path.exists():
                    out[stacking][case] = dict(np.load(str(path)))
            placement = root / stacking / "placement.txt"
            out[stacking + "_placement"] = placement.read_text() if placement.exists() else ""
        out["placement"] = out["stacked_placement"]
        return out
    finally:
        cluster.stop()
        tracker.cleanup()


# What the placement report says of each case's stack (the stacked runs).
REPORTED = {
    "frozen_after": "tables c3_user/embeddings kept as they were while c3_item/embeddings train",
    "frozen_after_legacy": "tables c5_user/embeddings kept as they were while "
                           "c5_item/embeddings train",
    "second_model": "tables c6_item/embeddings kept as they were while c6_user/embeddings train",
    "custom_after": "tables c7_item/embeddings, c7_user/embeddings applied per table "
                    "(RmsScaledSGD is not known to update a stack elementwise)",
    "legacy_loop": "tables c9_item/embeddings, c9_user/embeddings split out, each alone "
                   "(RmsScaledAdagrad (legacy) is not known to update a stack elementwise",
    "legacy_recompile": "tables c10_item/embeddings, c10_user/embeddings split out, each alone "
                        "(RmsScaledAdagrad (legacy) is not known to update a stack elementwise",
    "step_after_split": "tables c11_item/embeddings, c11_user/embeddings split out, each alone "
                        "(RmsScaledAdagrad (legacy) is not known to update a stack elementwise",
    "slots_split_legacy": "tables c14_item/embeddings, c14_user/embeddings split out, each "
                          "alone (RmsScaledAdagrad (legacy) is not known to update a stack "
                          "elementwise",
    "slots_split_keras": "tables c12_item/embeddings, c12_user/embeddings split out, each "
                         "alone (RmsScaledAdagrad (legacy) is not known to update a stack "
                         "elementwise",
    "predict_after_split": "tables c15_item/embeddings, c15_user/embeddings split out, each "
                           "alone (RmsScaledAdagrad (legacy) is not known to update a stack "
                           "elementwise",
}


@pytest.mark.timeout(1500)
@pytest.mark.parametrize("case", CASES)
def test_case_ends_like_unstacked(results, case):
    _assert_ends_like_unstacked(results, case, "")


@pytest.mark.timeout(1500)
@pytest.mark.parametrize("case", ASYNC_CASES)
def test_async_case_ends_like_unstacked(results, case):
    """Asynchronous mode: the stock coordinator's schedule splits the stack the same way."""
    _assert_ends_like_unstacked(results, case, "-async")


def _assert_ends_like_unstacked(results, case, mode):
    stacked, unstacked = results["stacked" + mode].get(case), results["unstacked" + mode].get(case)
    assert unstacked is not None, results["unstacked" + mode].get("error")
    assert stacked is not None, results["stacked" + mode].get("error")
    assert sorted(stacked) == sorted(unstacked)
    for name, value in unstacked.items():
        assert stacked[name].shape == value.shape, name
        np.testing.assert_allclose(stacked[name], value, atol=1e-6, rtol=0, err_msg=name)
    dim = {"frozen_after": 3, "frozen_after_legacy": 5, "second_model": 6,
           "custom_after": 7, "legacy_loop": 9, "legacy_recompile": 10,
           "step_after_split": 11, "slots_split_legacy": 14, "slots_split_keras": 12,
           "predict_after_split": 15}[case]
    # Both tables trained (in the first fit at least): the comparison is not of initial values.
    assert any(k.startswith("opt") for k in stacked) or case == "frozen_after_legacy"
    assert f"c{dim}_item/embeddings" in stacked and f"c{dim}_user/embeddings" in stacked
    # The placement report states the stack's fallback.
    placement = results["stacked" + mode + "_placement"]
    assert REPORTED[case] in placement, placement[-3000:]
    # The stacked run fell back (logged once per stack), where the unstacked one had nothing to.
    fallback = {"custom_after": "updates each table's rows of the stack on its own",
                "legacy_loop": "the step was traced again with tables",
                "legacy_recompile": "the step was traced again with tables",
                "step_after_split": "the step was traced again with tables",
                "slots_split_legacy": "the step was traced again with tables",
                "slots_split_keras": "the step was traced again with tables",
                "predict_after_split": "the step was traced again with tables"}.get(
        case, "are written back as they were")
    log = results["stacked" + mode + "_log"].replace("\n", " ")
    assert any(fallback in line and f"c{dim}_" in line
               for line in log.split("[chief]")), log[-4000:]


@pytest.mark.timeout(1500)
@pytest.mark.parametrize("mode", ["", "-async"])
def test_a_step_traced_before_the_split_is_traced_anew_and_trains_on(results, mode):
    """`step_after_split`: the SGD step read the stack the legacy step split; scheduled again,
    the coordinator traced it anew (logged) and its run trained every table and the head,
    as unstacked (`test_case_ends_like_unstacked` compares every weight and slot).
    """
    stacked = results["stacked" + mode].get("step_after_split")
    unstacked = results["unstacked" + mode].get("step_after_split")
    assert stacked is not None, results["stacked" + mode].get("error")
    assert unstacked is not None, results["unstacked" + mode].get("error")
    # Every weight (both tables, the head's kernel and bias) moved in the last run.
    assert stacked["moved_after_split"].tolist() == [1, 1, 1, 1], stacked["moved_after_split"]
    np.testing.assert_array_equal(stacked["moved_after_split"], unstacked["moved_after_split"])
    log = results["stacked" + mode + "_log"].replace("\n", " ")
    assert "'step' was traced again: its traces read the storage of stacks split since" in log, (
        log[-4000:])
    assert "cannot run" not in results["stacked" + mode + "_log"].split("CASE legacy_recompile")[-1]


@pytest.mark.timeout(1500)
def test_the_first_fit_s_function_after_the_split_is_refused_not_run(results):
    """`legacy_recompile`: the function Keras kept reads the old storage; scheduled, it is refused.

    Traced anew it would apply the legacy optimizer the model was compiled
    with since, not the Adam its old trace applies (as it does unstacked):
    another program, so it is refused, naming why. In both modes (the
    synchronous tracing and the stock asynchronous schedule, before queueing).
    """
    for mode in ("", "-async"):
        log = results["stacked" + mode + "_log"]
        assert "OLD_RAN" not in log
        refused = [line for line in log.splitlines() if "OLD_REFUSED" in line]
        assert refused, log[-4000:]
        assert ("cannot run: it was traced before tables c10_item/embeddings, "
                "c10_user/embeddings were split apart") in refused[0], refused[0]
        assert "traced again, it no longer reads" in refused[0], refused[0]
        assert "Fix: trace it again" in refused[0], refused[0]


@pytest.mark.timeout(1500)
@pytest.mark.parametrize("mode", ["", "-async"])
def test_a_legacy_optimizer_s_slots_are_split_with_the_stack(results, mode):
    """`slots_split_legacy`: legacy Adagrad, alive, had slots of the stack the split split.

    Each of its slots of an old stack shard became a slot per new stack
    shard with the same rows: it trained on after the custom loop (its
    first fit's functions dropped at the split, Keras made new ones), and
    both optimizers' slots of both tables end as unstacked (`test_case_ends_like_unstacked`, 1e-6; measured
    bit-identical). Here: both optimizers' slots moved away from their
    initial value (the comparison is not of untouched slots).
    """
    stacked = results["stacked" + mode].get("slots_split_legacy")
    assert stacked is not None, results["stacked" + mode].get("error")
    for opt in ("opt0", "opt1"):
        for table in ("item", "user"):
            slot = stacked[f"{opt}/c14_{table}/accumulator"]
            assert (slot > 0.1 + 1e-6).any(), (opt, table)  # Adagrad's initial value is 0.1.
    # What Keras lists of the first optimizer after the split: its iterations
    # and a slot per table shard and dense variable, named as unstacked (the
    # keys, with the names, are compared with unstacked above), no stack slot.
    listed = [k.split("/", 3)[3] for k in stacked if k.startswith("opt0/weights/")]
    assert len(listed) == 7 and not any("stacked_tables" in n for n in listed), listed
    log = results["stacked" + mode + "_log"].split("CASE step_after_split")[-1]
    # The first fit's functions, which read the old stack, were dropped at the
    # split, as `compile` drops them: the next `fit` made and traced its own.
    assert "train_function, train_tf_function dropped" in log, log[-4000:]


@pytest.mark.timeout(1500)
@pytest.mark.parametrize("mode", ["", "-async"])
def test_a_keras_optimizer_s_slots_are_split_with_the_stack(results, mode):
    """`slots_split_keras`: Keras's (new) SGD, alive, had slots of the stack the split split.

    Each of its slots of an old stack shard (one per stack shard, untracked,
    for the apply) became a slot per new stack shard with the same rows, and
    its per-table slots (what Keras lists and checkpoints) were re-pointed:
    it trained on after the custom loop (its first fit's functions dropped
    at the split, Keras made new ones), and its slots, what it lists (names, shapes, values) and a final
    checkpoint of the model and the SGD end as unstacked
    (`test_case_ends_like_unstacked`, 1e-6). Here: its momentum moved
    away from zero, the listed names hold no stack, the checkpoint holds
    the tables' momentum, under the unstacked run's keys.
    """
    stacked = results["stacked" + mode].get("slots_split_keras")
    unstacked = results["unstacked" + mode].get("slots_split_keras")
    assert stacked is not None, results["stacked" + mode].get("error")
    assert unstacked is not None, results["unstacked" + mode].get("error")
    # (name, value) of each variable listed: tf-keras 2.16+ names each table's
    # slot "ShardedVariable", as unstacked, so names are not unique.
    listed = [(k.split("/", 3)[3], v) for k, v in stacked.items()
              if k.startswith("opt0/variables/")]
    names = [n for n, _ in listed]
    assert not any("stacked_tables" in n for n in names), names
    # The tables' momentum ([rows, 12] per table shard, or [40, 12] per table with
    # tf-keras 2.16+, named "ShardedVariable" there as unstacked).
    momenta = [v for _, v in listed if v.ndim == 2 and v.shape[1] == 12]
    assert len(momenta) in (2, 4), names
    assert all(np.abs(v).max() > 1e-4 for v in momenta), names
    checkpoint = [k for k in stacked if k.startswith("ckpt/")]
    # The tables' momentum, under the optimizer (Keras 2.15: per table shard in
    # `_variables`; tf-keras 2.16+: per table, also under its list's name).
    assert any(k.startswith("ckpt/optimizer/") and stacked[k].ndim == 2
               and stacked[k].shape[1] == 12 for k in checkpoint), checkpoint
    assert not any("stacked_tables" in k for k in checkpoint), checkpoint
    assert sorted(checkpoint) == sorted(k for k in unstacked if k.startswith("ckpt/"))
    log = results["stacked" + mode + "_log"].split("CASE slots_split_legacy")[-1]
    # The first fit's functions, which read the old stack, were dropped at the
    # split, as `compile` drops them: the next `fit` made and traced its own.
    assert "train_function, train_tf_function dropped" in log, log[-4000:]
    assert "cannot be split" not in log, log[-4000:]


@pytest.mark.timeout(1500)
@pytest.mark.parametrize("mode", ["", "-async"])
def test_calls_outside_the_coordinator_traced_before_the_split_work_after_it(results, mode):
    """`predict_after_split`: `model.predict`, a user's tf.function forward and lookup, traced
    on the chief before the split and called there after it, return what unstacked tables
    return (`test_case_ends_like_unstacked` compares every output, 1e-6), not TF's error.

    Here: the step between the calls changed what each returns (the comparison is not of
    untrained rows), and each was traced anew after the split.
    """
    stacked = results["stacked" + mode].get("predict_after_split")
    assert stacked is not None, results["stacked" + mode].get("error")
    for name in ("predict", "forward", "lookup"):
        before, after = stacked[f"{name}_before"], stacked[f"{name}_after"]
        assert before.shape == after.shape and before.shape[0] == 24, name
        assert np.abs(after - before).max() > 1e-4, name
    np.testing.assert_allclose(stacked["predict_after"], stacked["forward_after"], atol=1e-6,
                               rtol=0)
    log = results["stacked" + mode + "_log"].split("CASE slots_split_keras")[-1]
    assert "cannot run" not in log, log[-4000:]
    assert "'forward' was traced again" in log and "'lookup' was traced again" in log, (
        log[-4000:])
    assert "predict_function" in log and "dropped" in log, log[-4000:]
