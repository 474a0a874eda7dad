"""Embedding lookups on an interleaved table: TF's lookup APIs dispatched to it.

Why this module exists: `tf.nn.embedding_lookup`, the sparse and safe
variants, v1 and v2, and `tf.identity` must see an
`InterleavedShardedVariable` as one logical ``[V, D]`` table. Each is
overridden for the type with `tf.experimental.dispatch_for_api` and calls
the v1 API on the shard list with ``partition_strategy="mod"`` -- one gather
per shard, on the shard's PS. Type-based dispatch is tried before the
fallback `dispatch_for_types` that `ShardedVariable` registers for
`embedding_lookup`. v1 `safe_embedding_lookup_sparse` is the exception (see
`install_safe_lookup_v1_override`). Registered when `sharding` is imported.
"""

import threading
from typing import List, Union

import numpy as np
import tensorflow as tf

from tf_psplugin._tf_internal import sharded_variable
from tf_psplugin.sharding import InterleavedShardedVariable


# `ids` types the v1 lookups claim. Ragged ids are left to TF's ragged
# dispatcher (which flattens them and calls back into these), because two
# type-based targets matching the same call is an error in TF 2.15.
_DenseIds = Union[tf.Tensor, tf.Variable, np.ndarray, np.generic, int, list, tuple]
_Params = Union[InterleavedShardedVariable, List[InterleavedShardedVariable]]


def _table_of(params) -> InterleavedShardedVariable:
    if isinstance(params, (list, tuple)):
        if len(params) != 1:
            raise ValueError(
                "Pass one InterleavedShardedVariable as params, not a list of "
                f"{len(params)}: each one is already a whole table."
            )
        params = params[0]
    return params


def _physical_sparse_ids(table, sp_ids):
    """`sp_ids` with its values shifted to the table's rows in a stack (`_physical_ids`)."""
    shifted = table._physical_ids(sp_ids.values)  # pylint: disable=protected-access
    if shifted is sp_ids.values:
        return sp_ids
    return tf.SparseTensor(sp_ids.indices, shifted, sp_ids.dense_shape)


def _physical_default_id(table, default_id: int) -> int:
    """A Python int `default_id`, shifted like `_physical_ids` (TF uses it as a Python value)."""
    offsets = getattr(table, "row_offsets", None)
    if not offsets:
        return default_id
    n = len(offsets)
    return int(default_id) + n * offsets[int(default_id) % n]


@tf.experimental.dispatch_for_api(tf.nn.embedding_lookup, {"params": InterleavedShardedVariable})
def _embedding_lookup_v2(params, ids, max_norm=None, name=None):
    rows = params._shape_only_lookup(ids, max_norm)  # pylint: disable=protected-access
    if rows is not None:
        return rows
    if max_norm is None:
        # Rows a fused lookup of the model's tables already fetched (lookup_fusion).
        from tf_psplugin import lookup_fusion  # pylint: disable=g-import-not-at-top  (a cycle)

        rows = lookup_fusion.take(params, ids)
        if rows is not None:
            return rows
    return tf.compat.v1.nn.embedding_lookup(params.variables, params._physical_ids(ids), "mod",
                                            name, max_norm=max_norm)


@tf.experimental.dispatch_for_api(
    tf.compat.v1.nn.embedding_lookup, {"params": _Params, "ids": _DenseIds}
)
def _embedding_lookup_v1(
    params, ids, partition_strategy="mod", name=None, validate_indices=True, max_norm=None
):
    # The table's layout is "mod" whatever the caller asks for: a caller
    # passing "div" means "the table's own layout" (embedding_lookup_v2 does).
    del partition_strategy
    table = _table_of(params)
    return tf.compat.v1.nn.embedding_lookup(
        table.variables, table._physical_ids(ids), "mod", name, validate_indices, max_norm
    )


@tf.experimental.dispatch_for_api(
    tf.nn.embedding_lookup_sparse, {"params": InterleavedShardedVariable}
)
def _embedding_lookup_sparse_v2(
    params, sp_ids, sp_weights, combiner=None, max_norm=None, name=None, allow_fast_lookup=False
):
    return tf.compat.v1.nn.embedding_lookup_sparse(
        params.variables, _physical_sparse_ids(params, sp_ids), sp_weights, "mod", name, combiner,
        max_norm, allow_fast_lookup
    )


@tf.experimental.dispatch_for_api(
    tf.compat.v1.nn.embedding_lookup_sparse, {"params": _Params, "sp_ids": tf.SparseTensor}
)
def _embedding_lookup_sparse_v1(
    params,
    sp_ids,
    sp_weights,
    partition_strategy="mod",
    name=None,
    combiner=None,
    max_norm=None,
    allow_fast_lookup=False,
):
    del partition_strategy  # Always the table's own "mod" layout.
    table = _table_of(params)
    return tf.compat.v1.nn.embedding_lookup_sparse(
        table.variables, _physical_sparse_ids(table, sp_ids), sp_weights, "mod", name, combiner,
        max_norm, allow_fast_lookup
    )


@tf.experimental.dispatch_for_api(
    tf.nn.safe_embedding_lookup_sparse,
    {"embedding_weights": InterleavedShardedVariable},
)
def _safe_embedding_lookup_sparse_v2(
    embedding_weights,
    sparse_ids,
    sparse_weights=None,
    combiner="mean",
    default_id=None,
    max_norm=None,
    name=None,
    allow_fast_lookup=False,
):
    return _safe_embedding_lookup_sparse_v1(
        embedding_weights, sparse_ids, sparse_weights=sparse_weights, combiner=combiner,
        default_id=default_id, name=name, max_norm=max_norm,
        allow_fast_lookup=allow_fast_lookup)  # An interleaved table: always "mod".


@tf.experimental.dispatch_for_api(tf.identity, {"input": InterleavedShardedVariable})
def _identity(input, name=None):  # pylint: disable=redefined-builtin
    # TF maps identity over a composite's components, which then fail to
    # rebuild a ShardedVariable from Tensors; a table's identity is its value.
    return tf.identity(input._logical_value(), name=name)  # pylint: disable=protected-access


def _safe_embedding_lookup_sparse_v1(
    embedding_weights,
    sparse_ids,
    sparse_weights=None,
    combiner="mean",
    default_id=None,
    name=None,
    partition_strategy="div",
    max_norm=None,
    allow_fast_lookup=False,
):
    """TF's ShardedVariable dispatcher for v1 safe lookups, plus "mod" for ours."""
    if isinstance(embedding_weights, InterleavedShardedVariable):
        partition_strategy = "mod"
        sparse_ids = _physical_sparse_ids(embedding_weights, sparse_ids)
        if default_id is not None:
            default_id = _physical_default_id(embedding_weights, default_id)
    return tf.compat.v1.nn.safe_embedding_lookup_sparse(
        embedding_weights.variables,
        sparse_ids,
        sparse_weights=sparse_weights,
        combiner=combiner,
        default_id=default_id,
        name=name,
        partition_strategy=partition_strategy,
        max_norm=max_norm,
        allow_fast_lookup=allow_fast_lookup,
    )


_override_lock = threading.Lock()
_override_installed = False


def install_safe_lookup_v1_override():
    """Makes v1 `safe_embedding_lookup_sparse` (feature columns call it) use "mod".

    TF 2.15.1 registers `sharded_variable.safe_embedding_lookup_sparse` with
    `dispatch_for_api` for every `ShardedVariable`; registering a second
    target for our subclass would make every such call fail with "Multiple
    dispatch targets". So we unregister TF's target and register one that
    does exactly what TF's did for a plain `ShardedVariable` (pass the shards
    and the caller's partition_strategy) and forces "mod" for ours. Runs once,
    when the first interleaved table is built, never at import.
    """
    global _override_installed
    with _override_lock:
        if _override_installed:
            return
        api = tf.compat.v1.nn.safe_embedding_lookup_sparse
        tf_target = getattr(sharded_variable, "safe_embedding_lookup_sparse", None)
        claimed = InterleavedShardedVariable
        if tf_target is not None:
            try:
                tf.experimental.unregister_dispatch_for(tf_target)
                claimed = sharded_variable.ShardedVariable
            except ValueError:  # Not registered in this TF version: nothing to replace.
                pass
        tf.experimental.dispatch_for_api(api, {"embedding_weights": claimed})(
            _safe_embedding_lookup_sparse_v1
        )
        _override_installed = True


def lookup_tables(tables, ids_list, name=None):
    """Looks up several tables with one round trip per PS task.

    `tf.nn.embedding_lookup` on each of T interleaved tables sharded over P
    PS tasks sends T x P id tensors to the PS tasks and T x P row tensors
    back, each a separate cross-process transfer. This routes every table's
    ids together: one id tensor and one count vector to each PS, where the
    T shard gathers run locally, and one row tensor back. The result, and the
    gradient each table receives (one `IndexedSlices` per shard, as with
    `tf.nn.embedding_lookup`), are the same as T separate lookups.

    Tables that are not `InterleavedShardedVariable`s (one process, or tables
    a strategy left on the workers), or that are sharded over different
    numbers of tasks, are looked up one by one with `tf.nn.embedding_lookup`.

    Args:
        tables: A sequence of T tables, all of the same row width and dtype.
        ids_list: A sequence of T integer id tensors of any shape.
        name: Optional name scope.

    Returns:
        A list of T tensors: the rows of ``tables[t]`` for ``ids_list[t]``, of
        shape ``ids_list[t].shape + [D]``.

    Raises:
        ValueError: `tables` and `ids_list` differ in length, or the tables
            differ in row width or dtype.
    """
    tables, ids_list = list(tables), list(ids_list)
    if len(tables) != len(ids_list):
        raise ValueError(f"lookup_tables: {len(tables)} tables but {len(ids_list)} id tensors; "
                         "pass one id tensor per table.")
    if not tables:
        return []
    widths = {int(t.shape[-1]) for t in tables}
    dtypes = {t.dtype.base_dtype for t in tables}
    if len(widths) > 1 or len(dtypes) > 1:
        raise ValueError(f"lookup_tables: tables differ in row width {sorted(widths)} or dtype "
                         f"{sorted(d.name for d in dtypes)}; look up each group on its own.")
    shard_counts = {len(t.variables) if isinstance(t, InterleavedShardedVariable) else None
                    for t in tables}
    with tf.name_scope(name or "lookup_tables"):
        if len(shard_counts) != 1 or None in shard_counts or len(tables) == 1:
            return [tf.nn.embedding_lookup(t, i) for t, i in zip(tables, ids_list)]
        return _fused_interleaved_lookup(tables, ids_list, shard_counts.pop())


def _fused_interleaved_lookup(tables, ids_list, num_shards):
    ids_list = [tf.cast(tf.convert_to_tensor(i), tf.int64) for i in ids_list]
    flat = [tf.reshape(i, [-1]) for i in ids_list]
    sizes = [tf.size(f, out_type=tf.int64) for f in flat]
    all_ids = tf.concat(flat, axis=0)
    table_of = tf.concat(
        [tf.fill([s], tf.constant(t, tf.int32)) for t, s in enumerate(sizes)], axis=0)
    offsets = [getattr(t, "row_offsets", None) for t in tables]
    if any(o is not None for o in offsets):
        # Stacked tables (table_stacking): every id shifted to its table's
        # rows in the stack, as `_physical_ids` does, in one gather for all
        # (and, as there, an id outside [0, V) kept out of every shard's range).
        offsets = [o or (0,) * num_shards for o in offsets]
        flat_offsets = tf.constant([o for row in offsets for o in row], tf.int64)  # [T * n]
        slot = tf.cast(table_of, tf.int64) * num_shards + all_ids % num_shards
        num_rows = tf.gather(tf.constant([int(t.shape[0]) for t in tables], tf.int64), table_of)
        shifted = all_ids + num_shards * tf.gather(flat_offsets, slot)
        too_big = tf.fill(tf.shape(all_ids), tf.constant(tf.int64.max, tf.int64))
        all_ids = tf.where(all_ids < 0, all_ids, tf.where(all_ids < num_rows, shifted, too_big))
    shard = tf.cast(all_ids % num_shards, tf.int32)  # Logical row i lives on shard i % n ...
    local = all_ids // num_shards                     # ... at position i // n.
    positions = tf.range(tf.size(all_ids, out_type=tf.int32))
    local_parts = tf.dynamic_partition(local, shard, num_shards)
    table_parts = tf.dynamic_partition(table_of, shard, num_shards)
    position_parts = tf.dynamic_partition(positions, shard, num_shards)
    rows = []
    for p in range(num_shards):
        shard_vars = [t.variables[p] for t in tables]
        if all(v is shard_vars[0] for v in shard_vars):
            # One stack holds them all (table_stacking): one gather per PS.
            with tf.device(shard_vars[0].device):
                rows.append(tf.gather(shard_vars[0], local_parts[p]))
            continue
        # The concatenation is table-major and dynamic_partition keeps order,
        # so shard p's ids are grouped by table, in table order.
        counts = tf.math.bincount(table_parts[p], minlength=len(tables),
                                  maxlength=len(tables), dtype=tf.int32)
        with tf.device(shard_vars[0].device):
            pieces = tf.split(local_parts[p], counts, num=len(tables))
            rows.append(tf.concat(
                [tf.gather(v, piece) for v, piece in zip(shard_vars, pieces)], axis=0))
    stitched = tf.dynamic_stitch(position_parts, rows)
    width = int(tables[0].shape[-1])
    out = []
    for i, part in zip(ids_list, tf.split(stitched, tf.stack(sizes), num=len(tables))):
        out.append(tf.reshape(part, tf.concat([tf.shape(i, out_type=tf.int64), [width]], 0)))
    return out
