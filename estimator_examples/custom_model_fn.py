"""A custom `model_fn` CTR model: get_variable embedding tables + a dense tower.

The model is plain TF1 Estimator code: one `tf.compat.v1.get_variable` table
per categorical feature (named `.../embeddings`, which is what makes the
plugin's placement rule treat it as an embedding table), looked up with
`tf.nn.embedding_lookup`, concatenated with the numeric features and fed to a
small MLP, trained with a TF1 optimizer. The tables are sharded over the PS
tasks; the tower is replicated on the chief and workers and all-reduced. Only
the lines tagged `# tf_psplugin:` differ from a single-machine script.

Launch every task with the same command line, by flags (the first worker is
the chief when no --chief_hosts is given):

    python estimator_examples/custom_model_fn.py --model_dir=/tmp/custom \
        --ps_hosts=localhost:2230,localhost:2231 \
        --worker_hosts=localhost:2220,localhost:2221 \
        --job_name=ps --task_index=0

(`--job_name=ps|worker|evaluator`, `--task_index=N`), or by TF_CONFIG with no
cluster flags. Without either, it trains in one process.
"""

from absl import app, flags

import tensorflow as tf

import tf_psplugin.config  # tf_psplugin: cluster flags
import tf_psplugin.data
import tf_psplugin.estimator  # tf_psplugin: the RunConfig

FLAGS = flags.FLAGS
flags.DEFINE_string("model_dir", "/tmp/tf_psplugin_custom", "Shared checkpoint directory.")
flags.DEFINE_integer("train_steps", 200, "Global steps to train for.")
flags.DEFINE_integer("batch_size", 64, "Examples per worker and step.")
flags.DEFINE_integer("vocab_size", 2000, "Rows of each embedding table.")
flags.DEFINE_integer("num_categorical", 4, "Categorical features (Criteo has 26).")
flags.DEFINE_integer("num_integer", 3, "Numeric features (Criteo has 13).")
flags.DEFINE_integer("embedding_dim", 8, "Embedding width.")
flags.DEFINE_enum("optimizer", "adagrad", ["adagrad", "adam", "sgd"], "TF1 optimizer.")
flags.DEFINE_float("learning_rate", 0.1, "Learning rate.")
flags.DEFINE_integer("save_checkpoints_steps", 50, "Checkpoint interval, in steps.")
flags.DEFINE_integer("eval_steps", 10, "Batches per evaluation.")
flags.DEFINE_string("placement_report_dir", None, "If set, each training task writes "
                    "placement_<task>.json (variable -> devices) there.")
flags.DEFINE_enum("embedding_updates", "sync", ["sync", "async"], "How table gradients apply.")
flags.DEFINE_enum("dense_placement", "allreduce", ["allreduce", "ps"],
                  "Where dense variables live: every worker (all-reduced) or the PS tasks.")
tf_psplugin.config.define_flags(FLAGS)  # tf_psplugin: --job_name --task_index --*_hosts


def _generator():
    return tf_psplugin.data.SyntheticCTR(
        vocab_size=FLAGS.vocab_size,
        num_categorical=FLAGS.num_categorical,
        num_integer=FLAGS.num_integer,
        seed=11,
        signal=1.0,
    )


def train_input_fn(input_context=None):
    """Each worker reads its own shard of the stream."""
    shard, num_shards = 0, 1
    if input_context is not None:
        shard, num_shards = input_context.input_pipeline_id, input_context.num_input_pipelines
    return _generator().dataset(FLAGS.batch_size, shard_index=shard, num_shards=num_shards)


def eval_input_fn():
    start = 1 << 40  # Held-out examples: far from anything the workers train on.
    return _generator().dataset(FLAGS.batch_size, num_batches=start + FLAGS.eval_steps,
                                offset_batches=start)


def _dense_layer(inputs, units, name, activation=None):
    with tf.compat.v1.variable_scope(name):
        kernel = tf.compat.v1.get_variable(
            "kernel", [inputs.shape[-1], units],
            initializer=tf.compat.v1.glorot_uniform_initializer())
        bias = tf.compat.v1.get_variable("bias", [units], initializer=tf.zeros_initializer())
        outputs = tf.matmul(inputs, kernel) + bias
        return activation(outputs) if activation else outputs


def model_fn(features, labels, mode, params):
    """Embeddings for each categorical feature, then a 2-layer MLP."""
    ids = features["categorical"]
    embedded = []
    with tf.compat.v1.variable_scope("embedding"):
        for i in range(params["num_categorical"]):
            with tf.compat.v1.variable_scope(f"C{i + 1}"):
                table = tf.compat.v1.get_variable(
                    "embeddings", [params["vocab_size"], params["embedding_dim"]],
                    initializer=tf.compat.v1.truncated_normal_initializer(stddev=0.05))
            embedded.append(tf.nn.embedding_lookup(table, ids[:, i]))
    net = tf.concat(embedded + [features["dense"]], axis=1)
    net = _dense_layer(net, 32, "hidden_0", tf.nn.relu)
    net = _dense_layer(net, 16, "hidden_1", tf.nn.relu)
    logits = _dense_layer(net, 1, "logits")
    probabilities = tf.sigmoid(logits)
    if mode == tf.estimator.ModeKeys.PREDICT:
        return tf.estimator.EstimatorSpec(mode, predictions={"probabilities": probabilities})
    loss = tf.compat.v1.losses.sigmoid_cross_entropy(labels, logits)
    if mode == tf.estimator.ModeKeys.EVAL:
        metrics = {"auc": tf.compat.v1.metrics.auc(labels, probabilities)}
        return tf.estimator.EstimatorSpec(mode, loss=loss, eval_metric_ops=metrics)
    optimizer = {
        "adagrad": tf.compat.v1.train.AdagradOptimizer,
        "adam": tf.compat.v1.train.AdamOptimizer,
        "sgd": tf.compat.v1.train.GradientDescentOptimizer,
    }[params["optimizer"]](params["learning_rate"])
    train_op = optimizer.minimize(loss, global_step=tf.compat.v1.train.get_global_step())
    return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


def main(argv):
    del argv
    config = tf_psplugin.estimator.RunConfig(  # tf_psplugin: drop-in for tf.estimator.RunConfig
        model_dir=FLAGS.model_dir,
        save_checkpoints_steps=FLAGS.save_checkpoints_steps,
        keep_checkpoint_max=20,
        save_summary_steps=10,
        log_step_count_steps=10,
        tf_random_seed=1,
        dense_placement=FLAGS.dense_placement,  # tf_psplugin: "allreduce" (default) or "ps"
        embedding_updates=FLAGS.embedding_updates,  # tf_psplugin: "sync" (default) or "async"
        flag_values=FLAGS,  # tf_psplugin: where define_flags registered the cluster flags
    )
    estimator = tf.estimator.Estimator(
        model_fn,
        config=config,
        params={
            "num_categorical": FLAGS.num_categorical,
            "vocab_size": FLAGS.vocab_size,
            "embedding_dim": FLAGS.embedding_dim,
            "optimizer": FLAGS.optimizer,
            "learning_rate": FLAGS.learning_rate,
        },
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
