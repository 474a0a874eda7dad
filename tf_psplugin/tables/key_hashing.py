"""Hashes of raw embedding keys: which shard owns a key, sketch buckets, initial rows.

Pure TensorFlow ops on int64 or string keys, the same on every task and TF
version, so a key's shard, its admission counters and its initial row do not
depend on the process that computes them. That is what makes a dynamic table
train the same under any number of PS tasks as in one process.

Integer keys are mixed with SplitMix64's finalizer (any int64, negative or
above 2^62, spreads evenly: consecutive and Zipf-hot ids land on different
shards); string keys go through `tf.strings.to_hash_bucket_fast` (FarmHash)
first.
"""

import tensorflow as tf

_GOLDEN = 0x9E3779B97F4A7C15
_M1 = 0xBF58476D1CE4E5B9
_M2 = 0x94D049BB133111EB


def _u64(value) -> tf.Tensor:
    return tf.constant(value, tf.uint64)


def mix64(x: tf.Tensor) -> tf.Tensor:
    """SplitMix64's finalizer on a uint64 tensor (a bijection; avalanches every bit)."""
    x = tf.bitwise.bitwise_xor(x, tf.bitwise.right_shift(x, _u64(30)))
    x = x * _u64(_M1)
    x = tf.bitwise.bitwise_xor(x, tf.bitwise.right_shift(x, _u64(27)))
    x = x * _u64(_M2)
    return tf.bitwise.bitwise_xor(x, tf.bitwise.right_shift(x, _u64(31)))


def key_hash(keys: tf.Tensor) -> tf.Tensor:
    """A uint64 hash of int64 or string keys (same shape)."""
    if keys.dtype == tf.string:
        base = tf.bitcast(tf.strings.to_hash_bucket_fast(keys, 2**63 - 1), tf.uint64)
    elif keys.dtype in (tf.int64, tf.int32):
        base = tf.bitcast(tf.cast(keys, tf.int64), tf.uint64)
    else:
        raise TypeError(f"keys must be int32, int64 or string, got {keys.dtype.name}.")
    return mix64(base + _u64(_GOLDEN))


def bucket(hashes: tf.Tensor, num_buckets: int, salt: int = 0) -> tf.Tensor:
    """`hashes` (uint64) -> int64 buckets in [0, num_buckets), one family per `salt`."""
    h = hashes if salt == 0 else mix64(tf.bitwise.bitwise_xor(hashes, _u64(salt * _GOLDEN % 2**64)))
    return tf.cast(tf.math.floormod(h, _u64(int(num_buckets))), tf.int64)


def shard_of(hashes: tf.Tensor, num_shards: int) -> tf.Tensor:
    """The shard (int32) that owns each key hash."""
    return tf.cast(bucket(hashes, num_shards), tf.int32)


def initial_rows(hashes: tf.Tensor, dim: int, scale: float, dtype=tf.float32) -> tf.Tensor:
    """Deterministic initial rows, uniform in [-scale, scale), one per key hash.

    Row j of a key depends on the key alone, so a key admitted on any shard,
    in any process, starts from the same vector.
    """
    if scale == 0:
        return tf.zeros(tf.concat([tf.shape(hashes), [dim]], 0), dtype)
    steps = tf.constant([(j * _GOLDEN) % 2**64 for j in range(1, dim + 1)], tf.uint64)
    bits = mix64(hashes[:, tf.newaxis] + steps[tf.newaxis, :])
    top24 = tf.cast(tf.bitwise.right_shift(bits, _u64(40)), tf.float64)
    unit = top24 / float(2**24)  # [0, 1)
    return tf.cast((2.0 * unit - 1.0) * scale, dtype)
