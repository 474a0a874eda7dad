"""Estimator front-end: `RunConfig` puts tables on PS and all-reduces dense variables.

Design (TF 2.15, graph mode, between-graph replication):

* Every task runs the same script and calls
  ``tf.estimator.train_and_evaluate``. `RunConfig` resolves the cluster from
  the plugin's flags or TF_CONFIG (the first worker becomes the chief when no
  chief is given), exports it as TF_CONFIG for the estimator's distribute
  coordinator, and sets ``train_distribute`` to the plugin's strategy. PS
  tasks serve variables and block; chief and workers train; the evaluator
  evaluates every new checkpoint with a plain single-process copy of the
  estimator and never connects to the training cluster.
* The strategy is TF1 ``MultiWorkerMirroredStrategy`` (collective
  all-reduce, which Estimator drives in independent-worker mode) whose
  variable creator sends every variable the shared
  `tf_psplugin.tables.placement.PlacementPolicy` calls a table (feature-column
  ``embedding_weights``, ``embeddings``, anything created in
  `tf_psplugin.tables.placement.embedding_table_scope`, any variable of 64 MiB or
  more) to the PS tasks as contiguous row shards, one per PS task, with its
  optimizer slots beside each shard. Dense variables are replicated on the
  chief and every worker and all-reduced every step.
* Table gradients are summed on the PS in an accumulator and applied once by
  the chief (``embedding_updates="sync"``, default: the same result as one process
  on the global batch), or applied by each worker for its own batch
  (``embedding_updates="async"``). Every step ends with a barrier across workers.
* The chief writes checkpoints and summaries to ``model_dir``. A table is
  saved as slices of ONE logical tensor, so the evaluator's unsharded copy, a
  restarted job, or a job with a different number of PS tasks restore it.
* ``dense_placement="ps"`` is the explicit fallback: every variable on PS,
  asynchronous updates (TF1 ParameterServerStrategy), tables still sharded.

See docs/estimator.md for launch commands, measurements and limits.

Importing this package on TensorFlow >= 2.16 raises ImportError: ``tf.estimator``
was removed there. The rest of tf_psplugin does not import it.
"""

from tf_psplugin._internal import compat as _compat

if not _compat.HAS_ESTIMATOR:
    raise ImportError(
        "tf_psplugin.estimator needs TensorFlow 2.15.x: tf.estimator was removed in "
        f"TensorFlow 2.16, and this is TensorFlow {'.'.join(map(str, _compat.TF_VERSION))}. "
        "Fix: `pip install 'tensorflow-cpu==2.15.1' 'tensorflow-estimator==2.15.*' 'numpy<2'` "
        "for Estimator models, or use the Keras front-end of tf_psplugin on this version."
    )

from tf_psplugin.estimator._report import PlacementReportHook  # noqa: E402
from tf_psplugin.estimator._run_config import MODE_HYBRID, MODE_PS_ASYNC, RunConfig  # noqa: E402
from tf_psplugin.estimator._strategy import TABLE_UPDATE_LOCAL, TABLE_UPDATE_SYNC  # noqa: E402

__all__ = [
    "MODE_HYBRID",
    "MODE_PS_ASYNC",
    "PlacementReportHook",
    "RunConfig",
    "TABLE_UPDATE_LOCAL",
    "TABLE_UPDATE_SYNC",
]
