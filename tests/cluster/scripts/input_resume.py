"""A resumed job continues each worker's input where it stood (`save_input_position`).

One chief process plays three jobs on one cluster, with TFRecord files read
by file (each worker its own files), 2 workers, plain SGD:

* straight: 8 steps in one `fit`;
* resumed: 5 steps with `ChiefCheckpoint(save_input_position=True)`, then a
  new model and callback (a restarted job) restores step 5 and fits 3 more
  steps on the dataset built from its start: its weights must equal
  straight's (the input continued exactly where it stood);
* control: the same without `save_input_position`: the input starts over,
  so the weights differ (the check above can fail).

The custom loop does the same with `ChiefCheckpointManager(input_iterator=...)`.
argv[1]: a scratch directory.
"""

import os
import sys

import numpy as np
import tensorflow as tf

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tf_psplugin  # noqa: E402
from checks import check  # noqa: E402

BATCH = 4
FILES = 4
RECORDS = 64


def write_files(folder):
    rng = np.random.default_rng(0)
    paths = []
    for f in range(FILES):
        path = os.path.join(folder, f"part-{f}.tfrecord")
        with tf.io.TFRecordWriter(path) as w:
            for _ in range(RECORDS):
                x = rng.normal(size=4).astype(np.float32)
                y = np.float32(x @ np.array([1.0, -2.0, 0.5, 3.0]) + rng.normal())
                example = tf.train.Example(features=tf.train.Features(feature={
                    "x": tf.train.Feature(float_list=tf.train.FloatList(value=x)),
                    "y": tf.train.Feature(float_list=tf.train.FloatList(value=[y]))}))
                w.write(example.SerializeToString())
        paths.append(path)
    return paths


def dataset(paths):
    spec = {"x": tf.io.FixedLenFeature([4], tf.float32),
            "y": tf.io.FixedLenFeature([1], tf.float32)}

    def parse(record):
        example = tf.io.parse_single_example(record, spec)
        return example["x"], example["y"]

    return tf.data.TFRecordDataset(paths).map(parse).batch(BATCH, drop_remainder=True)


def new_model(strategy):
    with strategy.scope():
        model = tf.keras.Sequential([tf.keras.Input((4,)), tf.keras.layers.Dense(
            1, kernel_initializer="zeros", bias_initializer="zeros")])
        model.compile(tf.keras.optimizers.legacy.SGD(0.05), "mse")
    return model


def weights(model):
    return np.concatenate([w.reshape(-1) for w in model.get_weights()])


def fit_resumed(strategy, paths, model_dir, save_input):
    first = new_model(strategy)
    first.fit(dataset(paths), epochs=1, steps_per_epoch=5, verbose=0, callbacks=[
        tf_psplugin.ChiefCheckpoint(model_dir, save_every_steps=5,
                                    save_input_position=save_input)])
    second = new_model(strategy)  # A restarted job: new model, new callback, new dataset.
    second.fit(dataset(paths), epochs=1, steps_per_epoch=3, verbose=0, callbacks=[
        tf_psplugin.ChiefCheckpoint(model_dir, save_every_steps=5,
                                    save_input_position=save_input)])
    return second


def custom_loop(strategy, coordinator, paths, model_dir, steps, resume_at=None):
    """Trains `steps` steps with a ChiefCheckpointManager tracking the iterator; returns weights."""
    model = new_model(strategy)
    optimizer = model.optimizer

    @tf.function
    def step(iterator):
        def replica(x, y):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(model(x) - y))
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
        x, y = next(iterator)
        strategy.run(replica, args=(x, y))

    iterator = iter(coordinator.create_per_worker_dataset(dataset(paths)))
    manager = tf_psplugin.ChiefCheckpointManager(model_dir, model=model, optimizer=optimizer,
                                           input_iterator=iterator)
    info = manager.restore_or_initialize()
    done = info.step if info else 0
    while done < steps:
        coordinator.schedule(step, args=(iterator,))
        done += 1
        if resume_at is not None and done == resume_at:
            break
    coordinator.join()
    manager.save(done)
    return weights(model)


def main():
    scratch = sys.argv[1]
    tf_psplugin.start_server()
    strategy = tf_psplugin.HybridParameterServerStrategy(
        options=tf_psplugin.HybridOptions(log_placement=False))
    coordinator = tf.distribute.experimental.coordinator.ClusterCoordinator(strategy)
    paths = write_files(scratch)

    straight = new_model(strategy)
    straight.fit(dataset(paths), epochs=1, steps_per_epoch=8, verbose=0)
    want = weights(straight)

    model_dir = os.path.join(scratch, "resumed")
    got = weights(fit_resumed(strategy, paths, model_dir, save_input=True))
    diff = float(np.abs(got - want).max())
    check("fit_resumed_input_continues", diff < 1e-6, f"max |diff| {diff:.3g}")
    saved = sorted(tf.io.gfile.listdir(os.path.join(model_dir, "ckpt-5.input")))
    check("input_state_written_by_each_worker",
          {"worker-0.index", "worker-1.index", "meta.json"} <= set(saved), saved)

    control = weights(fit_resumed(strategy, paths, os.path.join(scratch, "control"), False))
    diff = float(np.abs(control - want).max())
    check("fit_resumed_without_it_starts_over", diff > 1e-4, f"max |diff| {diff:.3g}")

    want = custom_loop(strategy, coordinator, paths, os.path.join(scratch, "loop_straight"), 8)
    loop_dir = os.path.join(scratch, "loop_resumed")
    custom_loop(strategy, coordinator, paths, loop_dir, 8, resume_at=5)
    got = custom_loop(strategy, coordinator, paths, loop_dir, 8)
    diff = float(np.abs(got - want).max())
    check("custom_loop_resumed_input_continues", diff < 1e-6, f"max |diff| {diff:.3g}")
    print("DONE", flush=True)


if __name__ == "__main__":
    main()
