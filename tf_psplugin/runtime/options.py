"""`HybridOptions`: the strategy's tuning knobs in one validated value.

`HybridParameterServerStrategy`'s constructor keeps stock's arguments first
(`cluster_resolver`, `variable_partitioner`) and the facts about the cluster
(`config`, `placement`, `failover`) as its own arguments; how the plugin
trains and communicates (table and dense modes, timeouts, exchange, lookup
fusion, stacking, ...) is one `HybridOptions`, as TF's collectives take a
`tf.distribute.experimental.CommunicationOptions`. Each knob is also
accepted as a keyword of the strategy (``stack_tables=True``), which is
what existing programs pass; `resolve` merges the two and refuses a knob
given both ways with different values.
"""

import dataclasses
from typing import Mapping, Optional

from tf_psplugin.cluster.connection import StrategyError
from tf_psplugin.sync import sparse_exchange as sparse_exchange_lib
from tf_psplugin.tables import half_precision
from tf_psplugin.tables import placement as placement_lib

EMBEDDING_UPDATES = ("sync", "async")
DENSE_PLACEMENTS = ("allreduce", "ps")


@dataclasses.dataclass(frozen=True)
class HybridOptions:
    """The tuning knobs of `HybridParameterServerStrategy`, validated when made.

    Example:

    ```python
    options = tf_psplugin.HybridOptions(stack_tables=True,
                                        collective_timeout_seconds=120)
    strategy = tf_psplugin.HybridParameterServerStrategy(options=options)
    # The same strategy, knobs as keywords (what existing programs pass):
    strategy = tf_psplugin.HybridParameterServerStrategy(
        stack_tables=True, collective_timeout_seconds=120)
    ```

    Attributes:
        embedding_updates: ``"sync"`` (global sparse gradient applied once per
            step: exactly single-process training on the global batch) or
            ``"async"`` (each worker pushes its own sparse gradient).
        dense_placement: ``"allreduce"`` (replicas on workers, synchronous) or
            ``"ps"`` (stock asynchronous PSS placement of dense variables).
        sharding: Shortcut for ``placement.sharding``: ``"interleaved"`` or
            ``"contiguous"``; None (default) keeps the `PlacementPolicy`'s
            (interleaved unless it says otherwise).
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
            where it happens, or after the `tf.cond` whose branch made it
            (see `on_read_updates.py`).
        fuse_lookups: Look up the sharded tables of a functional Keras
            model's `Embedding` layers together, one round trip per PS for
            all the tables of one width, instead of one per table; the rows
            and gradients are the same (see `tables/fusion.py`). Off by
            default: on loopback it was no faster (benchmarks/README).
        stack_tables: Store the embedding tables of one row width, dtype and
            shard count as one variable per shard (a stack; see
            `tables/stacking.py`): one gather, one optimizer apply and one
            set of slots per PS and step instead of one per table. On by
            default; False (the way out) gives every table its own
            variables (docs/api.md lists what a program can still tell).
        table_dtype: ``"bfloat16"`` or ``"float16"``: store every float32
            embedding table in that dtype on the PS (half the PS memory, and
            half the bytes per looked-up row), with its optimizer slots in
            float32 and each update computed in float32, then rounded into
            the rows; checkpoints hold the rows as float32. None (default):
            tables in the dtype their layer asks for. See
            docs/mixed_precision.md, "Tables in half precision"
            (`tables/half_precision.py`).

    Raises:
        StrategyError: a knob with a value the strategy does not support
            (ValueError for ``sharding``, as `PlacementPolicy` raises it).
    """

    embedding_updates: str = "sync"
    dense_placement: str = "allreduce"
    sharding: Optional[str] = None
    collective_timeout_seconds: float = 60.0
    connect_timeout_seconds: float = 300.0
    log_placement: bool = True
    sparse_exchange: str = "ps"
    pack_on_read_updates: bool = True
    fuse_lookups: bool = False
    stack_tables: bool = True
    table_dtype: Optional[str] = None

    def __post_init__(self):
        half_precision.check_table_dtype(self.table_dtype)
        _check_one_of("sparse_exchange", self.sparse_exchange,
                      sparse_exchange_lib.SPARSE_EXCHANGES)
        _check_one_of("embedding_updates", self.embedding_updates, EMBEDDING_UPDATES)
        _check_one_of("dense_placement", self.dense_placement, DENSE_PLACEMENTS)
        if self.sharding is not None:  # PlacementPolicy's own check and message.
            placement_lib.PlacementPolicy(sharding=self.sharding)
        if not self.collective_timeout_seconds >= 0:
            raise StrategyError(
                f"collective_timeout_seconds={self.collective_timeout_seconds!r} must be >= 0 "
                "(0 = no limit). Fix: pass a number of seconds above your slowest step.")

    def replace(self, **changes) -> "HybridOptions":
        """A copy with `changes` (knob name -> value), validated again."""
        return dataclasses.replace(self, **changes)


KNOBS = tuple(field.name for field in dataclasses.fields(HybridOptions))


def resolve(options: Optional[HybridOptions], knobs: Mapping[str, object],
            caller: str = "HybridParameterServerStrategy") -> HybridOptions:
    """The options a strategy runs with: `options`, or the defaults, plus `knobs`.

    Args:
        options: The ``options=`` argument, or None.
        knobs: The knobs passed as keywords (name -> value).
        caller: Named in the errors.

    Returns:
        A validated `HybridOptions`.

    Raises:
        TypeError: a keyword that is no knob (as Python's own message for an
            unexpected keyword argument).
        StrategyError: `options` is not a `HybridOptions`, a knob's value is
            not supported, or a knob is given both in `options` and as a
            keyword with a different value.
    """
    unknown = sorted(set(knobs) - set(KNOBS))
    if unknown:
        raise TypeError(f"{caller}() got an unexpected keyword argument {unknown[0]!r}")
    if options is None:
        return HybridOptions(**knobs)
    if not isinstance(options, HybridOptions):
        raise StrategyError(
            f"{caller}(options={options!r}): options must be a tf_psplugin.HybridOptions. "
            "Fix: options=tf_psplugin.HybridOptions(...), or pass the knobs as keywords.")
    for name, value in knobs.items():
        if getattr(options, name) != value:
            raise StrategyError(
                f"{caller}(options=HybridOptions({name}={getattr(options, name)!r}), "
                f"{name}={value!r}): {name} is given twice, with different values. Fix: give "
                f"it once, in options (options.replace({name}={value!r})) or as a keyword "
                "without options.")
    return options


def _check_one_of(name: str, value, allowed) -> None:
    if value not in allowed:
        raise StrategyError(
            f"{name}={value!r} is not supported. "
            f"Fix: use one of {', '.join(map(repr, allowed))}.")
