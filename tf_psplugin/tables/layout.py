"""Row layout of a sharded table: which logical row lives on which shard.

Why this module exists: the layout arithmetic is shared by the table type
(`sharded.py`), the placement report and the benchmark, and is pure
Python/numpy apart from the one TF helper that puts shard pieces back in
logical order. Two schemes: "interleaved" (logical row ``i`` on shard
``i % n`` at position ``i // n``: Zipf-hot small ids spread evenly) and
"contiguous" (TF's own ``ShardedVariable`` layout: row ranges).
"""

from typing import List, Sequence

import numpy as np
import tensorflow as tf

from tf_psplugin.tables.placement import SHARDING_INTERLEAVED, SHARDING_SCHEMES


def _check_layout_args(num_rows: int, num_shards: int, scheme: str) -> None:
    if scheme not in SHARDING_SCHEMES:
        raise ValueError(
            f"Unknown sharding scheme {scheme!r}. Fix: use one of {', '.join(SHARDING_SCHEMES)}."
        )
    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards}.")
    if num_rows < 0:
        raise ValueError(f"num_rows must be >= 0, got {num_rows}.")


def shard_rows(num_rows: int, num_shards: int, scheme: str) -> List[int]:
    """Returns how many rows each shard holds.

    Both schemes give the first ``num_rows % num_shards`` shards one extra row
    (the sizes TF's "div" partitioning uses), so a checkpoint slice per shard
    is as large as the shard itself.

    Args:
        num_rows: Rows of the logical table.
        num_shards: Number of shards (>= 1).
        scheme: ``"interleaved"`` or ``"contiguous"``.

    Returns:
        A list of ``num_shards`` row counts summing to ``num_rows``.

    Raises:
        ValueError: On an unknown scheme or a negative size.
    """
    _check_layout_args(num_rows, num_shards, scheme)
    base, extra = divmod(num_rows, num_shards)
    return [base + (1 if s < extra else 0) for s in range(num_shards)]


def logical_rows_of_shard(num_rows: int, num_shards: int, shard: int, scheme: str) -> slice:
    """Returns the logical rows that shard ``shard`` holds, in its row order.

    Interleaved shards hold ``slice(shard, num_rows, num_shards)``; contiguous
    ones a step-1 slice. A slice (rather than an index array) costs nothing for
    huge tables and indexes numpy arrays directly: ``full[rows]`` is the shard.

    Args:
        num_rows: Rows of the logical table.
        num_shards: Number of shards.
        shard: Shard index in ``[0, num_shards)``.
        scheme: ``"interleaved"`` or ``"contiguous"``.

    Returns:
        A `slice`; ``range(num_rows)[result]`` lists the logical row ids.

    Raises:
        ValueError: On bad arguments.
    """
    sizes = shard_rows(num_rows, num_shards, scheme)
    if not 0 <= shard < num_shards:
        raise ValueError(f"shard must be in [0, {num_shards}), got {shard}.")
    if scheme == SHARDING_INTERLEAVED:
        return slice(shard, num_rows, num_shards)
    begin = sum(sizes[:shard])
    return slice(begin, begin + sizes[shard], 1)


def shard_lookup_counts(ids, num_rows: int, num_shards: int, scheme: str) -> np.ndarray:
    """Counts how many of ``ids`` each shard serves (load-balance check).

    Args:
        ids: Array-like of logical row ids in ``[0, num_rows)``, any shape.
        num_rows: Rows of the logical table.
        num_shards: Number of shards.
        scheme: ``"interleaved"`` or ``"contiguous"``.

    Returns:
        An int64 array of length ``num_shards``.

    Raises:
        ValueError: On bad arguments or out-of-range ids.
    """
    sizes = shard_rows(num_rows, num_shards, scheme)
    ids = np.asarray(ids, dtype=np.int64).ravel()
    if ids.size and (ids.min() < 0 or ids.max() >= num_rows):
        raise ValueError(f"ids must lie in [0, {num_rows}).")
    if scheme == SHARDING_INTERLEAVED:
        owner = ids % num_shards
    else:
        owner = np.searchsorted(np.cumsum(sizes), ids, side="right")
    return np.bincount(owner, minlength=num_shards).astype(np.int64)


def _range_plan(num_shards: int, begin: int, end: int):
    """Where the logical rows ``[begin, end)`` live in interleaved shards.

    Returns a list indexed by ``j = (s - begin) % n``, the offset of shard
    ``s``'s first row inside the range, of ``(s, first_position, count)``.
    Counts are non-increasing in ``j`` (the first ``(end-begin) % n`` entries
    have one more row), which is what :func:`_interleave` expects.
    """
    plan = []
    for j in range(num_shards):
        first = begin + j
        count = len(range(first, end, num_shards))
        plan.append((first % num_shards, first // num_shards, count))
    return plan


def _interleave(pieces: Sequence[tf.Tensor], counts: Sequence[int], total: int) -> tf.Tensor:
    """Merges ``pieces`` (row ``k`` of piece ``j`` is output row ``k*n + j``).

    Uses pad + stack + reshape, so no index tensor the size of the table is
    ever built and gradients flow back to every piece.
    """
    if len(pieces) == 1:
        return pieces[0]
    n = len(pieces)
    rows = -(-total // n)
    tail = pieces[0].shape[1:].as_list()
    padded = []
    for piece, count in zip(pieces, counts):
        if count < rows:
            pad = tf.zeros([rows - count] + tail, dtype=piece.dtype)
            piece = tf.concat([piece, pad], axis=0)
        padded.append(piece)
    merged = tf.reshape(tf.stack(padded, axis=1), [rows * n] + tail)
    return merged if rows * n == total else merged[:total]
