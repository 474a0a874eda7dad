"""A Keras job with table stacking on or off, trained, then restarted from its checkpoint.

Used by tests/cluster/test_table_stacking_resume.py (issue 40). Arguments:
``<stacked|unstacked> <model_dir> <out_dir> [variant]``. The job is what a
Keras user writes: one functional model with a trainable and a frozen
`Embedding` (frozen at construction), a second model built in the same
scope (a target network), Keras Adam (moves every row it owns) and
`ChiefCheckpoint`, which restores the latest checkpoint of `model_dir` at
train begin. Run twice on one `model_dir`, the second run is a restart: it
restores (building the optimizer's slots before any step is traced) and
trains on. Variants:

* ``adam`` (default): as above.
* ``build_slots``: the program calls `tf_psplugin.build_optimizer_slots`
  after `compile`, as docs/api.md tells stock-callback users to.
* ``ema``: Adam with ``use_ema=True`` (an overwrite every 4 steps, and at the
  end of `fit`).
* ``custom``: a subclass of Adam (an optimizer stacking does not know: each
  of the model's tables gets storage of its own, and the placement report,
  written to ``<out_dir>/placement.txt``, says why).
* ``subclassed``: both models are `tf.keras.Model` subclasses (`Tower`,
  the same layers), built by a first eager call; their stacks are split
  at the trained model's first traced `__call__` (fresh run) or before its
  slots (restart).
* ``subclassed_build_slots``: ``subclassed`` and ``build_slots``.

It writes every table and dense weight of both models to
``<out_dir>/weights.npz`` and prints ``DONE``.
"""

import os
import sys

import numpy as np
import tensorflow as tf

import tf_psplugin

V, DIM = 40, 4


class MyAdam(tf.keras.optimizers.Adam):
    """A user's own optimizer class (here changing nothing)."""


class Tower(tf.keras.Model):
    """`build_model`'s layers as a subclassed model."""

    def __init__(self, prefix):
        super().__init__(name=f"{prefix}_tower")
        self.item = tf.keras.layers.Embedding(V, DIM, name=f"{prefix}_item")
        self.frozen = tf.keras.layers.Embedding(V, DIM, trainable=False, name=f"{prefix}_frozen")
        self.user = tf.keras.layers.Embedding(V, DIM, name=f"{prefix}_user")
        self.dense = tf.keras.layers.Dense(1, name=f"{prefix}_dense")

    def call(self, ids):
        return self.dense(tf.concat(
            [self.item(ids[:, 0]), self.frozen(ids[:, 1]), self.user(ids[:, 2])], axis=1))


def build_model(prefix, subclassed=False):
    if subclassed:
        model = Tower(prefix)
        model(tf.zeros([1, 3], tf.int64))  # Built eagerly, as `Input` builds a functional one.
        return model
    ids = tf.keras.Input((3,), dtype="int64", name=f"{prefix}_ids")
    item = tf.keras.layers.Embedding(V, DIM, name=f"{prefix}_item")(ids[:, 0])
    frozen = tf.keras.layers.Embedding(V, DIM, trainable=False,
                                       name=f"{prefix}_frozen")(ids[:, 1])
    user = tf.keras.layers.Embedding(V, DIM, name=f"{prefix}_user")(ids[:, 2])
    x = tf.keras.layers.Concatenate()([item, frozen, user])
    out = tf.keras.layers.Dense(1, name=f"{prefix}_dense")(x)
    return tf.keras.Model(ids, out)


def data(seed):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, V, (192, 3)).astype("int64")
    y = ((ids[:, :1] + ids[:, 2:]) % 2).astype("float32")
    return tf.data.Dataset.from_tensor_slices((ids, y)).batch(16).repeat()


def weights(model):
    """Every weight of `model` by layer and index, tables as ``[V, D]`` in id order."""
    out = {}
    for layer in model.layers:
        if isinstance(layer, tf.keras.layers.Embedding):
            out[f"{layer.name}/embeddings"] = np.asarray(tf.convert_to_tensor(layer.embeddings))
        else:
            for i, w in enumerate(layer.get_weights()):
                out[f"{layer.name}/{i}"] = w
    return out


def main():
    mode, model_dir, out_dir = sys.argv[1:4]
    variant = sys.argv[4] if len(sys.argv) > 4 else "adam"
    tf_psplugin.start_server()
    strategy = tf_psplugin.HybridParameterServerStrategy(
        options=tf_psplugin.HybridOptions(stack_tables=(mode == "stacked")))
    tf.keras.utils.set_random_seed(0)
    subclassed = variant.startswith("subclassed")
    with strategy.scope():
        model = build_model("m", subclassed)
        target = build_model("t", subclassed)  # A second model in scope (a target network).
        ema = {"use_ema": True, "ema_momentum": 0.9, "ema_overwrite_frequency": 4}
        adam = MyAdam if variant == "custom" else tf.keras.optimizers.Adam
        model.compile(adam(0.05, **(ema if variant == "ema" else {})), loss="mse")
    if variant.endswith("build_slots"):
        tf_psplugin.build_optimizer_slots(model)
    # Each run sees its own data (the restart is not the first run again).
    seed = 1 + len(tf.io.gfile.glob(os.path.join(model_dir, "*.index")))
    model.fit(data(seed), epochs=1, steps_per_epoch=6, verbose=0,
              callbacks=[tf_psplugin.ChiefCheckpoint(model_dir)])
    found = weights(model)
    found.update(weights(target))
    np.savez(os.path.join(out_dir, "weights.npz"), **found)
    with open(os.path.join(out_dir, "placement.txt"), "w", encoding="utf-8") as f:
        f.write(strategy.placement_report())
    print("DONE", flush=True)


if __name__ == "__main__":
    main()
