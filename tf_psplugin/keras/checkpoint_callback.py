"""`ChiefCheckpoint`: the Keras callback that checkpoints a cluster job from the chief.

Why this module exists: `fit` users get the chief's checkpointing
(`state.checkpoint.ChiefCheckpointManager`: one writer, only committed
checkpoints trusted, any restore shape) as one callback, beside the other
Keras callbacks of this layer: restore at train begin, saves by steps or
seconds between steps, a final save after every other callback's
`on_train_end`, and the evaluator's ``TRAINING_DONE`` signal.
"""

import time
from typing import Any, Callable, Optional

from tf_psplugin._internal import deprecation as _deprecation
from tf_psplugin._internal.compat import keras
from tf_psplugin.state import checkpoint as checkpoint_lib
from tf_psplugin.state import checkpoint_write
from tf_psplugin.state import input_state
from tf_psplugin.state import model_dir as model_dir_lib

__all__ = ["ChiefCheckpoint"]


class ChiefCheckpoint(keras.callbacks.Callback):
    """Keras callback: checkpoints from the chief, restores at train begin, final save.

    At train begin it restores the latest committed checkpoint in `model_dir`
    (if any; optimizer slots included). It saves every `save_every_steps`
    steps and/or `save_every_seconds` seconds (checked once per
    `steps_per_execution`); with neither given, every 600 seconds
    (`DEFAULT_SAVE_EVERY_SECS`, Estimator RunConfig's default),
    so a PS failure loses at most that much training. At train end it writes
    a final checkpoint
    and, once `final_step` is reached, ``TRAINING_DONE`` (the evaluator's
    signal to stop). Batch hooks never read the step's RemoteValues, so
    saving does not slow down steps between saves.

    With ``save_input_position=True`` each checkpoint also holds where
    every worker's input stands (the tf.data iterators' state, written by
    each worker: `tf_psplugin.state.input_state`), and a resumed `fit` continues
    the input from there: give `fit` the dataset from its start, and the
    first step comes as soon after a restart at step 50,000 as at step
    1,000 (no skipping). Off by default, because a program that already
    builds its dataset at the recorded offset would skip twice.

    Each checkpoint also records the input position as a number: batches of
    the dataset given to `fit` consumed so far. Without
    ``save_input_position``, resume the input by building the dataset at
    that offset before `fit`:

    ```python
    info = tf_psplugin.latest_checkpoint_info(model_dir)
    offset = info.input_position if info else 0
    dataset = gen.dataset(batch_size, offset_batches=offset)
    model.fit(dataset, steps_per_epoch=train_steps - (info.step if info else 0),
              callbacks=[tf_psplugin.ChiefCheckpoint(model_dir, save_every_steps=1000,
                                                     final_step=train_steps)])
    ```

    Args:
        model_dir: Directory for checkpoints (see `ChiefCheckpointManager`).
        save_every_steps: Save every this many steps (None: not by steps).
        save_every_seconds: Save when this many seconds passed (None: not by
            time, unless `save_every_steps` is None too: then 600). 0 turns
            periodic saves off (only the final one at train end).
        max_to_keep: Checkpoints kept.
        restore: Restore the latest checkpoint at train begin.
        final_step: ``TRAINING_DONE`` is written at train end when the step
            reached it; None writes it at every train end.
        batches_per_step: See `ChiefCheckpointManager`.
        write_on_chief: See `ChiefCheckpointManager`.
        save_input_position: Also save each worker's input position and
            continue from it on resume (see above).
        clock: Seconds clock (injectable for tests).
        save_every_secs: Deprecated name of `save_every_seconds`.
        full_every_saves: Every `full_every_saves`-th save is full, the saves
            between are deltas (see `ChiefCheckpointManager`); None: every
            save is full.
        full_every: Deprecated name of `full_every_saves`.
    """

    def __init__(self, model_dir: str, save_every_steps: Optional[int] = None,
                 save_every_seconds: Optional[float] = None, max_to_keep: Optional[int] = 5,
                 restore: bool = True, final_step: Optional[int] = None,
                 batches_per_step: Optional[int] = None, write_on_chief: bool = False,
                 save_input_position: bool = False,
                 clock: Callable[[], float] = time.monotonic,
                 save_every_secs: Any = _deprecation.UNSET,
                 full_every_saves: Optional[int] = None, full_every: Any = _deprecation.UNSET):
        super().__init__()
        self._supports_tf_logs = True  # Allowed with PSS; logs are never read.
        save_every_seconds = _deprecation.renamed(
            "ChiefCheckpoint", "save_every_secs", save_every_secs, "save_every_seconds",
            save_every_seconds, None)
        full_every_saves = _deprecation.renamed(
            "ChiefCheckpoint", "full_every", full_every, "full_every_saves", full_every_saves, None)
        if save_every_seconds is not None and save_every_seconds < 0:
            raise ValueError(
                f"save_every_seconds must be >= 0 or None, got {save_every_seconds!r}.")
        if save_every_steps is None and save_every_seconds is None:
            save_every_seconds = checkpoint_lib.DEFAULT_SAVE_EVERY_SECS
        save_every_seconds = save_every_seconds or None  # 0: no periodic saves.
        self.model_dir = model_dir_lib.resolve(model_dir)
        self._kwargs = dict(max_to_keep=max_to_keep, save_every_steps=save_every_steps,
                            save_every_seconds=save_every_seconds,
                            batches_per_step=batches_per_step,
                            write_on_chief=write_on_chief, clock=clock,
                            full_every_saves=full_every_saves)
        self._restore = restore
        self.final_step = final_step
        self.save_input_position = bool(save_input_position)
        self._original_train_function = None
        self._input_pending: Optional[model_dir_lib.CheckpointInfo] = None
        self._periodic = bool(save_every_steps or save_every_seconds)
        # Created now, typically outside strategy.scope(), so the checkpoint's
        # save counter is a plain chief variable, not a replicated one.
        self._root = checkpoint_write.TracedWriteCheckpoint()
        _ = self._root.save_counter
        self.manager: Optional[checkpoint_lib.ChiefCheckpointManager] = None
        self.restored: Optional[model_dir_lib.CheckpointInfo] = None
        if restore and final_step is not None and model_dir_lib.is_chief_task():
            # A resumed run is not done: say so as early as possible (the
            # evaluator may already be watching). Checked again at train begin.
            latest = model_dir_lib.latest_checkpoint_info(self.model_dir)
            if latest is not None and latest.step < final_step:
                model_dir_lib.clear_training_done(self.model_dir)
        self._step = 0
        self._done_in_epoch = 0
        self._train_end_deferred = False  # Set by `train_end_last`.

    def _implements_train_batch_hooks(self):
        return self._periodic

    def on_train_begin(self, logs=None):
        if self.manager is None or self.manager.model is not self.model:
            self.manager = checkpoint_lib.ChiefCheckpointManager(
                self.model_dir, model=self.model, optimizer=self.model.optimizer,
                _root=self._root, **self._kwargs)
            if self._restore:  # Once per model: a second fit() continues in memory.
                self.restored = self.manager.restore_or_initialize()
                self._input_pending = self.restored
        if self.save_input_position:
            self._watch_input()
        self._step = int(self.model.optimizer.iterations.numpy())
        if self.manager.is_writer and (self.final_step is None or self._step < self.final_step):
            model_dir_lib.clear_training_done(self.model_dir)

    def on_epoch_begin(self, epoch, logs=None):
        self._done_in_epoch = 0

    def on_train_batch_end(self, batch, logs=None):
        # `batch` is the index of the last step of this execution in the epoch.
        self._step += batch + 1 - self._done_in_epoch
        self._done_in_epoch = batch + 1
        if self.manager.should_save(self._step):
            self._save(final=False)

    def on_train_end(self, logs=None):
        if not self._train_end_deferred:
            self.train_end()

    def train_end_last(self) -> keras.callbacks.Callback:
        """A callback that runs this one's train end, for the end of the callback list.

        The final save then comes after every other callback's
        `on_train_end` (tf-keras 2.16+'s `EarlyStopping(restore_best_weights=
        True)` sets the best weights back there), while this callback's
        other hooks keep their place (its restore at train begin comes
        first). Under the strategy `fit` appends it itself
        (`keras.progress`); this callback's own `on_train_end` then does
        nothing, until the train end has run.
        """
        self._train_end_deferred = True
        outer = self

        class _TrainEnd(keras.callbacks.Callback):
            def __init__(self):
                super().__init__()
                self._supports_tf_logs = True

            def on_train_end(self, logs=None):
                outer.train_end()

        return _TrainEnd()

    def train_end(self) -> None:
        """The final save (and ``TRAINING_DONE``); puts back the wrapped train function."""
        self._train_end_deferred = False
        try:
            self._save(final=True)
        finally:
            if self._original_train_function is not None:
                self.model.train_function = self._original_train_function
                self._original_train_function = None

    def _watch_input(self) -> None:
        """Learns the training iterator from Keras's train function, and restores it.

        Keras builds `model.train_function` before `on_train_begin` and calls
        it with the epoch's per-worker iterator at every step; there is no
        callback hook that sees the iterator. The wrapper hands it to the
        manager (its position is saved with every checkpoint) and, on the
        first step after a restore, moves it to the restored position. The
        original function is put back at train end.
        """
        original = self.model.train_function
        if original is None or self._original_train_function is not None:
            return
        self._original_train_function = original

        def train_function(iterator):
            if self.manager.input_iterator is not iterator:
                self.manager.input_iterator = iterator
                if self._input_pending is not None:
                    pending, self._input_pending = self._input_pending, None
                    checkpoint_lib.join_steps(self.manager.strategy)
                    input_state.restore(iterator, pending.path)
            return original(iterator)

        self.model.train_function = train_function

    def _save(self, final: bool) -> None:
        checkpoint_lib.join_steps(self.manager.strategy)
        self._step = int(self.model.optimizer.iterations.numpy())  # Exact once steps joined.
        done = final and (self.final_step is None or self._step >= self.final_step)
        self.manager.save(self._step, final=done)
