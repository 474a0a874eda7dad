"""Table stacking (`table_stacking`) in one process.

The strategy is stood in for by a variable creator that does what
`VariableCreation._create_table` does: Keras `Embedding` tables become
`StackedTable`s (stack_tables=True) or `InterleavedShardedVariable`s (off),
on local "shards". Training must be the same either way, checkpoints must
carry each table under its own key, and lookups must see each table alone.
The multi-process check is tests/cluster/test_strategy.py's "stacked" case.
"""

import functools

import numpy as np
import pytest
import tensorflow as tf

from tf_psplugin._internal import patches
from tf_psplugin._internal import tf_objects
from tf_psplugin.state import checkpoint_write, export
from tf_psplugin.tables import fusion as lookup_fusion
from tf_psplugin.tables import lookups as table_lookups
from tf_psplugin.tables import shard_init
from tf_psplugin.tables import sharded as sharding
from tf_psplugin.tables import sharded_slots
from tf_psplugin.tables import stack_rows, stack_storage, stacked_fallback, stacked_updates
from tf_psplugin.tables.placement import base_name
from tf_psplugin.tables.sharded import InterleavedShardedVariable
from tf_psplugin.tables.stacking import StackedTable, TableStacks, TableView

FEATURES, VOCAB, SHARDS = 4, 23, 2


@pytest.fixture(autouse=True, scope="module")
def _stacked_updates():
    # What a strategy with stack_tables=True installs: the views' gradients
    # merged into one apply per stack shard.
    patches.install("keras_stacked_updates")


def _table_creator(stacks, num_shards=SHARDS):
    """A creator that makes every `embeddings` variable a table, as the strategy does."""

    def creator(next_creator, **kwargs):
        shape, dtype = shard_init.shape_and_dtype(kwargs)
        if base_name(kwargs.get("name")) != "embeddings":
            return next_creator(**kwargs)
        name = kwargs.get("name")
        make = functools.partial(shard_init.create_shard, next_creator, kwargs)
        if stacks is not None and stacks.eligible(shape, dtype, num_shards, kwargs):
            return stacks.add(name, shape, dtype, num_shards,
                              shard_values=functools.partial(
                                  sharding.shard_value_fn, kwargs["initial_value"], shape, dtype,
                                  num_shards=num_shards, name=name),
                              creator=make)
        return sharding.create_interleaved(name, shape, dtype, kwargs["initial_value"],
                                           num_shards, lambda s: None, make)

    return creator


def _model(stacks, num_shards=SHARDS, seed=0):
    """Four int64 id features: three 4-wide tables (23, 23, 31 rows) and one 8-wide."""
    tf.keras.utils.set_random_seed(seed)
    with tf.variable_creator_scope(_table_creator(stacks, num_shards)):
        ids = tf.keras.Input((FEATURES,), dtype="int64")
        columns = []
        for f in range(FEATURES):
            col = tf.keras.layers.Lambda(lambda t, f=f: t[:, f], name=f"ids_{f}")(ids)
            rows = VOCAB + 8 if f == 2 else VOCAB
            columns.append(tf.keras.layers.Embedding(rows, 8 if f == 3 else 4,
                                                     name=f"emb_{f}")(col))
        x = tf.keras.layers.Concatenate()(columns)
        x = tf.keras.layers.Dense(5, activation="relu", name="hidden")(x)
        return tf.keras.Model(ids, tf.keras.layers.Dense(1, name="out")(x))


def _batches(n=6, seed=1):
    rng = np.random.default_rng(seed)
    return [(tf.constant(rng.integers(0, VOCAB, size=(8, FEATURES)), tf.int64),
             tf.constant(rng.normal(size=(8, 1)), tf.float32)) for _ in range(n)]


def _step_function(model, optimizer):
    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x) - y))
        optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables),
                                      model.trainable_variables))

    return step


def _train(model, optimizer, batches):
    step = _step_function(model, optimizer)
    for x, y in batches:
        step(x, y)
    return step


def _tables(model):
    return {layer.name: layer.embeddings for layer in model.layers
            if isinstance(layer, tf.keras.layers.Embedding)}


def test_tables_of_one_width_share_one_variable_per_shard():
    model = _model(TableStacks(lambda s: None))
    tables = _tables(model)
    assert all(isinstance(t, StackedTable) for t in tables.values())
    narrow = [tables[f"emb_{f}"] for f in range(3)]
    for s in range(SHARDS):
        assert all(t.variables[s] is narrow[0].variables[s] for t in narrow)
    assert tables["emb_3"].variables[0] is not narrow[0].variables[0]
    # Keras lists each table's own rows of each stack shard (its views), named
    # and shaped as an unstacked table's shards, never the stack's shards.
    listed = model.trainable_variables
    assert len(listed) == FEATURES * SHARDS + 4
    for f in range(FEATURES):
        layer = model.get_layer(f"emb_{f}")
        assert [w.name for w in layer.weights] == [
            f"emb_{f}/embeddings/part_{s}:0" for s in range(SHARDS)]
        rows = VOCAB + 8 if f == 2 else VOCAB
        assert [w.shape.as_list()[0] for w in layer.weights] == [(rows + 1) // 2, rows // 2]
        assert layer.count_params() == rows * (8 if f == 3 else 4)
    assert not any(w is s for w in listed for t in narrow for s in t.variables)
    assert [t.shape.as_list() for t in narrow] == [[VOCAB, 4], [VOCAB, 4], [VOCAB + 8, 4]]
    assert narrow[0].variables[0].shape.as_list() == [12 + 12 + 16, 4]
    assert [t.row_offsets for t in narrow] == [(0, 0), (12, 11), (24, 22)]
    assert len({t._unique_id for t in tables.values()}) == FEATURES


@pytest.mark.parametrize("optimizer", ["adagrad", "adam"])
def test_training_matches_unstacked_tables(optimizer):
    make = {"adagrad": lambda: tf.keras.optimizers.legacy.Adagrad(0.3),
            "adam": lambda: tf.keras.optimizers.Adam(0.05)}[optimizer]
    stacked, plain = _model(TableStacks(lambda s: None)), _model(None)
    for a, b in zip(export.logical_weights(stacked), export.logical_weights(plain)):
        np.testing.assert_array_equal(a, b)  # Same initial values, per table.
    _train(stacked, make(), _batches())
    _train(plain, make(), _batches())
    got, want = export.logical_weights(stacked), export.logical_weights(plain)
    assert [w.shape for w in got] == [w.shape for w in want]
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_each_stack_shard_is_allocated_once():
    stacks = TableStacks(lambda s: None)
    model = _model(stacks)
    assert [s.materializations for s in stacks.stacks()] == [0, 0]  # Nothing needed them yet.
    _train(model, tf.keras.optimizers.legacy.Adagrad(0.3), _batches(2))
    assert [s.materializations for s in stacks.stacks()] == [1, 1]


def test_one_gather_and_one_apply_per_stack_shard(monkeypatch):
    model = _model(TableStacks(lambda s: None))
    optimizer = tf.keras.optimizers.legacy.Adagrad(0.3)

    def dense_read(view):
        raise AssertionError(f"{view.name} read densely in a step that only looks rows up")

    monkeypatch.setattr(TableView, "value", dense_read)
    step = _train(model, optimizer, _batches(1))
    graph = step.get_concrete_function(*_batches(1)[0]).graph
    applies = [op for op in graph.get_operations()
               if op.type == "ResourceSparseApplyAdagradV2"]
    # 2 stacks x 2 shards: one apply each (4 tables x 2 shards unstacked).
    assert len(applies) == 2 * SHARDS


def test_lookups_see_one_table():
    model = _model(TableStacks(lambda s: None))
    table = _tables(model)["emb_2"]
    full = table.numpy()
    assert full.shape == (VOCAB + 8, 4)
    ids = tf.constant([[30, 0], [7, 29]], tf.int64)
    np.testing.assert_array_equal(tf.nn.embedding_lookup(table, ids), full[ids.numpy()])
    np.testing.assert_array_equal(
        tf.compat.v1.nn.embedding_lookup(table, ids), full[ids.numpy()])
    np.testing.assert_array_equal(table.sparse_read([3, 30]), full[[3, 30]])
    np.testing.assert_array_equal(table[5], full[5])
    np.testing.assert_array_equal(table[3:9], full[3:9])
    sp = tf.SparseTensor([[0, 0], [0, 1], [2, 0]], tf.constant([1, 30, 4], tf.int64), [3, 2])
    np.testing.assert_allclose(
        tf.nn.embedding_lookup_sparse(table, sp, None, combiner="sum"),
        np.stack([full[1] + full[30], np.zeros(4), full[4]]), rtol=1e-6)
    safe = tf.nn.safe_embedding_lookup_sparse(table, sp, combiner="sum", default_id=30)
    np.testing.assert_allclose(safe, np.stack([full[1] + full[30], full[30], full[4]]),
                               rtol=1e-6)
    # Looked up together with the other tables of the stack: one gather per shard.
    tables = [_tables(model)[f"emb_{f}"] for f in range(3)]
    ids_list = [ids % VOCAB, ids % VOCAB, ids]
    got = table_lookups.lookup_tables(tables, ids_list)
    for t, i, g in zip(tables, ids_list, got):
        np.testing.assert_array_equal(g, t.numpy()[i.numpy()])
    graph = tf.function(lambda: table_lookups.lookup_tables(tables, ids_list)) \
        .get_concrete_function().graph
    assert sum(op.type == "ResourceGather" for op in graph.get_operations()) == SHARDS


def test_views_read_and_write_only_their_rows():
    """What Keras does with a layer's weights: read, set_weights, assign_*, scatter_*."""
    model = _model(TableStacks(lambda s: None))
    tables = _tables(model)
    before = {n: t.numpy() for n, t in tables.items()}
    layer = model.get_layer("emb_1")
    weights = layer.get_weights()
    full = before["emb_1"]
    for s, w in enumerate(weights):  # Shard s holds logical rows s, s + 2, ...
        np.testing.assert_array_equal(w, full[s::SHARDS])
    layer.set_weights([w + 1.0 for w in weights])
    np.testing.assert_array_equal(tables["emb_1"].numpy(), full + 1.0)
    view = layer.weights[1]
    view.assign_sub(tf.ones(view.shape))
    view.scatter_add(tf.IndexedSlices(tf.fill([1, 4], 5.0), tf.constant([2], tf.int64)))
    expect = full + 1.0
    expect[1::SHARDS] -= 1.0
    expect[1 + 2 * SHARDS] += 5.0
    np.testing.assert_array_equal(tables["emb_1"].numpy(), expect)
    np.testing.assert_array_equal(np.asarray(view), expect[1::SHARDS])
    with pytest.raises(tf.errors.InvalidArgumentError):
        view.scatter_update(tf.IndexedSlices(tf.ones([1, 4]), tf.constant([11], tf.int64)))
    for n in ("emb_0", "emb_2", "emb_3"):
        np.testing.assert_array_equal(tables[n].numpy(), before[n])


@pytest.mark.parametrize("read_first", [False, True], ids=["pending", "made"])
def test_models_and_frozen_tables_get_stacks_of_their_own(monkeypatch, read_first):
    """Two models in one scope and a frozen table, trained with Adam (not row-local).

    The tables of both models fill one stack as they are built; when the
    first model starts a traced call, its trainable tables, its frozen one
    and the other model's are split into three stacks, so that Adam's one
    apply per stack shard moves exactly the tables it trains.
    """
    monkeypatch.setattr(lookup_fusion, "_stacking", lambda: True)
    patches.install("keras_functional_fusion")
    stacks = TableStacks(lambda s: None)
    first, second = _model(stacks), _model(stacks, seed=3)
    narrow = lambda m: [_tables(m)[f"emb_{f}"] for f in range(3)]  # noqa: E731
    assert len({id(t.stack) for t in narrow(first) + narrow(second)}) == 1
    first.get_layer("emb_1").trainable = False
    plain = _model(None)
    plain.get_layer("emb_1").trainable = False
    if read_first:  # An eager read makes the stack's variables; the split copies them.
        first.get_weights()
        assert not narrow(first)[0].stack.never_made()
    _train(first, tf.keras.optimizers.Adam(0.05), _batches())
    _train(plain, tf.keras.optimizers.Adam(0.05), _batches())
    trained = narrow(first)
    assert trained[0].stack is trained[2].stack
    assert trained[1].stack is not trained[0].stack
    assert all(t.stack is not trained[0].stack and t.stack is not trained[1].stack
               for t in narrow(second))
    np.testing.assert_array_equal(_tables(first)["emb_1"].numpy(),
                                  _tables(_model(None))["emb_1"].numpy())  # Initial values.
    for a, b in zip(export.logical_weights(second), export.logical_weights(_model(None, seed=3))):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(export.logical_weights(first), export.logical_weights(plain)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


class _Subclassed(tf.keras.Model):
    """`_model`'s four tables and head, as a `tf.keras.Model` subclass."""

    def __init__(self):
        super().__init__()
        self.tables = [tf.keras.layers.Embedding(VOCAB + 8 if f == 2 else VOCAB,
                                                 8 if f == 3 else 4, name=f"emb_{f}")
                       for f in range(FEATURES)]
        self.hidden = tf.keras.layers.Dense(5, activation="relu", name="hidden")
        self.out = tf.keras.layers.Dense(1, name="out")

    def call(self, ids):
        return self.out(self.hidden(tf.concat(
            [table(ids[:, f]) for f, table in enumerate(self.tables)], axis=1)))


def _subclassed_model(stacks, seed=0):
    tf.keras.utils.set_random_seed(seed)
    with tf.variable_creator_scope(_table_creator(stacks)):
        model = _Subclassed()
        model(tf.zeros([1, FEATURES], tf.int64))  # Built by an eager call.
    return model


@pytest.mark.parametrize("build_slots", [False, True], ids=["traced_call", "build_slots"])
def test_subclassed_models_get_stacks_of_their_own(monkeypatch, build_slots):
    """Two subclassed models in one scope and a frozen table, trained with Adam.

    As for functional models: the first model's trainable tables, its
    frozen one and the other model's are split at its first traced
    `__call__` (`Model.__call__`, patched with the functional run), or by
    `separate_before_slots` before its optimizer's slots are made.
    """
    monkeypatch.setattr(lookup_fusion, "_stacking", lambda: True)
    patches.install("keras_functional_fusion")
    stacks = TableStacks(lambda s: None)
    first, second = _subclassed_model(stacks), _subclassed_model(stacks, seed=3)
    narrow = lambda m: [m.tables[f].embeddings for f in range(3)]  # noqa: E731
    assert len({id(t.stack) for t in narrow(first) + narrow(second)}) == 1
    first.tables[1].trainable = False
    plain = _subclassed_model(None)
    plain.tables[1].trainable = False
    optimizer = tf.keras.optimizers.Adam(0.05)
    if build_slots:
        first.compile(optimizer, "mse")
        lookup_fusion.separate_before_slots(first)
        optimizer.build(stacked_updates.substitute(first.trainable_variables))
    _train(first, optimizer, _batches())
    _train(plain, tf.keras.optimizers.Adam(0.05), _batches())
    trained = narrow(first)
    assert trained[0].stack is trained[2].stack
    assert trained[1].stack is not trained[0].stack
    assert all(t.stack is not trained[0].stack and t.stack is not trained[1].stack
               for t in narrow(second))
    for a, b in zip(export.logical_weights(second),
                    export.logical_weights(_subclassed_model(None, seed=3))):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(export.logical_weights(first), export.logical_weights(plain)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def _adam(kind):
    return {"adam": tf.keras.optimizers.Adam,
            "legacy_adam": tf.keras.optimizers.legacy.Adam,
            "legacy_adamax": tf.keras.optimizers.legacy.Adamax}[kind](0.05)


def _frozen_after_training(model, optimizer):
    """Trains `model`, freezes ``emb_1``, trains on (a new step, the same optimizer)."""
    _train(model, optimizer, _batches(3))
    model.get_layer("emb_1").trainable = False
    _train(model, optimizer, _batches(3, seed=2))


@pytest.mark.parametrize("kind", ["adam", "legacy_adam", "legacy_adamax"])
def test_a_non_row_local_optimizer_on_a_partly_trained_stack_keeps_the_other_rows(kind):
    """Adam on a stack some of whose tables get no gradient: per-table result, bit for bit.

    ``emb_1`` is frozen after the stack was traced (never split): its rows,
    and its rows of the stack's slots (whose moments are nonzero by then),
    are written back after each apply (`stacked_updates.keep_rows`), as
    Keras leaves an unstacked variable without a gradient untouched.
    """
    stacks = TableStacks(lambda s: None)
    stacked, plain = _model(stacks), _model(None)
    initial = _tables(plain)["emb_0"].numpy()
    optimizers = {"stacked": _adam(kind), "plain": _adam(kind)}
    _train(stacked, optimizers["stacked"], _batches(3))
    frozen_before = _tables(stacked)["emb_1"].numpy()
    stacked.get_layer("emb_1").trainable = False
    assert stacks.stack_of(_tables(stacked)["emb_1"].variables[0]) is \
        stacks.stack_of(_tables(stacked)["emb_0"].variables[0])  # Shared: the fallback runs.
    _train(stacked, optimizers["stacked"], _batches(3, seed=2))
    _frozen_after_training(plain, optimizers["plain"])
    np.testing.assert_array_equal(_tables(stacked)["emb_1"].numpy(), frozen_before)
    assert not np.array_equal(_tables(stacked)["emb_0"].numpy(), initial)  # It trained.
    for a, b in zip(export.logical_weights(stacked), export.logical_weights(plain)):
        np.testing.assert_array_equal(a, b)
    # The placement report states the fallback, per stack.
    notes = [text for _, text in stacks.fallbacks()]
    assert any(text.startswith("tables emb_1/embeddings kept as they were while ")
               and "emb_0/embeddings" in text and "changes every row" in text
               for text in notes), notes


def test_a_row_local_optimizer_on_a_partly_trained_stack_keeps_its_fast_path():
    """Adagrad updates only the rows it is given: one apply, no rows written back."""
    stacks = TableStacks(lambda s: None)
    model = _model(stacks)
    model.get_layer("emb_1").trainable = False  # Not split: no traced model call.
    for stack in stacks.stacks():
        stack.traced = True  # As once a traced function has used it: never split.
    x, y = _batches(1)[0]
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.square(model(x) - y))
    grads = tape.gradient(loss, model.trainable_variables)
    merged = stacked_updates.merge(tf.keras.optimizers.legacy.Adagrad(0.3),
                                   zip(grads, model.trainable_variables))
    assert not any(stacked_fallback.kept_rows(v) for _, v in merged)
    merged = stacked_updates.merge(tf.keras.optimizers.Adam(0.3),
                                   zip(grads, model.trainable_variables))
    narrow = _tables(model)["emb_1"]
    kept = {id(v): stacked_fallback.kept_rows(v) for _, v in merged
            if stacked_fallback.kept_rows(v)}
    assert sorted(kept) == sorted(id(v) for v in narrow.variables)
    for s, shard in enumerate(narrow.variables):
        assert kept[id(shard)] == [(narrow.row_offsets[s], narrow.shard_counts[s])]


def test_an_unknown_optimizer_applies_each_table_of_a_shared_stack_on_its_own():
    """A user's optimizer (not elementwise) on a stack traced whole: as unstacked, per table.

    The stack was traced by a first training with Keras Adam, so it cannot
    be split for the new optimizer; its update of each view (written through
    the view, with the view's own slots) is the unstacked shard's.
    """
    from tests.cluster.scripts.stacked_fallback import RmsScaledSGD

    stacks = TableStacks(lambda s: None)
    stacked, plain = _model(stacks), _model(None)
    for model in (stacked, plain):
        _train(model, tf.keras.optimizers.Adam(0.05), _batches(2))
    merged_before = stacked_updates.merge(
        RmsScaledSGD(0.05), [(tf.ones(v.shape), v) for v in stacked.trainable_variables])
    assert [v for _, v in merged_before] == list(stacked.trainable_variables)  # Per view.
    optimizers = {"stacked": RmsScaledSGD(0.05), "plain": RmsScaledSGD(0.05)}
    _train(stacked, optimizers["stacked"], _batches(3, seed=2))
    _train(plain, optimizers["plain"], _batches(3, seed=2))
    for a, b in zip(export.logical_weights(stacked), export.logical_weights(plain)):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)
    ours, theirs = optimizers["stacked"].variables, optimizers["plain"].variables
    assert [(v.name, v.shape) for v in ours] == [(v.name, v.shape) for v in theirs]
    for a, b in zip(ours, theirs):  # tf-keras 2.16+ lists a table's slots as one variable.
        np.testing.assert_allclose(tf.convert_to_tensor(a).numpy(), tf.convert_to_tensor(b).numpy(),
                                   rtol=0, atol=1e-6)


@pytest.mark.parametrize("late", ["clipnorm", "weight_decay", "none"])
def test_per_variable_clipping_and_decay_stay_per_table(late):
    """clipnorm and weight decay act on each table's own gradient and rows, as unstacked."""
    kwargs = {"clipnorm": {"clipnorm": 0.01}, "weight_decay": {"weight_decay": 0.1},
              "none": {}}[late]
    stacked, plain = _model(TableStacks(lambda s: None)), _model(None)
    for model in (stacked, plain):
        optimizer = tf.keras.optimizers.AdamW(0.05, **kwargs) if late == "weight_decay" \
            else tf.keras.optimizers.SGD(0.5, **kwargs)
        if late == "weight_decay":
            optimizer.exclude_from_weight_decay(var_names=["emb_2"])
        _train(model, optimizer, _batches(3))
    for a, b in zip(export.logical_weights(stacked), export.logical_weights(plain)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_writes_touch_only_the_table():
    model = _model(TableStacks(lambda s: None))
    tables = _tables(model)
    before = {n: t.numpy() for n, t in tables.items()}
    new = np.arange(VOCAB * 4, dtype=np.float32).reshape(VOCAB, 4)
    tables["emb_1"].assign(new)
    np.testing.assert_array_equal(tables["emb_1"].numpy(), new)
    tables["emb_1"].scatter_update(tf.IndexedSlices(tf.ones([2, 4]), tf.constant([0, 21])))
    new[[0, 21]] = 1.0
    np.testing.assert_array_equal(tables["emb_1"].numpy(), new)
    for n in ("emb_0", "emb_2", "emb_3"):
        np.testing.assert_array_equal(tables[n].numpy(), before[n])


@pytest.mark.parametrize("stacked", [True, False], ids=["stacked", "unstacked"])
@pytest.mark.parametrize("bad_id", [VOCAB, VOCAB + 1, 1000, -1, -2])
def test_an_id_outside_the_table_fails_as_unstacked(stacked, bad_id):
    """Lookups and writes of an id outside [0, V) fail: never another table's row."""
    model = _model(TableStacks(lambda s: None) if stacked else None)
    tables = _tables(model)
    # emb_0 is the first table of the stack, emb_1 the second: an id past
    # the end of either would be a row of its neighbour.
    for name in ("emb_0", "emb_1"):
        table = tables[name]
        assert isinstance(table, StackedTable) == stacked
        before = {n: t.numpy() for n, t in tables.items()}
        ids = tf.constant([[0, bad_id]], tf.int64)
        lookups = [
            lambda: tf.nn.embedding_lookup(table, ids),
            lambda: tf.compat.v1.nn.embedding_lookup(table, ids),
            lambda: table.sparse_read([bad_id]),
            lambda: table_lookups.lookup_tables([tables["emb_0"], tables["emb_1"]], [ids, ids]),
            lambda: tf.function(lambda: table_lookups.lookup_tables(
                [tables["emb_0"], tables["emb_1"]], [ids, ids]))(),
            lambda: table.scatter_update(tf.IndexedSlices(tf.ones([1, 4]),
                                                          tf.constant([bad_id], tf.int64))),
        ]
        for i, lookup in enumerate(lookups):
            with pytest.raises(tf.errors.InvalidArgumentError):
                lookup()
                pytest.fail(f"{name}: call {i} with id {bad_id} did not fail")
        for n, t in tables.items():
            np.testing.assert_array_equal(t.numpy(), before[n], err_msg=n)


@pytest.mark.parametrize("stacked", [True, False], ids=["stacked", "unstacked"])
def test_safe_lookup_treats_negative_ids_as_missing(stacked):
    """`safe_embedding_lookup_sparse`'s -1 (feature columns' out-of-vocabulary id) is missing."""
    tables = _tables(_model(TableStacks(lambda s: None) if stacked else None))
    table = tables["emb_1"]
    full = table.numpy()
    sp = tf.SparseTensor([[0, 0], [1, 0], [1, 1]], tf.constant([-1, 3, -1], tf.int64), [2, 2])
    for safe in (tf.nn.safe_embedding_lookup_sparse,
                 tf.compat.v1.nn.safe_embedding_lookup_sparse):
        out = safe(table, sp, combiner="sum").numpy()
        np.testing.assert_array_equal(out[0], np.zeros(4, np.float32))
        np.testing.assert_allclose(out[1], full[3], rtol=1e-6)
        with_default = safe(table, sp, combiner="sum", default_id=5).numpy()
        np.testing.assert_allclose(with_default[0], full[5], rtol=1e-6)


def _checkpointed(model, optimizer):
    sharded_slots.install_interleaved_slot_lookup(optimizer)
    optimizer._create_all_weights(model.trainable_variables)  # pylint: disable=protected-access
    return tf.train.Checkpoint(model=model, optimizer=optimizer)


@pytest.mark.parametrize("target", ["stacked", "interleaved_3", "plain"])
def test_checkpoint_restores_into_other_layouts(tmp_path, target):
    stacked = _model(TableStacks(lambda s: None))
    optimizer = tf.keras.optimizers.legacy.Adagrad(0.3)
    _train(stacked, optimizer, _batches())
    path = _checkpointed(stacked, optimizer).write(str(tmp_path / "ckpt"))
    keys = {name for name, _ in tf.train.list_variables(path)}
    for f in range(FEATURES):  # Each table and its slot under the table's own key.
        assert any(f"layer_with_weights-{f}/embeddings/.ATTRIBUTES" in k for k in keys), keys
        assert any(f"layer_with_weights-{f}/embeddings/.OPTIMIZER_SLOT" in k for k in keys), keys
    assert not any("stacked_tables" in k for k in keys)

    if target == "plain":
        other = tf.keras.models.clone_model(stacked)  # Plain variables, one per table.
        other.build((None, FEATURES))
    else:
        other = _model(TableStacks(lambda s: None) if target == "stacked" else None,
                       num_shards=SHARDS if target == "stacked" else 3, seed=5)
    other_opt = tf.keras.optimizers.legacy.Adagrad(0.3)
    status = _checkpointed(other, other_opt).read(path)
    status.assert_existing_objects_matched()
    for a, b in zip(export.logical_weights(other), export.logical_weights(stacked)):
        np.testing.assert_array_equal(a, b)
    src, dst = _tables(stacked), _tables(other)
    for name in src:
        np.testing.assert_array_equal(
            tf.convert_to_tensor(other_opt.get_slot(dst[name], "accumulator")),
            tf.convert_to_tensor(optimizer.get_slot(src[name], "accumulator")))


def test_checkpoint_of_unstacked_tables_restores_into_stacks(tmp_path):
    plain = _model(None, num_shards=3)
    optimizer = tf.keras.optimizers.legacy.Adagrad(0.3)
    _train(plain, optimizer, _batches())
    path = _checkpointed(plain, optimizer).write(str(tmp_path / "ckpt"))
    stacked = _model(TableStacks(lambda s: None), seed=9)
    stacked_opt = tf.keras.optimizers.legacy.Adagrad(0.3)
    _checkpointed(stacked, stacked_opt).read(path).assert_existing_objects_matched()
    for a, b in zip(export.logical_weights(stacked), export.logical_weights(plain)):
        np.testing.assert_array_equal(a, b)
    # Training goes on identically from there.
    _train(stacked, stacked_opt, _batches(3, seed=4))
    _train(plain, optimizer, _batches(3, seed=4))
    for a, b in zip(export.logical_weights(stacked), export.logical_weights(plain)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_a_table_made_after_slots_starts_a_new_stack():
    stacks = TableStacks(lambda s: None)
    model = _model(stacks)
    optimizer = tf.keras.optimizers.legacy.Adagrad(0.3)
    _train(model, optimizer, _batches(1))
    # The strategy seals a stack when a slot is made for its shards.
    for var in model.trainable_variables:
        stacks.seal(var)
    late = _model(stacks, seed=3)
    assert _tables(late)["emb_0"].variables[0] is not _tables(model)["emb_0"].variables[0]
    assert len(stacks.stacks()) == 4


def test_a_table_made_after_a_traced_use_starts_a_new_stack():
    """A traced function holds the stack's variables: a join would replace them under it."""
    stacks = TableStacks(lambda s: None)
    model = _model(stacks)
    _train(model, tf.keras.optimizers.legacy.SGD(0.1), _batches(1))  # No slots: not sealed.
    assert all(s.traced for s in stacks.stacks())
    late = _model(stacks, seed=3)
    assert _tables(late)["emb_0"].stack is not _tables(model)["emb_0"].stack


def test_async_checkpoints_save_each_saves_values(tmp_path):
    """An async checkpoint's CPU copies are refreshed at every save, not only the first."""
    model = _model(TableStacks(lambda s: None))
    optimizer = tf.keras.optimizers.legacy.Adagrad(0.3)
    checkpoint = _checkpointed(model, optimizer)
    options = tf.train.CheckpointOptions(experimental_enable_async_checkpoint=True)
    checkpoint.write(str(tmp_path / "first"), options=options)
    _train(model, optimizer, _batches(2))
    second = checkpoint.write(str(tmp_path / "second"), options=options)
    checkpoint.sync()
    other = _model(None, seed=5)
    tf.train.Checkpoint(model=other).read(second).expect_partial()
    for a, b in zip(export.logical_weights(other), export.logical_weights(model)):
        np.testing.assert_array_equal(a, b)


def test_not_stacked():
    stacks = TableStacks(lambda s: None)
    shape = tf.TensorShape([100, 4])
    assert stacks.eligible(shape, tf.float32, 2, {})
    assert not stacks.eligible(shape, tf.int64, 2, {})
    assert not stacks.eligible(shape, tf.float32, 1, {})
    assert not stacks.eligible(tf.TensorShape([100]), tf.float32, 2, {})
    assert not stacks.eligible(shape, tf.float32, 2, {"trainable": False})
    assert not stacks.eligible(shape, tf.float32, 2, {"constraint": tf.keras.constraints.NonNeg()})
    assert not stacks.eligible(tf.TensorShape([1 << 25, 4]), tf.float32, 2, {})
    with tf.Graph().as_default():
        assert not stacks.eligible(shape, tf.float32, 2, {})
    from tf_psplugin.tables.stacking import unstacked  # pylint: disable=g-import-not-at-top

    with unstacked():
        assert not stacks.eligible(shape, tf.float32, 2, {})


def test_fused_lookups_of_a_stack_are_one_gather_per_shard(monkeypatch):
    monkeypatch.setattr(lookup_fusion, "enabled", lambda: True)
    patches.install("keras_functional_fusion")
    model = _model(TableStacks(lambda s: None))
    x, _ = _batches(1)[0]
    graph = tf.function(model).get_concrete_function(x).graph
    gathers = [op for op in graph.get_operations()
               if op.type == "ResourceGather" and "fused_lookups" in op.name]
    assert len(gathers) == SHARDS  # The 4-wide stack; the 8-wide table is alone.
    np.testing.assert_allclose(tf.function(model)(x), _plain_forward(model, x), rtol=1e-6)


def test_fused_lookups_apply_the_whole_stack_gradient(monkeypatch):
    """The views' gradients of one fused gather go to the optimizer as that gather's gradient."""
    monkeypatch.setattr(lookup_fusion, "_stacking", lambda: True)
    patches.install("keras_functional_fusion")
    wholes = []
    whole_gradient = stack_rows.whole_gradient

    def spy(grads):
        wholes.append(whole_gradient(grads))
        return wholes[-1]

    monkeypatch.setattr(stack_rows, "whole_gradient", spy)
    stacked, plain = _model(TableStacks(lambda s: None)), _model(None)
    _train(stacked, tf.keras.optimizers.legacy.Adagrad(0.3), _batches())
    _train(plain, tf.keras.optimizers.legacy.Adagrad(0.3), _batches())
    # Per trace: the 4-wide stack's two shards do; the 8-wide table, alone,
    # has no fused gather (its views' gradients are put together).
    assert wholes and sum(w is not None for w in wholes) * 2 == len(wholes)
    for a, b in zip(export.logical_weights(stacked), export.logical_weights(plain)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def _plain_forward(model, x):
    local = tf.keras.models.clone_model(model)
    local.set_weights(export.logical_weights(model))
    return local(x)


def test_export_copies_each_table(tmp_path):
    model = _model(TableStacks(lambda s: None))
    _train(model, tf.keras.optimizers.legacy.Adagrad(0.3), _batches(2))
    x, _ = _batches(1, seed=7)[0]
    path = export.export_saved_model(model, str(tmp_path / "export"))
    loaded = tf.saved_model.load(path)
    np.testing.assert_allclose(loaded.signatures["serving_default"](
        **{model.input_names[0]: x})[model.output_names[0]], model(x), rtol=1e-5)
    assert isinstance(_tables(model)["emb_0"], InterleavedShardedVariable)


@pytest.mark.parametrize("stacked", [True, False], ids=["stacked", "unstacked"])
def test_saved_model_of_the_model_itself(tmp_path, stacked):
    """tf.saved_model.save of a stacked model (no copy) serves what the model computes."""
    model = _model(TableStacks(lambda s: None) if stacked else None)
    _train(model, tf.keras.optimizers.legacy.Adagrad(0.3), _batches(2))
    x, _ = _batches(1, seed=7)[0]
    tf.saved_model.save(model, str(tmp_path / "model"))
    loaded = tf.saved_model.load(str(tmp_path / "model"))
    np.testing.assert_allclose(loaded.signatures["serving_default"](
        **{model.input_names[0]: x})[model.output_names[0]], model(x), rtol=1e-5)


def test_new_optimizer_slots_restore_into_the_same_stacking(tmp_path):
    """Keras's new optimizers save slots by position: per stack, into the same stacking."""
    model = _model(TableStacks(lambda s: None))
    optimizer = tf.keras.optimizers.Adam(0.05)
    _train(model, optimizer, _batches(3))
    path = tf.train.Checkpoint(model=model, optimizer=optimizer).write(str(tmp_path / "ckpt"))
    other = _model(TableStacks(lambda s: None), seed=5)
    other_opt = tf.keras.optimizers.Adam(0.05)
    other_opt.build(other.trainable_variables)
    tf.train.Checkpoint(model=other, optimizer=other_opt).read(path).assert_consumed()
    for a, b in zip(export.logical_weights(other), export.logical_weights(model)):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(other_opt.variables, optimizer.variables):
        np.testing.assert_array_equal(tf.convert_to_tensor(a), tf.convert_to_tensor(b))
    # Training goes on identically.
    _train(model, optimizer, _batches(2, seed=4))
    _train(other, other_opt, _batches(2, seed=4))
    for a, b in zip(export.logical_weights(other), export.logical_weights(model)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


_FEATURE_COLUMNS = r'''
import functools, sys
import numpy as np
import tensorflow as tf
from tf_psplugin._internal import patches
from tf_psplugin.tables import shard_init
from tf_psplugin.tables import sharded as sharding
from tf_psplugin.tables import sharded_slots
from tf_psplugin.tables.stacking import TableStacks

patches.install("keras_stacked_updates")  # What a strategy with stack_tables=True installs.

def creator_for(stacks):
    def creator(next_creator, **kwargs):
        shape, dtype = shard_init.shape_and_dtype(kwargs)
        if not (kwargs.get("name") or "").endswith("embedding_weights"):
            return next_creator(**kwargs)
        name = kwargs["name"]
        make = functools.partial(shard_init.create_shard, next_creator, kwargs)
        if stacks is not None:
            return stacks.add(name, shape, dtype, 2, creator=make, shard_values=functools.partial(
                sharding.shard_value_fn, kwargs["initial_value"], shape, dtype, num_shards=2,
                name=name))
        return sharding.create_interleaved(name, shape, dtype, kwargs["initial_value"], 2,
                                           lambda s: None, make)
    return creator

def train(stacks):
    tf.keras.utils.set_random_seed(0)
    columns = [tf.feature_column.embedding_column(
        tf.feature_column.categorical_column_with_identity(f"c{i}", 20), 4) for i in range(3)]
    with tf.variable_creator_scope(creator_for(stacks)):
        inputs = {f"c{i}": tf.keras.Input((1,), dtype="int64", name=f"c{i}") for i in range(3)}
        model = tf.keras.Model(inputs, tf.keras.layers.Dense(1)(
            tf.keras.layers.DenseFeatures(columns)(inputs)))
    rng = np.random.default_rng(0)
    feats = {f"c{i}": tf.constant(rng.integers(0, 20, size=(8, 1)), tf.int64) for i in range(3)}
    y = tf.constant(rng.normal(size=(8, 1)), tf.float32)
    opt = tf.keras.optimizers.legacy.SGD(0.5)
    for _ in range(3):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(feats) - y))
        opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables),
                                model.trainable_variables))
    return model(feats).numpy()

# The stacked model first: nothing unstacked has been made in this process.
stacked = train(TableStacks(lambda s: None))
print("RESULT", float(np.abs(stacked - train(None)).max()))
'''


def test_feature_column_embeddings_of_a_process_whose_first_table_is_stacked(tmp_path):
    import subprocess  # pylint: disable=g-import-not-at-top
    import sys  # pylint: disable=g-import-not-at-top

    script = tmp_path / "feature_columns.py"
    script.write_text(_FEATURE_COLUMNS)
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                            timeout=240)
    assert result.returncode == 0, result.stderr[-4000:]
    diff = float(result.stdout.split("RESULT")[-1])
    assert diff <= 1e-5, diff


def _two_optimizer_step(model, *optimizers_and_variables):
    """A traced step applying each (optimizer, variables) pair's gradients."""

    @tf.function
    def step(x, y):
        with tf.GradientTape(persistent=True) as tape:
            loss = tf.reduce_mean(tf.square(model(x) - y))
        for optimizer, variables in optimizers_and_variables:
            optimizer.apply_gradients(zip(tape.gradient(loss, variables), variables))

    return step


@pytest.mark.parametrize("frequency", [None, 2])
def test_ema_averages_and_overwrites_each_table_alone(frequency):
    """`use_ema`: each table's own average, written back into its own rows only.

    One optimizer with EMA trains all but `emb_1`, another (no EMA) trains
    `emb_1`, which shares their stack; `fit`'s `finalize_variable_values`
    (and, with a frequency, the periodic overwrite) must write the averages
    of the first optimizer's tables only, as unstacked.
    """
    weights = []
    for stacks in (TableStacks(lambda s: None), None):
        model = _model(stacks)
        ema = tf.keras.optimizers.SGD(0.5, use_ema=True, ema_momentum=0.9,
                                      ema_overwrite_frequency=frequency)
        other = tf.keras.optimizers.SGD(0.5)
        own = [v for v in model.trainable_variables if "emb_1/" not in v.name]
        theirs = [v for v in model.trainable_variables if "emb_1/" in v.name]

        step = _two_optimizer_step(model, (ema, own), (other, theirs))
        for x, y in _batches(5):
            step(x, y)
        ema.finalize_variable_values(own)  # What `fit` does at its end.
        weights.append(export.logical_weights(model))
    for a, b in zip(*weights):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_fit_with_ema_ends_like_unstacked():
    """`fit` with `use_ema`: its end (`finalize_variable_values`) gets the views."""
    _assert_fit_like_unstacked(
        TableStacks(lambda s: None),
        lambda: tf.keras.optimizers.Adam(0.05, use_ema=True, ema_momentum=0.9,
                                         ema_overwrite_frequency=3))


def _assert_fit_like_unstacked(stacks, make_optimizer):
    """One epoch of `fit` on a model of `stacks` and an unstacked one: the same weights.

    Returns:
        The model of `stacks`, trained.
    """
    weights, models = [], (_model(stacks), _model(None))
    for model in models:
        model.compile(make_optimizer(), loss="mse")
        x, y = zip(*_batches(4))
        model.fit(tf.concat(x, 0), tf.concat(y, 0), batch_size=8, epochs=1, verbose=0,
                  shuffle=False)
        weights.append(export.logical_weights(model))
    for a, b in zip(*weights):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    return models[0]


class _NormalizedSGD(tf.keras.optimizers.Optimizer):
    """A custom optimizer: each variable's step scaled by its whole gradient's norm.

    Not elementwise: one apply to a stack (its tables' gradients together)
    would scale each table by the others' gradients too.
    """

    def __init__(self, learning_rate=0.5, name="NormalizedSGD"):
        super().__init__(name=name)
        self._learning_rate = self._build_learning_rate(learning_rate)

    def update_step(self, gradient, variable):
        lr = tf.cast(self.learning_rate, variable.dtype)
        if isinstance(gradient, tf.IndexedSlices):
            step = gradient.values * lr / (tf.norm(gradient.values) + 1.0)
            variable.scatter_sub(tf.IndexedSlices(step, gradient.indices))
        else:
            variable.assign_sub(gradient * lr / (tf.norm(gradient) + 1.0))

    def get_config(self):
        config = super().get_config()
        config["learning_rate"] = self._serialize_hyperparameter(self._learning_rate)
        return config


@pytest.mark.parametrize("make", [_NormalizedSGD,
                                  type("MyAdam", (tf.keras.optimizers.Adam,), {})])
def test_an_optimizer_of_another_class_gets_each_table_alone(monkeypatch, make):
    """A custom optimizer (or a subclass of a known one): no error, as unstacked.

    Its model's tables are each left alone in a stack at its first traced
    call (their own variables), and the placement report is told why.
    """
    monkeypatch.setattr(lookup_fusion, "_stacking", lambda: True)
    patches.install("keras_functional_fusion")
    told = {}
    stacks = TableStacks(lambda s: None,
                         on_restack=lambda table, name, why: told.update({id(table): (name, why)}))
    _assert_fit_like_unstacked(stacks, make)
    assert len(told) == FEATURES, told
    assert all(name == "" and make.__name__ in why for name, why in told.values()), told


def test_a_loss_scale_optimizer_stacks_as_its_inner_optimizer(monkeypatch):
    """mixed_float16: Keras's compile wraps Adam in a `LossScaleOptimizer`.

    It applies the unscaled gradients with its inner Adam (or skips the
    step): its model's tables stay in one stack, as with Adam alone.
    """
    monkeypatch.setattr(lookup_fusion, "_stacking", lambda: True)
    patches.install("keras_functional_fusion")

    def make():
        return tf.keras.mixed_precision.LossScaleOptimizer(tf.keras.optimizers.Adam(0.05))

    assert stacked_updates.why_apart(make()) is None
    assert "_NormalizedSGD" in stacked_updates.why_apart(
        tf.keras.mixed_precision.LossScaleOptimizer(_NormalizedSGD()))
    told = []
    stacks = TableStacks(lambda s: None, on_restack=lambda table, name, why: told.append(why))
    stacked = _assert_fit_like_unstacked(stacks, make)
    assert not any(told), told
    narrow = [_tables(stacked)[f"emb_{f}"] for f in range(3)]
    for s in range(SHARDS):  # The three 4-wide tables still share one variable per shard.
        assert all(t.variables[s] is narrow[0].variables[s] for t in narrow)


class _RmsScaledAdagrad(tf.keras.optimizers.legacy.Adagrad):
    """A user's legacy optimizer whose sparse step is scaled by the whole variable's RMS."""

    def _resource_apply_sparse(self, grad, var, indices, apply_state=None):
        scale = tf.sqrt(tf.reduce_mean(tf.square(tf.convert_to_tensor(var)))) + 0.1
        return super()._resource_apply_sparse(grad * scale, var, indices,
                                              apply_state=apply_state)


def _dispatch(step, batches, stacks):
    """Runs `step` on `batches`, each call traced as the coordinator traces it."""
    for x, y in batches:
        concrete = stacked_fallback.trace_splitting(
            lambda x=x, y=y: step.get_concrete_function(x, y), step, stacks,
            lambda traced: [traced])
        concrete(x, y)


def _train_splitting(model, optimizer, batches, stacks):
    """`_train`, each step traced as the coordinator traces it (`trace_splitting`)."""
    step = _step_function(model, optimizer)
    _dispatch(step, batches, stacks)
    return step


def test_a_legacy_unknown_optimizer_gets_its_tables_split_apart_and_the_step_retraced():
    """A custom loop with a user's legacy optimizer: split at the first trace, as unstacked.

    Its update is not elementwise (it reads the whole variable), so its one
    apply to a shared stack would differ; its kernels use the variable's
    handle, so it cannot apply per view either. The first trace stops
    before any slot (`SplitRequired`), the tables are split apart with
    their rows, the step is traced again as a first call: bit-identical
    weights and slots to unstacked tables, and the report names the split.
    """
    stacks = TableStacks(lambda s: None)
    stacked, plain = _model(stacks), _model(None)
    optimizers = {"stacked": _RmsScaledAdagrad(0.3), "plain": _RmsScaledAdagrad(0.3)}
    before = {name: t.numpy() for name, t in _tables(stacked).items()}
    narrow = [_tables(stacked)[f"emb_{f}"] for f in range(3)]
    assert narrow[0].stack is narrow[1].stack is narrow[2].stack  # Shared before the step.
    _train_splitting(stacked, optimizers["stacked"], _batches(3), stacks)
    _train(plain, optimizers["plain"], _batches(3))
    assert len({id(t.stack) for t in narrow}) == 3  # Each alone now.
    for name, table in _tables(stacked).items():
        assert not np.array_equal(table.numpy(), before[name]), name  # It trained.
    for a, b in zip(export.logical_weights(stacked), export.logical_weights(plain)):
        np.testing.assert_array_equal(a, b)
    for name, table in _tables(stacked).items():
        plain_table = _tables(plain)[name]
        for s in range(SHARDS):
            mine = optimizers["stacked"].get_slot(table.variables[s], "accumulator").numpy()
            theirs = optimizers["plain"].get_slot(plain_table.variables[s], "accumulator")
            start = table.row_offsets[s]
            np.testing.assert_array_equal(mine[start:start + table.shard_counts[s]],
                                          theirs.numpy(), err_msg=f"{name} {s}")
    notes = dict(stacks.fallbacks())
    assert any("emb_0/embeddings, emb_1/embeddings, emb_2/embeddings split out" in text
               and "_RmsScaledAdagrad (legacy) is not known" in text
               for text in notes.values()), notes


def test_a_live_legacy_optimizer_s_slots_are_split_with_the_stack():
    """Legacy Adagrad trained the stack and lives on; a user's legacy optimizer splits it.

    Each of Adagrad's slots of an old stack shard becomes a slot per new
    stack shard with the same rows (`slot_split`); Adagrad then trains on:
    weights and both optimizers' slots bit-identical to unstacked tables.
    (The strategy's variable creator records each slot of a stack shard;
    this harness has none, so the test records them as it would.)
    """
    stacks = TableStacks(lambda s: None)
    stacked, plain = _model(stacks), _model(None)
    firsts = {"stacked": tf.keras.optimizers.legacy.Adagrad(0.2),
              "plain": tf.keras.optimizers.legacy.Adagrad(0.2)}
    seconds = {"stacked": _RmsScaledAdagrad(0.3), "plain": _RmsScaledAdagrad(0.3)}
    first_step = _train(stacked, firsts["stacked"], _batches(2))
    narrow = [_tables(stacked)[f"emb_{f}"] for f in range(3)]
    for shard in narrow[0].stack.shards:
        stacks.seal(shard, slot=firsts["stacked"].get_slot(shard, "accumulator"))
    old_slots = [firsts["stacked"].get_slot(s, "accumulator") for s in narrow[0].stack.shards]
    assert narrow[0].stack.slots_held_by()
    _train_splitting(stacked, seconds["stacked"], _batches(2, seed=2), stacks)
    assert len({id(t.stack) for t in narrow}) == 3  # Split, with the slots.
    weights = firsts["stacked"].weights
    assert not any(w is old for w in weights for old in old_slots)  # Dropped from Adagrad.
    _dispatch(first_step, _batches(2, seed=3), stacks)  # Adagrad again, traced anew.
    _train(plain, firsts["plain"], _batches(2))
    _train(plain, seconds["plain"], _batches(2, seed=2))
    _train(plain, firsts["plain"], _batches(2, seed=3))
    for a, b in zip(export.logical_weights(stacked), export.logical_weights(plain)):
        np.testing.assert_array_equal(a, b)
    for name, table in _tables(stacked).items():
        plain_table = _tables(plain)[name]
        for s in range(SHARDS):
            start, count = table.row_offsets[s], table.shard_counts[s]
            for opts in (firsts, seconds):
                mine = opts["stacked"].get_slot(table.variables[s], "accumulator").numpy()
                theirs = opts["plain"].get_slot(plain_table.variables[s], "accumulator").numpy()
                np.testing.assert_array_equal(mine[start:start + count], theirs,
                                              err_msg=f"{name} {s}")
                assert (theirs > 0.1 + 1e-6).any(), name  # Trained.


def test_a_step_traced_before_a_split_is_traced_anew_and_trains_on():
    """A step traced before the split, still alive, read the stack; called after, it trains on.

    The split happens all the same (rows copied) and the old trace's
    storage is freed, so it never trains rows no table reads. Called by
    hand (outside the coordinator), it is traced anew before its call
    (`stacked_fallback.before_call`, the "retrace_after_split" patch the
    split installed); through the coordinator's tracing too: either way,
    as a first call on the new stacks, bit-identical to unstacked tables.
    """
    stacks = TableStacks(lambda s: None)
    stacked, plain = _model(stacks), _model(None)
    first = _batches(2, seed=3)
    sgd = {"stacked": tf.keras.optimizers.legacy.SGD(0.1),
           "plain": tf.keras.optimizers.legacy.SGD(0.1)}
    held = _train(stacked, sgd["stacked"], first)  # Alive.
    plain_step = _train(plain, sgd["plain"], first)
    narrow = [_tables(stacked)[f"emb_{f}"] for f in range(3)]
    assert narrow[0].stack is narrow[1].stack is narrow[2].stack
    optimizers = {"stacked": _RmsScaledAdagrad(0.3), "plain": _RmsScaledAdagrad(0.3)}
    _train_splitting(stacked, optimizers["stacked"], _batches(3), stacks)
    _train(plain, optimizers["plain"], _batches(3))
    assert len({id(t.stack) for t in narrow}) == 3  # Each alone now.
    assert "retrace_after_split" in patches.installed()
    after = [w.copy() for w in export.logical_weights(stacked)]
    assert any(stack_storage.retired_because(c) for c in tf_objects.traces_of_function(held))
    x, y = first[0]
    held(x, y)  # Called by hand: traced anew first, on the new stacks.
    plain_step(x, y)
    more = _batches(3, seed=4)
    _dispatch(held, more, stacks)
    for x, y in more:
        plain_step(x, y)
    for a, b, c in zip(export.logical_weights(stacked), export.logical_weights(plain), after):
        np.testing.assert_array_equal(a, b)
        assert not np.array_equal(a, c)  # It trained every weight after the split.
    traces = tf_objects.traces_of_function(held)
    assert traces and not any(stack_storage.retired_because(c) for c in traces)  # All anew.


def _step_of_replaceable_optimizer(model):
    """A `tf.function` step of `model` applying ``holder["optimizer"]`` (legacy SGD first).

    Replacing the holder's optimizer after a trace is what a `compile` with
    another does to a function Keras keeps: traced anew, it would run the new one.
    """
    holder = {"optimizer": tf.keras.optimizers.legacy.SGD(0.1)}

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x) - y))
        holder["optimizer"].apply_gradients(zip(
            tape.gradient(loss, model.trainable_variables), model.trainable_variables))

    return step, holder


def test_a_step_that_traced_anew_would_run_another_program_is_refused():
    """A step whose optimizer was replaced since its trace read a split stack: refused, for good.

    Traced anew it would apply the new optimizer, where its old trace (as
    an unstacked run) applies the old one: the coordinator's tracing
    refuses it, naming why and the fix, and keeps refusing it.
    """
    stacks = TableStacks(lambda s: None)
    stacked = _model(stacks)
    step, holder = _step_of_replaceable_optimizer(stacked)

    _dispatch(step, _batches(2, seed=3), stacks)
    holder["optimizer"] = tf.keras.optimizers.legacy.SGD(0.2)  # As a compile with another.
    _train_splitting(stacked, _RmsScaledAdagrad(0.3), _batches(2), stacks)
    before = [w.copy() for w in export.logical_weights(stacked)]
    for _ in range(2):
        with pytest.raises(stacked_updates.StackingError,
                           match=r"cannot run: it was traced before tables emb_0/embeddings, "
                                 r"emb_1/embeddings, emb_2/embeddings were split apart.*traced "
                                 r"again, it no longer reads.*Fix: trace it again"):
            _dispatch(step, _batches(1, seed=5), stacks)
    for a, b in zip(export.logical_weights(stacked), before):
        np.testing.assert_array_equal(a, b)


def test_a_dispatch_links_its_traces_to_the_stacks_only_when_it_traced(monkeypatch):
    """`trace_splitting` records traced functions (`Stack.traced_as`) only after a new trace.

    Each dispatch of a cached trace only looks it up: no recording (the
    coordinator calls this once per step).
    """
    stacks = TableStacks(lambda s: None)
    model = _model(stacks)
    recorded = []
    traced_as = stack_storage.Stack.traced_as
    monkeypatch.setattr(stack_storage.Stack, "traced_as",
                        lambda self, concrete: (recorded.append(concrete),
                                                traced_as(self, concrete))[1])
    step = _step_function(model, tf.keras.optimizers.legacy.SGD(0.1))
    batches = _batches(4) + [(x[:5], y[:5]) for x, y in _batches(2, seed=2)]
    counts = []
    for x, y in batches:  # Four of batch 8 (one trace), two of batch 5 (a second trace).
        concrete = stacked_fallback.trace_splitting(
            lambda x=x, y=y: step.get_concrete_function(x, y), step, stacks,
            lambda traced: [traced])
        concrete(x, y)
        counts.append(len(recorded))
    assert counts[0] > 0 and counts[:4] == [counts[0]] * 4, counts
    assert counts[4] > counts[3] and counts[5] == counts[4], counts
    stack = _tables(model)["emb_0"].stack
    # Both signatures' traces (and the first call's variable-creating one) read the stack.
    assert len(stack.live_traces()) >= 2


def test_the_traced_checkpoint_write_is_traced_again_after_a_split(tmp_path):
    """The chief's cached checkpoint write read the stack: after the split it saves the new rows.

    (Its trace read the old storage, which the split emptied.)
    """
    stacks = TableStacks(lambda s: None)
    model = _model(stacks)
    checkpoint = checkpoint_write.TracedWriteCheckpoint(model=model)
    checkpoint.write(str(tmp_path / "before"))
    held = _train(model, tf.keras.optimizers.legacy.SGD(0.1), _batches(1))  # Alive.
    _train_splitting(model, _RmsScaledAdagrad(0.3), _batches(2), stacks)
    assert len({id(_tables(model)[f"emb_{f}"].stack) for f in range(3)}) == 3
    path = checkpoint.write(str(tmp_path / "after"))
    other = _model(None, seed=5)
    tf.train.Checkpoint(model=other).read(path).assert_existing_objects_matched()
    for a, b in zip(export.logical_weights(other), export.logical_weights(model)):
        np.testing.assert_array_equal(a, b)
    assert held is not None


def test_a_legacy_unknown_optimizer_without_the_coordinator_is_refused_naming_the_fix():
    """A plain tf.function (no coordinator to trace it again): the error, with the fix."""
    model = _model(TableStacks(lambda s: None))
    with pytest.raises(Exception, match=r"share a stack.*Fix: HybridParameterServerStrategy"
                                        r"\(options=HybridOptions\(stack_tables=False\)\)"):
        _train(model, _RmsScaledAdagrad(0.3), _batches(1))
    stacked_fallback.take_split_request()


def test_known_optimizers_and_a_table_alone_never_ask_for_a_split():
    """The fast path: known legacy classes merge (no request); a table alone applies as is."""
    stacks = TableStacks(lambda s: None)
    model = _model(stacks)
    view = _tables(model)["emb_0"].views[0]
    alone = _tables(model)["emb_3"].views[0]  # The only 8-wide table: alone in its stack.
    grad = tf.IndexedSlices(tf.ones([1, 4]), tf.constant([0], tf.int64))
    grad8 = tf.IndexedSlices(tf.ones([1, 8]), tf.constant([0], tf.int64))
    stacked_fallback.take_split_request()
    for optimizer in (tf.keras.optimizers.legacy.Adagrad(0.1),
                      tf.keras.optimizers.legacy.RMSprop(0.1),
                      tf.keras.optimizers.legacy.Adadelta(0.1)):
        merged = stacked_updates.merge(optimizer, [(grad, view)])
        assert merged[0][1] is view.stack_shard
    assert stacked_updates.merge(_RmsScaledAdagrad(0.1), [(grad8, alone)])[0][1] is \
        alone.stack_shard
    assert stacked_fallback.take_split_request() is None
    with pytest.raises(stacked_fallback.SplitRequired, match="emb_0/embeddings"):
        stacked_updates.merge(_RmsScaledAdagrad(0.1), [(grad, view)])
    tables, why, message = stacked_fallback.take_split_request()
    assert [t.display_name for t in tables] == ["emb_0/embeddings"]
    assert "_RmsScaledAdagrad (legacy)" in why and "stack_tables=False" in message


def test_a_new_unknown_optimizer_in_a_custom_loop_applies_per_table_and_says_so():
    """No compile names it, so the stack stays shared: each view applied on its own (PER_TABLE)."""
    stacks = TableStacks(lambda s: None)
    stacked, plain = _model(stacks), _model(None)
    _train(stacked, _NormalizedSGD(), _batches(3))
    _train(plain, _NormalizedSGD(), _batches(3))
    narrow = [_tables(stacked)[f"emb_{f}"] for f in range(3)]
    assert narrow[0].stack is narrow[1].stack is narrow[2].stack  # Not split.
    for a, b in zip(export.logical_weights(stacked), export.logical_weights(plain)):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)
    assert [text for name, text in stacks.fallbacks() if name == narrow[0].stack.name] == [
        "tables emb_0/embeddings, emb_1/embeddings, emb_2/embeddings applied per table "
        "(_NormalizedSGD is not known to update a stack elementwise)"]
