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
* never later: a traced step that ends with an update still pending raises
  `StrategyError` naming the variable (`check_flushed`); its fix is to read
  the variable in the step or to construct the strategy with
  ``pack_on_read_updates=False``.

What is deferred is only the write: every delta is computed where the user
computed it. An update made in a branch of a `tf.cond` (a graph that is
neither the traced function nor a loop body, so no later flush could reach
it) is all-reduced on the spot, as every update is with packing off.
Variables with aggregation ``NONE`` or ``ONLY_FIRST_REPLICA`` are updated
locally, unreduced, as before.
"""

import threading
from typing import Callable, Dict, List, NamedTuple

import tensorflow as tf

from tf_psplugin.connection import StrategyError

# Graph classes whose ops run once per step of the traced function: the
# function itself and while-loop bodies (steps_per_execution > 1). TF's
# control-flow-v2 graph classes are told apart by name, not imported: they
# live in a private module (control_flow_v2_func_graphs).
_DEFERRABLE_GRAPHS = ("FuncGraph", "WhileBodyFuncGraph")

_AGGREGATIONS = (tf.VariableAggregation.SUM, tf.VariableAggregation.MEAN)


class _Pending(NamedTuple):
    var: object  # the ReplicatedVariable
    delta: tf.Tensor
    apply: Callable  # apply(reduced_delta) does the variable's own write


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


class OnReadUpdates:
    """The pending ON_READ updates of the synchronous step being traced.

    Args:
        collective_group: The workers' `collectives.CollectiveGroup`.
        num_workers: Workers in the group (divides ``MEAN`` updates).
        enabled: Pack updates (False: all-reduce each where it happens).
    """

    def __init__(self, collective_group, num_workers: int, enabled: bool = True):
        self._group = collective_group
        self._num_workers = int(num_workers)
        self.enabled = bool(enabled)
        self._pending: Dict[object, List[_Pending]] = {}  # graph -> updates, in order
        # id(function) -> (function, error): functions whose trace lost an update.
        self._unusable: Dict[int, tuple] = {}
        self._local = threading.local()

    def update(self, var, delta, apply: Callable, read_value: bool):
        """Records (or, if it cannot wait, does) an in-step update of `var`.

        Args:
            var: The ON_READ replicated variable.
            delta: Its worker-local delta.
            apply: ``apply(reduced_delta)`` performs the variable's own write
                (``assign_add`` or ``assign_sub``) and returns its result.
            read_value: What the caller asked the write to return.

        Returns:
            The write's result, or for a recorded update a `DeferredUpdate`
            (``read_value=True``) or an op standing for it.
        """
        aggregation = var.aggregation
        if aggregation not in _AGGREGATIONS:
            return apply(delta)
        delta = tf.convert_to_tensor(delta, dtype=var.dtype)
        graph = tf.compat.v1.get_default_graph()
        if not self.enabled or type(graph).__name__ not in _DEFERRABLE_GRAPHS:
            return self._reduce_and_apply([_Pending(var, delta, apply)])[0]
        self._pending.setdefault(graph, []).append(_Pending(var, delta, apply))
        with tf.control_dependencies([delta]):
            marker = tf.no_op(name="deferred_on_read_update")
        return DeferredUpdate(var, marker) if read_value else marker

    def take(self) -> List[_Pending]:
        """Removes and returns the updates pending in the current graph.

        For the caller to all-reduce their deltas with its own tensors (one
        collective) and pass the results to `apply`.
        """
        return self._pending.pop(tf.compat.v1.get_default_graph(), [])

    def deltas(self, pending: List[_Pending]) -> List[tf.Tensor]:
        return [p.delta for p in pending]

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
        for graph, pending in list(self._pending.items()):
            if not any(p.var is var for p in pending):
                continue
            del self._pending[graph]
            with graph.as_default():
                self._reduce_and_apply(pending)

    def check_flushed(self, fn) -> None:
        """Raises if the trace of `fn` ended with updates still pending (then forgets them).

        `fn` is remembered: its traced graph stays cached by TensorFlow, so
        scheduling it again (`check_usable`) raises the same error instead of
        running a step that loses the update.
        """
        if not self._pending:
            return
        names = sorted({p.var.name for pending in self._pending.values() for p in pending})
        self._pending.clear()
        self._unusable[id(fn)] = (fn, self._lost_update_error(names))
        raise self._unusable[id(fn)][1]

    def check_usable(self, fn) -> None:
        """Raises `check_flushed`'s error again for a function it rejected."""
        if id(fn) in self._unusable:
            raise self._unusable[id(fn)][1]

    @staticmethod
    def _lost_update_error(names) -> StrategyError:
        return StrategyError(
            f"the traced step updated {', '.join(map(repr, names))} (ON_READ: metric "
            "accumulators or batch-norm statistics) after its gradient all-reduce and "
            "never used them again, so the update would be lost: tf_psplugin applies "
            "such updates, packed into one all-reduce, when the step next reads them. "
            "Fix: read them in the step (Keras's train_step returns every metric's "
            "result()), or pass pack_on_read_updates=False to "
            "HybridParameterServerStrategy (one all-reduce per update).")

    def discard(self) -> None:
        """Forgets pending updates (a trace that failed)."""
        self._pending.clear()
