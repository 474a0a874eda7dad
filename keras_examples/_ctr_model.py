"""The CTR model of keras_examples/ctr.py, shared with tests and the evaluator.

Why this module exists: the chief trains the model inside
`strategy.scope()`, while the evaluator, the exporter and the tests build the
*same* architecture with no strategy at all and load the chief's checkpoints
into it. One builder function used everywhere is what guarantees that the
layers, their order and their variable names match.

The model is DLRM-style (Naumov et al. 2019):

* ONE fused embedding table of ``num_categorical * vocab_size`` rows: feature
  ``f`` with id ``i`` uses row ``f * vocab_size + i``. One lookup and one
  sparse gradient per step instead of 26; under the hybrid strategy that is
  one gather per PS shard per step. Measured on a 2-worker, 2-PS loopback
  cluster (2 shared cores, vocab 10k x 26, dim 16, 256 examples per worker,
  steps_per_execution 10): 7.6-8.3k examples/s fused vs 3.0-3.2k with 26
  `Embedding` layers (`fused=False`), i.e. ~2.5x.
  It is a Keras `Embedding`, so its variable is named ``embeddings`` and the
  strategy shards it over the PS tasks.
* a bottom MLP mapping the dense features to one more ``embedding_dim``
  vector, pairwise dot products of the 27 vectors, and a top MLP giving one
  logit (train with ``from_logits=True``).

Stable API (the benchmark may import it): `build_ctr_model(...)` and
`compile_ctr_model(...)`; the keyword arguments keep their meaning.
"""

from typing import Optional, Sequence

import tensorflow as tf

NUM_CATEGORICAL = 26
NUM_DENSE = 13


@tf.keras.utils.register_keras_serializable(package="tf_psplugin_examples")
class FeatureOffsets(tf.keras.layers.Layer):
    """Maps per-feature ids ``[B, F]`` to rows of a fused table: ``id + f * vocab_size``.

    Ids outside ``[0, vocab_size)`` are clipped into it, so a bad id never
    reads another feature's rows.
    """

    def __init__(self, vocab_size: int, **kwargs):
        super().__init__(**kwargs)
        self.vocab_size = int(vocab_size)

    def call(self, ids):
        ids = tf.clip_by_value(tf.cast(ids, tf.int64), 0, self.vocab_size - 1)
        offsets = tf.range(tf.shape(ids)[-1], dtype=tf.int64) * self.vocab_size
        return ids + offsets

    def get_config(self):
        return {**super().get_config(), "vocab_size": self.vocab_size}


@tf.keras.utils.register_keras_serializable(package="tf_psplugin_examples")
class DotInteraction(tf.keras.layers.Layer):
    """DLRM's feature interaction: dot products of every pair of ``[B, N, D]`` vectors.

    Returns ``[B, N * (N - 1) / 2]`` (the strict upper triangle of ``X X^T``).
    """

    def call(self, vectors):
        n = vectors.shape[1]
        gram = tf.linalg.matmul(vectors, vectors, transpose_b=True)  # [B, N, N]
        rows, cols = zip(*[(i, j) for i in range(n) for j in range(i + 1, n)])
        index = tf.constant([r * n + c for r, c in zip(rows, cols)], tf.int32)
        return tf.gather(tf.reshape(gram, [-1, n * n]), index, axis=1)


def build_ctr_model(vocab_size: int = 1000, embedding_dim: int = 16,
                    num_categorical: int = NUM_CATEGORICAL, num_dense: int = NUM_DENSE,
                    bottom_mlp: Sequence[int] = (64,), top_mlp: Sequence[int] = (128, 64),
                    fused: bool = True, seed: int = 0) -> tf.keras.Model:
    """Builds the (uncompiled) DLRM-style CTR model.

    Call it inside `strategy.scope()` on the chief for training, and outside
    any strategy (evaluator, export, tests) for a plain local copy: the two
    have the same variables in the same order.

    Args:
        vocab_size: Ids per categorical feature.
        embedding_dim: Width of every embedding and of the bottom MLP output.
        num_categorical: Categorical features (26 in Criteo).
        num_dense: Dense features (13 in Criteo).
        bottom_mlp: Hidden widths of the dense-feature MLP (its output layer
            has `embedding_dim` units).
        top_mlp: Hidden widths of the MLP after the interactions.
        fused: One table of `num_categorical * vocab_size` rows (default), or
            one `Embedding` layer per feature (for comparison).
        seed: Seed of every initializer (same seed, same initial weights).

    Returns:
        A functional `tf.keras.Model` taking ``{"dense": float32 [B,
        num_dense], "categorical": int64 [B, num_categorical]}`` and returning
        logits ``[B, 1]``.
    """
    counter = iter(range(1_000_000))

    def init():
        return tf.keras.initializers.GlorotUniform(seed=seed * 1000 + next(counter))

    dense_in = tf.keras.Input((num_dense,), dtype=tf.float32, name="dense")
    cat_in = tf.keras.Input((num_categorical,), dtype=tf.int64, name="categorical")
    if fused:
        rows = FeatureOffsets(vocab_size, name="feature_offsets")(cat_in)
        table = tf.keras.layers.Embedding(
            num_categorical * vocab_size, embedding_dim, name="embedding",
            embeddings_initializer=tf.keras.initializers.RandomUniform(
                -0.05, 0.05, seed=seed * 1000 + next(counter)))
        embedded = table(rows)  # [B, F, D]
    else:
        ids = FeatureOffsets(vocab_size, name="feature_offsets")(cat_in)
        columns = []
        for f in range(num_categorical):
            column = tf.keras.layers.Lambda(
                lambda x, f=f, v=vocab_size: x[:, f] - f * v, name=f"C{f + 1}_ids")(ids)
            columns.append(tf.keras.layers.Embedding(
                vocab_size, embedding_dim, name=f"embedding_C{f + 1}",
                embeddings_initializer=tf.keras.initializers.RandomUniform(
                    -0.05, 0.05, seed=seed * 1000 + next(counter)))(column))
        embedded = tf.keras.layers.Lambda(lambda xs: tf.stack(xs, axis=1),
                                          name="stack_embeddings")(columns)
    x = dense_in
    for i, width in enumerate(list(bottom_mlp) + [embedding_dim]):
        x = tf.keras.layers.Dense(width, activation="relu", kernel_initializer=init(),
                                  name=f"bottom_{i}")(x)
    bottom = tf.keras.layers.Reshape((1, embedding_dim), name="bottom_vector")(x)
    vectors = tf.keras.layers.Concatenate(axis=1, name="vectors")([bottom, embedded])
    interactions = DotInteraction(name="interactions")(vectors)
    x = tf.keras.layers.Concatenate(name="top_input")([x, interactions])
    for i, width in enumerate(top_mlp):
        x = tf.keras.layers.Dense(width, activation="relu", kernel_initializer=init(),
                                  name=f"top_{i}")(x)
    logits = tf.keras.layers.Dense(1, kernel_initializer=init(), name="logit")(x)
    return tf.keras.Model({"dense": dense_in, "categorical": cat_in}, logits, name="ctr_dlrm")


def compile_ctr_model(model: tf.keras.Model, learning_rate: float = 0.3,
                      steps_per_execution: int = 1,
                      optimizer: Optional[tf.keras.optimizers.Optimizer] = None) -> tf.keras.Model:
    """Compiles with Adagrad, binary cross-entropy on logits, and AUC.

    The optimizer is Keras 2's *legacy* Adagrad: ParameterServerStrategy (and
    so the hybrid strategy) supports the legacy optimizers, whose slots are
    created next to their variable -- on the PS shard for a table, on every
    worker for a dense replica; the Keras 2.11+ optimizers do not support
    sharded variables under PSS (keras-team/keras 18624).

    Args:
        model: From `build_ctr_model`.
        learning_rate: Adagrad learning rate.
        steps_per_execution: Steps per `tf.function` call (Keras knob).
        optimizer: Use this optimizer instead.

    Returns:
        `model`, compiled.
    """
    model.compile(
        optimizer=optimizer or tf.keras.optimizers.legacy.Adagrad(learning_rate),
        loss=tf.keras.losses.BinaryCrossentropy(from_logits=True),
        metrics=[tf.keras.metrics.AUC(name="auc", from_logits=True)],
        steps_per_execution=steps_per_execution)
    return model
