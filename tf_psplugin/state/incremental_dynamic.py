"""Incremental checkpoints of `DynamicEmbedding` tables: changed rows, freed rows, key changes.

Why this module exists: a `layers.DynamicEmbedding` is more than a row table.
A full checkpoint saves, per layer, its rows (``embeddings``) and their
optimizer slots, two per-row state tables (``row_last_used``, 0 for a free
row, and ``row_hits``), the admission sketch (``admission_counts``, with
``admit_after > 1``), the step ``clock``, and the key -> row maps as one list
of (key, row) pairs (``key_index``). Admission writes new rows, eviction and
expiry free rows and forget their keys: a delta that held only the rows the
optimizer updated would restore keys that are gone and miss new ones.
`incremental.IncrementalSaver` uses this module for every DynamicEmbedding
of the model; the generic table part (ids, rows, slots) is unchanged.

What a delta holds per layer, and how the changes are found (on each PS,
at the save, with no step in flight):

* **Dirty rows** of each shard: rows the optimizer updated (the table's
  `incremental.RowStamps`, as for any table); rows a training step used
  (recency, hits) and rows admission gave a key (new or evicted and
  reused): their ``row_last_used`` is at least the ``clock`` value read at
  the previous save, so they are found at the save by a scan, at no cost in
  the step; and rows eviction or expiry freed (``row_last_used`` 0: the
  clock cannot tell), which the layer stamps itself, with the same stamps
  and generation, in its admission step on the PS
  (`DynamicEmbedding.track_changed_rows`: one scatter of the freed rows per
  shard and step, usually empty; none per looked-up key). For each dirty
  row the delta holds the table row and its slots (generic), its
  ``row_last_used`` and ``row_hits``, the key it holds now and whether it
  holds one (a freed row holds none: its old key is deleted).
* **The sketch**, whose counters only grow: the counters that differ from a
  copy of the sketch taken at the previous save (kept on the PS beside each
  sketch shard, as large as it), found by a scan at the save; again no work
  in the step. (Written whole, the sketch, ``4 * capacity * sketch_depth``
  int64 by default, would cost as much as the table.)
* **The clock**: one int64, whole, with the dense variables.

Not in full checkpoints, so not in deltas: the keys waiting for admission
(none between steps) and `table_stats()` counters.

Restoring applies the rows and state tables by logical row (any PS count,
or one process), the sketch by logical counter, and the keys as: drop every
(key, row) pair whose row is a dirty row of the delta, then add (key, row)
for each dirty row that holds a key; the maps are then reloaded whole
(`KeyIndex.load`, as a full restore does), so they land on the shards the
current PS count names; this passes every pair through the chief once per
delta, as a full restore does once. The format is in `incremental`'s module
docstring.
"""

from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

import numpy as np
import tensorflow as tf

from tf_psplugin._internal import tf_internal as _tf_internal
from tf_psplugin.state.model_dir import CheckpointError

# The same suffix as incremental.DELTA_SUFFIX (that module imports this one;
# tests/unit/test_incremental_dynamic.py checks they agree).
_DELTA = "/.DELTA/"


def _parts(var) -> list:
    if isinstance(var, _tf_internal.sharded_variable.ShardedVariable):
        return list(var.variables)
    return [var]


def merge_key_pairs(old_keys: np.ndarray, old_rows: np.ndarray, rows: np.ndarray,
                    keys: np.ndarray, held: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """The (key, row) pairs after a delta: pairs of its rows replaced by what they hold now.

    Args:
        old_keys, old_rows: Every (key, row) pair before the delta.
        rows: The delta's dirty rows (logical, each at most once).
        keys: The key each dirty row holds now (ignored where not `held`).
        held: Whether each dirty row holds a key now.

    Returns:
        ``(keys, rows)``: the pairs of rows the delta does not name, then the
        delta's held pairs. A key that moved to another row, and a row freed
        or given to another key, lose their old pair: a key holds one row.
    """
    held = np.asarray(held, bool)
    keep = ~np.isin(np.asarray(old_rows, np.int64), np.asarray(rows, np.int64))
    new_keys = np.concatenate([np.asarray(old_keys)[keep], np.asarray(keys)[held]])
    new_rows = np.concatenate([np.asarray(old_rows, np.int64)[keep],
                               np.asarray(rows, np.int64)[held]])
    return new_keys, new_rows


def find_layers(root, paths: Mapping[int, str]) -> List[Tuple[str, Any]]:
    """Every built `DynamicEmbedding` reachable from `root`, with its object path."""
    from tf_psplugin.tables.dynamic import DynamicEmbedding  # pylint: disable=g-import-not-at-top

    out = []
    for obj in tf.train.TrackableView(root).descendants():
        if isinstance(obj, DynamicEmbedding) and id(obj) in paths:
            if not obj.built:
                raise CheckpointError(
                    f"incremental checkpoints (full_every_saves): DynamicEmbedding {obj.name} is "
                    "not built yet. Fix: build the model before creating the "
                    "ChiefCheckpointManager.")
            out.append((paths[id(obj)], obj))
    return out


class DynamicTable:
    """One `DynamicEmbedding` layer as `incremental.IncrementalSaver` tracks and writes it.

    Args:
        path: The layer's object path in the checkpoint.
        layer: The built layer.
        keys_by_id: id(variable) -> full-checkpoint key, for the root's variables.
        paths: id(trackable) -> object path (`incremental.object_keys`).
    """

    def __init__(self, path: str, layer, keys_by_id: Mapping[int, str],
                 paths: Mapping[int, str]):
        self.path = path
        self.layer = layer

        def key(var):
            if id(var) not in keys_by_id:
                raise CheckpointError(f"incremental checkpoints: {var.name} of "
                                      f"DynamicEmbedding {layer.name} is not in the checkpoint.")
            return keys_by_id[id(var)]

        self.table_key = key(layer.embeddings)
        self.row_state = [layer.row_last_used, layer.row_hits]
        self.row_state_keys = [key(v) for v in self.row_state]
        self.sketch = layer.admission_counts
        self.sketch_key = key(self.sketch) if self.sketch is not None else None
        self.key_index_path = paths[id(layer.key_index)]
        self._snapshots: List[tf.Variable] = []
        self._clock_at_save = self._read_clock()
        self.clock_since = self._clock_at_save
        n = layer.num_shards
        if n > 1 and self.sketch is not None and len(_parts(self.sketch)) != n:
            raise CheckpointError(
                f"incremental checkpoints: the sketch of DynamicEmbedding {layer.name} is split "
                f"over {len(_parts(self.sketch))} shards, its rows over {n}.")

    def not_tables(self) -> set:
        """ids of the layer's variables (and shards) that are not row tables with stamps."""
        out = set()
        for var in self.row_state + [self.sketch, self.layer.clock]:
            if var is not None:
                out.add(id(var))
                out.update(id(p) for p in _parts(var))
        return out

    def not_dense(self) -> set:
        """ids of the variables a delta writes by row (everything but the clock)."""
        return self.not_tables() - {id(self.layer.clock)} - {
            id(p) for p in _parts(self.layer.clock)}

    def install(self, stamps: List[Any], create_variable: Callable[..., tf.Variable]) -> None:
        """Makes the layer stamp the rows admission and expiry write; creates sketch copies.

        Args:
            stamps: The table's `incremental.RowStamps`, one per shard.
            create_variable: ``(device, **tf.Variable kwargs)`` -> a plain
                variable there (`HybridExtended.create_plain_variable`).
        """
        self.layer.track_changed_rows([s.mark_rows for s in stamps])
        if self.sketch is not None:
            for part in _parts(self.sketch):
                self._snapshots.append(create_variable(
                    part.device, initial_value=tf.zeros(part.shape, part.dtype),
                    trainable=False,
                    name=f"{part.name.split(':')[0]}/tf_psplugin_saved_copy"))

    def _read_clock(self) -> int:
        return int(tf.reshape(tf.convert_to_tensor(self.layer.clock), [-1])[0].numpy())

    def start_save(self, full: bool) -> None:
        """Call at every save, after the generations advanced, with no step in flight.

        A delta's used rows are those with ``row_last_used >=
        clock_since`` (the clock at the previous save). A full save also
        takes the sketch copies (a delta takes them as it writes).
        """
        self.clock_since = self._clock_at_save
        self._clock_at_save = self._read_clock()
        if full:
            for part, snapshot in zip(_parts(self.sketch) if self.sketch is not None else [],
                                      self._snapshots):
                with tf.device(part.device):
                    snapshot.assign(tf.convert_to_tensor(part))

    def dirty_rows(self, s: int, stamps, since: int) -> tf.Tensor:
        """Local ids (int64) of shard `s`'s rows changed since the previous save."""
        last = _parts(self.layer.row_last_used)[s]
        with tf.device(stamps.device):
            changed = (stamps.stamps >= since) | (tf.convert_to_tensor(last) >= self.clock_since)
            return tf.reshape(tf.where(changed), [-1])

    def add_row_pieces(self, s: int, local: tf.Tensor, ids: tf.Tensor,
                       add: Callable[[str, tf.Tensor], None]) -> None:
        """Adds shard `s`'s state rows, keys and held flags for its dirty rows, in `ids` order."""
        state = self.layer.shard_state(s)
        with tf.device(state.device):
            for key, var in zip(self.row_state_keys, self.row_state):
                add(key + _DELTA + "rows", tf.gather(_parts(var)[s], local))
            last = tf.gather(_parts(self.layer.row_last_used)[s], local)
            keys = state.rows.lookup(ids)  # Row -> key, on the PS holding the row.
            add(self.key_index_path + _DELTA + "keys", keys)
            add(self.key_index_path + _DELTA + "held", last > 0)  # 0: a free row.

    def sketch_devices(self) -> List[str]:
        """The device of each sketch shard (none without a sketch)."""
        return [p.device for p in _parts(self.sketch)] if self.sketch is not None else []

    def add_sketch_pieces(self, j: int, add: Callable[[str, tf.Tensor], None]) -> None:
        """Adds sketch shard `j`'s counters changed since the previous save; takes the copy."""
        parts = _parts(self.sketch)
        part, snapshot, n = parts[j], self._snapshots[j], len(parts)
        with tf.device(part.device):
            values = tf.convert_to_tensor(part)
            local = tf.reshape(tf.where(tf.not_equal(values, snapshot)), [-1])
            add(self.sketch_key + _DELTA + "ids", local * n + j)
            add(self.sketch_key + _DELTA + "rows", tf.gather(values, local))
            snapshot.assign(values)

    def manifest(self) -> Dict[str, Any]:
        """This layer's entry of the delta manifest's ``dynamic`` map."""
        return {"table": self.table_key, "row_state": list(self.row_state_keys),
                "key_index": self.key_index_path, "key_dtype": self.layer.key_dtype.name,
                "sketch": self.sketch_key}


def _concat(parts: Mapping[str, List[np.ndarray]], name: str, where: str) -> np.ndarray:
    if name not in parts:
        raise CheckpointError(f"delta {where} has no {name}.")
    values = parts[name]
    return values[0] if len(values) == 1 else np.concatenate(values)


def apply(root, dynamic: Mapping[str, Mapping[str, Any]], parts: Mapping[str, List[np.ndarray]],
          find: Callable[[str], Optional[Any]], paths: Mapping[int, str], where: str) -> int:
    """Applies a delta's ``dynamic`` entries (after its tables); returns the key changes.

    Args:
        root: The checkpoint root being restored.
        dynamic: The manifest's ``dynamic`` map (layer path -> entry).
        parts: The row files' tensors by name, one array per file, in file order.
        find: Full-checkpoint key -> variable of `root` (None: skip it).
        paths: id(trackable) -> object path, for `root`.
        where: The delta's path, for messages.

    Raises:
        CheckpointError: the delta names a layer `root` does not have.
    """
    layers = dict(find_layers(root, paths))
    changed = 0
    for path, meta in sorted(dynamic.items()):
        layer = layers.get(path)
        if layer is None:
            raise CheckpointError(
                f"delta {where} holds DynamicEmbedding {path}, which this model does not have. "
                "Fix: restore into the architecture that wrote it.")
        ids = _concat(parts, meta["table"] + _DELTA + "ids", where)
        for key in meta["row_state"]:
            target = find(key)
            if target is not None and len(ids):
                rows = _concat(parts, key + _DELTA + "rows", where)
                target.scatter_update(tf.IndexedSlices(tf.constant(rows), tf.constant(ids)))
        if meta.get("sketch"):
            target = find(meta["sketch"])
            counters = _concat(parts, meta["sketch"] + _DELTA + "ids", where)
            if target is not None and len(counters):
                values = _concat(parts, meta["sketch"] + _DELTA + "rows", where)
                target.scatter_update(tf.IndexedSlices(tf.constant(values),
                                                       tf.constant(counters)))
        if not len(ids):
            continue
        keys = _concat(parts, meta["key_index"] + _DELTA + "keys", where)
        held = _concat(parts, meta["key_index"] + _DELTA + "held", where)
        old_keys, old_rows = (t.numpy() for t in layer.key_index.export())
        new_keys, new_rows = merge_key_pairs(old_keys, old_rows, ids, keys, held)
        layer.key_index.load(tf.constant(new_keys, layer.key_dtype),
                             tf.constant(new_rows, tf.int64))
        changed += len(ids)
    return changed
