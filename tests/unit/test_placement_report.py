"""The placement summary the chief logs: tables in full, everything else grouped."""

import tensorflow as tf

from tf_psplugin.tables import placement

PS = ("/job:ps/replica:0/task:0/device:CPU:0", "/job:ps/replica:0/task:1/device:CPU:0")
WORKERS = ("/job:worker/replica:0/task:0/device:CPU:0", "/job:worker/replica:0/task:1/device:CPU:0")


def _records():
    records = [
        placement.PlacementRecord("user/embeddings:0", "table", (100000, 16), "float32",
                                  100000 * 16 * 4, PS),
        placement.PlacementRecord("item/embeddings:0", "table", (5000, 16), "float32",
                                  5000 * 16 * 4, PS),
        placement.PlacementRecord("user/embeddings/accumulator:0", "table-slot", (100000, 16),
                                  "float32", 100000 * 16 * 4, PS),
        placement.PlacementRecord("dense/kernel:0", "dense", (32, 64), "float32", 32 * 64 * 4,
                                  WORKERS),
        placement.PlacementRecord("dense/bias:0", "dense", (64,), "float32", 64 * 4, WORKERS),
    ]
    # Keras metrics: one scalar counter each, all named Variable:0.
    records += [placement.PlacementRecord("Variable:0", "dense", (), "float32", 4, WORKERS)
                for _ in range(30)]
    return records


def test_summary_lists_tables_in_full_and_groups_the_rest():
    summary = placement.format_summary(_records())
    lines = summary.splitlines()
    assert lines[0] == "tf_psplugin placement: 2 embedding table(s) on the PS tasks"
    assert sum(line.startswith("  table  ") for line in lines) == 2
    assert "user/embeddings:0" in summary and "item/embeddings:0" in summary
    assert "sharded on /job:ps/task:0, /job:ps/task:1" in summary
    assert "Variable:0" not in summary  # Metric counters are counted, not listed.
    assert ("  dense variables: 32, 0.01 MiB, one replica on each of /job:worker/task:0, "
            "/job:worker/task:1") in lines
    assert "  table optimizer slots: 1, 6.10 MiB, on /job:ps/task:0, /job:ps/task:1" in lines
    assert lines[-1].startswith("  total: tables 12.51 MiB on PS, dense 0.01 MiB per worker")
    assert "strategy.placement_report()" in lines[-1]
    assert len(lines) == 6


def test_full_report_still_lists_every_variable():
    report = placement.format_report(_records())
    assert report.count("Variable:0") == 30
    assert len(report.splitlines()) == 1 + len(_records()) + 1


def test_stacked_tables_name_their_stack():
    records = [placement.PlacementRecord(f"f{i}/embeddings:0", "table", (1000, 16), "float32",
                                         1000 * 16 * 4, PS, stack="stacked_tables_16_float32_0")
               for i in range(2)]
    records.append(placement.PlacementRecord("big/embeddings:0", "table", (10**6, 16), "float32",
                                             10**6 * 16 * 4, PS, unstacked="larger than 32 MiB"))
    for text in (placement.format_summary(records), placement.format_report(records)):
        lines = [line for line in text.splitlines() if "embeddings" in line]
        assert [line.endswith("(stacked in stacked_tables_16_float32_0)") for line in lines] == [
            True, True, False]
        assert lines[2].endswith("(not stacked: larger than 32 MiB)")


def test_why_a_table_is_not_stacked():
    from tf_psplugin.tables.stacking import TableStacks  # pylint: disable=g-import-not-at-top

    stacks = TableStacks(lambda s: None)
    shape = tf.TensorShape([100, 4])
    assert stacks.why_not(shape, tf.float32, 2, {}) is None
    assert "constraint" in stacks.why_not(shape, tf.float32, 2,
                                          {"constraint": tf.keras.constraints.NonNeg()})
    assert "larger than" in stacks.why_not(tf.TensorShape([1 << 25, 4]), tf.float32, 2, {})
    assert "one shard" in stacks.why_not(shape, tf.float32, 1, {})


def test_stack_fallbacks_are_listed_per_stack():
    records = [placement.PlacementRecord(f"f{i}/embeddings:0", "table", (1000, 16), "float32",
                                         1000 * 16 * 4, PS, stack="stacked_tables_16_float32_0")
               for i in range(2)]
    fallbacks = [("stacked_tables_16_float32_0",
                  "tables f0, f1 applied per table (Adamax2 is not known to update a stack "
                  "elementwise)")]
    lines = placement.format_report(records, fallbacks).splitlines()
    assert lines[-2] == ("  stack fallbacks (exact, as unstacked; slower than one apply per "
                         "stack):")
    assert lines[-1] == ("    stack 'stacked_tables_16_float32_0': tables f0, f1 applied per "
                         "table (Adamax2 is not known to update a stack elementwise)")
    assert "stack fallbacks" not in placement.format_report(records)
