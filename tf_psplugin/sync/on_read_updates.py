"""In-step updates of ON_READ replicated variables, packed into few all-reduces.

Metric accumulators (a Keras `Mean` has two, `AUC` four) and batch-norm
statistics are ``ON_READ`` variables. Under the hybrid strategy they are
replicated like every dense variable, and each replica must apply the
*global* update so that the replicas stay identical (exact metrics, no
per-step PS traffic). All-reducing each update where it happens costs one
collective per variable per step: two for the loss tracker alone, six more
for a model that also tracks AUC and a mean.

So an update made while a synchronous step is traced is recorded, not
applied, and later applied with its delta all-reduced together with every
other pending delta:

* **in the step's gradient all-reduce**, when the step still has one to
  come (the loss tracker and batch-norm statistics are updated in the
  forward pass): no collective of its own (`take` and `apply`);
* **when a pending variable is used again** in the step (read, or the
  update's result used as a value): one packed all-reduce for everything
  pending in that graph (`flush_if_pending`); Keras reads every metric at the
  end of its train and test steps;
* **at the end of a `strategy.run` in a loop body** (`end_of_run`): a
  step that runs several replica functions in a ``tf.range`` /
  ``tf.while_loop`` (``steps_per_execution``-style custom loops, TF's
  ``testCustomTrainingLoop``) and updates a metric after
  `apply_gradients` leaves the update pending in the loop body, which no
  later trace can reach; it is written as soon as the replica function
  returns, one packed all-reduce per iteration for everything pending;
* **at the end of the step**, for a step that updates a variable after its
  gradient all-reduce and never reads it again (TensorFlow's PSS tutorial
  updates its accuracy metric after `apply_gradients`, and reads
  `result()` only after `join()`): no trace can flush those. The
  coordinator then traces the user's Python function again, wrapped so
  that whatever is still pending when it returns is written with one
  packed all-reduce (`replacement_for`); should an update still be left
  (made in a loop body outside `strategy.run`, or in a nested
  tf.function), a third trace applies every update of that function where
  it happens, as with packing off, in whichever thread makes it (a
  `strategy.run` traces the replica function in a thread of its own). Packing
  is an optimisation, never a precondition: no step is refused for it.
  Only a concrete function, which has no Python function to trace again,
  cannot be mended: it raises `StrategyError` naming the variable.

What is deferred is only the write: every delta is computed where the user
computed it. An update made in a branch of a `tf.cond` (an autograph
``if`` on a tensor too) cannot wait there (no later flush reaches a
branch) nor be all-reduced there: the predicate may come from the
worker's own batch, so the workers of one step may take different
branches, and a collective that only some of them run stalls the step
until the step watchdog fails it. The
worker adds the delta to an accumulator of its own instead (a replicated
variable that is not ``ON_READ``, made the first time; no collective),
and the accumulator is all-reduced, written and zeroed as a pending update
of the nearest enclosing graph that every worker runs whole (`_accumulate`).
A read of the variable inside that branch does not see the branch's own
update yet (no collective can run there). This holds with packing off too.
Variables with aggregation ``NONE`` or ``ONLY_FIRST_REPLICA`` are updated
locally, unreduced, as before.
"""

import functools
import threading
import weakref
from typing import Callable, Dict, List, NamedTuple, Optional

import tensorflow as tf

from tf_psplugin.cluster.connection import StrategyError
from tf_psplugin.sync import replicated

# Graph classes whose ops run once per step of the traced function: the
# function itself and while-loop bodies (steps_per_execution > 1). TF's
# control-flow-v2 graph classes are told apart by name, not imported: they
# live in a private module (control_flow_v2_func_graphs).
_DEFERRABLE_GRAPHS = ("FuncGraph", "WhileBodyFuncGraph")

# A while-loop body: still being traced when a `strategy.run` in it returns.
_LOOP_BODY_GRAPH = "WhileBodyFuncGraph"

_AGGREGATIONS = (tf.VariableAggregation.SUM, tf.VariableAggregation.MEAN)


class _Pending(NamedTuple):
    var: object  # the ReplicatedVariable
    delta: Optional[tf.Tensor]  # None: the worker's sum is in `accumulator`
    apply: Callable  # apply(reduced_delta) does the variable's own write
    accumulator: object = None  # see `OnReadUpdates._accumulate`


class DeferredUpdate:
    """What a deferred ``assign_add``/``assign_sub`` returns for ``read_value=True``.

    Usable as a control dependency (it stands for the computed delta) and,
    converted to a tensor, as the variable's value after the update: the
    conversion reads the variable, which applies the pending update first.
    """

    def __init__(self, var, marker: tf.Operation):
        self._var = var
        self._marker = marker

    def _as_graph_element(self):  # For tf.control_dependencies and tf.group.
        return self._marker

    @property
    def op(self) -> tf.Operation:
        return self._marker

    @property
    def device(self) -> str:
        return self._marker.device

    @property
    def graph(self):
        return self._marker.graph

    @property
    def dtype(self):
        return self._var.dtype

    @property
    def shape(self):
        return self._var.shape

    def read_value(self) -> tf.Tensor:
        return self._var.read_value()


def _convert_deferred(value, dtype=None, name=None, as_ref=False):
    del name, as_ref
    result = value.read_value()
    if dtype is not None and not dtype.is_compatible_with(result.dtype):
        raise ValueError(f"Incompatible type conversion requested to type {dtype.name} "
                         f"for an update of a variable of type {result.dtype.name}")
    return result


tf.register_tensor_conversion_function(DeferredUpdate, _convert_deferred)


def _plain_accumulator(var):
    with tf.init_scope():
        return tf.Variable(tf.zeros(var.shape, var.dtype), trainable=False)


def _drain(accumulator) -> tf.Tensor:
    """The accumulator's value; the accumulator is zeroed after the read."""
    value = accumulator.read_value()
    with tf.control_dependencies([value]), replicated.inside_variable_update():
        accumulator.assign(tf.zeros_like(value), read_value=False)
    return tf.identity(value)


class OnReadUpdates:
    """The pending ON_READ updates of the synchronous step being traced.

    Args:
        collective_group: The workers' `collectives.CollectiveGroup`.
        num_workers: Workers in the group (divides ``MEAN`` updates).
        enabled: Pack updates (False: all-reduce each where it happens).
        make_accumulator: ``make_accumulator(var)`` returns a new variable of
            `var`'s shape and dtype, at zeros, that each worker keeps for
            itself (a replicated variable that is not ``ON_READ``); called
            while a step is traced, so it creates the variable outside the
            trace. Default: a plain `tf.Variable` (one process).
    """

    def __init__(self, collective_group, num_workers: int, enabled: bool = True,
                 make_accumulator: Optional[Callable] = None):
        self._group = collective_group
        self._num_workers = int(num_workers)
        self.enabled = bool(enabled)
        self._make_accumulator = make_accumulator or _plain_accumulator
        # (id(var), subtract) -> (var, accumulator): see `_accumulate`.
        self._accumulators: Dict[tuple, tuple] = {}
        self._pending: Dict[object, List[_Pending]] = {}  # graph -> updates, in order
        # A user's step function -> the tf.function traced in its place
        # (`replacement_for`); weak, so a dropped step function is forgotten.
        self._replacements = weakref.WeakKeyDictionary()
        self._stages = weakref.WeakKeyDictionary()  # replacement -> 1 (flush at end) or 2
        # Graphs of the traced functions whose updates are all applied where
        # they happen (the second replacement): a set of the graphs, not a
        # thread-local flag, since `strategy.run` traces the replica function
        # in a thread of its own.
        self._unpacked_graphs = weakref.WeakKeyDictionary()
        self._local = threading.local()

    def update(self, var, delta, apply: Callable, read_value: bool, subtract: bool = False):
        """Records (or, if it cannot wait, does) an in-step update of `var`.

        Args:
            var: The ON_READ replicated variable.
            delta: Its worker-local delta.
            apply: ``apply(reduced_delta)`` performs the variable's own write
                (``assign_add`` or ``assign_sub``) and returns its result.
            read_value: What the caller asked the write to return.
            subtract: The write is an ``assign_sub`` (updates in a branch
                are summed per kind of write).

        Returns:
            The write's result, or for a recorded update a `DeferredUpdate`
            (``read_value=True``) or an op standing for it.
        """
        aggregation = var.aggregation
        if aggregation not in _AGGREGATIONS:
            return apply(delta)
        delta = tf.convert_to_tensor(delta, dtype=var.dtype)
        graph = tf.compat.v1.get_default_graph()
        if type(graph).__name__ not in _DEFERRABLE_GRAPHS:
            return self._accumulate(var, delta, apply, read_value, subtract, graph)
        if not self.enabled or self._unpacked(graph):
            return self._reduce_and_apply([_Pending(var, delta, apply)])[0]
        self._pending.setdefault(graph, []).append(_Pending(var, delta, apply))
        with tf.control_dependencies([delta]):
            marker = tf.no_op(name="deferred_on_read_update")
        return DeferredUpdate(var, marker) if read_value else marker

    def _unpacked(self, graph) -> bool:
        return replicated.outermost_function_graph(graph) in self._unpacked_graphs

    def _accumulate(self, var, delta, apply, read_value, subtract, graph):
        """An update in a branch of a `tf.cond`: summed locally, all-reduced after the cond.

        A collective in a branch would need every worker to take that
        branch; a predicate computed from a worker's own batch (an ``if`` on
        a tensor, which autograph makes a `tf.cond`) does not. So the
        worker adds the delta to an accumulator of its own (no collective),
        and the accumulator's value is all-reduced and written, and the
        accumulator zeroed, in the nearest enclosing graph that every worker
        runs whole (the loop body or the step: `_flush_graph`), as a
        deferred update of that graph: with the gradients, at a read, at the
        end of a `strategy.run` in a loop body, or at the end of the step.
        """
        key = (id(var), bool(subtract))
        if key not in self._accumulators:
            self._accumulators[key] = (var, self._make_accumulator(var))
        accumulator = self._accumulators[key][1]
        with replicated.inside_variable_update():
            written = accumulator.assign_add(delta, read_value=False)
        target = self._flush_graph(graph)
        pending = self._pending.setdefault(target, [])
        if not any(p.accumulator is accumulator for p in pending):
            pending.append(_Pending(var, None, apply, accumulator))
        with tf.control_dependencies([written]):
            marker = tf.no_op(name="accumulated_on_read_update")
        return DeferredUpdate(var, marker) if read_value else marker

    def _flush_graph(self, graph):
        """Where the updates accumulated in `graph` (a cond branch) are written.

        The nearest enclosing loop body or traced function; the traced
        function itself for a trace that applies updates where they happen
        (it writes what is pending in the function at its end).
        """
        if self._unpacked(graph):
            return replicated.outermost_function_graph(graph)
        while type(graph).__name__ not in _DEFERRABLE_GRAPHS and getattr(
                graph, "outer_graph", None) is not None:
            graph = graph.outer_graph
        return graph

    def take(self) -> List[_Pending]:
        """Removes and returns the updates pending in the current graph.

        For the caller to all-reduce their deltas with its own tensors (one
        collective) and pass the results to `apply`.
        """
        return self._pending.pop(tf.compat.v1.get_default_graph(), [])

    def deltas(self, pending: List[_Pending]) -> List[tf.Tensor]:
        """The worker-local deltas of `pending` (an accumulator is read, then zeroed)."""
        return [p.delta if p.accumulator is None else _drain(p.accumulator) for p in pending]

    def apply(self, pending: List[_Pending], summed: List[tf.Tensor]) -> list:
        """Writes `pending` updates given their deltas summed over the workers.

        Returns:
            What each write returned.
        """
        self._local.flushing = True
        results = []
        try:
            for p, total in zip(pending, summed):
                if p.var.aggregation == tf.VariableAggregation.MEAN:
                    total = total / tf.cast(self._num_workers, total.dtype)
                results.append(p.apply(total))
        finally:
            self._local.flushing = False
        return results

    def _reduce_and_apply(self, pending: List[_Pending]) -> list:
        """All-reduces `pending`'s deltas with one collective, then writes them."""
        return self.apply(pending, self._group.all_reduce_packed(self.deltas(pending)))

    def flush_if_pending(self, var) -> None:
        """Applies every update pending beside one of `var`'s, with one all-reduce.

        Called when `var` is used in a traced step. The updates are written
        in the graph that recorded them, ahead of the use.
        """
        if not self._pending or getattr(self._local, "flushing", False):
            return
        current = tf.compat.v1.get_default_graph()
        for graph, pending in list(self._pending.items()):
            if not any(p.var is var for p in pending):
                continue
            # Ops added to an enclosing graph now run before the cond being
            # traced: its accumulated updates wait for a later flush (a read
            # inside a branch cannot see them: no collective can run there).
            now = [p for p in pending if p.accumulator is None or graph is current]
            if not now:
                continue
            later = [p for p in pending if not any(p is q for q in now)]
            if later:
                self._pending[graph] = later
            else:
                del self._pending[graph]
            with graph.as_default():
                self._reduce_and_apply(now)

    def end_of_run(self) -> None:
        """Writes what a `strategy.run` in a loop body left pending, with one all-reduce.

        Called when a replica function returns. In the body of a
        ``tf.range``/``tf.while_loop`` (several replica steps per scheduled
        step), an update made after the step's gradient all-reduce and not
        read in the body could otherwise never be written: the body's trace
        ends with the loop, and a later flush writes into the enclosing
        graph. In the traced function itself updates keep waiting (for a
        later all-reduce, a read, or the end of the step).
        """
        graph = tf.compat.v1.get_default_graph()
        if type(graph).__name__ != _LOOP_BODY_GRAPH or getattr(self._local, "flushing", False):
            return
        pending = self._pending.pop(graph, [])
        if pending:
            self._reduce_and_apply(pending)

    def left_pending(self) -> List[str]:
        """Names of the variables whose updates a finished trace left pending.

        Forgets those updates: the trace that recorded them is over, so they
        could never be written. The caller traces the step again, with
        `replacement_for`.
        """
        names = sorted({p.var.name for pending in self._pending.values() for p in pending})
        self._pending.clear()
        return names

    def step_function(self, fn):
        """The function to trace when `fn` is scheduled: `fn`, or its replacement."""
        try:
            return self._replacements.get(fn, fn)
        except TypeError:  # Not weakly referenceable: never replaced.
            return fn

    def replacement_for(self, fn, traced, names: List[str]):
        """A tf.function to schedule instead of `fn`, whose trace `traced` left updates pending.

        The first replacement runs `fn`'s Python function and then writes
        every update still pending in the step's graph, with one packed
        all-reduce. If `traced` was already that replacement (an update was
        left in a loop body), the second applies each update of the step
        where it happens. Both keep `fn`'s input signature.

        Args:
            fn: The function the user scheduled.
            traced: What was traced for it (`fn` or an earlier replacement).
            names: The variables left pending (for the error message).

        Returns:
            The replacement, remembered for later `schedule` calls of `fn`.

        Raises:
            StrategyError: `fn` is a concrete function (it cannot be traced
                again), or even the unpacked replacement left updates pending.
        """
        python_function = getattr(fn, "python_function", None)
        stage = self._stages.get(traced, 0)
        if python_function is None or stage >= 2:
            raise self._lost_update_error(names, concrete=python_function is None)
        unpacked = stage == 1

        @functools.wraps(python_function)
        def step(*args, **kwargs):
            if unpacked:
                self._unpacked_graphs[tf.compat.v1.get_default_graph()] = True
            outputs = python_function(*args, **kwargs)
            pending = self.take()  # What the step never read again.
            if pending:
                self._reduce_and_apply(pending)
            return outputs

        replacement = tf.function(step, input_signature=fn.input_signature)
        self._stages[replacement] = stage + 1
        try:
            self._replacements[fn] = replacement
        except TypeError:  # Not weakly referenceable: replaced for this call only.
            pass
        return replacement

    @staticmethod
    def _lost_update_error(names, concrete: bool) -> StrategyError:
        why = ("it is a concrete function, which tf_psplugin cannot trace again to write "
               "those updates at the end of the step. Fix: schedule the tf.function itself"
               if concrete else
               "even a trace with every update applied where it happens left them pending "
               "(please report this with the step's code). Fix")
        return StrategyError(
            f"the traced step updated {', '.join(map(repr, names))} (ON_READ: metric "
            f"accumulators or batch-norm statistics) and never used them again, and {why}, "
            "or pass options=HybridOptions(experimental_pack_on_read_updates=False) to "
            "HybridParameterServerStrategy (one all-reduce per update, where it happens).")

    def discard(self) -> None:
        """Forgets pending updates (a trace that failed)."""
        self._pending.clear()
