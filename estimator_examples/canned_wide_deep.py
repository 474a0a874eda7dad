"""Wide & deep CTR model with a canned Estimator, tables on PS, dense all-reduced.

`tf.estimator.DNNLinearCombinedClassifier` on generated Criteo-style data:
the DNN side embeds the categorical features (`embedding_column`: these
`embedding_weights` tables are sharded over the PS tasks), the linear side
uses the same categorical columns directly, plus numeric columns. The model
code is stock; only the lines tagged `# tf_psplugin:` differ from a
single-machine script.

Launch every task with the same command line, by flags (the first worker is
the chief when no --chief_hosts is given):

    python estimator_examples/canned_wide_deep.py --model_dir=/tmp/wd \
        --ps_hosts=localhost:2230,localhost:2231 \
        --worker_hosts=localhost:2220,localhost:2221,localhost:2222 \
        --evaluator_hosts=localhost:2240 --job_name=worker --task_index=0

(`--job_name=ps|worker|evaluator`, `--task_index=N`), or by TF_CONFIG with no
cluster flags. Without either, it trains in one process.
"""

from absl import app, flags

import tensorflow as tf

import tf_psplugin.config  # tf_psplugin: cluster flags
import tf_psplugin.data
import tf_psplugin.estimator  # tf_psplugin: the RunConfig

FLAGS = flags.FLAGS
flags.DEFINE_string("model_dir", "/tmp/tf_psplugin_wide_deep", "Shared checkpoint directory.")
flags.DEFINE_integer("train_steps", 200, "Global steps to train for.")
flags.DEFINE_integer("batch_size", 64, "Examples per worker and step.")
flags.DEFINE_integer("vocab_size", 2000, "Rows of each embedding table.")
flags.DEFINE_integer("num_categorical", 4, "Categorical features (Criteo has 26).")
flags.DEFINE_integer("num_integer", 3, "Numeric features (Criteo has 13).")
flags.DEFINE_integer("embedding_dim", 8, "Embedding width.")
flags.DEFINE_float("learning_rate", 0.3, "Learning rate of both optimizers (Ftrl, Adagrad).")
flags.DEFINE_integer("save_checkpoints_steps", 50, "Checkpoint interval, in steps.")
flags.DEFINE_integer("eval_steps", 10, "Batches per evaluation.")
flags.DEFINE_string("placement_report_dir", None, "If set, each training task writes "
                    "placement_<task>.json (variable -> devices) there.")
flags.DEFINE_enum("embedding_updates", "sync", ["sync", "async"], "How table gradients apply.")
tf_psplugin.config.define_flags(FLAGS)  # tf_psplugin: --job_name --task_index --*_hosts


def _generator():
    return tf_psplugin.data.SyntheticCTR(
        vocab_size=FLAGS.vocab_size,
        num_categorical=FLAGS.num_categorical,
        num_integer=FLAGS.num_integer,
        seed=7,
        signal=1.0,
    )


def _to_estimator_input(features, label):
    return tf_psplugin.data.to_named_columns(features), tf.cast(label, tf.int64)


def train_input_fn(input_context=None):
    """Each worker reads its own shard of the stream."""
    shard, num_shards = 0, 1
    if input_context is not None:
        shard, num_shards = input_context.input_pipeline_id, input_context.num_input_pipelines
    ds = _generator().dataset(FLAGS.batch_size, shard_index=shard, num_shards=num_shards)
    return ds.map(_to_estimator_input)


def eval_input_fn():
    start = 1 << 40  # Held-out examples: far from anything the workers train on.
    ds = _generator().dataset(FLAGS.batch_size, num_batches=start + FLAGS.eval_steps,
                              offset_batches=start)
    return ds.map(_to_estimator_input)


def feature_columns():
    """Returns (wide columns, deep columns)."""
    categorical = [
        tf.feature_column.categorical_column_with_identity(f"C{i + 1}", FLAGS.vocab_size)
        for i in range(FLAGS.num_categorical)
    ]
    numeric = [tf.feature_column.numeric_column(f"I{i + 1}") for i in range(FLAGS.num_integer)]
    deep = [tf.feature_column.embedding_column(c, FLAGS.embedding_dim) for c in categorical]
    return categorical, deep + numeric


def main(argv):
    del argv
    config = tf_psplugin.estimator.RunConfig(  # tf_psplugin: drop-in for tf.estimator.RunConfig
        model_dir=FLAGS.model_dir,
        save_checkpoints_steps=FLAGS.save_checkpoints_steps,
        keep_checkpoint_max=20,
        save_summary_steps=10,
        log_step_count_steps=10,
        tf_random_seed=1,
        embedding_updates=FLAGS.embedding_updates,  # tf_psplugin: "sync" (default) or "async"
        flag_values=FLAGS,  # tf_psplugin: where define_flags registered the cluster flags
    )
    wide, deep = feature_columns()
    estimator = tf.estimator.DNNLinearCombinedClassifier(
        linear_feature_columns=wide,
        dnn_feature_columns=deep,
        dnn_hidden_units=[32, 16],
        linear_optimizer=lambda: tf.keras.optimizers.legacy.Ftrl(FLAGS.learning_rate),
        dnn_optimizer=lambda: tf.keras.optimizers.legacy.Adagrad(FLAGS.learning_rate),
        config=config,
    )
    hooks = []
    if FLAGS.placement_report_dir:
        hooks.append(  # tf_psplugin: log (and save) where each variable went
            tf_psplugin.estimator.PlacementReportHook(FLAGS.placement_report_dir))
    tf.estimator.train_and_evaluate(
        estimator,
        tf.estimator.TrainSpec(train_input_fn, max_steps=FLAGS.train_steps, hooks=hooks),
        tf.estimator.EvalSpec(eval_input_fn, steps=None, start_delay_secs=0, throttle_secs=1),
    )


if __name__ == "__main__":
    app.run(main)
