"""What a `DynamicEmbedding` keeps on each PS task besides its rows, and how it writes rows.

`tables/dynamic.py` is the Keras layer; this module is its storage: each PS
task's key -> row map and row -> key map (`ShardState`, in that task's
memory), the maps checkpointed whole as (key, row) pairs (`KeyIndex`, so a
checkpoint restores into any number of PS tasks), the raw scatter writes
into logical rows of the row tables, and `check_consistency`, which reads it
all back. The admission policy that changes the maps is
`tables/dynamic_admission.py`.
"""

from typing import List

import tensorflow as tf

from tf_psplugin._internal import tf_internal as _tf_internal
from tf_psplugin.tables import key_hashing

# The counters `ShardState.stats` keeps, by key 0..3 (`DynamicEmbedding.table_stats`).
STAT_NAMES = ("admitted", "evicted", "rejected", "expired")


class Fill:
    """An initializer filling with one value (any dtype, also strings); shard-aware."""

    def __init__(self, value):
        self.value = value

    def __call__(self, shape, dtype=None, partition_shape=None, **_):
        return tf.fill(partition_shape or shape, tf.constant(self.value, dtype))


def table_parts(var) -> list:
    """The per-PS parts of a table (a plain variable is one part)."""
    if isinstance(var, _tf_internal.sharded_variable.ShardedVariable):
        return list(var.variables)
    return [var]



class KeyIndex(_tf_internal.trackable_base.Trackable):
    """The per-shard key -> row maps (and row -> key maps), checkpointed as (key, row) pairs.

    Saved whole, so a checkpoint restores into any number of shards: each key
    goes back to the map of the shard its hash names now, and each row's key
    to the reverse map of the shard that holds the row now. Rows are logical
    row numbers of the table, which restores by logical row.
    """

    def __init__(self, states):
        self._states = states
        # On a serving copy the map is saved as a table of its own.
        self.serving = False

    def export(self):
        """All (keys, rows) pairs, as two tensors."""
        exported = [st.map.export() for st in self._states]
        return tf.concat([k for k, _ in exported], 0), tf.concat([r for _, r in exported], 0)

    def load(self, keys, rows):
        """Replaces every map's content with these (key, row) pairs."""
        cleared = []
        for st in self._states:
            # Each map by its own keys: after a restore into another PS count
            # a key's map entry and its row's reverse entry are on different
            # shards, so the map's rows are not the reverse map's.
            old_keys, _ = st.map.export()
            old_rows, _ = st.rows.export()
            cleared += [st.map.remove(old_keys), st.rows.remove(old_rows)]
        n = len(self._states)
        with tf.control_dependencies([c for c in cleared if c is not None]):
            if n == 1:
                key_parts, row_parts = [keys], [rows]
                rkey_parts, rrow_parts = [keys], [rows]
            else:
                owner = key_hashing.shard_of(key_hashing.key_hash(keys), n)
                key_parts = tf.dynamic_partition(keys, owner, n)
                row_parts = tf.dynamic_partition(rows, owner, n)
                holder = tf.cast(tf.math.floormod(rows, n), tf.int32)
                rkey_parts = tf.dynamic_partition(keys, holder, n)
                rrow_parts = tf.dynamic_partition(rows, holder, n)
            ops = []
            for st, k, r, rk, rr in zip(self._states, key_parts, row_parts, rkey_parts,
                                        rrow_parts):
                ops += [st.map.insert(k, r), st.rows.insert(rr, rk)]
        return tf.group([o for o in ops if o is not None]) if ops else None

    def _serialize_to_tensors(self):
        # Trackable's saveable protocol (see _tf_internal.PRIVATE_ATTRIBUTES).
        if self.serving:
            return {}
        keys, rows = self.export()
        return {"keys": keys, "rows": rows}

    def _restore_from_tensors(self, restored_tensors):
        if self.serving:
            return tf.no_op()
        return self.load(restored_tensors["keys"], restored_tensors["rows"])


class ShardState:
    """What one PS task holds besides its table rows: maps, pending keys, counters."""

    def __init__(self, device: str, key_dtype: tf.DType):
        with tf.init_scope(), tf.device(device):
            # Anonymous: a restarted chief must not find its predecessor's
            # tables on the PS (a shared name would hand them back).
            self.map = tf.lookup.experimental.MutableHashTable(
                key_dtype, tf.int64, default_value=-1, experimental_is_anonymous=True)
            # Row (logical) -> key, for the rows this task holds: which key
            # an evicted row frees. A table, not a variable: a string
            # variable could not be restored in slices into another PS count.
            self.rows = tf.lookup.experimental.MutableHashTable(
                tf.int64, key_dtype, default_value="" if key_dtype == tf.string else 0,
                experimental_is_anonymous=True)
            self.pending = tf.lookup.experimental.MutableHashTable(
                key_dtype, tf.int64, default_value=0, experimental_is_anonymous=True)
            self.stats = tf.lookup.experimental.MutableHashTable(
                tf.int64, tf.int64, default_value=0, experimental_is_anonymous=True)
            # Serialises admissions to this shard when several workers admit
            # (asynchronous updates); a synchronous step has one admitter.
            self.lock = tf.CriticalSection(name="dynamic_embedding_admission")
        self.device = device


def find(table, keys) -> tf.Tensor:
    """`table.lookup(keys)` for 1-D keys, with its static shape (the op has none)."""
    rows = table.lookup(keys)
    rows.set_shape(keys.shape)
    return rows


def as_op(x):
    """The op of a write (None in eager mode, where it already ran)."""
    if x is None or isinstance(x, tf.Operation):
        return x
    return x.op


def _plain(var):
    """The resource variable under TF's PS wrappers (AggregatingVariable)."""
    while isinstance(var, _tf_internal.ps_values.AggregatingVariable):
        var = var.get()
    return var


_SCATTER_OPS = {"update": tf.raw_ops.ResourceScatterUpdate, "add": tf.raw_ops.ResourceScatterAdd}


def scatter(rows, writes) -> List[tf.Operation]:
    """Scatters into logical `rows` of (sharded) tables; the write ops.

    Args:
        rows: int64 logical rows, 1-D.
        writes: ``(table, values, kind)`` triples, kind "update" or "add";
            the tables have the same layout, so `rows` is split once.

    Returns:
        The write ops (none in eager mode).

    The raw ops, because a variable's own scatter methods return the variable
    (a sharded one returns itself, with no op to wait for).
    """
    n = len(table_parts(writes[0][0]))
    if n == 1:
        local_rows, owner = [rows], None
    else:
        owner = tf.cast(tf.math.floormod(rows, n), tf.int32)
        local_rows = tf.dynamic_partition(rows // n, owner, n)
    ops = []
    for table, values, kind in writes:
        parts = [values] if n == 1 else tf.dynamic_partition(values, owner, n)
        for shard, local, vals in zip(table_parts(table), local_rows, parts):
            shard = _plain(shard)
            with tf.device(shard.device):
                ops.append(_SCATTER_OPS[kind](resource=shard.handle, indices=local,
                                              updates=vals))
    return [o for o in ops if o is not None]


def assign_add(var, delta) -> tf.Operation:
    """Adds `delta` to a (one-part) variable, as a raw op to wait for."""
    var = _plain(var)
    with tf.device(var.device):
        return tf.raw_ops.AssignAddVariableOp(resource=var.handle, value=delta)


def check_consistency(states, row_last_used, capacity: int) -> List[str]:
    """Problems in the key -> row maps, as readable lines (none: consistent).

    Every stored key must map to a distinct row whose stored key is that
    key, on the map its hash names, within capacity.

    Args:
        states: The table's `ShardState`s, one per PS task.
        row_last_used: The table's recency table (0: a free row).
        capacity: The table's rows in all.

    Returns:
        One line per problem found.
    """
    problems = []
    n = len(states)
    row_keys = {}
    for s, st in enumerate(states):
        rows, keys = (t.numpy() for t in st.rows.export())
        for r, k in zip(rows, keys):
            if r % n != s:
                problems.append(f"row {r}'s key is kept on shard {s}, not {r % n}")
            row_keys[int(r)] = k
    last = tf.convert_to_tensor(row_last_used).numpy()
    seen_rows = {}
    for s, st in enumerate(states):
        keys, rows = (t.numpy() for t in st.map.export())
        for k, r in zip(keys, rows):
            if not 0 <= r < capacity:
                problems.append(f"shard {s}: key {k!r} maps to row {r} outside the table")
                continue
            if r in seen_rows:
                problems.append(f"row {r} holds keys {seen_rows[r]!r} and {k!r}")
            seen_rows[r] = k
            if row_keys.get(int(r)) != k:
                problems.append(f"row {r}: map says key {k!r}, row says "
                                f"{row_keys.get(int(r))!r}")
            if last[r] == 0:
                problems.append(f"row {r} of key {k!r} is marked free")
    used = int((last > 0).sum())
    if used != len(seen_rows) or len(row_keys) != len(seen_rows):
        problems.append(f"{used} rows are marked used, {len(row_keys)} rows have a key, "
                        f"the maps hold {len(seen_rows)} keys")
    return problems
