"""Admission, eviction and expiry of a `DynamicEmbedding`'s rows, on each PS task.

`tables/dynamic.py` is the Keras layer: its lookups only read the key -> row
maps and queue the keys they could not find (`tables/dynamic_state.py`).
This module is the policy that changes the maps, once per training step on
each PS task (module doc of `tables/dynamic.py`: who runs it, and when):

* a queued key is **admitted** once the count-min sketch has seen it
  ``admit_after`` times, into a free row of its PS's shard;
* a full shard **evicts** the least recently ("lru") or least frequently
  ("lfu") used rows the current step does not use, at least
  1/`EVICTION_BATCH` of the shard at once, or (eviction None) rejects;
* with ``expire_after_steps=N``, rows unused for N steps are **freed**,
  checked every ``max(1, N // EXPIRY_CHECKS_PER_PERIOD)`` steps.
"""

from typing import Optional, Sequence, Tuple

import tensorflow as tf

from tf_psplugin.tables import dynamic_state
from tf_psplugin.tables import key_hashing

EVICTION_POLICIES = ("lru", "lfu", None)
# A full shard evicts at least 1/EVICTION_BATCH of its rows at once.
EVICTION_BATCH = 16
# With expire_after_steps=N, a shard looks for expired rows every
# max(1, N // EXPIRY_CHECKS_PER_PERIOD) steps: a scan of its recency table
# costs O(rows), so not every step; a row is freed at most N / 8 steps late.
EXPIRY_CHECKS_PER_PERIOD = 8


class Admission:
    """The row policy of one `DynamicEmbedding`: admit, evict, expire, per shard.

    Made by the layer's `build` (a plain object: Keras and checkpoints do not
    walk it; the variables it writes are the layer's weights).

    Args:
        states: One `dynamic_state.ShardState` per PS task.
        embeddings: The rows (sharded interleaved like the tables below).
        row_last_used: Per row, the clock value of its last training use (0: free).
        row_hits: Per row, its training hits.
        admission_counts: The count-min sketch, ``sketch_depth * sketch_width``
            counters (None when ``admit_after`` is 1).
        admit_after: Training occurrences a key needs before it gets a row.
        eviction: "lru", "lfu" or None (see `EVICTION_POLICIES`).
        expire_after_steps: Free a row unused for this many steps (None: never).
        output_dim: Width of each row.
        init_scale: A new row starts uniform in ``[-init_scale, init_scale)``.
        sketch_width: Counters per hash function of the sketch.
        sketch_depth: Hash functions of the sketch.
    """

    def __init__(self, states: Sequence[dynamic_state.ShardState], embeddings, row_last_used,
                 row_hits, admission_counts, admit_after: int, eviction: Optional[str],
                 expire_after_steps: Optional[int], output_dim: int, init_scale: float,
                 sketch_width: int, sketch_depth: int):
        self.states = tuple(states)
        self.embeddings = embeddings
        self.row_last_used = row_last_used
        self.row_hits = row_hits
        self.admission_counts = admission_counts
        self.admit_after = admit_after
        self.eviction = eviction
        self.expire_after_steps = expire_after_steps
        self.output_dim = output_dim
        self.init_scale = init_scale
        self.sketch_width = sketch_width
        self.sketch_depth = sketch_depth
        # Per shard, `mark(local_rows)` -> op: incremental checkpoints record
        # the rows admission, eviction and expiry write
        # (`DynamicEmbedding.track_changed_rows`).
        self.row_marks: tuple = ()

    @property
    def num_shards(self) -> int:
        return len(self.states)

    def sketch_buckets(self, hashes) -> tf.Tensor:
        """Flat sketch indices, depth-major: [depth * len(hashes)]."""
        return tf.concat([
            key_hashing.bucket(hashes, self.sketch_width, salt=d + 1) + d * self.sketch_width
            for d in range(self.sketch_depth)], 0)

    def _mark_changed(self, s: int, local) -> list:
        """The op recording that shard `s`'s `local` rows changed (none if untracked)."""
        op = self.row_marks[s](local) if self.row_marks else None
        return [] if op is None else [op]

    def admit_exclusively(self, s: int, now) -> tf.Operation:
        """`admit` under shard s's lock (on its PS): one admission at a time."""
        st = self.states[s]
        if tf.executing_eagerly():
            return self.admit(s, now)
        with tf.device(st.device):
            return st.lock.execute(lambda: self.admit(s, now), exclusive_resource_access=False)

    def admit(self, s: int, now) -> tf.Operation:
        """Admits shard `s`'s pending keys; evicts or rejects when it is full.

        Runs on shard s's PS; touches only rows of that shard (and, for rows
        whose keys another shard's map holds after a restore into another PS
        count, that map).
        """
        st = self.states[s]
        n = self.num_shards
        emb = dynamic_state.table_parts(self.embeddings)[s]
        last_var = dynamic_state.table_parts(self.row_last_used)[s]
        hits_var = dynamic_state.table_parts(self.row_hits)[s]
        with tf.device(st.device):
            cand, _ = st.pending.export()
            cand.set_shape([None])
            removed = st.pending.remove(cand)
            with tf.control_dependencies([removed]):
                cand = tf.boolean_mask(cand, dynamic_state.find(st.map, cand) < 0)
            hashes = key_hashing.key_hash(cand)
            if self.admission_counts is not None:
                buckets = self.sketch_buckets(hashes)
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
            forgotten = self._forget(dynamic_state.find(st.rows, victim_rows), victim_rows)
            with tf.control_dependencies([forgotten] if forgotten is not None else []):
                ops = [forgotten, st.rows.remove(spare * n + s)]
            ops = [o for o in ops if o is not None]
            ops += dynamic_state.scatter(spare, [(last_var, tf.zeros_like(spare), "update"),
                                                 (hits_var, tf.zeros_like(spare), "update")])
            new_rows = slots * n + s
            values = key_hashing.initial_rows(hashes[:taken], self.output_dim, self.init_scale,
                                              emb.dtype)
            # Freed rows only: rows given a key now are marked used now, which
            # incremental checkpoints see without a mark.
            ops += self._mark_changed(s, spare)
            ops += dynamic_state.scatter(slots, [
                (emb, values, "update"),
                (last_var, tf.fill(tf.shape(slots), now), "update"),
                (hits_var, seen[:taken], "update")])
            with tf.control_dependencies(ops):
                inserted = tf.group(st.map.insert(admitted, new_rows),
                                    st.rows.insert(new_rows, admitted))
            with tf.control_dependencies([inserted]):
                expired, expiry = self._expire(s, now)
            stat_keys = tf.range(len(dynamic_state.STAT_NAMES), dtype=tf.int64)
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
        st = self.states[s]
        n = self.num_shards
        last_var = dynamic_state.table_parts(self.row_last_used)[s]
        hits_var = dynamic_state.table_parts(self.row_hits)[s]
        every = max(1, self.expire_after_steps // EXPIRY_CHECKS_PER_PERIOD)
        limit = now - self.expire_after_steps

        def scan():
            last = tf.convert_to_tensor(last_var)
            return tf.reshape(tf.where((last > 0) & (last <= limit)), [-1])

        local = tf.cond(tf.equal(now % every, 0), scan, lambda: tf.zeros([0], tf.int64))
        rows = local * n + s
        forgotten = self._forget(dynamic_state.find(st.rows, rows), rows)
        with tf.control_dependencies([forgotten]):
            ops = [st.rows.remove(rows)]
        ops += self._mark_changed(s, local)
        ops += dynamic_state.scatter(local, [(last_var, tf.zeros_like(local), "update"),
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
        for st, k, r in zip(self.states, parts_k, parts_r):
            still_there = tf.equal(dynamic_state.find(st.map, k), r)
            ops.append(st.map.remove(tf.boolean_mask(k, still_there)))
        return tf.group(ops)
