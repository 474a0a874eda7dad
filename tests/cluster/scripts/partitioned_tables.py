"""Chief script: stock PSS's constructor call with a `variable_partitioner`, class renamed.

Run by tests/cluster/test_partitioner.py under a LocalCluster (TF_CONFIG set)
with argv: OUT PARTITIONER SHARDING [stacked|stock]. PARTITIONER is "fixed3"
(`FixedShardsPartitioner(3)`: more shards than the 2 PS tasks) or "minsize"
(`MinSizePartitioner`: 3 shards for one table, 1 for the other). Trains two
tables synchronously on 2 workers, compares with single-process training on
the global batch, then restores the checkpoint into a plain Keras model.
"stock": the chief does not call `tf_psplugin.start_server()` either (the ps
and worker tasks run scripts/stock_server.py), so the program is stock code
with the class renamed. Writes a JSON report to OUT.
"""

import json
import os
import sys

import numpy as np
import tensorflow as tf

import tf_psplugin
from tf_psplugin import ReplicatedVariable
from tf_psplugin._internal.tf_internal import sharded_variable
# Every weight, each sharded table as one full array (the project's own helper).
from tf_psplugin.state.export import logical_weights

OUT, PARTITIONER, SHARDING = sys.argv[1], sys.argv[2], sys.argv[3]
STACKED = len(sys.argv) > 4 and sys.argv[4] == "stacked"
STOCK = len(sys.argv) > 4 and sys.argv[4] == "stock"
STEPS, BATCH, VOCAB_A, VOCAB_B, DIM, FEATURES = 12, 8, 50, 18, 4, 3


def make_partitioner():
    partitioners = tf.distribute.experimental.partitioners
    if PARTITIONER == "fixed3":
        return partitioners.FixedShardsPartitioner(3)
    # table_a: 50*4*4 = 800 bytes -> 3 shards; table_b: 18*4*4 = 288 bytes -> 1.
    return partitioners.MinSizePartitioner(min_shard_bytes=300, max_shards=4)


def make_model():
    inp = tf.keras.Input((FEATURES,), dtype="int64")
    x = tf.keras.layers.Embedding(
        VOCAB_A, DIM, embeddings_initializer=tf.keras.initializers.RandomUniform(seed=1),
        name="table_a")(inp)
    y = tf.keras.layers.Embedding(
        VOCAB_B, DIM, embeddings_initializer=tf.keras.initializers.RandomUniform(seed=4),
        name="table_b")(tf.keras.layers.Lambda(lambda t: t % VOCAB_B)(inp))
    x = tf.keras.layers.Concatenate()([tf.keras.layers.Flatten()(x), tf.keras.layers.Flatten()(y)])
    x = tf.keras.layers.Dense(8, activation="relu",
                              kernel_initializer=tf.keras.initializers.GlorotUniform(seed=2))(x)
    out = tf.keras.layers.Dense(
        1, kernel_initializer=tf.keras.initializers.GlorotUniform(seed=3))(x)
    return tf.keras.Model(inp, out)


def shards_of(table):
    if isinstance(table, sharded_variable.ShardedVariable):
        return list(table.variables)
    return [table]


def main():
    if not STOCK:
        tf_psplugin.start_server()
    resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    partitioner = make_partitioner()
    # The stock call, with only the class renamed (plus the plugin's options).
    strategy = tf_psplugin.HybridParameterServerStrategy(
        resolver, variable_partitioner=partitioner,
        options=tf_psplugin.HybridOptions(stack_tables=STACKED, log_placement=False),
        placement=tf_psplugin.PlacementPolicy(sharding=SHARDING))
    num_workers = strategy.num_replicas_in_sync
    rng = np.random.default_rng(0)
    ids = rng.integers(0, VOCAB_A, size=(STEPS * num_workers * BATCH, FEATURES)).astype("int64")
    y = rng.normal(size=(STEPS * num_workers * BATCH, 1)).astype("float32")
    with strategy.scope():
        model = make_model()
        model.compile(tf.keras.optimizers.legacy.Adagrad(0.1), "mse")
        dynamic = None
        if SHARDING == "interleaved":
            # Keeps one shard per PS whatever the partitioner (layers.py).
            dynamic = tf_psplugin.layers.DynamicEmbedding(4, capacity=64, name="dynamic")
            dynamic.build((None, 2))
    init = logical_weights(model)
    hist = model.fit(tf.data.Dataset.from_tensor_slices((ids, y)).batch(BATCH),
                     epochs=1, steps_per_epoch=STEPS, verbose=0)
    got = logical_weights(model)

    ref = make_model()
    rest = list(init)
    for layer in ref.layers:
        n = len(layer.weights)
        layer.set_weights(rest[:n])
        rest = rest[n:]
    ref.compile(tf.keras.optimizers.legacy.Adagrad(0.1), "mse")
    ref_hist = ref.fit(tf.data.Dataset.from_tensor_slices((ids, y)).batch(BATCH * num_workers),
                       epochs=1, steps_per_epoch=STEPS, verbose=0)
    diffs = [float(np.abs(a - b).max()) for a, b in zip(got, logical_weights(ref))]

    # The checkpoint holds logical tables: a plain model (one variable per
    # table, no cluster) restores the tables and their Adagrad accumulators.
    model_dir = os.path.join(os.path.dirname(OUT), "ckpt")
    tf_psplugin.ChiefCheckpointManager(model_dir, model=model).save(STEPS, final=True)
    plain = make_model()
    plain.compile(tf.keras.optimizers.legacy.Adagrad(0.1), "mse")
    tf_psplugin.load_into(plain, model_dir, include_optimizer=True)
    table_a = model.get_layer("table_a").embeddings
    slot = model.optimizer.get_slot(table_a, "accumulator")
    plain_slot = plain.optimizer.get_slot(plain.get_layer("table_a").embeddings, "accumulator")

    tables = {}
    for name in ("table_a", "table_b"):
        table = model.get_layer(name).embeddings
        shape = tf.TensorShape(table.shape)
        tables[name] = {
            "partitioner_says": int(partitioner(shape=shape, dtype=tf.float32)[0]),
            "type": type(table).__name__,
            "shards": [int(v.shape[0]) for v in shards_of(table)],
            "devices": [v.device for v in shards_of(table)],
        }
    report = {
        "num_workers": num_workers,
        "tables": tables,
        "tables_share_shards": all(a is b for a, b in zip(
            shards_of(table_a), shards_of(model.get_layer("table_b").embeddings))),
        "dynamic_shards": dynamic.num_shards if dynamic is not None else None,
        "dense_devices": sorted({d for v in model.variables if isinstance(v, ReplicatedVariable)
                                 for d in v.worker_devices()}),
        "records": [r.to_dict() for r in strategy.placement_records()],
        "diffs": diffs,
        "loss": hist.history["loss"][0],
        "ref_loss": ref_hist.history["loss"][0],
        "restored_tables": max(float(np.abs(a - b).max())
                               for a, b in zip(logical_weights(plain), got)),
        "restored_accumulator": float(np.abs(tf.convert_to_tensor(slot).numpy()
                                             - plain_slot.numpy()).max()),
        "accumulator_trained": float(np.abs(plain_slot.numpy() - 0.1).max()),
    }
    with open(OUT, "w") as f:
        json.dump(report, f)
    print("RESULT ok", flush=True)


if __name__ == "__main__":
    main()
