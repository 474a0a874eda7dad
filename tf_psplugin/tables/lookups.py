"""Embedding lookups on an interleaved table: TF's lookup APIs dispatched to it.

Why this module exists: `tf.nn.embedding_lookup`, the sparse and safe
variants, v1 and v2, and `tf.identity` must see an
`InterleavedShardedVariable` as one logical ``[V, D]`` table. Each is
overridden for the type with `tf.experimental.dispatch_for_api` and calls
the v1 API on the shard list with ``partition_strategy="mod"`` -- one gather
per shard, on the shard's PS. Type-based dispatch is tried before the
fallback `dispatch_for_types` that `ShardedVariable` registers for
`embedding_lookup`. v1 `safe_embedding_lookup_sparse` is the exception (see
`patch_safe_lookup_v1`). Registered when the `tables` package is imported.
"""

from typing import List, Union

import numpy as np
import tensorflow as tf

from tf_psplugin._internal import tf_objects
from tf_psplugin._internal.tf_internal import sharded_variable
from tf_psplugin.tables import prefetched, stack_rows
from tf_psplugin.tables.layout import shard_rows
from tf_psplugin.tables.placement import SHARDING_INTERLEAVED
from tf_psplugin.tables.sharded import InterleavedShardedVariable


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


def _shards(table):
    """What TF's v1 "mod" lookups gather from, with the table's own logical ids.

    An interleaved table's shard variables; a stacked table's per-shard views
    (`stacking.TableView`: its own rows of each stack shard, whose
    gradients are its own).
    """
    return table.views or table.variables


@tf.experimental.dispatch_for_api(tf.nn.embedding_lookup, {"params": InterleavedShardedVariable})
def _embedding_lookup_v2(params, ids, max_norm=None, name=None):
    rows = params._shape_only_lookup(ids, max_norm)  # pylint: disable=protected-access
    if rows is not None:
        return rows
    if max_norm is None:
        # Rows a fused lookup of the model's tables already fetched (tables/fusion.py).
        rows = prefetched.take(params, ids)
        if rows is not None:
            return rows
    return tf.compat.v1.nn.embedding_lookup(_shards(params), ids, "mod", name, max_norm=max_norm)


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
        _shards(table), ids, "mod", name, validate_indices, max_norm
    )


@tf.experimental.dispatch_for_api(
    tf.nn.embedding_lookup_sparse, {"params": InterleavedShardedVariable}
)
def _embedding_lookup_sparse_v2(
    params, sp_ids, sp_weights, combiner=None, max_norm=None, name=None, allow_fast_lookup=False
):
    return tf.compat.v1.nn.embedding_lookup_sparse(
        _shards(params), sp_ids, sp_weights, "mod", name, combiner, max_norm, allow_fast_lookup
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
        _shards(table), sp_ids, sp_weights, "mod", name, combiner, max_norm, allow_fast_lookup
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
    shards = embedding_weights.variables
    if isinstance(embedding_weights, InterleavedShardedVariable):
        partition_strategy = "mod"
        shards = _shards(embedding_weights)
    return tf.compat.v1.nn.safe_embedding_lookup_sparse(
        shards,
        sparse_ids,
        sparse_weights=sparse_weights,
        combiner=combiner,
        default_id=default_id,
        name=name,
        partition_strategy=partition_strategy,
        max_norm=max_norm,
        allow_fast_lookup=allow_fast_lookup,
    )




def patch_safe_lookup_v1():
    """Makes v1 `safe_embedding_lookup_sparse` (feature columns call it) use "mod".

    Applied through `tf_psplugin._internal.patches`
    ("safe_embedding_lookup_v1"); returns the undo.

    TF 2.15.1 registers `sharded_variable.safe_embedding_lookup_sparse` with
    `dispatch_for_api` for every `ShardedVariable`; registering a second
    target for our subclass would make every such call fail with "Multiple
    dispatch targets". So we unregister TF's target and register one that
    does exactly what TF's did for a plain `ShardedVariable` (pass the shards
    and the caller's partition_strategy) and forces "mod" for ours. Applied
    when the first interleaved table is built, never at import.
    """
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

    def undo():
        tf.experimental.unregister_dispatch_for(_safe_embedding_lookup_sparse_v1)
        if claimed is not InterleavedShardedVariable:  # TF's target was unregistered above.
            tf.experimental.dispatch_for_api(api, {"embedding_weights": claimed})(tf_target)

    return undo


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
    shard = tf.cast(all_ids % num_shards, tf.int32)  # Logical row i lives on shard i % n ...
    local = all_ids // num_shards                     # ... at position i // n.
    positions = tf.range(tf.size(all_ids, out_type=tf.int32))
    local_parts = tf.dynamic_partition(local, shard, num_shards)
    table_parts = tf.dynamic_partition(table_of, shard, num_shards)
    position_parts = tf.dynamic_partition(positions, shard, num_shards)
    physical_parts = None
    if any(t.views for t in tables):
        # Stacked tables: each id's row in its stack shard, for all at once
        # (an id outside its table stays out of every shard's range).
        slot = tf.cast(table_of, tf.int64) * num_shards + tf.cast(shard, tf.int64)
        offsets = tf.constant([o for t in tables for o in t.row_offsets], tf.int64)
        counts = tf.constant([c for t in tables
                              for c in shard_rows(int(t.shape[0]), num_shards,
                                                  SHARDING_INTERLEAVED)], tf.int64)
        physical = stack_rows.shift_valid(
            local, local + tf.gather(offsets, slot), tf.gather(counts, slot))
        physical_parts = tf.dynamic_partition(physical, shard, num_shards)
    rows = []
    for p in range(num_shards):
        # What each table gathers from on shard p: its shard variable, or, for
        # a stacked table, its view of the stack shard (own rows, own gradient).
        shards = [_shards(t)[p] for t in tables]
        stack_shard = _one_stack_shard(tables, p)
        if stack_shard is not None:
            # One stack holds them all (tables/stacking.py): one gather per PS.
            rows.append(_stacked_gather(tables, shards, stack_shard, local_parts[p],
                                        physical_parts[p], table_parts[p]))
            continue
        # The concatenation is table-major and dynamic_partition keeps order,
        # so shard p's ids are grouped by table, in table order.
        counts = tf.math.bincount(table_parts[p], minlength=len(tables),
                                  maxlength=len(tables), dtype=tf.int32)
        with tf.device(shards[0].device):
            pieces = tf.split(local_parts[p], counts, num=len(tables))
            rows.append(tf.concat(
                [tf.gather(v, piece) for v, piece in zip(shards, pieces)], axis=0))
    stitched = tf.dynamic_stitch(position_parts, rows)
    width = int(tables[0].shape[-1])
    out = []
    for i, part in zip(ids_list, tf.split(stitched, tf.stack(sizes), num=len(tables))):
        out.append(tf.reshape(part, tf.concat([tf.shape(i, out_type=tf.int64), [width]], 0)))
    return out


def _one_stack_shard(tables, p):
    """Shard p of the stack that holds every one of `tables` (tables/stacking.py), or None."""
    if not all(t.views for t in tables):
        return None
    first = tables[0].variables[p]
    return first if all(t.variables[p] is first for t in tables[1:]) else None


def _stacked_gather(tables, views, stack_shard, local, physical, table_of):
    """One gather of a stack shard for the ids of several of its tables.

    `local` holds each id's row within its table's shard, `physical` its row
    in the stack shard, `table_of` the table. The rows come from one gather
    of the stack shard; the gradient is split back into one `IndexedSlices`
    per table's view (its own rows), as each table's own lookup would give
    it (`TableView._read`), and the whole stack shard's gradient is noted
    beside them, so that an optimizer given all of them unchanged applies it
    without putting them back together (`stack_rows.whole_gradient`).
    """
    inner = tf_objects.aggregating_inner(stack_shard)
    shapes = [tf.constant(v.shape.as_list(), tf.int32) for v in views]
    whole_shape = tf.constant(inner.shape.as_list(), tf.int32)
    for view in views:
        stack_rows.watch(view)
    dtype = tables[0].dtype

    @tf.custom_gradient
    def gather(*handles):
        del handles  # Only the gradient's inputs: the rows come from the stack.
        rows = tf.raw_ops.ResourceGather(resource=inner.handle, indices=physical, dtype=dtype)

        def grad(dy):
            values = tf.dynamic_partition(dy, table_of, len(views))
            ids = tf.dynamic_partition(local, table_of, len(views))
            split = [tf.IndexedSlices(v, i, shape) for v, i, shape in zip(values, ids, shapes)]
            stack_rows.note_split(split, tf.IndexedSlices(dy, physical, whole_shape))
            return split

        return rows, grad

    with tf.device(inner.device):
        return gather(*[v.handle for v in views])
