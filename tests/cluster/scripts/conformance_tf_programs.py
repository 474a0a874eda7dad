"""TensorFlow's and Keras's own training programs, run with only the strategy swapped.

Used by tests/cluster/test_conformance.py. Each program is written the way
the documentation that users copy from writes it (TensorFlow's
"Parameter server training" tutorial, the Keras guide "Writing a training
loop from scratch"), with `tf_psplugin.HybridParameterServerStrategy()` in
place of `tf.distribute.experimental.ParameterServerStrategy(resolver)` and
nothing else changed. Each check prints `CHECK <name> ok` or
`CHECK <name> FAIL <why>`; a failing program does not stop the others; the
script ends with `DONE`.

What is asserted is what stock ParameterServerStrategy gives such a
program (it runs, the loss falls, metrics are readable after `join()` and
count every example once), and where synchronous training makes it so,
equality with one process on the global batch.
"""

import os
import random
import sys
import tempfile

import numpy as np
import tensorflow as tf

import tf_psplugin
from checks import check  # tests/cluster/scripts/checks.py

WORKERS = 2  # tests/cluster/test_conformance.py starts 2 workers.


def program(name):
    """Runs a program; an exception fails its `<name>_runs` check and nothing else."""
    def wrap(fn):
        def run(*args):
            try:
                fn(*args)
                check(f"{name}_runs", True)
            except Exception as e:  # pylint: disable=broad-except
                check(f"{name}_runs", False, f"{type(e).__name__}: {e}")
        return run
    return wrap


@program("tutorial_custom_loop")
def tutorial_custom_loop(strategy):
    """TF's PSS tutorial, "Training with a custom training loop", as published.

    Preprocessing layers in the input pipeline, `distribute_datasets_from_function`,
    a metric updated after `apply_gradients` and read only after `join()`,
    then the tutorial's evaluation loop.
    """
    random.seed(0)
    tf.keras.utils.set_random_seed(0)
    feature_vocab = ["avenger", "ironman", "batman", "hulk", "spiderman", "kingkong",
                     "wonder_woman"]
    label_vocab = ["yes", "no"]
    with strategy.scope():
        feature_lookup_layer = tf.keras.layers.StringLookup(vocabulary=feature_vocab,
                                                            mask_token=None)
        label_lookup_layer = tf.keras.layers.StringLookup(vocabulary=label_vocab,
                                                          num_oov_indices=0, mask_token=None)
        raw_feature_input = tf.keras.layers.Input(shape=(3,), dtype=tf.string, name="features")
        feature_id_input = feature_lookup_layer(raw_feature_input)
        feature_preprocess_stage = tf.keras.Model({"features": raw_feature_input},
                                                  feature_id_input)
        raw_label_input = tf.keras.layers.Input(shape=(1,), dtype=tf.string, name="label")
        label_id_input = label_lookup_layer(raw_label_input)
        label_preprocess_stage = tf.keras.Model({"label": raw_label_input}, label_id_input)

    def feature_and_label_gen(num_examples=200):
        examples = {"features": [], "label": []}
        for _ in range(num_examples):
            features = random.sample(feature_vocab, 3)
            label = ["yes"] if "avenger" in features else ["no"]
            examples["features"].append(features)
            examples["label"].append(label)
        return examples

    examples = feature_and_label_gen()

    def dataset_fn(_):
        raw_dataset = tf.data.Dataset.from_tensor_slices(examples)
        train_dataset = raw_dataset.map(
            lambda x: ({"features": feature_preprocess_stage(x["features"])},
                       label_preprocess_stage(x["label"]))
        ).shuffle(200).batch(32).repeat()
        return train_dataset

    with strategy.scope():
        model_input = tf.keras.layers.Input(shape=(3,), dtype=tf.int64, name="model_input")
        emb_layer = tf.keras.layers.Embedding(
            input_dim=len(feature_lookup_layer.get_vocabulary()), output_dim=16384)
        emb_output = tf.reduce_mean(emb_layer(model_input), axis=1)
        dense_output = tf.keras.layers.Dense(
            units=1, activation="sigmoid",
            kernel_regularizer=tf.keras.regularizers.L2(1e-4))(emb_output)
        model = tf.keras.Model({"features": model_input}, dense_output)
        optimizer = tf.keras.optimizers.legacy.RMSprop(learning_rate=0.1)
        accuracy = tf.keras.metrics.Accuracy()

    @tf.function
    def step_fn(iterator):
        def replica_fn(batch_data, labels):
            with tf.GradientTape() as tape:
                pred = model(batch_data, training=True)
                per_example_loss = tf.keras.losses.BinaryCrossentropy(
                    reduction=tf.keras.losses.Reduction.NONE)(labels, pred)
                loss = tf.nn.compute_average_loss(per_example_loss)
                model_losses = model.losses
                if model_losses:
                    loss += tf.nn.scale_regularization_loss(tf.add_n(model_losses))
            gradients = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(gradients, model.trainable_variables))
            actual_pred = tf.cast(tf.greater(pred, 0.5), tf.int64)
            accuracy.update_state(labels, actual_pred)
            return loss

        batch_data, labels = next(iterator)
        losses = strategy.run(replica_fn, args=(batch_data, labels))
        return strategy.reduce(tf.distribute.ReduceOp.SUM, losses, axis=None)

    coordinator = tf.distribute.experimental.coordinator.ClusterCoordinator(strategy)

    @tf.function
    def per_worker_dataset_fn():
        return strategy.distribute_datasets_from_function(dataset_fn)

    per_worker_dataset = coordinator.create_per_worker_dataset(per_worker_dataset_fn)
    per_worker_iterator = iter(per_worker_dataset)

    num_epochs, steps_per_epoch = 4, 5
    counts, results = [], []
    for _ in range(num_epochs):
        accuracy.reset_states()
        for _ in range(steps_per_epoch):
            coordinator.schedule(step_fn, args=(per_worker_iterator,))
        coordinator.join()
        results.append(float(accuracy.result().numpy()))
        counts.append(float(accuracy.count.numpy()))
    # A step is one batch on every worker. Each worker reads the whole
    # stream (the tutorial's dataset_fn does not shard), and 200 examples
    # batch into 6 batches of 32 and one of 8 before `repeat`: every example
    # a worker's batches hold counts once.
    sizes = ([32] * 6 + [8]) * 4
    expected = [sum(sizes[e * steps_per_epoch:(e + 1) * steps_per_epoch]) * WORKERS
                for e in range(num_epochs)]
    check("tutorial_custom_loop_metric_counts_every_example",
          counts == expected, (counts, expected))
    check("tutorial_custom_loop_learns", results[-1] > 0.9 and results[-1] >= results[0],
          results)
    loss = coordinator.schedule(step_fn, args=(per_worker_iterator,))
    final = float(loss.fetch())
    check("tutorial_custom_loop_loss_fetched", np.isfinite(final), final)

    # The tutorial's "Evaluation" section, inline distributed evaluation.
    with strategy.scope():
        eval_accuracy = tf.keras.metrics.Accuracy()

    @tf.function
    def eval_step(iterator):
        def replica_fn(batch_data, labels):
            pred = model(batch_data, training=False)
            actual_pred = tf.cast(tf.greater(pred, 0.5), tf.int64)
            eval_accuracy.update_state(labels, actual_pred)

        batch_data, labels = next(iterator)
        strategy.run(replica_fn, args=(batch_data, labels))

    def eval_dataset_fn():
        return tf.data.Dataset.from_tensor_slices(feature_and_label_gen(num_examples=16)).map(
            lambda x: ({"features": feature_preprocess_stage(x["features"])},
                       label_preprocess_stage(x["label"]))).shuffle(16).repeat().batch(8)

    per_worker_eval_dataset = coordinator.create_per_worker_dataset(eval_dataset_fn)
    per_worker_eval_iterator = iter(per_worker_eval_dataset)
    eval_steps_per_epoch = 2
    for _ in range(eval_steps_per_epoch):
        coordinator.schedule(eval_step, args=(per_worker_eval_iterator,))
    coordinator.join()
    check("tutorial_eval_counts_every_example",
          float(eval_accuracy.count.numpy()) == eval_steps_per_epoch * 8 * WORKERS,
          float(eval_accuracy.count.numpy()))
    check("tutorial_eval_accuracy", float(eval_accuracy.result()) > 0.9,
          float(eval_accuracy.result()))


@program("tutorial_fit")
def tutorial_fit(strategy):
    """TF's PSS tutorial, "Training with Model.fit": DatasetCreator and its callbacks."""
    tf.keras.utils.set_random_seed(1)

    def dataset_fn(input_context):
        global_batch_size = 64
        batch_size = input_context.get_per_replica_batch_size(global_batch_size)
        x = tf.random.uniform((10, 10))
        y = tf.random.uniform((10,))
        dataset = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(10).repeat()
        dataset = dataset.shard(input_context.num_input_pipelines,
                                input_context.input_pipeline_id)
        dataset = dataset.batch(batch_size)
        dataset = dataset.prefetch(2)
        return dataset

    dc = tf.keras.utils.experimental.DatasetCreator(dataset_fn)
    with strategy.scope():
        model = tf.keras.models.Sequential([tf.keras.layers.Dense(10)])
        model.compile(tf.keras.optimizers.legacy.SGD(), loss="mse", steps_per_execution=10)
    working_dir = tempfile.mkdtemp(prefix="tutorial_fit_")
    log_dir = os.path.join(working_dir, "log")
    ckpt_filepath = os.path.join(working_dir, "ckpt")
    backup_dir = os.path.join(working_dir, "backup")
    callbacks = [
        tf.keras.callbacks.TensorBoard(log_dir=log_dir),
        tf.keras.callbacks.ModelCheckpoint(filepath=ckpt_filepath),
        tf.keras.callbacks.BackupAndRestore(backup_dir=backup_dir),
    ]
    history = model.fit(dc, epochs=5, steps_per_epoch=20, callbacks=callbacks, verbose=0)
    losses = history.history["loss"]
    check("tutorial_fit_loss_falls", len(losses) == 5 and losses[-1] < losses[0], losses)
    check("tutorial_fit_checkpoint_written", os.path.exists(ckpt_filepath),
          os.listdir(working_dir))
    # The last epoch's SavedModel loads in a plain process with the trained weights.
    loaded = tf.keras.models.load_model(ckpt_filepath)
    diff = max(float(np.max(np.abs(a - b)))
               for a, b in zip(loaded.get_weights(), model.get_weights()))
    check("tutorial_fit_checkpoint_loads", diff == 0.0, diff)


def scratch_model():
    """The guide's small classifier, with an embedding table in front (a CTR shape)."""
    inputs = tf.keras.Input(shape=(2,), dtype="int64", name="ids")
    x = tf.keras.layers.Embedding(64, 4, name="ids_embedding")(inputs)
    x = tf.keras.layers.Flatten()(x)
    x = tf.keras.layers.Dense(16, activation="relu", name="dense_1")(x)
    outputs = tf.keras.layers.Dense(2, name="predictions")(x)
    return tf.keras.Model(inputs=inputs, outputs=outputs)


def scratch_data(n=512, seed=3):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, 64, size=(n, 2)).astype("int64")
    labels = (ids[:, 0] < 32).astype("int64")
    return ids, labels


@program("scratch_loop")
def scratch_loop(strategy):
    """Keras's "Writing a training loop from scratch", on the coordinator.

    Metrics updated after `apply_gradients`, read with `result()` at the
    end of each epoch and reset, a validation loop: the guide's shape,
    scheduled with `ClusterCoordinator`. Then the same loop in one process on
    the global batch (the workers' batches of a step, concatenated) must give
    the same weights and the same metric values.
    """
    batch, epochs, steps = 16, 2, 8
    ids, labels = scratch_data()
    tf.keras.utils.set_random_seed(3)
    with strategy.scope():
        model = scratch_model()
        optimizer = tf.keras.optimizers.legacy.SGD(learning_rate=0.5)
        loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(
            from_logits=True, reduction=tf.keras.losses.Reduction.NONE)
        train_acc_metric = tf.keras.metrics.SparseCategoricalAccuracy()
        train_loss = tf.keras.metrics.Mean()
        val_acc_metric = tf.keras.metrics.SparseCategoricalAccuracy()
    initial = model.get_weights()

    @tf.function
    def train_step(iterator):
        def replica_fn(x, y):
            with tf.GradientTape() as tape:
                logits = model(x, training=True)
                loss_value = tf.nn.compute_average_loss(loss_fn(y, logits))
            grads = tape.gradient(loss_value, model.trainable_weights)
            optimizer.apply_gradients(zip(grads, model.trainable_weights))
            train_acc_metric.update_state(y, logits)
            train_loss.update_state(loss_fn(y, logits))
            return loss_value
        x, y = next(iterator)
        return strategy.run(replica_fn, args=(x, y))

    @tf.function
    def test_step(iterator):
        def replica_fn(x, y):
            val_acc_metric.update_state(y, model(x, training=False))
        x, y = next(iterator)
        strategy.run(replica_fn, args=(x, y))

    coordinator = tf.distribute.experimental.coordinator.ClusterCoordinator(strategy)
    # A plain tf.data.Dataset: the coordinator gives worker i batches i, i+W, ...
    train = tf.data.Dataset.from_tensor_slices((ids, labels)).batch(batch).repeat()
    val = tf.data.Dataset.from_tensor_slices((ids[:128], labels[:128])).batch(batch).repeat()
    train_it = iter(coordinator.create_per_worker_dataset(train))
    val_it = iter(coordinator.create_per_worker_dataset(val))
    seen = []
    for _ in range(epochs):
        for _ in range(steps):
            coordinator.schedule(train_step, args=(train_it,))
        coordinator.join()
        seen.append((float(train_acc_metric.result()), float(train_loss.result())))
        train_acc_metric.reset_states()
        train_loss.reset_states()
        for _ in range(2):
            coordinator.schedule(test_step, args=(val_it,))
        coordinator.join()
        seen.append((float(val_acc_metric.result()), float(val_acc_metric.count)))
        val_acc_metric.reset_states()

    # One process, global batch = WORKERS * batch, same examples in the same order.
    local = scratch_model()
    local.set_weights(initial)
    local_opt = tf.keras.optimizers.legacy.SGD(learning_rate=0.5)
    acc, mean, val_acc = (tf.keras.metrics.SparseCategoricalAccuracy(), tf.keras.metrics.Mean(),
                          tf.keras.metrics.SparseCategoricalAccuracy())
    global_train = iter(tf.data.Dataset.from_tensor_slices((ids, labels)).batch(
        batch * WORKERS).repeat())
    global_val = iter(tf.data.Dataset.from_tensor_slices((ids[:128], labels[:128])).batch(
        batch * WORKERS).repeat())
    expected = []
    for _ in range(epochs):
        for _ in range(steps):
            x, y = next(global_train)
            with tf.GradientTape() as tape:
                logits = local(x, training=True)
                loss_value = tf.reduce_mean(loss_fn(y, logits))
            grads = tape.gradient(loss_value, local.trainable_weights)
            local_opt.apply_gradients(zip(grads, local.trainable_weights))
            acc.update_state(y, logits)
            mean.update_state(loss_fn(y, logits))
        expected.append((float(acc.result()), float(mean.result())))
        acc.reset_states()
        mean.reset_states()
        for _ in range(2):
            x, y = next(global_val)
            val_acc.update_state(y, local(x, training=False))
        expected.append((float(val_acc.result()), float(val_acc.count)))
        val_acc.reset_states()
    diff = max(float(np.max(np.abs(a - b)))
               for a, b in zip(model.get_weights(), local.get_weights()))
    check("scratch_loop_weights_equal_one_process", diff < 1e-5, diff)
    close = all(abs(a - b) < 1e-5 for s, e in zip(seen, expected) for a, b in zip(s, e))
    check("scratch_loop_metrics_equal_one_process", close, (seen, expected))
    check("scratch_loop_learns", seen[-2][1] < seen[0][1], seen)


@program("loop_per_execution")
def loop_per_execution(strategy):
    """Several replica steps per scheduled step, in a `tf.range` loop.

    How TF's docs teach `steps_per_execution` for custom loops, and TF's
    `ParameterServerCustomTrainingLoopTest.testCustomTrainingLoop`:
    `for _ in tf.range(k): strategy.run(replica_fn, args=(next(iterator),))`,
    `replica_fn` applies gradients and then updates an accuracy metric, a
    `Mean` of the loss only every other optimizer step, in a `tf.cond` (the
    optimizer's step counter is the same on every worker), and a `Mean` of
    the loss of the batches that are mostly positive, in an autograph `if`
    on the worker's own labels (a `tf.cond` that the workers of one step
    decide differently). Checked against one process on the global batch:
    the metrics count every example once and equal its values, and the
    losses and weights are its.
    """
    batch, k, schedules, epochs = 8, 4, 3, 2
    ids, labels = scratch_data(seed=5)
    tf.keras.utils.set_random_seed(5)
    with strategy.scope():
        model = scratch_model()
        optimizer = tf.keras.optimizers.legacy.SGD(learning_rate=0.5)
        accuracy = tf.keras.metrics.SparseCategoricalAccuracy()
        every_other = tf.keras.metrics.Mean()
        mostly_positive = tf.keras.metrics.Mean()
    initial = model.get_weights()
    loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(
        from_logits=True, reduction=tf.keras.losses.Reduction.NONE)

    @tf.function
    def train_steps(iterator):
        def replica_fn(inputs):
            x, y = inputs
            with tf.GradientTape() as tape:
                logits = model(x, training=True)
                per_example = loss_fn(y, logits)
                loss = tf.nn.compute_average_loss(per_example)
            grads = tape.gradient(loss, model.trainable_weights)
            optimizer.apply_gradients(zip(grads, model.trainable_weights))
            accuracy.update_state(y, logits)
            tf.cond(optimizer.iterations % 2 == 0,
                    lambda: tf.group(every_other.update_state(per_example)), tf.no_op)
            if tf.reduce_sum(y) * 2 > tf.size(y, out_type=y.dtype):
                mostly_positive.update_state(per_example)
            return loss

        total = tf.constant(0.0)
        for _ in tf.range(k):
            loss = strategy.run(replica_fn, args=(next(iterator),))
            total += strategy.reduce(tf.distribute.ReduceOp.SUM, loss, axis=None)
        return total

    coordinator = tf.distribute.experimental.coordinator.ClusterCoordinator(strategy)
    train = tf.data.Dataset.from_tensor_slices((ids, labels)).batch(batch).repeat()
    iterator = iter(coordinator.create_per_worker_dataset(train))
    seen, losses = [], []
    for _ in range(epochs):
        values = [coordinator.schedule(train_steps, args=(iterator,))
                  for _ in range(schedules)]
        coordinator.join()
        losses.extend(float(v.fetch()) for v in values)
        seen.append((float(accuracy.result()), float(accuracy.count),
                     float(every_other.result()), float(every_other.count),
                     float(mostly_positive.result()), float(mostly_positive.count)))
        for metric in (accuracy, every_other, mostly_positive):
            metric.reset_states()

    # One process, global batch = WORKERS * batch, same examples in the same order.
    local = scratch_model()
    local.set_weights(initial)
    local_opt = tf.keras.optimizers.legacy.SGD(learning_rate=0.5)
    acc, mean, positive = (tf.keras.metrics.SparseCategoricalAccuracy(),
                           tf.keras.metrics.Mean(), tf.keras.metrics.Mean())
    disagreements = 0  # replica steps whose workers decide the `if` differently
    global_train = iter(tf.data.Dataset.from_tensor_slices((ids, labels)).batch(
        batch * WORKERS).repeat())
    expected, expected_losses = [], []
    for _ in range(epochs):
        for _ in range(schedules):
            total = 0.0
            for _ in range(k):
                x, y = next(global_train)
                with tf.GradientTape() as tape:
                    logits = local(x, training=True)
                    per_example = loss_fn(y, logits)
                    loss = tf.reduce_mean(per_example)
                grads = tape.gradient(loss, local.trainable_weights)
                local_opt.apply_gradients(zip(grads, local.trainable_weights))
                acc.update_state(y, logits)
                if int(local_opt.iterations) % 2 == 0:
                    mean.update_state(per_example)
                decisions = []
                for w in range(WORKERS):  # worker w's batch is this slice of the global one
                    part = slice(w * batch, (w + 1) * batch)
                    decisions.append(int(tf.reduce_sum(y[part])) * 2 > batch)
                    if decisions[-1]:
                        positive.update_state(per_example[part])
                disagreements += len(set(decisions)) > 1
                total += float(loss)
            expected_losses.append(total)
        expected.append((float(acc.result()), float(acc.count), float(mean.result()),
                         float(mean.count), float(positive.result()), float(positive.count)))
        for metric in (acc, mean, positive):
            metric.reset_states()
    examples = schedules * k * batch * WORKERS
    check("loop_per_execution_counts_every_example",
          [s[1] for s in seen] == [examples] * epochs
          and [s[3] for s in seen] == [examples / 2] * epochs, seen)
    close = all(abs(a - b) < 1e-5 for s, e in zip(seen, expected) for a, b in zip(s, e))
    check("loop_per_execution_metrics_equal_one_process", close and disagreements > 0,
          (seen, expected, disagreements))
    check("loop_per_execution_losses_equal_one_process",
          np.allclose(losses, expected_losses, atol=1e-5), (losses, expected_losses))
    diff = max(float(np.max(np.abs(a - b)))
               for a, b in zip(model.get_weights(), local.get_weights()))
    check("loop_per_execution_weights_equal_one_process", diff < 1e-5, diff)


@program("fit_with_preprocessing")
def fit_with_preprocessing(strategy):
    """`model.fit` on a plain Dataset through a StringLookup in the input pipeline."""
    tf.keras.utils.set_random_seed(4)
    vocab = [f"item{i}" for i in range(20)]
    lookup = tf.keras.layers.StringLookup(vocabulary=vocab)
    rng = np.random.default_rng(4)
    items = rng.choice(vocab, size=(400, 1))
    label = np.array([[float(int(s[0][4:]) % 2)] for s in items], "float32")
    ds = tf.data.Dataset.from_tensor_slices((items, label)).map(
        lambda s, y: (lookup(s), y)).batch(16).repeat()
    with strategy.scope():
        model = tf.keras.Sequential([tf.keras.Input((1,), dtype="int64"),
                                     tf.keras.layers.Embedding(lookup.vocabulary_size(), 4),
                                     tf.keras.layers.Flatten(), tf.keras.layers.Dense(1)])
        model.compile(tf.keras.optimizers.legacy.Adagrad(0.3), loss="mse",
                      metrics=[tf.keras.metrics.BinaryAccuracy(threshold=0.5)])
    history = model.fit(ds, epochs=3, steps_per_epoch=10, verbose=0)
    losses = history.history["loss"]
    check("fit_with_preprocessing_loss_falls", losses[-1] < losses[0], losses)
    check("fit_with_preprocessing_metric", history.history["binary_accuracy"][-1] > 0.6,
          history.history)


PROGRAMS = {"tutorial_custom_loop": tutorial_custom_loop, "tutorial_fit": tutorial_fit,
            "scratch_loop": scratch_loop, "loop_per_execution": loop_per_execution,
            "fit_with_preprocessing": fit_with_preprocessing}


def main():
    """argv: [EMBEDDING_UPDATES [PROGRAM ...]]: the strategy's table mode, and
    which programs (default "sync" and all of them)."""
    tf_psplugin.start_server()
    updates = sys.argv[1] if len(sys.argv) > 1 else "sync"
    strategy = tf_psplugin.HybridParameterServerStrategy(
        options=tf_psplugin.HybridOptions(embedding_updates=updates))
    for name in sys.argv[2:] or list(PROGRAMS):
        PROGRAMS[name](strategy)
    print("DONE", flush=True)


if __name__ == "__main__":
    main()
