"""CTR training with tf_psplugin: the product's main job, end to end.

A DLRM-style click-through-rate model (keras_examples/_ctr_model.py) trained
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

Lines tagged `# tf_psplugin:` are what differs from single-machine Keras.
"""

import os
import sys
import time

from absl import app, flags

import tensorflow as tf

import tf_psplugin  # tf_psplugin: raises a clear ImportError under Keras 3.
import tf_psplugin.checkpoint  # tf_psplugin: chief checkpointing.
import tf_psplugin.evaluator  # tf_psplugin: the evaluator sidecar.
import tf_psplugin.export  # tf_psplugin: cluster-free SavedModel export.
import tf_psplugin.model_dir  # tf_psplugin: model_dir paths.
from tf_psplugin import config as tfp_config
from tf_psplugin.data import SyntheticCTR, criteo_tsv_dataset

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _ctr_model import build_ctr_model, compile_ctr_model  # noqa: E402

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
flags.DEFINE_integer("save_every_steps", 250, "Checkpoint every N steps (0: only at the end).")
flags.DEFINE_float("save_every_secs", 0, "Also checkpoint every S seconds (0: off).")
flags.DEFINE_integer("keep_checkpoints", 5, "Checkpoints kept in --model_dir.")
flags.DEFINE_integer("log_every_steps", 50, "Training curves: one point every N steps.")
flags.DEFINE_integer("eval_steps", 20, "Evaluator: batches per evaluation.")
flags.DEFINE_integer("eval_batch_size", 1024, "Evaluator: examples per batch.")
flags.DEFINE_float("eval_idle_timeout_secs", 900, "Evaluator: exit after this long "
                   "without a new checkpoint (it exits at once after the final one).")
flags.DEFINE_string("export_dir", None, "If set, the chief exports a cluster-free "
                    "SavedModel there after training.")
tfp_config.define_flags(FLAGS)  # tf_psplugin: --job_name --task_index --*_hosts.

EVAL_OFFSET_BATCHES = 1 << 40  # Evaluation examples come from far beyond any training data.


def model_fn():
    """The CTR model, uncompiled; same call on the chief and the evaluator."""
    return build_ctr_model(vocab_size=FLAGS.vocab_size, embedding_dim=FLAGS.embedding_dim,
                           seed=FLAGS.seed)


def generator():
    return SyntheticCTR(vocab_size=FLAGS.vocab_size, seed=FLAGS.seed)


def train_dataset(offset_batches):
    """Training batches (per worker), starting after `offset_batches` consumed ones."""
    if FLAGS.data == "synthetic":
        return generator().dataset(FLAGS.batch_size, offset_batches=offset_batches)
    return criteo_tsv_dataset(FLAGS.data, FLAGS.batch_size, vocab_size=FLAGS.vocab_size,
                              repeat=True).skip(offset_batches)


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
        return compile_ctr_model(model_fn())

    records = tf_psplugin.evaluator.run_evaluator(  # tf_psplugin: watch --model_dir.
        compiled_model, eval_dataset, FLAGS.model_dir, eval_steps=FLAGS.eval_steps,
        idle_timeout_secs=FLAGS.eval_idle_timeout_secs)
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
    model_dir = tf_psplugin.model_dir.resolve(FLAGS.model_dir)  # tf_psplugin: absolute path.
    # tf_psplugin: where a restarted chief resumes: step and input position.
    latest = tf_psplugin.checkpoint.latest_checkpoint(model_dir)
    start_step = latest.step if latest else 0
    offset = (latest.input_position or 0) if latest else 0
    if latest:
        print(f"ctr: resuming from {latest.path} (step {start_step}, input batch {offset})")

    strategy = tf_psplugin.HybridParameterServerStrategy(  # tf_psplugin: chief = coordinator.
        embedding_updates=FLAGS.embedding_updates, sharding=FLAGS.sharding)
    with strategy.scope():  # tf_psplugin: tables go to the PS tasks, the rest to every worker.
        # tf_psplugin: compile_ctr_model uses Keras 2's *legacy* Adagrad: PSS supports
        # the legacy optimizers (their slots live next to each table shard / replica).
        model = compile_ctr_model(model_fn(), learning_rate=FLAGS.learning_rate,
                                  steps_per_execution=FLAGS.steps_per_execution)
    # tf_psplugin: chief-only checkpoints; restores at train begin, final one at train_steps.
    checkpoints = tf_psplugin.checkpoint.ChiefCheckpoint(
        model_dir, save_every_steps=FLAGS.save_every_steps or None,
        save_every_secs=FLAGS.save_every_secs, max_to_keep=FLAGS.keep_checkpoints,
        final_step=FLAGS.train_steps)
    remaining = FLAGS.train_steps - start_step
    workers = config.num_workers
    examples_per_step = FLAGS.batch_size * workers  # tf_psplugin: one batch per worker per step.
    if remaining <= 0:
        print(f"ctr: already trained to step {start_step} >= --train_steps; nothing to do")
        manager = tf_psplugin.checkpoint.CheckpointManager(
            model_dir, model=model, optimizer=model.optimizer)
        manager.save(manager.restore_or_initialize().step, final=True)
        return
    print(f"ctr: training steps {start_step}..{FLAGS.train_steps} on {workers} worker(s) x "
          f"{FLAGS.batch_size} examples, {config.num_ps} PS task(s)")
    throughput = Throughput(examples_per_step)
    # tf_psplugin: training curves in <model_dir>/train, beside the evaluator's eval/.
    curves = tf_psplugin.TrainingSummaries(model_dir, every_n_steps=FLAGS.log_every_steps,
                                           examples_per_step=examples_per_step)
    # tf_psplugin: the default verbose="auto" shows the plugin's progress bar (lines when
    # stdout is not a terminal, e.g. under the launcher).
    history = model.fit(train_dataset(offset), epochs=1, steps_per_epoch=remaining,
                        callbacks=[checkpoints, throughput, curves])
    ceiling = generator().expected_auc(num_examples=50_000) if FLAGS.data == "synthetic" else None
    print(f"ctr: final step {int(model.optimizer.iterations.numpy())}  "
          f"loss {history.history['loss'][-1]:.4f}  auc {history.history['auc'][-1]:.4f}  "
          f"{throughput.examples_per_sec():,.0f} examples/s"
          + (f"  (expected AUC ceiling {ceiling:.4f})" if ceiling else ""), flush=True)
    print(f"ctr: checkpoint {checkpoints.manager.latest.path}", flush=True)
    print(f"ctr: curves: tensorboard --logdir {model_dir} (train/ and eval/)", flush=True)
    if FLAGS.export_dir:
        path = tf_psplugin.export.export_saved_model(  # tf_psplugin: full tables, no cluster.
            model, FLAGS.export_dir, model_fn=model_fn, overwrite=True)
        print(f"ctr: exported SavedModel to {path}", flush=True)


def main(argv):
    del argv
    config = tf_psplugin.start_server()  # tf_psplugin: ps/worker tasks serve here, never return.
    if not FLAGS.model_dir:
        raise app.UsageError("--model_dir is required (a directory shared by every task).")
    if config.task_type == "evaluator":  # tf_psplugin: never joins the training cluster.
        run_evaluator()
    else:
        train(config)


if __name__ == "__main__":
    app.run(main)
