"""Finite data in synchronous mode, checked against one cluster in one chief.

Used by tests/cluster/test_finite_data.py. Each check prints `CHECK <name>
ok` or `CHECK <name> FAIL <why>`; the script goes on after a failed check,
and ends with `DONE`. What an epoch is here: tf_psplugin/runtime/epochs.py.

Every dataset has a batch count that is not a multiple of the 2 workers, and
its last batch is partial, so every check would fail if the remainder were
handled as stock PSS or the plugin before it handled it (CancelledError, or a
hang in a collective).
"""

import collections
import io
import os
import re
import shutil
import tempfile
import time

import numpy as np
import tensorflow as tf

import tf_psplugin
from checks import check  # tests/cluster/scripts/checks.py

BATCH, FEATURES, VOCAB, DIM = 8, 3, 40, 4
EXAMPLES = 10 * BATCH + 3  # 11 batches of 8, the last one holds 3 examples.
TOL = 1e-5


def data(n=EXAMPLES, seed=0):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, VOCAB, size=(n, FEATURES)).astype("int64")
    y = (rng.random((n, 1)) < 0.4).astype("float32")
    return ids, y


def make_model():
    inp = tf.keras.Input((FEATURES,), dtype="int64")
    x = tf.keras.layers.Embedding(
        VOCAB, DIM, embeddings_initializer=tf.keras.initializers.RandomUniform(seed=1),
        name="table")(inp)
    x = tf.keras.layers.Flatten()(x)
    x = tf.keras.layers.Dense(8, activation="relu",
                              kernel_initializer=tf.keras.initializers.GlorotUniform(seed=2))(x)
    out = tf.keras.layers.Dense(1, activation="sigmoid",
                                kernel_initializer=tf.keras.initializers.GlorotUniform(seed=3))(x)
    return tf.keras.Model(inp, out)


def compile_model(model, spe=1):
    model.compile(tf.keras.optimizers.legacy.SGD(0.1), "binary_crossentropy",
                  metrics=[tf.keras.metrics.BinaryAccuracy(name="acc"),
                           tf.keras.metrics.AUC(name="auc")],
                  steps_per_execution=spe)


def logical_weights(model):
    out = []
    for layer in model.layers:
        if isinstance(layer, tf.keras.layers.Embedding):
            out.append(tf.convert_to_tensor(layer.embeddings).numpy())
        else:
            out.extend(w.numpy() for w in layer.weights)
    return out


def reference_like(model):
    """A single-process model with `model`'s current weights."""
    ref = make_model()
    weights = logical_weights(model)
    for layer in ref.layers:
        n = len(layer.weights)
        layer.set_weights(weights[:n])
        weights = weights[n:]
    compile_model(ref)
    return ref


def max_diff(a, b):
    return max(float(np.abs(x - y).max()) for x, y in zip(logical_weights(a), logical_weights(b)))


def close(got, want):
    return all(abs(got[k] - want[k]) <= TOL for k in want), {k: (got[k], want[k]) for k in want}


def check_fit_epochs(strategy, name, dataset, spe=1):
    """fit(epochs=3) ends cleanly; equals one process on the full global batches."""
    with strategy.scope():
        model = make_model()
        compile_model(model, spe)
    ref = reference_like(model)
    try:
        hist = model.fit(dataset, epochs=3, verbose=0)
    except Exception as e:  # noqa: BLE001 - reported as the check's failure.
        check(name, False, f"fit raised {type(e).__name__}: {e}")
        return
    # 11 batches over 2 workers: 5 full global steps per epoch, batch 10 dropped
    # (and 11, the partial one): one process on global batches 0-9.
    ids, y = data()
    kept = 10 * BATCH
    ref_ds = tf.data.Dataset.from_tensor_slices((ids[:kept], y[:kept])).batch(2 * BATCH)
    ref_hist = ref.fit(ref_ds, epochs=3, verbose=0)
    diff = max_diff(model, ref)
    epochs = len(hist.history["loss"])
    ok = epochs == 3 and diff <= TOL and abs(hist.history["loss"][-1]
                                            - ref_hist.history["loss"][-1]) <= TOL
    check(name, ok, f"epochs={epochs} max|w-ref|={diff:g} loss={hist.history['loss']} "
          f"ref={ref_hist.history['loss']}")


def check_evaluate(strategy, name, dataset, model):
    """evaluate counts every example once: equals one process on the same data."""
    ids, y = data()
    want = reference_like(model).evaluate(ids, y, batch_size=BATCH, verbose=0, return_dict=True)
    try:
        got = model.evaluate(dataset, verbose=0, return_dict=True)
    except Exception as e:  # noqa: BLE001
        check(name, False, f"evaluate raised {type(e).__name__}: {e}")
        return
    ok, detail = close(got, want)
    check(name, ok, detail)


def check_custom_loop_uneven(coordinator, known_length=True):
    """A dataset function with uneven shards: every worker stops at the shortest.

    Worker 0 has 3 batches, worker 1 has 5. With `known_length` the shards
    keep their cardinality (agreed before the epoch); without it a filter
    hides it, and the end is agreed step by step, with no counting pass.
    Checks `custom_loop_uneven_epoch{0,1}` and `custom_loop_usable_after`
    (or `custom_loop_unknown_length_...`).
    """
    prefix = "custom_loop_uneven" if known_length else "custom_loop_unknown_length"
    usable = "custom_loop_usable_after" if known_length else f"{prefix}_usable_after"

    def dataset_fn():
        index = tf.distribute.coordinator.experimental_get_current_worker_index()
        n = tf.cast(3 + 2 * index, tf.int64)
        if known_length:
            return tf.data.Dataset.range(100).take(n * 2).batch(2)
        return tf.data.Dataset.range(100).filter(lambda x: x < n * 2).batch(2)

    @tf.function
    def step(iterator):
        return tf.reduce_sum(next(iterator))

    per_worker = coordinator.create_per_worker_dataset(dataset_fn)
    for epoch in range(2):
        start = time.monotonic()
        it = iter(per_worker)
        results, error = [], None
        try:
            for _ in range(8):
                results.append(coordinator.schedule(step, args=(it,)))
            coordinator.join()
        except Exception as e:  # noqa: BLE001
            error = e
        done = []
        for r in results:
            try:
                done.append(int(r.fetch()))
            except Exception:  # noqa: BLE001 - cancelled or out of range.
                pass
        took = time.monotonic() - start
        # Worker 0's steps: batches (0,1), (2,3), (4,5): sums 1, 5, 9.
        check(f"{prefix}_epoch{epoch}",
              isinstance(error, tf.errors.OutOfRangeError) and done == [1, 5, 9] and took < 30,
              f"error={type(error).__name__}: {error} steps={done} took={took:.1f}s")
    # The cluster is still usable after the epochs ended.
    try:
        value = int(coordinator.schedule(step, args=(iter(per_worker),)).fetch())
        coordinator.join()
        check(usable, value == 0 + 1, value)
    except Exception as e:  # noqa: BLE001
        check(usable, False, repr(e))


def check_endless_filtered_stream(strategy):
    """An endless stream of unknown length with steps_per_epoch trains at once."""
    ids, y = data()
    stream = (tf.data.Dataset.from_tensor_slices((ids, y)).repeat()
              .filter(lambda x, t: tf.reduce_sum(x) % 7 != 0).batch(BATCH))
    with strategy.scope():
        model = make_model()
        compile_model(model)
    start = time.monotonic()
    try:
        hist = model.fit(stream, epochs=2, steps_per_epoch=5, verbose=0)
        took = time.monotonic() - start
        check("fit_endless_filtered_stream", len(hist.history["loss"]) == 2 and took < 60,
              f"took={took:.1f}s history={hist.history}")
    except Exception as e:  # noqa: BLE001
        check("fit_endless_filtered_stream", False, repr(e))


def check_fit_runs_out_with_steps(strategy):
    """Finite data of unknown length, more steps than data: Keras's rule, no hang."""
    ids, y = data()
    short = tf.data.Dataset.from_tensor_slices((ids, y)).filter(lambda x, t: True).batch(BATCH)
    with strategy.scope():
        model = make_model()
        compile_model(model)
    start = time.monotonic()
    error = None
    try:
        model.fit(short, epochs=1, steps_per_epoch=50, verbose=0)
    except Exception as e:  # noqa: BLE001 - Keras may surface the cancelled last step.
        error = e
    took = time.monotonic() - start
    trained = int(model.optimizer.iterations.numpy())
    # 11 batches over 2 workers: 5 steps every worker can take.
    check("fit_runs_out_with_steps",
          trained == 5 and took < 60 and (error is None or isinstance(
              error, (tf.errors.OutOfRangeError, tf.errors.CancelledError))),
          f"iterations={trained} took={took:.1f}s error={error!r}")
    try:
        model.fit(tf.data.Dataset.from_tensor_slices((ids, y)).batch(BATCH).repeat(),
                  epochs=1, steps_per_epoch=2, verbose=0)
        check("fit_after_running_out", int(model.optimizer.iterations.numpy()) == trained + 2,
              int(model.optimizer.iterations.numpy()))
    except Exception as e:  # noqa: BLE001
        check("fit_after_running_out", False, repr(e))


def check_batch_counter(strategy):
    """tf-keras's PSS metric test (batch counter over fit and evaluate), in our words.

    40 batches, 20 per worker: `steps_per_epoch=20` is one pass per epoch
    (a step reads one batch on every worker), so every epoch starts the data
    over and counts all 40 batches, as stock PSS's 40 steps do.
    """

    class BatchCount(tf.keras.metrics.Sum):
        def __init__(self, name="batch_count", dtype=tf.int64):
            super().__init__(name=name, dtype=dtype)

        def update_state(self, y_true, y_pred, sample_weight=None):
            return super().update_state(1, sample_weight)

    with strategy.scope():
        inputs = tf.keras.layers.Input((1,))
        model = tf.keras.Model(inputs, tf.keras.layers.Dense(1)(inputs))
        model.compile(loss="mse", metrics=[BatchCount()], steps_per_execution=2)
    x, val_x = np.ones((400, 1)), np.ones((100, 1))
    train = tf.data.Dataset.from_tensor_slices((x, x)).batch(10)
    val = tf.data.Dataset.from_tensor_slices((val_x, val_x)).batch(10)
    try:
        hist = model.fit(train, steps_per_epoch=20, validation_data=val, validation_steps=5,
                         epochs=5, verbose=0)
        check("batch_counter_fit",
              hist.history["batch_count"] == [40] * 5
              and hist.history["val_batch_count"] == [10] * 5, hist.history)
    except Exception as e:  # noqa: BLE001
        check("batch_counter_fit", False, repr(e))
    try:
        result = model.evaluate(train, steps=20, verbose=0)
        check("batch_counter_evaluate", result[-1] == 40, result)
    except Exception as e:  # noqa: BLE001
        check("batch_counter_evaluate", False, repr(e))


def check_file_sharding(strategy, coordinator):
    """A TFRecord input is sharded by file: each worker opens its own files only.

    4 files of 12 records (file id, example id), batches of 3: worker i must
    see only files i, i+2 (asserted in the step, on the worker), and an
    epoch must count every example once. `auto_shard_policy` OFF makes every
    worker read everything (each example twice); DATA shards by batch.
    """
    import tempfile  # pylint: disable=g-import-not-at-top

    folder = tempfile.mkdtemp(prefix="file_sharding_")
    files = []
    for f in range(4):
        path = os.path.join(folder, f"part-{f}.tfrecord")
        with tf.io.TFRecordWriter(path) as writer:
            for e in range(12):
                example = tf.train.Example(features=tf.train.Features(feature={
                    "file": tf.train.Feature(int64_list=tf.train.Int64List(value=[f])),
                    "id": tf.train.Feature(int64_list=tf.train.Int64List(value=[f * 12 + e])),
                }))
                writer.write(example.SerializeToString())
        files.append(path)
    spec = {"file": tf.io.FixedLenFeature([], tf.int64), "id": tf.io.FixedLenFeature([], tf.int64)}

    def make(policy=None):
        ds = tf.data.TFRecordDataset(files).map(
            lambda r: tf.io.parse_single_example(r, spec)).batch(3)
        if policy is not None:
            options = tf.data.Options()
            options.experimental_distribute.auto_shard_policy = policy
            ds = ds.with_options(options)
        return ds

    with strategy.scope():
        seen = tf.keras.metrics.Sum()

    def run(dataset, by_file):
        @tf.function
        def step(iterator):
            batch = next(iterator)
            if by_file:
                worker = tf.cast(
                    tf.distribute.coordinator.experimental_get_current_worker_index(), tf.int64)
                tf.debugging.assert_equal(batch["file"] % 2, worker + 0 * batch["file"],
                                          message="a worker read another worker's file")

            def replica_fn(ids):
                seen.update_state(tf.cast(ids, tf.float32))
            strategy.run(replica_fn, args=(batch["id"],))

        seen.reset_state()
        it = iter(coordinator.create_per_worker_dataset(dataset))
        try:
            for _ in range(40):
                coordinator.schedule(step, args=(it,))
            coordinator.join()
        except tf.errors.OutOfRangeError:
            pass
        return float(seen.result())

    total = float(sum(range(48)))
    for name, policy, by_file, want in (
            ("file_sharding_auto", None, True, total),
            ("file_sharding_data_policy", tf.data.experimental.AutoShardPolicy.DATA, False, total),
            ("file_sharding_off_policy", tf.data.experimental.AutoShardPolicy.OFF, False,
             2 * total)):
        try:
            got = run(make(policy), by_file)
            check(name, got == want, f"sum of ids {got}, want {want}")
        except Exception as e:  # noqa: BLE001
            check(name, False, repr(e))


def check_fit_files_read_once(strategy, folder):
    """fit(files, epochs=2), no steps_per_epoch: each record is read once per epoch.

    4 TFRecord files sharded by file (worker 0 reads files 0 and 2: 22
    records; worker 1 files 1 and 3: 16), batches of 4: 4 steps per epoch,
    the shortest worker's. A map right after the reader writes one empty
    file per record read (named by the record's id and a random number), so
    the checks count reads per record: worker 1's records are read exactly
    once per epoch (a counting pass before the first epoch made it three
    times per fit), worker 0's at most once. The weights equal one process
    on the global batches (worker 0's batch k with worker 1's), the
    epochs are 2 of 4 steps with an unknown length at the start,
    and the progress bar shows no total in the first epoch, as Keras does.
    """
    reads = os.path.join(folder, "reads")
    os.mkdir(reads)
    sizes = (13, 9, 9, 7)  # Files 0, 2 -> worker 0 (22); 1, 3 -> worker 1 (16).
    ids, y = data(sum(sizes), seed=3)
    files, records, start = [], [[], []], 0
    for f, size in enumerate(sizes):
        path = os.path.join(folder, f"part-{f}.tfrecord")
        with tf.io.TFRecordWriter(path) as writer:
            for r in range(start, start + size):
                writer.write(tf.train.Example(features=tf.train.Features(feature={
                    "x": tf.train.Feature(int64_list=tf.train.Int64List(value=ids[r])),
                    "y": tf.train.Feature(float_list=tf.train.FloatList(value=y[r])),
                    "id": tf.train.Feature(int64_list=tf.train.Int64List(value=[r])),
                })).SerializeToString())
                records[f % 2].append(r)
        files.append(path)
        start += size
    spec = {"x": tf.io.FixedLenFeature([FEATURES], tf.int64),
            "y": tf.io.FixedLenFeature([1], tf.float32),
            "id": tf.io.FixedLenFeature([], tf.int64)}

    def mark_read(record):
        example = tf.io.parse_single_example(record, spec)
        name = tf.strings.join([reads, "/", tf.strings.as_string(example["id"]), "-",
                                tf.strings.as_string(tf.random.uniform(
                                    [], maxval=2**62, dtype=tf.int64))])
        with tf.control_dependencies([tf.io.write_file(name, "")]):
            return tf.identity(example["x"]), tf.identity(example["y"])

    dataset = tf.data.TFRecordDataset(files).map(mark_read).batch(4)
    options = tf.data.Options()
    # FILE, not AUTO: AUTO's check that file sharding works reads a batch.
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.FILE
    dataset = dataset.with_options(options)

    def read_counts():
        return collections.Counter(int(n.split("-")[0]) for n in os.listdir(reads))

    class Record(tf.keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            self.steps_param, self.batches, self.windows = self.params.get("steps"), [], []

        def on_epoch_begin(self, epoch, logs=None):
            self.before = read_counts()
            self.start = int(self.model.optimizer.iterations.numpy())

        def on_epoch_end(self, epoch, logs=None):  # (Keras refuses batch hooks under PSS.)
            self.windows.append(read_counts() - self.before)
            self.batches.append(int(self.model.optimizer.iterations.numpy()) - self.start)

    with strategy.scope():
        model = make_model()
        compile_model(model)
    ref = reference_like(model)
    record, out = Record(), io.StringIO()
    bar = tf_psplugin.ProgressBar(stream=out, dynamic=False, line_every_seconds=1e-9)
    try:
        hist = model.fit(dataset, epochs=2, verbose=1, callbacks=[record, bar])
    except Exception as e:  # noqa: BLE001 - reported as the checks' failure.
        for name in ("fit_files_read_once", "fit_files_weights", "fit_files_callbacks",
                     "fit_files_progress_unknown_total"):
            check(name, False, f"fit raised {type(e).__name__}: {e}")
        return
    total = read_counts()
    w1 = [total[r] for r in records[1]]
    w0 = [total[r] for r in records[0]]
    epoch0_w1 = [record.windows[0][r] for r in records[1]]
    measured = (f"reads per record over the fit: worker 0 {w0} worker 1 {w1}; worker 1 in "
                f"epoch 1 {epoch0_w1}; records read {sum(total.values())} of "
                f"{2 * sum(sizes)} (2 epochs)")
    print("fit_files_read_once:", measured, flush=True)
    check("fit_files_read_once",
          w1 == [2] * len(w1) and max(w0) <= 2 and epoch0_w1 == [1] * len(w1), measured)
    # One process on the global batches: worker 0's batch k and worker 1's.
    order = [r for k in range(4) for r in records[0][4 * k:4 * k + 4] + records[1][4 * k:4 * k + 4]]
    ref_ds = tf.data.Dataset.from_tensor_slices((ids[order], y[order])).batch(8)
    ref_hist = ref.fit(ref_ds, epochs=2, verbose=0)
    diff = max_diff(model, ref)
    losses = np.abs(np.array(hist.history["loss"]) - np.array(ref_hist.history["loss"]))
    check("fit_files_weights", diff <= TOL and float(losses.max()) <= TOL,
          f"max|w-ref|={diff:g} loss={hist.history['loss']} ref={ref_hist.history['loss']}")
    check("fit_files_callbacks", record.steps_param is None and record.batches == [4, 4]
          and int(model.optimizer.iterations.numpy()) == 8,
          f"params steps={record.steps_param} batches per epoch={record.batches} "
          f"iterations={int(model.optimizer.iterations.numpy())}")
    text = out.getvalue()
    first, _, second = text.partition("Epoch 2/2")
    first_lines = [line for line in first.splitlines() if re.match(r"\d", line)]
    second_lines = [line for line in second.splitlines() if re.match(r"\d", line)]
    check("fit_files_progress_unknown_total",
          [line.split(" ")[0:2] for line in first_lines[:-1]]
          == [[str(k), "steps"] for k in range(1, 5)]
          and first_lines[-1].startswith("4/4 [")
          and second_lines and all(re.match(r"\d/4 \[", line) for line in second_lines),
          repr(text))


def check_custom_loop_sharded(coordinator):
    """A tf.data.Dataset sharded by the coordinator: OutOfRangeError, not CancelledError."""
    ds = tf.data.Dataset.range(11 * 4).batch(4)  # 11 batches over 2 workers.

    @tf.function
    def step(iterator):
        return tf.reduce_sum(next(iterator))

    it = iter(coordinator.create_per_worker_dataset(ds))
    count = 0
    error = None
    try:
        for _ in range(20):
            coordinator.schedule(step, args=(it,))
            count += 1
        coordinator.join()
    except Exception as e:  # noqa: BLE001
        error = e
    check("custom_loop_sharded_out_of_range", isinstance(error, tf.errors.OutOfRangeError),
          f"{type(error).__name__}: {error} after {count} schedules")


def main():
    tf_psplugin.start_server()
    strategy = tf_psplugin.HybridParameterServerStrategy()
    coordinator = tf.distribute.experimental.coordinator.ClusterCoordinator(strategy)
    ids, y = data()
    ds = tf.data.Dataset.from_tensor_slices((ids, y)).batch(BATCH)

    check_fit_epochs(strategy, "fit_epochs_known_length", ds)
    unknown = ds.filter(lambda x, y: True)
    check("unknown_cardinality_input",
          int(unknown.cardinality()) == tf.data.UNKNOWN_CARDINALITY, unknown.cardinality())
    check_fit_epochs(strategy, "fit_epochs_unknown_length", unknown)
    # Keras cuts the last execution of an epoch short (5 steps, 2 per execution).
    check_fit_epochs(strategy, "fit_epochs_steps_per_execution", ds, spe=2)

    with strategy.scope():
        model = make_model()
        compile_model(model)
    model.fit(ds.repeat(), epochs=1, steps_per_epoch=3, verbose=0)
    check_evaluate(strategy, "evaluate_exact", ds, model)
    check_evaluate(strategy, "evaluate_exact_unknown_length", unknown, model)
    # A static batch size (drop_remainder=True): 9 batches, padded all the same.
    ids_s, y_s = ids[:9 * BATCH], y[:9 * BATCH]
    static = tf.data.Dataset.from_tensor_slices((ids[:9 * BATCH + 5], y[:9 * BATCH + 5])).batch(
        BATCH, drop_remainder=True)
    want = reference_like(model).evaluate(ids_s, y_s, batch_size=BATCH, verbose=0,
                                          return_dict=True)
    try:
        got = model.evaluate(static, verbose=0, return_dict=True)
        ok, detail = close(got, want)
        check("evaluate_exact_static_batch", ok, detail)
    except Exception as e:  # noqa: BLE001
        check("evaluate_exact_static_batch", False, repr(e))

    # fit's validation data is evaluation input too.
    want = reference_like(model).evaluate(ids, y, batch_size=BATCH, verbose=0, return_dict=True)
    try:
        hist = model.fit(ds.repeat(), epochs=1, steps_per_epoch=1, validation_data=ds,
                         verbose=0)
        # Validation ran after the training step: compare with the trained weights.
        want = reference_like(model).evaluate(ids, y, batch_size=BATCH, verbose=0,
                                              return_dict=True)
        got = {k: hist.history["val_" + k][0] for k in want}
        ok, detail = close(got, want)
        check("fit_validation_exact", ok, detail)
    except Exception as e:  # noqa: BLE001
        check("fit_validation_exact", False, repr(e))

    try:
        pred = model.predict(ds, verbose=0)
        want = reference_like(model).predict(ids, batch_size=BATCH, verbose=0)
        check("predict_finite", pred.shape == (EXAMPLES, 1)
              and float(np.abs(pred - want).max()) <= TOL, pred.shape)
    except Exception as e:  # noqa: BLE001
        check("predict_finite", False, repr(e))

    check_custom_loop_sharded(coordinator)
    check_custom_loop_uneven(coordinator)
    check_custom_loop_uneven(coordinator, known_length=False)
    check_endless_filtered_stream(strategy)
    check_fit_runs_out_with_steps(strategy)
    check_batch_counter(strategy)
    check_file_sharding(strategy, coordinator)
    folder = tempfile.mkdtemp(prefix="files_read_once_")
    try:
        check_fit_files_read_once(strategy, folder)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    print("DONE", flush=True)


if __name__ == "__main__":
    main()
