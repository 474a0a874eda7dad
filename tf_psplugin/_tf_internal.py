"""The one place where tf_psplugin touches private TensorFlow APIs.

The public `tf.distribute` surface has no hooks for "some variables on PS,
others replicated on workers, kept in sync by collectives", so the strategy
subclasses ParameterServerStrategy internals. Every private symbol the
plugin uses is imported here, with the reason, so that a TF upgrade has one
file to audit. Checked against TF 2.15.1 and the 2.16-2.21 line (same module
paths).
"""

import importlib

# ParameterServerStrategyV2 and its Extended: we subclass both (there is no
# public extension point for variable creation or reduction). connection.py
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

# Resource variable helpers used by the replicated variable type.
from tensorflow.python.ops import resource_variable_ops  # noqa: F401

# Merge-call and update contexts for the strategy's Extended overrides.
from tensorflow.python.distribute import distribute_lib  # noqa: F401

# input_util builds distributed datasets; our strategy builds them with one
# replica per worker (no re-batching) while num_replicas_in_sync = workers.
from tensorflow.python.distribute import input_util  # noqa: F401

# ops.inside_function tells whether we are tracing (dataset build timing).
from tensorflow.python.framework import ops  # noqa: F401

# Table internals (sharding.py), checked on TF 2.15.1 and 2.21.0:
# * sharded_variable: ShardedVariableSpec (our table's TypeSpec extends it), and
#   TF's own v1 safe-lookup dispatch target, which ours must take precedence over.
# * resource_variable_ops.VariableSpec: the component spec of that TypeSpec.
# * trackable base VARIABLE_VALUE_KEY: the attribute name a variable saves under.
# * saveable_object SaveableObject/SaveSpec: lazy, sliced checkpoint values (no
#   public way to write one logical row range of a table per shard).
from tensorflow.python.trackable import base as trackable_base  # noqa: F401
from tensorflow.python.training.saving import saveable_object  # noqa: F401

# A variable created by a checkpoint restore gets this initial value (restore-
# on-create); table creation must keep it lazy. Exported only as tf.__internal__.
from tensorflow.python.trackable.base import CheckpointInitialValueCallable  # noqa: F401

# The coordinator's dispatch threads each run a synchronous eager executor, as
# the stock Worker does (no public constructor for one).
from tensorflow.python.eager import executor  # noqa: F401

# save_context tells a replicated variable that tf.saved_model.save is tracing
# it (it must then save one plain value, not per-worker replicas). Same module
# path in TF 2.15.1 and 2.21.0.
from tensorflow.python.saved_model import save_context  # noqa: F401

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



def keras_private_module(name: str):
    """Keras 2's private module `<keras package>.src.<name>` (tf.keras or tf-keras).

    Used by `progress.install_keras_hooks` and
    `epochs.install_data_handler_hook` (see the notes at the end of this
    module); checked on Keras 2.15 and tf-keras 2.16-2.21.
    """
    from tf_psplugin._compat import KERAS_PACKAGE  # pylint: disable=g-import-not-at-top

    return importlib.import_module(f"{KERAS_PACKAGE}.src.{name}")


# Private attributes (not imports) the plugin sets or reads, audited here too:
# * `StrategyExtendedV2._retrace_functions_for_each_device` (strategy.py):
#   TF's function cache (eager/polymorphic_function/function_context.py) puts
#   the calling device into a tf.function's cache key when it is True; the
#   coordinator relies on that to trace one copy of a sync step per update
#   role. Read by the same code in TF 2.15.1 and 2.21.0.
# * Closure internals `_function`, `_args`, `_kwargs`, `_output_type_spec`,
#   `_concrete_function` and `closure_queue._cancellation_mgr`
#   (coordinator.py): the stock Closure traces and wraps the function; we
#   reuse it per role and dispatch its parts ourselves.
# * `cluster_coordinator._get_error_from_remote_values` and
#   `ClosureInputError` (coordinator.py `_execute`): a per-worker input whose
#   creation failed must raise what the stock `Closure.execute_on` raises, so
#   user errors and dead workers are told apart the same way.
# * `tf.train.Checkpoint._write` overridden and `PythonState.
#   _serialize_to_tensors` extended (checkpoint_write.py): every
#   `Checkpoint.write`/`save` and `CheckpointManager.save` ends in `_write`,
#   and TF's eager multi-device save traces a new function per save that the
#   PS tasks never release (RSS grew with every checkpoint). Same signature
#   and callback handling in TF 2.15.1 and 2.21.0.
# * Keras 2 internals (not TF, same audit): `<keras>.src.engine.training.
#   _get_verbosity` and `<keras>.src.callbacks.CallbackList.
#   _add_default_callbacks` are wrapped once per process by the strategy's
#   constructor (progress.py `install_keras_hooks`), so fit/evaluate accept
#   verbose=1 and use the plugin's throttled ProgressBar under this strategy
#   only; Keras has no hook for a strategy to choose its progress bar. Same
#   names and signatures in Keras 2.15 and tf-keras 2.16-2.21.
# * Keras 2's `<keras>.src.engine.data_adapter.get_data_handler` is wrapped
#   once per process (epochs.py `install_data_handler_hook`): for a model under
#   this strategy it marks evaluation inputs (Keras passes
#   `pss_evaluation_shards` to evaluation handlers only) and sets the handler's
#   `_inferred_steps` (its epoch length) and reads its `_dataset`; Keras has no
#   hook for a strategy to say how long an epoch is. Same names in Keras 2.15
#   and tf-keras 2.16-2.21.
# * Per-worker datasets (epochs.py `SyncPerWorkerDataset`): it subclasses
#   `coordinator_values.PerWorkerDatasetFromDatasetFunction`, reads its
#   `_dataset_fn` (the traced dataset function) and calls the coordinator's
#   `_create_per_worker_resources` to run one function on every worker (the
#   public `schedule` runs on one), reading the result's `_values`: the
#   stock class creates its iterators the same way. Same in TF 2.15.1 and
#   2.21.0.
