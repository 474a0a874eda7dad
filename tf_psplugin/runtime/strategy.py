"""`HybridParameterServerStrategy`: tables on PS, dense variables in AllReduce.

A subclass of TF's ParameterServerStrategy (the chief is the single client
running a coordinator) that changes three things:

* **Placement** (`_create_variable`): embedding tables (see `placement.py`)
  are sharded across the PS tasks (one shard per task, or as many as the
  `variable_partitioner` says); every other variable becomes a
  `ReplicatedVariable` with one copy per worker. Metric accumulators and
  batch-norm statistics (``ON_READ`` variables) are replicated too; their
  in-step updates are applied with the deltas all-reduced, packed into the
  gradient all-reduce or into one all-reduce at their next read
  (`on_read_updates.py`), so every replica holds the global value (exact
  metrics, no per-step PS traffic).
* **Reduction** (`_batch_reduce_to`, `_reduce_to`): while a synchronous
  step is traced, dense gradients are summed across workers with one packed
  collective all-reduce; embedding gradients are handed to the PS that holds
  their shard and summed there (``"sync"``, see `sparse_exchange.py`) or
  left local (``"async"``). `num_replicas_in_sync` is the number of workers,
  so Keras scales losses correctly.
* **Updates** (`_update`): a replicated variable is updated locally on each
  worker (identically, since the gradients are identical). In ``"sync"``
  mode each PS shard is updated by exactly one worker (worker `p mod n`
  updates the shards on ps:p) with the global gradient,
  then every worker passes a collective barrier before it may read tables
  again.

The coordinator (`coordinator.py`) runs every scheduled function on every
worker, which is what makes the collectives meet. It traces one copy of the
step per update role (`update_role`, `_retrace_functions_for_each_device`),
so a shard's update is simply absent from the other workers' graphs: no
per-step `tf.cond`.

With ``dense_placement="ps"`` the strategy is stock asynchronous PSS (plus
the plugin's table sharding), for comparison and for fully-async users.
"""

import dataclasses
import functools
import random
from typing import List, NamedTuple, Optional

import tensorflow as tf

from tf_psplugin._internal import patches
from tf_psplugin._internal import verbosity as verbosity_lib
from tf_psplugin._internal.tf_internal import distribute_lib, input_util, ops
from tf_psplugin._internal.tf_internal import parameter_server_strategy_v2
from tf_psplugin._internal.tf_internal import ps_values
from tf_psplugin._internal.tf_internal import sharded_variable
from tf_psplugin.cluster import config as config_lib
from tf_psplugin.cluster import connection
from tf_psplugin.cluster.connection import StrategyError
from tf_psplugin.cluster.devices import ps_device
from tf_psplugin.fault import failover as failover_lib
from tf_psplugin.keras import progress as progress_lib
from tf_psplugin.runtime.coordinator import HybridClusterCoordinator
from tf_psplugin.sync import collectives as collectives_lib
from tf_psplugin.sync import on_read_updates as on_read_updates_lib
from tf_psplugin.sync import replicated as variables_lib
from tf_psplugin.sync import sparse_exchange as sparse_exchange_lib
from tf_psplugin.tables import host as table_host
from tf_psplugin.tables import placement as placement_lib
from tf_psplugin.tables import shard_init
from tf_psplugin.tables import sharded as sharding
from tf_psplugin.tables import stacked_updates
from tf_psplugin.tables import stacking as table_stacking

EMBEDDING_UPDATES = ("sync", "async")
DENSE_PLACEMENTS = ("allreduce", "ps")


# Not the global `random`: `tf.keras.utils.set_random_seed` seeds that, and a
# restarted chief would then draw the same "fresh" collective group key.
_FRESH = random.SystemRandom()


class HybridParameterServerStrategy(parameter_server_strategy_v2.ParameterServerStrategyV2):
    """ParameterServerStrategy with PS-sharded tables and all-reduced dense variables.

    Construct it on the chief; workers and PS tasks run
    `tf_psplugin.start_server()` (which blocks) before they get here.

    Example:

    ```python
    import tensorflow as tf
    import tf_psplugin

    tf_psplugin.start_server()              # ps/worker tasks block here
    strategy = tf_psplugin.HybridParameterServerStrategy()
    with strategy.scope():
        model = tf.keras.Sequential([
            tf.keras.layers.Embedding(1_000_000, 16),   # sharded on the PS tasks
            tf.keras.layers.GlobalAveragePooling1D(),
            tf.keras.layers.Dense(1),                  # replicated on the workers
        ])
        model.compile(tf.keras.optimizers.legacy.Adagrad(0.1), "mse")
    model.fit(dataset, epochs=2, steps_per_epoch=100)
    ```

    The first two arguments are stock ParameterServerStrategy's (the same in
    TF 2.15 and 2.21), so ``HybridParameterServerStrategy(resolver,
    variable_partitioner=...)`` is stock code with the class renamed; the rest
    are keywords of the plugin (docs/coming_from_stock_pss.md lists what
    behaves differently).

    Args:
        cluster_resolver: A cluster resolver for the training cluster. If
            None, `config` is used, else the cluster is resolved from the
            plugin's flags or `TF_CONFIG` (`tf_psplugin.config.resolve()`).
        variable_partitioner: As stock's: a
            `tf.distribute.experimental.partitioners.Partitioner` (or any
            callable ``(shape, dtype) -> [n, 1, ...]``) that decides how many
            shards each embedding table gets (first axis only; capped at its
            rows; ``n == 1`` keeps it whole on one PS, round-robin). Shard
            ``s`` goes to ps ``s mod num_ps``, so more shards than PS tasks
            is fine. None (default): one shard per PS task. It does not
            apply to dense variables, which are not on the PS (one replica
            per worker; with ``dense_placement="ps"`` they stay whole), nor
            to `layers.DynamicEmbedding`, which keeps one shard per PS.
        config: A `tf_psplugin.config.ClusterConfig` for this (chief) task.
        embedding_updates: ``"sync"`` (global sparse gradient applied once per
            step: exactly single-process training on the global batch) or
            ``"async"`` (each worker pushes its own sparse gradient).
        dense_placement: ``"allreduce"`` (replicas on workers, synchronous) or
            ``"ps"`` (stock asynchronous PSS placement of dense variables).
        placement: A `PlacementPolicy` (which variables are tables, sharding).
        sharding: Shortcut for ``placement.sharding``: ``"interleaved"``
            (default) or ``"contiguous"``.
        collective_timeout_seconds: A synchronous step that makes no progress
            on some worker for this long (a peer hung or unreachable) fails
            with `DeadlineExceededError` naming the workers, and goes through
            failover; one watchdog thread on the chief enforces it (0 = wait
            forever). Dead peers surface at once through RPC errors. Set it
            above your slowest step (`steps_per_execution` steps).
        connect_timeout_seconds: How long to wait for every worker and PS to
            accept connections before giving up with `TasksUnreachableError`,
            which names the missing tasks (tasks may start in any order);
            uncaught, the chief exits with the retryable status 138, so a
            slowly scheduled cluster is retried by the restart policy.
        failover: A `FailoverPolicy` (default: enabled). On a dead worker or
            PS the chief saves what survives and raises `TaskFailedError`;
            uncaught, it exits with status 138 so that the launcher's
            `--restart-failed` or the scheduler restarts it to resume from the
            checkpoint (see `failover.py`; `tf_psplugin.elastic.run` recovers
            in-process instead).
        log_placement: Log the placement report once, at the first step.
        sparse_exchange: How ``"sync"`` mode sums embedding gradients:
            ``"ps"`` (default: each worker sends its own to the PS holding
            the shard, where one worker's update sums them; a worker's bytes
            do not grow with the number of workers) or ``"allgather"``
            (every worker receives every other worker's gradients; kept for
            comparison, see `benchmarks.run --network`).
        pack_on_read_updates: Apply a synchronous step's updates of metric
            accumulators and batch-norm statistics with their deltas packed
            into the gradient all-reduce, or into one all-reduce when the
            step next reads them (default). False: one all-reduce per update,
            where it happens (for a custom step that updates a metric after
            its gradients and never reads it; see `on_read_updates.py`).
        fuse_lookups: Look up the sharded tables of a functional Keras
            model's `Embedding` layers together, one round trip per PS for
            all the tables of one width, instead of one per table; the rows
            and gradients are the same (see `tables/fusion.py`). Off by
            default: on loopback it was no faster (the per-table gathers and
            updates, not the transfers, cost the time; benchmarks/README).
        stack_tables: Store the embedding tables of one row width and dtype
            as one variable per PS (a stack; see `tables/stacking.py`; with
            a `variable_partitioner`, tables of one shard count share one
            variable per shard): one
            gather, one optimizer apply and one set of slots per PS and step
            instead of one per table; a functional model's lookups of one
            stack become one gather per PS (as `fuse_lookups` does). Off by
            default, because a Keras program can tell: a stacked layer's
            `weights`, `trainable` flag and regularizer cover the whole stack,
            and two models built in one scope share it (docs/api.md lists
            every difference). Turn it on for a model whose tables are all
            trainable, unregularized and unconstrained, and whose weights
            are read through checkpoints or `export.logical_weights`.

    Raises:
        StrategyError: for a cluster it cannot train on, or a process that is
            not the chief.
    """

    def __init__(self, cluster_resolver=None, variable_partitioner=None,
                 config: Optional[config_lib.ClusterConfig] = None,
                 embedding_updates: str = "sync", dense_placement: str = "allreduce",
                 placement: Optional[placement_lib.PlacementPolicy] = None,
                 sharding: Optional[str] = None, collective_timeout_seconds: float = 60.0,
                 connect_timeout_seconds: float = 300.0,
                 failover: Optional[failover_lib.FailoverPolicy] = None,
                 log_placement: bool = True, sparse_exchange: str = "ps",
                 pack_on_read_updates: bool = True, fuse_lookups: bool = False,
                 stack_tables: bool = False):
        _check_partitioner(variable_partitioner)
        if sparse_exchange not in sparse_exchange_lib.SPARSE_EXCHANGES:
            raise StrategyError(
                f"sparse_exchange={sparse_exchange!r} is not supported. Fix: use one of "
                f"{', '.join(map(repr, sparse_exchange_lib.SPARSE_EXCHANGES))}.")
        if embedding_updates not in EMBEDDING_UPDATES:
            raise StrategyError(
                f"embedding_updates={embedding_updates!r} is not supported. "
                f"Fix: use one of {', '.join(map(repr, EMBEDDING_UPDATES))}.")
        if dense_placement not in DENSE_PLACEMENTS:
            raise StrategyError(
                f"dense_placement={dense_placement!r} is not supported. "
                f"Fix: use one of {', '.join(map(repr, DENSE_PLACEMENTS))}.")
        placement = placement or placement_lib.PlacementPolicy()
        if sharding is not None:
            placement = placement_lib.PlacementPolicy(
                table_names=placement.table_names, min_table_bytes=placement.min_table_bytes,
                sharding=sharding)
        resolver = connection.resolve_cluster(cluster_resolver, config)
        spec = resolver.cluster_spec()
        num_ps = len(spec.as_dict().get("ps", []))
        num_workers = len(spec.as_dict().get("worker", []))
        if num_ps < 1:
            raise StrategyError(
                "the cluster has no PS task, so embedding tables have nowhere to live. "
                "Fix: add at least one address to 'ps' in TF_CONFIG (or --ps_hosts), "
                "or run `python -m tf_psplugin.launch --ps 2 ...` locally.")
        if num_workers < 1:
            raise StrategyError(
                "the cluster has no worker task to run training steps. Fix: add worker "
                "addresses to TF_CONFIG 'worker' (or --worker_hosts); with no chief given, "
                "the first worker becomes the chief, so give at least two worker hosts.")
        if not collective_timeout_seconds >= 0:
            raise StrategyError(
                f"collective_timeout_seconds={collective_timeout_seconds!r} must be >= 0 "
                "(0 = no limit). Fix: pass a number of seconds above your slowest step.")
        self._dense_allreduce = dense_placement == "allreduce"
        self._collective_timeout = float(collective_timeout_seconds)
        # TF logs the session config, PSS's device lists, ... at INFO: hidden by default.
        # Uncaught, TasksUnreachableError (pods still being scheduled) ends the
        # chief with the retryable status 138 and one line, not exit 1.
        patches.install("exit_on_failover_error")
        with verbosity_lib.quiet_tf_info(verbosity_lib.TF_LOGGER, verbosity_lib.ABSL_LOGGER):
            connection.wait_for_tasks(spec, connect_timeout_seconds)
            # Mirrors ParameterServerStrategyV2.__init__ (TF 2.15-2.21) but installs
            # our Extended; the parent's __init__ hard-codes its own Extended class.
            self._cluster_resolver = resolver
            self._verify_args_and_config(resolver)
            self._cluster_coordinator = None
            self._connect_to_cluster(coordinator_name="chief")
            self._extended = HybridExtended(
                self, resolver, embedding_updates=embedding_updates,
                dense_allreduce=self._dense_allreduce, placement=placement,
                collective_timeout_seconds=self._collective_timeout, log_placement=log_placement,
                sparse_exchange=sparse_exchange, pack_on_read_updates=pack_on_read_updates,
                table_partitioner=variable_partitioner)
            super(parameter_server_strategy_v2.ParameterServerStrategyV2, self).__init__(
                self._extended)
            self._should_use_with_coordinator = True
            self._canonicalize_devices = False
            self._is_parameter_server_strategy_v2 = True
            # Installing our coordinator now makes `ClusterCoordinator(strategy)`
            # (what Keras's fit/evaluate call) return it.
            coordinator = HybridClusterCoordinator(self)
        self._extended.create_step_counters()
        # fit/evaluate(verbose=1 or "auto") show tf_psplugin's ProgressBar.
        setattr(self, progress_lib.STRATEGY_MARKER, True)
        patches.install("keras_progress_bar")
        # fit/evaluate on finite data: one epoch length for every worker.
        patches.install("keras_data_handler")
        # Keras's optimizer sums duplicate sparse rows on the PS that holds them.
        patches.install("keras_dedup_on_ps")
        # A functional model's table lookups: one round trip per PS.
        self._extended.fuse_lookups = bool(fuse_lookups)
        if fuse_lookups:
            patches.install("keras_functional_fusion")
        if stack_tables:
            # A stack's tables are looked up together: one gather per PS.
            self._extended.enable_table_stacking()
            patches.install("keras_functional_fusion")
        policy = failover if failover is not None else failover_lib.FailoverPolicy()
        if policy.enabled and self._dense_allreduce:
            coordinator.failover = failover_lib.FailoverController(self, policy)
            patches.install("exit_on_failover_error")

    # -- connection ------------------------------------------------------------

    def _connect_to_cluster(self, coordinator_name: str):
        """Connects like stock PSS, but lets workers see each other (see `connection`)."""
        spec = self._cluster_resolver.cluster_spec()
        self._num_workers = len(spec.as_dict().get("worker", ()))
        self._num_ps = len(spec.as_dict().get("ps", ()))
        connection.connect(self._cluster_resolver, coordinator_name,
                           workers_see_each_other=self._dense_allreduce)

    # -- reporting -------------------------------------------------------------

    def placement_records(self) -> List[placement_lib.PlacementRecord]:
        """What was placed where: one record per variable created in scope."""
        return list(self._extended.placement_records)

    def placement_report(self) -> str:
        """Every placed variable, one line each, with shape, size and devices."""
        return placement_lib.format_report(self._extended.placement_records)

    def placement_summary(self) -> str:
        """Tables in full, the rest grouped by kind (logged once at the first step)."""
        return placement_lib.format_summary(self._extended.placement_records)

    @property
    def embedding_updates(self) -> str:
        """``"sync"`` or ``"async"``."""
        return self._extended.embedding_updates

    @property
    def dense_placement(self) -> str:
        """``"allreduce"`` or ``"ps"``."""
        return "allreduce" if self._dense_allreduce else "ps"


# The coordinator's own device (it joins the cluster as job "chief").
CHIEF_DEVICE = "/job:chief/replica:0/task:0/device:CPU:0"


class HybridExtended(parameter_server_strategy_v2.ParameterServerStrategyV2Extended,
                     table_host.TableHost):
    """The Extended half of `HybridParameterServerStrategy` (see module doc)."""

    def __init__(self, container_strategy, cluster_resolver, embedding_updates: str,
                 dense_allreduce: bool, placement: placement_lib.PlacementPolicy,
                 collective_timeout_seconds: float, log_placement: bool,
                 sparse_exchange: str = "ps", pack_on_read_updates: bool = True,
                 table_partitioner=None):
        # Stock's own partitioner stays None: the user's `variable_partitioner`
        # only decides the tables' shard counts (`_create_table`); dense and
        # other PS variables are never partitioned.
        super().__init__(container_strategy, cluster_resolver, variable_partitioner=None)
        self.table_partitioner = table_partitioner
        self.sparse_exchange = sparse_exchange
        self._gradient_queues = sparse_exchange_lib.PsGradientQueues(self._num_workers)
        self.embedding_updates = embedding_updates
        self.dense_allreduce = dense_allreduce
        self.placement = placement
        self.log_placement = log_placement
        self.synchronous_dispatch = dense_allreduce
        self.tracing_sync_step = False
        # The worker whose update role (`update_role`) a synchronous step is
        # being traced for, or None when one trace serves every worker.
        self.tracing_worker_index: Optional[int] = None
        if dense_allreduce:
            # Read by TF's function cache (function_context.make_function_context):
            # with it set, the calling device is part of a tf.function's cache
            # key, so the coordinator can trace one copy of a step per update
            # role (it calls each under that role's first worker's device) and
            # `_update` can leave a table update out of every trace but its
            # owner's.
            self._retrace_functions_for_each_device = True
        self.placement_records: List[placement_lib.PlacementRecord] = []
        self._table_shard_owner = {}  # id(shard variable or its slot) -> owning worker
        # id(table shard) -> ops its owner runs after the shard's sync update
        # (layers.DynamicEmbedding admits new keys there).
        self._after_update = {}
        # id(table shard) -> incremental.RowStamps: every optimizer apply to
        # the shard also stamps the rows it touched (incremental checkpoints).
        self._row_stamps = {}
        # Table shards whose update was traced without stamps: tracking them
        # now would miss that trace's updates.
        self._traced_without_stamps = set()
        self._creating_table = False
        self._creating_plain = False
        self._creating_internal = False
        # A fresh group key per chief process: a restarted chief must not meet
        # collective state that the workers cached for its predecessor.
        self.collective_group = collectives_lib.CollectiveGroup(
            self._num_workers, group_key=_FRESH.randint(10_000, 2**30))
        self.on_read_updates = on_read_updates_lib.OnReadUpdates(
            self.collective_group, self._num_workers, enabled=pack_on_read_updates)
        # Enforced by the coordinator's watchdog, not by the collective ops.
        self.step_timeout_seconds = float(collective_timeout_seconds)
        self.reduced_steps = None
        # Read by lookup_fusion: set by the strategy after construction.
        self.fuse_lookups = False
        self.committed_steps = None
        # Set by `enable_table_stacking` (the strategy's stack_tables=True).
        self.table_stacks: Optional[table_stacking.TableStacks] = None

    def enable_table_stacking(self) -> None:
        """Stores eligible tables in stacks from now on (see `table_stacking`)."""
        if self.table_stacks is None:
            self.table_stacks = table_stacking.TableStacks(
                shard_devices=self._table_shard_device, on_restack=self._restacked)
            # Each table's gradient (Keras sees its own rows) merged into one
            # apply per stack shard.
            patches.install("keras_stacked_updates")

    def _restacked(self, table, stack_name: str) -> None:
        """A table moved to another stack before it was made (`TableStacks.separate`)."""
        index = getattr(table, "_tf_psplugin_record", None)
        if index is not None:
            record = self.placement_records[index]
            self.placement_records[index] = dataclasses.replace(record, stack=stack_name)

    def create_step_counters(self):
        """Creates the per-worker step counters failover reads (allreduce mode).

        `reduced_steps` is incremented once the step's gradients are reduced,
        before any update; `committed_steps` once every update of the step is
        done (after the table barrier). Equal on a surviving worker means no
        step was half-applied when a peer died.
        """
        if not self.dense_allreduce:
            return
        self._creating_internal = True
        try:
            with self._container_strategy().scope():
                self.reduced_steps = tf.Variable(0, dtype=tf.int64, trainable=False,
                                                 name="tf_psplugin_reduced_steps")
                self.committed_steps = tf.Variable(0, dtype=tf.int64, trainable=False,
                                                   name="tf_psplugin_committed_steps")
        finally:
            self._creating_internal = False

    # -- replicas ---------------------------------------------------------------

    @property
    def _num_replicas_in_sync(self):
        if self.dense_allreduce:
            return self._num_workers
        return self._num_gpus_per_worker or 1

    @property
    def _sync_embeddings(self) -> bool:
        return self.embedding_updates == "sync"

    # -- variable creation ---------------------------------------------------

    def _create_var_creator(self, next_creator, **kwargs):
        if self._creating_table or self._creating_plain:
            # Table shards are plain variables on their PS (no aggregation
            # wrapper): updates to them are routed by `_update` below.
            return next_creator
        return super()._create_var_creator(next_creator, **kwargs)

    def _create_variable(self, next_creator, **kwargs):
        if kwargs.get("per_worker_variable", False):
            return super()._create_variable(next_creator, **kwargs)
        if self._creating_plain:
            return next_creator(**kwargs)
        colocate_with = kwargs.get("colocate_with", None)
        if isinstance(colocate_with, variables_lib.ReplicatedVariable):
            kwargs.pop("colocate_with")
            return self._create_replicated(next_creator, kind="dense-slot", **kwargs)
        if colocate_with is not None:
            if self.table_stacks is not None:
                # An optimizer slot of a stack: no table joins that stack now.
                self.table_stacks.seal(_unwrap(colocate_with))
            var = super()._create_variable(next_creator, **kwargs)
            kind = "table-slot" if id(_unwrap(colocate_with)) in self._table_shard_owner else "ps"
            if kind == "table-slot":
                self._table_shard_owner[id(_unwrap(var))] = self._table_shard_owner[
                    id(_unwrap(colocate_with))]
            self._record(var, kind)
            return var
        name = kwargs.get("name")
        shape, dtype = shard_init.shape_and_dtype(kwargs)
        dtype_size = dtype.size if dtype is not None else 4
        if placement_lib.in_embedding_table_scope() and (
                shape is None or not shape.rank or shape[0] is None):
            raise StrategyError(
                f"variable {name!r} with shape {shape} was created inside "
                "embedding_table_scope(), but only variables of rank >= 1 with a known first "
                "dimension can be sharded across PS tasks. Fix: create scalars and "
                "unknown-shape variables outside embedding_table_scope(), or pass an explicit "
                "`shape=` with the number of rows.")
        if shape is not None and shape.rank and shape.rank >= 1 and self.placement.is_table(
                name, shape.as_list(), dtype_size):
            return self._create_table(next_creator, **kwargs)
        if self.dense_allreduce:
            return self._create_replicated(next_creator, kind="dense",
                                           record=not self._creating_internal, **kwargs)
        var = super()._create_variable(next_creator, **kwargs)
        self._record(var, "ps")
        return var

    def _create_replicated(self, next_creator, kind: str, record: bool = True, **kwargs):
        kwargs.pop("caching_device", None)
        # The primary copy belongs on the chief even when the variable is
        # created while a step is traced under a worker's device (optimizer
        # slots are created in the first trace; see `tracing_worker_index`).
        with tf.device(CHIEF_DEVICE):
            var = variables_lib.ReplicatedVariable(
                self._container_strategy(), next_creator,
                end_of_step_fn=self._end_of_step, update_reduce_fn=self._on_read_update,
                graph_use_fn=self._on_read_use, **kwargs)
        if record:
            self._record(var, kind, devices=var.worker_devices())
        return var

    def _table_shard_device(self, shard: int) -> str:
        """Shard `shard` of an interleaved table (or stack): round-robin from ps:0.

        Every table with n shards has its shard s on the same PS, which fused
        lookups, stacks and DynamicEmbedding's admission rely on.
        """
        return ps_device(shard % self._num_ps)

    def _create_table(self, next_creator, **kwargs):
        """Creates an embedding table sharded over the PS tasks.

        One shard per PS task, or as many as `table_partitioner` says
        (`placement.table_shard_count`).
        """
        shape, dtype = shard_init.shape_and_dtype(kwargs)
        num_shards = placement_lib.table_shard_count(
            shape, dtype if dtype is not None else tf.float32, self._num_ps,
            partitioner=self.table_partitioner, name=kwargs.get("name"))
        scheme = self.placement.sharding
        unstacked = ""
        if self.table_stacks is not None:
            if scheme != placement_lib.SHARDING_INTERLEAVED:
                unstacked = f"{scheme} sharding"
            elif kwargs.get("initial_value") is None:
                unstacked = "no initial value"
            else:
                unstacked = self.table_stacks.why_not(shape, dtype, num_shards, kwargs) or ""
        if num_shards < 2:
            var = self._create_variable_round_robin(next_creator, **kwargs)
            self._table_shard_owner[id(_unwrap(var))] = self._table_shard_owner_of(var)
            self._record(var, "table", unstacked=unstacked)
            return var
        self._creating_table = True
        try:
            if (scheme == placement_lib.SHARDING_INTERLEAVED and self.table_stacks is not None
                    and kwargs.get("initial_value") is not None
                    and self.table_stacks.eligible(shape, dtype, num_shards, kwargs)):
                var = self.table_stacks.add(
                    kwargs.get("name"), shape, dtype, num_shards,
                    shard_values=functools.partial(
                        sharding.shard_value_fn, kwargs.get("initial_value"), shape, dtype,
                        num_shards=num_shards, name=kwargs.get("name")),
                    creator=functools.partial(shard_init.create_shard, next_creator, kwargs),
                    on_replace=self._replace_table_shard)
            elif scheme == placement_lib.SHARDING_INTERLEAVED:
                var = sharding.create_interleaved(
                    name=kwargs.get("name"), shape=shape, dtype=dtype,
                    initial_value=kwargs.get("initial_value"), num_shards=num_shards,
                    device_fn=self._table_shard_device,
                    creator=functools.partial(shard_init.create_shard, next_creator, kwargs))
            else:
                self._variable_partitioner = (
                    sharded_variable.FixedShardsPartitioner(num_shards))
                try:
                    var = super()._create_variable(next_creator, **kwargs)
                finally:
                    self._variable_partitioner = None
        finally:
            self._creating_table = False
        if not isinstance(var, table_stacking.StackedTable):
            # (A stack's shards are registered when they get their variables:
            # `_replace_table_shard`.)
            for shard in var.variables:
                self._table_shard_owner[id(_unwrap(shard))] = self._table_shard_owner_of(shard)
        else:
            # Its views: what Keras lists, reduces and (weight decay) updates.
            for view in var.views:
                self._table_shard_owner[id(view)] = self._table_shard_owner_of(view)
        self._record(var, "table", devices=[v.device for v in var.variables],
                     stack=getattr(getattr(var, "stack", None), "name", ""), unstacked=unstacked)
        if isinstance(var, table_stacking.StackedTable):
            var._tf_psplugin_record = len(self.placement_records) - 1  # For `_restacked`.
        return var

    def _replace_table_shard(self, old, new) -> None:
        """A stack shard got its variable, or a bigger one than `old` (table_stacking)."""
        if old is not None:
            self._table_shard_owner.pop(id(old), None)
        if new is not None:  # (None: the stack was split and its variable freed.)
            self._table_shard_owner[id(new)] = self._table_shard_owner_of(new)

    def _table_shard_owner_of(self, var) -> int:
        """The worker that applies sync updates to a table shard: its PS index mod workers.

        With as many workers as PS tasks, worker i updates exactly the shards
        on ps:i; with more workers than PS tasks the extra workers update
        nothing and share one trace of the step (see `update_role`).
        """
        return self._owner_of_ps(tf.DeviceSpec.from_string(_unwrap(var).device or "").task or 0)

    def _owner_of_ps(self, ps_index: int) -> int:
        """The worker that applies sync updates to the table shards on ps:`ps_index`."""
        return int(ps_index) % max(self._num_workers, 1)

    def update_role(self, worker_index: int) -> tuple:
        """The PS tasks whose table shards `worker_index` updates in sync mode.

        Workers with equal roles run the same trace of a synchronous step,
        so a step is traced at most min(workers, PS) + 1 times.
        """
        if not self._sync_embeddings:
            return ()
        return tuple(p for p in range(self._num_ps) if self._owner_of_ps(p) == worker_index)

    def run_after_update(self, shard, fn) -> None:
        """Makes the worker that updates `shard` in a sync step also run `fn()`.

        `fn` builds ops (it returns an op or None) that run after the shard's
        optimizer update and before the end-of-step barrier, in the updating
        worker's trace only: every worker's forward pass of the step is done
        by then, and none of the next step has started. In any other mode
        `fn` is never called (see `admits_after_update`).
        """
        if id(_unwrap(shard)) not in self._table_shard_owner:
            raise StrategyError(f"run_after_update: {getattr(shard, 'name', shard)!r} is not "
                                "a table shard of this strategy.")
        self._after_update[id(_unwrap(shard))] = fn

    def track_updated_rows(self, shard, stamps) -> None:
        """Makes every optimizer apply to table `shard` also call `stamps.mark(grad)`.

        Used by incremental checkpoints (`incremental.RowStamps`): the mark is
        one scatter on the shard's own PS, in the same trace as the update.
        Must be called before any step that updates the shard is traced.

        Raises:
            StrategyError: `shard` is not a table shard, is tracked already, or
                a step updating it was already traced (its updates would go
                unrecorded).
        """
        key = id(_unwrap(shard))
        if key not in self._table_shard_owner:
            raise StrategyError(f"track_updated_rows: {getattr(shard, 'name', shard)!r} is not "
                                "a table shard of this strategy.")
        if key in self._traced_without_stamps:
            raise StrategyError(
                f"incremental checkpoints: a training step updating {shard.name!r} was traced "
                "before row tracking was set up, so its updates would be missing from deltas. "
                "Fix: create the CheckpointManager (or pass ChiefCheckpoint to the first fit) "
                "before the first training step.")
        if self._row_stamps.get(key, stamps) is not stamps:
            raise StrategyError(
                f"incremental checkpoints: {shard.name!r} is already tracked for another "
                "CheckpointManager(full_every=...); steps traced for that one would not update "
                "this one's record. Fix: one incremental manager per model.")
        self._row_stamps[key] = stamps

    def create_plain_variable(self, device: str, **kwargs) -> tf.Variable:
        """A plain variable on `device`, even in this strategy's scope (not a table or replica)."""
        self._creating_plain = True
        try:
            with tf.device(device):
                return tf.Variable(**kwargs)
        finally:
            self._creating_plain = False

    def admits_after_update(self) -> bool:
        """True while a sync step is traced whose table updates run `run_after_update` hooks."""
        return self._in_sync_step() and self._sync_embeddings

    def _record(self, var, kind: str, devices=None, stack: str = "", unstacked: str = ""):
        try:
            shape = tuple(int(d) if d is not None else -1 for d in var.shape.as_list())
        except (ValueError, AttributeError):
            shape = ()
        dtype = tf.as_dtype(var.dtype)
        n = 1
        for d in shape:
            n *= max(d, 0)
        self.placement_records.append(placement_lib.PlacementRecord(
            name=getattr(var, "name", "?"), kind=kind, shape=shape, dtype=dtype.name,
            num_bytes=n * dtype.size, devices=tuple(devices or [getattr(var, "device", "")]),
            stack=stack, unstacked="" if stack else unstacked))

    # -- datasets ----------------------------------------------------------------

    def _experimental_distribute_dataset(self, dataset, options):
        if not self.dense_allreduce:
            return super()._experimental_distribute_dataset(dataset, options)
        # Each worker is one replica: no re-batching inside a worker. The
        # coordinator shards the dataset across workers.
        return input_util.get_distributed_dataset(
            dataset, self._input_workers_with_options(), self._container_strategy(),
            num_replicas_in_sync=1, options=options, build=ops.inside_function())

    def _distribute_datasets_from_function(self, dataset_fn, options):
        if not self.dense_allreduce:
            return super()._distribute_datasets_from_function(dataset_fn, options)
        input_context = WorkerInputContext(self._num_workers)
        return input_util.get_distributed_datasets_from_function(
            dataset_fn, self._input_workers_with_options(options), [input_context],
            self._container_strategy(), options=options, build=ops.inside_function())

    # -- reduction ----------------------------------------------------------------

    def _in_sync_step(self) -> bool:
        return self.dense_allreduce and self.tracing_sync_step and not tf.executing_eagerly()

    def _reduce_to(self, reduce_op, value, destinations, options):
        if not self._in_sync_step():
            return super()._reduce_to(reduce_op, value, destinations, options)
        mean = reduce_op == tf.distribute.ReduceOp.MEAN
        flat = tf.nest.flatten(value)
        dense = [tf.convert_to_tensor(v) for v in flat]
        reduced = self.collective_group.all_reduce_packed(dense, mean=mean)
        return tf.nest.pack_sequence_as(value, reduced)

    def _batch_reduce_to(self, reduce_op, value_destination_pairs, options):
        if not self._in_sync_step():
            return super()._batch_reduce_to(reduce_op, value_destination_pairs, options)
        mean = reduce_op == tf.distribute.ReduceOp.MEAN
        values = [v for v, _ in value_destination_pairs]
        out = list(values)
        dense_idx, sparse_idx = [], []
        for i, (v, dest) in enumerate(value_destination_pairs):
            if isinstance(v, tf.IndexedSlices) and self._is_table_var(dest):
                sparse_idx.append(i)
            else:
                dense_idx.append(i)
                if isinstance(v, tf.IndexedSlices):
                    values[i] = tf.convert_to_tensor(v)
        through_ps = bool(sparse_idx) and self._sync_embeddings and self._exchange_through_ps()
        hand_in = None
        if through_ps:
            hand_in = self._hand_in([values[i] for i in sparse_idx],
                                    [value_destination_pairs[i][1] for i in sparse_idx])
        token = None
        if dense_idx:
            # Metric and batch-norm updates recorded so far in the step ride
            # along (sums: only with a summed gradient).
            pending = self.on_read_updates.take() if not mean else []
            # The hand-ins first: then the dense all-reduce doubles as the
            # barrier the PS exchange needs (it completes on a worker only
            # once every worker has handed in), one collective fewer a step.
            with tf.control_dependencies(hand_in.ops if hand_in else []):
                reduced = self.collective_group.all_reduce_packed(
                    [values[i] for i in dense_idx] + self.on_read_updates.deltas(pending),
                    mean=mean)
            self.on_read_updates.apply(pending, reduced[len(dense_idx):])
            for i, r in zip(dense_idx, reduced):
                out[i] = r
            token = reduced[0]
        if sparse_idx and self._sync_embeddings:
            sparse = [values[i] for i in sparse_idx]
            if through_ps:
                if token is None:
                    token = self.collective_group.barrier(hand_in.ops)
                gathered = self._take(hand_in, token)
            else:
                gathered = self.collective_group.all_gather_indexed_slices(sparse)
            for i, g in zip(sparse_idx, gathered):
                if mean:
                    # On the PS when summed there.
                    with sparse_exchange_lib.on_ps_device_of(g.values):
                        g = tf.IndexedSlices(g.values / self._num_workers, g.indices,
                                             g.dense_shape)
                out[i] = g
        return self._after_reduction(out)

    def _exchange_through_ps(self) -> bool:
        # A trace shared by several update roles (`tracing_worker_index` is
        # None: a concrete function was scheduled) cannot know which PS it
        # takes from; it all-gathers instead.
        return (self.sparse_exchange == "ps" and self._num_workers > 1
                and self.tracing_worker_index is not None)

    def _hand_in(self, slices, destinations) -> "_HandIn":
        """Hands this worker's sparse gradients to the PS queues (see `sparse_exchange`).

        Groups them by PS and dtype, in an order every worker shares.
        """
        groups = {}
        for j, (s, dest) in enumerate(zip(slices, destinations)):
            ps = tf.DeviceSpec.from_string(_unwrap(dest).device or "").task or 0
            groups.setdefault((ps, s.values.dtype), []).append(j)
        worker = tf.distribute.coordinator.experimental_get_current_worker_index()
        in_order = sorted(groups.items(), key=lambda g: (g[0][0], g[0][1].name))
        ops_ = [self._gradient_queues.hand_in(ps, worker, [slices[j] for j in js])
                for (ps, _), js in in_order]
        return _HandIn(list(slices), groups, ops_)

    def _take(self, hand_in: "_HandIn", token) -> List[tf.IndexedSlices]:
        """The global sparse gradients, once every worker handed in (`token`).

        Returns, per input, the global sparse gradient (on its PS) where this
        trace's role updates that PS, else the local slices (never applied:
        `_update` leaves other roles' shards out). All of them depend on the
        token, so no worker takes before every worker handed in.
        """
        slices = hand_in.slices
        role = self.update_role(self.tracing_worker_index)
        out = list(slices)
        with tf.control_dependencies([token]):
            for (ps, _), js in hand_in.groups.items():
                if ps in role:
                    taken = self._gradient_queues.take(ps, [slices[j] for j in js])
                    for j, g in zip(js, taken):
                        out[j] = g
                else:
                    for j in js:
                        out[j] = tf.IndexedSlices(tf.identity(slices[j].values),
                                                  slices[j].indices, slices[j].dense_shape)
        return out

    def _after_reduction(self, out):
        """Counts the reduction, makes every update wait for the count, opens the step."""
        if self.reduced_steps is None:
            return out
        tensors, on_ps = [], {}
        for o in out:
            for t in [o.values, o.indices] if isinstance(o, tf.IndexedSlices) else [o]:
                device = sparse_exchange_lib.ps_device_of(t)
                if device:
                    on_ps.setdefault(device, []).append(t)
                else:
                    tensors.append(t)
        # Gradients summed on a PS stay there: one control edge per PS, and
        # the identities below are made on the PS too (an identity here
        # would copy the global gradient to this worker and back).
        for device, ts in on_ps.items():
            with tf.device(device):
                tensors.append(tf.group(ts))
        with tf.control_dependencies(tensors):
            counted = self.reduced_steps.assign_add(1, read_value=False)
        result = []
        with tf.control_dependencies([counted]):
            for o in out:
                tensor = o.values if isinstance(o, tf.IndexedSlices) else o
                with sparse_exchange_lib.on_ps_device_of(tensor):
                    if isinstance(o, tf.IndexedSlices):
                        result.append(tf.IndexedSlices(tf.identity(o.values), o.indices,
                                                       o.dense_shape))
                    else:
                        result.append(tf.identity(o))
        variables_lib.open_step()
        return result

    def _is_table_var(self, var) -> bool:
        return id(_unwrap(var)) in self._table_shard_owner

    # -- updates ------------------------------------------------------------------

    def _update(self, var, fn, args, kwargs, group):
        if isinstance(var, table_stacking.TableView) and (args or kwargs):
            # An optimizer applying a gradient to a view itself would write
            # the view's rows at the wrong place of the stack shard (its
            # kernels take the shard's handle); Keras's are merged first.
            raise stacked_updates.StackingError(
                f"stack_tables=True: {getattr(fn, '__qualname__', fn)} updates "
                f"{var.name}, a stacked table's rows, with a gradient directly; only Keras 2 "
                "optimizers (tf.keras.optimizers, .legacy) update stacked tables. Fix: "
                "HybridParameterServerStrategy(stack_tables=False), or a Keras optimizer.")
        if isinstance(var, variables_lib.ReplicatedVariable):
            with distribute_lib.UpdateContext(var.device), variables_lib.inside_variable_update():
                result = fn(var, *self._select_single_value(args),
                            **self._select_single_value(kwargs))
            if group:
                return result
            return tf.nest.map_structure(self._local_results, result)
        stamps = self._row_stamps.get(id(_unwrap(var)))
        if stamps is None and self._is_table_var(var) and not tf.executing_eagerly():
            self._traced_without_stamps.add(id(_unwrap(var)))
        if not self._in_sync_step():
            return self._stamped(super()._update(var, fn, args, kwargs, group), stamps, args)
        table_owner = self._table_shard_owner.get(id(_unwrap(var)))
        if table_owner is not None and not self._sync_embeddings:
            return self._stamped(super()._update(var, fn, args, kwargs, group), stamps, args)
        # Every sync update to a PS variable (a table shard, its slots) is
        # applied by one worker only: all workers hold the same reduced
        # gradient, and applying it twice would be wrong.
        owner = 0 if table_owner is None else table_owner

        def apply():
            graph = tf.compat.v1.get_default_graph()
            first = len(graph.get_operations())
            with variables_lib.inside_variable_update():
                result = super(HybridExtended, self)._update(var, fn, args, kwargs, True)
            if stamps is not None:  # A write: `done` below waits for it too.
                stamps.mark(self._gradient_of(args))
            after = self._after_update.get(id(_unwrap(var)))
            if after is not None:
                updated = [op for op in graph.get_operations()[first:] if not op.outputs]
                with tf.control_dependencies(
                        updated + [r for r in tf.nest.flatten(result) if r is not None]):
                    after()
            # `done` must depend on the writes themselves: the end-of-step
            # barrier waits for it, and a write it does not wait for can land
            # after another worker's next-step lookup. Keras's new optimizers
            # return None from their update step (their slot and table writes
            # are only ops in the graph), so depend on the ops the update
            # created that have no outputs: its writes (variable assigns,
            # scatters, resource applies; none of them has an output) and any
            # group of them. Only those, not every op: each control edge from
            # a PS op is a cross-device transfer per step.
            writes = [op for op in graph.get_operations()[first:] if not op.outputs]
            with tf.control_dependencies(
                    writes + [r for r in tf.nest.flatten(result) if r is not None]):
                return tf.constant(True)

        if self.tracing_worker_index is not None and table_owner is not None:
            # One trace per update role (see `update_role`): the table
            # update exists only in the owner's graph. No tf.cond: a cond
            # with its branch on a PS costs every worker a predicate, a pivot
            # and each (dead) input sent to the PS, for every shard and step
            # (benchmarks/README.md: 8.1k -> 14.7k examples/s, 26 tables).
            done = apply() if self.tracing_worker_index == owner else tf.constant(False)
        else:
            # One trace shared by several workers (a concrete function was
            # scheduled, or a PS variable that is not a table: roles only
            # describe table shards).
            worker = tf.distribute.coordinator.experimental_get_current_worker_index()
            done = tf.cond(tf.equal(worker, owner), apply, lambda: tf.constant(False))
        if table_owner is not None:
            # Also on non-owners: the end-of-step barrier is a collective that
            # every worker must join once the step has any table update.
            variables_lib.add_pending_table_update(done)
        if group:
            return done
        return [done]

    def _gradient_of(self, args):
        """The gradient an optimizer's update of one variable was given (its first argument)."""
        args = self._select_single_value(args)
        return args[0] if args else None

    def _stamped(self, result, stamps, args):
        """`result` of an update outside a sync step, after stamping the rows it touched."""
        if stamps is not None:
            stamps.mark(self._gradient_of(args))
        return result

    def _on_read_update(self, var, delta, apply, read_value):
        """An in-step update of an ON_READ replicated variable (see `on_read_updates`)."""
        if not self._in_sync_step():
            return apply(delta)
        return self.on_read_updates.update(var, delta, apply, read_value)

    def _on_read_use(self, var):
        """A traced use of an ON_READ replicated variable: its pending update first."""
        if self._in_sync_step():
            self.on_read_updates.flush_if_pending(var)

    def _end_of_step(self, pending_updates):
        """Ops every worker runs after all of a step's updates.

        In ``"sync"`` embedding mode, a collective barrier that depends on the
        step's gated table updates (so nobody reads a table before every
        update landed); then the commit counter.
        """
        deps = list(pending_updates)
        if self._sync_embeddings and deps:
            deps = [self.collective_group.barrier(deps)]
        if self.committed_steps is None:
            return deps
        with tf.control_dependencies(deps):
            return [self.committed_steps.assign_add(1, read_value=False)]


def _check_partitioner(variable_partitioner) -> None:
    """Raises StrategyError unless `variable_partitioner` is None or a partitioner."""
    if variable_partitioner is None or callable(variable_partitioner):
        return
    hint = ""
    if isinstance(variable_partitioner, config_lib.ClusterConfig):
        hint = (" The second positional argument is `variable_partitioner`, as in stock "
                "ParameterServerStrategy; pass the ClusterConfig as `config=`.")
    raise StrategyError(
        f"variable_partitioner={variable_partitioner!r} is not a partitioner.{hint} Fix: pass "
        "a tf.distribute.experimental.partitioners.Partitioner (e.g. "
        "MinSizePartitioner(min_shard_bytes=256 << 10, max_shards=num_ps)), any callable "
        "(shape, dtype) -> [num_shards, 1, ...], or None for one shard per PS task.")


class WorkerInputContext(tf.distribute.InputContext):
    """InputContext whose pipeline id is the running worker's index.

    The id is a tensor resolved when the dataset function runs on a worker,
    so `dataset.shard(ctx.num_input_pipelines, ctx.input_pipeline_id)` gives
    every worker its own shard.
    """

    def __init__(self, num_workers: int):
        super().__init__(num_input_pipelines=num_workers, input_pipeline_id=0,
                         num_replicas_in_sync=num_workers)

    @property
    def input_pipeline_id(self):
        if tf.executing_eagerly():
            return 0
        return tf.distribute.coordinator.experimental_get_current_worker_index()


class _HandIn(NamedTuple):
    """One worker's sparse gradients handed in to the PS queues in a step."""

    slices: List[tf.IndexedSlices]
    groups: dict  # (ps task, dtype) -> indices into `slices`
    ops: list  # the enqueue ops, one per group


def _unwrap(var):
    """The underlying resource variable of PSS wrappers (Aggregating/Caching)."""
    seen = 0
    while seen < 4:
        seen += 1
        if isinstance(var, ps_values.AggregatingVariable):
            var = var.get()
        elif isinstance(var, ps_values.CachingVariable):
            var = var._v  # pylint: disable=protected-access
        else:
            break
    return var


