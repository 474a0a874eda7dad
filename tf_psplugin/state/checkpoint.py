"""Chief checkpointing: one writer, only complete checkpoints trusted, any restore shape.

Why this module exists: with `HybridParameterServerStrategy` a model's state
is spread over the whole cluster -- table shards on the PS tasks, dense
replicas on the workers, the chief's primary copies in between -- and stock
tools each get a piece of it wrong:

* Saving must first let in-flight synchronous steps finish and copy worker
  0's replicas into the chief's primaries (`ReplicatedVariable.pull`);
  otherwise the checkpoint mixes tables of step N with dense weights of step
  N-k. After a restore the primaries must be pushed to every worker: TF
  restores multi-device checkpoints inside a `tf.function`, where the
  replicated variable cannot notice the write.
* TF saves each table shard on the PS task that holds it: the PS processes
  write their part of every checkpoint into ``model_dir`` themselves (so it
  must be on a filesystem the chief and the PS tasks share, with the same
  absolute path -- relative paths are resolved on the chief, never against a
  PS task's own cwd), and the last one merges the index. Nothing else ever
  writes there: workers and the evaluator never do.
* A crash in the middle of a save must never leave a checkpoint that a
  restore would pick, nor leave none. After TF has written the data and the
  index, the chief writes a commit marker ``<prefix>.commit`` (JSON: step,
  input position, and the size of every file of the checkpoint); only then
  does TF's `CheckpointManager` update its ``checkpoint`` state file and
  delete checkpoints beyond `max_to_keep` (the marker is written by a write
  callback, which TF runs before its own), so a failure between the write
  and the commit leaves the previous checkpoint in place. Only checkpoints
  with a marker whose files all exist with those sizes are restored,
  evaluated or exported; the state file is not trusted (naming and markers:
  model_dir.py).
* Optimizer slots must be created before restoring: Keras defers the restore
  of slots that do not exist yet, and a sharded table's deferred slot restore
  is lost (tensorflow 62215). Slots of interleaved tables are saved in
  logical row order (`optimizer_slots.install_checkpoint_listing`), so they reshard.

Checkpoints hold full logical tables (each shard saves its rows as a slice of
the ``[V, D]`` tensor), so they restore into any number of PS tasks, any
number of workers, and plain single-process Keras models (`load_into`).

With ``full_every_saves=K``, only every K-th save is a full checkpoint; the saves
between are deltas holding the table rows updated since the previous save
(`tf_psplugin.state.incremental`), and a restore applies the latest full
checkpoint's chain of deltas. TF's manager keeps `max_to_keep` full
checkpoints; a delta is deleted only with the full checkpoint it builds on,
so `max_to_keep` counts chains.
"""

import copy
import os
import json
import time
import warnings
import weakref
from typing import Any, Callable, List, Mapping, Optional, Union

import tensorflow as tf
from absl import logging

from tf_psplugin._internal import deprecation as _deprecation
from tf_psplugin._internal import tf_objects
from tf_psplugin._internal.tf_internal import sharded_variable
from tf_psplugin.state import checkpoint_write
from tf_psplugin.state import incremental
from tf_psplugin.state import input_state
from tf_psplugin.state import model_dir as model_dir_lib
from tf_psplugin.state import optimizer_slots
from tf_psplugin.state.model_dir import (  # noqa: F401  (re-exported: part of this API)
    CHECKPOINT_NAME, COMMIT_SUFFIX, DELTA_NAME, CheckpointError, CheckpointInfo,
    checkpoint_chain, commit_checkpoint, info_for_prefix, latest_checkpoint_info, list_checkpoints,
    remove_commit_marker, resolve_checkpoint, verify_checkpoint)
from tf_psplugin.state.optimizer_slots import build_optimizer_slots  # noqa: F401  (re-exported)
from tf_psplugin.state.plain_model import load_into  # noqa: F401  (re-exported)
from tf_psplugin.sync import outside_writes
from tf_psplugin.sync.replicated import ReplicatedVariable
from tf_psplugin.tables import fusion
from tf_psplugin.tables import slot_order
from tf_psplugin.tables import stacking

__all__ = [
    "COMMIT_SUFFIX",
    "CheckpointError",
    "CheckpointInfo",
    "CheckpointManager",
    "ChiefCheckpointManager",
    "build_optimizer_slots",
    "latest_checkpoint",
    "latest_checkpoint_info",
    "list_checkpoints",
    "load_into",
    "verify_checkpoint",
]

_CHIEF_CPU = "/job:chief/replica:0/task:0/device:CPU:0"
# ChiefCheckpoint's save interval when none is given (Estimator's RunConfig
# default, save_checkpoints_secs=600): what a PS failure can cost at most.
DEFAULT_SAVE_EVERY_SECS = 600.0


# --- Distributed state: in-flight steps, replicas, slots ----------------------


# The writers failover asks for an emergency save (`fault.failover`). Weak: a
# checkpoint manager (and the model it references) lives as long as the
# user's code keeps it; a notebook that builds many models frees them.
_checkpointers: List["weakref.ref"] = []


def register_checkpointer(checkpointer) -> None:
    """Registers what saves the emergency checkpoint during failover recovery.

    Args:
        checkpointer: An object with `save_emergency() -> Optional[str]`
            (saves now; returns the path) — the plugin's checkpoint callback
            and `ChiefCheckpointManager` register themselves.
    """
    if checkpointer not in live_checkpointers():
        _checkpointers.append(weakref.ref(checkpointer))


def live_checkpointers() -> List:
    """The registered checkpointers still alive, oldest first (dead ones dropped)."""
    live = [c for c in (ref() for ref in list(_checkpointers)) if c is not None]
    _checkpointers[:] = [weakref.ref(c) for c in live]
    return live


class _TrainingState(checkpoint_write.FedPythonState):
    """Python state saved in every checkpoint: step and input position."""

    def __init__(self):
        self.step = 0
        self.input_position: Optional[int] = None

    def serialize(self):
        return json.dumps({"step": int(self.step), "input_position": self.input_position})

    def deserialize(self, string_value):
        data = json.loads(string_value)
        self.step = int(data.get("step", 0))
        self.input_position = data.get("input_position")


def _reachable(objects: List[Any]) -> List[Any]:
    """What `objects` hold: their trackable descendants and their `variables`/`weights`."""
    candidates = []
    for obj in objects:
        if obj is None:
            continue
        candidates.extend(tf.train.TrackableView(obj).descendants())
        for attr in ("variables", "weights"):
            value = getattr(obj, attr, None)
            value = value() if callable(value) else value
            if isinstance(value, (list, tuple)):
                candidates.extend(value)
    return candidates


def _replicated_variables(objects: List[Any], reachable: Optional[List[Any]] = None
                          ) -> List[Any]:
    """Every `ReplicatedVariable` reachable from `objects` (slots included)."""
    found = {}
    for candidate in _reachable(objects) if reachable is None else reachable:
        if isinstance(candidate, ReplicatedVariable):
            found[id(candidate)] = candidate
    return list(found.values())


def _storage_of(var) -> List[Any]:
    """The variables whose writes `outside_writes` numbers, holding `var`'s values.

    A dense weight is its `ReplicatedVariable`; a table is its shards (a
    stacked table's views: its stack's shards); a PS variable, a stack's
    shard or a table slot is itself and each variable inside its wrappers.
    """
    var = tf_objects.autocast_inner(var)
    if isinstance(var, sharded_variable.ShardedVariableMixin):
        return [s for part in tf_objects.sharded_shards(var) for s in _storage_of(part)]
    if isinstance(var, stacking.TableView):
        return _storage_of(var.stack_shard)
    return outside_writes.levels(var) if isinstance(var, tf.Variable) else []


def _storage_variables(reachable: List[Any]) -> List[Any]:
    """The variables holding the values of `reachable` (`_storage_of` each), each once."""
    found = {}
    for candidate in reachable:
        for var in _storage_of(candidate):
            found[id(var)] = var
    return list(found.values())


def _watch_writes(reachable: List[Any]) -> None:
    """Numbers every later eager write to the variables of `reachable` (`outside_writes`).

    The strategy watches each table variable and numbers each replicated
    variable's writes from their creation; this covers the rest (a model
    without the strategy, a variable made elsewhere). Idempotent.
    """
    for var in _storage_variables(reachable):
        if not isinstance(var, ReplicatedVariable):  # (It numbers its own writes.)
            outside_writes.watch(var)


def _written_outside_steps(objects: List[Any], since: int) -> List[str]:
    """Names of the variables of `objects` written eagerly after `outside_writes` generation
    `since` (`set_weights`, use_ema's finalize, EarlyStopping's restore of the best weights).
    """
    if outside_writes.generation() <= since:
        return []  # Nothing written since: no walk (the common case).
    storage = _storage_variables(_reachable(objects))
    return sorted({getattr(var, "name", "?")
                   for var in outside_writes.written_after(storage, since)})


def _coordinator(strategy):
    """The strategy's coordinator, or None for strategies that have none."""
    if not isinstance(strategy, tf.distribute.experimental.ParameterServerStrategy):
        return None
    # The public constructor returns the strategy's existing coordinator.
    return tf.distribute.experimental.coordinator.ClusterCoordinator(strategy)


def join_steps(strategy) -> None:
    """Waits for every scheduled step (and raises its error, if any)."""
    coordinator = _coordinator(strategy)
    if coordinator is not None:
        coordinator.join()


def _num_sync_workers(strategy) -> int:
    """Workers that each consume one batch per synchronous step (1 if async)."""
    coordinator = _coordinator(strategy)
    if coordinator is not None and getattr(coordinator, "synchronous", False):
        return int(coordinator.num_workers)
    return 1


# --- The manager --------------------------------------------------------------


class ChiefCheckpointManager:
    """Saves and restores a distributed model from the chief, for custom loops.

    Not a `tf.train.CheckpointManager`: its `save(step)` and `restore`
    return a `CheckpointInfo`, not a path, and it commits every checkpoint
    it writes. Its former name, `CheckpointManager`, which shadowed TF's,
    is a deprecated alias.

    Wraps `tf.train.Checkpoint` + `tf.train.CheckpointManager` (checkpoints
    are ``<model_dir>/ckpt-<step>``, the ``checkpoint`` state file is kept
    for stock tools) and adds the distributed and atomicity parts described
    in the module docstring. Build it on the chief after the model and the
    optimizer, outside `strategy.scope()`. In a non-chief process it restores
    but never writes.

    Example:

    ```python
    manager = tf_psplugin.ChiefCheckpointManager(
        "/shared/run1", model=model, optimizer=optimizer, save_every_steps=1000)
    info = manager.restore_or_initialize()          # None on a fresh start
    step = info.step if info else 0
    while step < train_steps:
        coordinator.schedule(train_step, args=(iterator,))
        step += 1
        manager.maybe_save(step)
    manager.save(step, final=True)                  # also writes TRAINING_DONE
    ```

    Args:
        model_dir: Directory for checkpoints; relative paths are made absolute
            here (see `tf_psplugin.state.model_dir.resolve`).
        model: A Keras model (or any trackable), saved as ``model``.
        optimizer: Its optimizer, saved as ``optimizer`` (slots included).
        extra: More trackables to save, by name.
        max_to_keep: Checkpoints kept (older ones deleted); None keeps all.
        save_every_steps: `maybe_save` saves when this many steps have passed.
        save_every_seconds: `maybe_save` saves when this many seconds have passed.
        batches_per_step: Batches of the training dataset one step consumes,
            for the input position; default: the number of workers in
            synchronous mode (each reads its own batch), else 1.
        write_on_chief: Send every tensor to the chief and write all files
            there (no shared filesystem needed, but whole tables pass through
            the chief's memory). Default: each PS task writes its shards.
        strategy: The distribution strategy (default: the model's).
        clock: Seconds clock for `save_every_seconds` (injectable for tests).
        input_iterator: The per-worker iterator the training steps read
            (``iter(coordinator.create_per_worker_dataset(...))``). Each save
            then also writes where every worker's input stands, and `restore`
            moves the iterator there (`tf_psplugin.state.input_state`): a resumed
            job continues its input without reading it again. Build the
            dataset from its start, with no offset. Settable later as the
            `input_iterator` attribute.
        save_every_secs: Deprecated name of `save_every_seconds`.
        full_every_saves: Incremental checkpoints: every K-th save is full,
            the ones between are deltas holding only the table rows (and their
            slots) updated since the previous save, plus the dense state
            (`tf_psplugin.state.incremental`). The first save of a manager is
            always full. Build the manager before the first training step.
            None (default) or 1: every save is full. (Formerly `full_every`.)

    Raises:
        ModelDirError: if the chief cannot write `model_dir`.
        CheckpointError: `full_every_saves` given for a model it cannot save as deltas.
        ValueError: a former name and its new name given different values.
    """

    def __init__(self, model_dir: str, model=None, optimizer=None,
                 extra: Optional[Mapping[str, Any]] = None, max_to_keep: Optional[int] = 5,
                 save_every_steps: Optional[int] = None,
                 save_every_seconds: Optional[float] = None,
                 batches_per_step: Optional[int] = None, write_on_chief: bool = False,
                 strategy=None, clock: Callable[[], float] = time.monotonic,
                 input_iterator=None, _root: Optional[tf.train.Checkpoint] = None,
                 save_every_secs: Any = _deprecation.UNSET,
                 full_every_saves: Optional[int] = None, full_every: Any = _deprecation.UNSET):
        save_every_seconds = _deprecation.renamed(
            type(self).__name__, "save_every_secs", save_every_secs, "save_every_seconds",
            save_every_seconds, None)
        full_every_saves = _deprecation.renamed(type(self).__name__, "full_every", full_every,
                                                "full_every_saves", full_every_saves, None)
        for name, value in (("save_every_steps", save_every_steps),
                            ("save_every_seconds", save_every_seconds),
                            ("max_to_keep", max_to_keep), ("full_every_saves", full_every_saves)):
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be > 0 or None, got {value!r}.")
        self.model_dir = model_dir_lib.resolve(model_dir)
        self.is_writer = model_dir_lib.is_chief_task()
        if self.is_writer:
            model_dir_lib.ensure_writable(self.model_dir)
        self._model = model
        self._optimizer = optimizer
        self._strategy = strategy if strategy is not None else getattr(
            model, "distribute_strategy", None)
        self._save_every_steps = save_every_steps
        self._save_every_seconds = save_every_seconds
        self.input_iterator = input_iterator
        self._batches_per_step = batches_per_step
        self._clock = clock
        self._state = _TrainingState()
        # The save counter is created here, before any step runs and
        # (documented) outside strategy.scope(), so it is a plain chief
        # variable; ChiefCheckpoint makes its root even earlier.
        self._root = _root if _root is not None else checkpoint_write.TracedWriteCheckpoint()
        _ = self._root.save_counter
        objects = {"model": model, "optimizer": optimizer, "training_state": self._state}
        objects.update(extra or {})
        for name, obj in objects.items():
            if obj is not None:
                setattr(self._root, name, obj)
        self._objects = [obj for obj in objects.values() if obj is not None]
        # Also the model's own optimizer (saved with the model): table slots in logical order.
        optimizer_slots.install_checkpoint_listing(
            optimizer if optimizer is not None else getattr(model, "optimizer", None))
        self._options = tf.train.CheckpointOptions(
            experimental_io_device=_CHIEF_CPU if write_on_chief else None)
        self._manager = tf.train.CheckpointManager(
            self._root, self.model_dir, max_to_keep=max_to_keep, checkpoint_name=CHECKPOINT_NAME)
        self._last_save_step: Optional[int] = None
        self._last_save_time = clock()
        # `outside_writes` generation when `latest` was saved or restored:
        # a write after it (at the same step) makes `latest` stale.
        self._writes_seen = outside_writes.generation()
        self._base_step = 0  # Step and input position at the last restore.
        self._base_position = 0
        self.latest: Optional[CheckpointInfo] = None
        self._full_every = int(full_every_saves or 1)
        self._incremental: Optional[incremental.IncrementalSaver] = None
        # (base full checkpoint name, name of the last save, saves in this chain).
        self._chain: Optional[tuple] = None
        if self._full_every > 1 and model is not None:
            # Rows are stamped per stack shard, and each table's are found
            # by its place in its stack: the model's stacks are split now,
            # as its first traced call would, so they stay where they are.
            fusion.separate_before_slots(model)
        if self.is_writer and self._full_every > 1:
            self._incremental = incremental.IncrementalSaver(
                self._root, self._strategy,
                optimizer if optimizer is not None else getattr(model, "optimizer", None),
                python_state=[self._state])
        if self.is_writer and optimizer is not None:
            # Failover saves what survives a dead worker through us.
            register_checkpointer(self)

    def save_emergency(self) -> Optional[str]:
        """Saves the survivors' state during failover recovery (see failover.py).

        The coordinator has already pointed eager reads at a surviving worker
        and abandoned the failed step, so this is an ordinary save of the
        last committed step.

        Returns:
            The checkpoint path, or None if nothing could be saved.
        """
        if self._optimizer is None:
            return None
        if self.input_iterator is not None:
            # The failed worker's input position died with it: a checkpoint
            # now would hold a model whose input cannot continue. The job
            # resumes from the last periodic checkpoint, where both agree.
            logging.warning("tf_psplugin: no emergency checkpoint: the failed worker's input "
                            "position is lost, and this job saves its input position with "
                            "every checkpoint; it resumes from the latest periodic checkpoint, "
                            "where model and input agree.")
            return None
        info = self.save(int(self._optimizer.iterations.numpy()))
        return info.path if info is not None else None

    @property
    def model(self):
        """The model being checkpointed (None if none was given)."""
        return self._model

    @property
    def strategy(self):
        """The distribution strategy whose steps are joined before saving."""
        return self._strategy

    # -- positions --------------------------------------------------------------

    def input_position(self, step: int) -> int:
        """Batches consumed at `step`: restored position + steps since x batches per step."""
        per_step = self._batches_per_step or _num_sync_workers(self._strategy)
        return self._base_position + max(int(step) - self._base_step, 0) * per_step

    # -- saving -----------------------------------------------------------------

    def should_save(self, step: int) -> bool:
        """Whether `save_every_steps` or `save_every_seconds` says `step` is due."""
        if self._last_save_step is not None and step <= self._last_save_step:
            return False
        last = self._last_save_step if self._last_save_step is not None else self._base_step
        if self._save_every_steps and step - last >= self._save_every_steps:
            return True
        return bool(self._save_every_seconds) and (
            self._clock() - self._last_save_time >= self._save_every_seconds)

    def maybe_save(self, step: int) -> Optional[CheckpointInfo]:
        """Saves if `should_save(step)`; returns the new checkpoint or None."""
        return self.save(step) if self.should_save(step) else None

    def save(self, step: int, final: bool = False) -> Optional[CheckpointInfo]:
        """Writes and commits a checkpoint of the state after `step` steps.

        Waits for in-flight steps, pulls the dense replicas into the chief's
        primaries, writes ``ckpt-<step>`` (the PS tasks write their shards),
        then the commit marker; only then lets TF's manager delete checkpoints
        beyond `max_to_keep`, and drops markers of deleted checkpoints.
        If this manager already saved or restored the checkpoint of `step`
        and no weight, table or optimizer variable it saves was written
        outside a step since (`use_ema`'s finalize, `EarlyStopping(
        restore_best_weights=True)`, `set_weights`: see `outside_writes`),
        nothing is rewritten; otherwise the checkpoint of `step` is written
        again, in full (also in an incremental chain: a delta of the same
        step would not be applied after its parent), and replaces any other
        checkpoint of the same step (its marker is removed first).

        Args:
            step: The step number (e.g. `optimizer.iterations`).
            final: Also write ``TRAINING_DONE`` (the evaluator's exit signal).

        Returns:
            The committed checkpoint; None in a non-chief process.

        Raises:
            CheckpointError: if the save fails (message says why and the fix).
        """
        if not self.is_writer:
            return None
        step = int(step)
        latest = self.latest
        rewrite = False
        if latest is not None and latest.step == step and verify_checkpoint(latest) is None:
            written = _written_outside_steps(self._objects, self._writes_seen)
            if not written:
                # Nothing changed since this manager saved or restored it.
                if final:
                    model_dir_lib.write_training_done(self.model_dir, step, latest.path)
                return latest
            logging.info("tf_psplugin: step %d saved again: %d variable(s) written since its "
                         "checkpoint without a step (e.g. %s)", step, len(written), written[0])
            rewrite = True
        join_steps(self._strategy)
        reachable = _reachable(self._objects)
        for var in _replicated_variables(self._objects, reachable):
            var.pull()
        _watch_writes(reachable)
        self._state.step = step
        self._state.input_position = self.input_position(step)
        seen = outside_writes.generation()  # Writes from here on are after this checkpoint.
        if self._incremental is not None and self._chain is not None and \
                self._chain[2] < self._full_every and not rewrite:
            return self._save_delta(step, final, seen)
        if self._incremental is not None:
            self._chain = None
            self._incremental.begin_full()
        prefix = model_dir_lib.join(self.model_dir, f"{CHECKPOINT_NAME}-{step}")
        remove_commit_marker(prefix)  # Never trust a half-overwritten checkpoint.
        if self.input_iterator is not None:
            # Before the checkpoint's commit: a committed checkpoint's input
            # state is complete (or absent, after a warning).
            input_state.remove(prefix)
            input_state.save(self.input_iterator, prefix)
        committed: List[CheckpointInfo] = []
        position = self._state.input_position

        def commit(save_path):
            # TF's CheckpointManager.save appends its own callback (state
            # file, then deletion of checkpoints beyond max_to_keep) after
            # ours: nothing old is deleted before this one is committed. The
            # write is synchronous here (the chief's eager executor is sync
            # under PSS), so the files are complete.
            committed.append(commit_checkpoint(save_path, step, position))

        options = copy.copy(self._options)
        options.experimental_write_callbacks = [commit]
        try:
            path = self._manager.save(checkpoint_number=step, options=options)
        except (tf.errors.NotFoundError, tf.errors.PermissionDeniedError,
                tf.errors.FailedPreconditionError) as e:
            raise CheckpointError(
                f"saving {prefix} failed: {e.message.splitlines()[0]}. Fix: model_dir must be "
                "writable by the chief and every PS task, under the same absolute path on a "
                "shared filesystem (or use write_on_chief=True).") from None
        info = committed[0] if committed else commit_checkpoint(path, step, position)
        if self._incremental is not None:
            self._chain = (info.name, info.name, 1)
        self._last_save_step, self._last_save_time = step, self._clock()
        self.latest, self._writes_seen = info, seen
        self._drop_stale_markers()
        if final:
            model_dir_lib.write_training_done(self.model_dir, step, path)
        logging.info("tf_psplugin: checkpoint %s committed (step %d)", path, step)
        return info

    def _save_delta(self, step: int, final: bool, seen: int) -> CheckpointInfo:
        """Writes and commits ``delta-<step>`` on top of the current chain."""
        base, parent, count = self._chain
        self._chain = None  # Until this delta is committed: a failure means "full next".
        prefix = model_dir_lib.join(self.model_dir, f"{DELTA_NAME}-{step}")
        model_dir_lib.remove_delta(prefix)
        position = self._state.input_position
        try:
            self._incremental.check_covers(model_dir_lib.join(self.model_dir, base))
            if self.input_iterator is not None:
                input_state.remove(prefix)
                input_state.save(self.input_iterator, prefix)
            manifest = self._incremental.write_delta(
                prefix, self.model_dir, io_device=self._options.experimental_io_device)
            bundles = [model_dir_lib.join(self.model_dir, rel)
                       for rel in manifest["row_files"] + [manifest["dense"]]]
            info = model_dir_lib.commit_delta(prefix, step, position, base=base, parent=parent,
                                              manifest=manifest, bundles=bundles)
        except (tf.errors.NotFoundError, tf.errors.PermissionDeniedError,
                tf.errors.FailedPreconditionError) as e:
            model_dir_lib.remove_delta(prefix)
            input_state.remove(prefix)
            raise CheckpointError(
                f"saving {prefix} failed: {e.message.splitlines()[0]}. Fix: model_dir must be "
                "writable by the chief and every PS task, under the same absolute path on a "
                "shared filesystem.") from None
        except BaseException:
            model_dir_lib.remove_delta(prefix)  # No marker was written: never restored.
            input_state.remove(prefix)
            raise
        self._chain = (base, info.name, count + 1)
        self._last_save_step, self._last_save_time = step, self._clock()
        self.latest, self._writes_seen = info, seen
        if final:
            model_dir_lib.write_training_done(self.model_dir, step, prefix)
        logging.info("tf_psplugin: delta %s committed (step %d, base %s)", prefix, step, base)
        return info

    def _drop_stale_markers(self) -> None:
        kept = set(self._manager.checkpoints)
        # A delta is useless without its base: deleted with it, never before.
        for path in model_dir_lib.drop_orphan_deltas(
                self.model_dir, {os.path.basename(path) for path in kept}):
            input_state.remove(path)
        for info in list_checkpoints(self.model_dir):
            if info.path not in kept and verify_checkpoint(info) is not None:
                remove_commit_marker(info.path)
        # Input states of checkpoints TF's manager deleted.
        pattern = model_dir_lib.join(self.model_dir, f"{CHECKPOINT_NAME}-*.input")
        for directory in tf.io.gfile.glob(pattern):
            path = directory[:-len(".input")]
            if path not in kept and not tf.io.gfile.exists(path + ".index"):
                input_state.remove(path)

    # -- restoring --------------------------------------------------------------

    def restore(self, checkpoint: Union[str, CheckpointInfo, None] = None) -> CheckpointInfo:
        """Restores a checkpoint into the (already built) objects.

        Optimizer slots are created first, in-flight steps finish, and the
        restored dense values are pushed to every worker afterwards. Tables
        reshard to the current number of PS tasks.

        Args:
            checkpoint: A `CheckpointInfo`, a checkpoint prefix, or None for
                the latest committed checkpoint in `model_dir`.

        Returns:
            What was restored.

        Raises:
            CheckpointError: no committed checkpoint, or it does not match.
        """
        info, deltas = self._resolve_chain(checkpoint)
        optimizer_slots.build_slots(self._model, self._optimizer, self._strategy)
        optimizer = optimizer_slots.match_checkpoint(  # Listed as `info` lists them.
            self._model, self._optimizer, info.path)
        join_steps(self._strategy)
        replicated = _replicated_variables(self._objects)
        for var in replicated:
            var.pull()
        try:
            status = self._root.read(info.path, options=self._options)
            status.assert_existing_objects_matched()
            status.expect_partial()  # E.g. a save counter this root has not created yet.
        except (AssertionError, ValueError) as e:
            raise CheckpointError(
                f"checkpoint {info.path} does not match the model being restored: "
                f"{str(e).splitlines()[0]} Fix: build the same architecture (layer order and "
                "sizes) that wrote it, or start from an empty model_dir.") from None
        for delta in deltas:
            incremental.apply_delta(self._root, delta)
        slot_order.end_restore(optimizer)  # The next save is in the logical layout.
        if deltas:
            info = deltas[-1]
            self._state.step, self._state.input_position = info.step, info.input_position
        for var in replicated:
            var.push_if_needed(worker_indices=list(range(len(var.worker_devices()))))
        self._base_step = int(self._state.step or info.step)
        if self._state.input_position is not None:
            self._base_position = int(self._state.input_position)
        self._last_save_step, self._last_save_time = self._base_step, self._clock()
        self.latest = info
        _watch_writes(_reachable(self._objects))
        self._writes_seen = outside_writes.generation()  # The restore's own writes.
        self._chain = None  # The next save is full.
        logging.info("tf_psplugin: restored %s (step %d)", info.path, info.step)
        if self.input_iterator is not None:
            input_state.restore(self.input_iterator, info.path)
        return info

    def restore_or_initialize(self) -> Optional[CheckpointInfo]:
        """Restores the latest committed checkpoint (and its deltas); None if there is none."""
        if latest_checkpoint_info(self.model_dir) is None:
            return None
        return self.restore(None)  # The latest full checkpoint and its deltas.

    def _resolve_chain(self, checkpoint):
        """The full checkpoint to read and the deltas to apply after it."""
        if checkpoint is None:
            full, deltas = checkpoint_chain(self.model_dir)
            if full is not None:
                return full, deltas
        if isinstance(checkpoint, CheckpointInfo) and checkpoint.kind == model_dir_lib.KIND_DELTA:
            full, deltas = checkpoint_chain(self.model_dir)
            names = [d.name for d in deltas]
            if full is None or full.name != checkpoint.base or checkpoint.name not in names:
                raise CheckpointError(
                    f"delta {checkpoint.path} is not on the chain of the latest intact full "
                    "checkpoint (its base or an earlier delta is missing or torn). Fix: restore "
                    "the latest checkpoint (checkpoint=None).")
            return full, deltas[:names.index(checkpoint.name) + 1]
        return self._resolve(checkpoint), []

    def _resolve(self, checkpoint) -> CheckpointInfo:
        if isinstance(checkpoint, CheckpointInfo):
            return checkpoint
        if checkpoint is None:
            info = latest_checkpoint_info(self.model_dir)
            if info is None:
                raise CheckpointError(
                    f"no committed checkpoint in {self.model_dir}. Fix: train first, or point "
                    "model_dir at the directory that holds ckpt-*.commit files.")
            return info
        return info_for_prefix(str(checkpoint))
class CheckpointManager(ChiefCheckpointManager):
    """Deprecated name of `ChiefCheckpointManager` (it shadowed `tf.train.CheckpointManager`)."""

    def __init__(self, *args, **kwargs):
        warnings.warn("tf_psplugin.CheckpointManager is deprecated: use "
                      "tf_psplugin.ChiefCheckpointManager (the same arguments); the former "
                      "name shadowed tf.train.CheckpointManager, whose contract it does not have",
                      _deprecation.PluginDeprecationWarning, stacklevel=2)
        super().__init__(*args, **kwargs)


def latest_checkpoint(model_dir: str) -> Optional[CheckpointInfo]:
    """Deprecated name of `latest_checkpoint_info` (it shadowed `tf.train.latest_checkpoint`,
    which returns a path; this returns a `CheckpointInfo`, or None).
    """
    warnings.warn("tf_psplugin.latest_checkpoint is deprecated: use "
                  "tf_psplugin.latest_checkpoint_info (the same call; it returns a "
                  "CheckpointInfo, not tf.train.latest_checkpoint's path)",
                  _deprecation.PluginDeprecationWarning, stacklevel=2)
    return latest_checkpoint_info(model_dir)
