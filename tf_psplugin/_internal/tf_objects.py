"""Named accessors for the private attributes the plugin reads or sets on TF/Keras objects.

Why this module exists: `tf_internal.PRIVATE_ATTRIBUTES` lists every private
TF/Keras name the plugin touches, but a list of names does not move the
uses: before issue 33 about a hundred reads and writes such as
`coordinator._cluster.workers` or `remote._type_spec = spec` sat in twenty
modules, so a TF upgrade that renamed one meant a hunt through the package.
Here each such use is one small function named after what it means
(`coordinator_workers`, `set_remote_type_spec`, ...), whose docstring names
the TF/Keras class that defines the attribute, why no public API will do,
and the TF versions it was checked on. A TF upgrade audits `_internal/`:
this module for attribute uses, `tf_internal.py` for private imports and the
registry, `patches.py` for process-wide patches.

What stays outside: a subclass of a TF class reading or setting its own
inherited private state through `self` (or `cls`) -- `self._variables` in
our ShardedVariable subclass, `self._extended` in the strategy -- and the
private hooks such a subclass overrides (`def _create_variable`). That is
what subclassing means, and the attribute is still registered in
`PRIVATE_ATTRIBUTES`. tests/unit/test_tf_internal.py fails on any other use of
a TF/Keras private attribute outside `_internal/`.

"TF 2.15-2.21" below means checked on TF 2.15.1 (tf.keras 2.15) and TF 2.21.0
(tf-keras 2.21), the two versions CI runs.
"""

import functools
import inspect
import weakref
from typing import Any, Callable, Optional

from tf_psplugin._internal import tf_internal
from tf_psplugin._internal.tf_internal import cluster_coordinator, parameter_server_strategy_v2

# -- Cluster, strategy and coordinator ----------------------------------------


def stock_server_def_retries() -> int:
    """ParameterServerStrategyV2's `_SET_SERVER_DEF_RETRIES`: the retry count stock PSS connects
    with (50; TF 2.15-2.21).
    """
    return parameter_server_strategy_v2._SET_SERVER_DEF_RETRIES  # pylint: disable=protected-access


def strategy_cluster_resolver(strategy):
    """ParameterServerStrategyV2's `_cluster_resolver`: the resolver it was built with; no public
    getter (TF 2.15-2.21).
    """
    return strategy._cluster_resolver  # pylint: disable=protected-access


def model_cluster_coordinator(model) -> Optional[Any]:
    """Keras Model's `_cluster_coordinator` (set by fit under PSS), or None; Keras has no public
    getter (TF 2.15-2.21).
    """
    return getattr(model, "_cluster_coordinator", None)


def coordinator_workers(coordinator) -> list:
    """ClusterCoordinator's `_cluster.workers`: its Worker objects, one per worker task; no public
    list (TF 2.15-2.21).
    """
    return coordinator._cluster.workers  # pylint: disable=protected-access


def create_per_worker_resources(coordinator, fn: Callable):
    """ClusterCoordinator's `_create_per_worker_resources(fn)`: `fn` run once on every worker (how
    the stock per-worker dataset builds its iterators; TF 2.15-2.21).
    """
    return coordinator._create_per_worker_resources(fn)  # pylint: disable=protected-access


# -- Per-worker and remote values ---------------------------------------------


def per_worker_values(per_worker) -> tuple:
    """PerWorkerValues' `_values`: its RemoteValue per worker; no public accessor (TF 2.15-2.21)."""
    return per_worker._values  # pylint: disable=protected-access


def maybe_per_worker_values(obj) -> Optional[tuple]:
    """`_values` of a PerWorkerValues or PerWorkerDistributedIterator, or None for any other
    object (TF 2.15-2.21).
    """
    return getattr(obj, "_values", None)


def remote_value_local(remote):
    """RemoteValueImpl's `_get_values()`: the worker's value without fetching it to the
    coordinator (TF 2.15-2.21).
    """
    return remote._get_values()  # pylint: disable=protected-access


def maybe_remote_value_local(obj):
    """As `remote_value_local` for a RemoteValueImpl; None for any other object (TF 2.15-2.21)."""
    get = getattr(obj, "_get_values", None)
    return get() if get is not None else None


def set_remote_type_spec(remote, spec) -> None:
    """Sets RemoteValueImpl's `_type_spec`, as the stock per-worker iterator sets its own spec (TF
    2.15-2.21).
    """
    remote._type_spec = spec  # pylint: disable=protected-access


def iterator_resource(iterator) -> Optional[Any]:
    """OwnedIterator's `_iterator_resource`, or None: the handle the raw (de)serialize ops need;
    no public accessor (TF 2.15-2.21).
    """
    return getattr(iterator, "_iterator_resource", None)


# -- Keras's DataHandler ------------------------------------------------------


def data_handler_dataset(handler) -> Optional[Any]:
    """Keras DataHandler's `_dataset` (the DatasetAdapter's dataset), or None (tf.keras 2.15, tf-
    keras 2.21).
    """
    return getattr(handler, "_dataset", None)


def set_data_handler_inferred_steps(handler, steps: int) -> None:
    """Sets Keras DataHandler's `_inferred_steps`: the epoch length it cannot infer from a per-
    worker dataset (tf.keras 2.15, tf-keras 2.21).
    """
    handler._inferred_steps = steps  # pylint: disable=protected-access


def wait_for_each_step_while_length_unknown(handler, wait: Callable[[], None]) -> None:
    """Makes Keras DataHandler's `should_sync` call `wait()` while the epoch length is unknown.

    Keras's fit/evaluate loops read `should_sync` right after each step's
    call and, while `inferred_steps` is None, wait for that step
    (``context.async_wait()``) so that the step that finds the end of the
    data raises `OutOfRangeError` before its logs are used and its
    `on_*_batch_end` runs; the epoch length is then the steps before it.
    Under a coordinator the step runs remotely, so `wait` (the coordinator's
    `join`) waits for it and raises its error there. Keras has no hook for
    this: the handler's class is swapped for a subclass that overrides the
    property (tf.keras 2.15, tf-keras 2.16-2.21: `should_sync` is read in
    the fit/evaluate/predict loops only).
    """
    handler.__class__ = _handler_waiting_for_each_step(type(handler))
    handler.tf_psplugin_wait_for_step = wait


@functools.lru_cache(maxsize=None)
def _handler_waiting_for_each_step(base):
    class WaitForEachStep(base):  # pylint: disable=missing-class-docstring
        @property
        def should_sync(self):
            if self.inferred_steps is None:
                self.tf_psplugin_wait_for_step()
                return True
            return False

    WaitForEachStep.__name__ = WaitForEachStep.__qualname__ = base.__name__
    return WaitForEachStep


def data_handler_adapter(handler):
    """Keras DataHandler's `_adapter`, whose `should_recreate_iterator` decides a new pass
    (tf.keras 2.15, tf-keras 2.21).
    """
    return handler._adapter  # pylint: disable=protected-access


# -- Variables ----------------------------------------------------------------


def variable_unique_id(variable) -> str:
    """BaseResourceVariable's `_unique_id`: the key optimizers file slots under (TF 2.15-2.21)."""
    return variable._unique_id  # pylint: disable=protected-access


def variable_handle_name(variable) -> str:
    """BaseResourceVariable's `_handle_name`: the name its checkpoint key is made from (TF
    2.15-2.21).
    """
    return variable._handle_name  # pylint: disable=protected-access


def variable_shared_name(variable) -> str:
    """Variable's `_shared_name`: its name without the ":0" (TF 2.15-2.21)."""
    return variable._shared_name  # pylint: disable=protected-access


def variable_distribute_strategy(variable) -> Optional[Any]:
    """BaseResourceVariable's `_distribute_strategy` (the strategy that made it), or None (TF
    2.15-2.21).
    """
    return getattr(variable, "_distribute_strategy", None)


def set_variable_distribute_strategy(variable, strategy) -> None:
    """Sets BaseResourceVariable's `_distribute_strategy`; no public setter (TF 2.15-2.21)."""
    variable._distribute_strategy = strategy  # pylint: disable=protected-access


def set_save_slice_info(variable, save_slice_info) -> None:
    """Variable's `_set_save_slice_info`: which slice of a checkpoint tensor it is; no public
    setter (TF 2.15).
    """
    variable._set_save_slice_info(save_slice_info)  # pylint: disable=protected-access


def copy_trackable_to_cpu(trackable, object_map) -> None:
    """Trackable's `_copy_trackable_to_cpu`: its CPU copy for async checkpoints, into `object_map`
    (TF 2.15-2.21).
    """
    trackable._copy_trackable_to_cpu(object_map)  # pylint: disable=protected-access


def serialize_to_tensors(trackable) -> dict:
    """Trackable's `_serialize_to_tensors`: its checkpoint values (TF 2.15-2.21)."""
    return trackable._serialize_to_tensors()  # pylint: disable=protected-access


def restore_from_tensors(trackable, restored_tensors):
    """Trackable's `_restore_from_tensors`: restores its checkpoint values (TF 2.15-2.21)."""
    return trackable._restore_from_tensors(restored_tensors)  # pylint: disable=protected-access


def autocast_inner(variable):
    """The variable inside Keras's AutoCastVariable (mixed precision), or `variable` itself.

    AutoCastVariable keeps it as `_variable` and has no public accessor
    (Keras 2.15, tf-keras 2.16-2.21).
    """
    if type(variable).__name__ == "AutoCastVariable":
        return variable._variable  # pylint: disable=protected-access
    return variable


def aggregating_inner(aggregating):
    """AggregatingVariable's `_v`: the plain variable it wraps (TF 2.15-2.21)."""
    return aggregating._v  # pylint: disable=protected-access


def set_aggregating_container(variable, aggregating) -> None:
    """Sets a variable's `_aggregating_container` (a weak reference), as AggregatingVariable does
    for its own (TF 2.15-2.21).
    """
    variable._aggregating_container = weakref.ref(aggregating)  # pylint: disable=protected-access


# -- ShardedVariable ----------------------------------------------------------


def sharded_shards(sharded) -> list:
    """ShardedVariable's `_variables`: its shard variables in order (TF 2.15-2.21)."""
    return sharded._variables  # pylint: disable=protected-access


def sharded_saving_variable(sharded):
    """ShardedVariable's `_saving_variable`: the full-shape placeholder it saves under (TF
    2.15-2.21).
    """
    return sharded._saving_variable  # pylint: disable=protected-access


def sharded_container(variable) -> Optional[Any]:
    """The ShardedVariable a shard belongs to (its `_sharded_container` weak reference), or None
    (TF 2.15-2.21).
    """
    container = getattr(variable, "_sharded_container", None)
    return container() if callable(container) else None


def set_sharded_container(variable, sharded) -> None:
    """Sets a shard's `_sharded_container` to a weak reference to `sharded`, as ShardedVariable's
    init does (TF 2.15-2.21).
    """
    variable._sharded_container = weakref.ref(sharded)  # pylint: disable=protected-access


# -- Keras optimizers (legacy OptimizerV2 and the new Optimizer) ---------------


def optimizer_built(optimizer) -> bool:
    """Whether a Keras (new) Optimizer's `build` made its variables (its `_built` flag, set by
    each optimizer's `build`; tf.keras 2.15, tf-keras 2.21). Public `built` exists only on
    some versions.
    """
    return bool(getattr(optimizer, "_built", False))


def optimizer_variable_list(optimizer) -> Any:
    """A Keras (new) Optimizer's tracked `_variables` list, which `add_variable_from_reference`
    appends to and `optimizer.variables` and checkpoints list by position (tf.keras 2.15,
    tf-keras 2.21); tables/stacked_slots.py appends a stacked table's slot views to it, as
    Keras appends an unstacked shard's slot (no public way to add an optimizer variable made
    elsewhere).
    """
    return optimizer._variables  # pylint: disable=protected-access


def no_dependency(value) -> Any:
    """`value` wrapped so that a tracked list or attribute holds it untracked (TF's
    `NoDependency`, TF 2.15-2.21).
    """
    return tf_internal.data_structures.NoDependency(value)


def optimizer_variable_index(optimizer) -> Any:
    """A Keras (new) Optimizer's `_index_dict`: {`_var_key(variable)`: position} of each
    variable its `build` was given, which every per-variable list of slots (`_momentums`,
    `_velocities`, ...) is indexed by in `update_step` (tf.keras 2.15, tf-keras 2.21).
    tables/slot_split.py maps a split stack's new shards to their moved slots there, as
    `build` maps a variable (no public way to give a built optimizer a variable's slots).
    """
    return optimizer._index_dict  # pylint: disable=protected-access


def optimizer_variable_key(optimizer, variable) -> Any:
    """A Keras (new) Optimizer's `_var_key(variable)`: the key of `variable` in its
    `_index_dict` (tf.keras 2.15, tf-keras 2.21).
    """
    return optimizer._var_key(variable)  # pylint: disable=protected-access


def optimizer_lists(optimizer) -> list:
    """The lists a Keras (new) Optimizer holds as attributes (its per-variable slot lists,
    such as Adam's `_momentums` and `_velocities` or SGD's `momentums`, whose names each
    optimizer class chooses; tf.keras 2.15, tf-keras 2.21), read from its instance
    dictionary: tables/slot_split.py finds which of them hold a slot of a stack shard.
    """
    return [value for value in vars(optimizer).values() if isinstance(value, list)]


def optimizer_slots(optimizer) -> dict:
    """Legacy OptimizerV2's `_slots`: {variable key: {slot name: slot}} (tf.keras 2.15, tf-keras
    2.21).
    """
    return optimizer._slots  # pylint: disable=protected-access


def drop_legacy_optimizer_weight(optimizer, weight) -> None:
    """Removes `weight` from legacy OptimizerV2's `_weights` (the list `add_slot` appends each
    slot to, which `get_weights`/`variables()` list; tf.keras 2.15, tf-keras 2.21): a stack's
    slot moved to the new stacks by a split (tables/slot_split.py). No public way to drop one.
    """
    optimizer._weights[:] = [w for w in optimizer._weights  # pylint: disable=protected-access
                             if w is not weight]


def legacy_optimizer_weights(optimizer) -> list:
    """Legacy OptimizerV2's `_weights`: the list `variables()` and `weights` return (and
    `get_weights`/`set_weights` use), in the order made, which `add_slot` appends to
    (tf.keras 2.15, tf-keras 2.21). tables/legacy_slots.py lists a stacked table's slot
    views there, where Keras lists an unstacked shard's slot, and unlists the stack shard's
    slot (no public way to list a variable as the optimizer's, or to unlist one).
    """
    return optimizer._weights  # pylint: disable=protected-access


def sharded_slot_creator(optimizer) -> Optional[Callable]:
    """Legacy OptimizerV2's `_create_slots_for_sharded_variables`, or None (tf.keras 2.15, tf-
    keras 2.21).
    """
    return getattr(optimizer, "_create_slots_for_sharded_variables", None)


def set_sharded_slot_creator(optimizer, fn: Callable) -> None:
    """Sets legacy OptimizerV2's `_create_slots_for_sharded_variables` on one optimizer (tf.keras
    2.15, tf-keras 2.21).
    """
    optimizer._create_slots_for_sharded_variables = fn  # pylint: disable=protected-access


def trackable_children(obj, save_type: str = "checkpoint") -> dict:
    """A trackable's `_trackable_children`: {name: child} as a checkpoint lists them (TF
    2.15-2.21); tables/slot_order.py reads an optimizer's lists by position through it.
    """
    return obj._trackable_children(save_type)  # pylint: disable=protected-access


def trackable_children_method(obj) -> Callable:
    """A trackable's bound `_trackable_children` (TF 2.15-2.21), to wrap on one instance."""
    return obj._trackable_children  # pylint: disable=protected-access


def set_instance_method(obj, name: str, fn: Callable) -> None:
    """Sets `fn` as attribute `name` of one instance, untracked (`object.__setattr__`: an
    AutoTrackable would otherwise inspect the value). Used for a Keras (new) optimizer's
    `add_variable_from_reference` and `_trackable_children` (tf.keras 2.15, tf-keras 2.21).
    """
    object.__setattr__(obj, name, fn)


def create_all_weights_of(optimizer) -> Optional[Callable]:
    """Legacy OptimizerV2's `_create_all_weights` (makes every slot now), or None for new
    optimizers (tf.keras 2.15, tf-keras 2.21).
    """
    return getattr(optimizer, "_create_all_weights", None)


# -- Keras functional models --------------------------------------------------


def nodes_by_depth(model) -> dict:
    """Keras Functional's `_nodes_by_depth`: {depth: [Node]} (tf.keras 2.15, tf-keras 2.21)."""
    return model._nodes_by_depth  # pylint: disable=protected-access


def node_single_positional_tensor(node) -> bool:
    """Keras Node's `_single_positional_tensor_passed`: called with one tensor (tf.keras 2.15, tf-
    keras 2.21).
    """
    return node._single_positional_tensor_passed  # pylint: disable=protected-access


def node_input_ids(node) -> list:
    """Keras Node's `_keras_inputs_ids_and_indices`: (tensor id, index) of its inputs (tf.keras
    2.15, tf-keras 2.21).
    """
    return node._keras_inputs_ids_and_indices  # pylint: disable=protected-access


# -- The strategy's Extended, read by its collaborators (runtime/) ------------
# HybridExtended hands its jobs to VariableCreation, Reduction and Updates
# (issue 33); what those read of the stock ParameterServerStrategyV2Extended
# state goes through here, as it would for any other TF object.


def extended_container_strategy(extended):
    """StrategyExtendedV2's `_container_strategy()`: the strategy that owns it (TF 2.15-2.21)."""
    return extended._container_strategy()  # pylint: disable=protected-access


def set_being_scheduled(extended, scheduled: bool) -> None:
    """Sets ParameterServerStrategyV2Extended's `_being_scheduled`: True while a function is
    traced for `ClusterCoordinator.schedule` (variables must not be created then; TF 2.15-2.21).
    """
    extended._being_scheduled = scheduled  # pylint: disable=protected-access


def round_robin_creator(extended) -> Callable:
    """ParameterServerStrategyV2Extended's `_create_variable_round_robin`: the stock placement
    of a variable on the PS tasks in turn (TF 2.15-2.21).
    """
    return extended._create_variable_round_robin  # pylint: disable=protected-access


def set_variable_partitioner(extended, partitioner) -> None:
    """Sets ParameterServerStrategyV2Extended's `_variable_partitioner`, which its variable
    creation reads (TF 2.15-2.21).
    """
    extended._variable_partitioner = partitioner  # pylint: disable=protected-access


def local_results_of(extended) -> Callable:
    """StrategyExtendedV2's `_local_results`: a value's per-replica parts (TF 2.15-2.21)."""
    return extended._local_results  # pylint: disable=protected-access


def single_value_selector(extended) -> Callable:
    """ParameterServerStrategyV2Extended's `_select_single_value`: the one value of a
    (possibly mirrored) structure an update uses (TF 2.15-2.21).
    """
    return extended._select_single_value  # pylint: disable=protected-access


# -- Closures and remote values of the coordinator ----------------------------


def closure_function(closure) -> Callable:
    """Closure's `_function`: the traced function it runs on a worker (TF 2.15-2.21)."""
    return closure._function  # pylint: disable=protected-access


def closure_arguments(closure) -> tuple:
    """Closure's `_args` and `_kwargs`, as scheduled (TF 2.15-2.21)."""
    return closure._args, closure._kwargs  # pylint: disable=protected-access


def closure_output_type_spec(closure):
    """Closure's `_output_type_spec`: the TypeSpec of its result (TF 2.15-2.21)."""
    return closure._output_type_spec  # pylint: disable=protected-access


def restart_first_trace(function) -> None:
    """Makes a `tf.function` whose first trace failed trace as a first call again.

    A first trace that raised leaves the function set up for later calls,
    where creating a variable is an error ("Creating variables on a
    non-first call"); the coordinator traces a step again after splitting
    table stacks (runtime/role_tracing.py), which must be a first call, as
    the failed one was. Nothing is lost: no trace was kept. Checked on TF
    2.15 and 2.21 (`Function.__init__`'s three fields, reset as there).
    A concrete function, or a function already traced: nothing changes.
    """
    if not isinstance(function, tf_internal.polymorphic_function.Function):
        return
    if first_trace_of(function) is not None:
        return  # A first trace succeeded: not a failed first call.
    reset_traces(function)


def reset_traces(function) -> bool:
    """Makes a `tf.function` forget every trace: its next call traces it as a first call.

    The coordinator traces a scheduled step again when its traces read a
    split table stack's emptied storage (tables/stacked_fallback.py): the
    new trace reads the tables' new stacks. No public API drops a
    function's traces (a new `tf.function` would, but the user holds this
    one). The state is reset as `Function.__init__` sets it, checked on TF
    2.15 and 2.21: the traces cache (`_function_cache`, which the tracing
    options made in `_initialize` share, so it is cleared, not replaced),
    the first trace (`_concrete_variable_creation_fn`, absent until the
    first call) and the three fields `_call` reads to tell a first call
    from a later one. The next call is a first call whether or not the old
    first call made variables: objects that made them keep them (an
    optimizer's slots, built once), and a variable a new trace needs
    (a legacy optimizer's slot of a new stack shard) may be made.

    Args:
        function: The `tf.function` (anything else: nothing changes).

    Returns:
        Whether `function` is a `tf.function` whose traces were dropped.
    """
    if not isinstance(function, tf_internal.polymorphic_function.Function):
        return False
    # pylint: disable=protected-access
    with function._lock:  # The lock `_call` and the tracing hold.
        function._function_cache.clear()
        function._created_variables = None
        function._variable_creation_config = None
        function._no_variable_creation_config = None
        if hasattr(function, "_concrete_variable_creation_fn"):
            del function._concrete_variable_creation_fn
    return True


def wrap_tf_function_calls(before: Callable[[Any, tuple, dict], None],
                           before_concrete: Callable[[Any], None]) -> Callable[[], None]:
    """Makes every call of a `tf.function` call ``before(function, args, kwargs)`` first.

    After a table stack was split apart, a `tf.function` traced before the
    split reads the old, emptied storage; one called outside the
    coordinator (a user's serving or eval function, Keras's
    `predict_function`) is traced anew before its call by `before`
    (tables/stacked_fallback.py). No public hook runs before a traced
    function's call (its cached trace runs without its Python code), so
    `polymorphic_function.Function.__call__`, the public entry of every
    call (TF 2.15 and 2.21: defined on `Function` itself), is wrapped. So
    is `ConcreteFunction.__call__` (a user's call of a concrete function;
    a `tf.function`'s own calls and the coordinator's closures run its
    trace without it), with ``before_concrete(concrete)``: a trace cannot
    be traced again, but its error can name why. Its class is that of a
    concrete function (TF 2.15: `concrete_function.ConcreteFunction`, as
    in 2.21), found without a private import. Applied through
    `_internal/patches.py` ("retrace_after_split") only once a split
    emptied storage.

    Args:
        before: Called with the `tf.function`, its positional arguments
            (a tuple) and its keyword arguments (a dict); may raise.
        before_concrete: Called with the `ConcreteFunction`; may raise.

    Returns:
        The undo: puts the original `__call__`s back.
    """
    cls = tf_internal.polymorphic_function.Function
    concrete_cls = type(cls(lambda: 0, "probe").get_concrete_function())
    originals = [(cls, vars(cls)["__call__"]),
                 (concrete_cls, vars(concrete_cls)["__call__"])]

    @functools.wraps(originals[0][1])
    def __call__(self, *args, **kwds):
        before(self, args, kwds)
        return originals[0][1](self, *args, **kwds)

    @functools.wraps(originals[1][1])
    def concrete_call(self, *args, **kwargs):
        before_concrete(self)
        return originals[1][1](self, *args, **kwargs)

    cls.__call__ = __call__
    concrete_cls.__call__ = concrete_call

    def undo():
        for owner, original in originals:
            owner.__call__ = original

    return undo


def traces_of_function(function) -> list:
    """Every trace a `tf.function` keeps (its cache and its first trace); a concrete function.

    TF 2.15-2.21: `_function_cache.values()` is what
    `Function._list_all_concrete_functions` returns, without its tracing of
    an input signature not called yet.

    Args:
        function: A `tf.function` or a `ConcreteFunction` (anything else: none).

    Returns:
        The `ConcreteFunction`s, each once.
    """
    if not isinstance(function, tf_internal.polymorphic_function.Function):
        return [function] if hasattr(function, "graph") else []  # A ConcreteFunction.
    # pylint: disable-next=protected-access
    found = list(function._function_cache.values()) + [first_trace_of(function)]
    return list({id(c): c for c in found if c is not None}.values())


def first_trace_of(function) -> Optional[Any]:
    """A `tf.function`'s first (variable-creating) trace, or None (TF 2.15-2.21).

    It is kept apart from the traces its calls run when the first call made
    variables; it holds its graph as long as the function lives.
    """
    return getattr(function, "_concrete_variable_creation_fn", None)


def closure_concrete_function(closure) -> Optional[Any]:
    """Closure's `_concrete_function` (the traced function), or None (TF 2.15-2.21)."""
    return getattr(closure, "_concrete_function", None)


def select_worker_slice(worker_index: int, structured):
    """cluster_coordinator's `_select_worker_slice`: a worker's part of per-worker arguments
    (TF 2.15-2.21).
    """
    return cluster_coordinator._select_worker_slice(worker_index, structured)  # pylint: disable=protected-access


def error_from_remote_values(structured) -> Optional[BaseException]:
    """cluster_coordinator's `_get_error_from_remote_values`: the error an input RemoteValue
    holds, if any (TF 2.15-2.21).
    """
    return cluster_coordinator._get_error_from_remote_values(structured)  # pylint: disable=protected-access


def remote_value_set_error(remote, error: BaseException) -> None:
    """RemoteValueImpl's `_set_error`: the value fails with `error` (TF 2.15-2.21)."""
    remote._set_error(error)  # pylint: disable=protected-access


def remote_value_set_values(remote, values) -> None:
    """RemoteValueImpl's `_set_values`: the value is ready (TF 2.15-2.21)."""
    remote._set_values(values)  # pylint: disable=protected-access


def remote_value_status(remote):
    """RemoteValueImpl's `_status` (None until it is ready or failed; TF 2.15-2.21)."""
    return remote._status  # pylint: disable=protected-access


def per_worker_dataset_fn(per_worker) -> Optional[Callable]:
    """PerWorkerDatasetFromDatasetFunction's `_dataset_fn`, or None (TF 2.15-2.21)."""
    return getattr(per_worker, "_dataset_fn", None)


def original_dataset_fn(dataset_fn) -> Callable:
    """The user's dataset function behind TF's wrapper (`_original_dataset`), else itself
    (TF 2.15-2.21).
    """
    return getattr(dataset_fn, "_original_dataset", dataset_fn)


def takes_no_required_args(fn) -> bool:
    """Whether `fn` can be called with no arguments (a Variable's `initial_value` callable).

    Used where a table's initial value is wrapped (sharding, half precision)
    to tell an initializer of no arguments from one that needs shape/dtype.
    """
    try:
        inspect.signature(fn).bind()
        return True
    except TypeError:
        return False
    except ValueError:  # No signature (builtin): assume a zero-argument callable.
        return True
