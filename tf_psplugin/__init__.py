"""tf_psplugin: embedding tables on parameter servers, dense variables in AllReduce.

The public API is listed here and only here (see `__all__`). The command-line
modules `tf_psplugin.config`, `tf_psplugin.server`, `tf_psplugin.launch`,
the opt-in in-process recovery `tf_psplugin.elastic`, the Keras layers in
`tf_psplugin.layers` (`DynamicEmbedding`), the data helpers in
`tf_psplugin.data` and the test helpers in `tf_psplugin.testing` are public
too; everything else is private and may change.

Importing this package raises ImportError when `tf.keras` is Keras 3, which
has no ParameterServerStrategy; the message says what to install.
"""

from tf_psplugin import _compat  # noqa: F401  (raises ImportError on Keras 3)
from tf_psplugin._version import __version__
from tf_psplugin.checkpoint import (CheckpointError, CheckpointInfo, CheckpointManager,
                                    ChiefCheckpoint, build_optimizer_slots, latest_checkpoint,
                                    list_checkpoints, load_into)
from tf_psplugin.config import ClusterConfig, ConfigError
from tf_psplugin.config import resolve as resolve_cluster
from tf_psplugin.coordinator import HybridClusterCoordinator
from tf_psplugin.evaluator import EvaluatorError, run_evaluator, wait_for_evaluation
from tf_psplugin.export import ExportError, export_from_checkpoint, export_saved_model
from tf_psplugin import elastic
from tf_psplugin import layers
from tf_psplugin.failover import (RESTART_EXIT_CODE, FailoverError, FailoverPolicy,
                                  TaskFailedError)
from tf_psplugin.model_dir import ModelDirError
from tf_psplugin.options import HybridOptions
from tf_psplugin.placement import PlacementPolicy, embedding_table_scope
from tf_psplugin.progress import ProgressBar
from tf_psplugin.connection import TasksUnreachableError
from tf_psplugin.strategy import HybridParameterServerStrategy, StrategyError
from tf_psplugin.summaries import TrainingSummaries
from tf_psplugin.variables import ReplicatedVariable, current_worker_index



def start_server(config=None, argv=None):
    """Starts this task's role; see `tf_psplugin.server.start`.

    On a ps or worker task it serves and never returns; on the chief or the
    evaluator it returns the task's `ClusterConfig`. Call it first in every
    training script so the same script runs under every role.
    """
    # Imported here so `python -m tf_psplugin.server` does not find the module
    # already imported by the package (runpy warns about that).
    from tf_psplugin import server  # pylint: disable=g-import-not-at-top

    return server.start(config=config, argv=argv)


__all__ = [
    "CheckpointError",
    "CheckpointInfo",
    "CheckpointManager",
    "ChiefCheckpoint",
    "ClusterConfig",
    "ConfigError",
    "EvaluatorError",
    "ExportError",
    "FailoverError",
    "FailoverPolicy",
    "HybridClusterCoordinator",
    "HybridOptions",
    "HybridParameterServerStrategy",
    "ModelDirError",
    "PlacementPolicy",
    "ProgressBar",
    "RESTART_EXIT_CODE",
    "ReplicatedVariable",
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
    "latest_checkpoint",
    "list_checkpoints",
    "load_into",
    "resolve_cluster",
    "run_evaluator",
    "start_server",
    "wait_for_evaluation",
]
