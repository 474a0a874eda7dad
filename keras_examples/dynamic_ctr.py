"""CTR training on raw ids: a `DynamicEmbedding` instead of a hashed vocabulary.

The DLRM-style model of keras_examples/ctr.py, but its 26 categorical
features are raw keys: no `vocab_size`, no hashing into a fixed table, no
collisions. One `tf_psplugin.layers.DynamicEmbedding` serves all 26 features
(each feature's keys are kept apart by a feature prefix or salt); a key gets
a row of its own once it has been seen `--admit_after` times, and a full
table evicts the least recently used rows. The table is sharded over the PS
tasks by key hash; training is synchronous and exact.

Data:
* ``--data synthetic`` (default): `tf_psplugin.data.SyntheticCTR`, its ids
  scattered over a 2^40 id space (int64 keys), as hashed production ids are;
* ``--data '/path/day_*'``: Criteo TSV files; the categorical columns are
  the raw 8-hex-digit strings, used as string keys ``"C<f>:<hex>"``.

Local cluster:

    python -m tf_psplugin.launch --workers 2 --ps 2 -- \\
        python keras_examples/dynamic_ctr.py --train_steps 300 --capacity 200000

Lines tagged `# tf_psplugin:` are what differs from single-machine Keras.
"""

import time

from absl import app, flags

import tensorflow as tf

import tf_psplugin  # tf_psplugin: raises a clear ImportError under Keras 3.
from tf_psplugin import config as tfp_config
from tf_psplugin.data import NUM_CATEGORICAL_FEATURES, NUM_INTEGER_FEATURES, SyntheticCTR

FLAGS = flags.FLAGS
flags.DEFINE_integer("train_steps", 300, "Training steps (global batches).")
flags.DEFINE_integer("batch_size", 256, "Examples per worker per step.")
flags.DEFINE_integer("capacity", 200_000, "Rows of the dynamic table, over all PS tasks.")
flags.DEFINE_integer("admit_after", 2, "Sightings a key needs before it gets a row.")
flags.DEFINE_enum("eviction", "lru", ["lru", "lfu", "none"], "What a full table does.")
flags.DEFINE_integer("embedding_dim", 16, "Embedding width.")
flags.DEFINE_integer("steps_per_execution", 10, "Steps per tf.function call.")
flags.DEFINE_float("learning_rate", 0.3, "Adagrad learning rate.")
flags.DEFINE_string("data", "synthetic", "'synthetic' or a glob of Criteo TSV files.")
flags.DEFINE_integer("synthetic_ids", 100_000, "Synthetic data: distinct ids per feature.")
flags.DEFINE_integer("eval_batches", 8, "Held-out batches (per worker) for the final AUC.")
flags.DEFINE_string("model_dir", None, "If set: chief checkpoints there (PS shards and the "
                    "key -> row maps included), restored when restarted.")
flags.DEFINE_string("export_dir", None, "If set: a cluster-free SavedModel serving raw keys.")
tfp_config.define_flags(FLAGS)  # tf_psplugin: --job_name --task_index --*_hosts.

EVAL_OFFSET_BATCHES = 1 << 40  # Held-out examples come from far beyond any training data.


@tf.keras.utils.register_keras_serializable(package="tf_psplugin_examples")
class DotInteraction(tf.keras.layers.Layer):
    """DLRM's feature interaction: dot products of every pair of ``[B, N, D]`` vectors.

    Returns ``[B, N * (N - 1) / 2]`` (the strict upper triangle of ``X X^T``).
    """

    def call(self, vectors):
        n = vectors.shape[1]
        gram = tf.linalg.matmul(vectors, vectors, transpose_b=True)  # [B, N, N]
        rows, cols = zip(*[(i, j) for i in range(n) for j in range(i + 1, n)])
        index = tf.constant([r * n + c for r, c in zip(rows, cols)], tf.int32)
        return tf.gather(tf.reshape(gram, [-1, n * n]), index, axis=1)


def criteo_raw_dataset(pattern, batch_size, repeat):
    """Criteo TSV lines -> ({"dense", "categorical": string keys "C<f>:<hex>"}, label)."""
    files = sorted(tf.io.gfile.glob(pattern))
    if not files:
        raise app.UsageError(f"--data {pattern!r} matched no file.")
    defaults = [[0.0]] * (1 + NUM_INTEGER_FEATURES) + [[""]] * NUM_CATEGORICAL_FEATURES
    prefixes = tf.constant([f"C{f + 1}:" for f in range(NUM_CATEGORICAL_FEATURES)])

    def decode(lines):
        cols = tf.io.decode_csv(lines, defaults, field_delim="\t", use_quote_delim=False)
        dense = tf.math.log1p(tf.maximum(tf.stack(cols[1:1 + NUM_INTEGER_FEATURES], 1), 0.0))
        keys = prefixes + tf.stack(cols[1 + NUM_INTEGER_FEATURES:], 1)  # raw, per feature
        return {"dense": dense, "categorical": keys}, cols[0][:, None]

    ds = tf.data.TextLineDataset(files)
    if repeat:
        ds = ds.repeat()
    return ds.batch(batch_size, drop_remainder=True).map(decode).prefetch(tf.data.AUTOTUNE)


def synthetic_raw_dataset(batch_size, offset_batches=0, num_batches=None):
    """SyntheticCTR with its ids scattered over [0, 2^40) per feature (int64 keys)."""
    gen = SyntheticCTR(vocab_size=FLAGS.synthetic_ids)
    ds = gen.dataset(batch_size, offset_batches=offset_batches, num_batches=num_batches)
    salt = tf.range(NUM_CATEGORICAL_FEATURES, dtype=tf.int64)

    def raw(features, label):
        ids = features["categorical"] * NUM_CATEGORICAL_FEATURES + salt
        keys = tf.math.floormod(ids * 0x9E3779B1, 2**40)  # an odd multiplier: no collisions
        return {"dense": features["dense"], "categorical": keys}, label

    return ds.map(raw)


def key_dtype():
    return tf.int64 if FLAGS.data == "synthetic" else tf.string


def build_model():
    """DLRM-style: one DynamicEmbedding for the 26 raw-key features, MLPs, dot interactions."""
    dim = FLAGS.embedding_dim
    dense_in = tf.keras.Input((NUM_INTEGER_FEATURES,), name="dense")
    keys_in = tf.keras.Input((NUM_CATEGORICAL_FEATURES,), dtype=key_dtype(), name="categorical")
    embedded = tf_psplugin.layers.DynamicEmbedding(  # tf_psplugin: raw keys, rows on the PS.
        dim, capacity=FLAGS.capacity, key_dtype=key_dtype(), admit_after=FLAGS.admit_after,
        eviction=None if FLAGS.eviction == "none" else FLAGS.eviction,
        name="dynamic_embedding")(keys_in)  # [B, 26, dim]
    x = tf.keras.layers.Dense(64, activation="relu", name="bottom_0")(dense_in)
    x = tf.keras.layers.Dense(dim, activation="relu", name="bottom_1")(x)
    bottom = tf.keras.layers.Reshape((1, dim), name="bottom_vector")(x)
    vectors = tf.keras.layers.Concatenate(axis=1, name="vectors")([bottom, embedded])
    x = tf.keras.layers.Concatenate(name="top_input")(
        [x, DotInteraction(name="interactions")(vectors)])
    for i, width in enumerate((128, 64)):
        x = tf.keras.layers.Dense(width, activation="relu", name=f"top_{i}")(x)
    logits = tf.keras.layers.Dense(1, name="logit")(x)
    return tf.keras.Model({"dense": dense_in, "categorical": keys_in}, logits,
                          name="dynamic_ctr")


def main(argv):
    del argv
    config = tf_psplugin.start_server()  # tf_psplugin: ps/worker tasks serve here, never return.
    if config.task_type == "evaluator":
        raise app.UsageError("dynamic_ctr.py has no evaluator task; run it without one.")
    strategy = tf_psplugin.HybridParameterServerStrategy()  # tf_psplugin: chief = coordinator.
    with strategy.scope():  # tf_psplugin: the table and its key maps go to the PS tasks.
        model = build_model()
        model.compile(tf.keras.optimizers.legacy.Adagrad(FLAGS.learning_rate),
                      tf.keras.losses.BinaryCrossentropy(from_logits=True),
                      metrics=[tf.keras.metrics.AUC(from_logits=True, name="auc")],
                      steps_per_execution=FLAGS.steps_per_execution)
    callbacks = []
    if FLAGS.model_dir:  # tf_psplugin: chief-only checkpoints, restored at train begin.
        callbacks.append(tf_psplugin.ChiefCheckpoint(
            FLAGS.model_dir, save_every_steps=100, final_step=FLAGS.train_steps))
    if FLAGS.data == "synthetic":
        train = synthetic_raw_dataset(FLAGS.batch_size)
        heldout = synthetic_raw_dataset(FLAGS.batch_size, offset_batches=EVAL_OFFSET_BATCHES,
                                        num_batches=EVAL_OFFSET_BATCHES + FLAGS.eval_batches)
    else:
        train = criteo_raw_dataset(FLAGS.data, FLAGS.batch_size, repeat=True)
        heldout = criteo_raw_dataset(FLAGS.data, FLAGS.batch_size, repeat=False).take(
            FLAGS.eval_batches)
    print(f"dynamic_ctr: {FLAGS.train_steps} steps on {config.num_workers} worker(s) x "
          f"{FLAGS.batch_size} examples, {config.num_ps} PS task(s), capacity {FLAGS.capacity}",
          flush=True)
    start = time.monotonic()
    model.fit(train, epochs=1, steps_per_epoch=FLAGS.train_steps, callbacks=callbacks,
              verbose=2)
    seconds = time.monotonic() - start
    result = model.evaluate(heldout, verbose=0, return_dict=True)
    layer = model.get_layer("dynamic_embedding")
    stats = layer.table_stats()
    print(f"dynamic_ctr: held-out loss {result['loss']:.4f}  AUC {result['auc']:.4f}  "
          f"{FLAGS.train_steps * FLAGS.batch_size * config.num_workers / seconds:,.0f} "
          "examples/s (tracing included)", flush=True)
    print(f"dynamic_ctr: table rows {layer.table_size()} of {FLAGS.capacity}; admitted "
          f"{sum(s['admitted'] for s in stats)}, evicted {sum(s['evicted'] for s in stats)}, "
          f"rejected {sum(s['rejected'] for s in stats)}; per PS: "
          + ", ".join(f"{s['device'].split('/device')[0]} {s['size']}" for s in stats),
          flush=True)
    if FLAGS.export_dir:
        path = tf_psplugin.export_saved_model(  # tf_psplugin: serves raw keys, no cluster.
            model, FLAGS.export_dir, model_fn=build_model, overwrite=True)
        print(f"dynamic_ctr: exported SavedModel to {path}", flush=True)


if __name__ == "__main__":
    app.run(main)
