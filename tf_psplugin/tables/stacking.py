"""Table stacking: same-width embedding tables stored as one variable per PS.

Why this module exists: a CTR model has one `tf.keras.layers.Embedding` per
feature, and every table costs its own ops in every step on every PS (a
gather per worker, a sparse optimizer apply, a duplicate-row sum) and on
every worker (id routing, gradient plumbing). benchmarks/README.md
("Findings") measured that cost, not the transfers, as what makes 26 small
tables 1.5x slower than one table of the same rows. Stacking stores the
tables of one row width, dtype and PS count as ONE variable per PS (a
"stack"); each table keeps its own logical object, a `StackedTable`, which is
its rows inside the stack.

How no Keras or TF API can tell (issue 29):

* **Keras sees each table's own rows** (`TableView`): a stacked table
  lists, as its weights, one view per stack shard -- named, shaped and
  holding the rows an unstacked table's shard would (``<layer>/embeddings/
  part_<s>``, ``[rows, D]``). `layer.weights`, `get_weights`/`set_weights`,
  `count_params`, `trainable_variables`, `trainable=False`, regularizers
  and `tf.nest` see the table alone; the stack's shards appear nowhere.
* **Each table gets its own gradient**: a view's reads are gathers of the
  stack shard through a custom gradient whose input is the view's own
  handle tensor, so the tape gives each view an `IndexedSlices` of its own
  rows. A functional model's lookups of one stack are still one gather per
  PS (`lookups.lookup_tables`), with the gradient split per view.
* **One apply per stack shard** (`stacked_updates`): the views' gradients
  are merged into one gradient of the stack shard, with one set of slots;
  where one apply would not equal per-table applies, it writes back the
  rows of the tables without a gradient, or applies each table's view on
  its own.
* **Stacks per model**: a model's first traced call splits the stacks it
  uses -- not yet used by any traced function nor given slots -- into its
  trainable tables, its frozen ones and everything else
  (`separate_by_model`), so a second model built in the same scope (a
  target network, a teacher) or a frozen table never shares a stack with
  the tables an optimizer trains. A restore and `build_optimizer_slots`
  make slots before any call is traced: they split first the same way
  (`fusion.separate_before_slots`), so a restarted job has the stacks, and
  the slots, of its fresh run.
* **Everything that names a table sees the `StackedTable`**: lookups
  (`tf.nn.embedding_lookup` and the other APIs `tables/lookups.py` dispatches),
  reads, `assign`, checkpoints (each table saved under its own key, in
  logical row order: it restores into unstacked tables, any PS count and a
  single process), the placement report and export. An id outside
  ``[0, V)`` fails as on an unstacked table.
* **Growth, not planning**: a layer builds its table alone, before the next
  layer exists. The first table of a group opens a stack; each later one is
  appended to it. The stack's shards get their variables, of the full
  size, when first needed (a lookup, a read, a slot, a checkpoint), so
  each PS allocates a stack once. A table made after a slot exists for a
  stack or a traced function used it starts a new stack.

On by default (the strategy's ``stack_tables=True``; ``stack_tables=False``
is the way out): docs/api.md lists what a program can still tell (a
model's optimizer other than Keras's known ones gets its tables unstacked,
a legacy optimizer outside the known ones gets its tables split apart).

Which tables stack (`eligible`): 2-D float tables of a strategy with
``stack_tables=True``, made eagerly (Keras builds layers eagerly),
interleaved over 2 or more PS tasks, trainable, with no constraint, of at
most `MAX_TABLE_BYTES`; a stack stops growing at `MAX_STACK_BYTES`. Not
stacked: `DynamicEmbedding`'s tables (it addresses its own rows), tables
made in graph mode (the Estimator path), contiguous sharding.

The code: this module holds the logical table (`StackedTable`) and the
registry that decides which tables stack (`TableStacks`);
`table_view.py` what Keras sees of a table (`TableView`);
`stack_storage.py` the stacks' storage (`Stack`, `StackShard`).

Private TF API: `ShardedVariable`'s saving variable and type spec (the
table's own checkpoint and `tf.nest` components), through `_internal`.
"""

import gc
import weakref
from typing import Callable, Dict, List, Optional, Sequence

import tensorflow as tf

from tf_psplugin._internal import patches
from tf_psplugin._internal import tf_objects
from tf_psplugin._internal.scopes import ThreadScope
from tf_psplugin._internal.tf_internal import resource_variable_ops, sharded_variable
from tf_psplugin.tables import slot_split, stack_rows
from tf_psplugin.tables.layout import shard_rows
from tf_psplugin.tables.placement import SHARDING_INTERLEAVED
from tf_psplugin.tables.sharded import InterleavedShardedVariable
from tf_psplugin.tables.stack_storage import Stack, StackShard, current_rows, retire
from tf_psplugin.tables.table_view import TableView  # noqa: F401  (re-exported)

__all__ = ["StackedTable", "TableStacks", "TableView", "MAX_TABLE_BYTES", "MAX_STACK_BYTES",
           "models_seen", "unstacked"]

# A table larger than this is not stacked: its own ops are a small share of a
# step next to its rows, and its initial rows would be held twice on its PS
# while the stack is made (pending rows, then the variable).
MAX_TABLE_BYTES = 32 << 20
# A stack stops growing here: a table joining a stack whose variables exist
# copies them, and the pending rows of a stack not yet made are held twice.
MAX_STACK_BYTES = 1 << 30

_UNSTACKED = ThreadScope()
# A table's logical write, per stack shard: a scatter into its rows only.
_SCATTER_OF = {"assign": "scatter_update", "assign_add": "scatter_add",
               "assign_sub": "scatter_sub"}


def unstacked():
    """Tables created inside this scope are never stacked (their owner addresses rows).

    Returns:
        A context manager.
    """
    return _UNSTACKED.scope()


class StackedTable(InterleavedShardedVariable):
    """One logical table stored inside a stack: interleaved rows at an offset.

    Logical row ``i`` lives on stack shard ``i % n`` at row
    ``row_offsets[i % n] + i // n``. It reads, looks up, assigns and
    checkpoints like the `InterleavedShardedVariable` it would otherwise be
    (its checkpoint is the same tensor under the same key); its `variables`
    are the stack's shard variables, shared with the other tables of the
    stack.

    Args:
        variables: The stack's shard variables, one per PS.
        row_offsets: Where this table's rows start in each shard.
        num_rows: The table's logical row count.
        name: The table's name.
        stack: The `Stack` it belongs to (None for a copy, e.g. of slots).
    """

    def __init__(self, variables, row_offsets: Sequence[int], num_rows: int,
                 name: str = "StackedTable", stack=None):
        # Not InterleavedShardedVariable.__init__: its check is for shards
        # that hold one whole table. ShardedVariable's sets the shards, dtype
        # and, from the stack's shape, `_shape`, fixed below.
        sharded_variable.ShardedVariable.__init__(self, list(variables), name=name)
        n = len(self._variables)
        self._row_offsets = tuple(int(o) for o in row_offsets)
        self._shard_counts = tuple(shard_rows(int(num_rows), n, SHARDING_INTERLEAVED))
        if len(self._row_offsets) != n:
            raise ValueError(f"StackedTable {name!r}: {len(self._row_offsets)} row offsets for "
                             f"{n} shards; pass one per shard.")
        self._shape = tf.TensorShape([int(num_rows)] + self._variables[0].shape[1:].as_list())
        self._stack = stack
        # What Keras lists as the layer's weights (`__iter__`): this table's
        # own rows of each stack shard, one `TableView` per shard. A copy
        # (e.g. a slot's view of the stack's slots) has none.
        self._views = None
        if stack is not None:
            # Named as the shards of an unstacked table made here would be
            # ("<layer>/embeddings/part_<s>"): the variable name in the
            # current name scope.
            self._view_prefix = _scoped_name(name)
            self._views = [TableView(self, s) for s in range(n)]
            for view in self._views:
                tf_objects.set_sharded_container(view, self)
        # ShardedVariable made a saving placeholder of the stack's shape; the
        # table saves (tf.saved_model.save) as its own [V, D].
        self._saving_variable = resource_variable_ops.UninitializedVariable(
            shape=self._shape, dtype=self._dtype, name=name,
            trainable=self._variables[0].trainable,
            synchronization=tf.VariableSynchronization.NONE,
            aggregation=tf.VariableAggregation.NONE)
        # What InterleavedShardedVariable.__init__ does: without it, v1 safe
        # lookups (feature columns) of a process whose first table is
        # stacked would go to TF's ShardedVariable dispatcher, unshifted.
        patches.install("safe_embedding_lookup_v1")

    @property
    def stack(self):
        """The stack this table is in (None for a copy, e.g. a slot's view)."""
        return self._stack

    @property
    def display_name(self) -> str:
        """The table's name with its layer's scope ("item/embeddings"), for messages."""
        return self.view_prefix or self.name

    @property
    def view_prefix(self) -> Optional[str]:
        """The Keras name scope its views are named in (``<layer>/embeddings``), if made in one."""
        return getattr(self, "_view_prefix", None)

    @property
    def views(self) -> Optional[List["TableView"]]:
        """This table's rows of each stack shard, as Keras lists them (None for a copy)."""
        return self._views

    def rebind(self, stack, row_offsets) -> None:
        """Moves this table into `stack` at `row_offsets` (`TableStacks.separate`)."""
        self._variables = list(stack.shards)
        for shard in self._variables:
            tf_objects.set_sharded_container(shard, self)
        self._row_offsets = tuple(int(o) for o in row_offsets)
        self._stack = stack
        stack.tables.add(self)

    def __iter__(self):
        # Keras lists a sharded variable's weights by iterating it (`Layer.
        # add_weight`, its regularizers): this table's own `[rows, D]` views,
        # never the stack's shards, which hold other tables' rows too.
        return iter(self._views if self._views is not None else self._variables)

    @property
    def shares_shards(self) -> bool:
        """True: the stack's shards hold the other tables' rows too."""
        return True

    @property
    def row_offsets(self) -> tuple:
        """Row of each stack shard where this table's rows start."""
        return self._row_offsets

    @property
    def shard_counts(self) -> tuple:
        """How many of this table's rows each stack shard holds (from `row_offsets` on)."""
        return self._shard_counts

    @property
    def _unique_id(self):
        # Every table of a stack shares shard 0: the id must name the table.
        shard_id = tf_objects.variable_unique_id(self._variables[0])
        return f"{shard_id}_stacked_{self._row_offsets[0]}"

    @property
    def _type_spec(self):
        return StackedTableSpec(
            self._row_offsets, int(self._shape[0]), self.name,
            *(resource_variable_ops.VariableSpec(v.shape, v.dtype) for v in self._variables))

    def with_variables(self, variables, name: Optional[str] = None) -> "StackedTable":
        """The same rows of other shard variables (e.g. an optimizer's slots of the stack)."""
        return StackedTable(variables, self._row_offsets, int(self._shape[0]),
                            name=name or self.name)

    # -- layout ----------------------------------------------------------------

    def _physical_ids(self, ids):
        """Logical ids -> ids whose "mod" lookup on the stack shards finds this table's rows.

        Id ``i`` becomes ``i + n * row_offsets[i % n]``: same shard
        (``i % n``), row ``i // n + row_offsets[i % n]``. Ids outside
        ``[0, V)`` stay invalid, as they are for an unstacked table: a
        negative id stays as it is (the safe lookups drop it as "missing",
        the others fail on it) and an id ``>= V`` becomes the dtype's maximum,
        a row no stack has, so the shard's gather fails instead of reading
        (or a scatter writing) the next table's row.
        """
        ids = tf.convert_to_tensor(ids)
        return stack_rows.shift_valid(ids, ids + len(self._variables) * tf.gather(
            tf.constant(self._row_offsets, dtype=ids.dtype), ids % len(self._variables)),
            int(self._shape[0]))

    def _shape_only_lookup(self, ids, max_norm=None):
        """Zeros of the rows' shape while Keras infers an output shape before the stack exists.

        Keras calls each layer of a functional model as it is built, in a
        scratch graph named ``<layer>_scratch_graph`` (Keras 2.15 and
        tf-keras 2.21, `Layer._infer_output_signature` and the functional
        construction call) whose values are never run: a real lookup there
        would make the stack's variables before the next table joins, and
        appending that table would then copy them (and it would count as a
        traced use, after which the stack is never split: `TableStacks.
        separate`). Anywhere else, None.
        """
        del max_norm
        stack = self._stack
        if stack is None:
            return None
        graph = tf.compat.v1.get_default_graph()
        if tf.executing_eagerly() or not graph.name.endswith("_scratch_graph"):
            return None
        ids = tf.convert_to_tensor(ids)
        return tf.zeros(tf.concat([tf.shape(ids), [stack.width]], axis=0), dtype=self.dtype)

    def _logical_value(self) -> tf.Tensor:
        if len(self.variables) == 1:  # tf.saved_model.save's one saving variable.
            return tf.convert_to_tensor(self.variables[0])
        return self._read_rows(0, int(self._shape[0]))

    def sparse_read(self, indices, name=None):
        """Gathers logical rows ``indices``: through the views, for the tape (a copy: the shards)."""
        if self._views is None:
            return super().sparse_read(indices, name=name)
        return tf.compat.v1.nn.embedding_lookup(self._views, indices, "mod", name=name)

    def _write_shard(self, s: int, part, method: str, use_locking) -> None:
        """Writes this table's rows of stack shard ``s`` only (a scatter, not the whole shard)."""
        del use_locking
        start = self._row_offsets[s]
        rows = tf.range(start, start + self._shard_counts[s], dtype=tf.int64)
        getattr(self._variables[s], _SCATTER_OF[method])(tf.IndexedSlices(part, rows))


def _scoped_name(name: str) -> str:
    """`name` in the current name scope, as a variable made here would be named."""
    base = (name or "table").split(":")[0]
    try:
        with tf.name_scope(base) as scope:
            return scope.rstrip("/") or base
    except ValueError:  # Not a valid scope name: the name as it is.
        return base


class StackedTableSpec(sharded_variable.ShardedVariableSpec):
    """TypeSpec that rebuilds a `StackedTable` with its offsets."""

    __slots__ = ["_row_offsets", "_num_rows", "_table_name"]

    def __init__(self, row_offsets, num_rows, name, *variable_specs):
        super().__init__(*variable_specs)
        self._row_offsets = tuple(row_offsets)
        self._num_rows = int(num_rows)
        self._table_name = name

    value_type = property(lambda self: StackedTable)

    def _serialize(self):
        return (self._row_offsets, self._num_rows, self._table_name) + self._variable_specs

    def _to_components(self, value):
        # What `tf.nest` (expand_composites) and Keras (`Layer._track_variables`,
        # when a layer sets `self.embeddings = table`) see inside a table: its
        # own views, not the stack's shards (other tables' rows).
        views = value.views
        return list(views) if views else super()._to_components(value)

    def _from_components(self, variables):
        variables = list(variables)
        if variables and all(isinstance(v, TableView) for v in variables):
            return variables[0].table
        return StackedTable(variables, self._row_offsets, self._num_rows,
                            name=self._table_name)


# id(model) -> weak ref of a Keras model with stacked tables seen by
# `separate_by_model` (its traced calls): `models_seen`.
_MODELS: Dict[int, "weakref.ref"] = {}


def models_seen() -> list:
    """The live Keras models with stacked tables that a traced call (or a restore) has run.

    A split (`stacked_fallback.trace_splitting`) drops the traced functions
    Keras keeps on them that read the split stacks' old storage.
    """
    models = []
    for key, ref in list(_MODELS.items()):
        model = ref()
        if model is None:
            _MODELS.pop(key, None)
        else:
            models.append(model)
    return models


def separate_by_model(model, apart: Optional[str] = None) -> None:
    """Gives a model's stacked tables stacks of their own before its first traced call.

    A stack is filled as layers are built, before any model exists; two
    models built in one scope (a target network, a teacher) and the frozen
    tables of a model would share it. Before any traced function uses a
    stack, its tables are split by who trains them: `model`'s trainable
    tables, its frozen ones, and the rest (whose own model sorts them out
    when it runs).
    Then an optimizer's one apply per stack updates exactly the tables it
    is given (`stacked_updates`), whatever kind of optimizer it is.
    `model` is recorded (`models_seen`).

    Args:
        model: The Keras model about to run (or to get its optimizer's slots).
        apart: Why `model`'s tables must each have storage of their own (its
            optimizer is not known to update a stack as it updates each of
            its tables: `stacked_updates.why_apart`), or None. Each is then
            alone in its stack -- its own variables, as unstacked -- and the
            placement report says why.
    """
    mine, trainable = {}, set()
    for view in model.weights:
        if isinstance(view, TableView):
            mine[id(view.table)] = view.table
    if not mine:
        return
    ref = _MODELS.get(id(model))
    if ref is None or ref() is not model:
        _MODELS[id(model)] = weakref.ref(model)
    for view in model.trainable_variables:
        if isinstance(view, TableView):
            trainable.add(id(view.table))
    stacks = {}
    for table in mine.values():
        if table.stack is not None and not (table.stack.sealed or table.stack.traced):
            stacks[id(table.stack)] = table.stack
    if not stacks:
        return

    def group_of(table):
        if id(table) not in mine:
            return "other"
        if apart:
            return ("alone", id(table))
        return "trainable" if id(table) in trainable else "frozen"

    with tf.init_scope():  # Bookkeeping of eager objects, also while a step is traced.
        for stack in stacks.values():
            owner = stack.owner() if stack.owner is not None else None
            if owner is not None:
                owner.separate(stack, group_of, why_alone=apart or "")


def split_apart(tables: Sequence["StackedTable"], why: str) -> Optional[str]:
    """Gives each of `tables` storage of its own, after a trace that needed it was dropped.

    A legacy optimizer not known to update a stack as it updates each table
    (`stacked_fallback.SplitRequired`) found some of `tables` sharing a
    stack with others while a step was traced: the coordinator dropped that
    trace and calls this before tracing the step again. Their tables'
    current rows are copied into the new stacks' variables, as a split
    before the first step does. A live optimizer's slots of the stack are
    split with it (`slot_split`: a slot per new stack shard, the same rows;
    a legacy optimizer's, and a Keras optimizer's whose `build` lists them
    per table), and the old slots emptied; a live slot `slot_split` cannot
    move (a Keras optimizer outside the known ones) keeps it whole. A live
    traced function that read it does not (Keras keeps the first fit's
    train function after a `compile`, where no one calls it): the old
    variables are emptied
    (`stack_storage.retire`), so such a function never trains rows that no
    table reads any more: it is traced anew before it runs, scheduled or
    called, or refused, naming why (`stacked_fallback.trace_splitting`,
    `before_call`); Keras's functions that read them are dropped.

    Args:
        tables: The tables the optimizer applies; each ends alone in a stack.
        why: Why (the placement report shows it beside each table).

    Returns:
        None once split, else what holds a stack that had to be split.
    """
    gc.collect()  # Functions and slots (of a dead optimizer) that only cycles still held.
    apart = {id(t) for t in tables}
    stacks = {id(t.stack): t.stack for t in tables
              if t.stack is not None and len(list(t.stack.tables)) > 1}
    slots = {}  # id(stack) -> how its live slots move (`slot_split.movable`).
    for stack in stacks.values():
        held = ("a graph that is not a tf.function's uses its variables"
                if stack.traced_for_good() else None)
        if not held and stack.slots_held_by():
            slots[id(stack)] = slot_split.movable(stack.live_slots())
            if slots[id(stack)] is None:
                held = ("an optimizer that is still alive has slots for it that a split "
                        "cannot move (only a legacy optimizer's and a known Keras "
                        "optimizer's slots are split with a stack)")
        if held:
            return f"stack {stack.name!r} cannot be split: {held}"
        if stack.owner is None or stack.owner() is None:
            return f"stack {stack.name!r} has no registry"
    for stack in stacks.values():
        names = sorted(t.display_name for t in stack.tables if id(t) in apart)
        live = stack.live_traces()
        moves = slots.get(id(stack)) or []
        old = ([shard.inner for shard in stack.shards if shard.inner is not None]
               if live or moves else [])
        members = list(stack.tables)
        rows = {id(t): list(zip(t.row_offsets, t.shard_counts)) for t in members}
        with tf.init_scope():
            stack.owner().separate(stack, lambda t: ("alone", id(t)) if id(t) in apart
                                   else "other", why_alone=why, released=True)
            if old:
                for table in members:  # The rows copied before the old variables go.
                    table.stack.materialize()
                old += slot_split.move(moves, members, rows)  # Each slot's rows too.
            if live or any(m.lists is not None for m in moves):
                # (A Keras optimizer's old slots stay in its lists: emptied.)
                retire(old, live, (
                    f"it was traced before tables {', '.join(names)} were split apart "
                    f"({why}), and it reads their old storage, which was freed"))
        stack.fallbacks["split"] = f"tables {', '.join(names)} split out, each alone ({why})"
    return None


def is_stack_shard(variable) -> bool:
    """Whether `variable` is a stack's shard (what one apply per stack updates)."""
    return isinstance(variable, StackShard)


class TableStacks:
    """The stacks of one strategy, by (row width, dtype, shard count).

    Args:
        shard_devices: Maps a shard index to its PS device.
    """

    def __init__(self, shard_devices: Callable[[int], str],
                 on_restack: Callable[["StackedTable", str, str], None] = (
                     lambda table, name, why: None)):
        self._device_of = shard_devices
        self._on_restack = on_restack
        self._open: Dict[tuple, "weakref.ref[Stack]"] = {}
        self._all: List["weakref.ref[Stack]"] = []
        self._count = 0

    def eligible(self, shape: tf.TensorShape, dtype: tf.DType, num_shards: int,
                 kwargs: dict) -> bool:
        """Whether a table with these creation arguments is stacked (see the module doc)."""
        return self.why_not(shape, dtype, num_shards, kwargs) is None

    def why_not(self, shape: tf.TensorShape, dtype: tf.DType, num_shards: int,
                kwargs: dict) -> Optional[str]:
        """Why a table with these creation arguments is not stacked, or None if it is.

        The placement report shows the reason beside the table.
        """
        if _UNSTACKED.active():
            return "its layer addresses its own rows (DynamicEmbedding)"
        if not tf.executing_eagerly():
            return "made in graph mode"
        if num_shards < 2:
            return "one shard"
        if shape.rank != 2 or not shape.is_fully_defined() or not dtype.is_floating:
            return "not a 2-D float table of known shape"
        if not kwargs.get("trainable", True):
            return "not trainable"
        if kwargs.get("constraint") is not None:
            return "has a constraint (applied to the whole variable)"
        sync = kwargs.get("synchronization", tf.VariableSynchronization.AUTO)
        aggregation = kwargs.get("aggregation", tf.VariableAggregation.NONE)
        if sync not in (tf.VariableSynchronization.AUTO, tf.VariableSynchronization.ON_WRITE):
            return f"synchronization {sync.name}"
        if aggregation not in (tf.VariableAggregation.NONE, None):
            return f"aggregation {aggregation.name}"
        if shape.num_elements() * dtype.size > MAX_TABLE_BYTES:
            return (f"larger than {MAX_TABLE_BYTES >> 20} MiB "
                    "(its own ops are a small part of its cost)")
        return None

    def add(self, name: str, shape: tf.TensorShape, dtype: tf.DType, num_shards: int,
            shard_values: Callable[[int], Callable[[], tf.Tensor]],
            creator: Callable[..., tf.Variable],
            on_replace: Callable[[tf.Variable, tf.Variable], None] = lambda old, new: None,
            ) -> StackedTable:
        """Puts a new table in its group's open stack; returns its `StackedTable`.

        Args:
            name: The table's name.
            shape: Its logical shape ``[V, D]``.
            dtype: Its dtype.
            num_shards: PS shards (>= 2).
            shard_values: ``shard_values(s)()`` is shard ``s``'s initial rows
                (interleaved: logical rows ``s, s + n, ...``).
            creator: Creates a stack's shard variable from `tf.Variable` keyword
                arguments (``name``, ``shape``, ``initial_value``), when the
                stack is materialized (if this table starts a stack).
            on_replace: Called with (old or None, new) variable of a shard
                when the stack is materialized (the old one is then freed).
        """
        width = int(shape[1])
        key = (width, dtype.name, num_shards)
        stack = self._open[key]() if key in self._open else None
        table_bytes = shape.num_elements() * dtype.size
        if stack is not None and (stack.sealed or stack.traced
                                  or stack.num_bytes + table_bytes > MAX_STACK_BYTES):
            # (Traced: a function holds its variables, which a join would replace.)
            stack = None
        if stack is None:
            name_ = f"stacked_tables_{width}_{dtype.name}_{self._count}"
            self._count += 1
            stack = Stack(name_, num_shards, width, dtype, self._device_of, creator, on_replace)
            stack.owner = weakref.ref(self)
            # Weak: a stack lives as long as a table in it (tables hold it).
            self._open[key] = weakref.ref(stack)
            self._all.append(weakref.ref(stack))
        offsets = stack.append(shard_values,
                               shard_rows(int(shape[0]), num_shards, SHARDING_INTERLEAVED))
        table = StackedTable(stack.shards, offsets, int(shape[0]), name=name, stack=stack)
        stack.tables.add(table)
        stack.pending_tables.append(weakref.ref(table))
        return table

    def separate(self, stack: Stack, group_of: Callable[["StackedTable"], object],
                 why_alone: str = "", released: bool = False) -> None:
        """Splits a stack no traced function uses yet into one stack per group of its tables.

        `group_of(table)` names each table's group; the first group stays in
        `stack`. If the stack's variables exist (an eager read or a restore
        made them), each table's rows are read out of them and the variables
        are made anew per group, else only the pending rows move. Every
        moved table is re-pointed at its new stack's shards. Nothing happens
        once a slot exists or a traced function used the stack
        (`separate_by_model` runs this when a model starts a traced call).
        A table left alone in a stack by a split for `why_alone` is reported
        as not stacked, for that reason. `released`: the caller found that
        nothing holds the stack any more (`Stack.held_by`, `split_apart`).
        """
        if released:
            stack.release()
        if stack.sealed or stack.traced:
            return  # Slots exist, or a traced function holds its variables.
        n = len(stack.shards)
        if stack.never_made():
            members = [(ref(), [stack.pending[s][k] for s in range(n)])
                       for k, ref in enumerate(stack.pending_tables)]
            dead = any(t is None for t, _ in members)
            members = [(t, pieces) for t, pieces in members if t is not None]
        else:
            # Made (an eager read, a restore), but no function holds it: each
            # table's current rows are read out, and the old variables freed.
            members = [(t, None) for t in sorted(stack.tables, key=lambda t: t.row_offsets)]
            dead = False
        groups: Dict[object, list] = {}
        for table, pieces in members:
            groups.setdefault(group_of(table), []).append((table, pieces))
        if len(groups) < 2 and not dead:
            key = next(iter(groups), None)
            if why_alone and len(members) == 1 and isinstance(key, tuple) and key[0] == "alone":
                self._on_restack(members[0][0], "", why_alone)
            return
        if not stack.never_made():
            stack.materialize()  # Tables appended since: their rows into the variables.
            # pylint: disable-next=protected-access
            members = [(t, [current_rows(stack.shards[s].inner, t, s) for s in range(n)])
                       for t, _ in members]
            groups = {}
            for table, pieces in members:
                groups.setdefault(group_of(table), []).append((table, pieces))
            for shard in stack.shards:
                stack.on_replace(shard.inner, None)
                shard.replace_inner(None)
        for i, (key, items) in enumerate(groups.items()):
            alone = isinstance(key, tuple) and key[0] == "alone"
            if i == 0:
                target = stack
            else:
                target = stack.like(f"stacked_tables_{stack.width}_{stack.dtype.name}_"
                                    f"{self._count}")
                self._count += 1
                self._all.append(weakref.ref(target))
            target.rows = [0] * len(target.shards)
            target.pending = [[] for _ in target.shards]
            target.pending_tables = []
            for table, pieces in items:
                offsets = list(target.rows)
                for s, piece in enumerate(pieces):
                    target.pending[s].append(piece)
                    target.rows[s] += table.shard_counts[s]
                target.pending_tables.append(weakref.ref(table))
                if target is not stack:
                    stack.tables.discard(table)
                table.rebind(target, offsets)
                if why_alone and alone:
                    self._on_restack(table, "", why_alone)
                else:
                    self._on_restack(table, target.name, "")

    def stack_of(self, var) -> Optional[Stack]:
        """The stack whose shard `var` is (the wrapper, its variable or a view), or None."""
        if isinstance(var, TableView):
            var = var.stack_shard
        for stack in self.stacks():
            for shard in stack.shards:
                if var is shard or var is shard.inner:
                    return stack
        return None

    def seal(self, var, slot=None) -> None:
        """No table joins the stack of shard `var` any more (its slots exist).

        Args:
            var: A stack's shard (or its variable, or a view).
            slot: The optimizer's slot just made for it: the stack is not
                split while it lives (`Stack.held_by`).
        """
        stack = self.stack_of(var)
        if stack is not None:
            if slot is None:
                stack.sealed = True
            else:
                if isinstance(var, TableView):
                    var = var.stack_shard
                index = next((s for s, shard in enumerate(stack.shards)
                              if var is shard or var is shard.inner), None)
                stack.record_slot(slot, index)

    def fallbacks(self) -> List[tuple]:
        """(stack name, text) of every fallback a stack took, for the placement report.

        Set where the fallback is decided (`stacked_updates`: rows kept,
        applied per table; `split_apart`: tables split out).
        """
        return [(stack.name, text) for stack in self.stacks()
                for _, text in sorted(stack.fallbacks.items())]

    def stacks(self) -> List[Stack]:
        """Every stack that still has a table, in creation order."""
        return [s for s in (ref() for ref in self._all) if s is not None]
