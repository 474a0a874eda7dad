"""The chief of one `benchmarks.time_to_auc` setup: trains the demo model, scores it as it goes.

Why this module exists: time to a target AUC needs the held-out AUC at
known points of the training clock, measured without the evaluation's own
time on that clock. Keras joins every scheduled step at each epoch end (also
under ParameterServerStrategy), so this chief trains in epochs of
``eval_every_steps`` global steps and, at each epoch end, stops the clock,
copies the trained weights into a plain local copy of the model, scores the
held-out set and starts the clock again. It prints one ``AUC_EVAL {json}``
line per evaluation and stops at the first evaluation at or above the
target, or once the training clock passes ``max_seconds``.

    python -m benchmarks.auc_chief '<json job>'   # TF_CONFIG: the chief of a PS cluster

The model, data and held-out set are the demo's (`keras_examples/ctr.py`,
what `make demo` trains): `build_ctr_model`, `compile_ctr_model` (legacy
Adagrad at the job's learning rate, steps_per_execution), SyntheticCTR with
the demo's vocabulary and seed, held-out batches from far beyond any
training data.

Data per setup: every worker ``i`` of W reads global batches ``i, i + W,
...`` of the demo's stream, so every setup trains on the same examples.
Stock PSS's workers find ``i`` with
``tf.distribute.coordinator.experimental_get_current_worker_index`` (PSS
gives every worker pipeline id 0 of 1); the hybrid's from the input
context's ``input_pipeline_id`` (the job's ``hybrid_input`` "self_sharded",
the default). With "auto_sharded" the hybrid reads the demo's
`dataset(per_worker_batch)` as the demo does and the strategy hands each
worker its batches, but every worker then generates every global batch
(W - 1 of W wasted: about 1.2 ms of CPU per 256 examples).
"""

import json
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
if os.environ.get("TF_PSPLUGIN_BENCH_PLUGIN_PATH"):  # A patched plugin copy to measure.
    sys.path.insert(0, os.environ["TF_PSPLUGIN_BENCH_PLUGIN_PATH"])

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from benchmarks import time_to_auc as tta  # noqa: E402
from benchmarks.procs import strategy_arguments, write_result  # noqa: E402

_INFINITE = 1 << 62  # Batches of an endless stream (SyntheticCTR's own bound).


def _ctr():
    # The demo module defines absl flags at import; nothing here parses them.
    from keras_examples import ctr  # pylint: disable=g-import-not-at-top

    return ctr


def heldout_set(job):
    """The demo's held-out examples as NumPy: (features dict, labels [N])."""
    from tf_psplugin.data import SyntheticCTR  # pylint: disable=g-import-not-at-top

    ctr = _ctr()
    gen = SyntheticCTR(vocab_size=job["vocab_size"], seed=job["seed"])
    batch = 1024  # The demo evaluator's --eval_batch_size.
    num_batches = -(-job["eval_examples"] // batch)
    ds = gen.dataset(batch, num_batches=ctr.EVAL_OFFSET_BATCHES + num_batches,
                     offset_batches=ctr.EVAL_OFFSET_BATCHES)
    dense, cat, labels = [], [], []
    for features, label in ds:
        dense.append(features["dense"].numpy())
        cat.append(features["categorical"].numpy())
        labels.append(label.numpy()[:, 0])
    n = job["eval_examples"]
    return ({"dense": np.concatenate(dense)[:n], "categorical": np.concatenate(cat)[:n]},
            np.concatenate(labels)[:n])


def sharded_dataset(job, worker_index):
    """Worker i of W reads global batches i, i + W, ... of the demo's stream.

    Args:
        job: The chief's job (vocab_size, seed, per_worker_batch, num_workers).
        worker_index: input_context -> the running worker's index (a tensor).

    Returns:
        A `DatasetCreator` for `model.fit`.
    """
    from tf_psplugin.data import SyntheticCTR  # pylint: disable=g-import-not-at-top

    gen = SyntheticCTR(vocab_size=job["vocab_size"], seed=job["seed"])
    b, w = job["per_worker_batch"], job["num_workers"]
    examples = gen.examples_fn(b)

    def batch(index):
        ex = examples(index * b)
        return {"dense": ex["dense"], "categorical": ex["categorical"]}, ex["label"]

    def dataset_fn(input_context):
        index = tf.cast(worker_index(input_context), tf.int64)
        ds = tf.data.Dataset.range(index, _INFINITE, w)
        return ds.map(batch, num_parallel_calls=tf.data.AUTOTUNE,
                      deterministic=True).prefetch(tf.data.AUTOTUNE)

    return tf.keras.utils.experimental.DatasetCreator(dataset_fn)


def _stock_worker_index(input_context):
    del input_context  # PSS gives every worker pipeline id 0 of 1.
    return tf.distribute.coordinator.experimental_get_current_worker_index()


def _hybrid_worker_index(input_context):
    return input_context.input_pipeline_id  # The running worker's (WorkerInputContext).


def build(job):
    """Strategy, compiled model, training data, examples per step of the job's setup."""
    from tf_psplugin.data import SyntheticCTR  # pylint: disable=g-import-not-at-top

    ctr = _ctr()
    setup, b, w = job["setup"], job["per_worker_batch"], job["num_workers"]
    if setup == "stock_pss":
        resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
        # The table (26 x vocab x 16 floats) over the PS tasks, the MLP whole.
        partitioner = tf.distribute.experimental.partitioners.MinSizePartitioner(
            min_shard_bytes=1 << 20, max_shards=job["num_ps"])
        strategy = tf.distribute.experimental.ParameterServerStrategy(
            resolver, variable_partitioner=partitioner)
        data = sharded_dataset(job, _stock_worker_index)
        examples_per_step = b  # One worker's batch, applied on its own.
    else:
        import tf_psplugin  # pylint: disable=g-import-not-at-top

        strategy = tf_psplugin.HybridParameterServerStrategy(
            **strategy_arguments(job, tf_psplugin))
        if job.get("hybrid_input", "self_sharded") == "self_sharded":
            data = sharded_dataset(job, _hybrid_worker_index)
        else:
            data = SyntheticCTR(vocab_size=job["vocab_size"], seed=job["seed"]).dataset(b)
        examples_per_step = b * w  # One batch per worker per (global) step.
    with strategy.scope():
        model = ctr.compile_ctr_model(
            ctr.build_ctr_model(vocab_size=job["vocab_size"], embedding_dim=job["embedding_dim"],
                                seed=job["seed"]),
            learning_rate=job["learning_rate"], steps_per_execution=job["steps_per_execution"])
    return model, data, examples_per_step


class Scorer:
    """Held-out AUC of a (distributed) model through a plain local copy.

    Built after the strategy (which connects to the cluster before any op
    runs) but outside its scope; `score` may be called inside it (Keras
    runs callbacks in the training strategy's scope): the local model's
    forward pass is traced once, here, on one held-out batch.
    """

    def __init__(self, job):
        from tf_psplugin.state import export as export_lib  # pylint: disable=g-import-not-at-top

        ctr = _ctr()
        self._logical_weights = export_lib.logical_weights
        self.local = ctr.build_ctr_model(vocab_size=job["vocab_size"],
                                         embedding_dim=job["embedding_dim"], seed=job["seed"])
        self.features, self.labels = heldout_set(job)
        self.batch = 4096
        self._forward = tf.function(lambda x: self.local(x, training=False))
        self._logits(0, self.batch)  # Trace now, outside the strategy's scope.

    def _logits(self, start, stop):
        return self._forward({k: tf.constant(v[start:stop]) for k, v in self.features.items()})

    def score(self, model) -> float:
        self.local.set_weights(self._logical_weights(model))
        n = len(self.labels)
        logits = np.concatenate([self._logits(s, min(n, s + self.batch)).numpy()[:, 0]
                                 for s in range(0, n, self.batch)])
        return tta.auc(self.labels, logits)


class AucClock(tf.keras.callbacks.Callback):
    """Training clock without evaluations; scores and reports at every epoch end.

    The clock runs from each epoch's begin to its end (Keras has joined
    every scheduled step by then); the first epoch includes tracing. Stops
    training at the first AUC >= target or when the clock passes max_seconds.
    """

    def __init__(self, scorer, steps_per_epoch, examples_per_step, target_auc, max_seconds,
                 global_steps_per_epoch):
        super().__init__()
        self.scorer = scorer
        self.steps_per_epoch = steps_per_epoch
        self.global_steps_per_epoch = global_steps_per_epoch
        self.examples_per_step = examples_per_step
        self.target_auc = target_auc
        self.max_seconds = max_seconds
        self.train_seconds = 0.0
        self.epochs = 0
        self.reached = False
        self._begin = None

    def on_epoch_begin(self, epoch, logs=None):
        self._begin = time.monotonic()

    def on_epoch_end(self, epoch, logs=None):
        self.train_seconds += time.monotonic() - self._begin
        self.epochs = epoch + 1
        t0 = time.monotonic()
        value = self.scorer.score(self.model)
        eval_seconds = time.monotonic() - t0
        steps = self.epochs * self.steps_per_epoch
        line = {"seconds": round(self.train_seconds, 3), "steps": steps,
                "global_steps": self.epochs * self.global_steps_per_epoch,
                "examples": steps * self.examples_per_step, "auc": round(value, 5),
                "eval_seconds": round(eval_seconds, 3),
                "train_loss": None if not logs or logs.get("loss") is None
                else round(float(logs["loss"]), 5),
                "loadavg": round(os.getloadavg()[0], 2)}
        sys.stdout.write(tta.EVAL_PREFIX + json.dumps(line) + "\n")
        sys.stdout.flush()
        if value >= self.target_auc:
            self.reached = True
            self.model.stop_training = True
        elif self.train_seconds >= self.max_seconds:
            self.model.stop_training = True


def run(job):
    t0 = time.monotonic()
    # The strategy first: it connects to the cluster, which must happen before
    # this process runs any op or creates any variable (the local copy's too).
    model, data, examples_per_step = build(job)
    scorer = Scorer(job)  # Outside the strategy's scope.
    startup = time.monotonic() - t0
    w = job["num_workers"]
    # Stock PSS: W one-worker steps make one global step's examples.
    factor = w if job["setup"] == "stock_pss" else 1
    steps_per_epoch = job["eval_every_steps"] * factor
    clock = AucClock(scorer, steps_per_epoch, examples_per_step, job["target_auc"],
                     job["max_seconds"], job["eval_every_steps"])
    model.fit(data, epochs=10**7, steps_per_epoch=steps_per_epoch, verbose=0, callbacks=[clock])
    return {"train_seconds": clock.train_seconds, "epochs": clock.epochs,
            "reached": clock.reached, "startup_seconds": startup,
            "steps_per_epoch": steps_per_epoch, "examples_per_step": examples_per_step}


def main(argv):
    job = json.loads(argv[1])
    result = run(job)
    write_result(result, tf.__version__)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
