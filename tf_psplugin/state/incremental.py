"""Incremental checkpoints: deltas holding only the table rows updated since the last save.

Why this module exists: a CTR model's state is mostly its embedding tables,
and a step updates a small fraction of their rows. A full checkpoint writes
every row every time; between full saves, a delta writes only the rows (and
their optimizer slots; for a `DynamicEmbedding`, also their per-row state
and key changes) that changed since the previous save, plus the dense
state, which is small and changes every step. Opt in with
``ChiefCheckpointManager(..., full_every_saves=K)`` or ``ChiefCheckpoint(...,
full_every_saves=K)``: every K-th save is full, the K-1 saves between are deltas.

Tracking which rows changed (on the PS, in the step). `RowStamps` gives each
table shard an int32 stamp per row on the shard's own PS, and each PS task
one int32 generation counter. `HybridExtended._update` (every optimizer
apply to a table shard goes through it) adds one scatter to the apply: the
rows of the gradient get the current generation of their PS. A save first
advances every generation, then a delta takes the rows stamped at or after
the generation the previous save advanced to. A row updated while a delta is
being gathered is stamped with the new generation, so the next delta has
it: nothing is lost between gather and "clear", and nothing is ever cleared.
Writes outside the optimizer (`set_weights`, `EarlyStopping`'s restore, a
reset, an EMA overwrite, weight decay) go through the shard's or its slot's
`tf.Variable` methods: `RowStamps.watch` makes each of those stamp the rows
it writes (every row for an ``assign*``), so they reach the next delta too.

Writing a delta. Each PS task gathers its dirty rows (table and every slot
of that table), turns local row ids into logical ones (the table's layout),
and writes them with SaveV2 on its own device into ``delta-<step>/ps-<k>``;
the chief writes every other variable (dense weights, their slots, the
optimizer's step and hyperparameters) whole into ``delta-<step>/dense``.
Then the chief writes the commit marker ``delta-<step>.commit`` (kind,
base full checkpoint, parent, file sizes, manifest; see `model_dir`).

Restoring. The latest intact full checkpoint is restored as always, then
every delta of its chain in order (`model_dir.checkpoint_chain`): dense
values assigned, rows scattered into the logical tables and slots by key.
Because rows carry logical ids, this works into any number of PS tasks and
into a plain single-process model (`checkpoint.load_into`).

The delta format, for readers such as the serving loader
(`tf_psplugin.state.serving`; no TF object graph needed):

* ``delta-<step>/ps-<k>.index`` + ``.data-*``: a TF tensor bundle (read it
  with `tf.train.load_checkpoint` or RestoreV2). For each table, under the
  table's full-checkpoint key ``K`` (e.g.
  ``model/layer_with_weights-0/embeddings/.ATTRIBUTES/VARIABLE_VALUE``):
  ``K/.DELTA/ids`` (int64 ``[n]``, logical row ids, each at most once in the
  whole delta) and ``K/.DELTA/rows`` (``[n, ...]``, the rows' values; float32 for a
  half-precision table, as its full checkpoint holds it); for
  each optimizer slot of the table, ``S/.DELTA/rows`` under the slot's key
  ``S``, in the order of the table's ids. Different ``ps-<k>`` files hold
  disjoint ids. A serving loader applies ``table[ids] = rows`` per table.
  Keras's new optimizers keep one slot variable per table shard (its own
  key ``S``, the shard's rows; a stacked table's is its rows of the stack
  shard's slot, a `stacked_slots.SlotView`, under the same key ``S`` as
  unstacked): for each, ``S/.DELTA/ids`` (int64 local row ids of the
  table shard) and ``S/.DELTA/rows``, applied as ``slot[ids] = rows``.
  tf-keras 2.16+ wraps those in one `ShardedVariable` per slot (key ``S``;
  stacked: one `SlotView` of a piece per shard): part ``s`` is under
  ``S/.DELTA/part-<s>/ids`` and ``S/.DELTA/part-<s>/rows``.
* ``delta-<step>/dense.*``: every other variable, whole, under its
  full-checkpoint key.
* For each `DynamicEmbedding` layer (added to the format above; nothing
  above changes): its ``embeddings`` are a table as above (ids are logical
  rows of the layer's table, its optimizer slots are its slots), and the
  same ``ps-<k>`` bundles also hold, in the order of that table's ids,
  ``R/.DELTA/rows`` for each per-row state table ``R`` (``row_last_used``,
  int64, 0 for a free row; ``row_hits``, int64), and, under the layer's
  ``key_index`` object path ``P`` (e.g. ``model/layer_with_weights-0/
  key_index``), ``P/.DELTA/keys`` (the key each row holds now, int64 or
  string) and ``P/.DELTA/held`` (bool: whether it holds one; False for a
  row freed by eviction or expiry since the previous save). With
  ``admit_after > 1``: ``C/.DELTA/ids`` (int64, logical counter indices)
  and ``C/.DELTA/rows`` (int64 counts) for the counters of the admission
  sketch ``C`` that changed. The layer's ``clock`` is in ``dense``. A
  loader applies a layer's keys after its rows: remove every key that maps
  to one of the table's ids, then map ``keys[held] -> ids[held]`` (a
  loader that applied only the table rows would serve new rows under the
  keys they had before; `serving.ServingModel` applies the keys too). How
  the changes are found, and why the sketch is written by counter rather
  than whole: `incremental_dynamic`.
* ``delta-<step>.commit`` (JSON): ``kind: "delta"``, ``step``, ``base``
  (``ckpt-<m>``), ``parent`` (the base or the previous delta), ``files``
  (sizes), ``manifest``: ``tables`` (key -> shape, dtype, slot keys, and
  ``shard_slots``: the per-shard slot keys, ``sharded_slots``: key ->
  number of parts, when there are any),
  ``row_files`` and ``dense`` (prefixes relative to the model directory),
  and, when the model has a `DynamicEmbedding`, ``dynamic``: layer object
  path -> ``table`` (its embeddings' key, also in ``tables``),
  ``row_state`` (the ``R`` keys), ``key_index`` (``P``), ``key_dtype``
  (``"int64"`` or ``"string"``) and ``sketch`` (``C``, or null).

Stacked tables (`stack_tables=True`, the default) share one `RowStamps`
per stack shard: every row of the shard is stamped (the one optimizer
apply per stack shard stamps the merged gradient's rows; a write to one
table scatters into, and stamps, its rows only), and each table takes the
stamped rows of its own range of the shard (`_Table.dirty_rows`), written
by logical id under its own key as above. Keras's new optimizers' slots of
a stacked table are `stacked_slots.SlotView`s (one per table shard, or one
per table with tf-keras 2.16+), matched to the table by their pieces (the
table's rows of the stack shard's slot, `incremental_slots`): each is saved by
the table's changed rows, by the table's local ids, as an unstacked
table's per-shard slot, and a write through a view stamps the rows it
writes (the stack shard's slot is watched). A per-shard slot that is one
plain variable per stack shard (an optimizer whose slots are not listed
per table; `stacked_updates` gives each of its tables a stack of its own)
is listed under the first table of the stack (by key) and saved by the
shard's changed rows (local ids of the shard variable). The manager splits a model's stacks
before it tracks them (`fusion.separate_before_slots`); a table moved to
another stack afterwards fails the next save.

Limits (refused with `CheckpointError` when the manager is built): the optimizer's
sparse update must change only the gradient's rows, or every delta would
hold whole tables (`row_local_refusal`: Keras's legacy SGD, Adagrad and
Ftrl, Keras's Adagrad, `tf_psplugin.LazyAdam`; Keras's Adam, new SGD and
new Ftrl are refused by name). A table update with a dense gradient (a
regularizer) or a constraint marks every row of the shard. A restore by
another tool than `CheckpointManager` (raw ops on the variables' handles)
is not seen. `DynamicEmbedding` tables are supported
(`incremental_dynamic`); they restore into any PS count, as their full
checkpoints do.

Private TF API: the breadth-first object paths and slot keys a checkpoint
uses (`_tf_internal.graph_view`, `checkpoint_util`, `trackable_utils`).
"""

import os
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

import numpy as np
import tensorflow as tf
from absl import logging

from tf_psplugin._internal.tf_internal import checkpoint_util, graph_view, sharded_variable
from tf_psplugin._internal.tf_internal import trackable_base, trackable_utils
from tf_psplugin.state import incremental_dynamic, incremental_slots
from tf_psplugin.state import model_dir as model_dir_lib
from tf_psplugin.state.model_dir import CheckpointError
from tf_psplugin.state.row_stamps import RowStamps, row_local_refusal
from tf_psplugin.tables import half_precision, slot_order, stacked_slots

__all__ = ["DELTA_SUFFIX", "IncrementalSaver", "RowStamps", "apply_delta", "object_keys"]

DELTA_SUFFIX = "/.DELTA/"
DENSE_FILE = "dense"

# --- Which key is which object ------------------------------------------------


def _is_variable(obj) -> bool:
    from tf_psplugin.sync.replicated import ReplicatedVariable  # pylint: disable=g-import-not-at-top

    return isinstance(obj, (tf.Variable, sharded_variable.ShardedVariable, ReplicatedVariable))


def object_keys(root) -> Tuple[Dict[str, Any], Dict[str, Tuple[str, str]], Dict[int, str]]:
    """Every variable reachable from a checkpoint root, by its full-checkpoint key.

    Args:
        root: The `tf.train.Checkpoint` (or any trackable) checkpoints are
            written from.

    Returns:
        ``(variables, slots, paths)``: key -> variable (sharded tables and
        their slots as their containers; optimizer slots included under their
        slot keys); slot key -> (key of the variable it belongs to, slot
        name); id(object) -> object path, for every trackable reached.
    """
    view = graph_view.ObjectGraphView(root)
    result = checkpoint_util.objects_ids_and_slot_variables_and_paths(view)
    objects, names, slot_refs = result[0], result[4], result[3]
    variables, slots, paths = {}, {}, {}
    for obj in objects:
        path = names.get(obj) if obj in names else None
        if path is None:
            continue
        paths[id(obj)] = path
        if _is_variable(obj):
            variables[trackable_utils.checkpoint_key(
                path, trackable_base.VARIABLE_VALUE_KEY)] = obj
    for refs in slot_refs.values():
        for ref in refs:
            original = objects[ref.original_variable_node_id]
            slot = objects[ref.slot_variable_node_id]
            slot_key = trackable_utils.checkpoint_key(names[slot],
                                                      trackable_base.VARIABLE_VALUE_KEY)
            slots[slot_key] = (trackable_utils.checkpoint_key(
                names[original], trackable_base.VARIABLE_VALUE_KEY), ref.slot_name)
    return variables, slots, paths


# --- Tracked tables -------------------------------------------------------------


def _task_name(device: str) -> str:
    spec = tf.DeviceSpec.from_string(device or "")
    return f"{spec.job or 'local'}-{spec.task or 0}"


class _Table:
    """One table being tracked: its key, shards, layout and slots.

    A stacked table (`stacking.StackedTable`) holds rows
    ``[offsets[s], offsets[s] + counts[s])`` of each stack shard ``s``; the
    shard's `RowStamps` (one per stack shard, shared by the tables of the
    stack) cover every row of the shard. "Local" ids below are the table's
    own rows of a shard (``0..counts[s]``, as an unstacked shard's);
    "physical" ids are rows of the shard variable (local + offset).
    """

    def __init__(self, key: str, container, shards: List[Any]):
        from tf_psplugin.tables import stacking  # pylint: disable=g-import-not-at-top

        self.key = key
        self.container = container
        self.shards = shards
        if isinstance(container, stacking.StackedTable):
            self.offsets = [int(o) for o in container.row_offsets]
            self.counts = [int(c) for c in container.shard_counts]
        else:
            self.offsets = [0] * len(shards)
            self.counts = [int(shard.shape[0]) for shard in shards]
        self.shard_rows = [int(shard.shape[0]) for shard in shards]  # What the stamps cover.
        self.stamps: List[RowStamps] = []
        self.slot_keys: List[Tuple[str, str]] = []  # (slot key, slot name)
        # Keras's new optimizers: one slot variable per shard (key per shard s).
        # A stack shard's slots are listed under one table of the stack only,
        # and saved by physical ids (every table's rows of the shard).
        self.shard_slot_keys: List[List[str]] = [[] for _ in shards]
        # tf-keras 2.16+: the same, wrapped in one ShardedVariable per slot (its key).
        self.sharded_slot_keys: List[str] = []
        # Per-table views of a stack shard's slot (stacked_slots.SlotView), in
        # the two lists above: (key, shard index) -> the stack shard's slot.
        # Saved by this table's own rows of it, by local ids.
        self.view_slots: Dict[Tuple[str, int], Any] = {}
        # The DynamicEmbedding whose rows these are (None: a plain table).
        self.dynamic: Optional[incremental_dynamic.DynamicTable] = None

    def shares_shards(self) -> bool:
        """Whether the shard variables hold rows other than this table's (a shared stack)."""
        return any(o != 0 or c != int(shard.shape[0])
                   for o, c, shard in zip(self.offsets, self.counts, self.shards))

    def dirty_rows(self, s: int, since: int) -> tf.Tensor:
        """Local ids of this table's rows of shard `s` changed since generation `since`."""
        if self.dynamic is not None:
            return self.dynamic.dirty_rows(s, self.stamps[s], since)
        physical = self.stamps[s].dirty_rows(since)
        if not self.shares_shards():
            return physical
        start, stop = self.offsets[s], self.offsets[s] + self.counts[s]
        with tf.device(self.stamps[s].device):
            mine = tf.boolean_mask(physical, (physical >= start) & (physical < stop))
            return mine - start

    def physical(self, s: int, local: tf.Tensor) -> tf.Tensor:
        """Rows of shard `s`'s variable (and of its slots) holding `local` rows of this table."""
        return local + self.offsets[s] if self.offsets[s] else local

    def check_layout(self) -> None:
        """Raises unless the table is still where its rows were tracked (same shards, rows)."""
        from tf_psplugin.tables import stacking  # pylint: disable=g-import-not-at-top

        if not isinstance(self.container, stacking.StackedTable):
            return
        if (any(a is not b for a, b in zip(self.container.variables, self.shards))
                or list(self.container.row_offsets) != self.offsets
                or [int(s.shape[0]) for s in self.shards] != self.shard_rows):
            raise CheckpointError(
                f"incremental checkpoints (full_every_saves): table {self.container.name} was "
                "moved to another stack, or another table joined its stack, after the checkpoint "
                "manager began tracking its rows. Fix: build every model before the "
                "ChiefCheckpoint/CheckpointManager (after compile, before the first step), or "
                "HybridParameterServerStrategy(options=HybridOptions(stack_tables=False)).")

    def logical_ids(self, shard_index: int, local: tf.Tensor) -> tf.Tensor:
        """Logical row ids of `local` rows of shard `shard_index`."""
        from tf_psplugin.tables import sharded  # pylint: disable=g-import-not-at-top

        n = len(self.shards)
        if isinstance(self.container, sharded.InterleavedShardedVariable):
            return local * n + shard_index
        offset = sum(int(s.shape[0]) for s in self.shards[:shard_index])
        return local + offset


class IncrementalSaver:
    """Tracks updated table rows on the PS tasks and writes deltas for `CheckpointManager`.

    Build it before the first training step (each step's trace must contain
    the row stamps). Used by `tf_psplugin.ChiefCheckpointManager(full_every_saves=K)`;
    not meant to be called directly.

    Args:
        root: The checkpoint root the manager saves (its keys name the rows).
        strategy: A `HybridParameterServerStrategy`.
        optimizer: The optimizer whose slots are saved with the tables.
        python_state: Objects whose state the commit marker carries instead
            (the manager's step and input position).

    Raises:
        CheckpointError: what the model holds cannot be saved as deltas.
    """

    def __init__(self, root, strategy, optimizer, python_state=()):
        extended = getattr(strategy, "extended", None)
        if extended is None or not hasattr(extended, "track_updated_rows"):
            raise CheckpointError(
                "incremental checkpoints (full_every_saves) need HybridParameterServerStrategy: it "
                "records which table rows each step updates. Fix: drop full_every_saves.")
        self._root = root
        self._extended = extended
        self._optimizer = optimizer
        self._python_state = list(python_state)
        self._check_optimizer(optimizer)
        variables, _, paths = object_keys(root)
        keys_by_id = {id(var): key for key, var in variables.items()}
        self.dynamic = [incremental_dynamic.DynamicTable(path, layer, keys_by_id, paths)
                        for path, layer in incremental_dynamic.find_layers(root, paths)]
        self.tables = self._find_tables(
            variables, skip=set().union(*[d.not_tables() for d in self.dynamic]))
        if not self.tables:
            raise CheckpointError("incremental checkpoints (full_every_saves): the model has no "
                                  "sharded embedding table. Fix: drop full_every_saves.")
        self._generations: Dict[str, tf.Variable] = {}
        # One RowStamps per shard variable: the tables of a stack share them.
        stamps_of: Dict[int, RowStamps] = {}
        for table in self.tables:
            for shard in table.shards:
                row_stamps = stamps_of.get(id(shard))
                if row_stamps is None:
                    generation = self._generation(shard.device)
                    stamps = extended.create_plain_variable(
                        shard.device, initial_value=tf.zeros([int(shard.shape[0])], tf.int32),
                        trainable=False,
                        name=f"{shard.name.split(':')[0]}/tf_psplugin_row_stamps")
                    row_stamps = RowStamps(shard, generation, stamps)
                    extended.track_updated_rows(shard, row_stamps)
                    row_stamps.watch(shard)  # Writes outside the optimizer (set_weights, ...).
                    stamps_of[id(shard)] = row_stamps
                table.stamps.append(row_stamps)
        by_key = {table.key: table for table in self.tables}
        for dynamic in self.dynamic:
            table = by_key[dynamic.table_key]
            table.dynamic = dynamic
            table_tasks = {_task_name(shard.device) for shard in table.shards}
            if not {_task_name(d) for d in dynamic.sketch_devices()} <= table_tasks:
                raise CheckpointError(
                    f"incremental checkpoints: the admission sketch of {dynamic.layer.name} "
                    "is not on its table's PS tasks. Fix: drop full_every_saves for this model.")
            dynamic.install(table.stamps, extended.create_plain_variable)
        # Rows stamped at or after `since[device]` are dirty.
        self._since = {device: 1 for device in self._generations}
        self._checked_against: Optional[str] = None

    # -- setup -------------------------------------------------------------------

    @staticmethod
    def _check_optimizer(optimizer) -> None:
        why = row_local_refusal(optimizer)
        if why is not None:
            raise CheckpointError(f"incremental checkpoints (full_every_saves): {why}")

    def _find_tables(self, variables: Mapping[str, Any], skip=frozenset()) -> List[_Table]:
        """The row tables among `variables`, except those whose id is in `skip`."""
        is_table = self._extended.is_table_var
        tables, in_containers = [], set()
        for key, var in sorted(variables.items()):
            if id(var) in skip:
                continue
            if isinstance(var, sharded_variable.ShardedVariable) and all(
                    is_table(s) for s in var.variables):
                tables.append(_Table(key, var, list(var.variables)))
                in_containers.update(id(s) for s in var.variables)
        for key, var in sorted(variables.items()):
            if (isinstance(var, tf.Variable) and id(var) not in in_containers | skip
                    and is_table(var)):
                tables.append(_Table(key, var, [var]))  # A one-shard table.
        return tables

    def _generation(self, device: str) -> tf.Variable:
        task = _task_name(device)
        if task not in self._generations:
            self._generations[task] = self._extended.create_plain_variable(
                device, initial_value=tf.constant(1, tf.int32), trainable=False,
                name=f"tf_psplugin_row_generation_{task.replace('-', '_')}")
        return self._generations[task]

    # -- saving --------------------------------------------------------------------

    def advance(self) -> Dict[str, int]:
        """Starts a new generation on every PS; returns the generations to save from."""
        since = dict(self._since)
        for task, generation in self._generations.items():
            self._since[task] = int(generation.assign_add(1).numpy())
        return since

    def check_layout(self) -> None:
        """Raises `CheckpointError` if a table's stack changed since its rows were tracked."""
        for table in self.tables:
            table.check_layout()

    def begin_full(self) -> None:
        """Call right before a full save: rows updated after it go into the next delta."""
        self.check_layout()
        self.advance()
        incremental_slots.find_slots(self.tables, *object_keys(self._root)[:2])
        for dynamic in self.dynamic:
            dynamic.start_save(full=True)

    def check_covers(self, full_checkpoint: str) -> None:
        """Raises unless every tensor of `full_checkpoint` is a table, a slot or a variable here."""
        if self._checked_against == full_checkpoint:
            return
        variables, slots, paths = object_keys(self._root)
        handled = set(variables) | set(slots)
        skip = [paths[id(obj)] + "/" for obj in self._python_state if id(obj) in paths]
        skip += [d.key_index_path + "/" for d in self.dynamic]  # Written as key changes.
        names = tf.train.load_checkpoint(full_checkpoint).get_variable_to_shape_map()
        missing = sorted(k for k in names  # (The slot-order marker is a constant.)
                         if k not in handled and k != "_CHECKPOINTABLE_OBJECT_GRAPH"
                         and not slot_order.is_marked([k])
                         and not any(k.startswith(prefix) for prefix in skip))
        if missing:
            raise CheckpointError(
                f"incremental checkpoints (full_every_saves) cannot save {len(missing)} value(s) "
                f"of the full checkpoint as deltas (not variables): {', '.join(missing[:5])}. "
                "Fix: drop full_every_saves for this model.")
        self._checked_against = full_checkpoint

    def write_delta(self, prefix: str, model_dir: str,
                    io_device: Optional[str] = None) -> Dict[str, Any]:
        """Writes the delta files under `prefix` (a directory); returns its manifest.

        Call with no step in flight and the dense replicas pulled.

        Args:
            prefix: ``<model_dir>/delta-<step>``.
            model_dir: The model directory (paths in the manifest are relative to it).
            io_device: Write every file on this device (``write_on_chief``);
                default: each PS task writes its own rows.
        """
        self.check_layout()
        since = self.advance()
        for dynamic in self.dynamic:
            dynamic.start_save(full=False)
        variables, slots, _ = object_keys(self._root)
        incremental_slots.find_slots(self.tables, variables, slots)
        tf.io.gfile.makedirs(prefix)
        by_task: Dict[str, List[Tuple[_Table, int]]] = {}
        manifest_tables = {}
        for table in self.tables:
            for s, shard in enumerate(table.shards):
                by_task.setdefault(_task_name(shard.device), []).append((table, s))
            manifest_tables[table.key] = {
                "shape": [int(d) for d in table.container.shape],
                "dtype": table.container.dtype.name,
                "slots": [k for k, _ in table.slot_keys]}
            shard_slots = [k for keys in table.shard_slot_keys for k in keys]
            if shard_slots:
                manifest_tables[table.key]["shard_slots"] = shard_slots
            if table.sharded_slot_keys:
                manifest_tables[table.key]["sharded_slots"] = {
                    k: len(table.shards) for k in table.sharded_slot_keys}
        row_files = []
        for task, entries in sorted(by_task.items()):
            device = entries[0][0].shards[entries[0][1]].device
            names, tensors = [], []
            pieces: Dict[str, List[tf.Tensor]] = {}

            def add(name, tensor):
                pieces.setdefault(name, []).append(tensor)

            with tf.device(device):
                for table, s in entries:
                    local = table.dirty_rows(s, since[task])
                    physical = table.physical(s, local)  # Rows of the (stack) shard.
                    shard = table.shards[s]
                    ids = table.logical_ids(s, local)
                    add(table.key + DELTA_SUFFIX + "ids", ids)
                    # As float32 for a half-precision table.
                    rows = tf.gather(shard, physical)
                    pieces.setdefault(table.key + DELTA_SUFFIX + "rows", []).append(
                        tf.cast(rows, half_precision.float32_for_checkpoint(rows.dtype)))
                    for slot_key, _ in table.slot_keys:
                        slot = variables[slot_key]
                        slot_shard = slot.variables[s] if len(table.shards) > 1 else slot
                        pieces.setdefault(slot_key + DELTA_SUFFIX + "rows", []).append(
                            tf.gather(slot_shard, physical))
                    # Per-shard slots hold the whole shard variable's rows (every
                    # table of a stack): saved by the shard's own changed rows.
                    slot_ids = (table.stamps[s].dirty_rows(since[task])
                                if table.shares_shards() else local)
                    # One variable per shard (Keras's new optimizers), or its part
                    # `s` (tf-keras wraps per-shard slots): local ids.
                    shard_slots = [(k + DELTA_SUFFIX, k, None) for k in table.shard_slot_keys[s]]
                    shard_slots += [(f"{k}{DELTA_SUFFIX}part-{s}/", k, s)
                                    for k in table.sharded_slot_keys]
                    for name, slot_key, part in shard_slots:
                        view_storage = table.view_slots.get((slot_key, s))
                        if view_storage is not None:  # The table's rows of the stack's slot.
                            add(name + "ids", local)
                            add(name + "rows", tf.gather(view_storage, physical))
                        else:
                            var = variables[slot_key]
                            var = var if part is None else var.variables[part]
                            add(name + "ids", slot_ids)
                            add(name + "rows", tf.gather(var, slot_ids))
                    if table.dynamic is not None:
                        table.dynamic.add_row_pieces(s, local, ids, add)
                for dynamic in self.dynamic:
                    for j, sketch_device in enumerate(dynamic.sketch_devices()):
                        if _task_name(sketch_device) == task:
                            dynamic.add_sketch_pieces(j, add)
                for name, parts in pieces.items():
                    names.append(name)
                    tensors.append(parts[0] if len(parts) == 1 else tf.concat(parts, 0))
            file_prefix = model_dir_lib.join(prefix, task)
            with tf.device(io_device or device):
                tf.raw_ops.SaveV2(prefix=file_prefix, tensor_names=names,
                                  shape_and_slices=[""] * len(names), tensors=tensors)
            row_files.append(file_prefix)
        table_vars = {id(t.container) for t in self.tables}
        table_vars.update(*[d.not_dense() for d in self.dynamic])
        table_slot_keys = {k for t in self.tables for k, _ in t.slot_keys}
        table_slot_keys.update(k for t in self.tables for keys in t.shard_slot_keys for k in keys)
        table_slot_keys.update(k for t in self.tables for k in t.sharded_slot_keys)
        dense_names, dense_values = [], []
        for key, var in sorted(variables.items()):
            if id(var) in table_vars or key in table_slot_keys:
                continue
            dense_names.append(key)
            # (A ShardedVariable whole: its parts in order, as a full save holds it.)
            dense_values.append(tf.convert_to_tensor(var) if isinstance(
                var, sharded_variable.ShardedVariable) else tf.identity(var))
        dense_prefix = model_dir_lib.join(prefix, DENSE_FILE)
        with tf.device(io_device):  # None: this process (the chief).
            tf.raw_ops.SaveV2(prefix=dense_prefix, tensor_names=dense_names,
                              shape_and_slices=[""] * len(dense_names), tensors=dense_values)

        def rel(path):
            return path[len(model_dir.rstrip("/")) + 1:]

        manifest = {"tables": manifest_tables, "row_files": [rel(p) for p in row_files],
                    "dense": rel(dense_prefix)}
        if self.dynamic:
            manifest["dynamic"] = {d.path: d.manifest() for d in self.dynamic}
        return manifest


# --- Restoring ------------------------------------------------------------------


def _read_bundle(prefix: str) -> Dict[str, np.ndarray]:
    reader = tf.train.load_checkpoint(prefix)
    return {name: reader.get_tensor(name) for name in reader.get_variable_to_shape_map()}


def apply_delta(root, info: model_dir_lib.CheckpointInfo,
                skip: Optional[Callable[[str], bool]] = None) -> int:
    """Applies a committed delta to the objects of `root` (restored to its parent already).

    Args:
        root: A checkpoint root of the same architecture as the writer's
            (`CheckpointManager`'s, or ``tf.train.Checkpoint(model=...,
            optimizer=...)`` in a single process).
        info: The delta (`model_dir.checkpoint_chain`).
        skip: Keys for which it returns True are not applied (e.g. slots,
            when restoring without the optimizer); any other key of the
            delta must name a variable of `root`.

    Returns:
        The number of table rows written.

    Raises:
        CheckpointError: the delta does not match the model.
    """
    manifest = (model_dir_lib.read_json(info.path + model_dir_lib.COMMIT_SUFFIX) or {}).get(
        "manifest") or {}
    model_dir = os.path.dirname(info.path)
    variables, _, paths = object_keys(root)

    def find(key):
        if key in variables:
            return variables[key]
        if skip is not None and skip(key):
            return None
        raise CheckpointError(
            f"delta {info.path} holds {key}, which this model does not have. Fix: restore "
            "into the architecture that wrote it.")

    dense = _read_bundle(model_dir_lib.join(model_dir, manifest.get("dense", "")))
    for key, value in sorted(dense.items()):
        var = find(key)
        if var is not None:
            var.assign(value)
    rows_written = 0
    parts: Dict[str, List[np.ndarray]] = {}
    for row_file in manifest.get("row_files", []):
        for name, value in _read_bundle(model_dir_lib.join(model_dir, row_file)).items():
            parts.setdefault(name, []).append(value)
    for table_key, meta in sorted(manifest.get("tables", {}).items()):
        ids = parts.get(table_key + DELTA_SUFFIX + "ids")
        if not ids:
            raise CheckpointError(f"delta {info.path} lists table {table_key} but holds no ids.")
        ids = np.concatenate(ids)
        if not len(ids):
            continue
        for key in [table_key] + list(meta.get("slots", [])):
            target = find(key)
            if target is None:
                continue
            rows = np.concatenate(parts[key + DELTA_SUFFIX + "rows"])
            # (Rounded into a half-precision table, kept in a float32 one.)
            target.scatter_update(tf.IndexedSlices(tf.cast(tf.constant(rows), target.dtype),
                                                   tf.constant(ids)))
        for key in meta.get("shard_slots", []):
            target = find(key)
            local = parts.get(key + DELTA_SUFFIX + "ids")
            if target is not None and local:
                rows = np.concatenate(parts[key + DELTA_SUFFIX + "rows"])
                target.scatter_update(tf.IndexedSlices(tf.constant(rows),
                                                       tf.constant(np.concatenate(local))))
        for key, count in sorted(meta.get("sharded_slots", {}).items()):
            target = find(key)
            if target is None:
                continue
            # A ShardedVariable, or (a stacked model) a table's whole SlotView.
            target_parts = ([target.part(i) for i in range(len(target.pieces))]
                            if isinstance(target, stacked_slots.SlotView)
                            else list(target.variables))
            if len(target_parts) != count:
                raise CheckpointError(
                    f"delta {info.path} holds {key} as {count} shard(s), the model has "
                    f"{len(target_parts)}. Fix: restore into as many PS tasks as wrote it "
                    "(Keras's new optimizers save a table's slots per shard).")
            for s, part in enumerate(target_parts):
                local = parts.get(f"{key}{DELTA_SUFFIX}part-{s}/ids")
                if local:
                    rows = np.concatenate(parts[f"{key}{DELTA_SUFFIX}part-{s}/rows"])
                    part.scatter_update(tf.IndexedSlices(tf.constant(rows),
                                                         tf.constant(np.concatenate(local))))
        rows_written += len(ids)
    if manifest.get("dynamic"):
        incremental_dynamic.apply(root, manifest["dynamic"], parts, find, paths, info.path)
    logging.info("tf_psplugin: applied delta %s (%d table rows)", info.path, rows_written)
    return rows_written

