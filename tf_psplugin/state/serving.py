"""Serving-side loader: a SavedModel export kept fresh from the chief's deltas.

Why this module exists: an online CTR model is trained continuously, and
serving should answer with rows minutes (not a re-export) after training
updated them. Exporting the whole model again writes every row of every
table; the chief's incremental checkpoints (`tf_psplugin.state.incremental`)
already hold only the rows that changed. `ServingModel` loads an export
(`export_saved_model` / `export_from_checkpoint`) in a serving process with
no cluster, then applies, in place, the deltas the chief commits in
``model_dir``: ``table[ids] = rows`` per table and every dense variable
whole. Requests keep being answered while it does.

How a checkpoint key finds a SavedModel variable. The export writes
``assets.extra/tf_psplugin_serving.json`` (``SERVING_METADATA``; TF Serving's
convention for files beside a SavedModel that are not part of it): for each
of the exported model's variables, in ``model.variables`` order (which
``tf.saved_model.load(...).variables`` keeps), its checkpoint key as the
trainer's ``tf.train.Checkpoint(model=...)`` names it, its name, shape and
dtype; and, for `export_from_checkpoint`, which checkpoint the export holds
(its name, its chain's full checkpoint, its step).

Which deltas apply. Only deltas in chain order (`model_dir.checkpoint_chain`):
those of the export's full checkpoint, after the one the export holds, each
the child of the previous one and intact. A torn or uncommitted delta ends
the chain there (the deltas after it hold only rows changed since it), so
serving waits for the next full checkpoint. When a newer full checkpoint
appears, its tables and dense variables are reloaded whole, then its chain
applied. An export made from a live model (`export_saved_model`) records no
checkpoint: its first poll loads the latest full checkpoint and its chain.
An export of a checkpoint this model directory has not got (another run,
another directory) is refused with `ServingError`.

What a concurrent request sees. Everything a poll applies (a full reload
and/or several deltas) is read from files first, then assigned under a
write lock that requests made through `ServingModel.__call__` /
`ServingModel.signature` hold for reading: such a request sees the model at
one committed checkpoint, before or after the poll, never a mix. A request
that calls the loaded SavedModel directly (`ServingModel.loaded`) takes no
lock: during a poll it may see some variables (or, during a full reload,
whole tables) at the new step and others at the old one; each single
variable is never half-written (each assignment is one TF op).

`DynamicEmbedding` tables. The export holds each layer's key -> row map
as a table of the SavedModel (`DynamicEmbedding.freeze_for_serving`): a
request's raw keys (int64 or strings) are looked up there, a key with a
row reads that row, any other key (never admitted, still waiting for
admission, evicted, expired) reads the layer's ``default_value`` in every
column, exactly what the trained layer's lookup gives outside training
(``training=False``: `Model.predict`, `evaluate`). The metadata records
where each map is in the checkpoints (its ``key_index`` path) and in the
export (its layer's path). A full reload replaces the map with the
checkpoint's (key, row) pairs; a delta replaces, as `load_into` restores
it (`incremental_dynamic.merge_key_pairs`), every pair of each row it
names by the key that row holds now, if any: keys admitted since (new
rows, or rows taken from evicted keys) appear, evicted and expired keys
disappear. The rows' last use, hit counts and admission counters follow
too (the served lookup does not read them). The map is swapped whole, in
one op, with the other assignments of the poll.

Optimizer slots and state in the deltas are ignored (serving has no
optimizer). A full reload holds each table up to three times while it is
assigned (the variable, the values read, the assignment's copy): measured
for a 10M x 16 table, 1.08 GB before and 2.84 GB peak
(benchmarks/README.md).
"""

import json
import os
import threading
import time
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import tensorflow as tf
from absl import logging

from tf_psplugin.errors import ServingError  # noqa: F401  (see errors.py)
from tf_psplugin.state import incremental
from tf_psplugin.state import incremental_dynamic
from tf_psplugin.state import model_dir as model_dir_lib
from tf_psplugin.state.model_dir import CheckpointInfo
from tf_psplugin.tables import dynamic as dynamic_lib

__all__ = ["SERVING_METADATA", "ServingError", "ServingModel", "serving_metadata"]

SERVING_METADATA = os.path.join("assets.extra", "tf_psplugin_serving.json")
METADATA_FORMAT = 1
# Checkpoint keys that are never model variables: the trainer's optimizer and
# its save counter (a Keras model tracks a compiled optimizer under it too).
_NOT_SERVED = ("optimizer/", "save_counter/", "model/optimizer/")
# A delta or full checkpoint removed or rewritten while read (the chief's
# max_to_keep, a new full save): tried again at the next poll.
_RACE_ERRORS = (tf.errors.NotFoundError, tf.errors.DataLossError, OSError)
# A DynamicEmbedding's key -> row map in a full checkpoint (`tables.dynamic_state.KeyIndex`).
_KEY_INDEX_KEYS = "/.ATTRIBUTES/keys"
_KEY_INDEX_ROWS = "/.ATTRIBUTES/rows"


def serving_metadata(model, checkpoint: Optional[CheckpointInfo] = None) -> Dict[str, Any]:
    """What `ServingModel` needs to map checkpoint keys onto an export's variables.

    Args:
        model: The plain (no strategy) Keras model about to be saved.
        checkpoint: The checkpoint whose values it holds (its chain end), or
            None for a model exported live.

    Returns:
        A JSON-serialisable dict (written as ``SERVING_METADATA``).
    """
    keys, _, paths = incremental.object_keys(tf.train.Checkpoint(model=model))
    key_of = {id(var): key for key, var in keys.items()}
    entries = [{"key": key_of.get(id(var)), "name": var.name,
                "shape": [int(d) for d in var.shape], "dtype": var.dtype.name}
               for var in model.variables]
    # Each DynamicEmbedding's key -> row map: where checkpoints name it
    # (its key_index) and where the export holds it (the layer's path).
    dynamic = sorted(({"name": layer.name, "path": paths[id(layer)],
                       "key_index": paths[id(layer.key_index)],
                       "key_dtype": layer.key_dtype.name}
                      for layer in model.submodules
                      if isinstance(layer, dynamic_lib.DynamicEmbedding)
                      and id(layer) in paths), key=lambda d: d["path"])
    source = None
    if checkpoint is not None:
        source = {"name": checkpoint.name, "step": int(checkpoint.step),
                  "base": checkpoint.base if checkpoint.kind == model_dir_lib.KIND_DELTA
                  else checkpoint.name}
    return {"format": METADATA_FORMAT, "checkpoint": source, "variables": entries,
            "dynamic_tables": dynamic}


class _ReadWriteLock:
    """Many readers (requests) or one writer (a poll); a waiting writer goes first."""

    def __init__(self):
        self._cond = threading.Condition()
        self._readers = 0
        self._writer = False
        self._writers_waiting = 0

    def acquire_read(self):
        with self._cond:
            while self._writer or self._writers_waiting:
                self._cond.wait()
            self._readers += 1

    def release_read(self):
        with self._cond:
            self._readers -= 1
            if not self._readers:
                self._cond.notify_all()

    def acquire_write(self):
        with self._cond:
            self._writers_waiting += 1
            while self._writer or self._readers:
                self._cond.wait()
            self._writers_waiting -= 1
            self._writer = True

    def release_write(self):
        with self._cond:
            self._writer = False
            self._cond.notify_all()


class _KeyMap:
    """A served `DynamicEmbedding`'s key -> row map: the export's table, replaced whole.

    The export holds the map as a ``MutableHashTable`` of the frozen layer
    (`DynamicEmbedding.freeze_for_serving`), which the SavedModel's
    functions look raw keys up in; `load` swaps its content in one op
    (``LookupTableImportV2`` replaces every pair), so a lookup sees the old
    pairs or the new ones.

    Args:
        table: The loaded SavedModel's restored table (a resource).
        key_index: The map's object path in the trainer's checkpoints (its
            full-checkpoint keys are ``<key_index>/.ATTRIBUTES/keys`` and
            ``/rows``, its delta entries ``<key_index>/.DELTA/keys``).
        key_dtype: The layer's key dtype name ("int64" or "string").
        name: The layer's name, for messages.
    """

    def __init__(self, table, key_index: str, key_dtype: str, name: str):
        self.table = table
        self.key_index = key_index
        self.key_dtype = tf.as_dtype(key_dtype)
        self.name = name

    def export(self) -> Tuple[np.ndarray, np.ndarray]:
        """Every (key, row) pair served now."""
        keys, rows = tf.raw_ops.LookupTableExportV2(
            table_handle=self.table.resource_handle, Tkeys=self.key_dtype, Tvalues=tf.int64)
        return keys.numpy(), rows.numpy()

    def load(self, keys: np.ndarray, rows: np.ndarray) -> None:
        """Makes these (key, row) pairs the whole map."""
        keys = tf.constant(keys if len(keys) else [], self.key_dtype)
        tf.raw_ops.LookupTableImportV2(table_handle=self.table.resource_handle, keys=keys,
                                       values=tf.constant(rows, tf.int64))


class _Update:
    """What one poll will assign: dense values, table rows and key maps, read from files."""

    def __init__(self):
        self.assign: Dict[str, Any] = {}  # numpy arrays or tensors
        self.scatter: List[Tuple[str, np.ndarray, np.ndarray]] = []
        # key_index path -> every (key, row) pair of the map after the update.
        self.key_pairs: Dict[str, Tuple[np.ndarray, np.ndarray]] = {}
        self.applied: List[CheckpointInfo] = []


class ServingModel:
    """A SavedModel export that follows the chief's incremental checkpoints in place.

    Load it in the serving process (no cluster, no strategy), answer
    requests with it, and call `poll` (or `start` a background poller): each
    committed delta of the export's chain is applied to the loaded tables,
    dense variables and `DynamicEmbedding` key -> row maps, and a newer
    full checkpoint is reloaded whole.

    Example:

    ```python
    serving = tf_psplugin.ServingModel("/shared/run1/export", model_dir="/shared/run1")
    serving.start(poll_seconds=2.0)            # or call serving.poll() yourself
    scores = serving(ids)                      # a request: sees one checkpoint's state
    print("serving step", serving.step)
    serving.stop()
    ```

    Args:
        export_dir: A SavedModel written by `export_saved_model` or
            `export_from_checkpoint` (it carries ``SERVING_METADATA``).
        model_dir: The training model directory to follow (local or
            remote); None serves the export as it is (`poll` does nothing).

    Raises:
        ServingError: the export has no serving metadata, or its variables
            do not match it.
    """

    def __init__(self, export_dir: str, model_dir: Optional[str] = None):
        self.export_dir = model_dir_lib.resolve(export_dir)
        self.model_dir = model_dir_lib.resolve(model_dir) if model_dir else None
        metadata = model_dir_lib.read_json(model_dir_lib.join(self.export_dir,
                                                               SERVING_METADATA))
        if not metadata or metadata.get("format") != METADATA_FORMAT:
            raise ServingError(
                f"export {self.export_dir} has no {SERVING_METADATA} (format "
                f"{METADATA_FORMAT}), so its variables cannot be matched to checkpoint keys. "
                "Fix: export it again with tf_psplugin.export_from_checkpoint or "
                "export_saved_model of this version.")
        self.loaded = tf.saved_model.load(self.export_dir)
        variables = list(self.loaded.variables)
        entries = metadata["variables"]
        if len(variables) != len(entries):
            raise ServingError(f"export {self.export_dir} has {len(variables)} variables, its "
                               f"metadata lists {len(entries)}. Fix: export it again.")
        self._variables: Dict[str, tf.Variable] = {}
        for var, entry in zip(variables, entries):
            if (var.name, [int(d) for d in var.shape], var.dtype.name) != (
                    entry["name"], entry["shape"], entry["dtype"]):
                raise ServingError(
                    f"export {self.export_dir}: variable {var.name} {var.shape} does not match "
                    f"its metadata ({entry}). Fix: export it again.")
            if entry["key"]:
                self._variables[entry["key"]] = var
        # An export written before serving followed dynamic keys lists their
        # layer names only: polling it is refused (see `poll`).
        self._old_dynamic: List[str] = list(metadata.get("dynamic_embeddings") or [])
        self._key_maps: Dict[str, _KeyMap] = {}
        for entry in metadata.get("dynamic_tables") or []:
            key_map = _KeyMap(self._find_key_table(entry), entry["key_index"],
                              entry["key_dtype"], entry["name"])
            self._key_maps[entry["key_index"]] = key_map
        source = metadata.get("checkpoint")
        self._base: Optional[str] = source["base"] if source else None
        self._name: Optional[str] = source["name"] if source else None
        self.step: Optional[int] = source["step"] if source else None
        self.applied_time: Optional[float] = None
        self.last_error: Optional[BaseException] = None
        self._lock = _ReadWriteLock()
        self._poll_lock = threading.Lock()
        self._thread: Optional[threading.Thread] = None
        self._stop = threading.Event()
        self._warned: set = set()

    def _find_key_table(self, entry: Dict[str, Any]):
        """The loaded export's key -> row table of the DynamicEmbedding `entry` names."""
        obj = self.loaded
        path = entry["path"][len("model/"):] if entry["path"].startswith("model/") \
            else entry["path"]
        for name in path.split("/") + ["serving_key_map"]:
            obj = getattr(obj, name, None)
            if obj is None:
                raise ServingError(
                    f"export {self.export_dir}: DynamicEmbedding {entry['name']} "
                    f"({entry['path']}) has no serving key table in the SavedModel. Fix: "
                    "export it again with tf_psplugin.export_from_checkpoint or "
                    "export_saved_model of this version.")
        return obj

    # -- requests ----------------------------------------------------------------

    def __call__(self, *args, **kwargs):
        """Calls the loaded model (its ``__call__``) under the read lock."""
        self._lock.acquire_read()
        try:
            return self.loaded(*args, **kwargs)
        finally:
            self._lock.release_read()

    def signature(self, name: str = "serving_default"):
        """The SavedModel signature `name`, wrapped to run under the read lock."""
        function = self.loaded.signatures[name]

        def call(*args, **kwargs):
            self._lock.acquire_read()
            try:
                return function(*args, **kwargs)
            finally:
                self._lock.release_read()

        return call

    @property
    def checkpoint(self) -> Optional[str]:
        """Base name of the checkpoint or delta the model is at (None: live export)."""
        return self._name

    # -- following the model directory -------------------------------------------

    def poll(self) -> List[CheckpointInfo]:
        """Applies what the chief committed since the model's checkpoint.

        Returns:
            What was applied, in order: a newer full checkpoint (reloaded
            whole) if any, then deltas of its chain. Empty when nothing new
            is committed, or when a file vanished while being read (the
            chief's retention; the next poll tries again).

        Raises:
            ServingError: the model directory holds neither the export's
                checkpoint nor a newer full one; a checkpoint holds a
                `DynamicEmbedding` the export has not got; or the export
                was written by a version that did not record its
                `DynamicEmbedding` key maps.
        """
        if self.model_dir is None:
            return []
        if self._old_dynamic and not self._key_maps:
            raise ServingError(
                f"{self.export_dir}: DynamicEmbedding layer(s) {', '.join(self._old_dynamic)}: "
                "the export does not record where their key -> row maps are, so their key "
                "changes cannot be followed. Fix: export it again with this version "
                "(tf_psplugin.export_from_checkpoint), or serve it as it is (no model_dir).")
        with self._poll_lock:
            try:
                update = self._plan()
            except _RACE_ERRORS as e:
                logging.warning("tf_psplugin: serving: a checkpoint changed while read (%s); "
                                "trying again at the next poll", str(e).splitlines()[0])
                return []
            if update.applied:
                self._apply(update)
            return update.applied

    def _plan(self) -> _Update:
        full, deltas = model_dir_lib.checkpoint_chain(self.model_dir)
        update = _Update()
        if full is None:
            if self._base is not None:
                raise self._wrong_base("it holds no intact full checkpoint")
            return update
        if full.name == self._base:
            names = [full.name] + [d.name for d in deltas]
            if self._name in names:
                for delta in deltas[names.index(self._name):]:
                    self._read_delta(delta, update)
                return update
            if deltas and deltas[-1].step > self.step:
                # The export's point is no longer in the chain: start again from its full.
                pass
            else:
                return update  # The chain ends before (torn) or at the export's point.
        elif self.step is not None and full.step <= self.step:
            raise self._wrong_base(f"its latest full checkpoint is {full.name}")
        self._read_full(full, update)
        for delta in deltas:
            self._read_delta(delta, update)
        return update

    def _wrong_base(self, problem: str) -> ServingError:
        return ServingError(
            f"the export {self.export_dir} holds {self._name} (step {self.step}, full checkpoint "
            f"{self._base}), but the model directory {self.model_dir} has not got it and "
            f"{problem}. Fix: follow the model_dir the export was made from, or export again "
            "from this one (tf_psplugin.export_from_checkpoint(model_fn, model_dir, ...)).")

    def _key_map(self, key_index: str) -> Optional[_KeyMap]:
        found = self._key_maps.get(key_index)
        if found is None and not key_index.startswith("model/"):
            found = self._key_maps.get("model/" + key_index)  # A save_weights checkpoint.
        return found

    def _target(self, key: str, where: str) -> Optional[tf.Variable]:
        var = self._variables.get(key)
        if var is None and not key.startswith("model/"):
            var = self._variables.get("model/" + key)  # A save_weights checkpoint.
        if var is None and not (key.startswith(_NOT_SERVED)
                                or incremental.DELTA_SUFFIX in key
                                or ".OPTIMIZER_SLOT/" in key
                                or key == "_CHECKPOINTABLE_OBJECT_GRAPH"):
            if key not in self._warned:
                self._warned.add(key)
                logging.warning("tf_psplugin: serving: %s holds %s, which the export has not "
                                "got; ignored", where, key)
        return var

    def _read_full(self, full: CheckpointInfo, update: _Update) -> None:
        reader = tf.train.load_checkpoint(full.path)
        dtypes = reader.get_variable_to_dtype_map()
        found = set()
        maps = set()
        for key in sorted(dtypes):
            if key.endswith(_KEY_INDEX_KEYS):
                key_map = self._key_map(key[:-len(_KEY_INDEX_KEYS)])
                if key_map is not None:
                    rows_key = key[:-len(_KEY_INDEX_KEYS)] + _KEY_INDEX_ROWS
                    update.key_pairs[key_map.key_index] = (reader.get_tensor(key),
                                                           reader.get_tensor(rows_key))
                    maps.add(key_map.key_index)
                    continue
            if key.endswith(_KEY_INDEX_ROWS) and self._key_map(
                    key[:-len(_KEY_INDEX_ROWS)]) is not None:
                continue  # Read with its keys.
            var = self._target(key, full.path)
            if var is not None:
                # Read as a tensor, not numpy: one copy less (measured: a 10M x 16
                # reload 1.7 s and +1.8 GB instead of 15 s and +2.8 GB).
                with tf.device("/cpu:0"):
                    [update.assign[key]] = tf.raw_ops.RestoreV2(
                        prefix=full.path, tensor_names=[key], shape_and_slices=[""],
                        dtypes=[dtypes[key]])
                found.add(id(var))
        missing = [k for k, v in self._variables.items() if id(v) not in found]
        if missing:
            raise ServingError(
                f"full checkpoint {full.path} lacks {len(missing)} variable(s) of the export, "
                f"e.g. {missing[0]}. Fix: serve an export of the model this directory trains.")
        lacking = sorted(set(self._key_maps) - maps)
        if lacking:
            raise ServingError(
                f"full checkpoint {full.path} lacks the key -> row map {lacking[0]} of the "
                "export's DynamicEmbedding. Fix: serve an export of the model this directory "
                "trains.")
        update.applied.append(full)

    def _read_dynamic(self, delta: CheckpointInfo, dynamic: Dict[str, Any],
                      parts: Dict[str, List[np.ndarray]], update: _Update) -> None:
        """A delta's DynamicEmbedding changes: row state, sketch counters, key pairs.

        The keys as `incremental_dynamic.apply` restores them: every pair of
        a row the delta names is dropped, then each such row's key (if it
        holds one now) maps to it. Merged into the pairs the map will have
        after the deltas before this one in the same poll.
        """
        def joined(name: str) -> np.ndarray:
            if name not in parts:
                raise ServingError(f"delta {delta.path} has no {name}: not written by "
                                   "tf_psplugin's incremental checkpoints.")
            return np.concatenate(parts[name])

        for path, meta in sorted(dynamic.items()):
            key_map = self._key_map(meta["key_index"])
            if key_map is None:
                raise ServingError(
                    f"delta {delta.path} changes the keys of DynamicEmbedding {path}, which "
                    f"the export {self.export_dir} has not got (or does not record). Fix: "
                    "serve an export of the model this directory trains, made by this "
                    "version (tf_psplugin.export_from_checkpoint).")
            ids = joined(meta["table"] + incremental.DELTA_SUFFIX + "ids")
            if not len(ids):
                continue
            for key in meta["row_state"]:
                if self._target(key, delta.path) is not None:
                    update.scatter.append(
                        (key, ids, joined(key + incremental.DELTA_SUFFIX + "rows")))
            if meta.get("sketch") and self._target(meta["sketch"], delta.path) is not None:
                counters = joined(meta["sketch"] + incremental.DELTA_SUFFIX + "ids")
                if len(counters):
                    update.scatter.append((meta["sketch"], counters, joined(
                        meta["sketch"] + incremental.DELTA_SUFFIX + "rows")))
            keys = joined(meta["key_index"] + incremental.DELTA_SUFFIX + "keys")
            held = joined(meta["key_index"] + incremental.DELTA_SUFFIX + "held")
            before = update.key_pairs.get(key_map.key_index)
            if before is None:
                before = key_map.export()  # Only a poll changes it, under _poll_lock.
            update.key_pairs[key_map.key_index] = incremental_dynamic.merge_key_pairs(
                before[0], before[1], ids, keys, held)

    def _read_delta(self, delta: CheckpointInfo, update: _Update) -> None:
        marker = model_dir_lib.read_json(delta.path + model_dir_lib.COMMIT_SUFFIX)
        if marker is None:  # Deleted since it was listed (retention removes markers first).
            raise tf.errors.NotFoundError(None, None, f"{delta.path} is gone")
        manifest = marker.get("manifest") or {}
        if "dense" not in manifest:
            raise ServingError(f"delta {delta.path} has no manifest: not written by "
                               "tf_psplugin's incremental checkpoints.")
        for key, value in sorted(_read_bundle(
                model_dir_lib.join(self.model_dir, manifest["dense"])).items()):
            if self._target(key, delta.path) is not None:
                update.assign[key] = value
        parts: Dict[str, List[np.ndarray]] = {}
        for row_file in manifest.get("row_files", []):
            for name, value in _read_bundle(
                    model_dir_lib.join(self.model_dir, row_file)).items():
                parts.setdefault(name, []).append(value)
        for table_key, meta in sorted(manifest.get("tables", {}).items()):
            var = self._target(table_key, delta.path)
            if var is None:
                raise ServingError(
                    f"delta {delta.path} updates table {table_key}, which the export "
                    f"{self.export_dir} has not got. Fix: serve an export of the model this "
                    "directory trains.")
            if [int(d) for d in var.shape] != list(meta["shape"]):
                raise ServingError(
                    f"delta {delta.path}: table {table_key} is {meta['shape']}, the export's is "
                    f"{var.shape}. Fix: serve an export of the model this directory trains.")
            ids = parts.get(table_key + incremental.DELTA_SUFFIX + "ids", [])
            rows = parts.get(table_key + incremental.DELTA_SUFFIX + "rows", [])
            if len(ids) != len(rows):
                raise ServingError(f"delta {delta.path} is inconsistent: {table_key} has "
                                   f"{len(ids)} id files and {len(rows)} row files.")
            ids = np.concatenate(ids) if ids else np.zeros([0], np.int64)
            if len(ids):
                update.scatter.append((table_key, ids, np.concatenate(rows)))
        if manifest.get("dynamic"):
            self._read_dynamic(delta, manifest["dynamic"], parts, update)
        update.applied.append(delta)

    def _apply(self, update: _Update) -> None:
        last = update.applied[-1]
        self._lock.acquire_write()
        try:
            for key, value in update.assign.items():
                self._target(key, last.path).assign(value)
            for key, ids, rows in update.scatter:
                self._target(key, last.path).scatter_update(
                    tf.IndexedSlices(tf.constant(rows), tf.constant(ids)))
            for key_index, (keys, rows) in update.key_pairs.items():
                self._key_maps[key_index].load(keys, rows)
            self._base = last.base if last.kind == model_dir_lib.KIND_DELTA else last.name
            self._name, self.step = last.name, last.step
            self.applied_time = time.time()
        finally:
            self._lock.release_write()
        logging.info("tf_psplugin: serving: now at %s (step %d): applied %s", last.name,
                     last.step, ", ".join(i.name for i in update.applied))

    # -- a background poller -----------------------------------------------------

    def start(self, poll_seconds: float = 5.0) -> "ServingModel":
        """Polls in a daemon thread every `poll_seconds` until `stop`.

        A `ServingError` is logged and kept in `last_error`; the thread goes
        on polling (a newer full checkpoint may still arrive).

        Returns:
            self.
        """
        if self._thread is not None:
            raise RuntimeError("ServingModel.start was called twice. Fix: call stop() first.")
        if self.model_dir is None:
            raise ServingError("ServingModel(model_dir=None) has nothing to follow. Fix: pass "
                               "the training model_dir.")
        self._stop.clear()

        def loop():
            while not self._stop.is_set():
                try:
                    self.poll()
                except ServingError as e:
                    if str(e) != str(self.last_error):
                        logging.error("tf_psplugin: serving: %s", e)
                    self.last_error = e
                self._stop.wait(poll_seconds)

        self._thread = threading.Thread(target=loop, name="tf_psplugin_serving_poll",
                                        daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stops the background poller (waits for a poll in progress)."""
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None

    def __enter__(self) -> "ServingModel":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _read_bundle(prefix: str) -> Dict[str, np.ndarray]:
    reader = tf.train.load_checkpoint(prefix)
    return {name: reader.get_tensor(name) for name in reader.get_variable_to_shape_map()}


def write_metadata(export_dir: str, metadata: Dict[str, Any]) -> None:
    """Writes `metadata` as ``<export_dir>/SERVING_METADATA``."""
    path = model_dir_lib.join(export_dir, SERVING_METADATA)
    tf.io.gfile.makedirs(os.path.dirname(path))
    with tf.io.gfile.GFile(path, "w") as f:
        f.write(json.dumps(metadata, indent=1, sort_keys=True))
