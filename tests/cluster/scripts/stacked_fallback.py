"""Keras jobs whose stacks cannot be split before they are traced, stacked or unstacked.

Used by tests/cluster/test_stacked_fallback.py (issue 40 item 1: any
optimizer works on stacked tables, never an error). Arguments:
``<stacked|unstacked> <out_dir> <case>...``. Each case is one small job, as a
Keras user writes it, on its own models (each case its own table width, so
cases never share a stack): a model with two `Embedding` tables of one
width (40 rows; they share a stack) and a `Dense` head, trained with
`fit` on deterministic data, then:

* ``frozen_after``: the ``user`` table is frozen after the first `fit`
  (``layer.trainable = False``, compile again with the same Keras Adam)
  and the model trained on: the stack was traced whole, so Adam's one
  apply would move the frozen rows (their moments are nonzero).
* ``frozen_after_legacy``: the same with the legacy Keras Adam.
* ``second_model``: a second model sharing the ``user`` layer (a tower of
  the first) is compiled with its own Keras Adam and trained after the
  first: its apply updates the ``user`` table only, of a stack shared with
  ``item``. Then the first model trains on.
* ``custom_after``: after a first `fit` with Keras Adam, the model is
  compiled again with a user's own optimizer (a subclass of
  `tf.keras.optimizers.Optimizer` whose update is not elementwise: it
  scales each variable's step by the variable's RMS) and trained on.

It writes ``<out_dir>/<case>.npz``: every weight of the case's models
(tables as ``[V, D]`` in id order) and, for Keras's new optimizers, every
variable each optimizer lists (``opt<i>/<j>``), and prints ``DONE``.
"""

import os
import sys

import numpy as np
import tensorflow as tf

import tf_psplugin

V = 40
WIDTHS = {"frozen_after": 3, "frozen_after_legacy": 5, "second_model": 6, "custom_after": 7}


class RmsScaledSGD(tf.keras.optimizers.Optimizer):
    """A user's optimizer: SGD whose step is scaled by the variable's RMS (not elementwise)."""

    def __init__(self, learning_rate=0.05, name="RmsScaledSGD", **kwargs):
        super().__init__(name=name, **kwargs)
        self._learning_rate = self._build_learning_rate(learning_rate)

    def build(self, var_list):
        super().build(var_list)
        if hasattr(self, "_built") and self._built:
            return
        self._velocities = [self.add_variable_from_reference(v, "velocity") for v in var_list]
        self._built = True

    def update_step(self, gradient, variable):
        lr = tf.cast(self.learning_rate, variable.dtype)
        velocity = self._velocities[self._index_dict[self._var_key(variable)]]
        scale = tf.sqrt(tf.reduce_mean(tf.square(tf.convert_to_tensor(variable)))) + 0.1
        grad = tf.convert_to_tensor(gradient)
        velocity.assign(0.9 * velocity + grad)
        variable.assign_sub(lr * scale * velocity)

    def get_config(self):
        config = super().get_config()
        config.update({"learning_rate": self._serialize_hyperparameter(self._learning_rate)})
        return config


def two_tables(prefix, dim):
    ids = tf.keras.Input((2,), dtype="int64", name=f"{prefix}_ids")
    item = tf.keras.layers.Embedding(V, dim, name=f"{prefix}_item")
    user = tf.keras.layers.Embedding(V, dim, name=f"{prefix}_user")
    x = tf.keras.layers.Concatenate()([item(ids[:, 0]), user(ids[:, 1])])
    model = tf.keras.Model(ids, tf.keras.layers.Dense(1, name=f"{prefix}_dense")(x))
    return model, ids, user


def data(seed):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, V, (96, 2)).astype("int64")
    y = ((ids[:, :1] + 2 * ids[:, 1:]) % 3).astype("float32")
    return tf.data.Dataset.from_tensor_slices((ids, y)).batch(16).repeat()


def fit(model, seed, steps=3):
    model.fit(data(seed), epochs=1, steps_per_epoch=steps, verbose=0)


def weights(models, optimizers):
    out = {}
    for model in models:
        for layer in model.layers:
            if isinstance(layer, tf.keras.layers.Embedding):
                out[f"{layer.name}/embeddings"] = np.asarray(
                    tf.convert_to_tensor(layer.embeddings))
            else:
                for i, w in enumerate(layer.get_weights()):
                    out[f"{layer.name}/{i}"] = w
    for i, optimizer in enumerate(optimizers):
        if isinstance(optimizer, tf.keras.optimizers.Optimizer):
            for j, var in enumerate(optimizer.variables):
                out[f"opt{i}/{j}"] = np.asarray(tf.convert_to_tensor(var))
    return out


def run_case(case):
    dim = WIDTHS[case]
    tf.keras.utils.set_random_seed(dim)
    model, ids, user = two_tables(f"c{dim}", dim)
    adam = (tf.keras.optimizers.legacy.Adam(0.05) if case == "frozen_after_legacy"
            else tf.keras.optimizers.Adam(0.05))
    model.compile(adam, "mse")
    fit(model, 1)
    models, optimizers = [model], [adam]
    if case.startswith("frozen_after"):
        user.trainable = False
        model.compile(adam, "mse")
        fit(model, 2)
    elif case == "second_model":
        tower = tf.keras.Model(ids, tf.keras.layers.Dense(1, name=f"c{dim}_tower_dense")(
            user(ids[:, 1])))
        tower_adam = tf.keras.optimizers.Adam(0.02)
        tower.compile(tower_adam, "mse")
        fit(tower, 2)
        fit(model, 3, steps=2)
        models, optimizers = [model, tower], [adam, tower_adam]
    elif case == "custom_after":
        custom = RmsScaledSGD(0.05)
        model.compile(custom, "mse")
        fit(model, 2)
        optimizers = [adam, custom]
    return weights(models, optimizers)


def main():
    stacking, out_dir = sys.argv[1:3]
    tf_psplugin.start_server()
    strategy = tf_psplugin.HybridParameterServerStrategy(
        options=tf_psplugin.HybridOptions(stack_tables=(stacking == "stacked")))
    for case in sys.argv[3:]:
        with strategy.scope():
            found = run_case(case)
        np.savez(os.path.join(out_dir, f"{case}.npz"), **found)
        print("CASE", case, flush=True)
    with open(os.path.join(out_dir, "placement.txt"), "w", encoding="utf-8") as f:
        f.write(strategy.placement_report())
    print("DONE", flush=True)


if __name__ == "__main__":
    main()
