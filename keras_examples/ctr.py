"""CTR training with tf_psplugin: the product's main job, end to end.

A DLRM-style click-through-rate model (`build_ctr_model` below) trained
with `HybridParameterServerStrategy`: the fused embedding table (26 features
x vocab_size rows) is sharded over the PS tasks, the MLPs are replicated on
every worker and trained synchronously with all-reduce. The chief
checkpoints to --model_dir (restoring from it when restarted, including the
input position), ends with a checkpoint at --train_steps, and prints the
final loss, AUC, throughput and the best AUC the data allows. The evaluator
task, if any, evaluates every checkpoint without joining the cluster.

Local cluster (what `make demo` runs):

    python -m tf_psplugin.launch --workers 2 --ps 2 --evaluator -- \\
        python keras_examples/ctr.py --model_dir /tmp/ctr --train_steps 1500

By hand, one process per task (same command everywhere; roles from flags or
TF_CONFIG; the first worker is the chief when no chief is given):

    python keras_examples/ctr.py --model_dir /shared/ctr --job_name=ps --task_index=0 \\
        --worker_hosts=h1:2222,h2:2222,h3:2222 --ps_hosts=h4:2222,h5:2222

Lines tagged `# tf_psplugin:` are what differs from single-machine Keras. The
script uses only tf_psplugin's public API and is self-contained: copy it.
"""

import time
from typing import Optional, Sequence

from absl import app, flags

import tensorflow as tf

import tf_psplugin  # tf_psplugin: raises a clear ImportError under Keras 3.
from tf_psplugin import config as tfp_config  # tf_psplugin: --job_name, --*_hosts flags.
from tf_psplugin.data import SyntheticCTR, criteo_tsv_dataset

FLAGS = flags.FLAGS
flags.DEFINE_string("model_dir", None, "Checkpoints, eval results, TRAINING_DONE. Must be "
                    "shared by the chief, the PS tasks and the evaluator.")
flags.DEFINE_integer("train_steps", 1500, "Total training steps (global batches).")
flags.DEFINE_integer("batch_size", 256, "Examples per worker per step.")
flags.DEFINE_integer("vocab_size", 10_000, "Ids per categorical feature.")
flags.DEFINE_integer("embedding_dim", 16, "Embedding width.")
flags.DEFINE_integer("steps_per_execution", 10, "Steps per tf.function call.")
flags.DEFINE_enum("embedding_updates", "sync", ["sync", "async"],
                  "sync: exact global-batch SGD; async: each worker pushes its own gradient.")
flags.DEFINE_enum("sharding", "interleaved", ["interleaved", "contiguous"],
                  "How table rows are spread over the PS tasks.")
flags.DEFINE_string("data", "synthetic", "'synthetic' or a glob of Criteo TSV files.")
flags.DEFINE_float("learning_rate", 0.3, "Adagrad learning rate (1500 steps of 2 x 256 "
                   "examples, vocab 10k: held-out AUC 0.778 vs a ceiling of 0.791).")
flags.DEFINE_integer("seed", 0, "Data and initialisation seed.")
flags.DEFINE_enum("table_dtype", "float32", ["float32", "bfloat16", "float16"],
                  "Store the embedding table on the PS in this dtype (HybridOptions.table_dtype; "
                  "half precision needs --optimizer=adagrad).")
flags.DEFINE_enum("optimizer", "legacy_adagrad", ["legacy_adagrad", "adagrad"],
                  "legacy_adagrad: tf.keras.optimizers.legacy.Adagrad; adagrad: Keras's new "
                  "Adagrad (float32 slots beside a half-precision table).")
flags.DEFINE_integer("save_every_steps", 250, "Checkpoint every N steps (0: only at the end).")
flags.DEFINE_float("save_every_seconds", 0, "Also checkpoint every S seconds (0: off).")
flags.DEFINE_integer("keep_checkpoints", 5, "Checkpoints kept in --model_dir.")
flags.DEFINE_integer("log_every_steps", 50, "Training curves: one point every N steps.")
flags.DEFINE_integer("eval_steps", 20, "Evaluator: batches per evaluation.")
flags.DEFINE_integer("eval_batch_size", 1024, "Evaluator: examples per batch.")
flags.DEFINE_float("eval_idle_timeout_seconds", 900, "Evaluator: exit after this long "
                   "without a new checkpoint (it exits at once after the final one).")
flags.DEFINE_float("wait_for_evaluator_seconds", 0, "Chief: when the cluster has an evaluator, "
                   "wait up to this long for it to score the final checkpoint before exiting "
                   "(a TFJob with cleanPodPolicy: Running stops the evaluator once the chief "
                   "exits). 0: do not wait.")
flags.DEFINE_string("export_dir", None, "If set, the chief exports a cluster-free "
                    "SavedModel there after training.")
tfp_config.define_flags(FLAGS)  # tf_psplugin: --job_name --task_index --*_hosts.

EVAL_OFFSET_BATCHES = 1 << 40  # Evaluation examples come from far beyond any training data.


# -- The model ---------------------------------------------------------------
# DLRM-style (Naumov et al. 2019). The chief builds it inside
# `strategy.scope()`; the evaluator and the export build the same one with no
# strategy and load the chief's checkpoints into it, so one builder is used
# everywhere (same layers, order and variable names).
#
# * ONE fused embedding table of `num_categorical * vocab_size` rows: feature
#   f with id i uses row f * vocab_size + i. One lookup and one sparse
#   gradient per step instead of 26: one gather per PS shard per step
#   (measured on 2 workers, 2 PS, 2 cores, vocab 10k x 26, dim 16, 256
#   examples per worker: 7.6-8.3k examples/s fused vs 3.0-3.2k with 26
#   `Embedding` layers, `fused=False`). A Keras `Embedding`, so the strategy
#   shards it over the PS tasks.
# * a bottom MLP mapping the dense features to one more `embedding_dim`
#   vector, pairwise dot products of the 27 vectors, and a top MLP giving one
#   logit (trained with `from_logits=True`).

NUM_CATEGORICAL = 26
NUM_DENSE = 13


@tf.keras.utils.register_keras_serializable(package="tf_psplugin_examples")
class FeatureOffsets(tf.keras.layers.Layer):
    """Maps per-feature ids ``[B, F]`` to rows of a fused table: ``id + f * vocab_size``.

    Ids outside ``[0, vocab_size)`` are clipped into it, so a bad id never
    reads another feature's rows.
    """

    def __init__(self, vocab_size: int, **kwargs):
        super().__init__(**kwargs)
        self.vocab_size = int(vocab_size)

    def call(self, ids):
        ids = tf.clip_by_value(tf.cast(ids, tf.int64), 0, self.vocab_size - 1)
        offsets = tf.range(tf.shape(ids)[-1], dtype=tf.int64) * self.vocab_size
        return ids + offsets

    def get_config(self):
        return {**super().get_config(), "vocab_size": self.vocab_size}


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


def build_ctr_model(vocab_size: int = 1000, embedding_dim: int = 16,
                    num_categorical: int = NUM_CATEGORICAL, num_dense: int = NUM_DENSE,
                    bottom_mlp: Sequence[int] = (64,), top_mlp: Sequence[int] = (128, 64),
                    fused: bool = True, seed: int = 0) -> tf.keras.Model:
    """Builds the (uncompiled) DLRM-style CTR model.

    Call it inside `strategy.scope()` on the chief for training, and outside
    any strategy (evaluator, export, tests) for a plain local copy: the two
    have the same variables in the same order.

    Args:
        vocab_size: Ids per categorical feature.
        embedding_dim: Width of every embedding and of the bottom MLP output.
        num_categorical: Categorical features (26 in Criteo).
        num_dense: Dense features (13 in Criteo).
        bottom_mlp: Hidden widths of the dense-feature MLP (its output layer
            has `embedding_dim` units).
        top_mlp: Hidden widths of the MLP after the interactions.
        fused: One table of `num_categorical * vocab_size` rows (default), or
            one `Embedding` layer per feature (for comparison).
        seed: Seed of every initializer (same seed, same initial weights).

    Returns:
        A functional `tf.keras.Model` taking ``{"dense": float32 [B,
        num_dense], "categorical": int64 [B, num_categorical]}`` and returning
        logits ``[B, 1]``.
    """
    counter = iter(range(1_000_000))

    def init():
        return tf.keras.initializers.GlorotUniform(seed=seed * 1000 + next(counter))

    dense_in = tf.keras.Input((num_dense,), dtype=tf.float32, name="dense")
    cat_in = tf.keras.Input((num_categorical,), dtype=tf.int64, name="categorical")
    if fused:
        rows = FeatureOffsets(vocab_size, name="feature_offsets")(cat_in)
        table = tf.keras.layers.Embedding(
            num_categorical * vocab_size, embedding_dim, name="embedding",
            embeddings_initializer=tf.keras.initializers.RandomUniform(
                -0.05, 0.05, seed=seed * 1000 + next(counter)))
        embedded = table(rows)  # [B, F, D]
    else:
        ids = FeatureOffsets(vocab_size, name="feature_offsets")(cat_in)
        columns = []
        for f in range(num_categorical):
            column = tf.keras.layers.Lambda(
                lambda x, f=f, v=vocab_size: x[:, f] - f * v, name=f"C{f + 1}_ids")(ids)
            columns.append(tf.keras.layers.Embedding(
                vocab_size, embedding_dim, name=f"embedding_C{f + 1}",
                embeddings_initializer=tf.keras.initializers.RandomUniform(
                    -0.05, 0.05, seed=seed * 1000 + next(counter)))(column))
        embedded = tf.keras.layers.Lambda(lambda xs: tf.stack(xs, axis=1),
                                          name="stack_embeddings")(columns)
    x = dense_in
    for i, width in enumerate(list(bottom_mlp) + [embedding_dim]):
        x = tf.keras.layers.Dense(width, activation="relu", kernel_initializer=init(),
                                  name=f"bottom_{i}")(x)
    bottom = tf.keras.layers.Reshape((1, embedding_dim), name="bottom_vector")(x)
    vectors = tf.keras.layers.Concatenate(axis=1, name="vectors")([bottom, embedded])
    interactions = DotInteraction(name="interactions")(vectors)
    x = tf.keras.layers.Concatenate(name="top_input")([x, interactions])
    for i, width in enumerate(top_mlp):
        x = tf.keras.layers.Dense(width, activation="relu", kernel_initializer=init(),
                                  name=f"top_{i}")(x)
    logits = tf.keras.layers.Dense(1, kernel_initializer=init(), name="logit")(x)
    return tf.keras.Model({"dense": dense_in, "categorical": cat_in}, logits, name="ctr_dlrm")


def compile_ctr_model(model: tf.keras.Model, learning_rate: float = 0.3,
                      steps_per_execution: int = 1,
                      optimizer: Optional[tf.keras.optimizers.Optimizer] = None) -> tf.keras.Model:
    """Compiles with Adagrad, binary cross-entropy on logits, and AUC.

    The optimizer is Keras 2's *legacy* Adagrad: ParameterServerStrategy (and
    so the hybrid strategy) supports the legacy optimizers, whose slots are
    created next to their variable -- on the PS shard for a table, on every
    worker for a dense replica; the Keras 2.11+ optimizers do not support
    sharded variables under PSS (keras-team/keras 18624).

    Args:
        model: From `build_ctr_model`.
        learning_rate: Adagrad learning rate.
        steps_per_execution: Steps per `tf.function` call (Keras knob).
        optimizer: Use this optimizer instead.

    Returns:
        `model`, compiled.
    """
    model.compile(
        optimizer=optimizer or tf.keras.optimizers.legacy.Adagrad(learning_rate),
        loss=tf.keras.losses.BinaryCrossentropy(from_logits=True),
        metrics=[tf.keras.metrics.AUC(name="auc", from_logits=True)],
        steps_per_execution=steps_per_execution)
    return model


# -- The job -----------------------------------------------------------------


def make_optimizer():
    """The --optimizer at --learning_rate."""
    if FLAGS.optimizer == "adagrad":
        return tf.keras.optimizers.Adagrad(FLAGS.learning_rate)
    return tf.keras.optimizers.legacy.Adagrad(FLAGS.learning_rate)


def model_fn():
    """The CTR model, uncompiled; same call on the chief and the evaluator."""
    return build_ctr_model(vocab_size=FLAGS.vocab_size, embedding_dim=FLAGS.embedding_dim,
                           seed=FLAGS.seed)


def generator():
    return SyntheticCTR(vocab_size=FLAGS.vocab_size, seed=FLAGS.seed)


def train_dataset():
    """Training batches (per worker), from the start of the data.

    A resumed job continues where each worker's input stood: the checkpoint
    holds it (`save_input_position` below), so the dataset needs no offset.
    """
    if FLAGS.data == "synthetic":
        return generator().dataset(FLAGS.batch_size)
    return criteo_tsv_dataset(FLAGS.data, FLAGS.batch_size, vocab_size=FLAGS.vocab_size,
                              repeat=True)


def eval_dataset():
    if FLAGS.data == "synthetic":
        return generator().dataset(FLAGS.eval_batch_size, num_batches=EVAL_OFFSET_BATCHES
                                   + FLAGS.eval_steps, offset_batches=EVAL_OFFSET_BATCHES)
    return criteo_tsv_dataset(FLAGS.data, FLAGS.eval_batch_size, vocab_size=FLAGS.vocab_size)


class Throughput(tf.keras.callbacks.Callback):
    """Examples/s from the first scheduled step (tracing done) to the end of fit.

    Reads no logs, so it never waits for a step.
    """

    def __init__(self, examples_per_step):
        super().__init__()
        self._supports_tf_logs = True  # tf_psplugin: allowed under PSS; logs are RemoteValues.
        self.examples_per_step = examples_per_step
        self.first = self.last = None  # (steps done, monotonic time)

    def on_train_batch_end(self, batch, logs=None):
        if self.first is None:
            self.first = (batch + 1, time.monotonic())
        self.last = batch + 1

    def on_train_end(self, logs=None):
        self.end = time.monotonic()

    def examples_per_sec(self):
        if self.first is None or self.last <= self.first[0]:
            return float("nan")
        return (self.last - self.first[0]) * self.examples_per_step / (self.end - self.first[1])


def run_evaluator():
    """The evaluator task: plain local TF, never connects to the training cluster."""

    def compiled_model():
        return compile_ctr_model(model_fn(), optimizer=make_optimizer())

    records = tf_psplugin.run_evaluator(  # tf_psplugin: watch --model_dir.
        compiled_model, eval_dataset, FLAGS.model_dir, eval_steps=FLAGS.eval_steps,
        idle_timeout_seconds=FLAGS.eval_idle_timeout_seconds)
    if not records:
        return
    final = records[-1]  # The evaluator logged every record as it went.
    line = (f"ctr evaluator: final step {final['step']}  held-out loss {final['loss']:.4f}  "
            f"AUC {final['auc']:.4f}")
    if FLAGS.data == "synthetic":
        ceiling = generator().expected_auc(num_examples=50_000)
        line += f"  ({ceiling - final['auc']:.4f} below the expected AUC ceiling {ceiling:.4f})"
    print(line, flush=True)


def train(config):
    model_dir = FLAGS.model_dir
    # tf_psplugin: where a restarted chief resumes.
    latest = tf_psplugin.latest_checkpoint_info(model_dir)
    start_step = latest.step if latest else 0
    if latest:
        print(f"ctr: resuming from {latest.path} (step {start_step})")

    strategy = tf_psplugin.HybridParameterServerStrategy(  # tf_psplugin: chief = coordinator.
        options=tf_psplugin.HybridOptions(
            embedding_updates=FLAGS.embedding_updates,
            # tf_psplugin: None keeps the table in the dtype its layer asks for (float32).
            table_dtype=None if FLAGS.table_dtype == "float32" else FLAGS.table_dtype),
        placement=tf_psplugin.PlacementPolicy(sharding=FLAGS.sharding))
    with strategy.scope():  # tf_psplugin: tables go to the PS tasks, the rest to every worker.
        # tf_psplugin: Keras 2's *legacy* Adagrad by default: PSS supports the legacy
        # optimizers (their slots live next to each table shard / replica); a table in
        # half precision (--table_dtype) needs Keras's new Adagrad (--optimizer=adagrad).
        model = compile_ctr_model(model_fn(), steps_per_execution=FLAGS.steps_per_execution,
                                  optimizer=make_optimizer())
    # tf_psplugin: chief-only checkpoints; restores at train begin, final one at train_steps.
    # Each also holds where every worker's input stands, and a restarted job continues
    # from there without reading its input again.
    checkpoints = tf_psplugin.ChiefCheckpoint(
        model_dir, save_every_steps=FLAGS.save_every_steps or None,
        save_every_seconds=FLAGS.save_every_seconds, max_to_keep=FLAGS.keep_checkpoints,
        final_step=FLAGS.train_steps, save_input_position=True)
    remaining = FLAGS.train_steps - start_step
    workers = config.num_workers
    examples_per_step = FLAGS.batch_size * workers  # tf_psplugin: one batch per worker per step.
    if remaining <= 0:
        print(f"ctr: already trained to step {start_step} >= --train_steps; nothing to do")
        manager = tf_psplugin.ChiefCheckpointManager(
            model_dir, model=model, optimizer=model.optimizer)
        manager.save(manager.restore_or_initialize().step, final=True)
        return
    print(f"ctr: training steps {start_step}..{FLAGS.train_steps} on {workers} worker(s) x "
          f"{FLAGS.batch_size} examples, {config.num_ps} PS task(s)")
    throughput = Throughput(examples_per_step)
    # tf_psplugin: training curves in <model_dir>/train, beside the evaluator's eval/.
    curves = tf_psplugin.TrainingSummaries(model_dir, write_every_steps=FLAGS.log_every_steps,
                                           examples_per_step=examples_per_step)
    # tf_psplugin: the default verbose="auto" shows the plugin's progress bar (lines when
    # stdout is not a terminal, e.g. under the launcher).
    history = model.fit(train_dataset(), epochs=1, steps_per_epoch=remaining,
                        callbacks=[checkpoints, throughput, curves])
    ceiling = generator().expected_auc(num_examples=50_000) if FLAGS.data == "synthetic" else None
    print(f"ctr: final step {int(model.optimizer.iterations.numpy())}  "
          f"loss {history.history['loss'][-1]:.4f}  auc {history.history['auc'][-1]:.4f}  "
          f"{throughput.examples_per_sec():,.0f} examples/s"
          + (f"  (expected AUC ceiling {ceiling:.4f})" if ceiling else ""), flush=True)
    print(f"ctr: checkpoint {checkpoints.manager.latest.path}", flush=True)
    print(f"ctr: curves: tensorboard --logdir {model_dir} (train/ and eval/)", flush=True)
    if FLAGS.wait_for_evaluator_seconds > 0 and config.has_evaluator:
        # tf_psplugin: keep the chief (and so the job) alive until the final score is in.
        record = tf_psplugin.wait_for_evaluation(
            model_dir, int(model.optimizer.iterations.numpy()),
            timeout_seconds=FLAGS.wait_for_evaluator_seconds)
        if record is not None:
            auc = record.get("auc")
            print(f"ctr: the evaluator scored step {record['step']}"
                  + (f": AUC {auc:.4f}" if isinstance(auc, float) else ""), flush=True)
    if FLAGS.export_dir:
        path = tf_psplugin.export_saved_model(  # tf_psplugin: full tables, no cluster.
            model, FLAGS.export_dir, model_fn=model_fn, overwrite=True)
        print(f"ctr: exported SavedModel to {path}", flush=True)


def main(argv):
    del argv
    if FLAGS.table_dtype != "float32" and FLAGS.optimizer == "legacy_adagrad":
        raise app.UsageError(f"--table_dtype={FLAGS.table_dtype} needs --optimizer=adagrad: a "
                             "legacy optimizer cannot update a half-precision table.")
    config = tf_psplugin.start_server()  # tf_psplugin: ps/worker tasks serve here, never return.
    if not FLAGS.model_dir:
        raise app.UsageError("--model_dir is required (a directory shared by every task).")
    if config.task_type == "evaluator":  # tf_psplugin: never joins the training cluster.
        run_evaluator()
    else:
        train(config)


if __name__ == "__main__":
    app.run(main)
