"""DynamicEmbedding in one process: admission, eviction, keys, checkpoints, export."""

import numpy as np
import pytest
import tensorflow as tf

import tf_psplugin
from tf_psplugin.tables import dynamic as dynamic_lib
from tf_psplugin.tables import dynamic_state
from tf_psplugin.tables import key_hashing


def make(**kwargs):
    kwargs.setdefault("output_dim", 3)
    kwargs.setdefault("capacity", 8)
    return dynamic_lib.DynamicEmbedding(**kwargs)


def stored_keys(layer):
    return sorted(k for s in range(layer.num_shards)
                  for k in layer.shard_state(s).map.export()[0].numpy().tolist())


def step(layer, keys):
    """One training call (admission happens at its end)."""
    return layer(tf.constant(keys), training=True).numpy()


@pytest.mark.parametrize("field,kwargs", [
    ("output_dim", {"output_dim": 0}),
    ("capacity", {"capacity": -1}),
    ("key_dtype", {"key_dtype": tf.float32}),
    ("admit_after", {"admit_after": 0}),
    ("eviction", {"eviction": "fifo"}),
    ("init_scale", {"init_scale": -1.0}),
    ("sketch_width", {"admit_after": 2, "sketch_width": 0}),
    ("expire_after_steps", {"expire_after_steps": 0}),
])
def test_bad_arguments_name_the_field(field, kwargs):
    with pytest.raises(ValueError, match=f"{field}=.*Fix"):
        make(**kwargs)


def test_a_key_gets_a_row_after_admit_after_sightings_and_reads_the_default_before():
    layer = make(admit_after=3, default_value=0.5)
    for _ in range(2):
        np.testing.assert_array_equal(step(layer, [7]), np.full((1, 3), 0.5))
    assert layer.table_size() == 0
    step(layer, [7])  # Third sighting: admitted at the end of this step.
    assert stored_keys(layer) == [7]
    got = layer(tf.constant([7]), training=False).numpy()
    want = key_hashing.initial_rows(key_hashing.key_hash(tf.constant([7], tf.int64)), 3, 0.05)
    np.testing.assert_array_equal(got, want.numpy())
    # Repeats within one batch count too.
    step(layer, [9, 9, 9])
    assert stored_keys(layer) == [7, 9]


def test_reads_do_not_count_or_admit():
    layer = make()
    layer(tf.constant([1, 2]), training=False)
    layer(tf.constant([1, 2]))  # training=None: a read
    assert layer.table_size() == 0
    assert all(s["admitted"] == 0 for s in layer.table_stats())


def test_lru_evicts_the_least_recently_used_row():
    layer = make(capacity=2, eviction="lru")
    step(layer, [1])
    step(layer, [2])
    step(layer, [1])       # 1 is now more recent than 2
    step(layer, [3])       # full: 2 goes
    assert stored_keys(layer) == [1, 3]
    stats = layer.table_stats()[0]
    assert (stats["size"], stats["admitted"], stats["evicted"], stats["rejected"]) == (2, 3, 1, 0)
    assert layer.check_consistency() == []


def test_a_full_shard_evicts_a_batch_of_old_rows_at_once():
    # 64 rows: a full shard frees 64 / EVICTION_BATCH = 4 rows when it needs one.
    assert dynamic_lib.EVICTION_BATCH == 16
    layer = make(capacity=64, eviction="lru")
    for k in range(64):
        step(layer, [k])
    step(layer, [1000])
    stats = layer.table_stats()[0]
    assert (stats["evicted"], stats["size"]) == (4, 61)
    assert stored_keys(layer) == list(range(4, 64)) + [1000]  # 0..3 were the oldest
    step(layer, [1001, 1002, 1003])  # free rows: no eviction
    assert layer.table_stats()[0]["evicted"] == 4
    assert layer.table_size() == 64
    assert layer.check_consistency() == []


def test_lfu_evicts_the_least_frequently_used_row():
    layer = make(capacity=2, eviction="lfu")
    step(layer, [1])
    step(layer, [1, 1, 1])
    step(layer, [2])       # 2 is the most recent, but used least
    step(layer, [3])
    assert stored_keys(layer) == [1, 3]


def test_rows_unused_for_expire_after_steps_are_freed_on_the_check_steps():
    # N = 16: checked every 16 // 8 = 2 steps. The clock starts at 1 and
    # ticks after each training step; a row used at clock c expires at the
    # first even clock >= c + 16.
    layer = make(capacity=8, expire_after_steps=16)
    step(layer, [1, 2])                 # clock 1: rows for 1 and 2
    for _ in range(15):                 # clocks 2..16: only key 2 is used
        step(layer, [2])
    assert stored_keys(layer) == [1, 2]  # clock 16: 1 unused for 15 steps
    step(layer, [2])                    # clock 17: odd, no check
    assert stored_keys(layer) == [1, 2]
    step(layer, [2])                    # clock 18: check, 1 last used at 1 <= 18 - 16
    assert stored_keys(layer) == [2]
    stats = layer.table_stats()[0]
    assert (stats["size"], stats["expired"], stats["evicted"]) == (1, 1, 0)
    assert layer.check_consistency() == []
    # Seen again, the key is new: admitted with its initial row.
    step(layer, [1])
    assert stored_keys(layer) == [1, 2]
    got = layer(tf.constant([1]), training=False).numpy()
    want = key_hashing.initial_rows(key_hashing.key_hash(tf.constant([1], tf.int64)), 3, 0.05)
    np.testing.assert_array_equal(got, want.numpy())


def test_without_expiry_unused_rows_stay():
    layer = make(capacity=8)
    step(layer, [1, 2])
    for _ in range(40):
        step(layer, [2])
    assert stored_keys(layer) == [1, 2]
    assert layer.table_stats()[0]["expired"] == 0


def test_no_eviction_rejects_new_keys_when_full():
    layer = make(capacity=2, eviction=None)
    step(layer, [1, 2])
    step(layer, [3])
    assert stored_keys(layer) == [1, 2]
    assert layer.table_stats()[0]["rejected"] == 1
    np.testing.assert_array_equal(step(layer, [3]), np.zeros((1, 3)))


def test_rows_used_in_the_current_step_are_never_evicted():
    layer = make(capacity=2, eviction="lru")
    step(layer, [1, 2])
    step(layer, [1, 2, 3])  # 1 and 2 are in use now: 3 cannot get a row
    assert stored_keys(layer) == [1, 2]
    assert layer.table_stats()[0]["rejected"] == 1


def test_an_evicted_row_starts_again_from_its_new_keys_initial_value():
    layer = make(capacity=1, eviction="lru")
    step(layer, [1])
    step(layer, [2])
    want = key_hashing.initial_rows(key_hashing.key_hash(tf.constant([2], tf.int64)), 3, 0.05)
    np.testing.assert_array_equal(layer(tf.constant([2])).numpy(), want.numpy())
    np.testing.assert_array_equal(layer(tf.constant([1])).numpy(), np.zeros((1, 3)))


def test_int64_keys_of_any_value_are_distinct():
    keys = [-(2**63), -1, 0, 1, 2**62 + 1, 2**63 - 1]
    layer = make(capacity=16)
    step(layer, keys)
    assert stored_keys(layer) == sorted(keys)
    vectors = layer(tf.constant(keys)).numpy()
    assert len({tuple(v) for v in vectors}) == len(keys)


def test_string_keys_and_ragged_inputs_keep_their_shape():
    layer = make(key_dtype=tf.string)
    ragged = tf.ragged.constant([["a", "b", "a"], ["c"]])
    layer(ragged, training=True)
    out = layer(ragged)
    assert isinstance(out, tf.RaggedTensor)
    assert out.shape.as_list() == [2, None, 3]
    np.testing.assert_array_equal(out[0][0].numpy(), out[0][2].numpy())
    assert stored_keys(layer) == [b"a", b"b", b"c"]
    with pytest.raises(TypeError, match="string keys"):
        layer(tf.constant([1]))


def test_dense_inputs_of_any_rank():
    layer = make(capacity=32)
    out = layer(tf.constant(np.arange(24).reshape(2, 3, 4)), training=True)
    assert out.shape == (2, 3, 4, 3)
    with pytest.raises(TypeError, match="cast the ids to tf.int64"):
        layer(tf.constant([1.5]))


def test_the_initial_row_depends_on_the_key_alone():
    a, b = make(name="a"), make(name="b", capacity=100)
    step(a, [5, 6])
    step(b, [6, 123, 5])
    np.testing.assert_array_equal(a(tf.constant([5, 6])).numpy(), b(tf.constant([5, 6])).numpy())


def test_sketch_counts_are_bounded_and_never_undercount():
    layer = make(admit_after=2, sketch_width=16, sketch_depth=2, capacity=64)
    step(layer, list(range(100)))  # 100 keys in 16 counters: collisions
    assert layer.admission_counts.shape == (32,)
    step(layer, list(range(100)))
    # Every key has been seen twice: a count-min sketch can only over-count.
    assert layer.table_size() == 64


def build_model(capacity=64, key_dtype=tf.int64):
    inp = tf.keras.Input((2,), dtype=key_dtype)
    x = make(output_dim=4, capacity=capacity, key_dtype=key_dtype, name="dyn")(inp)
    out = tf.keras.layers.Dense(
        1, kernel_initializer=tf.keras.initializers.GlorotUniform(seed=1))(
            tf.keras.layers.Flatten()(x))
    model = tf.keras.Model(inp, out)
    model.compile(tf.keras.optimizers.legacy.Adagrad(0.1), "mse")
    return model


def zipf_ids(n=256, seed=0):
    return (np.random.RandomState(seed).zipf(1.3, size=(n, 2)) * 1_000_003 - 7).astype(np.int64)


def test_fit_trains_admitted_rows_only():
    model = build_model(capacity=8)
    ids = zipf_ids()
    model.fit(ids, np.ones((len(ids), 1)), batch_size=16, epochs=1, verbose=0)
    layer = model.get_layer("dyn")
    assert 0 < layer.table_size() <= 8
    assert layer.check_consistency() == []
    assert layer.table_stats()[0]["evicted"] > 0


def test_checkpoint_round_trip_restores_rows_and_map(tmp_path):
    model = build_model()
    ids = zipf_ids()
    model.fit(ids, np.ones((len(ids), 1)), batch_size=16, epochs=1, verbose=0)
    path = tf.train.Checkpoint(model=model).write(str(tmp_path / "ckpt"))
    fresh = build_model()
    tf.train.Checkpoint(model=fresh).read(path).assert_existing_objects_matched()
    keys = tf.constant(np.unique(ids))
    np.testing.assert_array_equal(fresh.get_layer("dyn")(keys).numpy(),
                                  model.get_layer("dyn")(keys).numpy())
    assert fresh.get_layer("dyn").table_size() == model.get_layer("dyn").table_size()
    assert fresh.get_layer("dyn").check_consistency() == []


def test_loading_pairs_again_clears_reverse_entries_held_on_another_shard():
    # Two shards in one process: after a restore into another PS count a
    # key's map entry (shard of its hash) and its row's reverse entry (shard
    # row mod 2) may differ; a second load must leave no stale reverse entry.
    states = [dynamic_state.ShardState("/cpu:0", tf.int64) for _ in range(2)]
    index = dynamic_state.KeyIndex(states)
    keys = tf.constant(np.arange(40, dtype=np.int64) * 7919)
    index.load(keys, tf.range(40, dtype=tf.int64))
    index.load(keys[:3], tf.constant([5, 6, 7], tf.int64))
    reverse = {int(r): int(k) for st in states for r, k in zip(*(t.numpy() for t in
                                                                 st.rows.export()))}
    assert reverse == {5: 0, 6: 7919, 7: 2 * 7919}
    got_keys, got_rows = (t.numpy() for t in index.export())
    assert dict(zip(got_keys.tolist(), got_rows.tolist())) == {0: 5, 7919: 6, 2 * 7919: 7}


def test_export_serves_raw_keys_and_unknown_keys_read_the_default(tmp_path):
    model = build_model()
    ids = zipf_ids()
    model.fit(ids, np.ones((len(ids), 1)), batch_size=16, epochs=1, verbose=0)
    path = tf_psplugin.export_saved_model(model, str(tmp_path / "export"),
                                          model_fn=build_model)
    serve = tf.saved_model.load(path).signatures["serving_default"]
    batch = tf.constant(np.concatenate([ids[:5], [[424242, -99]]]))
    got = list(serve(batch).values())[0].numpy()
    np.testing.assert_allclose(got, model(batch).numpy(), atol=1e-6)
    unknown = model.get_layer("dyn")(tf.constant([[424242, -99]])).numpy()
    np.testing.assert_array_equal(unknown, np.zeros_like(unknown))


def test_config_round_trip():
    layer = make(admit_after=2, eviction="lfu", key_dtype=tf.string)
    clone = dynamic_lib.DynamicEmbedding.from_config(layer.get_config())
    assert (clone.admit_after, clone.eviction, clone.key_dtype) == (2, "lfu", tf.string)


def test_shards_are_balanced_under_zipf_keys():
    # 200k distinct raw ids, weighted by a Zipf law over their rank: the hot
    # ids are consecutive small numbers, as CTR id streams are.
    ranks = np.arange(1, 200_001)
    weights = 1.0 / ranks ** 1.05
    for n in (2, 3, 4, 8):
        shard = key_hashing.shard_of(key_hashing.key_hash(tf.constant(ranks, tf.int64)), n).numpy()
        distinct = np.bincount(shard, minlength=n)
        load = np.bincount(shard, weights=weights, minlength=n)
        assert distinct.max() / distinct.mean() < 1.02, distinct
        # The hottest id alone is ~8% of all traffic; the rest spreads evenly.
        assert load.max() / load.mean() < 1.0 + 0.1 * n, (n, load / load.mean())



def test_contiguous_sharding_is_refused_with_the_fix(monkeypatch):
    from tf_psplugin._internal import tf_internal as _tf_internal

    original = dynamic_lib.DynamicEmbedding.add_weight

    def add_weight(self, name, shape, **kwargs):
        var = original(self, name, shape, **kwargs)
        if name != "embeddings":
            return var
        # What the strategy builds with sharding="contiguous": row ranges.
        return _tf_internal.sharded_variable.ShardedVariable(
            [tf.Variable(var[:4]), tf.Variable(var[4:])])

    monkeypatch.setattr(dynamic_lib.DynamicEmbedding, "add_weight", add_weight)
    with pytest.raises(ValueError, match='sharding="interleaved"'):
        make(capacity=8)(tf.constant([1]))
