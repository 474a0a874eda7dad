"""Chief script: a DynamicEmbedding on a Zipf stream over 2^40 raw ids vs a collision-free table.

Run by tests/cluster/test_dynamic_embedding.py under a LocalCluster (2
workers, 2 PS). Writes a JSON report to argv[1].

Data: FEATURES categorical features per example; each feature's id has a
Zipf-distributed frequency rank (numpy's zipf, a = ZIPF_A, unbounded) and is
scattered over [0, 2^40) by an odd multiplier, so the stream keeps bringing
ids never seen before, as production id streams do. The label is
Bernoulli(sigmoid(bias + sum_f w(f, rank))) with hidden weights that shrink
with rank (frequent ids matter, the long tail is mostly noise).

Models (same head, same optimizer, same global batches):
* dynamic: `layers.DynamicEmbedding(capacity=CAPACITY, admit_after=2,
  eviction="lru")` on the raw ids, trained under the strategy (sync);
* reference: a fixed-vocabulary `Embedding` with one row per distinct id
  of the whole data set (a perfect dictionary: no collisions at all),
  trained in this process on the same global batches.
Both are evaluated on held-out examples (AUC).
"""

import json
import sys

import numpy as np
import tensorflow as tf

import tf_psplugin
from tf_psplugin import layers

OUT = sys.argv[1]
FEATURES, DIM, PER_WORKER_BATCH, STEPS, HELDOUT = 4, 8, 128, 300, 8192
CAPACITY, ZIPF_A, ID_BITS = 2048, 1.15, 40


def generate(num_examples, seed):
    rng = np.random.RandomState(seed)
    ranks = np.minimum(rng.zipf(ZIPF_A, size=(num_examples, FEATURES)), 2**ID_BITS - 1)
    feature = np.arange(FEATURES)[None, :]
    ids = ((ranks * FEATURES + feature) * 0x9E3779B1) % (2**ID_BITS)
    # Hidden weights: a hashed normal per (feature, rank), shrinking with rank.
    z = np.sin(ranks * 12.9898 + feature * 78.233) * 43758.5453
    z = (z - np.floor(z)) * 2 - 1  # deterministic pseudo-random in [-1, 1)
    w = 2.5 * z / np.sqrt(1.0 + ranks / 30.0)
    logit = w.sum(axis=1) - 1.0
    y = (rng.uniform(size=num_examples) < 1 / (1 + np.exp(-logit))).astype(np.float32)
    return ids.astype(np.int64), y[:, None]


def head(x):
    x = tf.keras.layers.Flatten()(x)
    x = tf.keras.layers.Dense(16, activation="relu",
                              kernel_initializer=tf.keras.initializers.GlorotUniform(seed=1))(x)
    return tf.keras.layers.Dense(1, kernel_initializer=tf.keras.initializers.GlorotUniform(seed=2))(x)


def compile_model(model):
    model.compile(tf.keras.optimizers.legacy.Adagrad(0.2),
                  tf.keras.losses.BinaryCrossentropy(from_logits=True),
                  metrics=[tf.keras.metrics.AUC(from_logits=True, name="auc")])
    return model


def main():
    config = tf_psplugin.start_server()
    workers = config.num_workers
    global_batch = PER_WORKER_BATCH * workers
    ids, y = generate(STEPS * global_batch, seed=0)
    test_ids, test_y = generate(HELDOUT, seed=1)

    strategy = tf_psplugin.HybridParameterServerStrategy()
    with strategy.scope():
        inp = tf.keras.Input((FEATURES,), dtype=tf.int64)
        dyn = layers.DynamicEmbedding(DIM, capacity=CAPACITY, admit_after=2, eviction="lru",
                                      name="dyn")
        model = compile_model(tf.keras.Model(inp, head(dyn(inp))))
    model.fit(tf.data.Dataset.from_tensor_slices((ids, y)).batch(PER_WORKER_BATCH), epochs=1,
              steps_per_epoch=STEPS, verbose=0)
    dyn_auc = model.evaluate(tf.data.Dataset.from_tensor_slices((test_ids, test_y))
                             .batch(PER_WORKER_BATCH), verbose=0, return_dict=True)["auc"]

    # The reference: one row per distinct id of all the data, no collisions.
    vocab, index = np.unique(np.concatenate([ids.ravel(), test_ids.ravel()]), return_inverse=True)
    train_idx = index[:ids.size].reshape(ids.shape)
    test_idx = index[ids.size:].reshape(test_ids.shape)
    inp = tf.keras.Input((FEATURES,), dtype=tf.int64)
    emb = tf.keras.layers.Embedding(
        len(vocab), DIM, embeddings_initializer=tf.keras.initializers.RandomUniform(
            -0.05, 0.05, seed=3))(inp)
    ref = compile_model(tf.keras.Model(inp, head(emb)))
    ref.fit(train_idx, y, batch_size=global_batch, epochs=1, shuffle=False, verbose=0)
    ref_auc = ref.evaluate(test_idx, test_y, batch_size=global_batch, verbose=0,
                           return_dict=True)["auc"]

    report = {
        "distinct_ids": int(len(vocab)), "capacity": CAPACITY,
        "max_id": int(ids.max()), "min_id": int(ids.min()),
        "size": dyn.table_size(), "stats": dyn.table_stats(),
        "problems": dyn.check_consistency(),
        "dynamic_auc": float(dyn_auc), "reference_auc": float(ref_auc),
    }
    with open(OUT, "w") as f:
        json.dump(report, f)
    print("RESULT", json.dumps({k: v for k, v in report.items() if k != "stats"}))


if __name__ == "__main__":
    main()
