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

Where the code is: this module is the layer (arguments, weights, lookups,
counting keys); `tables/dynamic_state.py` what each PS holds (the maps,
pending keys, counters, their checkpoint); `tables/dynamic_admission.py`
the policy that admits, evicts and expires rows.

Docs: docs/dynamic_embedding.md.
"""

import weakref
from typing import List, Optional, Tuple

import tensorflow as tf

from tf_psplugin.tables import dynamic_admission
from tf_psplugin.tables import dynamic_state
from tf_psplugin.tables import host
from tf_psplugin.tables import key_hashing
from tf_psplugin.tables import placement as placement_lib
from tf_psplugin.tables import sharded
from tf_psplugin.tables import stacking
# The policy's constants, public here too (`tf_psplugin.tables.dynamic.EVICTION_BATCH`).
from tf_psplugin.tables.dynamic_admission import (  # noqa: F401
    EVICTION_BATCH, EVICTION_POLICIES, EXPIRY_CHECKS_PER_PERIOD)


class _TraceState:
    """Per-trace values of a layer, opaque to Keras and tf.Module attribute walks."""

    def __init__(self):
        self.now_by_graph = weakref.WeakKeyDictionary()  # traced graph -> clock read


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
        self._shard_states: Tuple[dynamic_state.ShardState, ...] = ()
        self._admission: Optional[dynamic_admission.Admission] = None  # Made by build.
        self._trace = _TraceState()
        self._frozen = False  # Set on a serving copy: lookups only (see freeze_for_serving).

    # -- state -----------------------------------------------------------------

    def build(self, input_shape):
        # Tables of their own (never stacked): admission addresses their rows.
        # One shard per PS whatever the strategy's variable_partitioner: the
        # row tables must be split like the embeddings, and each PS admits
        # into its own rows.
        with placement_lib.embedding_table_scope(), stacking.unstacked(), \
                placement_lib.one_shard_per_ps():
            self.embeddings = self.add_weight(
                "embeddings", [self.capacity, self.output_dim], initializer="zeros",
                trainable=True)
            # 0: the row is free; else the clock value of its last training use.
            self.row_last_used = self.add_weight(
                "row_last_used", [self.capacity], dtype=tf.int64,
                initializer=dynamic_state.Fill(0), trainable=False)
            self.row_hits = self.add_weight(
                "row_hits", [self.capacity], dtype=tf.int64,
                initializer=dynamic_state.Fill(0), trainable=False)
            self.admission_counts = None
            if self.admit_after > 1:
                self.admission_counts = self.add_weight(
                    "admission_counts", [self.sketch_depth * self.sketch_width], dtype=tf.int64,
                    initializer=dynamic_state.Fill(0), trainable=False)
            # Training steps seen, starting at 1 (0 marks a free row).
            self.clock = self.add_weight("clock", [1], dtype=tf.int64,
                                         initializer=dynamic_state.Fill(1), trainable=False)
        row_shards = dynamic_state.table_parts(self.embeddings)
        if len(row_shards) > 1 and not isinstance(self.embeddings, _interleaved_type()):
            raise ValueError(
                f"DynamicEmbedding {self.name!r} needs its table sharded interleaved (row r on "
                "PS r mod n), but the strategy shards tables by contiguous row ranges. Fix: "
                "create HybridParameterServerStrategy with sharding=\"interleaved\" (the "
                "default).")
        for table in (self.row_last_used, self.row_hits):
            parts = len(dynamic_state.table_parts(table))
            if parts != len(row_shards):
                raise ValueError(
                    f"DynamicEmbedding {self.name!r}: its row tables were split over "
                    f"{parts} and {len(row_shards)} shards. Fix: give every PS "
                    "task the same placement policy (capacity must be >= the PS count).")
        self._shard_states = tuple(dynamic_state.ShardState(s.device, self.key_dtype)
                                   for s in row_shards)
        # Tracked (checkpointed) under this name; see dynamic_state.KeyIndex.
        self.key_index = dynamic_state.KeyIndex(self._shard_states)
        self._admission = dynamic_admission.Admission(
            self._shard_states, self.embeddings, self.row_last_used, self.row_hits,
            self.admission_counts, admit_after=self.admit_after, eviction=self.eviction,
            expire_after_steps=self.expire_after_steps, output_dim=self.output_dim,
            init_scale=self.init_scale, sketch_width=self.sketch_width,
            sketch_depth=self.sketch_depth)
        extended = host.current()
        if extended is not None:
            for s, shard in enumerate(row_shards):
                extended.run_after_update(shard, self._admission_hook(s))
        super().build(input_shape)

    @property
    def num_shards(self) -> int:
        """PS tasks (parts) the table is split over."""
        return len(self._shard_states)

    def shard_state(self, s: int) -> dynamic_state.ShardState:
        """What PS task `s` holds for this table: its key maps, pending keys, counters.

        Incremental checkpoints read the row -> key map of the rows they write.
        """
        self._require_built("shard_state")
        return self._shard_states[s]

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
            stat_keys = tf.range(len(dynamic_state.STAT_NAMES), dtype=tf.int64)
            values = st.stats.lookup(stat_keys).numpy()
            row = {"shard": s, "device": st.device, "size": int(st.map.size())}
            row.update({k: int(v) for k, v in zip(dynamic_state.STAT_NAMES, values)})
            out.append(row)
        return out

    def track_changed_rows(self, marks) -> None:
        """Makes admission, eviction and expiry report the rows they write.

        For incremental checkpoints (`tf_psplugin.state.incremental_dynamic`): in
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
        self._admission.row_marks = tuple(marks)

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
        if host.current() is not None or self.num_shards != 1:
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
        row_parts = [dynamic_state.find(st.map, k)
                     for st, k in zip(self._shard_states, key_parts)]
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
                admitted = [self._admission.admit_exclusively(s, now) for s in range(n)]
            with tf.control_dependencies(admitted):
                ticked = dynamic_state.assign_add(self.clock, tf.ones([1], tf.int64))
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
        ops = dynamic_state.scatter(found_rows, [
            (self.row_last_used, tf.fill(tf.shape(found_rows), now), "update"),
            (self.row_hits, tf.boolean_mask(tf.cast(counts, tf.int64), found), "add")])
        for st, k, r in zip(self._shard_states, key_parts, row_parts):
            missing = tf.boolean_mask(k, r < 0)
            ops.append(st.pending.insert(missing, tf.zeros(tf.shape(missing), tf.int64)))
        if self.admission_counts is not None:
            missing = tf.logical_not(found)
            buckets = self._admission.sketch_buckets(tf.boolean_mask(hashes, missing))
            add = tf.tile(tf.boolean_mask(tf.cast(counts, tf.int64), missing),
                          [self.sketch_depth])
            ops += dynamic_state.scatter(buckets, [(self.admission_counts, add, "add")])
        return [o for o in (dynamic_state.as_op(o) for o in ops) if o is not None]

    # -- admission and eviction ------------------------------------------------------

    def _admits_after_update(self) -> bool:
        """True in a synchronous step: the updating worker admits (see module doc)."""
        extended = host.current()
        return extended is not None and extended.admits_after_update()

    def _admission_hook(self, s: int):
        def hook():
            now = self._now()
            done = self._admission.admit(s, now)
            if s != 0:
                return done
            with tf.control_dependencies([done]):
                return dynamic_state.assign_add(self.clock, tf.ones([1], tf.int64))
        return hook

    def check_consistency(self) -> List[str]:
        """Problems in the key -> row maps, as readable lines (none: consistent).

        Every stored key must map to a distinct row whose stored key is that
        key, on the map its hash names, within capacity. For tests and for
        debugging a job; it reads every map and row key, so it is not cheap.
        """
        self._require_built("check_consistency")
        return dynamic_state.check_consistency(self._shard_states, self.row_last_used,
                                               self.capacity)

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


def _interleaved_type():
    return sharded.InterleavedShardedVariable


def _require(ok: bool, field: str, value, expected: str) -> None:
    if not ok:
        raise ValueError(f"DynamicEmbedding: {field}={value!r} is not valid. Fix: pass {expected}.")


__all__ = ["DynamicEmbedding", "EVICTION_POLICIES"]