"""The fallbacks of one apply per stack shard: rows written back, views applied on their own.

Why this module exists: `stacked_updates` merges the views' gradients of a
stack shard into one apply where that equals per-table applies. Where it
does not, the stack still trains exactly as unstacked tables would, in one
of two ways, decided by `stacked_updates.merge` and carried out here, in
the optimizer's own update of the stack shard:

* **Rows written back** (`keep_rows`): an optimizer whose update is
  elementwise but moves every row of what it applies to (Keras's and
  legacy Adam: the moment decay) applied to a stack some of whose tables
  get no gradient (frozen after the stack was traced, another model's).
  The rows of those tables, in the stack shard and in each of its slots,
  are read before the update and written back after it, on the shard's PS
  and in the update's own trace: Keras leaves a variable without a
  gradient untouched, and so does this, bit for bit. The optimizer's
  distributed apply is given a strategy whose `update` wraps the shard's
  update function so (`keeping`).
* **Tables split apart, the step traced again** (`trace_splitting`): a
  legacy optimizer not known to update a stack elementwise applies through
  the variable's handle, a view's being the whole stack shard's; its tables
  get a stack each when the step's first trace meets them
  (`SplitRequired`), and the step is traced again. A function traced
  before (a step of the user's, the first fit's) reads the old storage,
  which is emptied (`stack_storage.retire`): scheduled again, it is traced
  anew on the new stacks, or refused if that would change what it runs
  (the model was compiled with another optimizer since). Called outside
  the coordinator (a user's serving function, Keras's `predict_function`),
  it is traced anew before the call (`before_call`, from the
  "retrace_after_split" patch installed at the first such split), or
  refused the same way; the functions Keras keeps on a model that read
  the old storage are dropped at the split (`drop_stale_keras_functions`).
* **Views applied on their own** (`applying_per_table`): a Keras
  (non-legacy) optimizer not known to update a stack as it updates each
  table gets each view with its own gradient; the strategy's update of a
  view is allowed while this scope is open (`runtime/updates.py`), and the
  optimizer's `update_step` writes the view's rows through its methods,
  with Keras's own slots per view.
"""

import threading
from typing import Callable, Optional, Sequence, Tuple

from absl import logging
import tensorflow as tf

from tf_psplugin._internal import patches
from tf_psplugin._internal import tf_objects
from tf_psplugin._internal.compat import keras
from tf_psplugin._internal.identity import IdentityMap
from tf_psplugin._internal.scopes import ThreadScope
from tf_psplugin._internal.tf_internal import ps_values
from tf_psplugin.errors import StackingError
from tf_psplugin.tables import slot_split
from tf_psplugin.tables import stack_storage
from tf_psplugin.tables import stacking

__all__ = ["SplitRequired", "applying_per_table", "applying_per_table_scope", "before_call",
           "before_concrete_call", "drop_stale_keras_functions", "keep_rows", "keeping", "kept_rows",
           "patch_retrace_after_split", "record_slot", "set_kept_rows", "take_split_request",
           "trace_splitting"]


# Stack shard -> [(first row, row count)]: the rows its next optimizer apply
# must leave as they are (set by `merge`, for the apply of the gradient it
# merged; `keep_rows` reads it there). The entry dies with the shard.
_KEEP_ROWS: IdentityMap = IdentityMap()


def set_kept_rows(shard, rows: Sequence[Tuple[int, int]]) -> None:
    """Sets the rows the next apply to stack `shard` keeps (none: its plain apply)."""
    if rows:
        _KEEP_ROWS[shard] = list(rows)
    else:
        _KEEP_ROWS.pop(shard, None)


def kept_rows(shard) -> list:
    """(first row, row count) ranges the next apply to stack `shard` keeps (set by `merge`)."""
    return list(_KEEP_ROWS.get(shard) or [])


def _storage(variable):
    """The plain variable under TF's PS wrappers (`AggregatingVariable`s)."""
    while isinstance(variable, ps_values.AggregatingVariable):
        variable = variable.get()
    return variable


def record_slot(optimizer, model_variable, slot) -> None:
    """Records `slot`, made by a new optimizer for `model_variable`, if that is a stack shard.

    Recorded as Keras makes it (`add_variable_from_reference`), since a
    stack shard's slots are listed nowhere (`slot_split.record_keras_slot`:
    a split moves them too).
    """
    if stacking.is_stack_shard(model_variable):
        slot_split.record_keras_slot(optimizer, model_variable, slot)


def _slots_of(optimizer, shard) -> list:
    """The optimizer's slot variables of stack `shard` (its rows, as the shard's)."""
    legacy = getattr(keras.optimizers.legacy, "Optimizer", None)
    if legacy is not None and isinstance(optimizer, legacy):
        slots = []
        for slot_name in optimizer.get_slot_names():
            try:
                slots.append(optimizer.get_slot(shard, slot_name))
            except KeyError:
                continue
    else:
        slots = slot_split.keras_slots_of(optimizer, shard)
    rows = shard.shape[:1]
    return [s for s in slots if s.shape.rank and s.shape[:1] == rows]


def keep_rows(optimizer, shard, fn, rows: Sequence[Tuple[int, int]]):
    """`fn` (an optimizer's update of stack `shard`) that leaves `rows` as they were.

    The fallback of a stack some of whose tables get no gradient, for an
    optimizer whose apply moves every row (Adam): the rows of those tables
    in the stack shard and in each of its slots are read before the update
    and written back after it, on the shard's PS, in the update's own trace.

    Args:
        optimizer: The optimizer applying (its slots of `shard`).
        shard: The stack shard.
        fn: The update, called as ``fn(var, *args, **kwargs)``.
        rows: (first row, row count) ranges of the stack shard to keep.

    Returns:
        The update function to give the strategy's `update` instead.
    """
    targets = [shard] + _slots_of(optimizer, shard)

    def update(var, *args, **kwargs):
        indices = tf.concat([tf.range(start, start + count, dtype=tf.int64)
                             for start, count in rows], axis=0)
        variables = [_storage(t) for t in targets]
        saved = [v.sparse_read(indices) for v in variables]
        eager = tf.executing_eagerly()
        graph = None if eager else tf.compat.v1.get_default_graph()
        first = 0 if eager else len(graph.get_operations())
        with tf.control_dependencies(saved):
            result = fn(var, *args, **kwargs)
        # After every write of the update (ops without outputs: assigns,
        # scatters, resource applies) and its result.
        writes = [] if eager else [op for op in graph.get_operations()[first:]
                                   if not op.outputs]
        done = [r for r in tf.nest.flatten(result) if r is not None]
        with tf.control_dependencies(writes + done):
            restored = [v.scatter_update(tf.IndexedSlices(s, indices))
                        for v, s in zip(variables, saved)]
        if result is None or eager:
            return result
        with tf.control_dependencies(
                [r.op if hasattr(r, "op") else r for r in restored if r is not None]):
            return tf.group(*done)

    return update


_PER_TABLE_APPLY = ThreadScope()


def applying_per_table_scope():
    """A context manager: the optimizer's apply made inside applies views one by one."""
    return _PER_TABLE_APPLY.scope()


def applying_per_table() -> bool:
    """Whether an optimizer's apply of views one by one is being made (see `stacked_updates.merge`).

    The strategy's update of a view with a gradient is allowed then only:
    a Keras (non-legacy) optimizer's `update_step` writes the view through
    its methods (scatters into its rows of the stack shard), with the view's
    own slots.
    """
    return _PER_TABLE_APPLY.active()


class _KeepingExtended:
    """A strategy's `extended` whose `update` of a stack shard keeps the rows `merge` recorded."""

    def __init__(self, extended, optimizer):
        self._extended = extended
        self._optimizer = optimizer

    def update(self, var, fn, args=(), kwargs=None, group=True):
        rows = kept_rows(var)
        if rows:
            fn = keep_rows(self._optimizer, var, fn, rows)
        return self._extended.update(var, fn, args=args, kwargs=kwargs, group=group)

    def __getattr__(self, name):
        return getattr(self._extended, name)


class _KeepingStrategy:
    """A strategy as the optimizer's distributed apply sees it, with `_KeepingExtended`."""

    def __init__(self, distribution, optimizer):
        self._distribution = distribution
        self.extended = _KeepingExtended(distribution.extended, optimizer)

    def __getattr__(self, name):
        return getattr(self._distribution, name)


def keeping(distribution, optimizer, grads_and_vars):
    """`distribution`, or its `_KeepingStrategy` if a variable's apply must keep rows."""
    if any(kept_rows(var) for _, var in grads_and_vars):
        return _KeepingStrategy(distribution, optimizer)
    return distribution


class SplitRequired(StackingError):
    """A legacy optimizer not known to update a stack elementwise met a shared stack.

    Its kernels apply through the variable's handle, and a view's handle is
    the whole stack shard's: its apply to a table is exact only if the table
    is alone in its stack. Raised while a step is traced (before any slot
    of it is made); the coordinator catches it, splits the tables apart
    and traces the step again (`trace_splitting`). Anywhere else (a
    `tf.function` called without the coordinator, or a stack a live
    optimizer has slots for that a split cannot move: `slot_split`) it is
    the error the user sees, naming the fix.

    Attributes:
        tables: The tables the optimizer applies that share a stack.
        why: Why they need storage of their own (for the placement report).
    """

    def __init__(self, name: str, tables, known: Sequence[str]):
        self.tables = list({id(t): t for t in tables}.values())
        self.why = (f"{name} (legacy) is not known to update a stack elementwise; "
                    "its kernels apply through the whole stack's handle")
        shown = ", ".join(sorted(t.display_name for t in self.tables))
        super().__init__(
            f"stack_tables=True: tables {shown} share a stack, and {self.why}. Outside "
            "ClusterCoordinator.schedule (which splits them apart before the first step and "
            "traces the step again), or while an optimizer that is still alive has slots "
            "for the stack that a split cannot move (a Keras optimizer outside the known "
            "ones), they cannot be split. Fix: "
            "HybridParameterServerStrategy(options=HybridOptions(stack_tables=False)), "
            "or compile the model with "
            f"this optimizer before its first call (its tables are then stacked apart), or "
            f"one of {', '.join(sorted(set(known)))} of tf.keras.optimizers or "
            ".legacy, or a subclass of tf.keras.optimizers.Optimizer (not .legacy).")
        # Autograph re-raises an error raised in a traced function as its own
        # `StagingError` (the message kept, not this object): the request is
        # also left here for the coordinator (`take_split_request`).
        with _SPLIT_LOCK:
            _SPLIT_REQUEST["value"] = (self.tables, self.why, str(self))


# The last `SplitRequired`'s (tables, why, message), until taken. Not per
# thread: a step's replica function runs in a thread of its own
# (`mirrored_run`), not the one tracing the step.
_SPLIT_REQUEST = {}
_SPLIT_LOCK = threading.Lock()


def take_split_request():
    """(tables, why, message) of the last `SplitRequired` raised, not yet taken.

    None if there is none.

    The coordinator's tracing clears it before a trace (a call) and takes it
    after a trace failed, whatever the error became on its way out
    (autograph's `StagingError`).
    """
    with _SPLIT_LOCK:
        return _SPLIT_REQUEST.pop("value", None)


def _name_of(function, concrete=None) -> str:
    return (getattr(function, "__name__", None) or getattr(concrete, "name", None)
            or "the function")


def _refuse_retired(concretes, function) -> None:
    """Raises if one of `concretes` reads a split stack's freed storage (`stack_storage.retire`)."""
    for concrete in concretes:
        why = stack_storage.retired_because(concrete)
        if why is not None:
            raise StackingError(
                f"stack_tables=True: {_name_of(function, concrete)!r} cannot run: {why}. Fix: "
                "trace it again (a new tf.function, or get_concrete_function called again; "
                "Keras makes one when the model is compiled again), or "
                "HybridParameterServerStrategy(options=HybridOptions(stack_tables=False)).")


# tf.function -> `stack_storage.retirements()` when its traces were last found
# to read no emptied storage (a trace made later reads live storage).
_CHECKED: IdentityMap = IdentityMap()
# tf.function -> why it is refused: traced again, it ran another program.
_REFUSED: IdentityMap = IdentityMap()


def _retrace_if_stale(function) -> list:
    """Drops `function`'s traces if one reads a split stack's emptied storage; returns those.

    The next call traces it anew, as a first call (`tf_objects.
    reset_traces`): its views now read the tables' new stacks. A concrete
    function cannot be traced again: it is refused, naming the fix. None is
    looked up again until the next split (`stack_storage.retirements`).
    """
    count = stack_storage.retirements()
    if not count:
        return []
    refused = _REFUSED.get(function)
    if refused is not None:
        raise StackingError(refused)
    if _CHECKED.get(function) == count:
        return []
    traces = tf_objects.traces_of_function(function)
    stale = [c for c in traces if stack_storage.retired_because(c) is not None]
    if stale and not tf_objects.reset_traces(function):
        _refuse_retired(stale, function)  # A concrete function.
    if not stale:
        _CHECKED[function] = count
    return stale


def _resources(concrete) -> list:
    """The resource handles (variables, tables) a trace captured by value."""
    graph = getattr(concrete, "graph", None)
    return [t for t in getattr(graph, "external_captures", None) or ()
            if getattr(t, "dtype", None) == tf.resource]


def _check_retrace(function, old: list, traced: list) -> None:
    """Refuses `function`, traced anew, if it would run another program or read old storage.

    Traced again, a function reads what its Python state names now: the
    same variables, but for the split stacks' storage (and slots), when
    only the stacks changed (a user's own step). A Keras train function
    whose model was compiled again since would run the new optimizer, not
    the one it ran before (and an unstacked run still runs): that is
    refused, naming why, and stays refused. So is a new trace that still
    captures emptied storage (a `tf.function` it calls, whose own trace
    was kept).

    Args:
        function: The function traced anew.
        old: Its traces that read emptied storage (dropped).
        traced: Its new traces (as far as the caller knows them).
    """
    new = {}
    for concrete in list(traced) + tf_objects.traces_of_function(function):
        new.update((id(t), t) for t in _resources(concrete))
    missing = {id(t) for concrete in old for t in _resources(concrete)
               if id(t) not in new and stack_storage.handle_retired_because(t) is None}
    still = [why for why in map(stack_storage.handle_retired_because, new.values())
             if why is not None]
    if not missing and not still:
        return
    name = _name_of(function, old[0])
    if still:
        message = (f"stack_tables=True: {name!r} cannot run: it calls a tf.function that "
                   f"still reads a split stack's old storage ({still[0]}). Fix: trace that "
                   "function again (a new tf.function), or "
                   "HybridParameterServerStrategy(options=HybridOptions(stack_tables=False)).")
    else:
        message = (
            f"stack_tables=True: {name!r} cannot run: "
            f"{stack_storage.retired_because(old[0])}; traced again, it no longer reads "
            f"{len(missing)} variable(s) its old trace read (an optimizer or model replaced "
            "since, e.g. by compiling the model again), so it would run another program than "
            "it ran before. Fix: trace it again (a new tf.function; Keras makes one when the "
            "model is compiled again), or "
            "HybridParameterServerStrategy(options=HybridOptions(stack_tables=False)).")
    _REFUSED[function] = message
    raise StackingError(message)


def _reads_retired(function) -> bool:
    """Whether a trace `function` keeps reads a split stack's emptied storage."""
    return any(stack_storage.retired_because(c) is not None
               for c in tf_objects.traces_of_function(function))


# What `compile` sets back to None (Keras 2.15, tf-keras 2.16-2.21: public attributes).
_KERAS_FUNCTIONS = ("train_function", "train_tf_function", "test_function", "predict_function")


def _tf_functions_in(value) -> list:
    """`value` if it is a tf.function, else the tf.functions its closure holds.

    Under a parameter-server strategy Keras keeps, as `train_function` and
    `test_function`, a lambda that schedules its tf.function.
    """
    if isinstance(value, tf.types.experimental.GenericFunction):
        return [value]
    found = []
    for cell in getattr(value, "__closure__", None) or ():
        try:
            contents = cell.cell_contents
        except ValueError:  # An empty cell.
            continue
        if isinstance(contents, tf.types.experimental.GenericFunction):
            found.append(contents)
    return found


def drop_stale_keras_functions(keep: Sequence[object] = ()) -> list:
    """Drops the traced functions Keras keeps on a model that read a split stack's old storage.

    Each of `train_function`, `train_tf_function`, `test_function` and
    `predict_function` of every live model with stacked tables
    (`stacking.models_seen`) whose trace reads emptied storage is set back
    to None, as `compile` does: Keras makes and traces it anew on its next
    `fit`, `evaluate` or `predict`, on the new stacks.

    Args:
        keep: The functions being traced now (the step that split the
            stacks): a model's attribute holding one is left as it is (a
            `fit` running reads it again at its next step), and traced
            anew by the coordinator.

    Returns:
        (model name, attribute) of each function dropped.
    """
    dropped = []
    for model in stacking.models_seen():
        names = []
        for name in _KERAS_FUNCTIONS:
            functions = _tf_functions_in(getattr(model, name, None))
            if any(f is k for f in functions for k in keep):
                continue
            if any(_reads_retired(f) for f in functions):
                setattr(model, name, None)
                names.append(name)
        if names:
            logging.warning("stack_tables=True: model %r: %s dropped (traced before its tables "
                            "were split apart, they read the old storage); Keras traces them "
                            "anew, as after compile.", model.name, ", ".join(names))
            dropped += [(model.name, n) for n in names]
    return dropped


def before_call(function, args: tuple, kwargs: dict) -> None:
    """Traces `function` anew before a call if a trace it keeps reads emptied storage.

    Run before every call of a `tf.function` once a split emptied storage
    (the "retrace_after_split" patch, `tf_objects.wrap_tf_function_calls`):
    a function traced before a split and called outside the coordinator (a
    user's serving or eval function, a Keras function not dropped) has its
    traces dropped (`tf_objects.reset_traces`) and is traced now, on the new
    stacks, before it runs; as a scheduled one, it is refused, naming why,
    if its new trace would run another program (`_check_retrace`). A
    function checked since the last split costs one lookup.

    Args:
        function: The `tf.function` about to be called.
        args: Its positional arguments.
        kwargs: Its keyword arguments.

    Raises:
        StackingError: `function` cannot run (see above).
    """
    count = stack_storage.retirements()
    if not count or _CHECKED.get(function) == count:
        return
    stale = _retrace_if_stale(function)
    if not stale:
        return
    concrete = function.get_concrete_function(*args, **kwargs)  # Traced, not run.
    _check_retrace(function, stale, [concrete])
    _CHECKED[function] = count
    logging.warning("stack_tables=True: %r was traced again: its traces read the storage of "
                    "stacks split since.", _name_of(function))


def before_concrete_call(concrete) -> None:
    """Refuses a user's call of `concrete` if it reads emptied storage, naming the fix.

    A `ConcreteFunction` cannot be traced again: called by hand after a
    split of a stack it read, it raises this `StackingError` instead of
    TF's error about a row out of ``[0, 0)``.
    """
    if stack_storage.retirements():
        _refuse_retired([concrete], concrete)


def patch_retrace_after_split():
    """Makes every `tf.function` call run `before_call` first; returns the undo.

    Every call of a `ConcreteFunction` by hand runs `before_concrete_call`.
    Applied through `tf_psplugin._internal.patches` ("retrace_after_split"),
    by `trace_splitting` once a split emptied storage a live trace reads.
    """
    return tf_objects.wrap_tf_function_calls(before_call, before_concrete_call)


def trace_splitting(trace: Callable[[], object], function, stacks,
                    traces_of: Callable[[object], list] = lambda result: [],
                    probe: Optional[Callable[[], object]] = None,
                    scheduled: Optional[object] = None):
    """`trace()`, done again after splitting the stacks a legacy optimizer needs apart.

    A legacy optimizer not known to update a stack elementwise, applying
    tables that share a stack (a custom loop, or a model compiled with it
    after a traced `fit`), stops the trace of the step (`SplitRequired`,
    before it makes any slot). The trace is dropped, the tables are split
    apart (`stacking.split_apart`: each alone in a stack, their current
    rows copied) and the step is traced again, as its first call
    (`tf_objects.restart_first_trace`). Each split leaves fewer shared
    stacks, so this ends. A live traced function that read a split stack
    (a step traced before it, or the first fit's, which Keras keeps) does
    not stop the split: its storage is freed. Scheduled again, such a
    function is traced anew first, as a first call (`tf_objects.
    reset_traces`), and runs on the new stacks; if its new trace no
    longer reads a variable its old one read (the model was compiled with
    another optimizer since), it is refused, naming why, rather than run
    another program. A live optimizer's slots of a split stack (a legacy
    one's, or a known Keras one's) are split with it (`stacking.split_apart`,
    `slot_split`); a stack whose live slots a split cannot move raises the
    error, which names the fix.
    After such a split, the functions Keras keeps on a model that read the
    old storage are dropped (`drop_stale_keras_functions`), and every call
    of a `tf.function` outside the coordinator checks it first (`before_call`).
    The coordinator traces every step through this (runtime/role_tracing.py
    in synchronous mode, runtime/coordinator.py's asynchronous schedule).
    A dispatch whose call traced nothing (a cached trace) only looks its
    traces up: it links them to the stacks they read (`Stack.traced_as`)
    only when a new trace was made.

    Args:
        trace: Traces the step (``function``, on each role); returns its result.
        function: The `tf.function` being traced.
        stacks: The strategy's `TableStacks` (None: `trace()` as it is).
        traces_of: The `ConcreteFunction`s in `trace()`'s result: while they
            live, they hold the stacks they read (`Stack.held_by`).
        probe: Traces the step without running it, where `trace()` also
            queues it (the stock asynchronous schedule): a function traced
            anew is checked before it is queued. None: `trace()` runs nothing.
        scheduled: The function the user scheduled, if `function` replaces
            it (runtime/role_tracing.py): a model's attribute holding it is
            not dropped either.

    Returns:
        What `trace()` returned.

    Raises:
        StackingError: the stacks cannot be split, or `function` was traced
            before a stack it reads was split and cannot be traced again
            (see above).
    """
    stale = _retrace_if_stale(function) if stacks is not None else []
    done = set()
    while True:
        take_split_request()  # None left from an earlier trace.
        mark = stack_storage.trace_mark()
        try:
            if stale and probe is not None:
                probe()
                _check_retrace(function, stale, [])
            result = trace()
        except Exception as error:  # pylint: disable=broad-except
            # A `SplitRequired`, which autograph re-raises as its `StagingError`:
            # known by the request it left. Any other error is the user's.
            request = take_split_request()
            if request is None or stacks is None:
                raise
            del error  # Only tables and text kept: its traceback holds the dropped trace.
        else:
            if stacks is None:
                return result
            traced = list(traces_of(result))
            _refuse_retired(traced, function)
            if stale:
                if probe is None:
                    _check_retrace(function, stale, traced)
                logging.warning("stack_tables=True: %r was traced again: its traces read the "
                                "storage of stacks split since.", _name_of(function))
                stale = []
            if stack_storage.retirements():
                _CHECKED[function] = stack_storage.retirements()
            if stack_storage.recorded_since(mark):  # What holds the stacks from now on.
                traced.append(tf_objects.first_trace_of(function))
                for stack in stacks.stacks():
                    for concrete in traced:
                        stack.traced_as(concrete)
            return result
        for stack in stacks.stacks():
            stack.drop_traces_since(mark)  # The failed trace's: it is gone.
        tf_objects.restart_first_trace(function)  # The retrace is its first call, as this was.
        tables, why, message = request
        key = frozenset(id(t) for t in tables)
        held = "they were split already" if key in done else stacking.split_apart(tables, why)
        if held:
            raise StackingError(f"{message} ({held}.)")
        done.add(key)
        if stack_storage.retirements():
            drop_stale_keras_functions(keep=[function, scheduled])
            patches.install("retrace_after_split")
        stale += _retrace_if_stale(function)  # Its earlier traces (other arguments, roles).
        logging.warning("stack_tables=True: the step was traced again with tables %s each in a "
                        "stack of its own (%s).", sorted(t.display_name for t in tables), why)
