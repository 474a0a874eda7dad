"""Single-process tests of `incremental_dynamic`: key merges, dirty rows, sketch changes.

The cluster side (stamps installed by `IncrementalSaver`, deltas written by
each PS, restored bit-exact) is tests/cluster/test_incremental_dynamic.py.
Here a `DynamicEmbedding` trains in one process (it admits right after its
own lookups) with the same `RowStamps` the saver would give it, and the
rows `DynamicTable` reports dirty are compared with the rows whose saved
state actually changed.
"""

import numpy as np
import pytest
import tensorflow as tf

from tf_psplugin.state import incremental
from tf_psplugin.state import incremental_dynamic
from tf_psplugin import layers
from tf_psplugin.state.model_dir import CheckpointError


@pytest.fixture(autouse=True)
def no_tf_config(monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)


def test_the_suffix_is_the_incremental_formats():
    suffix = incremental_dynamic._DELTA  # pylint: disable=protected-access
    assert suffix == incremental.DELTA_SUFFIX


def test_merge_replaces_every_pair_of_a_delta_row():
    old_keys = np.array([10, 11, 12, 13], np.int64)
    old_rows = np.array([0, 1, 2, 3], np.int64)
    # Row 1 freed (key 11 evicted or expired), row 2 given to new key 20,
    # key 13 moved from row 3 to row 5 (row 3 freed), row 0 untouched.
    rows = np.array([1, 2, 3, 5], np.int64)
    keys = np.array([0, 20, 0, 13], np.int64)
    held = np.array([False, True, False, True])
    new_keys, new_rows = incremental_dynamic.merge_key_pairs(old_keys, old_rows, rows, keys,
                                                             held)
    assert dict(zip(new_keys.tolist(), new_rows.tolist())) == {10: 0, 20: 2, 13: 5}
    assert len(new_keys) == 3  # Each key once.


def test_merge_with_string_keys_and_nothing_held():
    old_keys = np.array([b"a", b"b"], object)
    new_keys, new_rows = incremental_dynamic.merge_key_pairs(
        old_keys, np.array([4, 7]), np.array([7]), np.array([b""], object), np.array([False]))
    assert new_keys.tolist() == [b"a"] and new_rows.tolist() == [4]


def layer_model(**kwargs):
    inp = tf.keras.Input((2,), dtype=kwargs.get("key_dtype", tf.int64))
    layer = layers.DynamicEmbedding(2, name="dyn", **kwargs)
    return layer, tf.keras.Model(inp, layer(inp))


def saved_state(layer):
    """Per row: (embedding row, last use, hits, key or None)."""
    emb = layer.embeddings.numpy()
    last, hits = layer.row_last_used.numpy(), layer.row_hits.numpy()
    keys, rows = (t.numpy() for t in layer.key_index.export())
    key_of = dict(zip(rows.tolist(), keys.tolist()))
    return [(emb[r].tobytes(), int(last[r]), int(hits[r]), key_of.get(r))
            for r in range(layer.capacity)]


def tracked_layer(**kwargs):
    """A built layer, its RowStamps and DynamicTable, as `IncrementalSaver` sets them up."""
    return tracked_model(**kwargs)[1:]


def tracked_model(**kwargs):
    """`tracked_layer`'s results, after the model."""
    layer, model = layer_model(**kwargs)
    variables, _, paths = incremental.object_keys(tf.train.Checkpoint(model=model))
    keys_by_id = {id(v): k for k, v in variables.items()}
    [(path, found)] = incremental_dynamic.find_layers(tf.train.Checkpoint(model=model), paths)
    assert found is layer
    generation = tf.Variable(1, dtype=tf.int32)
    stamps = incremental.RowStamps(layer.embeddings, generation,
                                   tf.Variable(tf.zeros([layer.capacity], tf.int32)))
    table = incremental_dynamic.DynamicTable(path, layer, keys_by_id, paths)
    table.install([stamps], lambda device, **kw: tf.Variable(**kw))
    return model, layer, table, stamps, generation


def start_save(table, generation, full):
    """What `IncrementalSaver` does at a save: a new generation, then the layer's start."""
    since = int(generation.numpy())
    generation.assign_add(1)
    table.start_save(full=full)
    return since + 1 if full else since


def test_dirty_rows_cover_admitted_used_evicted_and_expired_rows_and_nothing_else_later():
    layer, table, stamps, generation = tracked_layer(capacity=6, eviction="lru",
                                                     expire_after_steps=2)
    rng = np.random.RandomState(0)
    for _ in range(4):
        keys = np.concatenate([[[100, 100]], rng.randint(0, 6, size=(2, 2))])
        layer(tf.constant(keys, tf.int64), training=True)
    since = start_save(table, generation, full=True)
    before = saved_state(layer)
    # New keys fill the table (eviction), old ones stop appearing (expiry);
    # key 100, admitted before the save, is used every step. No optimizer
    # runs here: the rows a step uses are found by their last use, not by
    # the optimizer's stamps.
    for step in range(4):
        layer(tf.constant([[100, 200 + step], [100, 300 + step]], tf.int64), training=True)
    stats = {k: sum(s[k] for s in layer.table_stats()) for k in ("evicted", "expired")}
    assert stats["evicted"] + stats["expired"] > 0, stats
    since = start_save(table, generation, full=False)
    after = saved_state(layer)
    changed = {r for r in range(layer.capacity) if before[r] != after[r]}
    freed = {r for r in changed if after[r][3] is None}
    assert freed, (before, after)
    dirty = set(table.dirty_rows(0, stamps, since).numpy().tolist())
    assert changed <= dirty, (changed, dirty)
    # Nothing happens between this save and the next: nothing is dirty.
    since = start_save(table, generation, full=False)
    assert table.dirty_rows(0, stamps, since).numpy().tolist() == []


def test_row_pieces_hold_each_rows_key_and_whether_it_holds_one():
    layer, table, stamps, generation = tracked_layer(capacity=4, eviction="lru",
                                                     expire_after_steps=1)
    layer(tf.constant([[5, 6]], tf.int64), training=True)
    since = start_save(table, generation, full=False)
    local = table.dirty_rows(0, stamps, since)
    pieces = {}
    table.add_row_pieces(0, local, local, lambda name, t: pieces.setdefault(name, t.numpy()))
    keys, rows = (t.numpy() for t in layer.key_index.export())
    holder = dict(zip(rows.tolist(), keys.tolist()))
    got_keys = pieces[table.key_index_path + "/.DELTA/keys"]
    held = pieces[table.key_index_path + "/.DELTA/held"]
    assert sorted(got_keys[held].tolist()) == [5, 6]
    assert {r: k for r, k, h in zip(local.numpy(), got_keys, held) if h} == holder
    last_key = table.row_state_keys[0] + "/.DELTA/rows"
    np.testing.assert_array_equal(pieces[last_key], layer.row_last_used.numpy()[local.numpy()])


def test_sketch_pieces_are_the_counters_changed_since_the_last_save():
    layer, table, _, generation = tracked_layer(capacity=4, admit_after=3, sketch_width=64)
    layer(tf.constant([[1, 2]], tf.int64), training=True)
    start_save(table, generation, full=True)
    before = layer.admission_counts.numpy().copy()
    layer(tf.constant([[3, 3]], tf.int64), training=True)  # Key 3 twice: counted, not admitted.
    pieces = {}
    table.add_sketch_pieces(0, lambda name, t: pieces.setdefault(name, t.numpy()))
    ids = pieces[table.sketch_key + "/.DELTA/ids"]
    after = layer.admission_counts.numpy()
    assert sorted(ids.tolist()) == sorted(np.flatnonzero(after != before).tolist())
    assert len(ids) == layer.sketch_depth  # One counter per hash function.
    np.testing.assert_array_equal(pieces[table.sketch_key + "/.DELTA/rows"], after[ids])
    # Taken as it was written: the next delta has none of them.
    pieces = {}
    table.add_sketch_pieces(0, lambda name, t: pieces.setdefault(name, t.numpy()))
    assert pieces[table.sketch_key + "/.DELTA/ids"].tolist() == []


def test_an_unbuilt_layer_is_refused():
    layer = layers.DynamicEmbedding(2, capacity=4, name="dyn")
    root = tf.train.Checkpoint(layer=layer)
    with pytest.raises(CheckpointError, match="not built"):
        incremental_dynamic.find_layers(root, {id(layer): "layer"})


def test_pieces_applied_to_the_full_save_give_the_layer_now_with_string_keys(tmp_path):
    kwargs = dict(capacity=6, eviction="lru", expire_after_steps=2, key_dtype=tf.string)
    model, layer, table, stamps, generation = tracked_model(**kwargs)
    keys = np.array([f"k{i}".encode() for i in range(30)], object)
    rng = np.random.RandomState(1)
    for _ in range(4):
        layer(tf.constant(rng.choice(keys[:8], size=(3, 2))), training=True)
    prefix = tf.train.Checkpoint(model=model).write(str(tmp_path / "full"))
    start_save(table, generation, full=True)
    for step in range(2):  # Keys 8.. replace the first ones (evicted)...
        layer(tf.constant(keys[8 + 6 * step:14 + 6 * step].reshape(3, 2)), training=True)
    for _ in range(3):  # ...then only key 20 is used: the others expire.
        layer(tf.constant([[keys[20], keys[20]]]), training=True)
    stats = layer.table_stats()[0]
    assert stats["evicted"] > 0 and stats["expired"] > 0, stats
    since = start_save(table, generation, full=False)
    local = table.dirty_rows(0, stamps, since)
    parts = {}

    def add(name, tensor):
        parts.setdefault(name, []).append(tensor.numpy())

    add(table.table_key + "/.DELTA/ids", local)
    table.add_row_pieces(0, local, local, add)
    reader, reader_model = layer_model(**kwargs)
    reader_root = tf.train.Checkpoint(model=reader_model)
    reader_root.read(prefix).assert_existing_objects_matched()
    variables, _, paths = incremental.object_keys(reader_root)
    variables[table.table_key].scatter_update(tf.IndexedSlices(
        tf.gather(layer.embeddings, local), local))
    incremental_dynamic.apply(reader_root, {table.path: table.manifest()}, parts,
                              variables.get, paths, "test")
    assert saved_state(reader) == saved_state(layer)
    assert reader.check_consistency() == []
