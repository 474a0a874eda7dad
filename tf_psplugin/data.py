"""CTR input pipelines: a generated Criteo-like stream and a Criteo TSV reader.

Why this module exists: every example, test and benchmark of tf_psplugin needs
click-through data with the properties that make parameter-server training
interesting -- many large categorical features whose ids are heavy-tailed (a
few hot rows take most lookups, so embedding shards see realistic skew) next to
a few dense features -- and the real Criteo logs are a terabyte we cannot ship.
`SyntheticCTR` generates such data on the fly from a *known* hidden logistic
model, so a test can tell "the model learned" from "the model ran":
`SyntheticCTR.expected_auc` is the ceiling a trained model approaches.
`criteo_tsv_dataset` reads the real logs into the same element structure, so
switching sources is a one-line change.

Both pipelines are pure tf.data graphs (no `py_function`, no Python per
example): they run in parallel, inside `distribute_datasets_from_function`, in
Estimator input_fns and on remote ParameterServerStrategy workers.

The generator is counter-based: every random number is a SplitMix64 hash of
(seed, stream, column, example index), so example `i` is the same whatever the
batch size, sharding or starting offset. A consequence the numerical tests of
the strategy rely on: k workers reading shards of batch size B at step t see
exactly the rows of batch t of the unsharded stream with batch size k*B.
The exact distributions are documented in docs/data.md.
"""

import dataclasses
import functools
import math
import os
from typing import Dict, NamedTuple, Optional, Sequence, Tuple, Union

import numpy as np
import tensorflow as tf

NUM_INTEGER_FEATURES = 13
NUM_CATEGORICAL_FEATURES = 26
INTEGER_FEATURE_NAMES = tuple(f"I{i}" for i in range(1, NUM_INTEGER_FEATURES + 1))
CATEGORICAL_FEATURE_NAMES = tuple(f"C{i}" for i in range(1, NUM_CATEGORICAL_FEATURES + 1))

Features = Dict[str, tf.Tensor]

# SplitMix64 (Steele, Lea & Flood 2014): output = mix(key + (counter + 1) * GOLDEN).
_GOLDEN, _M1, _M2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
_MASK64 = (1 << 64) - 1
# Streams: independent key families, one per kind of random draw.
_ZIPF, _DENSE, _LABEL, _WEIGHT, _PARAMS, _FIXTURE = range(1, 7)
_MAX_COUNT = 10_000_000  # dense raw counts are capped here (exact in float32)
_DENSE_WEIGHT = 0.3  # std of one dense feature's logit term, in units of `signal`
_EVAL_START = 1 << 56  # example index where expected_auc's "fresh" data starts
_MOMENT_RANKS = 1 << 17  # ranks enumerated exactly when calibrating the bias
_INFINITE = 1 << 62
# Rows are padded to a multiple of this before elementwise math: Eigen evaluates
# full SIMD packets with vectorised exp/log and only the tail of a tensor whose
# size is not a multiple of the packet width with scalar libm, which can differ
# by one ulp. Padding makes every row take the packet path, so a row's values do
# not depend on its position or on the batch size (16 floats = one AVX-512 packet).
_ROW_ALIGN = 16
_PHI = (math.sqrt(5.0) - 1.0) / 2.0


def _mix_int(x: int) -> int:
    """SplitMix64 finaliser on a Python int (for keys and per-feature constants)."""
    x &= _MASK64
    x = ((x ^ (x >> 30)) * _M1) & _MASK64
    x = ((x ^ (x >> 27)) * _M2) & _MASK64
    return x ^ (x >> 31)


def _key(seed: int, *path: int) -> int:
    """Derives a 64-bit stream key from the seed and a path of small ints."""
    k = _mix_int(seed ^ 0x5851F42D4C957F2D)
    for p in path:
        k = _mix_int(k + (p + 1) * _GOLDEN)
    return k


def _bits_np(keys: np.ndarray, counters: np.ndarray) -> np.ndarray:
    """NumPy twin of `_bits_tf` (used for calibration and the fixture writer)."""
    x = keys.astype(np.uint64) + (counters.astype(np.uint64) + np.uint64(1)) * np.uint64(_GOLDEN)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(_M1)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(_M2)
    return x ^ (x >> np.uint64(31))


def _bits_tf(keys: tf.Tensor, counters: tf.Tensor) -> tf.Tensor:
    """64 random bits per element: SplitMix64 of key + (counter + 1) * GOLDEN (uint64)."""
    u64 = functools.partial(tf.constant, dtype=tf.uint64)
    x = keys + (counters + u64(1)) * u64(_GOLDEN)
    x = tf.bitwise.bitwise_xor(x, tf.bitwise.right_shift(x, u64(30))) * u64(_M1)
    x = tf.bitwise.bitwise_xor(x, tf.bitwise.right_shift(x, u64(27))) * u64(_M2)
    return tf.bitwise.bitwise_xor(x, tf.bitwise.right_shift(x, u64(31)))


def _uniform_tf(bits: tf.Tensor) -> tf.Tensor:
    """float64 uniform in [0, 1) from the top 53 bits."""
    top = tf.cast(tf.bitwise.right_shift(bits, tf.constant(11, tf.uint64)), tf.int64)
    return tf.cast(top, tf.float64) * 2.0**-53


def _normal_tf(bits: tf.Tensor) -> tf.Tensor:
    """Standard normal (float64) by Box-Muller on the two 32-bit halves of `bits`."""
    hi = tf.cast(tf.bitwise.right_shift(bits, tf.constant(32, tf.uint64)), tf.int64)
    lo = tf.cast(tf.bitwise.bitwise_and(bits, tf.constant(0xFFFFFFFF, tf.uint64)), tf.int64)
    u1 = (tf.cast(hi, tf.float64) + 1.0) * 2.0**-32  # (0, 1]
    u2 = tf.cast(lo, tf.float64) * 2.0**-32
    return tf.sqrt(-2.0 * tf.math.log(u1)) * tf.cos(2.0 * math.pi * u2)


def _aligned(fn, *tensors: tf.Tensor):
    """Applies row-wise `fn` to row-padded `tensors`, then strips the padding (_ROW_ALIGN)."""
    rows = tf.shape(tensors[0])[0]
    pad = tf.math.floormod(-rows, _ROW_ALIGN)
    padded = [tf.pad(t, [[0, pad]] + [[0, 0]] * (t.shape.rank - 1)) for t in tensors]
    return fn(*padded)[:rows]


def _normal_np(bits: np.ndarray) -> np.ndarray:
    u1 = ((bits >> np.uint64(32)).astype(np.float64) + 1.0) * 2.0**-32
    u2 = (bits & np.uint64(0xFFFFFFFF)).astype(np.float64) * 2.0**-32
    return np.sqrt(-2.0 * np.log(u1)) * np.cos(2.0 * math.pi * u2)


def _uniform_np(bits: np.ndarray) -> np.ndarray:
    return (bits >> np.uint64(11)).astype(np.float64) * 2.0**-53


def fixture_field_keys(seed: int) -> np.ndarray:
    """The Criteo fixture's random key of each of its 13 + 26 fields (uint64), from `seed`."""
    num_fields = NUM_INTEGER_FEATURES + NUM_CATEGORICAL_FEATURES
    return np.array([_key(seed, _FIXTURE, j) for j in range(num_fields)], np.uint64)


def fixture_uniform(keys: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """Reproducible uniform [0, 1) draws: one per (row, key), `rows` a [n, 1] uint64 column."""
    return _uniform_np(_bits_np(keys, rows))


class _Params(NamedTuple):
    """Per-feature constants of one SyntheticCTR configuration (all derived from the seed)."""

    zipf_keys: np.ndarray  # uint64 [C]
    weight_keys: np.ndarray  # uint64 [C]
    dense_keys: np.ndarray  # uint64 [I]
    label_key: np.ndarray  # uint64 [1]
    perm_a: np.ndarray  # int64 [C]: id = (a * rank + b) mod vocab_size
    perm_b: np.ndarray  # int64 [C]
    perm_a_inv: np.ndarray  # int64 [C]: rank = a_inv * (id - b) mod vocab_size
    cat_scale: np.ndarray  # float64 [C]: signal * importance_f
    dense_mu: np.ndarray  # float64 [I]: raw count = floor(exp(mu + sigma * z))
    dense_sigma: np.ndarray  # float64 [I]
    dense_mean: np.ndarray  # float64 [I]: E[log1p(count)]
    dense_weight: np.ndarray  # float64 [I]
    bias: float


@dataclasses.dataclass(frozen=True)
class SyntheticCTR:
    """Deterministic, streamed CTR data in Criteo's schema with a known hidden model.

    Each example has `num_integer` dense features (log1p of heavy-tailed counts,
    like the Criteo reader's output) and `num_categorical` ids drawn from a
    discretised power law (Zipf-like, exponent `zipf_exponent`) over
    `[0, vocab_size)`. Frequency ranks are scattered over the id space by an
    affine (golden-ratio) bijection, as hashing scatters real Criteo ids, so
    every shard of a row-partitioned table gets its share of hot rows. The label is
    Bernoulli(sigmoid(logit)) with
    `logit = bias + sum_f w_f(id_f) + sum_j v_j * (dense_j - E[dense_j])`, where
    `w_f(id) = signal * importance_f * z(f, id) / sqrt(1 + rank(id) / weight_rank_scale)`
    and `z` is a hashed standard normal: weights live mostly on frequent ids,
    which is what makes the model learnable from ~1e5 examples. `bias` is
    calibrated analytically so the mean label is close to `ctr`.

    Example:

        gen = SyntheticCTR(vocab_size=1000, seed=1)
        ds = gen.dataset(batch_size=256, num_batches=100)
        features, label = next(iter(ds))
        features["dense"].shape, features["categorical"].shape  # (256, 13), (256, 26)
        gen.expected_auc(num_examples=50_000)  # ~0.81: the best any model can do

    Attributes:
        vocab_size: Rows per categorical feature; ids lie in `[0, vocab_size)`.
        num_categorical: Number of categorical features (26 in Criteo).
        num_integer: Number of dense features (13 in Criteo).
        zipf_exponent: Exponent `s >= 0` of the power law over ranks.
        seed: Seeds everything: data, hidden model, id scattering.
        signal: Scale of the hidden weights; larger means higher `expected_auc`.
        weight_rank_scale: Rank at which hidden weights have shrunk by 1/sqrt(2).
        ctr: Target mean label; `bias` is solved for it (within ~0.02).
    """

    vocab_size: int = 100_000
    num_categorical: int = NUM_CATEGORICAL_FEATURES
    num_integer: int = NUM_INTEGER_FEATURES
    zipf_exponent: float = 1.05
    seed: int = 0
    signal: float = 0.5
    weight_rank_scale: float = 100.0
    ctr: float = 0.25

    def __post_init__(self):
        if not 1 <= self.vocab_size <= 2**31:
            raise ValueError(f"vocab_size must be in [1, 2**31], got {self.vocab_size}.")
        if self.num_categorical < 1 or self.num_integer < 1:
            raise ValueError(
                "num_categorical and num_integer must be >= 1, got "
                f"{self.num_categorical} and {self.num_integer}."
            )
        if self.zipf_exponent < 0 or self.signal < 0 or self.weight_rank_scale <= 0:
            raise ValueError(
                "zipf_exponent and signal must be >= 0 and weight_rank_scale > 0, got "
                f"{self.zipf_exponent}, {self.signal}, {self.weight_rank_scale}."
            )
        if not 0.0 < self.ctr < 1.0:
            raise ValueError(f"ctr must be in (0, 1), got {self.ctr}.")

    # ---- public API -------------------------------------------------------

    def dataset(
        self,
        batch_size: int,
        num_batches: Optional[int] = None,
        shard_index: int = 0,
        num_shards: int = 1,
        offset_batches: int = 0,
    ) -> tf.data.Dataset:
        """Streams `(features, label)` batches, generated on the fly in parallel.

        Global batch `b` holds examples `[b * batch_size, (b + 1) * batch_size)`.
        The result equals `unsharded.skip(offset_batches).shard(num_shards,
        shard_index)`, but skipped and other shards' batches are never generated.

        Args:
            batch_size: Examples per batch.
            num_batches: Length of the global (unsharded) stream, counted from
                batch 0 with skipped batches included; None = infinite.
            shard_index: Which shard this reader is, in `[0, num_shards)`.
            num_shards: Number of disjoint readers (e.g. workers); reader `i` gets
                global batches `offset + i, offset + i + n, ...`.
            offset_batches: Global batches to skip, e.g. the input position saved
                in a checkpoint. Costs nothing.

        Returns:
            A `tf.data.Dataset` of `({"dense": float32 [B, num_integer],
            "categorical": int64 [B, num_categorical]}, label float32 [B, 1])`.

        Raises:
            ValueError: On a non-positive batch size, an invalid shard, or
                `offset_batches > num_batches` (a past-the-end, empty stream).
        """
        _check_batching(batch_size, shard_index, num_shards)
        if not 0 <= offset_batches < _INFINITE:
            raise ValueError(f"offset_batches must be in [0, 2**62), got {offset_batches}.")
        stop = _INFINITE if num_batches is None else int(num_batches)
        if offset_batches > stop:
            raise ValueError(
                f"offset_batches={offset_batches} is past the end of the stream "
                f"(num_batches={num_batches}). num_batches counts global batches from 0, "
                "skipped ones included: for n batches after an offset k pass "
                "num_batches=k + n, offset_batches=k."
            )
        start = offset_batches + shard_index
        self._params  # noqa: B018  (calibrate eagerly, outside the dataset graph)
        ds = tf.data.Dataset.range(start, max(start, stop), num_shards)
        ds = ds.map(
            self._batch_fn(batch_size),
            num_parallel_calls=tf.data.AUTOTUNE,
            deterministic=True,
        )
        return ds.prefetch(tf.data.AUTOTUNE)

    def logits(self, features: Features) -> tf.Tensor:
        """The hidden model's true logit for a batch of features.

        Args:
            features: `{"dense": [B, num_integer], "categorical": [B, num_categorical]}`
                as produced by `dataset`.

        Returns:
            float32 `[B, 1]`; `sigmoid` of it is the exact click probability.
        """
        dense = tf.convert_to_tensor(features["dense"], tf.float32)
        ids = tf.convert_to_tensor(features["categorical"], tf.int64)
        return tf.cast(_aligned(self._logits64, dense, ids), tf.float32)

    def expected_auc(self, num_examples: int = 200_000) -> float:
        """AUC of the true logits on fresh examples: the ceiling for a learned model.

        Computed on examples far from any training stream (index 2**56 on), with
        sigmoid(logit) as soft labels instead of sampled ones; this is the AUC a
        perfect model would score on infinitely many examples of this
        distribution, up to sampling error of the features (~1e-3 at 200k).

        Args:
            num_examples: Fresh examples to evaluate.

        Returns:
            The expected AUC, a float in [0.5, 1].

        Raises:
            RuntimeError: If called where TensorFlow cannot execute eagerly.
        """
        chunks = []
        with tf.init_scope():
            if not tf.executing_eagerly():
                raise RuntimeError("expected_auc() needs eager execution (call it outside graphs).")
            for start in range(0, num_examples, 1 << 16):
                ex = self.examples_fn(1 << 16)(tf.constant(_EVAL_START + start, tf.int64))
                chunks.append(ex["logit"].numpy()[:, 0])
        scores = np.concatenate(chunks)[:num_examples]
        return _soft_auc(1.0 / (1.0 + np.exp(-scores)), scores)

    # ---- generation -------------------------------------------------------

    def _batch_fn(self, batch_size: int):
        """`batch_index -> (features, label)` as a tf.function traced once per batch size."""

        def batch(batch_index: tf.Tensor) -> Tuple[Features, tf.Tensor]:
            ex = self._examples(batch_index * batch_size, batch_size)
            return {"dense": ex["dense"], "categorical": ex["categorical"]}, ex["label"]

        return self._cached_function(("batch", batch_size), batch)

    def examples_fn(self, count: int):
        """`start -> count examples from index start` as a cached tf.function (eager callers).

        The examples are dicts of NumPy-convertible tensors ("dense",
        "counts", "categorical", "label"); `testing.write_criteo_fixture`
        writes them as text.
        """
        return self._cached_function(("examples", count), lambda s: self._examples(s, count))

    def _cached_function(self, key, fn):
        # Tracing the generator costs ~0.3 s; datasets and chunks reuse one trace.
        if key not in self._functions:
            self._functions[key] = tf.function(fn, autograph=False)
        return self._functions[key]

    @functools.cached_property
    def _functions(self) -> dict:
        return {}

    def _examples(self, start: tf.Tensor, count: int) -> Features:
        """Examples `[start, start + count)`: dense, categorical, label, logit, raw counts."""
        p = self._params
        padded = -(-count // _ROW_ALIGN) * _ROW_ALIGN
        index = tf.cast(start + tf.range(padded, dtype=tf.int64), tf.uint64)[:, None]
        n = float(self.vocab_size)
        # Zipf ranks by inverse CDF of the power law x^-s on [1, N + 1); rank = floor(x) - 1.
        u = _uniform_tf(_bits_tf(tf.constant(p.zipf_keys), index))
        s = self.zipf_exponent
        if abs(s - 1.0) < 1e-9:
            x = tf.exp(u * math.log(n + 1.0))
        else:
            x = tf.exp(tf.math.log1p(u * ((n + 1.0) ** (1.0 - s) - 1.0)) / (1.0 - s))
        rank = tf.clip_by_value(tf.cast(tf.floor(x), tf.int64) - 1, 0, self.vocab_size - 1)
        ids = tf.math.floormod(rank * p.perm_a + p.perm_b, self.vocab_size)
        # Dense: raw count = floor(exp(mu + sigma * z)), capped; feature = log1p(count).
        z = _normal_tf(_bits_tf(tf.constant(p.dense_keys), index))
        counts = tf.minimum(tf.floor(tf.exp(p.dense_mu + p.dense_sigma * z)), _MAX_COUNT)
        dense = tf.math.log1p(tf.cast(counts, tf.float32))
        logit = self._logits64(dense, ids)
        label = _uniform_tf(_bits_tf(tf.constant(p.label_key), index)) < tf.sigmoid(logit)
        out = {
            "logit": logit,
            "dense": dense,
            "categorical": ids,
            "label": tf.cast(label, tf.float32),
            "counts": tf.cast(counts, tf.int64),
        }
        return {k: v[:count] for k, v in out.items()}

    def _logits64(self, dense: tf.Tensor, ids: tf.Tensor) -> tf.Tensor:
        p = self._params
        ids = tf.cast(ids, tf.int64)
        n = self.vocab_size
        rank = tf.math.floormod(p.perm_a_inv * tf.math.floormod(ids - p.perm_b, n), n)
        shrink = tf.math.rsqrt(1.0 + tf.cast(rank, tf.float64) / self.weight_rank_scale)
        z = _normal_tf(_bits_tf(tf.constant(p.weight_keys), tf.cast(ids, tf.uint64)))
        cat = tf.reduce_sum(p.cat_scale * shrink * z, axis=1, keepdims=True)
        centred = tf.cast(dense, tf.float64) - p.dense_mean
        return p.bias + cat + tf.reduce_sum(p.dense_weight * centred, axis=1, keepdims=True)

    @functools.cached_property
    def _params(self) -> _Params:
        """Derives every per-feature constant from the seed and calibrates the bias (NumPy)."""
        c, i, n, seed = self.num_categorical, self.num_integer, self.vocab_size, self.seed

        def keys(stream: int, k: int) -> np.ndarray:
            return np.array([_key(seed, stream, j) for j in range(k)], np.uint64)

        def draws(row: int, k: int) -> np.ndarray:  # k 64-bit draws from parameter stream `row`
            return _bits_np(keys(_PARAMS, 4)[row : row + 1], np.arange(k))

        importance = 0.2 + 0.8 * _uniform_np(draws(0, c))
        mu, sigma = -1.0 + 4.0 * _uniform_np(draws(1, i)), 1.0 + _uniform_np(draws(2, i))
        v = _normal_np(draws(3, i))
        # rank -> id: id = (a * rank + b_f) mod N with a the integer nearest N * (sqrt(5) - 1) / 2
        # that is coprime to N (a bijection; hot ranks spread evenly over the id range).
        a = max(round(n * _PHI), 1)
        while math.gcd(a, n) != 1:
            a += 1
        perm_a = [a % n] * c
        perm_b = [_key(seed, _PARAMS, 200 + j) % n for j in range(c)]
        perm_a_inv = [pow(a, -1, n) if n > 1 else 0] * c
        # Dense moments E[log1p(count)], Var[...] by quadrature over z ~ N(0, 1).
        zq = np.linspace(-9.0, 9.0, 36_001)
        wq = np.exp(-0.5 * zq**2)
        wq /= wq.sum()
        cnt = np.minimum(np.floor(np.exp(mu[:, None] + sigma[:, None] * zq)), _MAX_COUNT)
        d = np.log1p(cnt.astype(np.float32)).astype(np.float64)
        dense_mean = d @ wq
        dense_std = np.sqrt(np.maximum(((d - dense_mean[:, None]) ** 2) @ wq, 1e-12))
        dense_weight = self.signal * _DENSE_WEIGHT * v / dense_std
        # Categorical moments: exact over the top ranks, bounded over the tail.
        cat_scale = self.signal * importance
        k = min(n, _MOMENT_RANKS)
        r = np.arange(k, dtype=np.float64)
        pmf = np.diff(self._rank_cdf(np.arange(k + 1, dtype=np.float64)))
        shrink = 1.0 / np.sqrt(1.0 + r / self.weight_rank_scale)
        top_ranks = np.arange(k, dtype=np.uint64)
        mean_logit, var_logit = 0.0, float(np.sum((dense_weight * dense_std) ** 2))
        for j in range(c):
            ids = (top_ranks * np.uint64(a) + np.uint64(perm_b[j])) % np.uint64(n)
            z = _normal_np(_bits_np(np.array([_key(seed, _WEIGHT, j)], np.uint64), ids))
            w = cat_scale[j] * shrink * z
            m1 = float(pmf @ w)
            tail = (1.0 - pmf.sum()) * (cat_scale[j] ** 2) / (1.0 + k / self.weight_rank_scale)
            mean_logit += m1
            var_logit += float(pmf @ w**2) + tail - m1**2
        # E[sigmoid(X)] ~= sigmoid(mu / sqrt(1 + pi * var / 8)) for X ~ N(mu, var).
        target = math.log(self.ctr / (1.0 - self.ctr)) * math.sqrt(1.0 + math.pi * var_logit / 8.0)
        return _Params(
            zipf_keys=keys(_ZIPF, c),
            weight_keys=keys(_WEIGHT, c),
            dense_keys=keys(_DENSE, i),
            label_key=keys(_LABEL, 1),
            perm_a=np.array(perm_a, np.int64),
            perm_b=np.array(perm_b, np.int64),
            perm_a_inv=np.array(perm_a_inv, np.int64),
            cat_scale=cat_scale,
            dense_mu=mu,
            dense_sigma=sigma,
            dense_mean=dense_mean,
            dense_weight=dense_weight,
            bias=round(target - mean_logit, 6),
        )

    def _rank_cdf(self, x: np.ndarray) -> np.ndarray:
        """P(rank < x) for the discretised power law (exact; see docs/data.md)."""
        n, s = float(self.vocab_size), self.zipf_exponent
        if abs(s - 1.0) < 1e-9:
            return np.log1p(x) / math.log(n + 1.0)
        return ((1.0 + x) ** (1.0 - s) - 1.0) / ((n + 1.0) ** (1.0 - s) - 1.0)


def _soft_auc(pos_weight: np.ndarray, scores: np.ndarray) -> float:
    """ROC AUC where example i counts as pos_weight[i] positive and 1 - pos_weight[i] negative.

    With 0/1 weights this is the ordinary (tie-averaged) AUC. Self-pairs are excluded.
    """
    order = np.argsort(scores, kind="stable")
    s, pw = scores[order], pos_weight[order].astype(np.float64)
    nw = 1.0 - pw
    _, first = np.unique(s, return_index=True)
    grp_pos, grp_neg = np.add.reduceat(pw, first), np.add.reduceat(nw, first)
    grp_self = np.add.reduceat(pw * nw, first)
    neg_below = np.cumsum(grp_neg) - grp_neg
    num = np.sum(grp_pos * neg_below + 0.5 * (grp_pos * grp_neg - grp_self))
    den = pw.sum() * nw.sum() - np.sum(pw * nw)
    return float(num / den) if den > 0 else float("nan")


def _check_batching(batch_size: int, shard_index: int, num_shards: int) -> None:
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}.")
    if num_shards < 1 or not 0 <= shard_index < num_shards:
        raise ValueError(
            f"Need 0 <= shard_index < num_shards, got shard_index={shard_index}, "
            f"num_shards={num_shards}."
        )


def to_named_columns(features: Features) -> Features:
    """Splits `{"dense", "categorical"}` into one column per Criteo feature name.

    For Estimator feature columns (`numeric_column("I1")`,
    `categorical_column_with_identity("C1", vocab_size)`), which want one tensor
    per name.

    Args:
        features: `{"dense": [B, I], "categorical": [B, C]}` with static I, C.

    Returns:
        `{"I1": float32 [B], ..., "C1": int64 [B], ...}`; names I1..I<I>, C1..C<C>.
    """
    columns = {}
    for prefix, key in (("I", "dense"), ("C", "categorical")):
        for j, col in enumerate(tf.unstack(features[key], axis=1)):
            columns[f"{prefix}{j + 1}"] = col
    return columns


# ---- Criteo TSV -------------------------------------------------------------


def criteo_tsv_dataset(
    file_pattern: Union[str, Sequence[str]],
    batch_size: int,
    vocab_size: int = 100_000,
    num_parallel_reads: int = tf.data.AUTOTUNE,
    shuffle_files: bool = False,
    shard_index: int = 0,
    num_shards: int = 1,
    repeat: bool = False,
    drop_remainder: bool = True,
    seed: Optional[int] = None,
    compression_type: str = "",
) -> tf.data.Dataset:
    """Reads Criteo-format TSV (label, 13 ints, 26 hex categoricals) into CTR batches.

    Lines of several files are interleaved (parallel reads), batched, then
    decoded a whole batch at a time with `tf.io.decode_csv`. Integers become
    `log(1 + max(x, 0))` (empty -> 0). Non-empty categoricals become
    `1 + Fingerprint64(string) mod (vocab_size - 1)` via
    `tf.strings.to_hash_bucket_fast` (stable across runs, machines and TF
    versions); empty ones become the reserved id 0, which no string maps to.
    Sharding follows tf.data's AUTO policy: by file when there are at least
    `num_shards` files, otherwise by line.

    Args:
        file_pattern: A glob (or list of globs) of uncompressed or
            `compression_type` files.
        batch_size: Lines per batch.
        vocab_size: Ids per categorical feature (>= 2; 0 is reserved for missing).
        num_parallel_reads: Files read concurrently; AUTOTUNE means
            min(#files, 16). The line order depends on it, not on the machine.
        shuffle_files: Shuffle the file order each epoch (with `seed`).
        shard_index: Which shard this reader is, in `[0, num_shards)`.
        num_shards: Number of disjoint readers.
        repeat: Repeat forever (batches then span epochs).
        drop_remainder: Drop the last partial batch (static batch dimension).
        seed: Seed of the file shuffle.
        compression_type: "", "GZIP" or "ZLIB", as for `tf.data.TextLineDataset`.

    Returns:
        A `tf.data.Dataset` with the element structure of `SyntheticCTR.dataset`.

    Raises:
        ValueError: If no file matches, or on invalid sizes or shard arguments.
    """
    _check_batching(batch_size, shard_index, num_shards)
    if vocab_size < 2:
        raise ValueError(f"vocab_size must be >= 2 (id 0 is reserved), got {vocab_size}.")
    patterns = [file_pattern] if isinstance(file_pattern, (str, os.PathLike)) else file_pattern
    files = sorted({f for p in patterns for f in tf.io.gfile.glob(os.fspath(p))})
    if not files:
        raise ValueError(
            f"criteo_tsv_dataset: file_pattern {file_pattern!r} matched no file. Fix: check "
            "the path and glob (e.g. '/data/criteo/day_*'), or create a small test file "
            "with tf_psplugin.testing.write_criteo_fixture(path, num_rows)."
        )
    by_file = len(files) >= num_shards
    if by_file:
        files = files[shard_index::num_shards]
    ds = tf.data.Dataset.from_tensor_slices(files)
    if shuffle_files:
        ds = ds.shuffle(len(files), seed=seed, reshuffle_each_iteration=True)
    cycle = 16 if num_parallel_reads == tf.data.AUTOTUNE else max(int(num_parallel_reads), 1)
    ds = ds.interleave(
        lambda f: tf.data.TextLineDataset(f, compression_type=compression_type),
        cycle_length=min(cycle, len(files)),
        num_parallel_calls=tf.data.AUTOTUNE,
        deterministic=True,
    )
    if not by_file:
        ds = ds.shard(num_shards, shard_index)
    if repeat:
        ds = ds.repeat()
    ds = ds.batch(batch_size, drop_remainder=drop_remainder)
    ds = ds.map(
        functools.partial(_decode_criteo, vocab_size=vocab_size),
        num_parallel_calls=tf.data.AUTOTUNE,
        deterministic=True,
    )
    return ds.prefetch(tf.data.AUTOTUNE)


def _decode_criteo(lines: tf.Tensor, vocab_size: int) -> Tuple[Features, tf.Tensor]:
    defaults = [[0.0]] * (1 + NUM_INTEGER_FEATURES) + [[""]] * NUM_CATEGORICAL_FEATURES
    cols = tf.io.decode_csv(lines, defaults, field_delim="\t", use_quote_delim=False)
    ints = tf.stack(cols[1 : 1 + NUM_INTEGER_FEATURES], axis=1)
    cats = tf.stack(cols[1 + NUM_INTEGER_FEATURES :], axis=1)
    hashed = tf.strings.to_hash_bucket_fast(cats, vocab_size - 1) + 1
    features = {
        "dense": _aligned(lambda x: tf.math.log1p(tf.maximum(x, 0.0)), ints),
        "categorical": tf.where(tf.equal(cats, ""), tf.zeros_like(hashed), hashed),
    }
    return features, cols[0][:, None]
