"""Incremental checkpoints follow stacked tables' slot views by their rows (issue 41).

In one process, with the stand-in strategy of test_table_stacking.py (four
tables, three of them in one 4-wide stack, two shards): Keras's (new)
Adagrad lists each table's slot as its rows of the stack shards' slot
(`stacked_slots.SlotView`: one view per shard on Keras 2.15, the table's
whole slot of one piece per shard on tf-keras 2.16+). `incremental_slots`'
slot matching lists each view as its table's per-shard (or sharded) slot,
so a delta saves it by the table's own changed rows; a write through a view
stamps exactly the rows it writes, in the stack shard's stamps, and no
other table's. The writing side on a cluster:
tests/cluster/test_incremental_stacked.py.
"""

import numpy as np
import pytest
import tensorflow as tf

from tests.unit.test_table_stacking import _batches, _model, _stacked_updates, _train  # noqa: F401
from tf_psplugin._internal.compat import TF_VERSION
from tf_psplugin.state import incremental, incremental_slots
from tf_psplugin.state.row_stamps import RowStamps
from tf_psplugin.tables import stacked_slots
from tf_psplugin.tables.stacking import StackedTable, TableStacks


def _saver_of(model, optimizer):
    """An `IncrementalSaver`'s table tracking (stamps per stack shard) without a strategy."""
    root = tf.train.Checkpoint(model=model, optimizer=optimizer)
    variables, slots, _ = incremental.object_keys(root)
    saver = incremental.IncrementalSaver.__new__(incremental.IncrementalSaver)
    saver.tables = [incremental._Table(key, var, list(var.variables))  # pylint: disable=protected-access
                    for key, var in sorted(variables.items()) if isinstance(var, StackedTable)]
    generation = tf.Variable(1, dtype=tf.int32)
    stamps_of = {}
    for table in saver.tables:
        for shard in table.shards:
            if id(shard) not in stamps_of:
                stamps_of[id(shard)] = RowStamps(
                    shard, generation, tf.Variable(tf.zeros([int(shard.shape[0])], tf.int32)))
            table.stamps.append(stamps_of[id(shard)])
    incremental_slots.find_slots(saver.tables, variables, slots)
    return saver, variables, generation


def _stamped(stamps: RowStamps, since: int):
    return stamps.dirty_rows(since).numpy().tolist()


@pytest.fixture(name="tracked")
def _tracked():
    model = _model(TableStacks(lambda s: None))
    optimizer = tf.keras.optimizers.Adagrad(0.3)
    _train(model, optimizer, _batches(2))
    return _saver_of(model, optimizer)


def test_each_slot_view_is_its_tables_slot_by_rows(tracked):
    saver, variables, _ = tracked
    views = {key for key, var in variables.items() if isinstance(var, stacked_slots.SlotView)}
    assert views
    listed = set()
    for table in saver.tables:
        assert table.slot_keys == []
        per_shard = [k for keys in table.shard_slot_keys for k in keys]
        if TF_VERSION >= (2, 16):  # The table's whole slot, one piece per shard.
            assert per_shard == [] and len(table.sharded_slot_keys) == 1, table.key
            keys = table.sharded_slot_keys
        else:  # One view per shard.
            assert [len(keys) for keys in table.shard_slot_keys] == [1, 1], table.key
            assert table.sharded_slot_keys == []
            keys = per_shard
        for s in range(len(table.shards)):
            key = keys[0] if TF_VERSION >= (2, 16) else keys[s]
            view = variables[key]
            slot, start, count = view.pieces[0 if TF_VERSION < (2, 16) else s]
            # The view's piece: this table's rows of stack shard s's slot.
            assert table.view_slots[(key, s)] is slot
            assert stacked_slots.stack_shard_of(slot) is table.shards[s]
            assert (start, count) == (table.offsets[s], table.counts[s])
        listed.update(keys)
    # Every view is some table's slot: none is left to the dense state.
    assert listed == views


def test_writes_through_a_view_stamp_its_rows_only(tracked):
    saver, variables, generation = tracked
    stacked = [t for t in saver.tables if t.shares_shards()]
    assert len(stacked) == 3  # The 4-wide stack: 23, 23 and 31 rows.
    first, second = stacked[0], stacked[1]
    since = int(generation.assign_add(1).numpy())
    key = (first.sharded_slot_keys or first.shard_slot_keys[1])[0]
    view = variables[key]
    # assign: every row of the view (the table's rows of the shard(s)), no other table's.
    before = view.numpy()
    view.assign(tf.fill(view.shape, 0.5))
    np.testing.assert_array_equal(view.numpy(), np.full(before.shape, 0.5, before.dtype))
    shards = range(2) if first.sharded_slot_keys else [1]
    for s in shards:
        offset, count = first.offsets[s], first.counts[s]
        assert _stamped(first.stamps[s], since) == list(range(offset, offset + count)), s
        assert first.dirty_rows(s, since).numpy().tolist() == list(range(count))
        assert second.dirty_rows(s, since).numpy().tolist() == []
    # scatter_update of a one-shard view: its rows, shifted to the stack shard's.
    key = (second.sharded_slot_keys or second.shard_slot_keys[1])[0]
    part = variables[key].part(1) if second.sharded_slot_keys else variables[key]
    since = int(generation.assign_add(1).numpy())
    part.scatter_update(tf.IndexedSlices(tf.fill([2, 4], 2.0), tf.constant([1, 4], tf.int64)))
    offset = second.offsets[1]
    assert _stamped(second.stamps[1], since) == [offset + 1, offset + 4]
    assert second.dirty_rows(1, since).numpy().tolist() == [1, 4]
    assert second.dirty_rows(0, since).numpy().tolist() == []
    np.testing.assert_array_equal(part.numpy()[[1, 4]], np.full([2, 4], 2.0, np.float32))
