"""tf_psplugin: embedding tables on parameter servers, dense variables in AllReduce.

The public API is listed here and only here (see `__all__`: what users call).
Also importable from here, for compatibility, but not in `__all__`: the
types a program meets without constructing them (`HybridClusterCoordinator`,
which `tf.distribute.experimental.coordinator.ClusterCoordinator(strategy)`
returns; `ReplicatedVariable`, the type of dense variables) and the
deprecated names `CheckpointManager` (now `ChiefCheckpointManager`) and
`latest_checkpoint` (now `latest_checkpoint_info`), which shadowed
`tf.train`'s names with other contracts (CHANGELOG.md). The command-line
modules `tf_psplugin.config`, `tf_psplugin.server`, `tf_psplugin.launch`,
the opt-in in-process recovery `tf_psplugin.elastic`, the Keras layers in
`tf_psplugin.layers` (`DynamicEmbedding`), every public exception in
`tf_psplugin.errors`, the data helpers in `tf_psplugin.data`, the test
helpers in `tf_psplugin.testing` and the Estimator front-end in
`tf_psplugin.estimator` are public too; everything else is private and may
change.

The private code is in subpackages by layer, each importing only from the
layers below it (`tests/unit/test_package_layers.py` checks this):
`_internal` (TF adapter, patches, compat) < `cluster` < `sync` < `tables` <
`state` < `fault` < `keras` < `runtime` (the strategy and coordinator).
See docs/modules.md.

Importing this package raises ImportError when `tf.keras` is Keras 3, which
has no ParameterServerStrategy; the message says what to install.
"""

from tf_psplugin._internal import compat as _compat  # noqa: F401  (raises ImportError on Keras 3)
from tf_psplugin._version import __version__
from tf_psplugin.cluster.config import ClusterConfig
from tf_psplugin.cluster.flags import resolve as resolve_cluster
from tf_psplugin.errors import (RESTART_EXIT_CODE, CheckpointError, ConfigError, EvaluatorError,
                                ExportError, FailoverError, ModelDirError, ServingError,
                                StackingError, StrategyError, TaskFailedError,
                                TasksUnreachableError)
from tf_psplugin.fault.failover import FailoverPolicy
from tf_psplugin.keras.checkpoint_callback import ChiefCheckpoint
from tf_psplugin.keras.progress import ProgressBar
from tf_psplugin.keras.summaries import TrainingSummaries
from tf_psplugin.runtime.coordinator import HybridClusterCoordinator
from tf_psplugin.runtime.options import HybridOptions
from tf_psplugin.runtime.strategy import HybridParameterServerStrategy
from tf_psplugin.state.checkpoint import (CheckpointInfo, CheckpointManager,
                                          ChiefCheckpointManager, build_optimizer_slots,
                                          latest_checkpoint, latest_checkpoint_info,
                                          list_checkpoints, load_into)
from tf_psplugin.state.evaluator import run_evaluator, wait_for_evaluation
from tf_psplugin.state.export import export_from_checkpoint, export_saved_model
from tf_psplugin.state.serving import ServingModel
from tf_psplugin.sync.replicated import ReplicatedVariable, current_worker_index
from tf_psplugin.tables.lazy_adam import LazyAdam
from tf_psplugin.tables.placement import PlacementPolicy, embedding_table_scope
# The public modules that are also names of this package (not the CLIs:
# `python -m tf_psplugin.config` must not find its module already imported).
from tf_psplugin import elastic, layers



def start_server(config=None, argv=None):
    """Starts this task's role; see `tf_psplugin.server.start`.

    On a ps or worker task it serves and never returns; on the chief or the
    evaluator it returns the task's `ClusterConfig`. Call it first in every
    training script so the same script runs under every role.
    """
    from tf_psplugin.cluster import server  # pylint: disable=g-import-not-at-top

    return server.start(config=config, argv=argv)


__all__ = [
    "CheckpointError",
    "CheckpointInfo",
    "ChiefCheckpoint",
    "ChiefCheckpointManager",
    "ClusterConfig",
    "ConfigError",
    "EvaluatorError",
    "ExportError",
    "FailoverError",
    "FailoverPolicy",
    "HybridOptions",
    "HybridParameterServerStrategy",
    "LazyAdam",
    "ModelDirError",
    "PlacementPolicy",
    "ProgressBar",
    "RESTART_EXIT_CODE",
    "ServingError",
    "ServingModel",
    "StackingError",
    "StrategyError",
    "TaskFailedError",
    "TasksUnreachableError",
    "TrainingSummaries",
    "__version__",
    "build_optimizer_slots",
    "current_worker_index",
    "elastic",
    "embedding_table_scope",
    "layers",
    "export_from_checkpoint",
    "export_saved_model",
    "latest_checkpoint_info",
    "list_checkpoints",
    "load_into",
    "resolve_cluster",
    "run_evaluator",
    "start_server",
    "wait_for_evaluation",
]
