"""Tables stored in half precision (``HybridOptions(table_dtype=...)``, issue 42 items 2 and 4).

A 2-worker, 2-PS cluster trains a two-table model with bfloat16 tables
(tests/cluster/scripts/half_tables.py): the table shards on the PS are
bfloat16 and half the bytes of float32 ones, their Adagrad slots float32;
training matches single-process training on the global batch that rounds
as the PS does; the checkpoints (a full one and deltas) load into a plain
float32 model, export and serve, restore into a float32 strategy, and a
float32 checkpoint restores into a bfloat16 strategy (rounded).

Half-precision tables in the composition suite (stacked against unstacked,
kill-and-resume, ``full_every``, export, the situations, Keras's policies):
tests/cluster/test_composition.py, ``test_half_precision_cell_ends_like_unstacked``.
Mixed precision with half-precision tables end to end:
tests/cluster/test_mixed_half_tables.py.
"""

import json
import os

import numpy as np
import pytest
import tensorflow as tf

from tests.cluster import _cluster_util as cu

SCRIPT = os.path.join(os.path.dirname(__file__), "scripts", "half_tables.py")
TABLE_KEYS = ("table_a/0", "table_b/0")

pytestmark = [pytest.mark.cluster]


def _run(cluster, tmp_path, name, *args):
    out = tmp_path / name
    out.mkdir()
    result = cluster.run_chief([cu.PYTHON, SCRIPT, *args[:3], str(out), *args[3:]], timeout=300)
    assert result.returncode == 0 and "DONE" in result.stdout, (name, result.stdout[-6000:])
    report = json.loads((out / "report.json").read_text())
    return out, report


def _rounded(value, dtype):
    return tf.cast(tf.cast(value, dtype), tf.float32).numpy()


@pytest.mark.timeout(900)
def test_bfloat16_tables_train_checkpoint_and_convert(make_cluster, tmp_path):
    cluster = make_cluster(num_workers=2, num_ps=2)
    cluster.start_servers()
    bf16_dir, f32_dir = str(tmp_path / "bf16_model"), str(tmp_path / "f32_model")
    out, report = _run(cluster, tmp_path, "train", "train", "bfloat16", bf16_dir)

    # Stored in bfloat16 on the PS: half the bytes; the slots are float32.
    assert report["shard_dtypes"] == ["bfloat16"], report["shard_dtypes"]
    tables = [v for v in report["ps_variables"] if v["kind"] == "table"]
    assert sorted(v["shape"][0] for v in tables) == [30, 50]
    for v in tables:
        assert v["dtype"] == "bfloat16" and v["num_bytes"] == v["shape"][0] * 4 * 2, v
    slots = [v for v in report["ps_variables"] if v["kind"] == "table-slot"]
    assert slots and all(v["dtype"] == "float32" for v in slots), slots
    # Rows are looked up in bfloat16 (the accumulator reads of the update are float32).
    assert "bfloat16" in report["gather_dtypes"], report["gather_dtypes"]

    # Training: as one process on the global batch that rounds as the PS does
    # (each looked-up row's gradient rounded to bfloat16, an id's rows summed
    # and the update computed in float32, the new rows rounded).
    # Measured: tables equal, dense weights within 3e-8 (float32 sums in
    # another order). Bounds: one bfloat16 step of the largest row (such an
    # order difference may round a row the other way), and 1e-6.
    for key, diff in report["vs_emulated"].items():
        ulp = 2.0 ** (np.floor(np.log2(report["max_abs"][key])) - 7)
        bound = ulp if key in TABLE_KEYS else 1e-6
        assert diff <= bound, (key, diff, bound, report["vs_emulated"])
    # Float32 training differs by more (measured 1.2e-3 on the tables).
    assert max(report["vs_float32"][k] for k in TABLE_KEYS) > 1e-4, report["vs_float32"]

    # The checkpoint chain (a full checkpoint and deltas) in a plain float32 model.
    assert any(c.startswith("delta-") for c in report["checkpoints"]), report["checkpoints"]
    assert report["loaded_step"] == 12
    assert report["loaded_dtypes"] == ["float32"], report["loaded_dtypes"]
    assert max(report["loaded_vs_trained"].values()) == 0.0, report["loaded_vs_trained"]
    # Exported, then served: the export follows the delta of 4 more steps.
    assert report["serving_step"] == 16, report
    assert report["serving_vs_trained"] < 1e-6, report["serving_vs_trained"]
    trained = dict(np.load(str(out / "weights.npz")))
    trained_optimizer = dict(np.load(str(out / "optimizer.npz")))
    slot_keys = [k for k, v in trained_optimizer.items() if v.ndim == 2]
    assert len(slot_keys) >= 2 and all(k.endswith(":float32") for k in slot_keys), slot_keys

    # A float32 strategy restores the bfloat16 chain (exactly), trains, and saves.
    out_f32, report_f32 = _run(cluster, tmp_path, "to_f32", "convert", "none", bf16_dir, f32_dir)
    assert report_f32["restored_step"] == 16 and report_f32["shard_dtypes"] == ["float32"]
    restored = dict(np.load(str(out_f32 / "restored.npz")))
    for key, value in trained.items():
        np.testing.assert_array_equal(restored[key], value, err_msg=key)
    restored_optimizer = dict(np.load(str(out_f32 / "restored_optimizer.npz")))
    assert sorted(restored_optimizer) == sorted(trained_optimizer)
    for key, value in trained_optimizer.items():  # The step and the float32 slots.
        np.testing.assert_array_equal(restored_optimizer[key], value, err_msg=key)
    assert max(float(np.abs(trained_optimizer[k] - 0.1).max()) for k in slot_keys) > 0.01
    f32_bytes = {v["shape"][0]: v["num_bytes"] for v in report_f32["ps_variables"]
                 if v["kind"] == "table"}
    for v in tables:  # Half the bytes of the same table in float32.
        assert 2 * v["num_bytes"] == f32_bytes[v["shape"][0]], (v, f32_bytes)
    f32_trained = dict(np.load(str(out_f32 / "weights.npz")))

    # And back: a bfloat16 strategy restores the float32 checkpoint, rounded.
    out_back, report_back = _run(cluster, tmp_path, "back", "convert", "bfloat16", f32_dir,
                                 str(tmp_path / "unused"))
    assert report_back["restored_step"] == 20 and report_back["shard_dtypes"] == ["bfloat16"]
    back = dict(np.load(str(out_back / "restored.npz")))
    for key, value in f32_trained.items():
        want = _rounded(value, tf.bfloat16) if key in TABLE_KEYS else value
        np.testing.assert_array_equal(back[key], want, err_msg=key)
    assert any(not np.array_equal(f32_trained[k], back[k]) for k in TABLE_KEYS)
