"""The placement rule: which variables are embedding tables and where they go.

This is the one decision the whole product rests on, so it lives in one place
and both front-ends (the Keras strategy and the Estimator run config) ask it:

* an **embedding table** is sharded across every PS task, in host memory;
* everything else is **dense** and gets one replica per worker, kept in sync by
  collective all-reduce (or, with ``dense_placement="ps"``, lives on a PS as in
  stock ParameterServerStrategy).

A variable is a table when any of these holds:

1. it was created inside :func:`embedding_table_scope`;
2. its base name is one that embedding layers use: ``embeddings``
   (``tf.keras.layers.Embedding`` and the plugin's own layer) or
   ``embedding_weights`` (``tf.feature_column.embedding_column``,
   canned estimators), and it is 2-D;
3. it is larger than ``PlacementPolicy.min_table_bytes``.

Rules 1 and 2 mean unchanged user code gets the right placement; rule 3 keeps
a huge variable of any other kind off the workers.

How many shards a table gets is :func:`table_shard_count`: one per PS task,
or what the strategy's ``variable_partitioner`` says (as stock
ParameterServerStrategy's constructor argument).
"""

import contextlib
import dataclasses
from typing import Iterable, Optional, Sequence, Tuple

from tf_psplugin._internal.scopes import ThreadScope

SHARDING_INTERLEAVED = "interleaved"
SHARDING_CONTIGUOUS = "contiguous"
SHARDING_SCHEMES = (SHARDING_INTERLEAVED, SHARDING_CONTIGUOUS)

KIND_TABLE = "table"
KIND_DENSE = "dense"

_TABLE_SCOPE = ThreadScope()
_ONE_SHARD_PER_PS_SCOPE = ThreadScope()


@contextlib.contextmanager
def embedding_table_scope():
    """Places every variable created inside this scope on the PS, sharded.

    Example:

    ```python
    with strategy.scope(), tf_psplugin.embedding_table_scope():
        user_vectors = tf.Variable(tf.zeros([10_000_000, 32]))
    ```

    Yields:
        None.
    """
    with _TABLE_SCOPE.scope():
        yield


def in_embedding_table_scope() -> bool:
    """Returns True inside :func:`embedding_table_scope` on this thread."""
    return _TABLE_SCOPE.active()


def one_shard_per_ps():
    """Tables created inside this scope get one shard per PS task, whatever the partitioner.

    For tables whose owner lays out its rows per PS task
    (`layers.DynamicEmbedding`: each PS admits keys into its own rows, and
    its row tables must be split like its embeddings).

    Returns:
        A context manager.
    """
    return _ONE_SHARD_PER_PS_SCOPE.scope()


def table_shard_count(shape, dtype, num_ps: int, partitioner=None,
                      name: Optional[str] = None) -> int:
    """How many shards (row blocks) an embedding table is split into.

    Without a partitioner (or inside :func:`one_shard_per_ps`), one per PS
    task. With one, what it returns for the first axis, as stock
    ParameterServerStrategy uses its ``variable_partitioner``: called as
    ``partitioner(shape=shape, dtype=dtype)``, it returns the number of
    partitions per axis, and only the first axis may be split. Either way
    capped at the number of rows, so that no shard is empty. More shards
    than PS tasks is allowed: the strategy places them round-robin.

    Args:
        shape: The table's full shape (a `tf.TensorShape` for TF's
            partitioners), rank >= 1 with a known first dimension.
        dtype: Its `tf.DType`.
        num_ps: PS tasks in the cluster.
        partitioner: A `tf.distribute.experimental.partitioners.Partitioner`
            or any callable ``(shape, dtype) -> list of ints``; None for one
            shard per PS task.
        name: The table's name, for the error message.

    Returns:
        The number of shards, between 1 and the number of rows.

    Raises:
        ValueError: The partitioner's answer splits another axis than the
            first, or asks for no shard.
    """
    num_rows = int(shape[0])
    if partitioner is None or _ONE_SHARD_PER_PS_SCOPE.active():
        return max(1, min(int(num_ps), num_rows))
    parts = partitioner(shape=shape, dtype=dtype)
    parts = list(parts) if isinstance(parts, (list, tuple)) else [parts]
    if (not parts or not all(isinstance(p, int) or hasattr(p, "__index__") for p in parts)
            or int(parts[0]) < 1 or any(int(p) != 1 for p in parts[1:])):
        raise ValueError(
            f"variable_partitioner returned {parts!r} for table {name!r} of shape "
            f"{list(shape)}, but a table can only be split along its first axis (rows). "
            "Fix: return a list of one int per axis, [n, 1, ...] with n >= 1, as "
            "tf.distribute.experimental.partitioners do.")
    return max(1, min(int(parts[0]), num_rows))


def base_name(name: Optional[str]) -> str:
    """Returns the last path component of a variable name, without ``:0``.

    Feature columns name their variables ``input_layer/C1_embedding/
    embedding_weights/part_0:0``; Keras passes just ``embeddings``. Both reduce
    to the name the embedding code chose.

    Args:
        name: A variable name, possibly scoped, partitioned or with an output
            index; may be None.

    Returns:
        The base name, e.g. ``embedding_weights``.
    """
    if not name:
        return ""
    parts = [p for p in str(name).split(":")[0].split("/") if p]
    while parts and parts[-1].startswith("part_"):
        parts.pop()
    return parts[-1] if parts else ""


def num_bytes(shape: Sequence[Optional[int]], dtype_size: int) -> int:
    """Returns the size in bytes of a fully defined shape, or 0 if unknown."""
    total = dtype_size
    for dim in shape:
        if dim is None:
            return 0
        total *= int(dim)
    return total


@dataclasses.dataclass(frozen=True)
class PlacementPolicy:
    """Decides whether a variable is an embedding table.

    Attributes:
        table_names: Base variable names that mark a 2-D variable as a table.
        min_table_bytes: Any variable at least this large is a table, whatever
            its name. 0 disables the size rule.
        sharding: How table rows are spread over PS tasks: ``"interleaved"``
            (row ``i`` on shard ``i mod n``, ``n`` shards: one per PS task
            unless a ``variable_partitioner`` says otherwise; balances Zipf-hot
            ids) or
            ``"contiguous"`` (row ranges, TF's default layout).
    """

    table_names: Tuple[str, ...] = ("embeddings", "embedding_weights")
    min_table_bytes: int = 64 << 20
    sharding: str = SHARDING_INTERLEAVED

    def __post_init__(self):
        if self.sharding not in SHARDING_SCHEMES:
            raise ValueError(
                f"PlacementPolicy.sharding: unknown scheme {self.sharding!r}. "
                f"Fix: use one of {', '.join(SHARDING_SCHEMES)}."
            )
        if self.min_table_bytes < 0:
            raise ValueError(
                "PlacementPolicy.min_table_bytes: must be >= 0 (0 disables the size rule)."
            )
        object.__setattr__(self, "table_names", tuple(self.table_names))

    def is_table(self, name: Optional[str], shape: Iterable[Optional[int]], dtype_size: int) -> bool:
        """Returns True if a variable with this name and shape is a table.

        Args:
            name: The variable's name as given to the variable creator.
            shape: Its shape (dimensions may be None when unknown).
            dtype_size: Bytes per element.

        Returns:
            Whether the variable belongs sharded on the PS tasks.
        """
        shape = tuple(shape)
        if in_embedding_table_scope():
            return True
        if len(shape) == 2 and base_name(name) in self.table_names:
            return True
        size = num_bytes(shape, dtype_size)
        return bool(self.min_table_bytes) and size >= self.min_table_bytes

    def kind(self, name: Optional[str], shape: Iterable[Optional[int]], dtype_size: int) -> str:
        """Returns :data:`KIND_TABLE` or :data:`KIND_DENSE` for a variable."""
        return KIND_TABLE if self.is_table(name, shape, dtype_size) else KIND_DENSE


@dataclasses.dataclass(frozen=True)
class PlacementRecord:
    """Where one variable was placed, for the start-up report.

    Attributes:
        name: Variable name.
        kind: ``"table"``, ``"dense"``, or ``"slot"`` suffixed kinds.
        shape: Full (logical) shape.
        dtype: dtype name.
        num_bytes: Size of the full variable.
        devices: Devices holding it (shards or replicas).
        stack: For a table stored in a stack (``stack_tables=True``), the
            stack's name; else empty.
        unstacked: With ``stack_tables=True``, why this table is not in a
            stack (e.g. "has a constraint"); else empty.
    """

    name: str
    kind: str
    shape: Tuple[int, ...]
    dtype: str
    num_bytes: int
    devices: Tuple[str, ...]
    stack: str = ""
    unstacked: str = ""

    def to_dict(self) -> dict:
        """Returns a JSON-friendly dict."""
        return dataclasses.asdict(self)


def format_report(records: Sequence[PlacementRecord],
                  stack_fallbacks: Sequence[Tuple[str, str]] = ()) -> str:
    """Formats placement records as a table for logs.

    Args:
        records: What was placed.
        stack_fallbacks: (stack name, what it does instead of one apply per
            stack shard, and why) for each fallback a stack took
            (``stack_tables=True``: rows of tables without a gradient kept,
            tables applied per table, tables split out of the stack).

    Returns:
        A multi-line human-readable report.
    """
    lines = ["tf_psplugin placement:"]
    for r in records:
        devices = sorted({_short_device(d) for d in r.devices})
        lines.append(
            f"  {r.kind:6s} {r.name:40s} {str(list(r.shape)):18s} {r.dtype:8s} "
            f"{r.num_bytes / 2**20:9.2f} MiB  on {', '.join(devices)}{_stacked_in(r)}"
        )
    tables = sum(r.num_bytes for r in records if r.kind.startswith(KIND_TABLE))
    dense = sum(r.num_bytes for r in records if r.kind.startswith(KIND_DENSE))
    lines.append(f"  total: tables {tables / 2**20:.2f} MiB on PS, dense {dense / 2**20:.2f} MiB per worker")
    if stack_fallbacks:
        lines.append("  stack fallbacks (exact, as unstacked; slower than one apply per stack):")
        lines.extend(f"    stack {name!r}: {text}" for name, text in stack_fallbacks)
    return "\n".join(lines)


def _stacked_in(record: PlacementRecord) -> str:
    if record.stack:
        return f" (stacked in {record.stack})"
    return f" (not stacked: {record.unstacked})" if record.unstacked else ""


def _short_device(device: str) -> str:
    return device.replace("/replica:0", "").replace("/device:CPU:0", "")


def _devices(records: Sequence[PlacementRecord]) -> str:
    return ", ".join(sorted({_short_device(d) for r in records for d in r.devices}))


def format_summary(records: Sequence[PlacementRecord]) -> str:
    """A short placement report for the log: tables in full, the rest grouped.

    Tables are what a user checks (are they sharded, on which PS, how big);
    dense variables, optimizer slots and metric counters are summarised by
    kind with their count and size. `format_report` keeps the full list.

    Args:
        records: What was placed.

    Returns:
        A few human-readable lines.
    """
    tables = [r for r in records if r.kind == KIND_TABLE]
    lines = [f"tf_psplugin placement: {len(tables)} embedding table(s) on the PS tasks"]
    for r in tables:
        lines.append(
            f"  table  {r.name:40s} {str(list(r.shape)):18s} {r.dtype:8s} "
            f"{r.num_bytes / 2**20:9.2f} MiB  sharded on {_devices([r])}{_stacked_in(r)}")
    groups = {}
    for r in records:
        if r.kind != KIND_TABLE:
            groups.setdefault(r.kind, []).append(r)
    labels = {"table-slot": "table optimizer slots", KIND_DENSE: "dense variables",
              "dense-slot": "dense optimizer slots", "ps": "variables on PS (not sharded)"}
    for kind in sorted(groups, key=lambda k: (list(labels).index(k) if k in labels else 99, k)):
        group = groups[kind]
        size = sum(r.num_bytes for r in group) / 2**20
        where = ("one replica on each of " if kind.startswith(KIND_DENSE) else "on ") + _devices(group)
        lines.append(f"  {labels.get(kind, kind)}: {len(group)}, {size:.2f} MiB, {where}")
    table_bytes = sum(r.num_bytes for r in records if r.kind.startswith(KIND_TABLE))
    dense_bytes = sum(r.num_bytes for r in records if r.kind.startswith(KIND_DENSE))
    lines.append(f"  total: tables {table_bytes / 2**20:.2f} MiB on PS, dense "
                 f"{dense_bytes / 2**20:.2f} MiB per worker "
                 "(every variable: strategy.placement_report())")
    return "\n".join(lines)
