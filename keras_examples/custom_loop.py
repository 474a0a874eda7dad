"""A custom training loop with the strategy and its coordinator.

What `model.fit` does for you, written out: the chief builds the model and a
legacy Keras optimizer in `strategy.scope()`, makes a per-worker dataset, and
schedules a `tf.function` training step through the coordinator. In
synchronous mode (the default) `coordinator.schedule` runs the step on EVERY
worker at once, each on its own shard of the data; the dense gradients are
all-reduced among the workers inside `optimizer.apply_gradients`, and the
returned RemoteValue holds worker 0's outputs (the loss below is reduced
across workers, so it describes the global batch). Only the lines tagged
`# tf_psplugin:` differ from a stock ParameterServerStrategy loop.

Run it on a local cluster (chief + 2 workers + 1 PS):

    python -m tf_psplugin.launch --workers 2 --ps 1 -- \
        python keras_examples/custom_loop.py --steps 40

or by hand, one process per task with the same flags (the first worker is
the chief when no --chief_hosts is given):

    python keras_examples/custom_loop.py --job_name=ps --task_index=0 \
        --worker_hosts=localhost:2220,localhost:2221,localhost:2222 \
        --ps_hosts=localhost:2230

or with TF_CONFIG set and no cluster flags. See keras_examples/README.md.
"""

import sys
import time

import numpy as np
import tensorflow as tf
from absl import app, flags

import tf_psplugin  # tf_psplugin: raises a clear ImportError under Keras 3.
import tf_psplugin.config

FLAGS = flags.FLAGS
flags.DEFINE_integer("steps", 40, "Synchronous training steps (each runs on every worker).")
flags.DEFINE_integer("batch_size", 64, "Examples per worker and step.")
flags.DEFINE_integer("vocab_size", 5000, "Rows of the embedding table.")
flags.DEFINE_integer("embedding_dim", 8, "Embedding width.")
flags.DEFINE_float("learning_rate", 0.2, "Adagrad learning rate.")
flags.DEFINE_integer("log_every", 10, "Print progress every this many steps.")
tf_psplugin.config.define_flags(FLAGS)  # tf_psplugin: --job_name --task_index --*_hosts

_IDS_PER_EXAMPLE = 4


def dataset_fn(input_context: tf.distribute.InputContext) -> tf.data.Dataset:
    """An endless stream of (ids, label); the label is learnable from the ids.

    Each worker reads its own shard: `input_context.input_pipeline_id` is the
    index of the worker that builds the dataset.
    """
    rng = np.random.default_rng(0)
    ids = rng.integers(0, FLAGS.vocab_size, size=(16_384, _IDS_PER_EXAMPLE))
    labels = (ids % 3 == 0).any(axis=1, keepdims=True).astype("float32")
    ds = tf.data.Dataset.from_tensor_slices((ids, labels))
    # tf_psplugin: one input pipeline per worker.
    ds = ds.shard(input_context.num_input_pipelines, input_context.input_pipeline_id)
    return ds.repeat().batch(FLAGS.batch_size, drop_remainder=True).prefetch(2)


def build_model() -> tf.keras.Model:
    return tf.keras.Sequential([
        tf.keras.layers.Embedding(FLAGS.vocab_size, FLAGS.embedding_dim),  # Table: on the PS.
        tf.keras.layers.GlobalAveragePooling1D(),
        tf.keras.layers.Dense(16, activation="relu"),  # Dense: replicated on the workers.
        tf.keras.layers.Dense(1),
    ])


def main(argv):
    del argv
    try:
        config = tf_psplugin.resolve_cluster(flag_values=FLAGS)  # tf_psplugin: flags or TF_CONFIG
    except tf_psplugin.ConfigError as e:
        sys.exit(f"custom_loop: error: {e}")
    tf_psplugin.start_server(config)  # tf_psplugin: ps/worker tasks serve here, never return.

    strategy = tf_psplugin.HybridParameterServerStrategy(config=config)  # tf_psplugin
    # tf_psplugin: returns the strategy's own coordinator (synchronous dispatch).
    coordinator = tf.distribute.experimental.coordinator.ClusterCoordinator(strategy)
    num_workers = strategy.num_replicas_in_sync  # One replica per worker.
    global_batch_size = FLAGS.batch_size * num_workers

    with strategy.scope():
        model = build_model()
        # tf_psplugin: a Keras 2 legacy optimizer (the strategy supports these).
        optimizer = tf.keras.optimizers.legacy.Adagrad(FLAGS.learning_rate)

    @tf.function
    def per_worker_dataset_fn():
        return strategy.distribute_datasets_from_function(dataset_fn)

    per_worker_dataset = coordinator.create_per_worker_dataset(per_worker_dataset_fn)
    per_worker_iterator = iter(per_worker_dataset)

    @tf.function
    def train_step(iterator):
        def replica_fn(ids, labels):
            with tf.GradientTape() as tape:
                logits = model(ids, training=True)
                per_example = tf.keras.losses.binary_crossentropy(labels, logits, from_logits=True)
                loss = tf.nn.compute_average_loss(per_example, global_batch_size=global_batch_size)
            grads = tape.gradient(loss, model.trainable_variables)
            # tf_psplugin: dense gradients are all-reduced across workers here.
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            correct = tf.reduce_sum(tf.cast(tf.equal(labels > 0.5, logits > 0.0), tf.float32))
            return loss, correct

        ids, labels = next(iterator)
        loss, correct = strategy.run(replica_fn, args=(ids, labels))
        # Summed over the workers: the global batch's mean loss and hit count.
        return (strategy.reduce(tf.distribute.ReduceOp.SUM, loss, axis=None),
                strategy.reduce(tf.distribute.ReduceOp.SUM, correct, axis=None))

    start = time.time()
    for step in range(1, FLAGS.steps + 1):
        # tf_psplugin: runs on every worker; the RemoteValue is worker 0's output.
        result = coordinator.schedule(train_step, args=(per_worker_iterator,))
        if step % FLAGS.log_every == 0 or step == FLAGS.steps:
            loss, correct = result.fetch()  # Waits for this step only.
            print(f"custom_loop: step {step}/{FLAGS.steps} loss {loss:.4f} "
                  f"accuracy {correct / global_batch_size:.3f} "
                  f"({step / (time.time() - start):.1f} steps/s, {num_workers} workers)",
                  flush=True)
    coordinator.join()
    print(f"custom_loop: done, {FLAGS.steps} steps, optimizer iterations "
          f"{int(optimizer.iterations.numpy())}", flush=True)


if __name__ == "__main__":
    app.run(main)
