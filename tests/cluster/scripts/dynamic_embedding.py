"""Chief script: a DynamicEmbedding trained under the strategy vs in one process.

Run by tests/cluster/test_dynamic_embedding.py under a LocalCluster.
argv: OUT (JSON report), PHASE ("train" or "restore"), CKPT (checkpoint
prefix), MODE ("sync" or "async"), CAPACITY (rows, default 64: no eviction),
KEYS ("int" or "string"), EXPIRE (expire_after_steps, default none).

* train: trains a model with a DynamicEmbedding (raw int64 keys of any
  value, admission after 2 sightings) on 2 workers, trains the same model
  in one process on the global batch, and reports the max |diff| of every
  key's vector and of the dense weights, the table sizes and stats; then
  writes a checkpoint to CKPT and reports every key's vector.
* restore: builds the model under this cluster (any PS count), restores
  CKPT, and reports every key's vector and the table size; then restores the
  same checkpoint into a model without a strategy and reports those too.
"""

import json
import sys

import numpy as np
import tensorflow as tf

import tf_psplugin
from tf_psplugin import layers
from traced_graphs import ancestors, traced_graphs

OUT, PHASE, CKPT = sys.argv[1], sys.argv[2], sys.argv[3]
MODE = sys.argv[4] if len(sys.argv) > 4 else "sync"
CAPACITY = int(sys.argv[5]) if len(sys.argv) > 5 else 64
STRING_KEYS = len(sys.argv) > 6 and sys.argv[6] == "string"
EXPIRE = int(sys.argv[7]) if len(sys.argv) > 7 and sys.argv[7] != "none" else None
STEPS, BATCH, FEATURES, DIM = 12, 8, 3, 4
# 40 distinct raw keys: negative, small, above 2^62.
KEYS = np.array([-(2**63) + 5, -7, 0, 3, 2**62 + 11, 2**63 - 2] +
                [int(x) for x in np.random.RandomState(7).randint(-2**40, 2**40, size=34)],
                dtype=np.int64)
if STRING_KEYS:
    KEYS = np.array([f"user_{k}".encode() for k in KEYS], dtype=object)
KEY_DTYPE = tf.string if STRING_KEYS else tf.int64


def make_model():
    inp = tf.keras.Input((FEATURES,), dtype=KEY_DTYPE)
    x = layers.DynamicEmbedding(DIM, capacity=CAPACITY, admit_after=2, key_dtype=KEY_DTYPE,
                                expire_after_steps=EXPIRE, name="dyn")(inp)
    x = tf.keras.layers.Flatten()(x)
    x = tf.keras.layers.Dense(8, activation="relu",
                              kernel_initializer=tf.keras.initializers.GlorotUniform(seed=2))(x)
    out = tf.keras.layers.Dense(1, kernel_initializer=tf.keras.initializers.GlorotUniform(seed=3))(x)
    model = tf.keras.Model(inp, out)
    # With expiry, freed rows are reused, and a reused row keeps its optimizer
    # slots (docs/dynamic_embedding.md, Limits): which row a key gets depends
    # on the PS count, so Adagrad's inherited accumulators would differ from
    # one process's for a reason other than expiry. SGD has no slots.
    optimizer = (tf.keras.optimizers.legacy.SGD(0.1) if EXPIRE
                 else tf.keras.optimizers.legacy.Adagrad(0.1))
    model.compile(optimizer, "mse")
    return model


def dense_weights(model):
    return [w.numpy() for layer in model.layers if isinstance(layer, tf.keras.layers.Dense)
            for w in layer.weights]


_MAP_WRITES = {"LookupTableInsertV2", "LookupTableRemoveV2"}


def admission_order(model):
    """Where the traced sync steps change key maps, relative to the step's collectives.

    Returns (map writes the end-of-step barrier does not wait for, admission
    exports that do not wait for the gradient all-reduce, graphs that admit):
    admission must run after every worker's lookups (after the all-reduce,
    which waits for every worker's hand-in) and before the next step can
    read (before the barrier).
    """
    late, early, admitting = [], [], 0
    for graph in traced_graphs(model):
        ops = graph.get_operations()
        exports = [op for op in ops if op.type == "LookupTableExportV2"]
        if not exports:
            continue  # A role that admits to no shard.
        admitting += 1
        collectives = [op for op in ops if op.type.startswith("CollectiveReduce")]
        barriers = [op for op in collectives if op.inputs[0].op.type == "Const"
                    and op.inputs[0].op.control_inputs]
        reduces = [op for op in collectives if op not in barriers]
        if barriers:
            before_barrier = ancestors(barriers[-1])
            late += [op.name for op in ops
                     if op.type in _MAP_WRITES and op.name not in before_barrier]
        else:
            late.append(f"{graph.name}: no barrier")
        early += [e.name for e in exports
                  if not any(r.name in ancestors(e) for r in reduces)]
    return late, early, admitting


def key_vectors(model):
    return model.get_layer("dyn")(tf.constant(KEYS), training=False).numpy()


def data(num_workers):
    rng = np.random.RandomState(0)
    # Zipf-like over KEYS: a few keys are hot, some appear once (not admitted).
    p = 1.0 / np.arange(1, len(KEYS) + 1) ** 1.1
    ids = KEYS[rng.choice(len(KEYS), size=(STEPS * num_workers * BATCH, FEATURES), p=p / p.sum())]
    y = rng.normal(size=(len(ids), 1)).astype("float32")
    return ids, y


def train(strategy, num_workers):
    ids, y = data(num_workers)
    with strategy.scope():
        model = make_model()
    init = dense_weights(model)
    hist = model.fit(tf.data.Dataset.from_tensor_slices((ids, y)).batch(BATCH), epochs=1,
                     steps_per_epoch=STEPS, verbose=0)
    ref = make_model()
    ref(tf.constant(ids[:1]))
    dense = [l for l in ref.layers if isinstance(l, tf.keras.layers.Dense)]
    dense[0].set_weights(init[:2])
    dense[1].set_weights(init[2:])
    ref_hist = ref.fit(tf.data.Dataset.from_tensor_slices((ids, y)).batch(BATCH * num_workers),
                       epochs=1, steps_per_epoch=STEPS, verbose=0)
    got, want = key_vectors(model), key_vectors(ref)
    late, early, admitting = admission_order(model) if MODE == "sync" else ([], [], 0)
    dyn, ref_dyn = model.get_layer("dyn"), ref.get_layer("dyn")
    tf.train.Checkpoint(model=model).write(CKPT)
    return {
        "key_vector_diff": float(np.abs(got - want).max()),
        "dense_diff": max(float(np.abs(a - b).max())
                          for a, b in zip(dense_weights(model), dense_weights(ref))),
        "loss": hist.history["loss"][0], "ref_loss": ref_hist.history["loss"][0],
        "size": dyn.table_size(), "ref_size": ref_dyn.table_size(),
        "stats": dyn.table_stats(), "ref_stats": ref_dyn.table_stats(),
        "num_shards": dyn.num_shards,
        "problems": dyn.check_consistency(),
        "admission_after_barrier": late, "admission_before_all_reduce": early,
        "admitting_graphs": admitting, "capacity": CAPACITY,
        "shard_devices": [v.device for v in dyn.embeddings.variables],
        "admitted_keys": int((np.abs(got).sum(axis=1) > 0).sum()),
        "vectors": got.tolist(),
    }


def restore(strategy):
    with strategy.scope():
        model = make_model()
        model(tf.constant(KEYS[:FEATURES][None]))
    tf.train.Checkpoint(model=model).read(CKPT).expect_partial()
    single = make_model()
    single(tf.constant(KEYS[:FEATURES][None]))
    tf.train.Checkpoint(model=single).read(CKPT).expect_partial()
    # One more training step under the new layout: admission and eviction
    # work on restored maps whose rows may live on another PS now.
    ids, y = data(1)
    dyn = model.get_layer("dyn")
    report = {"vectors": key_vectors(model).tolist(), "size": dyn.table_size(),
              "num_shards": dyn.num_shards, "problems": dyn.check_consistency(),
              "single_vectors": key_vectors(single).tolist(),
              "single_size": single.get_layer("dyn").table_size()}
    model.fit(tf.data.Dataset.from_tensor_slices((ids, y)).batch(BATCH), epochs=1,
              steps_per_epoch=2, verbose=0)
    report["size_after_training"] = dyn.table_size()
    report["problems_after_training"] = dyn.check_consistency()
    return report


def main():
    config = tf_psplugin.start_server()
    num_workers = config.num_workers
    strategy = tf_psplugin.HybridParameterServerStrategy(
        options=tf_psplugin.HybridOptions(embedding_updates=MODE))
    report = train(strategy, num_workers) if PHASE == "train" else restore(strategy)
    with open(OUT, "w") as f:
        json.dump(report, f)
    print("RESULT ok")


if __name__ == "__main__":
    main()
