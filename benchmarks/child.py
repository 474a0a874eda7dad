"""One benchmark process: trains the model under one setup and prints its result.

Why this module exists: a TensorFlow process can connect to one cluster only,
so every setup runs in its own process(es) and the parent (`run`) collects a
single ``BENCH_RESULT {json}`` line from each. This module is that process:

    python -m benchmarks.child '<json job>'

with ``job["role"]`` one of:

* ``single``: plain Keras in this process, no strategy.
* ``ps_chief``: the chief of a loopback PS cluster started by the parent
  (TF_CONFIG set by `tf_psplugin.launch.LocalCluster`); ``job["setup"]`` is
  ``stock_pss``, ``hybrid_sync``, ``hybrid_sync_unstacked`` (``stack_tables=False``)
  or ``hybrid_async``.
* ``mwms_worker``: one MultiWorkerMirroredStrategy worker (TF_CONFIG set by
  the parent); every worker runs this, worker 0 reports the throughput.
* ``soak_chief``: a ``ps_chief`` that trains for ``job["duration_seconds"]``
  of wall-clock time instead of a number of epochs and prints
  ``SOAK_PROGRESS {json}`` after every epoch (see `benchmarks.soak`).

``job["mixed_precision"]`` (default ``float32``) is the Keras policy the
process sets before building the model (every MultiWorkerMirroredStrategy
worker sets it; in a PS cluster the chief, which traces every step).

Timing: `model.fit` runs ``1 + timed_epochs`` epochs of ``steps_per_epoch``
steps; epoch 0 is the warm-up (tracing, first RPCs, cache fill) and is not
timed. Keras joins the coordinator at every epoch end, so epoch wall times
include every scheduled step.
"""

import json
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
if os.environ.get("TF_PSPLUGIN_BENCH_PLUGIN_PATH"):  # A patched plugin copy to measure.
    sys.path.insert(0, os.environ["TF_PSPLUGIN_BENCH_PLUGIN_PATH"])

import tensorflow as tf  # noqa: E402

from benchmarks import model as model_lib  # noqa: E402
from benchmarks.procs import (  # noqa: E402
    SOAK_PROGRESS_PREFIX, cpu_seconds, strategy_arguments, write_result)


_KEEP = []  # Objects that must live as long as the process (row tracking).


class EpochTimer(tf.keras.callbacks.Callback):
    """Wall time and CPU time of the setup's processes at every epoch boundary.

    Args:
        pids: Other processes of this setup on this host (role -> pid) whose
            CPU time is read from /proc along with this process's own.
    """

    def __init__(self, pids=None, announce=False, profile=None):
        super().__init__()
        self.pids = dict(pids or {})
        self.announce = announce
        # benchmarks.profile: {"trace_dir": chief's trace of epoch
        # "trace_epoch" (from its start to its end), "ss_epochs": [a, b]:
        # `ss` listings at the ends of epochs a and b (exact step counts).
        self.profile = dict(profile or {})
        self.ss = {}
        self.marks = []
        self.cpu_marks = []

    def _mark(self):
        self.marks.append(time.perf_counter())
        cpu = {role: cpu_seconds(str(pid)) for role, pid in self.pids.items()}
        cpu["self"] = cpu_seconds()
        self.cpu_marks.append(cpu)

    def on_train_begin(self, logs=None):
        self.marks, self.cpu_marks = [], []
        self._mark()

    def on_epoch_end(self, epoch, logs=None):
        self._mark()
        self._profile_hooks(epoch)
        if self.announce:  # benchmarks.profile starts its traces on this line.
            sys.stdout.write(f"BENCH_EPOCH_END {epoch}\n")
            sys.stdout.flush()

    def _profile_hooks(self, epoch):
        """benchmarks.profile's chief trace and `ss` listings at epoch ends (steps joined)."""
        if not self.profile:
            return
        if epoch in self.profile.get("ss_epochs", ()):
            import subprocess  # pylint: disable=g-import-not-at-top

            self.ss[str(epoch)] = subprocess.run(
                ["ss", "-tinpH", "state", "established"], capture_output=True, text=True,
                timeout=30, check=False).stdout
        trace_epoch = self.profile.get("trace_epoch")
        if self.profile.get("trace_dir") and trace_epoch is not None:
            if epoch == trace_epoch - 1:
                tf.profiler.experimental.start(self.profile["trace_dir"])
            elif epoch == trace_epoch:
                tf.profiler.experimental.stop()


def _fit_and_time(model, dataset, job, steps_per_step_examples):
    timer = EpochTimer(job.get("cpu_pids"), announce=job.get("announce_epochs", False),
                       profile=job.get("profile"))
    spe_steps = job["steps_per_epoch"]
    epochs = 1 + job["timed_epochs"]
    history = model.fit(dataset, epochs=epochs, steps_per_epoch=spe_steps, verbose=0,
                        callbacks=[timer])
    marks = timer.marks
    epoch_seconds = [b - a for a, b in zip(marks[:-1], marks[1:])]
    timed = epoch_seconds[1:]
    timed_steps = spe_steps * job["timed_epochs"]
    total = sum(timed)
    return {
        "examples_per_sec": timed_steps * steps_per_step_examples / total if total > 0 else None,
        "timed_steps": timed_steps,
        "timed_seconds": total,
        "warmup_seconds": epoch_seconds[0],
        "epoch_examples_per_sec": [spe_steps * steps_per_step_examples / s for s in timed],
        "final_loss": float(history.history["loss"][-1]),
        # CPU seconds per process over the timed epochs (epoch 1 .. end).
        "timed_cpu_seconds": {role: timer.cpu_marks[-1][role] - timer.cpu_marks[1][role]
                              for role in timer.cpu_marks[-1]},
        "loadavg_end": os.getloadavg()[0],
        # benchmarks.profile: per epoch end (0 = warm-up's), CPU seconds of
        # every process, and the `ss` listings.
        **({"epoch_cpu_marks": timer.cpu_marks, "ss": timer.ss} if timer.profile else {}),
    }


def _spec(job):
    return model_lib.ModelSpec.from_dict(job["model"])


def run_single(job):
    spec = _spec(job)
    model = model_lib.build_model(spec)
    model_lib.compile_model(model, spec, job["steps_per_execution"])
    ds = model_lib.make_dataset(spec, job["global_batch"], job["pool_batches"])
    return _fit_and_time(model, ds, job, job["global_batch"])


def _stock_pss_strategy(job):
    resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    # Shards every variable of at least `min_shard_bytes` (the tables; the MLP
    # kernels are smaller) over at most num_ps shards.
    partitioner = tf.distribute.experimental.partitioners.MinSizePartitioner(
        min_shard_bytes=job["partition_min_bytes"], max_shards=job["num_ps"])
    return tf.distribute.experimental.ParameterServerStrategy(
        resolver, variable_partitioner=partitioner)


def _build_ps_chief(job):
    """Strategy, compiled model and dataset of a PS-cluster setup, as every mode uses them.

    Returns:
        ``(model, dataset, examples_per_step, per_step_batch)``.
    """
    setup = job["setup"]
    if setup == "stock_pss":
        strategy = _stock_pss_strategy(job)
        per_step_batch = job["global_batch"]  # Each async step: one worker, one full batch.
        examples_per_step = per_step_batch
        # Every worker reads its own copy of this dataset and runs about
        # 1/num_workers of the warm-up steps: a smaller pool is fully cached
        # before the timed epochs, as in the other setups.
        pool = max(1, job["pool_batches"] // job["num_workers"])
    else:
        import tf_psplugin  # pylint: disable=g-import-not-at-top

        strategy = tf_psplugin.HybridParameterServerStrategy(
            **strategy_arguments(job, tf_psplugin))
        per_step_batch = job["global_batch"] // job["num_workers"]
        examples_per_step = per_step_batch * job["num_workers"]
        pool = job["pool_batches"] * job["num_workers"]  # The coordinator shards by batch.
    spec = _spec(job)
    with strategy.scope():
        model = model_lib.build_model(spec)
        model_lib.compile_model(model, spec, job["steps_per_execution"])
    if job.get("track_rows") and setup != "stock_pss":
        # Incremental checkpoints' row tracking (one scatter per table shard
        # per step), as ChiefCheckpointManager(full_every_saves=...) installs it; no saves.
        import tempfile  # pylint: disable=g-import-not-at-top

        import tf_psplugin  # pylint: disable=g-import-not-at-top

        scratch = tempfile.TemporaryDirectory(prefix="tf_psplugin_track_rows_")  # Removed at exit.
        _KEEP.append(scratch)
        _KEEP.append(tf_psplugin.ChiefCheckpointManager(
            scratch.name, model=model, optimizer=model.optimizer, full_every_saves=1000))
    # epoch_pass (soak): one pass over the pool per epoch, so Keras makes
    # new per-worker iterators every epoch.
    ds = model_lib.make_dataset(spec, per_step_batch, pool, repeat=not job.get("epoch_pass"))
    return model, ds, examples_per_step, per_step_batch


def run_ps_chief(job):
    t0 = time.perf_counter()
    model, ds, examples_per_step, per_step_batch = _build_ps_chief(job)
    built = time.perf_counter() - t0
    result = _fit_and_time(model, ds, job, examples_per_step)
    result["startup_seconds"] = built
    result["per_worker_batch"] = per_step_batch
    # The dense all-reduce's bucket size the strategy chose (HybridOptions.
    # dense_bucket_bytes=None: by where the workers are); None for stock PSS.
    result["dense_bucket_bytes_used"] = getattr(model.distribute_strategy.extended,
                                                "dense_bucket_bytes", None)
    if job.get("heldout_batches"):
        result.update(_heldout(model, job, per_step_batch))
    return result


def _heldout(model, job, batch_size):
    """Held-out AUC after training, and the dynamic table's size and counts."""
    spec = _spec(job)
    # Past every worker's pool: data no step trained on.
    after = job["pool_batches"] * job["num_workers"] + 1
    heldout = model_lib.heldout_dataset(spec, batch_size, job["heldout_batches"], after)
    metrics = model.evaluate(heldout, verbose=0, return_dict=True)  # Finite: every batch once.
    out = {"heldout_auc": float(metrics["auc"]), "heldout_loss": float(metrics["loss"])}
    if spec.variant == "dynamic":
        layer = model.get_layer("embedding_dynamic")
        stats = layer.table_stats()
        out["table_size"] = layer.table_size()
        out["table_stats"] = [{k: v for k, v in s.items() if k != "device"} for s in stats]
    return out


def run_mwms_worker(job):
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    spec = _spec(job)
    global_batch = job["global_batch"]

    def dataset_fn(ctx):
        return model_lib.make_dataset(
            spec, ctx.get_per_replica_batch_size(global_batch), job["pool_batches"],
            shard_index=ctx.input_pipeline_id, num_shards=ctx.num_input_pipelines)

    with strategy.scope():
        model = model_lib.build_model(spec)
        model_lib.compile_model(model, spec, job["steps_per_execution"])
    ds = strategy.distribute_datasets_from_function(dataset_fn)
    result = _fit_and_time(model, ds, job, global_batch)
    result["per_worker_batch"] = global_batch // strategy.num_replicas_in_sync
    return result


class SoakProgress(tf.keras.callbacks.Callback):
    """Prints cumulative progress after every epoch and stops at a wall-clock deadline.

    Keras allows only epoch-level callbacks under ParameterServerStrategy, and
    it joins the coordinator before `on_epoch_end`, so the step count printed
    there has really been executed. Each line is
    ``SOAK_PROGRESS {"epoch", "steps", "examples", "t", "mono", "loss"}``:
    ``t`` is seconds since training began, ``mono`` the same instant on
    `time.monotonic()` (CLOCK_MONOTONIC, one clock for every process on a
    Linux host, so the parent can place it on its own time axis). One line
    with ``steps`` 0 is printed when training begins.

    Args:
        steps_per_epoch: Steps in one epoch.
        examples_per_step: Examples one step trains on (all workers together).
        duration_seconds: Training stops at the first epoch end after this
            many seconds since training began.
    """

    def __init__(self, steps_per_epoch, examples_per_step, duration_seconds):
        super().__init__()
        self.steps_per_epoch = steps_per_epoch
        self.examples_per_step = examples_per_step
        self.duration_seconds = duration_seconds
        self.start = None
        self.steps = 0
        self.epochs = 0

    def _say(self, epoch, logs):
        now = time.monotonic()
        loss = (logs or {}).get("loss")
        line = {"epoch": epoch, "steps": self.steps,
                "examples": self.steps * self.examples_per_step,
                "t": round(now - self.start, 3), "mono": now,
                "loss": None if loss is None else float(loss)}
        sys.stdout.write(SOAK_PROGRESS_PREFIX + json.dumps(line) + "\n")
        sys.stdout.flush()
        return now

    def on_train_begin(self, logs=None):
        self.start = time.monotonic()
        self._say(-1, None)

    def on_epoch_end(self, epoch, logs=None):
        self.epochs = epoch + 1
        self.steps = self.epochs * self.steps_per_epoch
        if self._say(epoch, logs) - self.start >= self.duration_seconds:
            self.model.stop_training = True


def run_soak_chief(job):
    model, ds, examples_per_step, per_step_batch = _build_ps_chief(job)
    progress = SoakProgress(job["steps_per_epoch"], examples_per_step, job["duration_seconds"])
    callbacks = [progress]
    if job.get("checkpoint_every_secs") and job["setup"] != "stock_pss":
        # What a real job does for hours: periodic checkpoints with keep-N
        # retention (the soak watches the model_dir's files and the chief's
        # RSS across saves). Stock PSS has no plugin checkpoint callback.
        import tf_psplugin  # pylint: disable=g-import-not-at-top

        callbacks.append(tf_psplugin.ChiefCheckpoint(
            job["model_dir"], save_every_seconds=job["checkpoint_every_secs"], max_to_keep=3))
    # Far more epochs than the deadline allows: SoakProgress stops the fit. The
    # plugin's setups run with its progress bar, as a user's job does (stock PSS
    # refuses verbose=1).
    history = model.fit(ds, epochs=10**7, steps_per_epoch=job["steps_per_epoch"],
                        verbose=0 if job["setup"] == "stock_pss" else 1, callbacks=callbacks)
    trained = time.monotonic() - progress.start
    return {"steps": progress.steps, "epochs": progress.epochs, "train_seconds": trained,
            "examples_per_sec": progress.steps * examples_per_step / trained,
            "per_worker_batch": per_step_batch,
            "final_loss": float(history.history["loss"][-1]) if history.history else None}


RUNNERS = {"single": run_single, "ps_chief": run_ps_chief, "mwms_worker": run_mwms_worker,
           "soak_chief": run_soak_chief}


def set_policy(job):
    """Sets the job's Keras policy (``mixed_precision``) for this process."""
    policy = job.get("mixed_precision", "float32")
    if policy != "float32":
        tf.keras.mixed_precision.set_global_policy(policy)


def main(argv):
    job = json.loads(argv[1])
    t0 = time.perf_counter()
    set_policy(job)
    result = RUNNERS[job["role"]](job)
    result["process_seconds"] = time.perf_counter() - t0
    write_result(result, tf.__version__)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
