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

`HybridExtended` keeps the hooks TF calls by name and hands each to one of
its parts: `variable_creation.py`, `reduction.py` and `updates.py`. The
tuning knobs are one `HybridOptions` (`options.py`).

The coordinator (`coordinator.py`) runs every scheduled function on every
worker, which is what makes the collectives meet. It traces one copy of the
step per update role (`update_role`, `_retrace_functions_for_each_device`;
`role_tracing.py`),
so a shard's update is simply absent from the other workers' graphs: no
per-step `tf.cond`.

With ``dense_placement="ps"`` the strategy is stock asynchronous PSS (plus
the plugin's table sharding), for comparison and for fully-async users.
"""

import random
import threading
from typing import List, Optional

import tensorflow as tf

from tf_psplugin._internal import patches
from tf_psplugin._internal import verbosity as verbosity_lib
from tf_psplugin._internal.tf_internal import input_util, ops
from tf_psplugin._internal.tf_internal import parameter_server_strategy_v2
from tf_psplugin.cluster import config as config_lib
from tf_psplugin.cluster import connection
from tf_psplugin.cluster.connection import StrategyError
from tf_psplugin.fault import failover as failover_lib
from tf_psplugin.keras import progress as progress_lib
from tf_psplugin.runtime import options as options_lib
from tf_psplugin.runtime import reduction
from tf_psplugin.runtime import updates
from tf_psplugin.runtime import variable_creation
from tf_psplugin.runtime.coordinator import HybridClusterCoordinator
from tf_psplugin.sync import collectives
from tf_psplugin.sync import on_read_updates as on_read_updates_lib
from tf_psplugin.sync import replicated
from tf_psplugin.tables import host
from tf_psplugin.tables import placement as placement_lib
from tf_psplugin.tables import stacking

EMBEDDING_UPDATES = options_lib.EMBEDDING_UPDATES
DENSE_PLACEMENTS = options_lib.DENSE_PLACEMENTS


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

    Tuned:

    ```python
    options = tf_psplugin.HybridOptions(stack_tables=False)
    placement = tf_psplugin.PlacementPolicy(sharding="contiguous")
    strategy = tf_psplugin.HybridParameterServerStrategy(options=options,
                                                         placement=placement)
    ```

    The two positional arguments are stock ParameterServerStrategy's (the
    same in TF 2.15 and 2.21), so ``HybridParameterServerStrategy(resolver,
    variable_partitioner=...)`` is stock code with the class renamed; the rest
    are keyword-only arguments of the plugin (docs/coming_from_stock_pss.md
    lists what behaves differently): how it trains in `options`, which
    variables are tables in `placement`, what happens on a dead task in
    `failover`, and `config`, the plugin's own way to name the cluster.

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
        options: A `tf_psplugin.HybridOptions`: the tuning knobs
            (``embedding_updates``, ``dense_placement``,
            ``collective_timeout_seconds``, ``connect_timeout_seconds``,
            ``log_placement``, ``stack_tables``, ``table_dtype`` and the
            ``experimental_*`` toggles; each documented there). None: the
            defaults.
        placement: A `PlacementPolicy`: which variables are tables and how
            they are sharded (``sharding``'s one home).
        failover: A `FailoverPolicy` (default: enabled). On a dead worker or
            PS the chief saves what survives and raises `TaskFailedError`;
            uncaught, it exits with status 138 so that the launcher's
            `--restart-failed` or the scheduler restarts it to resume from the
            checkpoint (see `failover.py`; `tf_psplugin.elastic.run` recovers
            in-process instead). With ``dense_placement="ps"`` there is no
            failover, and an enabled policy given here is refused.
        config: A `tf_psplugin.config.ClusterConfig` for this (chief) task,
            used when `cluster_resolver` is None.
        **knobs: Deprecated: a knob of `HybridOptions` as a keyword
            (``HybridParameterServerStrategy(stack_tables=False)``) still
            works for one release, with a `DeprecationWarning` naming the
            `HybridOptions` field; with `options`, a knob given with another
            value than `options` has is an error.

    Raises:
        StrategyError: for a cluster it cannot train on, a process that is
            not the chief, an unsupported knob or combination of knobs
            (`HybridOptions` lists them), `options` contradicting `placement`
            or `failover`, or a knob given in `options` and as a keyword with
            different values.
        TypeError: a keyword that is no knob of `HybridOptions`.
    """

    def __init__(self, cluster_resolver=None, variable_partitioner=None, *,
                 options: Optional[options_lib.HybridOptions] = None,
                 placement: Optional[placement_lib.PlacementPolicy] = None,
                 failover: Optional[failover_lib.FailoverPolicy] = None,
                 config: Optional[config_lib.ClusterConfig] = None, **knobs):
        _check_partitioner(variable_partitioner)
        options = options_lib.resolve(options, knobs)
        self._hybrid_options = options
        _check_options_with(options, placement, failover)
        placement = placement or placement_lib.PlacementPolicy()
        if options.sharding is not None:
            placement = placement_lib.PlacementPolicy(
                table_names=placement.table_names, min_table_bytes=placement.min_table_bytes,
                sharding=options.sharding)
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
        self._dense_allreduce = options.dense_placement == "allreduce"
        self._collective_timeout = float(options.collective_timeout_seconds)
        # TF logs the session config, PSS's device lists, ... at INFO: hidden by default.
        # Uncaught, TasksUnreachableError (pods still being scheduled) ends the
        # chief with the retryable status 138 and one line, not exit 1.
        patches.install("exit_on_failover_error")
        with verbosity_lib.quiet_tf_info(verbosity_lib.TF_LOGGER, verbosity_lib.ABSL_LOGGER):
            connection.wait_for_tasks(spec, options.connect_timeout_seconds)
            # Mirrors ParameterServerStrategyV2.__init__ (TF 2.15-2.21) but installs
            # our Extended; the parent's __init__ hard-codes its own Extended class.
            self._cluster_resolver = resolver
            self._verify_args_and_config(resolver)
            self._cluster_coordinator = None
            self._connect_to_cluster(coordinator_name="chief")
            self._extended = HybridExtended(
                self, resolver, embedding_updates=options.embedding_updates,
                dense_allreduce=self._dense_allreduce, placement=placement,
                collective_timeout_seconds=self._collective_timeout,
                log_placement=options.log_placement,
                sparse_exchange=options.experimental_sparse_exchange,
                pack_on_read_updates=options.experimental_pack_on_read_updates,
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
        if self._extended.agrees_loss_scaling:
            # mixed_float16: Keras's loss scaling, its finite check agreed.
            patches.install("keras_loss_scaling")
        # A functional model's table lookups: one round trip per PS.
        self._extended.fuse_lookups = bool(options.experimental_fuse_lookups)
        # Float32 tables stored in half precision (None: as asked for).
        self._extended.table_dtype = options.table_dtype
        # A sync step's dense all-reduces: buckets of about this size (0: one;
        # None: buckets only when the workers span hosts).
        self._extended.dense_bucket_bytes = collectives.bucket_bytes_for(
            options.dense_bucket_bytes, spec.as_dict().get("worker", ()))
        # ... and the dtype the dense gradients travel in (None: their own).
        self._extended.dense_allreduce_dtype = options.dense_allreduce_dtype
        if options.experimental_fuse_lookups:
            patches.install("keras_functional_fusion")
        if options.stack_tables:
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
        stacks = self._extended.table_stacks
        fallbacks = stacks.fallbacks() if stacks is not None else []
        return placement_lib.format_report(self._extended.placement_records, fallbacks)

    def placement_summary(self) -> str:
        """Tables in full, the rest grouped by kind (logged once at the first step)."""
        return placement_lib.format_summary(self._extended.placement_records)

    @property
    def options(self) -> options_lib.HybridOptions:
        """The `HybridOptions` this strategy runs with (its knobs, however they were given)."""
        return self._hybrid_options

    @property
    def embedding_updates(self) -> str:
        """``"sync"`` or ``"async"``."""
        return self._extended.embedding_updates

    @property
    def dense_placement(self) -> str:
        """``"allreduce"`` or ``"ps"``."""
        return "allreduce" if self._dense_allreduce else "ps"


class HybridExtended(parameter_server_strategy_v2.ParameterServerStrategyV2Extended,
                     host.TableHost):
    """The Extended half of `HybridParameterServerStrategy` (see module doc).

    TF's `StrategyExtended` calls its hooks by name (`_create_variable`,
    `_reduce_to`, `_batch_reduce_to`, `_update`, ...); each decides between
    stock behaviour and the plugin's and hands the plugin's to one of three
    collaborators: `creation` (`variable_creation.VariableCreation`: where
    variables go, placement records, table shard owners), `reduction`
    (`reduction.Reduction`: a sync step's all-reduces and PS exchange) and
    `updates` (`updates.Updates`: who applies each update, row stamps, the
    end of the step). The Extended itself holds the configuration and the
    tracing state the coordinator sets while it traces a step.
    """

    def __init__(self, container_strategy, cluster_resolver, embedding_updates: str,
                 dense_allreduce: bool, placement: placement_lib.PlacementPolicy,
                 collective_timeout_seconds: float, log_placement: bool,
                 sparse_exchange: str = "ps", pack_on_read_updates: bool = True,
                 table_partitioner=None):
        # Stock's own partitioner stays None: the user's `variable_partitioner`
        # only decides the tables' shard counts (`VariableCreation._create_table`);
        # dense and other PS variables are never partitioned.
        super().__init__(container_strategy, cluster_resolver, variable_partitioner=None)
        self.table_partitioner = table_partitioner
        self.sparse_exchange = sparse_exchange
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
        self.creation = variable_creation.VariableCreation(
            self, num_workers=self._num_workers, num_ps=self._num_ps)
        self.reduction = reduction.Reduction(self, self.creation, self._num_workers)
        self.updates = updates.Updates(self, self.creation)
        # A fresh group key per chief process: a restarted chief must not meet
        # collective state that the workers cached for its predecessor.
        self.collective_group = collectives.CollectiveGroup(
            self._num_workers, group_key=_FRESH.randint(10_000, 2**30))
        self.on_read_updates = on_read_updates_lib.OnReadUpdates(
            self.collective_group, self._num_workers, enabled=pack_on_read_updates,
            make_accumulator=self._create_on_read_accumulator)
        # Enforced by the coordinator's watchdog, not by the collective ops.
        self.step_timeout_seconds = float(collective_timeout_seconds)
        self.reduced_steps = None
        # Read by tables/fusion.py: set by the strategy after construction.
        self.fuse_lookups = False
        # Read by variable creation (HybridOptions.table_dtype): set likewise.
        self.table_dtype = None
        # Read by reduction.py (HybridOptions.dense_bucket_bytes): set likewise.
        self.dense_bucket_bytes = 0
        # Read by reduction.py (HybridOptions.dense_allreduce_dtype): likewise.
        self.dense_allreduce_dtype = None
        self.committed_steps = None

    # -- read by other modules ----------------------------------------------------

    @property
    def placement_records(self) -> List[placement_lib.PlacementRecord]:
        """What was placed where (`VariableCreation.placement_records`)."""
        return self.creation.placement_records

    @property
    def table_stacks(self) -> Optional[stacking.TableStacks]:
        """The table stacks with ``stack_tables=True``, else None (read by tables/fusion.py)."""
        return self.creation.table_stacks

    def enable_table_stacking(self) -> None:
        """Stores eligible tables in stacks from now on (see `tables/stacking.py`)."""
        self.creation.enable_table_stacking()

    @property
    def agrees_loss_scaling(self) -> bool:
        """Whether Keras's loss scaling may run (`sync/loss_scaling.py`): sync dense and tables."""
        return self.dense_allreduce and self.embedding_updates == "sync"

    def update_role(self, worker_index: int) -> tuple:
        """The PS tasks whose table shards `worker_index` updates in sync mode."""
        return self.creation.update_role(worker_index)

    def create_plain_variable(self, device: str, **kwargs) -> tf.Variable:
        """A plain variable on `device`, even in this strategy's scope (not a table or replica)."""
        return self.creation.create_plain_variable(device, **kwargs)

    def is_table_var(self, var) -> bool:
        """Whether `var` is a shard of a table this strategy made."""
        return self.creation.is_table_var(var)

    def run_after_update(self, shard, fn) -> None:
        """Makes the worker that updates `shard` in a sync step also run `fn()` (`Updates`)."""
        self.updates.run_after_update(shard, fn)

    def track_updated_rows(self, shard, stamps) -> None:
        """Makes every optimizer apply to table `shard` also stamp its rows (`Updates`)."""
        self.updates.track_updated_rows(shard, stamps)

    def admits_after_update(self) -> bool:
        """True while a sync step is traced whose table updates run `run_after_update` hooks."""
        return self.updates.admits_after_update()

    def _create_on_read_accumulator(self, var):
        """A worker's own sum of `var`'s updates in `tf.cond` branches (`on_read_updates`).

        Replicated but not ``ON_READ`` (its writes stay local) and not
        recorded. Called while a replica function is traced, where neither
        this strategy's scope nor eager variable creation can be entered
        (``init_scope`` keeps the replica context), so it is made eagerly in
        a thread of its own, as the chief makes any variable in the scope.
        """
        name = "tf_psplugin_branch_sum_" + var.name.split(":")[0].replace("/", "_")
        made, failed = [], []

        def create():
            try:
                with self.creation.internal_variables(), self._container_strategy().scope():
                    made.append(tf.Variable(tf.zeros(var.shape, var.dtype), trainable=False,
                                            name=name))
            except Exception as e:  # pylint: disable=broad-except
                failed.append(e)  # Re-raised in the tracing thread below.

        thread = threading.Thread(target=create, name="tf_psplugin_create_" + name)
        thread.start()
        thread.join(timeout=self._CREATE_TIMEOUT_SECONDS)
        if failed:
            raise failed[0]
        if not made:
            raise StrategyError(
                f"creating {name!r} (where the workers sum their updates of {var.name!r} "
                f"made in a tf.cond branch) took more than {self._CREATE_TIMEOUT_SECONDS} s. "
                "Fix: check that every worker is reachable, or update the metric outside "
                "the tf.cond.")
        return made[0]

    _CREATE_TIMEOUT_SECONDS = 300.0

    def create_step_counters(self):
        """Creates the per-worker step counters failover reads (allreduce mode).

        `reduced_steps` is incremented once the step's gradients are reduced,
        before any update; `committed_steps` once every update of the step is
        done (after the table barrier). Equal on a surviving worker means no
        step was half-applied when a peer died.
        """
        if not self.dense_allreduce:
            return
        with self.creation.internal_variables(), self._container_strategy().scope():
            self.reduced_steps = tf.Variable(0, dtype=tf.int64, trainable=False,
                                             name="tf_psplugin_reduced_steps")
            self.committed_steps = tf.Variable(0, dtype=tf.int64, trainable=False,
                                               name="tf_psplugin_committed_steps")

    # -- replicas ---------------------------------------------------------------

    @property
    def _num_replicas_in_sync(self):
        if self.dense_allreduce:
            return self._num_workers
        return self._num_gpus_per_worker or 1

    # -- variable creation ---------------------------------------------------------

    def _create_var_creator(self, next_creator, **kwargs):
        if self.creation.creates_unwrapped:
            return next_creator
        return super()._create_var_creator(next_creator, **kwargs)

    def _create_variable(self, next_creator, **kwargs):
        return self.creation.create_variable(next_creator, super()._create_variable, **kwargs)

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

    # -- reduction and updates ---------------------------------------------------

    def in_sync_step(self) -> bool:
        """Whether a synchronous step is being traced (the plugin's reductions and updates)."""
        return self.dense_allreduce and self.tracing_sync_step and not tf.executing_eagerly()

    def _call_for_each_replica(self, fn, args, kwargs):
        result = super()._call_for_each_replica(fn, args, kwargs)
        if self.in_sync_step():
            # In a loop body, metric updates the replica function left
            # pending are written now (see `on_read_updates.end_of_run`).
            self.on_read_updates.end_of_run()
        return result

    def _reduce_to(self, reduce_op, value, destinations, options):
        if not self.in_sync_step():
            return super()._reduce_to(reduce_op, value, destinations, options)
        return self.reduction.reduce_to(reduce_op, value)

    def _batch_reduce_to(self, reduce_op, value_destination_pairs, options):
        if not self.in_sync_step():
            return super()._batch_reduce_to(reduce_op, value_destination_pairs, options)
        return self.reduction.batch_reduce_to(reduce_op, value_destination_pairs)

    def _update(self, var, fn, args, kwargs, group):
        return self.updates.update(var, fn, args, kwargs, group, super()._update)


def _check_options_with(options: options_lib.HybridOptions,
                        placement: Optional[placement_lib.PlacementPolicy],
                        failover: Optional[failover_lib.FailoverPolicy]) -> None:
    """Refuses `options` with a `placement` or `failover` they contradict.

    Raises:
        StrategyError: the deprecated ``HybridOptions(sharding=...)`` and a
            `placement` with another sharding (which one would win is not
            obvious), or an enabled `failover` given with
            ``dense_placement="ps"`` (asynchronous steps have no failover: it
            would be ignored).
    """
    if (options.sharding is not None and placement is not None
            and placement.sharding != options.sharding):
        raise StrategyError(
            f"HybridParameterServerStrategy(options=HybridOptions(sharding={options.sharding!r}), "
            f"placement=PlacementPolicy(sharding={placement.sharding!r})): sharding is given "
            "twice, with different values. Fix: give it once, as "
            f"placement=PlacementPolicy(sharding=...), its one home.")
    if failover is not None and failover.enabled and options.dense_placement == "ps":
        raise StrategyError(
            "HybridParameterServerStrategy(options=HybridOptions(dense_placement='ps'), "
            "failover=FailoverPolicy(enabled=True)): with dense variables on the PS the steps "
            "are asynchronous, as in stock PSS, and have no failover. Fix: drop failover= (or "
            "pass FailoverPolicy(enabled=False)), or use dense_placement='allreduce'.")


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
        return replicated.current_worker_index()
