"""Keras layers for tables keyed by raw ids: `DynamicEmbedding`.

A `tf.keras.layers.Embedding` needs ids in ``[0, input_dim)``: raw ids must
be hashed into a fixed vocabulary, where distinct ids collide. A
`DynamicEmbedding` takes the raw keys (any int64, or strings) and gives each
admitted key a row of its own, up to ``capacity`` rows in all:

* a key is **admitted** once it has been seen ``admit_after`` times in
  training batches (counted in a count-min sketch of bounded size); until
  then it reads the default vector and gets no row and no update;
* when the table is full, ``eviction`` frees the least recently ("lru") or
  least frequently ("lfu") used row that the current step does not use, or
  (None) rejects the new key;
* with ``expire_after_steps=N``, a row whose key no training step has used
  for N steps is freed (its key forgotten), whether or not the table is
  full, so keys that stopped appearing (yesterday's items) do not hold rows;
* a new row starts from a vector that depends on the key alone.

Where it lives: the rows are an embedding table like any other (sharded over
the PS tasks by `HybridParameterServerStrategy`, with its optimizer slots
beside it); each row's last use and hit count are tables of the same
layout beside it; each PS task holds the key -> row map of the keys that
hash to it and the row -> key map of the rows it holds
(`tf.lookup.experimental.MutableHashTable`s, in that task's memory), and
the keys waiting for admission. Workers hold none of it.

When the map changes: a step's lookups only read it. The keys a training
step saw but could not find are collected on their PS; after the step's
update they are admitted, so a new key's row is used from the next step on.
Under synchronous training the worker that updates a PS's table shards also
admits that PS's keys, between the gradient all-reduce and the end-of-step
barrier (`TableHost.run_after_update`, implemented by the strategy), so no worker reads the map
while it changes, and training equals one process on the global batch. In
one process, or with asynchronous updates, the layer admits right after its
own lookups.

Checkpoints hold the rows, their slots, recency and hit counts as logical
tables, the admission counters, and the key -> row maps as one list of
(key, row) pairs; they restore into any number of PS tasks and into a
model without a strategy.

Docs: docs/dynamic_embedding.md.
"""

import weakref
from typing import List, Optional, Tuple

import tensorflow as tf

from tf_psplugin._internal import tf_internal as _tf_internal
from tf_psplugin.tables import host as table_host
from tf_psplugin.tables import key_hashing
from tf_psplugin.tables import placement as placement_lib
from tf_psplugin.tables import sharded as sharding
from tf_psplugin.tables import stacking as table_stacking

EVICTION_POLICIES = ("lru", "lfu", None)
# A full shard evicts at least 1/EVICTION_BATCH of its rows at once.
EVICTION_BATCH = 16
_STAT_NAMES = ("admitted", "evicted", "rejected", "expired")
# With expire_after_steps=N, a shard looks for expired rows every
# max(1, N // EXPIRY_CHECKS_PER_PERIOD) steps: a scan of its recency table
# costs O(rows), so not every step; a row is freed at most N / 8 steps late.
EXPIRY_CHECKS_PER_PERIOD = 8


class _Fill:
    """An initializer filling with one value (any dtype, also strings); shard-aware."""

    def __init__(self, value):
        self.value = value

    def __call__(self, shape, dtype=None, partition_shape=None, **_):
        return tf.fill(partition_shape or shape, tf.constant(self.value, dtype))


def _shards(var) -> list:
    """The per-PS parts of a table (a plain variable is one part)."""
    if isinstance(var, _tf_internal.sharded_variable.ShardedVariable):
        return list(var.variables)
    return [var]


class _KeyIndex(_tf_internal.trackable_base.Trackable):
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


class _TraceState:
    """Per-trace values of a layer, opaque to Keras and tf.Module attribute walks."""

    def __init__(self):
        self.now_by_graph = weakref.WeakKeyDictionary()  # traced graph -> clock read
        # Per shard, `mark(local_rows)` -> op: incremental checkpoints record
        # the rows admission, eviction and expiry write (`track_changed_rows`).
        self.row_marks = ()


class _ShardState:
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


class DynamicEmbedding(tf.keras.layers.Layer):
    """An embedding table keyed by raw ids, with admission and eviction.

    Example:

    ```python
    with strategy.scope():
        ids = tf.keras.Input((3,), dtype=tf.int64)        # raw ids, any value
        x = tf_psplugin.layers.DynamicEmbedding(
            16, capacity=1_000_000, admit_after=2, eviction="lru")(ids)
        ...
    ```

    Inputs: int64 (or int32) keys, or strings with ``key_dtype=tf.string``,
    as a dense tensor of any rank or a `tf.RaggedTensor`. Output: the input's
    shape plus ``output_dim`` (ragged in, ragged out), like
    `tf.keras.layers.Embedding`.

    Only calls with ``training=True`` (what `Model.fit` passes) count keys
    and admit them; other calls only read. Call the layer once per training
    step (concatenate several features' keys first if they share a table):
    admission happens at the end of a step.

    Args:
        output_dim: Width of each row.
        capacity: Rows stored in all (over every PS task). Each PS allocates
            from its own ``capacity / num_ps`` rows, so a shard is full a
            little before the whole table is.
        key_dtype: `tf.int64` (any value, also negative or above 2^62) or
            `tf.string`.
        admit_after: Training occurrences a key needs before it gets a row
            (1: at its first step). Counted in a count-min sketch, which can
            only over-count: a key may be admitted early, never late.
        eviction: "lru" (least recent use), "lfu" (fewest hits), or None
            (a full shard rejects new keys). Rows used in the current step
            are never evicted.
        expire_after_steps: Free a row once its key has not been used by
            a training step for this many steps (None: never). Checked on
            each PS every ``max(1, N // 8)`` steps (the scan reads the
            shard's recency table), so a row is freed between N and
            ``N + N // 8`` steps after its last use; deterministic, so a
            synchronous job frees exactly what one process would. Counted
            as "expired" in `table_stats()`.
        init_scale: A new row starts uniform in ``[-init_scale,
            init_scale)``, a function of its key (0: zeros).
        default_value: What a key without a row reads (a scalar, every
            column).
        sketch_width: Counters per hash function of the admission sketch
            (default ``4 * capacity``, at least 1024). Only with
            ``admit_after > 1``.
        sketch_depth: Hash functions of the sketch.
        **kwargs: Keras `Layer` arguments (``name``, ...).

    Raises:
        ValueError: On an argument outside the ranges above (naming it).
    """

    def __init__(self, output_dim: int, capacity: int, key_dtype=tf.int64, admit_after: int = 1,
                 eviction: Optional[str] = "lru", init_scale: float = 0.05,
                 default_value: float = 0.0, sketch_width: Optional[int] = None,
                 sketch_depth: int = 2, expire_after_steps: Optional[int] = None, **kwargs):
        super().__init__(**kwargs)
        key_dtype = tf.as_dtype(key_dtype)
        if key_dtype == tf.int32:
            key_dtype = tf.int64
        _require(isinstance(output_dim, int) and output_dim > 0, "output_dim", output_dim,
                 "a positive int")
        _require(isinstance(capacity, int) and capacity > 0, "capacity", capacity,
                 "a positive int")
        _require(key_dtype in (tf.int64, tf.string), "key_dtype", key_dtype.name,
                 "tf.int64 or tf.string")
        _require(isinstance(admit_after, int) and admit_after >= 1, "admit_after", admit_after,
                 "an int >= 1")
        _require(eviction in EVICTION_POLICIES, "eviction", eviction, '"lru", "lfu" or None')
        _require(init_scale >= 0, "init_scale", init_scale, "a float >= 0")
        _require(expire_after_steps is None or (isinstance(expire_after_steps, int)
                                                and expire_after_steps >= 1),
                 "expire_after_steps", expire_after_steps, "None or an int >= 1")
        _require(isinstance(sketch_depth, int) and sketch_depth >= 1, "sketch_depth",
                 sketch_depth, "an int >= 1")
        if sketch_width is None:
            sketch_width = max(1024, 4 * capacity)
        _require(isinstance(sketch_width, int) and sketch_width >= 1, "sketch_width",
                 sketch_width, "a positive int")
        self.output_dim = output_dim
        self.capacity = capacity
        self.key_dtype = key_dtype
        self.admit_after = admit_after
        self.eviction = eviction
        self.init_scale = float(init_scale)
        self.default_value = float(default_value)
        self.sketch_width = sketch_width
        self.sketch_depth = sketch_depth
        self.expire_after_steps = expire_after_steps
        # Not tracked by Keras (a dict or list attribute would be): the maps
        # are checkpointed through `key_index`, the rest is per process.
        self._shard_states: Tuple[_ShardState, ...] = ()
        self._trace = _TraceState()
        self._frozen = False  # Set on a serving copy: lookups only (see freeze_for_serving).

    # -- state -----------------------------------------------------------------

    def build(self, input_shape):
        # Tables of their own (never stacked): admission addresses their rows.
        # One shard per PS whatever the strategy's variable_partitioner: the
        # row tables must be split like the embeddings, and each PS admits
        # into its own rows.
        with placement_lib.embedding_table_scope(), table_stacking.unstacked(), \
                placement_lib.one_shard_per_ps():
            self.embeddings = self.add_weight(
                "embeddings", [self.capacity, self.output_dim], initializer="zeros",
                trainable=True)
            # 0: the row is free; else the clock value of its last training use.
            self.row_last_used = self.add_weight("row_last_used", [self.capacity],
                                                 dtype=tf.int64, initializer=_Fill(0),
                                                 trainable=False)
            self.row_hits = self.add_weight("row_hits", [self.capacity], dtype=tf.int64,
                                            initializer=_Fill(0), trainable=False)
            self.admission_counts = None
            if self.admit_after > 1:
                self.admission_counts = self.add_weight(
                    "admission_counts", [self.sketch_depth * self.sketch_width], dtype=tf.int64,
                    initializer=_Fill(0), trainable=False)
            # Training steps seen, starting at 1 (0 marks a free row).
            self.clock = self.add_weight("clock", [1], dtype=tf.int64, initializer=_Fill(1),
                                         trainable=False)
        row_shards = _shards(self.embeddings)
        if len(row_shards) > 1 and not isinstance(self.embeddings, _interleaved_type()):
            raise ValueError(
                f"DynamicEmbedding {self.name!r} needs its table sharded interleaved (row r on "
                "PS r mod n), but the strategy shards tables by contiguous row ranges. Fix: "
                "create HybridParameterServerStrategy with sharding=\"interleaved\" (the "
                "default).")
        for table in (self.row_last_used, self.row_hits):
            if len(_shards(table)) != len(row_shards):
                raise ValueError(
                    f"DynamicEmbedding {self.name!r}: its row tables were split over "
                    f"{len(_shards(table))} and {len(row_shards)} shards. Fix: give every PS "
                    "task the same placement policy (capacity must be >= the PS count).")
        self._shard_states = tuple(_ShardState(s.device, self.key_dtype) for s in row_shards)
        # Tracked (checkpointed) under this name; see _KeyIndex.
        self.key_index = _KeyIndex(self._shard_states)
        extended = table_host.current()
        if extended is not None:
            for s, shard in enumerate(row_shards):
                extended.run_after_update(shard, self._admission_hook(s))
        super().build(input_shape)

    @property
    def num_shards(self) -> int:
        """PS tasks (parts) the table is split over."""
        return len(self._shard_states)

    def table_size(self) -> int:
        """Rows stored now, over every shard."""
        self._require_built("table_size")
        return int(sum(int(st.map.size()) for st in self._shard_states))

    def table_stats(self) -> List[dict]:
        """Per shard: size, and keys admitted, evicted, rejected and expired so far.

        The admitted/evicted/rejected counts are this process's (they are
        kept on the PS, not in checkpoints); size is the map's.
        """
        self._require_built("table_stats")
        out = []
        for s, st in enumerate(self._shard_states):
            values = st.stats.lookup(tf.range(len(_STAT_NAMES), dtype=tf.int64)).numpy()
            row = {"shard": s, "device": st.device, "size": int(st.map.size())}
            row.update({k: int(v) for k, v in zip(_STAT_NAMES, values)})
            out.append(row)
        return out

    def track_changed_rows(self, marks) -> None:
        """Makes admission, eviction and expiry report the rows they write.

        For incremental checkpoints (`tf_psplugin.incremental_dynamic`): in
        each traced step, shard s's admission calls ``marks[s](local_rows)``
        (on that shard's PS) for the rows eviction frees without giving them
        to a new key, and expiry for the rows it frees: a freed row's last
        use is 0, so nothing else tells it changed. (Rows given a key get
        the step's clock as their last use.) Set it before the first
        training step is traced.

        Args:
            marks: One callable per shard, taking int64 local row ids and
                returning the op that records them (or None).
        """
        self._require_built("track_changed_rows")
        if len(marks) != self.num_shards:
            raise ValueError(f"track_changed_rows: {len(marks)} marks for {self.num_shards} "
                             "shards.")
        self._trace.row_marks = tuple(marks)

    def _mark_changed(self, s: int, local) -> list:
        """The op recording that shard `s`'s `local` rows changed (none if untracked)."""
        op = self._trace.row_marks[s](local) if self._trace.row_marks else None
        return [] if op is None else [op]

    def _require_built(self, what):
        if not self.built:
            raise RuntimeError(f"DynamicEmbedding.{what}(): the layer is not built yet. "
                               "Fix: call the layer (or build the model) first.")

    # -- forward -----------------------------------------------------------------

    def copy_key_index_from(self, other: "DynamicEmbedding") -> None:
        """Makes this layer's key -> row maps those of `other` (any shard counts).

        `set_weights` copies the tables but not the maps, which are not
        weights; `export_saved_model` calls this on its local copy.
        """
        self._require_built("copy_key_index_from")
        keys, rows = other.key_index.export()
        self.key_index.load(keys, rows)

    def freeze_for_serving(self) -> None:
        """Makes this (local, strategy-free) layer a read-only lookup for export.

        Every call then only reads (no counting, no admission, whatever
        ``training`` says), and the key -> row maps become tracked resources,
        so a SavedModel holds their contents and serves raw keys: an unknown
        key reads the default vector.
        """
        self._require_built("freeze_for_serving")
        if table_host.current() is not None or self.num_shards != 1:
            raise ValueError("freeze_for_serving: call it on a local copy built without a "
                             "strategy (tf_psplugin.export_saved_model makes one).")
        self._frozen = True
        state = self._shard_states[0]
        keys, rows = state.map.export()
        # A table of its own, saved with its contents (the training maps are
        # checkpointed through `key_index`, which a SavedModel cannot use).
        serving = tf.lookup.experimental.MutableHashTable(self.key_dtype, tf.int64,
                                                          default_value=-1)
        serving.insert(keys, rows)
        state.map = serving
        self.key_index.serving = True
        self.serving_key_map = serving

    def call(self, inputs, training=None):
        ragged = isinstance(inputs, tf.RaggedTensor)
        flat = inputs.flat_values if ragged else tf.reshape(inputs, [-1])
        if self.key_dtype == tf.string:
            if flat.dtype != tf.string:
                raise TypeError(f"DynamicEmbedding {self.name!r} takes string keys "
                                f"(key_dtype=tf.string), got {flat.dtype.name}.")
        else:
            if not flat.dtype.is_integer:
                raise TypeError(f"DynamicEmbedding {self.name!r} takes integer keys, got "
                                f"{flat.dtype.name}. Fix: cast the ids to tf.int64, or pass "
                                "key_dtype=tf.string for string keys.")
            flat = tf.cast(flat, tf.int64)
        unique, index, counts = tf.unique_with_counts(flat, out_idx=tf.int64)
        vectors = self._lookup_unique(unique, counts,
                                      training=bool(training) and not self._frozen)
        out = tf.gather(vectors, index)
        if ragged:
            return inputs.with_flat_values(out)
        return tf.reshape(out, tf.concat([tf.shape(inputs, out_type=tf.int64),
                                          [self.output_dim]], 0))

    def compute_output_shape(self, input_shape):
        return tf.TensorShape(input_shape).concatenate([self.output_dim])

    def _lookup_unique(self, keys, counts, training: bool) -> tf.Tensor:
        n = self.num_shards
        hashes = key_hashing.key_hash(keys)
        size = tf.size(keys, out_type=tf.int64)
        if n == 1:
            key_parts = [keys]
            pos_parts = [tf.range(size)]
        else:
            owner = key_hashing.shard_of(hashes, n)
            key_parts = tf.dynamic_partition(keys, owner, n)
            pos_parts = tf.dynamic_partition(tf.range(size), owner, n)
        row_parts = [_find(st.map, k) for st, k in zip(self._shard_states, key_parts)]
        rows = row_parts[0] if n == 1 else tf.dynamic_stitch(
            [tf.cast(p, tf.int32) for p in pos_parts], row_parts)
        found = rows >= 0
        records = []
        if training:
            now = self._now()
            records = self._record(rows, found, counts, now, key_parts, row_parts,
                                   hashes, n)
        found_rows = tf.boolean_mask(rows, found)
        gathered = tf.nn.embedding_lookup(self.embeddings, found_rows)
        if records:
            # The gradient waits for the records, the forward pass does not:
            # the gather runs beside them, and under synchronous training the
            # gradient hand-in, and so the step's all-reduce, still waits for
            # every worker's records (see module doc).
            gathered = _backward_after(gathered, records)
        default = tf.fill(tf.stack([size, self.output_dim]),
                          tf.constant(self.default_value, gathered.dtype))
        vectors = tf.tensor_scatter_nd_update(default, tf.where(found), gathered)
        if training and not self._admits_after_update():
            with tf.control_dependencies(records + [vectors]):
                admitted = [self._admit_exclusively(s, now) for s in range(n)]
            with tf.control_dependencies(admitted):
                ticked = _assign_add(self.clock, tf.ones([1], tf.int64))
            with tf.control_dependencies([ticked]):
                vectors = tf.identity(vectors)
        return vectors

    def _now(self) -> tf.Tensor:
        """This step's clock value (read once per traced step and shared with the hook)."""
        graph = tf.compat.v1.get_default_graph()
        now = self._trace.now_by_graph.get(graph) if not tf.executing_eagerly() else None
        if now is None:
            now = tf.reshape(tf.convert_to_tensor(self.clock), [])
            if not tf.executing_eagerly():
                self._trace.now_by_graph[graph] = now
        return now

    def _record(self, rows, found, counts, now, key_parts, row_parts, hashes, n):
        """Marks the found rows used now; queues unknown keys; counts them."""
        found_rows = tf.boolean_mask(rows, found)
        ops = _scatter(found_rows, [
            (self.row_last_used, tf.fill(tf.shape(found_rows), now), "update"),
            (self.row_hits, tf.boolean_mask(tf.cast(counts, tf.int64), found), "add")])
        for st, k, r in zip(self._shard_states, key_parts, row_parts):
            missing = tf.boolean_mask(k, r < 0)
            ops.append(st.pending.insert(missing, tf.zeros(tf.shape(missing), tf.int64)))
        if self.admission_counts is not None:
            missing = tf.logical_not(found)
            buckets = self._sketch_buckets(tf.boolean_mask(hashes, missing))
            add = tf.tile(tf.boolean_mask(tf.cast(counts, tf.int64), missing),
                          [self.sketch_depth])
            ops += _scatter(buckets, [(self.admission_counts, add, "add")])
        return [o for o in (_as_op(o) for o in ops) if o is not None]

    def _sketch_buckets(self, hashes) -> tf.Tensor:
        """Flat sketch indices, depth-major: [depth * len(hashes)]."""
        return tf.concat([
            key_hashing.bucket(hashes, self.sketch_width, salt=d + 1) + d * self.sketch_width
            for d in range(self.sketch_depth)], 0)

    # -- admission and eviction ------------------------------------------------------

    def _admits_after_update(self) -> bool:
        """True in a synchronous step: the updating worker admits (see module doc)."""
        extended = table_host.current()
        return extended is not None and extended.admits_after_update()

    def _admission_hook(self, s: int):
        def hook():
            now = self._now()
            done = self._admit(s, now)
            if s != 0:
                return done
            with tf.control_dependencies([done]):
                return _assign_add(self.clock, tf.ones([1], tf.int64))
        return hook

    def _admit_exclusively(self, s: int, now) -> tf.Operation:
        """`_admit` under shard s's lock (on its PS): one admission at a time."""
        st = self._shard_states[s]
        if tf.executing_eagerly():
            return self._admit(s, now)
        with tf.device(st.device):
            return st.lock.execute(lambda: self._admit(s, now), exclusive_resource_access=False)

    def check_consistency(self) -> List[str]:
        """Problems in the key -> row maps, as readable lines (none: consistent).

        Every stored key must map to a distinct row whose stored key is that
        key, on the map its hash names, within capacity. For tests and for
        debugging a job; it reads every map and row key, so it is not cheap.
        """
        self._require_built("check_consistency")
        problems = []
        n = self.num_shards
        row_keys = {}
        for s, st in enumerate(self._shard_states):
            rows, keys = (t.numpy() for t in st.rows.export())
            for r, k in zip(rows, keys):
                if r % n != s:
                    problems.append(f"row {r}'s key is kept on shard {s}, not {r % n}")
                row_keys[int(r)] = k
        last = tf.convert_to_tensor(self.row_last_used).numpy()
        seen_rows = {}
        for s, st in enumerate(self._shard_states):
            keys, rows = (t.numpy() for t in st.map.export())
            for k, r in zip(keys, rows):
                if not 0 <= r < self.capacity:
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

    def _admit(self, s: int, now) -> tf.Operation:
        """Admits shard `s`'s pending keys; evicts or rejects when it is full.

        Runs on shard s's PS; touches only rows of that shard (and, for rows
        whose keys another shard's map holds after a restore into another PS
        count, that map).
        """
        st = self._shard_states[s]
        n = self.num_shards
        emb = _shards(self.embeddings)[s]
        last_var = _shards(self.row_last_used)[s]
        hits_var = _shards(self.row_hits)[s]
        with tf.device(st.device):
            cand, _ = st.pending.export()
            cand.set_shape([None])
            removed = st.pending.remove(cand)
            with tf.control_dependencies([removed]):
                cand = tf.boolean_mask(cand, _find(st.map, cand) < 0)
            hashes = key_hashing.key_hash(cand)
            if self.admission_counts is not None:
                buckets = self._sketch_buckets(hashes)
                seen = tf.reduce_min(tf.reshape(
                    self.admission_counts.sparse_read(buckets), [self.sketch_depth, -1]), 0)
                eligible = seen >= self.admit_after
                cand = tf.boolean_mask(cand, eligible)
                hashes = tf.boolean_mask(hashes, eligible)
                seen = tf.boolean_mask(seen, eligible)
            else:
                seen = tf.ones(tf.shape(cand), tf.int64)
            # A fixed order (by hash), so which keys a full shard takes does
            # not depend on the order workers handed them in.
            order = tf.argsort(tf.bitcast(hashes, tf.int64), stable=True)
            cand, hashes, seen = (tf.gather(t, order) for t in (cand, hashes, seen))
            last = tf.convert_to_tensor(last_var)
            free = tf.reshape(tf.where(tf.equal(last, 0)), [-1])
            wanted = tf.size(cand, out_type=tf.int64)
            free = free[:wanted]
            short = wanted - tf.size(free, out_type=tf.int64)
            if self.eviction is None:
                victims = tf.zeros([0], tf.int64)
            else:
                # Only in a step that needs rows it has not got (a cond on
                # this PS: no worker takes part): the oldest (or least hit)
                # rows the step does not use, ties to the lower row. At least
                # 1/EVICTION_BATCH of the shard at once, so the scan over the
                # shard's rows runs in one step of many, not in every step of
                # a full table; the rows not needed now become free.
                batch = max(1, int(last_var.shape[0]) // EVICTION_BATCH)
                victims = tf.cond(
                    short > 0,
                    lambda: self._victims(last, hits_var, now, tf.maximum(short, batch)),
                    lambda: tf.zeros([0], tf.int64))
            reused = victims[:tf.maximum(short, 0)]
            spare = victims[tf.size(reused):]
            slots = tf.concat([free, reused], 0)
            taken = tf.size(slots, out_type=tf.int64)
            admitted = cand[:taken]
            victim_rows = victims * n + s
            forgotten = self._forget(_find(st.rows, victim_rows), victim_rows)
            with tf.control_dependencies([forgotten] if forgotten is not None else []):
                ops = [forgotten, st.rows.remove(spare * n + s)]
            ops = [o for o in ops if o is not None]
            ops += _scatter(spare, [(last_var, tf.zeros_like(spare), "update"),
                                    (hits_var, tf.zeros_like(spare), "update")])
            new_rows = slots * n + s
            values = key_hashing.initial_rows(hashes[:taken], self.output_dim, self.init_scale,
                                              emb.dtype)
            # Freed rows only: rows given a key now are marked used now, which
            # incremental checkpoints see without a mark.
            ops += self._mark_changed(s, spare)
            ops += _scatter(slots, [(emb, values, "update"),
                                    (last_var, tf.fill(tf.shape(slots), now), "update"),
                                    (hits_var, seen[:taken], "update")])
            with tf.control_dependencies(ops):
                inserted = tf.group(st.map.insert(admitted, new_rows),
                                    st.rows.insert(new_rows, admitted))
            with tf.control_dependencies([inserted]):
                expired, expiry = self._expire(s, now)
            stat_keys = tf.range(len(_STAT_NAMES), dtype=tf.int64)
            delta = tf.stack([taken, tf.size(victims, out_type=tf.int64), wanted - taken,
                              expired])
            with tf.control_dependencies([expiry]):
                counted = st.stats.insert(stat_keys, st.stats.lookup(stat_keys) + delta)
            return tf.group(inserted, counted)

    def _expire(self, s: int, now) -> Tuple[tf.Tensor, tf.Operation]:
        """Frees shard `s`'s rows unused for `expire_after_steps` (on check steps).

        Runs after the step's admissions (rows admitted now are used now, so
        never expire here). Returns (rows freed, the op freeing them).
        """
        if not self.expire_after_steps:
            return tf.constant(0, tf.int64), tf.no_op()
        st = self._shard_states[s]
        n = self.num_shards
        last_var = _shards(self.row_last_used)[s]
        hits_var = _shards(self.row_hits)[s]
        every = max(1, self.expire_after_steps // EXPIRY_CHECKS_PER_PERIOD)
        limit = now - self.expire_after_steps

        def scan():
            last = tf.convert_to_tensor(last_var)
            return tf.reshape(tf.where((last > 0) & (last <= limit)), [-1])

        local = tf.cond(tf.equal(now % every, 0), scan, lambda: tf.zeros([0], tf.int64))
        rows = local * n + s
        forgotten = self._forget(_find(st.rows, rows), rows)
        with tf.control_dependencies([forgotten]):
            ops = [st.rows.remove(rows)]
        ops += self._mark_changed(s, local)
        ops += _scatter(local, [(last_var, tf.zeros_like(local), "update"),
                                (hits_var, tf.zeros_like(local), "update")])
        return tf.size(local, out_type=tf.int64), tf.group([o for o in ops if o is not None])

    def _victims(self, last, hits_var, now, wanted) -> tf.Tensor:
        """Local rows to evict: up to `wanted` rows not used at `now`, by policy."""
        evictable = tf.reshape(tf.where((last > 0) & (last < now)), [-1])
        score = tf.gather(last if self.eviction == "lru" else tf.convert_to_tensor(hits_var),
                          evictable)
        k = tf.cast(tf.minimum(wanted, tf.size(evictable, out_type=tf.int64)), tf.int32)
        _, order = tf.math.top_k(-score, k=k, sorted=True)
        return tf.gather(evictable, order)

    def _forget(self, keys, rows) -> tf.Operation:
        """Removes evicted keys from the map that holds them (if it still maps them there)."""
        n = self.num_shards
        if n == 1:
            parts_k, parts_r = [keys], [rows]
        else:
            owner = key_hashing.shard_of(key_hashing.key_hash(keys), n)
            parts_k = tf.dynamic_partition(keys, owner, n)
            parts_r = tf.dynamic_partition(rows, owner, n)
        ops = []
        for st, k, r in zip(self._shard_states, parts_k, parts_r):
            ops.append(st.map.remove(tf.boolean_mask(k, tf.equal(_find(st.map, k), r))))
        return tf.group(ops)

    def get_config(self):
        config = super().get_config()
        config.update(output_dim=self.output_dim, capacity=self.capacity,
                      key_dtype=self.key_dtype.name, admit_after=self.admit_after,
                      eviction=self.eviction, init_scale=self.init_scale,
                      default_value=self.default_value, sketch_width=self.sketch_width,
                      sketch_depth=self.sketch_depth, expire_after_steps=self.expire_after_steps)
        return config


def _backward_after(x: tf.Tensor, ops) -> tf.Tensor:
    """Identity whose gradient waits for `ops` (the forward value does not)."""

    @tf.custom_gradient
    def identity(t):
        def grad(dy):
            with tf.control_dependencies(ops):
                return tf.identity(dy)

        return tf.identity(t), grad

    return identity(x)


def _find(table, keys) -> tf.Tensor:
    """`table.lookup(keys)` for 1-D keys, with its static shape (the op has none)."""
    rows = table.lookup(keys)
    rows.set_shape(keys.shape)
    return rows


def _as_op(x):
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


def _scatter(rows, writes) -> List[tf.Operation]:
    """Scatters into logical `rows` of (sharded) tables; the write ops.

    Args:
        rows: int64 logical rows, 1-D.
        writes: ``(table, values, kind)`` triples, kind "update" or "add";
            the tables have the same layout, so `rows` is split once.

    The raw ops, because a variable's own scatter methods return the variable
    (a sharded one returns itself, with no op to wait for).
    """
    n = len(_shards(writes[0][0]))
    if n == 1:
        local_rows, owner = [rows], None
    else:
        owner = tf.cast(tf.math.floormod(rows, n), tf.int32)
        local_rows = tf.dynamic_partition(rows // n, owner, n)
    ops = []
    for table, values, kind in writes:
        parts = [values] if n == 1 else tf.dynamic_partition(values, owner, n)
        for shard, local, vals in zip(_shards(table), local_rows, parts):
            shard = _plain(shard)
            with tf.device(shard.device):
                ops.append(_SCATTER_OPS[kind](resource=shard.handle, indices=local,
                                              updates=vals))
    return [o for o in ops if o is not None]


def _assign_add(var, delta) -> tf.Operation:
    var = _plain(var)
    with tf.device(var.device):
        return tf.raw_ops.AssignAddVariableOp(resource=var.handle, value=delta)


def _interleaved_type():
    return sharding.InterleavedShardedVariable


def _require(ok: bool, field: str, value, expected: str) -> None:
    if not ok:
        raise ValueError(f"DynamicEmbedding: {field}={value!r} is not valid. Fix: pass {expected}.")


__all__ = ["DynamicEmbedding", "EVICTION_POLICIES"]
