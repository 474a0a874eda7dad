"""Training curves: loss, metrics and throughput as TensorBoard scalars from the chief.

Why this module exists: under any ParameterServerStrategy, Keras's own
`TensorBoard` callback sees the step's logs as RemoteValues, and the
evaluator writes its curves to ``<model_dir>/eval``; nothing wrote the
training side. `TrainingSummaries` runs on the chief (the only process
that runs Keras callbacks under a coordinator), fetches one step's logs
every `write_every_steps` steps -- worker 0's outputs, which describe the
global batch in synchronous mode -- and writes them under
``<model_dir>/train``, so one ``tensorboard --logdir <model_dir>`` shows
training and evaluation side by side. Throughput is written too
(``steps_per_sec``, and ``examples_per_sec`` when the global batch size is
known).

Fetching a step's logs waits for that step only; at the default of one
fetch per 100 steps the cost is negligible.
"""

import os
import time
import warnings
from typing import Any, Optional

import tensorflow as tf

from tf_psplugin._internal import deprecation as _deprecation
from tf_psplugin._internal import tf_objects
from tf_psplugin._internal.compat import keras
from tf_psplugin._internal.numbers import to_float
from tf_psplugin.state import model_dir as model_dir_lib

TRAIN_DIR = "train"


class TrainingSummaries(keras.callbacks.Callback):
    """Writes training loss/metrics and throughput to ``<model_dir>/train``.

    Example:

    ```python
    model.fit(dataset, steps_per_epoch=1000, epochs=10, callbacks=[
        tf_psplugin.TrainingSummaries(model_dir, write_every_steps=100,
                                      examples_per_step=global_batch_size)])
    ```

    Steps are global training steps (`optimizer.iterations`, read once at
    train begin, so a resumed job continues its curves). Only the chief
    writes; in any other process the callback does nothing.

    Args:
        model_dir: The job's model directory (the evaluator's too).
        write_every_steps: Write one point every this many steps (as
            `ChiefCheckpoint`'s `save_every_steps`).
        examples_per_step: The global batch size; enables ``examples_per_sec``.
            Default: what the strategy's coordinator read from the training
            dataset's static batch dimension, if anything.
        every_n_steps: Deprecated name of `write_every_steps` (it works, with
            a DeprecationWarning).
    """

    def __init__(self, model_dir: str, write_every_steps: int = 100,
                 examples_per_step: Optional[int] = None,
                 every_n_steps: Any = _deprecation.UNSET):
        super().__init__()
        write_every_steps = _deprecation.renamed(
            "TrainingSummaries", "every_n_steps", every_n_steps, "write_every_steps",
            write_every_steps, 100)
        if int(write_every_steps) < 1:
            raise ValueError(f"write_every_steps={write_every_steps!r} must be >= 1. Fix: pass "
                             "a number of steps, 1 or more.")
        # Keras may hand us RemoteValues under a coordinator; we fetch them.
        self._supports_tf_logs = True
        self.model_dir = model_dir_lib.resolve(model_dir)
        self.train_dir = os.path.join(self.model_dir, TRAIN_DIR)
        self.write_every_steps = int(write_every_steps)
        self.examples_per_step = self._examples_per_step_arg = examples_per_step
        self._writer = None
        self._step = 0
        self._done_in_epoch = 0
        self._last_step = 0
        self._last_time = 0.0

    @property
    def every_n_steps(self) -> int:
        """Deprecated: `write_every_steps`."""
        warnings.warn("TrainingSummaries.every_n_steps is deprecated: read write_every_steps",
                      _deprecation.PluginDeprecationWarning, stacklevel=2)
        return self.write_every_steps

    def _implements_train_batch_hooks(self):
        return True

    def on_train_begin(self, logs=None):
        if not model_dir_lib.is_chief_task():
            return
        optimizer = getattr(self.model, "optimizer", None)
        iterations = getattr(optimizer, "iterations", None)
        self._step = int(iterations.numpy()) if iterations is not None else 0
        self._last_step, self._last_time = self._step, time.monotonic()
        if self._examples_per_step_arg is None:  # The strategy's coordinator may know it.
            coordinator = tf_objects.model_cluster_coordinator(self.model)
            self.examples_per_step = getattr(coordinator, "examples_per_step", None)
        if self._writer is None:
            self._writer = tf.summary.create_file_writer(self.train_dir)

    def on_epoch_begin(self, epoch, logs=None):
        self._done_in_epoch = 0

    def on_train_batch_end(self, batch, logs=None):
        if self._writer is None:
            return
        # With steps_per_execution > 1 Keras reports every k-th batch.
        self._step += batch + 1 - self._done_in_epoch
        self._done_in_epoch = batch + 1
        if self._step - self._last_step < self.write_every_steps:
            return
        values = logs.fetch() if hasattr(logs, "fetch") else (logs or {})
        now = time.monotonic()
        rate = (self._step - self._last_step) / max(now - self._last_time, 1e-9)
        with self._writer.as_default(step=self._step):
            for name, value in sorted(values.items()):
                scalar = to_float(value)
                if scalar is not None:
                    tf.summary.scalar(name, scalar)
            tf.summary.scalar("steps_per_sec", rate)
            if self.examples_per_step:
                tf.summary.scalar("examples_per_sec", rate * self.examples_per_step)
        self._last_step, self._last_time = self._step, now

    def on_train_end(self, logs=None):
        if self._writer is not None:
            self._writer.flush()


