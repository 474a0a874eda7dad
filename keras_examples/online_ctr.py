"""Online CTR training: an endless stream, incremental checkpoints, a serving model kept fresh.

A CTR model trained continuously on an endless generated stream
(`tf_psplugin.data.SyntheticCTR`; Keras needs `--steps_per_epoch` for
endless data, and an "epoch" is just a reporting period). The chief saves
every `--save_every_steps` with incremental checkpoints: every
`--full_every_saves`-th save is a full checkpoint, the saves between are deltas
holding only the table rows updated since the previous save. Beside
training:

* the evaluator task (launcher `--evaluator`) scores the checkpoints,
  deltas included, without joining the cluster;
* with `--serve`, the chief starts a serving process (no cluster): it
  exports the latest full checkpoint, loads the export as a
  `tf_psplugin.ServingModel`, applies every committed delta to it in place,
  and after each update answers a request and prints how long after the
  chief committed the checkpoint it answered with it.

Local cluster:

    python -m tf_psplugin.launch --workers 2 --ps 2 --evaluator -- \\
        python keras_examples/online_ctr.py --model_dir /tmp/online --serve \\
        --wait_for_evaluator_seconds 120

The serving process alone, by hand, following a job's model directory:

    python keras_examples/online_ctr.py --serving_process --model_dir /shared/online

Lines tagged `# tf_psplugin:` are what differs from single-machine Keras. The
script uses only tf_psplugin's public API and is self-contained: copy it.
"""

import os
import subprocess
import sys
import time

from absl import app, flags

import tensorflow as tf

import tf_psplugin  # tf_psplugin: raises a clear ImportError under Keras 3.
from tf_psplugin import config as tfp_config  # tf_psplugin: --job_name, --*_hosts flags.
from tf_psplugin.data import NUM_CATEGORICAL_FEATURES, NUM_INTEGER_FEATURES, SyntheticCTR

FLAGS = flags.FLAGS
flags.DEFINE_string("model_dir", None, "Checkpoints and deltas, eval results. Shared by the "
                    "chief, the PS tasks, the evaluator and the serving process.")
flags.DEFINE_integer("steps_per_epoch", 100, "Steps per Keras epoch (a reporting period: "
                     "the stream never ends).")
flags.DEFINE_integer("epochs", 10, "Epochs to train; an online job would not stop.")
flags.DEFINE_integer("batch_size", 256, "Examples per worker per step.")
flags.DEFINE_integer("vocab_size", 10_000, "Ids per categorical feature.")
flags.DEFINE_integer("embedding_dim", 16, "Embedding width.")
flags.DEFINE_integer("steps_per_execution", 10, "Steps per tf.function call.")
flags.DEFINE_float("learning_rate", 0.3, "Adagrad learning rate.")
flags.DEFINE_integer("seed", 0, "Data and initialisation seed.")
flags.DEFINE_integer("save_every_steps", 50, "Save every N steps.")
flags.DEFINE_integer("full_every_saves", 5, "Every N-th save is full; the saves between are "
                     "deltas.")
flags.DEFINE_alias("full_every", "full_every_saves")  # Its former name.
flags.DEFINE_integer("keep_checkpoints", 2, "Full checkpoints (with their deltas) kept.")
flags.DEFINE_integer("eval_steps", 10, "Evaluator: batches per evaluation.")
flags.DEFINE_integer("eval_batch_size", 512, "Evaluator: examples per batch.")
flags.DEFINE_float("eval_idle_timeout_seconds", 600, "Evaluator: exit after this long "
                   "without a new checkpoint.")
flags.DEFINE_float("wait_for_evaluator_seconds", 0, "Chief: wait up to this long for the "
                   "evaluator to score the final checkpoint before exiting (0: do not wait).")
flags.DEFINE_bool("serve", False, "Chief: also start a serving process following model_dir.")
flags.DEFINE_bool("serving_process", False, "Run as the serving process (no cluster).")
flags.DEFINE_string("export_dir", None, "Serving: where the export goes "
                    "(default <model_dir>/serving_export).")
flags.DEFINE_float("serving_poll_seconds", 1.0, "Serving: seconds between looks at model_dir.")
flags.DEFINE_float("serving_timeout_seconds", 600, "Serving: give up after this long without "
                   "a new checkpoint.")
tfp_config.define_flags(FLAGS)  # tf_psplugin: --job_name --task_index --*_hosts.

EVAL_OFFSET_BATCHES = 1 << 40  # Held-out examples come from far beyond any training data.


# -- The model: one fused table (sharded on the PS tasks) and a small MLP ------


class FeatureRows(tf.keras.layers.Layer):
    """Per-feature ids ``[B, F]`` to rows of one fused table: ``id + f * vocab_size``."""

    def __init__(self, vocab_size: int, **kwargs):
        super().__init__(**kwargs)
        self.vocab_size = int(vocab_size)

    def call(self, ids):
        ids = tf.clip_by_value(tf.cast(ids, tf.int64), 0, self.vocab_size - 1)
        return ids + tf.range(tf.shape(ids)[-1], dtype=tf.int64) * self.vocab_size

    def get_config(self):
        return {**super().get_config(), "vocab_size": self.vocab_size}


def build_model() -> tf.keras.Model:
    """The CTR model, uncompiled: the same builder on the chief, the evaluator and serving."""
    vocab = FLAGS.vocab_size
    dense_in = tf.keras.Input((NUM_INTEGER_FEATURES,), name="dense")
    cat_in = tf.keras.Input((NUM_CATEGORICAL_FEATURES,), dtype=tf.int64, name="categorical")
    rows = FeatureRows(vocab, name="feature_rows")(cat_in)
    embedded = tf.keras.layers.Embedding(  # tf_psplugin: a table, sharded on the PS tasks.
        NUM_CATEGORICAL_FEATURES * vocab, FLAGS.embedding_dim, name="embedding",
        embeddings_initializer=tf.keras.initializers.RandomUniform(-0.05, 0.05,
                                                                   seed=FLAGS.seed))(rows)
    x = tf.keras.layers.Concatenate(name="features")(
        [tf.keras.layers.Flatten(name="flat")(embedded), dense_in])
    for i, width in enumerate((64, 32)):
        x = tf.keras.layers.Dense(width, activation="relu", name=f"mlp_{i}",
                                  kernel_initializer=tf.keras.initializers.GlorotUniform(
                                      seed=FLAGS.seed + 1 + i))(x)
    logit = tf.keras.layers.Dense(1, name="logit")(x)
    return tf.keras.Model({"dense": dense_in, "categorical": cat_in}, logit, name="online_ctr")


def compile_model(model: tf.keras.Model) -> tf.keras.Model:
    # tf_psplugin: incremental checkpoints need an optimizer whose sparse update changes
    # only the gradient's rows: Keras legacy Adagrad, SGD or Ftrl (not Adam).
    model.compile(tf.keras.optimizers.legacy.Adagrad(FLAGS.learning_rate),
                  tf.keras.losses.BinaryCrossentropy(from_logits=True),
                  metrics=[tf.keras.metrics.AUC(name="auc", from_logits=True)],
                  steps_per_execution=FLAGS.steps_per_execution)
    return model


def generator() -> SyntheticCTR:
    return SyntheticCTR(vocab_size=FLAGS.vocab_size, seed=FLAGS.seed)


def heldout(batch_size: int, batches: int) -> tf.data.Dataset:
    return generator().dataset(batch_size, num_batches=EVAL_OFFSET_BATCHES + batches,
                               offset_batches=EVAL_OFFSET_BATCHES)


def final_step() -> int:
    return FLAGS.epochs * FLAGS.steps_per_epoch


# -- The three roles -----------------------------------------------------------


def start_serving_process() -> subprocess.Popen:
    """This script as the serving process: no TF_CONFIG, so it never joins the cluster."""
    env = {k: v for k, v in os.environ.items() if k != "TF_CONFIG"}
    argv = [a for a in sys.argv[1:] if a not in ("--serve", "--noserving_process")]
    return subprocess.Popen([sys.executable, os.path.abspath(__file__), *argv,
                             "--serving_process", "--noserve"], env=env)


def train(config):
    strategy = tf_psplugin.HybridParameterServerStrategy()  # tf_psplugin: chief = coordinator.
    with strategy.scope():  # tf_psplugin: the table goes to the PS tasks, the MLP to workers.
        model = compile_model(build_model())
    # tf_psplugin: chief-only checkpoints; every full_every-th save full, deltas between.
    checkpoints = tf_psplugin.ChiefCheckpoint(
        FLAGS.model_dir, save_every_steps=FLAGS.save_every_steps,
        full_every_saves=FLAGS.full_every_saves,
        max_to_keep=FLAGS.keep_checkpoints, final_step=final_step())
    serving = start_serving_process() if FLAGS.serve else None
    print(f"online_ctr: {FLAGS.epochs} x {FLAGS.steps_per_epoch} steps of an endless stream on "
          f"{config.num_workers} worker(s) x {FLAGS.batch_size} examples, {config.num_ps} PS "
          f"task(s); a save every {FLAGS.save_every_steps} steps, one in "
          f"{FLAGS.full_every_saves} full", flush=True)
    try:
        # An endless dataset: Keras needs steps_per_epoch.
        model.fit(generator().dataset(FLAGS.batch_size), epochs=FLAGS.epochs,
                  steps_per_epoch=FLAGS.steps_per_epoch, callbacks=[checkpoints])
        latest = checkpoints.manager.latest
        print(f"online_ctr: trained to step {int(model.optimizer.iterations.numpy())}; last "
              f"save {os.path.basename(latest.path)} ({latest.kind}); saves in model_dir: "
              + ", ".join(sorted(n[:-len(".commit")] for n in os.listdir(FLAGS.model_dir)
                                 if n.endswith(".commit"))), flush=True)
        if FLAGS.wait_for_evaluator_seconds > 0 and config.has_evaluator:
            record = tf_psplugin.wait_for_evaluation(  # tf_psplugin: the final score is in.
                FLAGS.model_dir, final_step(), timeout_seconds=FLAGS.wait_for_evaluator_seconds)
            if record is not None:
                print(f"online_ctr: the evaluator scored step {record['step']}: AUC "
                      f"{record['auc']:.4f}", flush=True)
        if serving is not None:  # It exits once it serves the final step.
            serving.wait(timeout=FLAGS.serving_timeout_seconds)
            print(f"online_ctr: the serving process exited ({serving.returncode})", flush=True)
    finally:
        if serving is not None and serving.poll() is None:
            serving.kill()
            serving.wait()


def run_evaluator():
    """The evaluator task: plain local TF, never connects to the training cluster."""
    records = tf_psplugin.run_evaluator(  # tf_psplugin: follows model_dir, deltas included.
        lambda: compile_model(build_model()),
        lambda: heldout(FLAGS.eval_batch_size, FLAGS.eval_steps), FLAGS.model_dir,
        eval_steps=FLAGS.eval_steps, idle_timeout_seconds=FLAGS.eval_idle_timeout_seconds)
    if records:
        print(f"online_ctr evaluator: {len(records)} evaluation(s), final step "
              f"{records[-1]['step']} AUC {records[-1]['auc']:.4f}", flush=True)


def run_serving():
    """The serving process: an export of a full checkpoint, kept fresh from the deltas."""
    model_dir = FLAGS.model_dir
    export_dir = FLAGS.export_dir or os.path.join(model_dir, "serving_export")
    deadline = time.monotonic() + FLAGS.serving_timeout_seconds
    while True:
        checkpoints = tf_psplugin.list_checkpoints(model_dir)  # Full checkpoints only.
        if checkpoints:
            try:
                # tf_psplugin: a SavedModel of the latest full checkpoint; no cluster needed.
                tf_psplugin.export_from_checkpoint(build_model, checkpoints[-1].path,
                                                   export_dir, overwrite=True)
                break
            except (tf_psplugin.CheckpointError, tf.errors.NotFoundError):
                pass  # Deleted by the chief's max_to_keep meanwhile: take the next one.
        if time.monotonic() > deadline:
            raise app.UsageError(f"no checkpoint in {model_dir} after "
                                 f"{FLAGS.serving_timeout_seconds:.0f} s.")
        time.sleep(FLAGS.serving_poll_seconds)
    # tf_psplugin: the export, updated in place from the chief's deltas.
    serving = tf_psplugin.ServingModel(export_dir, model_dir=model_dir)
    predict = serving.signature()  # Requests through it see one committed checkpoint.
    features, _ = next(iter(heldout(256, 1)))
    print(f"online_ctr serving: exported and loaded {serving.checkpoint} (step {serving.step})",
          flush=True)
    last_change = time.monotonic()
    while serving.step is None or serving.step < final_step():
        applied = serving.poll()
        if applied:
            answer = next(iter(predict(**features).values()))  # A request.
            seconds = time.time() - applied[-1].wall_time
            ctr = float(tf.reduce_mean(tf.sigmoid(answer)))
            print(f"online_ctr serving: step {serving.step} (applied "
                  f"{', '.join(i.name for i in applied)}) answered {seconds:.2f} s after the "
                  f"chief committed it; mean predicted CTR {ctr:.4f}", flush=True)
            last_change = time.monotonic()
        elif time.monotonic() - last_change > FLAGS.serving_timeout_seconds:
            print(f"online_ctr serving: nothing new for {FLAGS.serving_timeout_seconds:.0f} s; "
                  "exiting", flush=True)
            return
        time.sleep(FLAGS.serving_poll_seconds)
    print(f"online_ctr serving: done at the final step {serving.step}", flush=True)


def main(argv):
    del argv
    if not FLAGS.model_dir:
        raise app.UsageError("--model_dir is required (a directory shared by every task).")
    if FLAGS.serving_process:  # tf_psplugin: serving needs no cluster and no strategy.
        run_serving()
        return
    config = tf_psplugin.start_server()  # tf_psplugin: ps/worker tasks serve here, never return.
    if config.task_type == "evaluator":  # tf_psplugin: never joins the training cluster.
        run_evaluator()
    else:
        train(config)


if __name__ == "__main__":
    app.run(main)
