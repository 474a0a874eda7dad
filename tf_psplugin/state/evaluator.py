"""The evaluator sidecar: evaluates the chief's checkpoints with plain, local TensorFlow.

Why this module exists: evaluation during training should neither slow the
training steps nor touch the training cluster. A coordinator that includes
the evaluator in its cluster spec hangs (tensorflow issue 46169), and a
process that connects to the cluster becomes part of its failure domain.
So the evaluator task never connects to anything: no strategy, no servers.
It watches ``model_dir`` for committed checkpoints (see checkpoint.py: only
checkpoints with an intact commit marker count; with incremental
checkpoints, ``full_every_saves``, also the deltas of the latest full
checkpoint's chain), loads each into a local
copy of the model (tables as full tensors, optimizer state ignored),
evaluates it on its own dataset, and records the result:

* one JSON line per checkpoint in ``<model_dir>/eval/metrics.jsonl``:
  ``{"step", "loss", <every compiled metric>, "checkpoint", "wall_time"}``;
* TensorBoard scalars under ``<model_dir>/eval``.

It stops once the chief has written ``TRAINING_DONE`` and the checkpoint of
that final step has been evaluated, or after `idle_timeout_secs` without a
new checkpoint. A chief whose scheduler stops the evaluator as soon as the
chief exits (a Kubeflow TFJob with ``cleanPodPolicy: Running``) calls
`wait_for_evaluation` before exiting, so the final checkpoint gets its score.
The local launcher's ``--evaluator`` runs the training script with
``TF_CONFIG`` task type ``evaluator``; the script dispatches on
``config.task_type`` and calls `run_evaluator` there.
"""

import json
import os
import time
from typing import Any, Callable, Dict, List, Optional

import tensorflow as tf
from absl import logging

from tf_psplugin._internal import deprecation as _deprecation
from tf_psplugin._internal.numbers import to_float
from tf_psplugin.errors import EvaluatorError  # noqa: F401  (see errors.py)
from tf_psplugin.state import checkpoint as checkpoint_lib
from tf_psplugin.state import model_dir as model_dir_lib

__all__ = ["EvaluatorError", "METRICS_FILE", "run_evaluator", "wait_for_evaluation"]

METRICS_FILE = "metrics.jsonl"
# Errors worth retrying: a file being copied, a flaky network filesystem.
_TRANSIENT_ERRORS = (tf.errors.DataLossError, tf.errors.UnavailableError,
                     tf.errors.AbortedError, tf.errors.DeadlineExceededError,
                     tf.errors.InternalError, OSError)


def _check_not_in_training_cluster() -> None:
    if tf.distribute.has_strategy():
        raise EvaluatorError(
            "run_evaluator() was called inside a distribution strategy scope. Fix: the "
            "evaluator never joins the training cluster (tensorflow 46169); call it at top "
            "level in the evaluator process, without building a strategy.")
    raw = os.environ.get("TF_CONFIG", "")
    if raw.strip():
        try:
            task = json.loads(raw).get("task", {})
        except (ValueError, AttributeError):
            task = {}
        if isinstance(task, dict) and task.get("type") in ("chief", "worker", "ps"):
            raise EvaluatorError(
                f"run_evaluator() runs in the evaluator task, but TF_CONFIG says this process "
                f"is {task.get('type')}:{task.get('index', 0)}. Fix: dispatch on "
                "config.task_type == 'evaluator' (or --job_name=evaluator).")


def _append_line(path: str, line: str) -> None:
    """Appends a line; object stores cannot append, so they rewrite the object."""
    if model_dir_lib.is_remote(path):
        old = ""
        if tf.io.gfile.exists(path):
            with tf.io.gfile.GFile(path, "r") as f:
                old = f.read()
        with tf.io.gfile.GFile(path, "w") as f:
            f.write(old + line)
        return
    with open(path, "a", encoding="utf-8") as f:
        f.write(line)
        f.flush()


def _read_records(metrics_path: str) -> List[Dict[str, Any]]:
    """The records in metrics.jsonl with an integer step; [] if there is no file yet."""
    if not tf.io.gfile.exists(metrics_path):
        return []
    records = []
    with tf.io.gfile.GFile(metrics_path, "r") as f:
        for line in f:
            try:
                record = json.loads(line)
                record["step"] = int(record["step"])
            except (ValueError, KeyError, TypeError):
                continue  # A torn last line from a crash.
            records.append(record)
    return records


class _Recorder:
    """Writes metrics.jsonl and TensorBoard scalars under <model_dir>/eval."""

    def __init__(self, model_dir: str):
        self.eval_dir = model_dir_lib.join(model_dir, model_dir_lib.EVAL_SUBDIR)
        tf.io.gfile.makedirs(self.eval_dir)
        self.metrics_path = model_dir_lib.join(self.eval_dir, METRICS_FILE)
        self._writer = tf.summary.create_file_writer(self.eval_dir)

    def evaluated_steps(self) -> set:
        """Steps already recorded (a restarted evaluator does not redo them)."""
        return {record["step"] for record in _read_records(self.metrics_path)}

    def record(self, result: Dict[str, Any]) -> None:
        _append_line(self.metrics_path, json.dumps(result, sort_keys=True) + "\n")
        with self._writer.as_default():
            for name, value in result.items():
                if name not in ("step", "wall_time") and to_float(value, finite=True) is not None:
                    tf.summary.scalar(name, to_float(value, finite=True), step=result["step"])
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


def run_evaluator(model_fn: Callable[[], tf.keras.Model],
                  dataset_fn: Callable[[], tf.data.Dataset], model_dir: str,
                  eval_steps: Optional[int] = None, poll_seconds: float = 5.0,
                  idle_timeout_seconds: Optional[float] = 3600.0, evaluate_all: bool = False,
                  stale_done_grace_seconds: float = 120.0,
                  max_read_retries: int = 3, retry_delay_seconds: float = 2.0,
                  clock: Callable[[], float] = time.monotonic,
                  sleep: Callable[[float], None] = time.sleep,
                  poll_interval_seconds: Any = _deprecation.UNSET,
                  poll_interval_secs: Any = _deprecation.UNSET,
                  idle_timeout_secs: Any = _deprecation.UNSET,
                  stale_done_grace_secs: Any = _deprecation.UNSET,
                  retry_delay_secs: Any = _deprecation.UNSET) -> List[Dict[str, Any]]:
    """Evaluates every new committed checkpoint in `model_dir` until training is done.

    Example (in the training script, after `config = tf_psplugin.start_server()`):

    ```python
    if config.task_type == "evaluator":
        tf_psplugin.run_evaluator(
            model_fn=lambda: compile_ctr_model(build_ctr_model(vocab_size=1000)),
            dataset_fn=lambda: SyntheticCTR(vocab_size=1000).dataset(1024, num_batches=20,
                                                                     offset_batches=1 << 40),
            model_dir=FLAGS.model_dir)
        return
    ```

    Args:
        model_fn: Builds and compiles (loss and metrics) a local model of the
            trained architecture. Called once, with no strategy.
        dataset_fn: Returns the evaluation dataset; called per evaluation.
        model_dir: The chief's model directory.
        eval_steps: Batches per evaluation (None: the whole dataset).
        poll_seconds: Seconds between looks at `model_dir`.
        idle_timeout_seconds: Stop after this long without a new checkpoint
            (None: wait forever, until ``TRAINING_DONE``).
        evaluate_all: Evaluate every new checkpoint, not just the newest one
            when several appeared since the last look. The final checkpoint
            is evaluated either way.
        stale_done_grace_seconds: A ``TRAINING_DONE`` that was already there
            when the evaluator started may be left from a run that is being
            resumed right now (its chief removes it when it starts, possibly
            after the evaluator looked). Such a marker ends the evaluator only
            after this many seconds; one written later ends it at once.
        max_read_retries: Retries of a checkpoint read that failed with a
            transient error (each logged) before the checkpoint is skipped.
        retry_delay_seconds: Seconds between those retries.
        clock: Seconds clock (injectable for tests).
        sleep: Sleep function (injectable for tests).
        poll_interval_seconds, poll_interval_secs: Deprecated names of
            `poll_seconds` (they work, with a DeprecationWarning).
        idle_timeout_secs, stale_done_grace_secs, retry_delay_secs:
            Deprecated names of the ``*_seconds`` arguments (the same).

    Returns:
        The records written, one per evaluated checkpoint.

    Raises:
        EvaluatorError: when called in a training task or strategy scope, or
            if `model_fn` returns an uncompiled model.
    """
    poll_seconds = _deprecation.renamed(
        "run_evaluator", "poll_interval_seconds", poll_interval_seconds, "poll_seconds",
        poll_seconds, 5.0)
    poll_seconds = _deprecation.renamed(
        "run_evaluator", "poll_interval_secs", poll_interval_secs, "poll_seconds",
        poll_seconds, 5.0)
    idle_timeout_seconds = _deprecation.renamed(
        "run_evaluator", "idle_timeout_secs", idle_timeout_secs, "idle_timeout_seconds",
        idle_timeout_seconds, 3600.0)
    stale_done_grace_seconds = _deprecation.renamed(
        "run_evaluator", "stale_done_grace_secs", stale_done_grace_secs,
        "stale_done_grace_seconds", stale_done_grace_seconds, 120.0)
    retry_delay_seconds = _deprecation.renamed(
        "run_evaluator", "retry_delay_secs", retry_delay_secs, "retry_delay_seconds",
        retry_delay_seconds, 2.0)
    _check_not_in_training_cluster()
    model_dir = model_dir_lib.resolve(model_dir)
    model = model_fn()
    if not getattr(model, "compiled_loss", None):
        raise EvaluatorError("model_fn() returned a model that is not compiled. Fix: compile it "
                             "with the training loss and metrics inside model_fn.")
    recorder = _Recorder(model_dir)
    done_steps = recorder.evaluated_steps()
    last_step = max(done_steps) if done_steps else -1
    skipped: set = set()
    results: List[Dict[str, Any]] = []
    started = last_activity = clock()
    stale_done = model_dir_lib.read_training_done(model_dir)  # Maybe from an earlier run.
    logging.info("tf_psplugin evaluator: watching %s (no connection to the training cluster)",
                 model_dir)
    try:
        while True:
            new = [i for i in _committed(model_dir)
                   if i.step > last_step and i.path not in skipped]
            targets = new if evaluate_all else new[-1:]
            for info in targets:
                if info.step <= last_step:
                    continue  # Loaded already: a delta is read with the rest of its chain.
                result = _evaluate_checkpoint(model, dataset_fn, info, eval_steps,
                                              max_read_retries, retry_delay_seconds, sleep)
                if result is None:
                    skipped.add(info.path)
                    continue
                recorder.record(result)
                results.append(result)
                last_step = max(last_step, info.step, result["step"])
                logging.info("tf_psplugin evaluator: step %d %s", info.step, json.dumps(
                    {k: v for k, v in result.items() if k not in ("checkpoint", "wall_time")}))
            if new:
                last_activity = clock()
            done = model_dir_lib.read_training_done(model_dir)
            if done is not None and done == stale_done and clock() - started < (
                    stale_done_grace_seconds):
                done = None  # Give a resuming chief time to remove it.
            if done is not None and last_step >= done["step"]:
                logging.info("tf_psplugin evaluator: training finished at step %d; exiting",
                             done["step"])
                return results
            if idle_timeout_seconds is not None and clock() - last_activity >= idle_timeout_seconds:
                logging.warning("tf_psplugin evaluator: no new checkpoint for %.0f s%s; exiting",
                                idle_timeout_seconds,
                                "" if done is None else f" (TRAINING_DONE at step {done['step']}"
                                " but that checkpoint never became readable)")
                return results
            sleep(poll_seconds)
    finally:
        recorder.close()


def _committed(model_dir: str) -> List[checkpoint_lib.CheckpointInfo]:
    """Full checkpoints and the deltas of the latest one's chain (`full_every_saves`), by step."""
    _, deltas = model_dir_lib.checkpoint_chain(model_dir)
    return sorted(checkpoint_lib.list_checkpoints(model_dir) + deltas, key=lambda i: i.step)


def _evaluate_checkpoint(model, dataset_fn, info: checkpoint_lib.CheckpointInfo,
                         eval_steps, max_read_retries, retry_delay_secs, sleep):
    """Loads and evaluates one checkpoint; None if it vanished or stays unreadable."""
    for attempt in range(max_read_retries + 1):
        problem = checkpoint_lib.verify_checkpoint(info)
        if problem is not None:
            logging.warning("tf_psplugin evaluator: skipping %s: %s (deleted or partial)",
                            info.path, problem)
            return None
        try:
            # A delta is read as its chain (the model directory's latest full
            # checkpoint and deltas): what is loaded may be newer than `info`.
            source = (os.path.dirname(info.path) if info.kind == model_dir_lib.KIND_DELTA
                      else info.path)
            info = checkpoint_lib.load_into(model, source)
            break
        except tf.errors.NotFoundError as e:
            logging.warning("tf_psplugin evaluator: %s vanished while loading (%s); skipping",
                            info.path, e.message.splitlines()[0])
            return None
        except (checkpoint_lib.CheckpointError,) + _TRANSIENT_ERRORS as e:
            if attempt == max_read_retries:
                logging.error("tf_psplugin evaluator: giving up on %s after %d attempts: %s",
                              info.path, attempt + 1, e)
                return None
            logging.warning("tf_psplugin evaluator: reading %s failed (attempt %d of %d): %s; "
                            "retrying", info.path, attempt + 1, max_read_retries + 1, e)
            sleep(retry_delay_secs)
    metrics = model.evaluate(dataset_fn(), steps=eval_steps, verbose=0, return_dict=True)
    result: Dict[str, Any] = {"step": int(info.step), "checkpoint": info.path,
                              "wall_time": time.time()}
    for name, value in metrics.items():
        result[name] = to_float(value, finite=True)
    return result


def wait_for_evaluation(model_dir: str, step: int, timeout_seconds: float,
                        poll_seconds: float = 2.0,
                        clock: Callable[[], float] = time.monotonic,
                        sleep: Callable[[float], None] = time.sleep,
                        poll_interval_seconds: Any = _deprecation.UNSET
                        ) -> Optional[Dict[str, Any]]:
    """Waits (on the chief) until the evaluator has recorded its result for `step`.

    Why: a scheduler may stop the evaluator as soon as the chief exits. A
    Kubeflow TFJob decides success by the chief alone, and with
    ``cleanPodPolicy: Running`` it then deletes every pod still running,
    the evaluator included, possibly while it scores the final checkpoint.
    Called after the final checkpoint (and ``TRAINING_DONE``) are written,
    this holds the chief until ``<model_dir>/eval/metrics.jsonl`` has a record
    of `step` or a later one. It only reads files: the evaluator stays out of
    the training cluster.

    Example (at the end of the chief's training):

    ```python
    record = tf_psplugin.wait_for_evaluation(
        FLAGS.model_dir, step=int(model.optimizer.iterations.numpy()), timeout_seconds=600)
    ```

    Args:
        model_dir: The chief's model directory (the evaluator's too).
        step: The final training step (the step of the final checkpoint).
        timeout_seconds: Give up after this many seconds (the evaluator may
            have crashed or been removed); a warning is logged.
        poll_seconds: Seconds between looks at the metrics file.
        clock: Seconds clock (injectable for tests).
        sleep: Sleep function (injectable for tests).
        poll_interval_seconds: Deprecated name of `poll_seconds` (it works,
            with a DeprecationWarning).

    Returns:
        The evaluator's record (``{"step", "loss", <metrics>...}``) of the
        first evaluated step >= `step`, or None on timeout.
    """
    poll_seconds = _deprecation.renamed(
        "wait_for_evaluation", "poll_interval_seconds", poll_interval_seconds, "poll_seconds",
        poll_seconds, 2.0)
    metrics_path = model_dir_lib.join(model_dir_lib.resolve(model_dir),
                                      model_dir_lib.EVAL_SUBDIR, METRICS_FILE)
    deadline = clock() + timeout_seconds
    logging.info("tf_psplugin: waiting up to %.0f s for the evaluator to score step %d (%s)",
                 timeout_seconds, step, metrics_path)
    while True:
        try:
            done = [r for r in _read_records(metrics_path) if r["step"] >= step]
        except _TRANSIENT_ERRORS as e:  # A flaky shared filesystem: look again.
            logging.warning("tf_psplugin: reading %s failed (%s); retrying", metrics_path, e)
            done = []
        if done:
            return min(done, key=lambda r: r["step"])
        if clock() >= deadline:
            logging.warning("tf_psplugin: the evaluator has not scored step %d after %.0f s; "
                            "not waiting any longer (is the evaluator running?)",
                            step, timeout_seconds)
            return None
        sleep(poll_seconds)
