"""Keras's new optimizers' table slots restore into another PS count, stacking and a plain model.

Issue 40: a job trained with Keras Adagrad or Adam on 2 PS tasks
(`ChiefCheckpoint`) is restored on 3 PS tasks with the other stacking, that
one's checkpoint on 1 PS task with the first stacking, and into a plain
single-process model (`load_into(include_optimizer=True)`). Each restore
holds the source's tensors exactly under the same keys (the tables' slots
as one logical ``[V, D]`` tensor each, `tf_psplugin.tables.slot_order`), and
one further step on the same batch ends, in every cluster, as the plain
model's step (weights and slots within 1e-5).
"""

import json
import os
import subprocess

import numpy as np
import pytest

from tests.cluster import _cluster_util as cu

SCRIPT = os.path.join(os.path.dirname(__file__), "scripts", "slot_order_resume.py")

pytestmark = [pytest.mark.cluster]


def _ok(result, what):
    assert result.returncode == 0 and "DONE" in result.stdout, (what, result.stdout[-6000:],
                                                               result.stderr[-6000:])
    return result.stdout


def _local(args, what):
    """Runs the script without a cluster (a plain model, or reading checkpoints)."""
    return _ok(subprocess.run([cu.PYTHON, SCRIPT] + args, capture_output=True, text=True,
                              timeout=300, check=False), what)


@pytest.mark.timeout(1200)
@pytest.mark.parametrize("optimizer,first", [("adagrad", "stacked"), ("adam", "unstacked")])
def test_new_optimizer_slots_restore_across_ps_counts_stacking_and_plain(
        shared_cluster, tmp_path, optimizer, first):
    other = "unstacked" if first == "stacked" else "stacked"
    source = str(tmp_path / "source")
    _ok(shared_cluster(num_workers=1, num_ps=2).run_chief(
        [cu.PYTHON, SCRIPT, "train", first, optimizer, source], timeout=300), "train 2 PS")
    runs = {}
    # 2 PS -> 3 PS with the other stacking; then that checkpoint -> 1 PS, stacking as first.
    for name, num_ps, stacking, src in [("ps3", 3, other, source),
                                        ("ps1", 1, first, str(tmp_path / "ps3" / "restored"))]:
        out = tmp_path / name
        out.mkdir()
        _ok(shared_cluster(num_workers=1, num_ps=num_ps).run_chief(
            [cu.PYTHON, SCRIPT, "resume", stacking, optimizer, src, str(out / "restored"),
             str(out / "stepped"), str(out)], timeout=300), name)
        runs[name] = out
    plain = tmp_path / "plain"
    plain.mkdir()
    _local(["plain", optimizer, source, str(plain)], "plain")
    pairs = [(source, runs["ps3"] / "restored"), (source, runs["ps1"] / "restored"),
             (source, plain / "restored"), (plain / "stepped", runs["ps3"] / "stepped"),
             (plain / "stepped", runs["ps1"] / "stepped")]
    stdout = _local(["compare"] + [str(p) for pair in pairs for p in pair], "compare")
    found = json.loads(stdout.split("RESULT ", 1)[1].splitlines()[0])
    for (a, b), result in zip(pairs, found):
        assert result["only"] == [] and result["shapes_equal"], (a, b, result)
        # Both tables' slots (Adagrad: 1 each; Adam: 2 each), logical [V, D].
        assert result["table_slots"] == (2 if optimizer == "adagrad" else 4), (a, b, result)
    for (a, b), result in list(zip(pairs, found))[:3]:
        assert result["diff"] == 0.0, (a, b, result)  # Restored exactly.
    for (a, b), result in list(zip(pairs, found))[3:]:
        assert result["diff"] < 1e-5, (a, b, result)  # One step on, as the plain model's.
    want = dict(np.load(str(plain / "weights.npz")))
    for name in ("ps3", "ps1"):
        got = dict(np.load(str(runs[name] / "weights.npz")))
        assert sorted(got) == sorted(want)
        for key, value in want.items():
            np.testing.assert_allclose(got[key], value, rtol=0, atol=1e-5, err_msg=(name, key))
