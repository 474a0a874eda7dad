"""A stack's storage: the one variable per PS that holds the rows of its tables.

Why this module exists: stacked tables (`stacking`) share storage that is
made once, when first needed, of the full size, and remade bigger or split
when tables join or leave. `Stack` holds a group's rows (pending initial
rows, then one variable per PS) and `StackShard` is what the tables' shard
lists hold on each PS: TF's forwarding variable, answering what Keras asks
while a model is built without the variable, and making it on first use.

Private TF API: a stack shard is a `ps_values.AggregatingVariable` (TF's
forwarding variable, which stock PSS wraps PS variables in) whose inner
variable (`_v`, and the inner's `_aggregating_container`) is set when the
stack is materialized, and which answers `_get_save_slice_info` for
`ShardedVariable`; there is no public variable whose storage is made
later or replaced.
"""

import functools
import itertools
import weakref
from typing import Callable, Dict, List, Optional, Sequence

import tensorflow as tf

from tf_psplugin._internal import tf_objects
from tf_psplugin._internal.tf_internal import ps_values
from tf_psplugin.sync import outside_writes
from tf_psplugin.tables import shard_init

__all__ = ["Stack", "StackShard", "TableSet", "canonical_device", "current_rows",
           "handle_retired_because", "recorded_since", "retire", "retired_because", "retirements",
           "trace_mark"]


class TableSet:
    """The live tables of a stack, by identity (a WeakSet would compare tables with ==)."""

    def __init__(self):
        self._refs: Dict[int, "weakref.ref"] = {}

    def add(self, table) -> None:
        self._refs[id(table)] = weakref.ref(table, lambda _, key=id(table): self._refs.pop(key,
                                                                                         None))

    def discard(self, table) -> None:
        self._refs.pop(id(table), None)

    def __iter__(self):
        return iter([t for t in (ref() for ref in list(self._refs.values())) if t is not None])


# Numbers the traces that read a stack, in order, across stacks (`trace_mark`).
_TRACE_MARKS = itertools.count(1)
# The number of the newest trace recorded by any stack (`recorded_since`).
_NEWEST = {"mark": 0}


def trace_mark() -> int:
    """A mark: traces recorded after it are newer (`Stack.drop_traces_since`)."""
    return next(_TRACE_MARKS)


def recorded_since(mark: int) -> bool:
    """Whether any stack recorded a new trace after `mark` (`trace_mark`).

    The coordinator links a dispatch's traced functions to the stacks they
    read only when its call traced something (a cached trace was linked
    when it was made).
    """
    return _NEWEST["mark"] > mark


# id(graph) -> (weak ref of a traced graph whose stack storage was retired,
# why): it reads variables that were freed when its stack was split apart.
_RETIRED: Dict[int, tuple] = {}
_RETIREMENTS = {"count": 0}
# id(handle) -> (the handle of a retired variable, why) (held: an old trace
# holds it anyway, and it names no memory once emptied): `handle_retired_because`.
_RETIRED_HANDLES: Dict[int, tuple] = {}


def retirements() -> int:
    """How many times old stack storage was emptied (`retire`) in this process.

    A cache of traced functions that read tables and are not run through
    the coordinator (the checkpoint's traced write) keys on it: it traces
    anew after a split instead of reading the emptied storage.
    """
    return _RETIREMENTS["count"]


def retire(variables: Sequence[tf.Variable], graphs: Sequence[object], why: str) -> None:
    """Empties a split stack's old shard variables that live traced functions still read.

    A stack read by a traced function that Keras keeps after `compile` (its
    first fit's) is split all the same (`stacking.split_apart`): its
    tables' rows were copied into new stacks. The old variables live on in
    the old traces (a captured handle holds its resource), which could then
    train rows no table reads any more. Each is given zero rows instead (an
    assignment that does not validate the shape): its memory on the PS is
    freed, and any op of an old trace fails (a gather or scatter of a row
    out of ``[0, 0)``, an apply of mismatched shapes) before it writes
    anything. Nothing runs those traces: the coordinator traces a
    scheduled function that kept one anew (`stacked_fallback`), and so
    does a call of a `tf.function` outside it (`stacked_fallback.
    before_call`), or refuses it, naming why (`retired_because`), as it
    refuses a `ConcreteFunction` called by hand.

    Args:
        variables: The old shard variables (the caller copied their rows).
        graphs: The traced graphs that read them and still live.
        why: What the coordinator's error says.
    """
    _RETIREMENTS["count"] += 1
    for variable in variables:
        _RETIRED_HANDLES[id(variable.handle)] = (variable.handle, why)
    for graph in graphs:
        _RETIRED[id(graph)] = (weakref.ref(graph), why)
    for variable in variables:
        with tf.device(variable.device):
            # Public raw op: no variable API changes a variable's shape, and
            # destroying it does nothing while a trace holds its handle.
            tf.raw_ops.AssignVariableOp(
                resource=variable.handle, validate_shape=False,
                value=tf.zeros([0] + variable.shape.as_list()[1:], variable.dtype))


def handle_retired_because(handle) -> Optional[str]:
    """Why `handle` (a resource a trace captured) must not be read (a retired variable's), or None."""
    entry = _RETIRED_HANDLES.get(id(handle))
    return entry[1] if entry is not None and entry[0] is handle else None


def retired_because(concrete) -> Optional[str]:
    """Why `concrete` (a traced function) must not run: it reads a split stack's old storage."""
    graph = getattr(concrete, "graph", None)
    entry = _RETIRED.get(id(graph)) if graph is not None else None
    if entry is None:
        return None
    if entry[0]() is not graph:  # Gone, and the id reused.
        _RETIRED.pop(id(graph), None)
        return None
    return entry[1]


class Stack:
    """The shard variables of one stack and the tables in it.

    A table that joins does not copy the stack: each shard keeps the initial
    rows of the tables appended since it was last materialized (tensors on
    its PS) and makes its variable, of the full known shape, from all of
    them at once when anything first needs it (a lookup, a read, a slot, a
    checkpoint). Building a model of 26 tables thus writes each shard once,
    not once per table (appending by copying grew each PS's peak RSS by
    0.55 GB on the 26-table benchmark model). A table that joins after that
    costs one copy of the shard.
    """

    def __init__(self, name: str, num_shards: int, width: int, dtype: tf.DType,
                 device_of: Callable[[int], Optional[str]], creator,
                 on_replace: Callable[[Optional[tf.Variable], tf.Variable], None]):
        self.name = name
        self.width = width
        self.dtype = dtype
        self.rows = [0] * num_shards
        self.pending: List[list] = [[] for _ in range(num_shards)]
        self.shards = [StackShard(self, s, device_of(s)) for s in range(num_shards)]
        for shard in self.shards:
            # A view's write scatters through its shard's own methods (into
            # the inner handle): numbered there, as a write outside a step.
            outside_writes.watch(shard)
        self._creator = creator
        self.on_replace = on_replace
        self.sealed = False
        self.traced = False  # A traced function has used its variables (set by its shards).
        # Who holds the variables: the outermost graph of each trace that read
        # them (a weak reference; None for a graph that is not a FuncGraph,
        # held for good) and each slot made for a shard (`TableStacks.seal`).
        self._traces: Dict[int, tuple] = {}  # id(graph) -> (its weak ref or None, mark).
        self._functions: Dict[int, "weakref.ref"] = {}  # id(graph) -> its ConcreteFunction.
        self._slots: List["weakref.ref"] = []
        self._slot_shards: Dict[int, int] = {}  # id(slot) -> the index of its shard, if known.
        # What the placement report says of this stack's fallbacks (`note_fallback`).
        self.fallbacks: Dict[str, str] = {}
        self.materializations = 0
        self.tables = TableSet()
        # The tables whose rows are in `pending`, in order (one piece each per shard).
        self.pending_tables: List["weakref.ref"] = []
        self.owner: Optional["weakref.ref"] = None  # Set by TableStacks.

    def record_trace(self) -> None:
        """Records the graph being traced as one that holds the variables (`StackShard._v`)."""
        self.traced = True
        graph = tf.compat.v1.get_default_graph()
        function = getattr(graph, "building_function", False)  # A tf.function's graph.
        while function and getattr(getattr(graph, "outer_graph", None), "building_function",
                                   False):
            graph = graph.outer_graph
        ref = self._traces.get(id(graph), (False, 0))[0]
        if ref is False or (ref is not None and ref() is not graph):  # New (or an id reused).
            mark = next(_TRACE_MARKS)
            self._traces[id(graph)] = (weakref.ref(graph) if function else None, mark)
            self._functions.pop(id(graph), None)
            _NEWEST["mark"] = max(_NEWEST["mark"], mark)

    def traced_as(self, concrete) -> None:
        """Records that the trace of `concrete`'s graph, if it read the stack, lives as `concrete`.

        A traced graph can outlive its function (one whose trace failed was
        seen still referenced after garbage collection): whether the function
        is alive is what tells whether anything can still run on the stack's
        variables.
        """
        graph = getattr(concrete, "graph", None)
        entry = self._traces.get(id(graph)) if graph is not None else None
        if entry is not None and (entry[0] is None or entry[0]() is graph):
            self._functions[id(graph)] = weakref.ref(concrete)

    def drop_traces_since(self, mark: int) -> None:
        """Forgets the traces recorded after `mark` (`trace_mark`): they failed and were dropped."""
        dropped = False
        for key, (_, seq) in list(self._traces.items()):
            if seq > mark:
                del self._traces[key]
                self._functions.pop(key, None)
                dropped = True
        if dropped and not self._traces:
            self.traced = False  # Only the failed trace had read it.

    def record_slot(self, slot, index: Optional[int] = None) -> None:
        """Records an optimizer's slot of a shard (number `index`): it holds the row layout."""
        self.sealed = True
        if index is not None:
            self._slot_shards[id(slot)] = index
        try:
            self._slots.append(weakref.ref(slot))
        except TypeError:  # Not weakly referable: held for good.
            self._slots.append(lambda slot=slot: slot)

    def held_by(self) -> Optional[str]:
        """What still holds this stack's variables or row layout, or None.

        A traced function that read them (its `ConcreteFunction` alive, if
        known: `traced_as`; else its graph), or an optimizer's slot of a
        shard. A trace that failed is forgotten (`drop_traces_since`); the
        caller collects garbage first.
        """
        if self.traced and not self._traces:
            return "a traced function uses its variables"  # Marked so without a record.
        if self.live_traces():
            return "a traced function that is still alive uses its variables"
        return self.slots_held_by()

    def live_traces(self) -> List[object]:
        """The traced graphs that read the variables and still live (see `held_by`).

        A graph that is not a `FuncGraph` (held for good) is not listed.
        """
        live = []
        for key, (ref, _) in self._traces.items():
            function = self._functions.get(key)
            alive = function() is not None if function is not None else (
                ref is None or ref() is not None)
            graph = ref() if ref is not None else None
            if alive and graph is not None:
                live.append(graph)
        return live

    def traced_for_good(self) -> bool:
        """Whether a graph that is not a tf.function's (it lives for good) read the variables."""
        return (self.traced and not self._traces) or any(
            ref is None for ref, _ in self._traces.values())

    def slots_held_by(self) -> Optional[str]:
        """"an optimizer has slots for it" while an optimizer's slot of a shard lives, else None."""
        if any(ref() is not None for ref in self._slots):
            return "an optimizer has slots for it"
        if self.sealed and not self._slots:
            return "an optimizer has slots for it"
        return None

    def live_slots(self) -> Optional[List[tuple]]:
        """(slot, shard index) of every live slot recorded, or None if one's shard is unknown."""
        live = [slot for slot in (ref() for ref in self._slots) if slot is not None]
        if self.sealed and not self._slots:
            return None  # Sealed without a slot's record (`TableStacks.seal`).
        if any(id(slot) not in self._slot_shards for slot in live):
            return None
        return [(slot, self._slot_shards[id(slot)]) for slot in live]

    def release(self) -> None:
        """Forgets the traces and slots that held the stack (`held_by` found none alive)."""
        self._traces.clear()
        self._functions.clear()
        self._slots.clear()
        self._slot_shards.clear()
        self.traced = False
        self.sealed = False

    @property
    def num_bytes(self) -> int:
        return sum(self.rows) * self.width * self.dtype.size

    def append(self, shard_values: Callable[[int], Callable[[], tf.Tensor]],
               counts: Sequence[int]) -> List[int]:
        """Computes a table's initial rows on each PS; returns where they start in the stack.

        The rows are computed now, so that an initializer draws the same
        values as for an unstacked table (Keras's unseeded initializers
        follow the global seed in creation order); they join the stack's
        variables when it is materialized.
        """
        offsets = list(self.rows)
        for s, count in enumerate(counts):
            with tf.device(self.shards[s].device or None):
                rows = shard_init.compute_rows(shard_values(s), [count, self.width],
                                               self.dtype)
            self.pending[s].append(rows)
            self.rows[s] += int(count)
        return offsets

    def materialize(self) -> None:
        """Makes each shard's variable hold every row appended so far (one allocation)."""
        if not any(self.pending):
            return
        with tf.init_scope():  # Also when first needed while a step is traced.
            for s, shard in enumerate(self.shards):
                if not self.pending[s]:
                    continue
                old = shard.inner
                pieces = list(self.pending[s])
                with tf.device(shard.device or None):
                    new = self._creator(
                        name=f"{self.name}/part_{s}", shape=[self.rows[s], self.width],
                        initial_value=functools.partial(_rows_of, old, pieces, self.dtype))
                shard.replace_inner(new)
                tf_objects.set_aggregating_container(new, shard)
                self.pending[s] = []
                self.on_replace(old, new)
        self.pending_tables = []
        self.materializations += 1

    def never_made(self) -> bool:
        """Whether no shard has its variable yet (nothing can have read the stack)."""
        return all(shard.inner is None for shard in self.shards)

    def like(self, name: str) -> "Stack":
        """A new, empty stack of the same row width, dtype, shards and creator."""
        stack = Stack(name, len(self.shards), self.width, self.dtype, lambda s: None,
                       self._creator, self.on_replace)
        for mine, theirs in zip(stack.shards, self.shards):
            mine.place_like(theirs)
            tf_objects.set_variable_distribute_strategy(
                mine, tf_objects.variable_distribute_strategy(theirs))
        stack.owner = self.owner
        return stack


def current_rows(variable, table, s: int) -> tf.Tensor:
    """`table`'s rows of stack shard `s`, read from the shard's `variable` (on its PS)."""
    start = table.row_offsets[s]
    count = table.shard_counts[s]
    with tf.device(variable.device):
        return tf.identity(variable.sparse_read(tf.range(start, start + count, dtype=tf.int64)))


def _rows_of(old: Optional[tf.Variable], pieces, dtype) -> tf.Tensor:
    parts = [old.read_value()] if old is not None else []
    parts += [tf.cast(piece, dtype) for piece in pieces]
    return parts[0] if len(parts) == 1 else tf.concat(parts, axis=0)


class StackShard(ps_values.AggregatingVariable):
    """A stack's shard on one PS: forwards to the variable that holds its rows.

    `AggregatingVariable` is TF's own forwarding variable (stock PSS wraps PS
    variables in it); Keras, the tape and the optimizers use its inner
    variable's handle. The inner variable is made, or remade bigger, by the
    stack (`Stack.materialize`) when first needed; what Keras and
    `ShardedVariable` ask while a model is built (shape, dtype, device,
    name, trainable) is answered without it. Its strategy is the one whose
    scope made it, as Keras checks before it makes slots; None outside any
    (a plain variable's, e.g. in one process), where assignments go
    straight to the variable.
    """

    # pylint: disable=super-init-not-called
    def __init__(self, stack: Stack, index: int, device: Optional[str]):
        # Not AggregatingVariable.__init__: there is no inner variable yet.
        self._distribute_strategy = (tf.distribute.get_strategy()
                                     if tf.distribute.has_strategy() else None)
        # NONE: cross-replica writes go through the strategy's `update`.
        self._aggregation = tf.VariableAggregation.NONE
        self._stack = stack
        self._index = index
        self._inner: Optional[tf.Variable] = None
        self._device = canonical_device(device)

    @property
    def _v(self):
        if self._inner is None or self._stack.pending[self._index]:
            self._stack.materialize()
        if not tf.executing_eagerly():
            # A traced function may now hold this variable: the stack is
            # split only once that function is gone (`Stack.held_by`).
            self._stack.record_trace()
        return self._inner

    @property
    def shape(self):
        return tf.TensorShape([self._stack.rows[self._index], self._stack.width])

    @property
    def dtype(self):
        return self._stack.dtype

    @property
    def device(self):
        return self._inner.device if self._inner is not None else self._device

    @property
    def name(self):
        return f"{self._stack.name}/part_{self._index}:0"

    @property
    def trainable(self):
        return True

    @property
    def synchronization(self):
        return tf.VariableSynchronization.AUTO

    @property
    def inner(self) -> Optional[tf.Variable]:
        """The variable holding the rows, or None before the stack is first made."""
        return self._inner

    def replace_inner(self, variable: Optional[tf.Variable]) -> None:
        """Makes `variable` hold this shard's rows (None: not made; the stack's own call)."""
        self._inner = variable

    @property
    def planned_device(self) -> str:
        """The device this shard was made for (its variable's, once made, may differ in form)."""
        return self._device

    def place_like(self, other: "StackShard") -> None:
        """Puts this (not yet made) shard on the device `other` was planned for."""
        self._device = other.planned_device

    def _get_save_slice_info(self):
        return None  # ShardedVariable asks; the stack's tables save themselves.

    def _assign_func(self, *args, **kwargs):
        if self._distribute_strategy is None:
            f = kwargs.pop("f")
            return f(self._v, *args, **kwargs)
        return super()._assign_func(*args, **kwargs)


def canonical_device(device: Optional[str]) -> str:
    """``/job:ps/task:0/device:CPU:0`` as a variable reports it (with ``/replica:0``)."""
    if not device:
        return ""
    spec = tf.DeviceSpec.from_string(device)
    if spec.job and spec.replica is None:
        spec = spec.replace(replica=0)
    return spec.to_string()
