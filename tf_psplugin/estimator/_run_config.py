"""`RunConfig`: stock `tf.estimator.RunConfig` plus the plugin's cluster and strategy.

Why this module exists: Estimator takes its cluster from the ``TF_CONFIG``
environment variable and its distribution from ``train_distribute``. A user
who launches with the flag style (``--job_name=worker --task_index=0
--ps_hosts=... --worker_hosts=...``) has no TF_CONFIG, and no stock strategy
puts tables on PS while all-reducing the dense variables. This class closes
both gaps in its constructor and changes nothing else:

1. it resolves the cluster with `tf_psplugin.config.resolve` (flags first, then
   TF_CONFIG; the first worker becomes the chief when none is given) and
   exports the resolved, chief-explicit TF_CONFIG to ``os.environ`` -- the
   estimator's distribute coordinator reads that variable again inside
   ``train_and_evaluate``, so it must be set in this process;
2. it builds the hybrid strategy (or the explicit PS fallback) and passes it
   as ``train_distribute`` to the stock constructor.

Every task (chief, workers, PS, evaluator) runs the same script and calls
``tf.estimator.train_and_evaluate``: the PS tasks serve variables and block,
chief and workers train, the evaluator evaluates each new checkpoint with a
plain, undistributed copy of the estimator and never connects to the
training cluster.
"""

import dataclasses
import inspect
import json
import os
from typing import Any, Optional

import tensorflow as tf
from absl import flags, logging

from tf_psplugin._internal import deprecation as _deprecation
from tf_psplugin.cluster import config as config_lib
from tf_psplugin.cluster import flags as flags_lib
from tf_psplugin.estimator import _strategy
from tf_psplugin.tables import placement as placement_lib

MODE_HYBRID = "hybrid"
MODE_PS_ASYNC = "ps_async"
MODES = (MODE_HYBRID, MODE_PS_ASYNC)

# The Keras front-end's names (`HybridParameterServerStrategy`) are the ones:
# dense_placement "allreduce"/"ps" is what `mode` "hybrid"/"ps_async" was,
# embedding_updates "sync"/"async" what `table_update` "sync"/"local" was.
DENSE_PLACEMENT_TO_MODE = {"allreduce": MODE_HYBRID, "ps": MODE_PS_ASYNC}
EMBEDDING_UPDATES_TO_TABLE_UPDATE = {"sync": _strategy.TABLE_UPDATE_SYNC,
                                     "async": _strategy.TABLE_UPDATE_LOCAL}


# The stock constructor's sentinel for "use the default checkpoint interval";
# read from its signature instead of importing the private module constant.
_USE_DEFAULT = inspect.signature(tf.estimator.RunConfig.__init__).parameters[
    "save_checkpoints_steps"
].default


def _resolve_cluster(
    cluster: Optional[config_lib.ClusterConfig],
    flag_values: Optional[flags.FlagValues],
) -> Optional[config_lib.ClusterConfig]:
    """Returns this task's cluster config, or None when there is no cluster.

    No cluster means neither ``--job_name`` nor TF_CONFIG is set: a local,
    single-process run, as with the stock RunConfig. Anything given but
    invalid raises.
    """
    if cluster is not None:
        return cluster
    fv = flags_lib.FLAGS if flag_values is None else flag_values
    try:
        return flags_lib.resolve(flag_values=flag_values)
    except config_lib.ConfigError as e:
        job_name = fv["job_name"].value if "job_name" in fv else None
        nothing_given = (
            e.field == "TF_CONFIG"
            and not os.environ.get("TF_CONFIG", "").strip()
            and not job_name
        )
        if nothing_given:
            return None
        raise


@dataclasses.dataclass(frozen=True)
class _Settings:
    """The plugin's part of a RunConfig; immutable, so copies share it.

    Estimator deep-copies its RunConfig (``replace``, the distribute
    coordinator); `ClusterConfig` holds a read-only mapping that cannot be
    deep-copied, and need not be.
    """

    mode: str
    table_update: str
    policy: placement_lib.PlacementPolicy
    cluster: Optional[config_lib.ClusterConfig]

    def __deepcopy__(self, memo):
        return self


class RunConfig(tf.estimator.RunConfig):
    """Drop-in `tf.estimator.RunConfig` with tables on PS and dense all-reduce.

    Same arguments as `tf.estimator.RunConfig` (except ``train_distribute``,
    which this class provides), plus the keyword-only placement options.
    With no cluster configured it behaves exactly like the stock class.

    Example (every task runs this; the role comes from TF_CONFIG or flags):

    ```python
    import tensorflow as tf
    import tf_psplugin.estimator

    config = tf_psplugin.estimator.RunConfig(model_dir="/shared/run1",
                                             save_checkpoints_steps=100)
    estimator = tf.estimator.DNNLinearCombinedClassifier(
        linear_feature_columns=wide, dnn_feature_columns=deep,
        dnn_hidden_units=[64, 32], config=config)
    tf.estimator.train_and_evaluate(
        estimator,
        tf.estimator.TrainSpec(train_input_fn, max_steps=1000),
        tf.estimator.EvalSpec(eval_input_fn, steps=10, throttle_secs=0))
    ```

    Keyword-only args (named as in `HybridParameterServerStrategy`):
        dense_placement: ``"allreduce"`` (default): embedding tables sharded
            over the PS tasks, dense variables replicated on chief and
            workers and kept in sync by collective all-reduce. ``"ps"``: the
            explicit fallback -- every variable on PS, asynchronous updates
            (TF1 ParameterServerStrategy), tables still sharded.
        embedding_updates: With ``dense_placement="allreduce"`` only.
            ``"sync"`` (default): every worker's table gradient is summed on
            the PS and applied once by the chief, so a step equals
            single-process training on the global batch. ``"async"``: each
            worker applies its own sparse gradient (less work for the
            chief; exact for SGD, approximate for adaptive optimizers).
        placement: The table-vs-dense rule; default
            `tf_psplugin.PlacementPolicy()`.
        cluster: An explicit `tf_psplugin.config.ClusterConfig`; default:
            resolved from flags (``flag_values``) or TF_CONFIG.
        flag_values: The absl `FlagValues` on which the script registered the
            plugin's flags with `tf_psplugin.config.define_flags`.
        mode: Deprecated name of `dense_placement` (``"hybrid"`` is
            ``"allreduce"``, ``"ps_async"`` is ``"ps"``).
        table_update: Deprecated name of `embedding_updates` (``"local"`` is
            ``"async"``).
        placement_policy: Deprecated name of `placement`.

    Raises:
        ValueError: on ``train_distribute``/``device_fn`` (the plugin owns
            placement), an unknown placement or update value, or a
            deprecated keyword given with its new name.
        tf_psplugin.config.ConfigError: if the cluster flags or TF_CONFIG are
            invalid.
    """

    def __init__(
        self,
        model_dir=None,
        tf_random_seed=None,
        save_summary_steps=100,
        save_checkpoints_steps=_USE_DEFAULT,
        save_checkpoints_secs=_USE_DEFAULT,
        session_config=None,
        keep_checkpoint_max=5,
        keep_checkpoint_every_n_hours=10000,
        log_step_count_steps=100,
        train_distribute=None,
        device_fn=None,
        protocol=None,
        eval_distribute=None,
        experimental_distribute=None,
        experimental_max_worker_delay_secs=None,
        session_creation_timeout_secs=7200,
        checkpoint_save_graph_def=True,
        *,
        dense_placement: Optional[str] = None,
        embedding_updates: Optional[str] = None,
        placement: Optional[placement_lib.PlacementPolicy] = None,
        cluster: Optional[config_lib.ClusterConfig] = None,
        flag_values: Optional[flags.FlagValues] = None,
        mode: Any = _deprecation.UNSET,
        table_update: Any = _deprecation.UNSET,
        placement_policy: Any = _deprecation.UNSET,
    ):
        if dense_placement is not None:
            if dense_placement not in DENSE_PLACEMENT_TO_MODE:
                raise ValueError(
                    f"RunConfig.dense_placement: unknown value {dense_placement!r}. Fix: use "
                    f"one of {tuple(DENSE_PLACEMENT_TO_MODE)}.")
            dense_placement = DENSE_PLACEMENT_TO_MODE[dense_placement]
        if embedding_updates is not None:
            if embedding_updates not in EMBEDDING_UPDATES_TO_TABLE_UPDATE:
                raise ValueError(
                    f"RunConfig.embedding_updates: unknown value {embedding_updates!r}. Fix: "
                    f"use one of {tuple(EMBEDDING_UPDATES_TO_TABLE_UPDATE)}.")
            embedding_updates = EMBEDDING_UPDATES_TO_TABLE_UPDATE[embedding_updates]
        owner = "tf_psplugin.estimator.RunConfig"
        mode = _deprecation.renamed(owner, "mode", mode, "dense_placement", dense_placement,
                                    None) or MODE_HYBRID
        table_update = _deprecation.renamed(owner, "table_update", table_update,
                                            "embedding_updates", embedding_updates,
                                            None) or _strategy.TABLE_UPDATE_SYNC
        placement = _deprecation.renamed(owner, "placement_policy", placement_policy,
                                         "placement", placement, None)
        if mode not in MODES:
            raise ValueError(f"RunConfig.mode: unknown mode {mode!r}. Fix: use one of {MODES}.")
        if table_update not in _strategy.TABLE_UPDATES:
            raise ValueError(
                f"RunConfig.table_update: unknown value {table_update!r}. "
                f"Fix: use one of {_strategy.TABLE_UPDATES}."
            )
        if train_distribute is not None or experimental_distribute is not None:
            raise ValueError(
                "RunConfig.train_distribute: tf_psplugin.estimator.RunConfig provides the "
                "strategy itself. Fix: drop train_distribute/experimental_distribute, or use "
                "tf.estimator.RunConfig for a stock strategy."
            )
        if device_fn is not None:
            raise ValueError(
                "RunConfig.device_fn: the plugin places variables itself (tables on PS, dense "
                "on workers) and Estimator ignores device_fn with a strategy. Fix: drop "
                "device_fn, or use tf.estimator.RunConfig(device_fn=...) for manual placement."
            )
        policy = placement or placement_lib.PlacementPolicy()
        resolved = _resolve_cluster(cluster, flag_values)
        strategy = None
        if resolved is not None:
            # tf_psplugin.config guarantees a chief and at least one PS task.
            num_training = len(resolved.cluster.get("chief", ())) + resolved.num_workers
            if mode == MODE_PS_ASYNC:
                logging.warning(
                    "tf_psplugin.estimator: mode='ps_async' (fallback): EVERY variable lives on "
                    "the PS tasks and each worker applies its own gradients asynchronously; "
                    "dense variables are not replicated or all-reduced. Use mode='hybrid' "
                    "unless the model cannot run in it (docs/estimator.md, Limits)."
                )
            os.environ["TF_CONFIG"] = json.dumps(resolved.tf_config())
            _strategy.log_mode(mode, table_update, resolved.num_ps, num_training)
            strategy = _strategy.make_strategy(mode, policy, table_update)
        self._tf_psplugin = _Settings(mode, table_update, policy, resolved)
        super().__init__(
            model_dir=model_dir,
            tf_random_seed=tf_random_seed,
            save_summary_steps=save_summary_steps,
            save_checkpoints_steps=save_checkpoints_steps,
            save_checkpoints_secs=save_checkpoints_secs,
            session_config=session_config,
            keep_checkpoint_max=keep_checkpoint_max,
            keep_checkpoint_every_n_hours=keep_checkpoint_every_n_hours,
            log_step_count_steps=log_step_count_steps,
            train_distribute=strategy,
            device_fn=None,
            protocol=protocol,
            eval_distribute=eval_distribute,
            experimental_distribute=None,
            experimental_max_worker_delay_secs=experimental_max_worker_delay_secs,
            session_creation_timeout_secs=session_creation_timeout_secs,
            checkpoint_save_graph_def=checkpoint_save_graph_def,
        )

    @property
    def placement_mode(self) -> str:
        """``"hybrid"`` or ``"ps_async"``."""
        return self._tf_psplugin.mode

    @property
    def dense_placement(self) -> str:
        """``"allreduce"`` or ``"ps"`` (the Keras front-end's names)."""
        return {m: d for d, m in DENSE_PLACEMENT_TO_MODE.items()}[self._tf_psplugin.mode]

    @property
    def embedding_updates(self) -> str:
        """``"sync"`` or ``"async"`` (the Keras front-end's names)."""
        return {t: e for e, t in EMBEDDING_UPDATES_TO_TABLE_UPDATE.items()}[
            self._tf_psplugin.table_update]

    @property
    def placement(self) -> placement_lib.PlacementPolicy:
        """The table-vs-dense rule in use."""
        return self._tf_psplugin.policy

    @property
    def table_update(self) -> str:
        """Deprecated name: ``"sync"`` or ``"local"`` (`embedding_updates` "async")."""
        return self._tf_psplugin.table_update

    @property
    def placement_policy(self) -> placement_lib.PlacementPolicy:
        """Deprecated name of `placement`."""
        return self._tf_psplugin.policy

    @property
    def cluster(self) -> Optional[config_lib.ClusterConfig]:
        """This task's resolved cluster, or None for a local run."""
        return self._tf_psplugin.cluster
