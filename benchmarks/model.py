"""The benchmark's CTR model and input pipeline, identical in every setup.

Why this module exists: a throughput comparison is only meaningful if every
setup trains the same model on the same data with the same optimizer and
Keras knobs. The model is defined here rather than imported from
`keras_examples/` so that the benchmark stays stable while examples evolve.

Default model (Criteo-shaped): 26 categorical features, one embedding table
of `vocab_size` rows x `embedding_dim` per feature (Keras `Embedding`, whose
weight is named ``embeddings``, so every strategy recognises it as a table),
concatenated with the 13 dense features, then an MLP 512-256-128-1 (ReLU) and
a logit (float32 under every Keras policy, as Keras's mixed-precision guide
says); binary cross-entropy; legacy Adagrad (``optimizer``: Keras's new
Adagrad or SGD instead, which mixed_float16 and half-precision tables need).

Variants used by the profile (`--variant`):

* ``fused``: one table of ``26 * vocab_size`` rows with per-feature id offsets:
  one lookup (and one sparse gradient) per step instead of 26.
* ``multitable``: the 26 tables of the baseline, looked up together with
  `tf_psplugin.tables.lookups.lookup_tables` (one round trip per PS for all
  of them): what `experimental_fuse_lookups=True` does for the baseline model.
* ``dedup``: ids are de-duplicated with `tf.unique` before the lookup, so each
  distinct row is fetched from the PS (and its gradient pushed) once per batch.

Ablations of the table lookup (issue 44 item 2: how much a pipelined step
could win), same dense work as ``baseline``:

* ``local_rows``: no table at all; each feature's rows are gathered on the
  worker from a small constant (``ids % LOCAL_ROWS`` rows of width
  `embedding_dim`): no lookup RPC and no sparse gradient push on the critical
  path of the step, and no PS work.
* ``no_push``: the baseline's tables and lookups, but no gradient reaches the
  tables (`tf.stop_gradient` on the rows): the lookup RPC stays, the sparse
  gradient push and the PS's apply go.

Both scale the rows by one trainable scalar (`AblationScale`, a dense
variable: one float all-reduced), so the backward pass still computes the
gradient of the loss with respect to the rows (the first MLP layer's input
gradient) as the baseline does. ``baseline`` minus ``no_push`` bounds the
push; ``no_push`` minus ``local_rows`` bounds the lookup.

Raw-id variants (``benchmarks.run --dynamic``): every feature's id becomes a
raw key in a 2^40 id space (`raw_keys`), as Criteo-style hashed strings are;
one table of `capacity` rows serves all 26 features:

* ``hashed``: a static `Embedding` of `capacity` rows; a key's row is its
  hash modulo `capacity` (distinct keys collide).
* ``dynamic``: a `tf_psplugin.layers.DynamicEmbedding` of the same capacity
  (a row per admitted key, LRU eviction when full).

Input: `tf_psplugin.data.SyntheticCTR` (Zipf ids), a pool of batches generated
once, cached in memory and repeated, so data generation is outside the timed
steps and costs the same in every setup.
"""

import dataclasses
from typing import Dict, Optional, Tuple

import tensorflow as tf

NUM_DENSE = 13
VARIANTS = ("baseline", "fused", "dedup", "fused_dedup", "multitable", "hashed", "dynamic",
            "local_rows", "no_push")
ABLATION_VARIANTS = ("local_rows", "no_push")
LOCAL_ROWS = 1024  # Rows of the `local_rows` variant's worker-local constant.
RAW_KEY_VARIANTS = ("hashed", "dynamic")
RAW_KEY_BITS = 40
# ModelSpec.optimizer -> the optimizer for a learning rate (the names are
# benchmarks.run's --optimizer choices). Keras's new optimizers are what
# `mixed_float16` (LossScaleOptimizer) and tables in half precision
# (HybridOptions.table_dtype) need (docs/mixed_precision.md).
class SlotlessSGD(tf.keras.optimizers.SGD):
    """Keras's SGD without momentum and without its momentum slot.

    Keras's SGD (2.15 and tf-keras 2.21) makes a momentum slot of every
    variable's shape even with ``momentum=0``, and its sparse update then
    assigns every row of it and of the table each step (``m.assign(m *
    momentum)``, ``variable.assign_add(m)``). This one makes none, so its
    update of a table is ``scatter_add`` of the gradient's rows: the plain
    SGD whose PS memory is the table's alone (``benchmarks.run --memory
    --optimizer sgd_noslot``).
    """

    def __init__(self, learning_rate=0.01, **kwargs):
        super().__init__(learning_rate, momentum=0.0, **kwargs)

    def build(self, var_list):
        # Skips SGD.build (which makes the slots): Keras's Optimizer.build only.
        tf.keras.optimizers.Optimizer.build(self, var_list)
        if getattr(self, "_built", False):
            return
        self.momentums = [None] * len(var_list)  # SGD.update_step's "no momentum" branch.
        self._built = True


OPTIMIZERS = {
    "legacy_adagrad": tf.keras.optimizers.legacy.Adagrad,
    "adagrad": tf.keras.optimizers.Adagrad,
    "sgd": tf.keras.optimizers.SGD,
    "sgd_noslot": SlotlessSGD,
}


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """What is trained: model shape, optimizer and data.

    Attributes:
        vocab_size: Rows per categorical feature (raw-key variants: distinct
            ids per feature in the generated data).
        num_categorical: Categorical features (26 as in Criteo).
        embedding_dim: Embedding width.
        hidden: MLP widths before the logit.
        variant: One of `VARIANTS` (see module doc).
        learning_rate: Adagrad learning rate.
        seed: Data and initialisation seed.
        capacity: Rows of the one table of the raw-key variants.
        admit_after: The dynamic variant's `admit_after`.
        optimizer: One of `OPTIMIZERS`: ``legacy_adagrad`` (the benchmark's
            default), ``adagrad`` (Keras's new Adagrad) or ``sgd``.
    """

    vocab_size: int = 100_000
    num_categorical: int = 26
    embedding_dim: int = 16
    hidden: Tuple[int, ...] = (512, 256, 128)
    variant: str = "baseline"
    learning_rate: float = 0.05
    seed: int = 0
    capacity: int = 0
    admit_after: int = 1
    optimizer: str = "legacy_adagrad"

    def __post_init__(self):
        if self.variant not in VARIANTS:
            raise ValueError(f"variant must be one of {VARIANTS}, got {self.variant!r}")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {sorted(OPTIMIZERS)}, "
                             f"got {self.optimizer!r}")
        object.__setattr__(self, "hidden", tuple(int(h) for h in self.hidden))

    @property
    def fused(self) -> bool:
        return self.variant.startswith("fused")

    @property
    def dedup(self) -> bool:
        return self.variant.endswith("dedup")

    def table_rows(self) -> int:
        """Rows of all embedding tables together."""
        return self.vocab_size * self.num_categorical

    def to_dict(self) -> Dict[str, object]:
        d = dataclasses.asdict(self)
        d["hidden"] = list(self.hidden)
        return d

    @classmethod
    def from_dict(cls, d: Dict[str, object]) -> "ModelSpec":
        return cls(**d)


class DedupEmbedding(tf.keras.layers.Layer):
    """An embedding lookup that fetches each distinct id once per batch.

    Its weight is named ``embeddings`` like Keras's `Embedding`, so placement
    treats it as a table. The gradient reaching the table is an IndexedSlices
    with one row per distinct id (not one per occurrence).
    """

    def __init__(self, input_dim: int, output_dim: int, **kwargs):
        super().__init__(**kwargs)
        self.input_dim = int(input_dim)
        self.output_dim = int(output_dim)

    def build(self, input_shape):
        self.embeddings = self.add_weight(
            name="embeddings", shape=(self.input_dim, self.output_dim),
            initializer=tf.keras.initializers.RandomUniform(-0.05, 0.05), trainable=True)
        super().build(input_shape)

    def call(self, ids):
        ids = tf.cast(ids, tf.int64)
        flat = tf.reshape(ids, [-1])
        unique_ids, position = tf.unique(flat)
        rows = tf.nn.embedding_lookup(self.embeddings, unique_ids)
        out = tf.gather(rows, position)
        return tf.reshape(out, tf.concat([tf.shape(ids), [self.output_dim]], axis=0))


class MultiTableEmbedding(tf.keras.layers.Layer):
    """One Keras `Embedding` per feature, looked up together (`lookup_tables`)."""

    def __init__(self, num_tables: int, input_dim: int, output_dim: int, **kwargs):
        super().__init__(**kwargs)
        self.tables = [
            tf.keras.layers.Embedding(
                input_dim, output_dim, name=f"embedding_C{f + 1}",
                embeddings_initializer=tf.keras.initializers.RandomUniform(-0.05, 0.05))
            for f in range(num_tables)]

    def build(self, input_shape):
        for layer in self.tables:
            layer.build(input_shape[:1])
        super().build(input_shape)

    def call(self, ids):
        from tf_psplugin.tables.lookups import lookup_tables  # pylint: disable=g-import-not-at-top

        columns = lookup_tables([layer.embeddings for layer in self.tables],
                                tf.unstack(ids, axis=1))
        return tf.concat(columns, axis=1)


class AblationScale(tf.keras.layers.Layer):
    """Rows times one trainable scalar (initially 1): keeps the row gradient computed.

    Without it a model whose rows need no gradient (``local_rows``,
    ``no_push``) would skip the first MLP layer's input gradient, dense work
    the baseline does.
    """

    def build(self, input_shape):
        self.scale = self.add_weight(name="scale", shape=(), initializer="ones",
                                     trainable=True)
        super().build(input_shape)

    def call(self, rows):
        return rows * tf.cast(self.scale, rows.dtype)


class LocalRows(tf.keras.layers.Layer):
    """Every feature's rows from a worker-local constant: a lookup with no RPC.

    `LOCAL_ROWS` x `dim` values (64 KiB at width 16), the same for every
    feature; ids are taken modulo `LOCAL_ROWS`. Output: [B, F * dim], as the
    baseline's concatenated embeddings.
    """

    def __init__(self, dim: int, seed: int = 0, **kwargs):
        super().__init__(**kwargs)
        self.dim = int(dim)
        self.seed = int(seed)

    def call(self, ids):
        import numpy as np  # pylint: disable=g-import-not-at-top

        values = np.random.default_rng(self.seed).uniform(
            -0.05, 0.05, (LOCAL_ROWS, self.dim)).astype(np.float32)
        rows = tf.gather(tf.constant(values), tf.math.floormod(tf.cast(ids, tf.int64), LOCAL_ROWS))
        return tf.reshape(rows, [-1, ids.shape[-1] * self.dim])


def _embedding(spec: ModelSpec, rows: int, name: str):
    if spec.dedup:
        return DedupEmbedding(rows, spec.embedding_dim, name=name)
    return tf.keras.layers.Embedding(
        rows, spec.embedding_dim, name=name,
        embeddings_initializer=tf.keras.initializers.RandomUniform(-0.05, 0.05))


def raw_keys(ids: tf.Tensor) -> tf.Tensor:
    """Feature ids [B, F] in [0, vocab) -> raw int64 keys in [0, 2^40), distinct per feature.

    An odd multiplier is a bijection modulo 2^40, so distinct (feature, id)
    pairs give distinct keys; the keys look like hashed strings (no order,
    no locality), the way production CTR ids arrive.
    """
    num_features = ids.shape[-1]
    salted = (tf.cast(ids, tf.uint64) * tf.constant(num_features, tf.uint64)
              + tf.constant(list(range(num_features)), tf.uint64))
    mask = tf.constant(2**RAW_KEY_BITS - 1, tf.uint64)
    mixed = tf.bitwise.bitwise_and(salted * tf.constant(0x9E3779B97F4A7C15, tf.uint64), mask)
    return tf.bitcast(mixed, tf.int64)


def _raw_key_embedding(spec: ModelSpec, cat_in):
    if spec.variant == "hashed":
        from tf_psplugin.tables import key_hashing  # pylint: disable=g-import-not-at-top

        rows = tf.keras.layers.Lambda(
            lambda k: key_hashing.bucket(key_hashing.key_hash(k), spec.capacity),
            name="hash_keys")(cat_in)
        emb = tf.keras.layers.Embedding(
            spec.capacity, spec.embedding_dim, name="embedding_hashed",
            embeddings_initializer=tf.keras.initializers.RandomUniform(-0.05, 0.05))(rows)
    else:
        from tf_psplugin import layers  # pylint: disable=g-import-not-at-top

        emb = layers.DynamicEmbedding(spec.embedding_dim, capacity=spec.capacity,
                                      admit_after=spec.admit_after, eviction="lru",
                                      name="embedding_dynamic")(cat_in)
    return tf.keras.layers.Flatten(name="flatten")(emb)


def build_model(spec: ModelSpec) -> tf.keras.Model:
    """Builds the (uncompiled) CTR model; call inside `strategy.scope()`.

    Args:
        spec: The model description.

    Returns:
        A functional Keras model taking `{"dense": [B, 13] float32,
        "categorical": [B, num_categorical] int64}` and returning logits [B, 1].
    """
    tf.keras.utils.set_random_seed(spec.seed)
    dense_in = tf.keras.Input(shape=(NUM_DENSE,), dtype=tf.float32, name="dense")
    cat_in = tf.keras.Input(shape=(spec.num_categorical,), dtype=tf.int64, name="categorical")
    if spec.variant in RAW_KEY_VARIANTS:
        emb = _raw_key_embedding(spec, cat_in)
    elif spec.fused:
        offsets = tf.constant([f * spec.vocab_size for f in range(spec.num_categorical)],
                              dtype=tf.int64)
        ids = tf.keras.layers.Lambda(lambda c: c + offsets, name="fuse_ids")(cat_in)
        emb = _embedding(spec, spec.table_rows(), "embedding_fused")(ids)
        emb = tf.keras.layers.Flatten(name="flatten")(emb)
    elif spec.variant == "local_rows":
        emb = LocalRows(spec.embedding_dim, spec.seed, name="local_rows")(cat_in)
    elif spec.variant == "multitable":
        emb = MultiTableEmbedding(spec.num_categorical, spec.vocab_size, spec.embedding_dim,
                                  name="embeddings_all")(cat_in)
    else:
        columns = []
        for f in range(spec.num_categorical):
            ids_f = tf.keras.layers.Lambda(lambda c, f=f: c[:, f], name=f"ids_C{f + 1}")(cat_in)
            columns.append(_embedding(spec, spec.vocab_size, f"embedding_C{f + 1}")(ids_f))
        emb = tf.keras.layers.Concatenate(name="concat_embeddings")(columns)
        if spec.variant == "no_push":
            emb = tf.keras.layers.Lambda(tf.stop_gradient, name="stop_row_gradients")(emb)
    if spec.variant in ABLATION_VARIANTS:
        emb = AblationScale(name="ablation_scale")(emb)
    x = tf.keras.layers.Concatenate(name="concat")([dense_in, emb])
    for i, width in enumerate(spec.hidden):
        x = tf.keras.layers.Dense(width, activation="relu", name=f"mlp_{i}")(x)
    # float32 under a mixed policy too (Keras's mixed-precision guide); the
    # same layer as before under float32.
    logit = tf.keras.layers.Dense(1, name="logit", dtype="float32")(x)
    return tf.keras.Model({"dense": dense_in, "categorical": cat_in}, logit, name="ctr")


def compile_model(model: tf.keras.Model, spec: ModelSpec, steps_per_execution: int) -> None:
    """Compiles with the benchmark's loss, optimizer and knobs (AUC for raw-key variants).

    Under `mixed_float16` Keras's `compile` wraps the optimizer in its
    `LossScaleOptimizer`, as in a user's job.
    """
    # The raw-key variants report held-out AUC (`benchmarks.run --dynamic`).
    metrics = ([tf.keras.metrics.AUC(from_logits=True, name="auc")]
               if spec.variant in RAW_KEY_VARIANTS else None)
    model.compile(
        optimizer=OPTIMIZERS[spec.optimizer](spec.learning_rate),
        loss=tf.keras.losses.BinaryCrossentropy(from_logits=True),
        metrics=metrics, steps_per_execution=steps_per_execution)


def make_dataset(spec: ModelSpec, batch_size: int, pool_batches: int,
                 shard_index: int = 0, num_shards: int = 1,
                 vocab_size: Optional[int] = None, repeat: bool = True) -> tf.data.Dataset:
    """A repeated pool of `pool_batches` cached batches of `batch_size` examples.

    Args:
        spec: Model description (vocabulary, seed).
        batch_size: Examples per batch (per worker for multi-worker setups).
        pool_batches: Distinct batches this reader cycles through.
        shard_index: This reader's shard of the generated stream.
        num_shards: Number of readers.
        vocab_size: Override of `spec.vocab_size` for the ids.
        repeat: False: the pool once (a finite dataset of known length).

    Returns:
        An infinite (or, with ``repeat=False``, finite) dataset of
        `({"dense", "categorical"}, label)` batches.
    """
    from tf_psplugin.data import SyntheticCTR  # pylint: disable=g-import-not-at-top

    gen = SyntheticCTR(vocab_size=vocab_size or spec.vocab_size,
                       num_categorical=spec.num_categorical, seed=spec.seed)
    ds = gen.dataset(batch_size, num_batches=pool_batches * num_shards,
                     shard_index=shard_index, num_shards=num_shards)
    if spec.variant in RAW_KEY_VARIANTS:
        ds = ds.map(lambda x, y: ({"dense": x["dense"], "categorical": raw_keys(x["categorical"])},
                                  y))
    return ds.cache().repeat() if repeat else ds.cache()


def heldout_dataset(spec: ModelSpec, batch_size: int, num_batches: int,
                    after_batches: int) -> tf.data.Dataset:
    """`num_batches` batches of the same stream that no training pool holds.

    Args:
        spec: Model description.
        batch_size: Examples per batch.
        num_batches: Batches to return.
        after_batches: Global batches of `batch_size` to skip first (past
            every reader's pool).
    """
    from tf_psplugin.data import SyntheticCTR  # pylint: disable=g-import-not-at-top

    gen = SyntheticCTR(vocab_size=spec.vocab_size, num_categorical=spec.num_categorical,
                       seed=spec.seed)
    ds = gen.dataset(batch_size, num_batches=after_batches + num_batches,
                     offset_batches=after_batches)
    if spec.variant in RAW_KEY_VARIANTS:
        ds = ds.map(lambda x, y: ({"dense": x["dense"], "categorical": raw_keys(x["categorical"])},
                                  y))
    return ds
