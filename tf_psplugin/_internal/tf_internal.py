"""The one place where tf_psplugin touches private TensorFlow APIs.

The public `tf.distribute` surface has no hooks for "some variables on PS,
others replicated on workers, kept in sync by collectives", so the strategy
subclasses ParameterServerStrategy internals. Every private module the
plugin uses is imported here, with the reason, and every private attribute of
a TF/Keras class or module it reads, sets or overrides is registered in
`PRIVATE_ATTRIBUTES` below with the class that defines it. Reads and writes
of those attributes on TF/Keras objects go through the named functions of
`tf_objects.py` next to this module; outside `_internal/`, only the plugin's
own subclasses of TF classes touch their inherited private state, through
`self`/`cls` (that is part of subclassing); runtime/strategy.py and
runtime/coordinator.py are still excepted until their class split (issue
33). A TF upgrade therefore audits `_internal/` (and, for now, those two).
tests/unit/test_tf_internal.py enforces all three and checks every entry
against the installed TF; CI runs it on TF 2.15.1 and 2.21.0 (same module
paths from 2.16 on). `_compat` refuses TF minors newer
than the last one tested.
"""

import importlib

# ParameterServerStrategyV2 and its Extended: we subclass both (there is no
# public extension point for variable creation or reduction). tf_objects.py
# also reads its `_SET_SERVER_DEF_RETRIES` (50 in TF 2.15.1 and 2.21.0), the
# retry count stock PSS gives `context.set_server_def_retries`.
from tensorflow.python.distribute import parameter_server_strategy_v2  # noqa: F401

# PerWorkerVariable is TF's "one copy per worker" variable; our replicated
# dense variable extends it (public API exposes only `per_worker_variable=True`,
# which is not trainable and does not sync with the coordinator's copy).
from tensorflow.python.distribute import ps_values  # noqa: F401

# ShardedVariable: TF's sharded table type; placement and checkpoint code must
# recognise it (it is exported only as tf.__internal__).
from tensorflow.python.distribute import sharded_variable  # noqa: F401

# Cluster coordinator internals: our coordinator subclasses ClusterCoordinator
# and dispatches one closure to every worker (the public `schedule` sends a
# function to exactly one worker). RemoteValueImpl is the only RemoteValue
# implementation; coordinator_context tells a function which worker runs it.
from tensorflow.python.distribute.coordinator import cluster_coordinator  # noqa: F401
from tensorflow.python.distribute.coordinator import coordinator_context  # noqa: F401
from tensorflow.python.distribute.coordinator import values as coordinator_values  # noqa: F401

# The eager context: collective ops need `configure_collective_ops` before the
# cluster is connected, and connecting needs device filters that let workers
# see each other (stock PSS hides workers from one another).
from tensorflow.python.eager import context  # noqa: F401
from tensorflow.python.eager import remote  # noqa: F401
from tensorflow.python.training import server_lib  # noqa: F401

# Collective ops v2: all-reduce / all-gather among the workers of the AllReduce
# group. `tf.raw_ops.CollectiveReduceV2` is public but lacks the Python
# wrapper's ordering-token and key handling.
from tensorflow.python.ops import collective_ops  # noqa: F401

# tf.function's class: a first trace that stopped to split table stacks
# (tables/stacked_updates.SplitRequired) is made a first trace again, where
# variables may be created (tf_objects.restart_first_trace), and a step whose
# traces read a split stack's old storage is traced anew (tf_objects.
# reset_traces); no public API forgets a function's traces.
from tensorflow.python.eager.polymorphic_function import polymorphic_function  # noqa: F401

# Resource variable helpers used by the replicated variable type.
from tensorflow.python.ops import resource_variable_ops  # noqa: F401

# Merge-call and update contexts for the strategy's Extended overrides.
from tensorflow.python.distribute import distribute_lib  # noqa: F401

# input_util builds distributed datasets; our strategy builds them with one
# replica per worker (no re-batching) while num_replicas_in_sync = workers.
from tensorflow.python.distribute import input_util  # noqa: F401

# input_ops.auto_shard_dataset: tf.data's auto-shard rewrite (by file, else
# by element), which MultiWorkerMirroredStrategy applies to each worker's
# input; the coordinator applies it to a Dataset it splits over the workers.
# There is no public entry point. Same in TF 2.15.1 and 2.21.0.
from tensorflow.python.distribute import input_ops  # noqa: F401

# ops.inside_function tells whether we are tracing (dataset build timing).
from tensorflow.python.framework import ops  # noqa: F401

# Table internals (tables/sharded.py), checked on TF 2.15.1 and 2.21.0:
# * sharded_variable: ShardedVariableSpec (our table's TypeSpec extends it), and
#   TF's own v1 safe-lookup dispatch target, which ours must take precedence over.
# * resource_variable_ops.VariableSpec: the component spec of that TypeSpec.
# * trackable base VARIABLE_VALUE_KEY: the attribute name a variable saves under.
# * saveable_object SaveableObject/SaveSpec: lazy, sliced checkpoint values (no
#   public way to write one logical row range of a table per shard).
from tensorflow.python.trackable import base as trackable_base  # noqa: F401
from tensorflow.python.training.saving import saveable_object  # noqa: F401
# data_structures.NoDependency: a stack shard's slot a Keras (new) optimizer keeps
# in its lists for the apply, but which no checkpoint may list
# (tables/stacked_slots.py): the one way to put a value in a tracked list untracked.
from tensorflow.python.trackable import data_structures  # noqa: F401

# A variable created by a checkpoint restore gets this initial value (restore-
# on-create); table creation must keep it lazy. Exported only as tf.__internal__.
from tensorflow.python.trackable.base import CheckpointInitialValueCallable  # noqa: F401

# CancellationManager: the coordinator cancels a step's remote calls on every
# worker when one part failed with the user's error (the stock closure queue
# owns one too, with no public constructor). Same path in TF 2.15.1 and 2.21.0.
from tensorflow.python.eager import cancellation  # noqa: F401

# The coordinator's dispatch threads each run a synchronous eager executor, as
# the stock Worker does (no public constructor for one).
from tensorflow.python.eager import executor  # noqa: F401

# iterator_ops: epochs.AgreedIterator subclasses OwnedIterator (and its
# IteratorSpec) so that a traced step's `next` agrees with the other workers
# whether the epoch has ended; tf.data has no public hook into `next`.
# Same module path in TF 2.15.1 and 2.21.0.
from tensorflow.python.data.ops import iterator_ops  # noqa: F401

# save_context tells a replicated variable that tf.saved_model.save is tracing
# it (it must then save one plain value, not per-worker replicas). Same module
# path in TF 2.15.1 and 2.21.0.
from tensorflow.python.saved_model import save_context  # noqa: F401

# tape.variable_accessed: a stacked table's per-table views (stacking.
# TableView) are read through a custom-gradient gather of their stack; the
# tape must watch the view (as a variable's own read op makes it do), and
# there is no public call that tells the active tapes "this variable was
# read". Same module path in TF 2.15.1 and 2.21.0.
from tensorflow.python.eager import tape as tape_lib  # noqa: F401

# dispatch.register_dispatchable_type: TF's type-based dispatch only looks at
# arguments of registered types (CompositeTensors register themselves). A
# stacked table's views are plain `tf.Variable` subclasses; TF's sparse and
# safe lookups call `embedding_lookup` with the list of them, which must reach
# the plugin's lookup instead of TF's (which would read every view densely).
# Same module path in TF 2.15.1 and 2.21.0.
from tensorflow.python.util import dispatch as tf_dispatch  # noqa: F401

# Estimator path (TF 2.15 only; tf.estimator is gone after it): the TF1
# strategies' Extended classes, which the public tf.compat.v1 strategies do not
# let us replace. collective_all_reduce_strategy: our hybrid Extended extends
# CollectiveAllReduceExtended; parameter_server_strategy: the ps_async
# fallback's Extended extends ParameterServerExtended.
from tensorflow.python.distribute import collective_all_reduce_strategy  # noqa: F401
from tensorflow.python.distribute import parameter_server_strategy  # noqa: F401
# PartitionedVariable (estimator/_tables.py): the TF1 container Estimator code
# expects a partitioned table in; it is not exported.
from tensorflow.python.ops import variables as tf_variables  # noqa: F401

# Incremental checkpoints (incremental.py) name each table, slot and dense
# variable by the key a full checkpoint stores it under, so that a delta's
# rows go back into the same objects in any process. TF computes those keys
# (breadth-first object paths, slot keys) only in these private modules; the
# public TrackableView lists objects but not slot variables or their paths.
# Same module paths and signatures in TF 2.15.1 and 2.21.0.
from tensorflow.python.checkpoint import graph_view  # noqa: F401
from tensorflow.python.checkpoint import util as checkpoint_util  # noqa: F401
from tensorflow.python.trackable import trackable_utils  # noqa: F401



def keras_private_module(name: str):
    """Keras 2's private module `<keras package>.src.<name>` (tf.keras or tf-keras).

    Used by the patches of `keras/progress.py`, `runtime/epochs.py`,
    `sync/sparse_exchange.py`, `sync/loss_scaling.py` and `tables/fusion.py` (see `patches`)
    (their attributes are in PRIVATE_ATTRIBUTES); checked on Keras 2.15 and
    tf-keras 2.16-2.21.
    """
    from tf_psplugin._internal.compat import KERAS_PACKAGE  # pylint: disable=g-import-not-at-top

    return importlib.import_module(f"{KERAS_PACKAGE}.src.{name}")


# Private attributes: every private name of a TF/Keras class or module that
# the plugin reads, sets or overrides, with the TF/Keras class (or module) that
# defines it. tests/unit/test_tf_internal.py finds these uses in the package
# and fails on a name missing here, on a name here that nothing uses any more,
# and on a name the installed TF/Keras no longer defines at its owner; it runs
# on TF 2.15.1 (Keras 2.15) and TF 2.21.0 (tf-keras 2.21), so every entry is
# checked on both. Owners: "<module alias above>.<Class>", "keras:<module under
# keras.src>.<Class>" (tf.keras on 2.15, tf_keras later) or "tf:<public path>".
_PSV2_EXTENDED = "parameter_server_strategy_v2.ParameterServerStrategyV2Extended"
_TF1_COLLECTIVE_EXTENDED = "collective_all_reduce_strategy.CollectiveAllReduceExtended"
PRIVATE_ATTRIBUTES = {
    # -- runtime/strategy.py (its Extended's parts: runtime/variable_creation.py,
    # runtime/reduction.py, runtime/updates.py), cluster/connection.py: the hybrid ParameterServerStrategyV2. --
    # Its __init__ mirrors ParameterServerStrategyV2.__init__ (TF 2.15-2.21) but
    # installs the hybrid Extended and connects with device filters that let
    # workers see each other; connection.py mirrors `_connect_to_cluster`.
    "_verify_args_and_config": "parameter_server_strategy_v2.ParameterServerStrategyV2",
    "_connect_to_cluster": "parameter_server_strategy_v2.ParameterServerStrategyV2",
    "_extended": "distribute_lib.StrategyBase",
    "_cluster_resolver": "parameter_server_strategy_v2.ParameterServerStrategyV2",
    "_cluster_coordinator": _PSV2_EXTENDED,
    "_should_use_with_coordinator": "parameter_server_strategy_v2.ParameterServerStrategyV2",
    "_canonicalize_devices": "parameter_server_strategy_v2.ParameterServerStrategyV2",
    "_is_parameter_server_strategy_v2": "parameter_server_strategy_v2.ParameterServerStrategyV2",
    "_num_workers": _PSV2_EXTENDED,
    "_num_ps": _PSV2_EXTENDED,
    "_num_gpus_per_worker": _PSV2_EXTENDED,
    "_variable_partitioner": _PSV2_EXTENDED,
    "_SET_SERVER_DEF_RETRIES": "parameter_server_strategy_v2",
    # Extended hooks TF calls (variable creation, reduction, updates, input);
    # the stock ones place dense variables on PS and reduce on the coordinator.
    "_create_var_creator": _PSV2_EXTENDED,
    "_create_variable": _PSV2_EXTENDED,
    "_create_variable_round_robin": _PSV2_EXTENDED,
    "_reduce_to": _PSV2_EXTENDED,
    "_batch_reduce_to": "distribute_lib.StrategyExtendedV2",
    "_update": _PSV2_EXTENDED,
    "_local_results": _PSV2_EXTENDED,
    "_select_single_value": "parameter_server_strategy.ParameterServerStrategyExtended",
    "_num_replicas_in_sync": _PSV2_EXTENDED,
    "_container_strategy": "distribute_lib.StrategyExtendedV2",
    "_experimental_distribute_dataset": _PSV2_EXTENDED,
    "_distribute_datasets_from_function": _PSV2_EXTENDED,
    "_input_workers_with_options": _PSV2_EXTENDED,
    "_v": "ps_values.AggregatingVariable",  # the plain variable inside an aggregating one
    # -- sync/replicated.py: the replicated dense variable extends PerWorkerVariable
    # (public API has only per_worker_variable=True: not trainable, no sync) and
    # builds its per-worker copies and checkpoint value itself.
    "_coordinator": "ps_values.PerWorkerVariable",
    "_coordinator_instance": "ps_values.PerWorkerVariable",
    "_per_worker_vars": "ps_values.PerWorkerVariable",
    "_maybe_create_per_worker_vars": "ps_values.PerWorkerVariable",
    "_var_creator": "ps_values.PerWorkerVariable",
    "_values": "coordinator_values.PerWorkerValues",
    "_get_values": "coordinator_values.RemoteValueImpl",
    "_trainable": "resource_variable_ops.BaseResourceVariable",
    "_aggregation": "resource_variable_ops.BaseResourceVariable",
    "_synchronization": "resource_variable_ops.BaseResourceVariable",
    "_constraint": "resource_variable_ops.BaseResourceVariable",
    "_handle_name": "resource_variable_ops.BaseResourceVariable",
    "_unique_id": "resource_variable_ops.BaseResourceVariable",
    "_shared_name": "tf_variables.Variable",
    "_save_slice_info": "tf_variables.Variable",
    "_distribute_strategy": "resource_variable_ops.BaseResourceVariable",
    "_serialize_to_tensors": "trackable_base.Trackable",
    "_restore_from_tensors": "trackable_base.Trackable",
    # tables/slot_order.py: what a checkpoint lists for a Keras (new) optimizer.
    "_trackable_children": "trackable_base.Trackable",
    # -- tables/sharded.py: the table type extends ShardedVariable (lookups routed by
    # layout, sliced saveables, its TypeSpec); optimizers create its slots.
    "_variables": "sharded_variable.ShardedVariableMixin",
    "_shape": "sharded_variable.ShardedVariableMixin",
    "_dtype": "sharded_variable.ShardedVariableMixin",
    "_decompose_indices": "sharded_variable.ShardedVariableMixin",
    "_type_spec": "sharded_variable.ShardedVariable",
    "_from_components": "sharded_variable.ShardedVariableSpec",
    # -- runtime/epochs.py: AgreedIterator's `next` and TypeSpec; the per-worker
    # iterators' RemoteValues get its spec, as the stock class sets its own.
    "_next_internal": "iterator_ops.OwnedIterator",
    # -- state/input_state.py: each worker's iterator resource, serialized and
    # restored there by the public raw ops (no public handle accessor).
    "_iterator_resource": "iterator_ops.OwnedIterator",
    # The data handler's adapter: a pass over sharded data is W times fewer
    # steps than Keras's test for starting an epoch over assumes.
    "_adapter": "keras:engine.data_adapter.DataHandler",
    # runtime/updates.py: mixed precision wraps a layer's dense variable in
    # Keras's AutoCastVariable, which a legacy optimizer hands to the update.
    "_variable": "keras:mixed_precision.autocast_variable.AutoCastVariable",
    # sync/replicated.py: what AutoCastVariable asks its variable for in
    # tf.control_dependencies (a PerWorkerVariable has no _graph_element).
    "_as_graph_element": "resource_variable_ops.BaseResourceVariable",
    "_gather_saveables_for_checkpoint": "sharded_variable.ShardedVariableMixin",
    "_copy_trackable_to_cpu": "sharded_variable.ShardedVariableMixin",
    "_sharded_container": "sharded_variable.ShardedVariableMixin",  # export.py
    "_create_slots_for_sharded_variables": "keras:optimizers.legacy.optimizer_v2.OptimizerV2",
    # -- tables/stacking.py: a stacked table is a ShardedVariable over its
    # stack's shards with its own saving placeholder and TypeSpec (offsets);
    # a stack shard is an AggregatingVariable re-pointed as the stack grows;
    # tables/sharded.py registers every stacked table's slots the way Keras
    # registers a sharded variable's (one per shard, so it knows one table).
    "_saving_variable": "sharded_variable.ShardedVariableMixin",
    "_serialize": "sharded_variable.ShardedVariableSpec",
    # A stacked table's components, to tf.nest and Keras's `_track_variables`
    # (which lists them as the layer's weights), are its own views.
    "_to_components": "sharded_variable.ShardedVariableSpec",
    "_variable_specs": "sharded_variable.ShardedVariableSpec",
    "_assign_func": "ps_values.AggregatingVariable",
    "_aggregating_container": "ps_values.AggregatingVariable",
    "_get_save_slice_info": "tf_variables.Variable",  # asked by ShardedVariable's init
    "_slots": "keras:optimizers.legacy.optimizer_v2.OptimizerV2",
    # (`_weights` below, registered with its first owner, is also legacy OptimizerV2's list
    # of slots: tables/slot_split.py drops a stack's slot moved by a split from it.)
    # -- tables/lazy_adam.py: LazyAdam extends Keras's (new) Adam and reads, as
    # Adam's own update_step does, the moments Adam's build made for a variable
    # (no public accessor from a variable to its optimizer slots).
    "_index_dict": "keras:optimizers.optimizer._BaseOptimizer",
    "_var_key": "keras:optimizers.optimizer._BaseOptimizer",
    "_momentums": "keras:optimizers.adam.Adam",
    # tables/stacked_slots.py (via tf_objects): a new optimizer's slots of a
    # stack are built from the views before the merge, once (`_built`), and
    # listed per table in its `_variables` (see _internal/tf_objects.py).
    "_built": "keras:optimizers.adam.Adam",
    "_velocities": "keras:optimizers.adam.Adam",
    # -- runtime/coordinator.py (and runtime/watchdog.py, runtime/worker_datasets.py): one closure
    # dispatched to every worker. The stock Closure traces and wraps the
    # function; we reuse its parts per role and set results/errors on TF's
    # RemoteValueImpl the way Closure.execute_on does.
    "_function": "cluster_coordinator.Closure",
    "_args": "cluster_coordinator.Closure",
    "_kwargs": "cluster_coordinator.Closure",
    "_output_type_spec": "cluster_coordinator.Closure",
    "_concrete_function": "cluster_coordinator.Closure",
    # tf.function's first-trace state (tf_objects.restart_first_trace).
    "_created_variables": "polymorphic_function.Function",
    "_variable_creation_config": "polymorphic_function.Function",
    "_no_variable_creation_config": "polymorphic_function.Function",
    "_concrete_variable_creation_fn": "polymorphic_function.Function",
    "_function_cache": "polymorphic_function.Function",
    "_lock": "polymorphic_function.Function",
    "_cluster": "cluster_coordinator.ClusterCoordinator",
    "_being_scheduled": "cluster_coordinator.ClusterCoordinator",
    "_get_error_from_remote_values": "cluster_coordinator",
    "_select_worker_slice": "cluster_coordinator",
    "_set_values": "coordinator_values.RemoteValueImpl",
    "_set_error": "coordinator_values.RemoteValueImpl",
    "_error": "coordinator_values.RemoteValueImpl",
    "_status": "coordinator_values.RemoteValueImpl",
    "_status_available_event": "coordinator_values.RemoteValueImpl",
    "_wait_and_maybe_error": "coordinator_values.RemoteValueImpl",
    "_original_dataset": "coordinator_values.PerWorkerDatasetFromDataset",
    # -- runtime/epochs.py: SyncPerWorkerDataset extends PerWorkerDatasetFromDataset-
    # Function and runs one function on every worker as the stock class creates
    # its iterators; Keras's DataHandler is told the epoch length.
    "_dataset_fn": "coordinator_values.PerWorkerDatasetFromDatasetFunction",
    "_create_per_worker_resources": "cluster_coordinator.ClusterCoordinator",
    "_inferred_steps": "keras:engine.data_adapter.DataHandler",
    "_dataset": "keras:engine.data_adapter.DatasetAdapter",
    # -- keras/progress.py, keras/summaries.py, state/checkpoint.py: Keras 2 callbacks. Keras has
    # no hook for a strategy to choose its progress bar or say which callbacks
    # run per batch; `_get_verbosity` raises under ParameterServerStrategy.
    "_get_verbosity": "keras:engine.training",
    "_add_default_callbacks": "keras:callbacks.CallbackList",
    "_progbar": "keras:callbacks.CallbackList",
    "_supports_tf_logs": "keras:callbacks.Callback",
    "_implements_train_batch_hooks": "keras:callbacks.Callback",
    "_called_in_fit": "keras:callbacks.ProgbarLogger",
    "_reset_progbar": "keras:callbacks.ProgbarLogger",
    "_maybe_init_progbar": "keras:callbacks.ProgbarLogger",
    "_batch_update_progbar": "keras:callbacks.ProgbarLogger",
    # checkpoint.py: slots exist before the first restore (legacy optimizers
    # create them lazily in the first apply_gradients otherwise).
    "_create_all_weights": "keras:optimizers.legacy.optimizer_v2.OptimizerV2",
    # -- tables/stacked_updates.py: a stacked table's views' gradients become one
    # apply per stack shard, after Keras's per-variable clipping and decay.
    "_distributed_apply": "keras:optimizers.legacy.optimizer_v2.OptimizerV2",
    "_distributed_apply_gradients_fn": "keras:optimizers.optimizer.Optimizer",
    # `use_ema`: a stacked table's moving average is its rows of the stack
    # shard's, updated and written back per table (Keras has no EMA hook).
    "_update_model_variables_moving_average": "keras:optimizers.optimizer.Optimizer",
    "_overwrite_model_variables_with_average_value": "keras:optimizers.optimizer.Optimizer",
    "_model_variables_moving_average": "keras:optimizers.optimizer.Optimizer",
    "_index_dict": "keras:optimizers.optimizer.Optimizer",
    "_var_key": "keras:optimizers.optimizer.Optimizer",
    # -- sync/sparse_exchange.py: Keras's optimizer sums duplicate sparse rows
    # outside extended.update; for a gradient summed on a PS, that sum runs there.
    "_deduplicate_sparse_grad": "keras:optimizers.optimizer.Optimizer",
    # -- sync/loss_scaling.py: Keras's loss scale checks "every gradient is
    # finite" itself, per replica; here the workers agree on it in the
    # step's all-reduce (table gradients included), and Keras's check
    # returns that answer. No public hook.
    "_is_all_finite": "keras:mixed_precision.loss_scale_optimizer",
    "_DynamicLossScaleState": "keras:mixed_precision.loss_scale_optimizer",
    # -- state/checkpoint_write.py: the loss scale lists its variables per graph
    # (`_weights` by `_graph_key`); a traced checkpoint write must see the eager ones.
    # (Also legacy OptimizerV2's list of its variables, `variables()`: tables/
    # legacy_slots.py lists a stacked table's slot views there, per table.)
    "_weights": "keras:mixed_precision.loss_scale_optimizer._DynamicLossScaleState",
    "_graph_key": "tf:Graph",
    # -- tables/fusion.py: a functional model's Embedding layers at one depth
    # are looked up together; Keras has no hook that sees them before they run.
    "_run_internal_graph": "keras:engine.functional.Functional",
    "_nodes_by_depth": "keras:engine.functional.Functional",
    "_single_positional_tensor_passed": "keras:engine.node.Node",
    "_keras_inputs_ids_and_indices": "keras:engine.node.Node",
    # -- state/checkpoint_write.py: every Checkpoint.write/save ends in `_write`; TF's
    # eager multi-device save traces a new function per save that the PS tasks
    # never release (RSS grew per checkpoint), so saves go through one trace.
    "_write": "tf:train.Checkpoint",
    # -- estimator/ (TF 2.15 only): the TF1 strategies' Extended hooks.
    "_initialize_multi_worker": _TF1_COLLECTIVE_EXTENDED,
    "_configure": _TF1_COLLECTIVE_EXTENDED,
    "_update_config_proto": _TF1_COLLECTIVE_EXTENDED,
    "_cluster_spec": _TF1_COLLECTIVE_EXTENDED,
    "_is_chief": _TF1_COLLECTIVE_EXTENDED,
    "_call_for_each_replica": _TF1_COLLECTIVE_EXTENDED,
    "_make_input_fn_iterator": _TF1_COLLECTIVE_EXTENDED,
    "_validate_colocate_with_variable": _TF1_COLLECTIVE_EXTENDED,
    "_set_save_slice_info": "tf_variables.Variable",
}
