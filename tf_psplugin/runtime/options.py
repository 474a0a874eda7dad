"""`HybridOptions`: the strategy's tuning knobs in one validated value.

`HybridParameterServerStrategy`'s constructor is stock's
(`cluster_resolver`, `variable_partitioner`) plus keyword-only facts about
the cluster (`options`, `placement`, `failover`, `config`); how the plugin
trains and communicates (table and dense modes, timeouts, stacking, table
dtype, ...) is one `HybridOptions`, as TF's collectives take a
`tf.distribute.experimental.CommunicationOptions`.

Deprecated, each still working for one release with a `DeprecationWarning`
naming the replacement (CHANGELOG.md):

* a knob passed as a keyword of the strategy
  (``HybridParameterServerStrategy(stack_tables=False)``): `resolve` merges
  it into the options and refuses a knob given both ways with different
  values;
* the developer toggles' former names (``sparse_exchange``,
  ``pack_on_read_updates``, ``fuse_lookups``), now ``experimental_*``;
* ``HybridOptions(sharding=...)``: sharding's one home is
  `PlacementPolicy(sharding=...)`.
"""

import dataclasses
import warnings
from typing import Any, Mapping, Optional

from tf_psplugin._internal import deprecation as _deprecation
from tf_psplugin.cluster.connection import StrategyError
from tf_psplugin.sync import collectives
from tf_psplugin.sync import sparse_exchange as sparse_exchange_lib
from tf_psplugin.tables import half_precision
from tf_psplugin.tables import placement as placement_lib

EMBEDDING_UPDATES = ("sync", "async")

# HybridOptions.dense_bucket_bytes's default (None: buckets when the workers
# span hosts, one packed all-reduce when they share one, where buckets were
# measured slower; benchmarks/README.md "Bucketed dense all-reduce";
# `collectives.bucket_bytes_for`).
DEFAULT_DENSE_BUCKET_BYTES = None
DENSE_PLACEMENTS = ("allreduce", "ps")

# The developer toggles' former names -> their names now.
RENAMED = {
    "sparse_exchange": "experimental_sparse_exchange",
    "pack_on_read_updates": "experimental_pack_on_read_updates",
    "fuse_lookups": "experimental_fuse_lookups",
}


@dataclasses.dataclass(frozen=True, init=False)
class HybridOptions:
    """The tuning knobs of `HybridParameterServerStrategy`, validated when made.

    Example:

    ```python
    options = tf_psplugin.HybridOptions(stack_tables=True,
                                        collective_timeout_seconds=120)
    strategy = tf_psplugin.HybridParameterServerStrategy(options=options)
    ```

    Every argument is a keyword. The ``experimental_*`` knobs are developer
    toggles kept to compare implementations; they may change or go without
    a deprecation period. Combinations that cannot mean what they say are
    refused (``StrategyError`` naming the fields and the fix): the sparse
    exchange ``"allgather"`` with asynchronous table updates
    (``embedding_updates="async"``) or with ``dense_placement="ps"`` (no
    synchronous step, so nothing is exchanged), ``dense_allreduce_dtype``
    with ``dense_placement="ps"`` (no dense all-reduce), and
    ``experimental_pack_on_read_updates=False`` with
    ``dense_placement="ps"`` (no replicated accumulators to update).

    Attributes:
        embedding_updates: ``"sync"`` (global sparse gradient applied once per
            step: exactly single-process training on the global batch) or
            ``"async"`` (each worker pushes its own sparse gradient).
            With ``dense_placement="ps"`` every update is asynchronous,
            whatever this says.
        dense_placement: ``"allreduce"`` (replicas on workers, synchronous) or
            ``"ps"``: the whole strategy becomes stock asynchronous PSS (dense
            variables on the PS, asynchronous steps, no failover), with the
            plugin's table sharding; for comparison and fully-async users.
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
        log_placement: Log the placement summary once, at the first step
            (False: quiet; `strategy.placement_summary()` still returns it).
        experimental_sparse_exchange: How ``"sync"`` mode sums embedding
            gradients: ``"ps"`` (default: each worker sends its own to the PS
            holding the shard, where one worker's update sums them; a
            worker's bytes do not grow with the number of workers) or
            ``"allgather"`` (every worker receives every other worker's
            gradients; kept for comparison, see `benchmarks.run --network`).
            Formerly ``sparse_exchange``.
        experimental_pack_on_read_updates: Apply a synchronous step's updates
            of metric accumulators and batch-norm statistics with their
            deltas packed into the gradient all-reduce, or into one
            all-reduce when the step next reads them (default). False: one
            all-reduce per update, where it happens, or after the `tf.cond`
            whose branch made it (see `on_read_updates.py`). Formerly
            ``pack_on_read_updates``.
        experimental_fuse_lookups: Look up the sharded tables of a functional
            Keras model's `Embedding` layers together, one round trip per PS
            for all the tables of one width, instead of one per table; the
            rows and gradients are the same (see `tables/fusion.py`). Off by
            default: on loopback it was no faster (benchmarks/README).
            Formerly ``fuse_lookups``.
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
        dense_bucket_bytes: A synchronous step's dense gradients are summed
            among the workers in all-reduces of about this many bytes each,
            the last layers' first, so that their all-reduce runs while the
            backward pass still computes the earlier layers' gradients (as
            Horovod and PyTorch DDP bucket them); the sums are the same
            (see `runtime/reduction.py`). 0: one packed all-reduce for all
            of them. None (default): buckets of 256 KiB when the workers'
            addresses name more than one host, one all-reduce when they
            all name one (loopback included): buckets are faster on
            separate hosts and slower on one shared box (benchmarks/README.md,
            "Bucketed dense all-reduce"); the trained weights are the same
            bit for bit either way.
        dense_allreduce_dtype: ``"bfloat16"`` or ``"float16"``: a synchronous
            step's float32 dense gradients are cast to that dtype for their
            all-reduce among the workers and back to float32 after it (as
            PyTorch DDP's ``bf16_compress_hook`` and Horovod's
            ``Compression.fp16`` do): the ring moves half the bytes, and the
            sums keep 8 (bfloat16) or 11 (float16) significant bits, so the
            trained weights differ from the uncompressed run's in the last
            bits (a program can tell). What rides in the all-reduce besides
            the gradients (metric and batch-norm deltas, the loss-scaling
            count) stays exact. float16 keeps 11 bits but a narrow range (a
            sum above 65504 becomes inf); it is refused under
            ``mixed_float16``'s loss scaling. None (default): the gradients
            travel in their own dtype. See docs/api.md and
            benchmarks/README.md, "Compressed dense all-reduce".
        sharding: Deprecated: pass ``placement=PlacementPolicy(sharding=...)``
            to the strategy (its one home). ``"interleaved"`` or
            ``"contiguous"`` overrides the `PlacementPolicy`'s; None (default)
            keeps it.

    Raises:
        StrategyError: a knob with a value the strategy does not support, or
            a combination of knobs that is refused (ValueError for
            ``sharding``, as `PlacementPolicy` raises it).
        TypeError: an argument that is no knob.
    """

    embedding_updates: str = "sync"
    dense_placement: str = "allreduce"
    collective_timeout_seconds: float = 60.0
    connect_timeout_seconds: float = 300.0
    log_placement: bool = True
    experimental_sparse_exchange: str = "ps"
    experimental_pack_on_read_updates: bool = True
    experimental_fuse_lookups: bool = False
    stack_tables: bool = True
    table_dtype: Optional[str] = None
    dense_bucket_bytes: Optional[int] = DEFAULT_DENSE_BUCKET_BYTES
    dense_allreduce_dtype: Optional[str] = None
    sharding: Optional[str] = None  # Deprecated: PlacementPolicy's.

    def __init__(self, *, embedding_updates: str = "sync", dense_placement: str = "allreduce",
                 collective_timeout_seconds: float = 60.0,
                 connect_timeout_seconds: float = 300.0, log_placement: bool = True,
                 experimental_sparse_exchange: str = "ps",
                 experimental_pack_on_read_updates: bool = True,
                 experimental_fuse_lookups: bool = False, stack_tables: bool = True,
                 table_dtype: Optional[str] = None,
                 dense_bucket_bytes: Optional[int] = DEFAULT_DENSE_BUCKET_BYTES,
                 dense_allreduce_dtype: Optional[str] = None,
                 sharding: Any = _deprecation.UNSET,
                 sparse_exchange: Any = _deprecation.UNSET,
                 pack_on_read_updates: Any = _deprecation.UNSET,
                 fuse_lookups: Any = _deprecation.UNSET):
        # The developer toggles' former names: deprecated aliases.
        experimental_sparse_exchange = _deprecation.renamed(
            "HybridOptions", "sparse_exchange", sparse_exchange,
            "experimental_sparse_exchange", experimental_sparse_exchange, "ps")
        experimental_pack_on_read_updates = _deprecation.renamed(
            "HybridOptions", "pack_on_read_updates", pack_on_read_updates,
            "experimental_pack_on_read_updates", experimental_pack_on_read_updates, True)
        experimental_fuse_lookups = _deprecation.renamed(
            "HybridOptions", "fuse_lookups", fuse_lookups,
            "experimental_fuse_lookups", experimental_fuse_lookups, False)
        if sharding is _deprecation.UNSET:
            sharding = None
        if sharding is not None:
            warnings.warn(
                f"HybridOptions(sharding={sharding!r}) is deprecated: sharding has one home. Fix: "
                f"HybridParameterServerStrategy(placement=tf_psplugin.PlacementPolicy("
                f"sharding={sharding!r}))", _deprecation.PluginDeprecationWarning, stacklevel=2)
        values = dict(
            embedding_updates=embedding_updates, dense_placement=dense_placement,
            sharding=sharding, collective_timeout_seconds=collective_timeout_seconds,
            connect_timeout_seconds=connect_timeout_seconds, log_placement=log_placement,
            experimental_sparse_exchange=experimental_sparse_exchange,
            experimental_pack_on_read_updates=experimental_pack_on_read_updates,
            experimental_fuse_lookups=experimental_fuse_lookups, stack_tables=stack_tables,
            table_dtype=table_dtype, dense_bucket_bytes=dense_bucket_bytes,
            dense_allreduce_dtype=dense_allreduce_dtype)
        for name, value in values.items():
            object.__setattr__(self, name, value)
        self._validate()

    def _validate(self):
        half_precision.check_table_dtype(self.table_dtype)
        _check_one_of("experimental_sparse_exchange", self.experimental_sparse_exchange,
                      sparse_exchange_lib.SPARSE_EXCHANGES)
        _check_one_of("embedding_updates", self.embedding_updates, EMBEDDING_UPDATES)
        _check_one_of("dense_placement", self.dense_placement, DENSE_PLACEMENTS)
        if self.sharding is not None:  # PlacementPolicy's own check and message.
            placement_lib.PlacementPolicy(sharding=self.sharding)
        if not self.collective_timeout_seconds >= 0:
            raise StrategyError(
                f"collective_timeout_seconds={self.collective_timeout_seconds!r} must be >= 0 "
                "(0 = no limit). Fix: pass a number of seconds above your slowest step.")
        if self.dense_bucket_bytes is not None and (
                isinstance(self.dense_bucket_bytes, bool)
                or not isinstance(self.dense_bucket_bytes, int) or self.dense_bucket_bytes < 0):
            raise StrategyError(
                f"dense_bucket_bytes={self.dense_bucket_bytes!r} must be a whole number of bytes "
                ">= 0. Fix: pass e.g. 1 << 20, 0 for one all-reduce of every dense gradient, or None "
                "(the default: buckets only when the workers span hosts).")
        if self.dense_allreduce_dtype is not None:
            _check_one_of("dense_allreduce_dtype", self.dense_allreduce_dtype,
                          (None,) + collectives.WIRE_DTYPES)
        _check_combinations(self)

    def replace(self, **changes) -> "HybridOptions":
        """A copy with `changes` (knob name -> value), validated again.

        A toggle's former name (``sparse_exchange``, ...) is taken for its
        ``experimental_*`` name, with a `DeprecationWarning`.
        """
        for old in set(changes) & set(RENAMED):
            warnings.warn(f"HybridOptions.replace({old}=...) is deprecated: use "
                          f"{RENAMED[old]}=...", _deprecation.PluginDeprecationWarning,
                          stacklevel=2)
            changes[RENAMED[old]] = changes.pop(old)
        return dataclasses.replace(self, **changes)

    # The former names, read: deprecated aliases of the experimental_* fields.
    @property
    def sparse_exchange(self) -> str:
        """Deprecated: `experimental_sparse_exchange`."""
        _warn_read("sparse_exchange")
        return self.experimental_sparse_exchange

    @property
    def pack_on_read_updates(self) -> bool:
        """Deprecated: `experimental_pack_on_read_updates`."""
        _warn_read("pack_on_read_updates")
        return self.experimental_pack_on_read_updates

    @property
    def fuse_lookups(self) -> bool:
        """Deprecated: `experimental_fuse_lookups`."""
        _warn_read("fuse_lookups")
        return self.experimental_fuse_lookups


KNOBS = tuple(field.name for field in dataclasses.fields(HybridOptions))


def resolve(options: Optional[HybridOptions], knobs: Mapping[str, object],
            caller: str = "HybridParameterServerStrategy") -> HybridOptions:
    """The options a strategy runs with: `options`, or the defaults, plus `knobs`.

    Args:
        options: The ``options=`` argument, or None.
        knobs: The knobs passed as keywords (name -> value; deprecated, each
            warns with a `DeprecationWarning` naming its `HybridOptions`
            field). A toggle's former name counts as its ``experimental_*``
            name.

    Returns:
        A validated `HybridOptions`.

    Raises:
        TypeError: a keyword that is no knob (as Python's own message for an
            unexpected keyword argument).
        StrategyError: `options` is not a `HybridOptions`, a knob's value is
            not supported, or a knob is given both in `options` and as a
            keyword with a different value.
    """
    unknown = sorted(set(knobs) - set(KNOBS) - set(RENAMED))
    if unknown:
        raise TypeError(f"{caller}() got an unexpected keyword argument {unknown[0]!r}")
    if options is not None and not isinstance(options, HybridOptions):
        raise StrategyError(
            f"{caller}(options={options!r}): options must be a tf_psplugin.HybridOptions. "
            "Fix: options=tf_psplugin.HybridOptions(...).")
    if knobs:
        named = {RENAMED.get(name, name): value for name, value in knobs.items()}
        given = ", ".join(f"{name}={value!r}" for name, value in named.items())
        warnings.warn(
            f"{caller}({', '.join(f'{k}=...' for k in knobs)}): tuning knobs as keywords of the "
            f"strategy are deprecated. Fix: {caller}(options=tf_psplugin.HybridOptions({given}))",
            _deprecation.PluginDeprecationWarning, stacklevel=3)
        knobs = named
    if options is None:
        return HybridOptions(**knobs)
    for name, value in knobs.items():
        if getattr(options, name) != value:
            raise StrategyError(
                f"{caller}(options=HybridOptions({name}={getattr(options, name)!r}), "
                f"{name}={value!r}): {name} is given twice, with different values. Fix: give "
                f"it once, in options (options.replace({name}={value!r})).")
    return options


def _check_combinations(options: HybridOptions) -> None:
    """Refuses knobs that cannot take effect together (see `HybridOptions`)."""
    if options.experimental_sparse_exchange == "allgather":
        if options.embedding_updates == "async":
            raise StrategyError(
                "HybridOptions(embedding_updates='async', experimental_sparse_exchange="
                "'allgather'): asynchronous table updates exchange no gradients. Fix: "
                "embedding_updates='sync', or drop experimental_sparse_exchange.")
        if options.dense_placement == "ps":
            raise StrategyError(
                "HybridOptions(dense_placement='ps', experimental_sparse_exchange='allgather'): "
                "with dense variables on the PS no step is synchronous, so no gradient is "
                "exchanged. Fix: dense_placement='allreduce', or drop "
                "experimental_sparse_exchange.")
    if options.dense_placement == "ps" and options.dense_allreduce_dtype is not None:
        raise StrategyError(
            f"HybridOptions(dense_placement='ps', dense_allreduce_dtype="
            f"{options.dense_allreduce_dtype!r}): with dense variables on the PS no dense "
            "gradient is all-reduced. Fix: dense_placement='allreduce', or drop "
            "dense_allreduce_dtype.")
    if options.dense_placement == "ps" and not options.experimental_pack_on_read_updates:
        raise StrategyError(
            "HybridOptions(dense_placement='ps', experimental_pack_on_read_updates=False): with "
            "dense variables on the PS no accumulator is replicated, so there are no updates to "
            "pack. Fix: dense_placement='allreduce', or drop experimental_pack_on_read_updates.")


def _warn_read(old: str) -> None:
    warnings.warn(f"HybridOptions.{old} is deprecated: read HybridOptions.{RENAMED[old]}",
                  _deprecation.PluginDeprecationWarning, stacklevel=3)


def _check_one_of(name: str, value, allowed) -> None:
    if value not in allowed:
        raise StrategyError(
            f"{name}={value!r} is not supported. "
            f"Fix: use one of {', '.join(map(repr, allowed))}.")
