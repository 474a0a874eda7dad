"""A Keras progress bar for `model.fit(verbose=1)` under the hybrid strategy.

Why this module exists: Keras refuses ``verbose=1`` under any
ParameterServerStrategy (``_get_verbosity`` raises) and turns ``"auto"`` into
one line per epoch, because its `ProgbarLogger` fetches every step's logs:
under a coordinator each fetch waits for that step, so the chief stops
scheduling once per step. `ProgressBar` keeps Keras's look but fetches at
most once per refresh interval (one step's logs, then scheduling resumes),
and adds examples/s. In a terminal (or a notebook) it redraws one line; when
stdout is not a terminal -- the launcher's prefixed output, a log file -- it
prints one plain line every `line_every_seconds` instead of a stream of
carriage returns.

Keras has no hook for a strategy to choose its progress bar, so the
strategy's constructor calls `install_keras_hooks()` once per process: it
wraps two Keras internals so that, *only while a
`HybridParameterServerStrategy` is in use*, ``verbose=1``/``"auto"`` is
accepted and the default `ProgbarLogger` is this one. With any other
strategy both wrappers call Keras's own code unchanged. Nothing is patched
at import time.
"""

import math
import sys
import time
from typing import Any, Dict, Optional

import numpy as np
import tensorflow as tf

from tf_psplugin._internal import tf_internal as _tf_internal
from tf_psplugin._internal import tf_objects
from tf_psplugin._internal import keras_members
from tf_psplugin._internal.compat import keras
from tf_psplugin.keras import checkpoint_callback

# Marks a strategy whose fit/evaluate get the ProgressBar (set by the strategy).
STRATEGY_MARKER = "_tf_psplugin_progress"


def _fetch_logs(logs) -> Dict[str, float]:
    """Logs as plain floats; waits for the one step whose RemoteValues they are."""
    if logs is None:
        return {}
    if hasattr(logs, "fetch"):  # One RemoteValue holding the whole dict.
        logs = logs.fetch()
    values = {}
    for name, value in dict(logs).items():
        if hasattr(value, "fetch"):
            value = value.fetch()
        if hasattr(value, "numpy"):
            value = value.numpy()
        array = np.asarray(value)
        if array.size == 1 and np.issubdtype(array.dtype, np.number):
            values[name] = float(array.reshape(()))
    return values


def _format_rate(rate: float) -> str:
    if rate >= 1e6:
        return f"{rate / 1e6:.2f}M"
    if rate >= 1e4:
        return f"{rate / 1e3:.1f}k"
    return f"{rate:,.0f}"


def _format_eta(seconds: float) -> str:
    seconds = max(0, int(round(seconds)))
    if seconds >= 3600:
        return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"
    if seconds >= 60:
        return f"{seconds // 60}:{seconds % 60:02d}"
    return f"{seconds}s"


def _format_value(value: float) -> str:
    return f"{value:.4f}" if abs(value) > 1e-3 or value == 0 else f"{value:.4e}"


class ProgressBar(keras.callbacks.ProgbarLogger):
    """Keras-style progress for fit/evaluate under `HybridParameterServerStrategy`.

    The strategy installs it as the default progress bar, so a user only
    writes ``model.fit(..., verbose=1)`` (or leaves the default ``"auto"``).
    Passing one explicitly sets its options:

    ```python
    model.fit(dataset, steps_per_epoch=1000, verbose=1, callbacks=[
        tf_psplugin.ProgressBar(line_every_seconds=10)])
    ```

    ``verbose=1`` shows steps, a bar, examples/s (when the global batch size
    is static), the epoch's running loss/metrics and the ETA; ``verbose=2``
    prints one such line per epoch. Each refresh fetches one step's logs, so
    the chief pauses scheduling once per refresh, not once per step.

    Args:
        refresh_seconds: Terminal redraw interval (each redraw is one fetch).
        line_every_seconds: When stdout is not a terminal: one line this often.
        examples_per_step: The global batch size; default: read from the
            strategy's coordinator (the per-worker dataset's static batch
            dimension times the workers a step runs on), else unknown and
            only steps/s is shown.
        stream: Where to write (default: `sys.stdout` at each write).
        dynamic: Redraw in place (True) or print lines (False); default:
            whether the stream is a terminal or a notebook is running.
    """

    def __init__(self, refresh_seconds: float = 1.0, line_every_seconds: float = 15.0,
                 examples_per_step: Optional[int] = None, stream=None,
                 dynamic: Optional[bool] = None):
        super().__init__(count_mode="steps")
        if not refresh_seconds > 0 or not line_every_seconds > 0:
            raise ValueError(
                f"refresh_seconds={refresh_seconds!r} and line_every_seconds="
                f"{line_every_seconds!r} must be > 0 (seconds between updates).")
        self._supports_tf_logs = True  # Logs are RemoteValues; fetched on refresh only.
        self.refresh_seconds = float(refresh_seconds)
        self.line_every_seconds = float(line_every_seconds)
        self._examples_per_step_arg = examples_per_step
        self._stream = stream
        self._dynamic_arg = dynamic
        self._reset_counters()

    # -- Keras hooks ------------------------------------------------------------

    def on_train_begin(self, logs=None):
        super().on_train_begin(logs)
        self._lookup_examples_per_step()

    def on_test_begin(self, logs=None):
        if not self._called_in_fit:
            self._lookup_examples_per_step()
        super().on_test_begin(logs)

    def on_predict_begin(self, logs=None):
        self._lookup_examples_per_step()
        super().on_predict_begin(logs)

    def on_epoch_begin(self, epoch, logs=None):
        self._reset_counters()
        if self.verbose and self.epochs > 1:
            self._write(f"Epoch {epoch + 1}/{self.epochs}\n")

    def on_epoch_end(self, epoch, logs=None):
        self._finalize(logs)

    def on_test_end(self, logs=None):
        if not self._called_in_fit:
            self._finalize(logs)

    def on_predict_end(self, logs=None):
        self._finalize(None)

    def _reset_progbar(self):  # Called by Keras's on_test_begin/on_predict_begin.
        self._reset_counters()

    def _maybe_init_progbar(self):  # Keras's Progbar is not used.
        pass

    def _batch_update_progbar(self, batch, logs=None):
        """Keras calls this after every step (or `steps_per_execution` steps)."""
        now = time.monotonic()
        self.seen = batch + 1
        if self._first is None:
            self._first = (self.seen, now)  # Tracing is over: rates start here.
        if self.verbose != 1 or (self.target and self.seen >= self.target):
            return  # The last step's line is the epoch's final one.
        interval = self.refresh_seconds if self._is_dynamic else self.line_every_seconds
        if now - self._last_write < interval:
            return
        self._values = _fetch_logs(logs)  # Waits for this step only.
        now = time.monotonic()
        self._render(now, final=False)
        self._last_write = now

    # -- internals --------------------------------------------------------------

    def _reset_counters(self):
        self.seen = 0
        self._values: Dict[str, float] = {}
        self._start = time.monotonic()
        self._first = None
        self._last_write = self._start
        self._width = 0
        self._is_dynamic = self._dynamic()  # Once per epoch, not an isatty() per step.

    def _lookup_examples_per_step(self):
        self.examples_per_step = self._examples_per_step_arg
        if self.examples_per_step is None and self.model is not None:
            coordinator = tf_objects.model_cluster_coordinator(self.model)
            self.examples_per_step = getattr(coordinator, "examples_per_step", None)

    def _dynamic(self) -> bool:
        if self._dynamic_arg is not None:
            return self._dynamic_arg
        stream = self._stream or sys.stdout
        return bool(getattr(stream, "isatty", lambda: False)()) or "ipykernel" in sys.modules

    def _write(self, text: str):
        stream = self._stream or sys.stdout
        stream.write(text)
        stream.flush()

    def _steps_per_sec(self, now: float) -> Optional[float]:
        if self._first is None:
            return None
        steps, since = self.seen - self._first[0], now - self._first[1]
        if steps <= 0 or since <= 0:
            # One update so far: the whole run, tracing included.
            steps, since = self.seen, now - self._start
        return steps / since if steps > 0 and since > 0 else None

    def _render(self, now: float, final: bool):
        target = self.target
        if target:
            digits = int(math.log10(target)) + 1
            filled = int(30 * min(self.seen, target) / target)
            bar = "=" * max(filled - 1, 0) + (">" if self.seen < target else "=") * (filled > 0)
            text = f"{self.seen:{digits}d}/{target} [{bar}{'.' * (30 - filled)}]"
        else:
            text = f"{self.seen} steps"
        rate = self._steps_per_sec(now)
        elapsed = now - self._start
        if final:
            text += f" - {elapsed:.0f}s"
            if self.seen:
                text += f" {1000 * elapsed / self.seen:.0f}ms/step"
        elif rate and target:
            text += f" - ETA: {_format_eta((target - self.seen) / rate)}"
        if rate and self.examples_per_step:
            text += f" - {_format_rate(rate * self.examples_per_step)} examples/s"
        elif rate:
            text += f" - {rate:.1f} steps/s"
        for name, value in self._values.items():
            text += f" - {name}: {_format_value(value)}"
        if self._is_dynamic:
            pad = " " * max(self._width - len(text), 0)
            self._width = len(text)
            self._write("\r" + text + pad + ("\n" if final else ""))
        else:
            self._write(text + "\n")

    def _finalize(self, logs):
        if not self.verbose:
            return
        values = _fetch_logs(logs)
        if values:
            self._values = values
        if self.target is None:
            self.target = self.seen
        self.seen = max(self.seen, self.target or 0)
        self._render(time.monotonic(), final=True)


# -- the strategy's hook into Keras ----------------------------------------------

def _uses_plugin(strategy: Any) -> bool:
    return bool(getattr(strategy, STRATEGY_MARKER, False))


def patch_keras_progress():
    """Lets fit/evaluate under the hybrid strategy use `ProgressBar`; returns the undo.

    Applied through `tf_psplugin._internal.patches` ("keras_progress_bar").

    Private Keras API, checked against Keras 2.15 (tf.keras) and tf-keras
    2.16-2.21, where both functions have the same name and signature:

    * ``<keras>.src.engine.training._get_verbosity(verbose, strategy)``:
      raises for ``verbose=1`` and maps ``"auto"`` to 2 under any strategy
      that uses a coordinator. For a strategy carrying `STRATEGY_MARKER` it
      returns 1 instead (2 when Keras logs through absl, as Keras does).
    * ``CallbackList._add_default_callbacks``: adds a `ProgbarLogger` when
      the user passed none; under such a strategy that default one is
      replaced by a `ProgressBar` (a user-passed logger is kept), and each
      `ChiefCheckpoint`'s train end is appended to the list
      (`ChiefCheckpoint.train_end_last`): its final save comes after every
      other callback's `on_train_end`, so it holds the weights `fit`
      returns with (tf-keras 2.16+'s `EarlyStopping(restore_best_weights=
      True)` sets them back there).

    Every other strategy goes through Keras's original functions.
    """
    training = _tf_internal.keras_private_module("engine.training")
    callbacks = _tf_internal.keras_private_module("callbacks")
    io_utils = _tf_internal.keras_private_module("utils.io_utils")
    original_verbosity = keras_members.keras_get_verbosity(training)
    original_add_defaults = keras_members.add_default_callbacks(callbacks.CallbackList)

    def _get_verbosity(verbose, distribute_strategy):
        if _uses_plugin(distribute_strategy) and verbose in (1, "auto"):
            if verbose == "auto" and not io_utils.is_interactive_logging_enabled():
                return 2
            return 1
        return original_verbosity(verbose, distribute_strategy)

    def _add_default_callbacks(self, add_history, add_progbar):
        passed = list(self.callbacks)
        original_add_defaults(self, add_history, add_progbar)
        default = keras_members.callback_list_progbar(self)
        if (default is not None and not any(default is cb for cb in passed)
                and type(default) is callbacks.ProgbarLogger
                and _uses_plugin(tf.distribute.get_strategy())):
            replacement = ProgressBar()
            self.callbacks[self.callbacks.index(default)] = replacement
            keras_members.set_callback_list_progbar(self, replacement)
        if _uses_plugin(tf.distribute.get_strategy()):
            self.callbacks.extend([cb.train_end_last() for cb in list(self.callbacks)
                                   if isinstance(cb, checkpoint_callback.ChiefCheckpoint)])

    keras_members.set_keras_get_verbosity(training, _get_verbosity)
    keras_members.set_add_default_callbacks(callbacks.CallbackList, _add_default_callbacks)

    def undo():
        keras_members.set_keras_get_verbosity(training, original_verbosity)
        keras_members.set_add_default_callbacks(callbacks.CallbackList, original_add_defaults)

    return undo
