"""Keras's new optimizers' table slots restored into another PS count, stacking and a plain model.

Used by tests/cluster/test_slot_order.py (issue 40). Modes:

* ``train <stacked|unstacked> <optimizer> <model_dir>`` (a chief): trains
  a two-table model 4 steps with `ChiefCheckpoint(model_dir)`, which
  writes the final checkpoint.
* ``resume <stacked|unstacked> <optimizer> <source_dir> <restored_dir>
  <stepped_dir> <out_dir>`` (a chief, any PS count): restores the latest
  checkpoint of `source_dir` (`ChiefCheckpointManager.restore`), saves it
  at once to `restored_dir`, trains one step on a fixed batch, saves to
  `stepped_dir`, and writes the logical weights to ``<out_dir>/weights.npz``.
* ``plain <optimizer> <source_dir> <out_dir>`` (no cluster): the same
  steps in a plain single-process model that `load_into(...,
  include_optimizer=True)` filled; checkpoints ``<out_dir>/restored`` and
  ``<out_dir>/stepped`` (`tf.train.Checkpoint(model=, optimizer=)`: the
  same keys), weights ``<out_dir>/weights.npz``.
* ``compare <a> <b> ...`` (no cluster): for each pair of checkpoint
  prefixes or model directories, the largest difference of the model's and
  optimizer's tensors under their common keys, and the keys only one of
  them has (the format marker and the manager's own state aside); prints
  one JSON line ``RESULT {...}``.

Each prints ``DONE`` at the end.
"""

import json
import os
import sys

import numpy as np
import tensorflow as tf

import tf_psplugin
from stacked_resume import weights as logical_weights  # (this directory: the script's own path)

V, DIM = 37, 4
OPTIMIZERS = {"adagrad": lambda: tf.keras.optimizers.Adagrad(0.3),
              "adam": lambda: tf.keras.optimizers.Adam(0.05)}


def build_model():
    ids = tf.keras.Input((2,), dtype="int64", name="ids")
    item = tf.keras.layers.Embedding(V, DIM, name="item")(ids[:, 0])
    user = tf.keras.layers.Embedding(V + 6, DIM, name="user")(ids[:, 1])
    x = tf.keras.layers.Concatenate()([item, user])
    x = tf.keras.layers.Dense(3, activation="tanh", name="hidden")(x)
    return tf.keras.Model(ids, tf.keras.layers.Dense(1, name="out")(x))


def data(seed, n=64):
    rng = np.random.default_rng(seed)
    ids = np.stack([rng.integers(0, V, n), rng.integers(0, V + 6, n)], axis=1).astype("int64")
    y = rng.normal(size=(n, 1)).astype("float32")
    return tf.data.Dataset.from_tensor_slices((ids, y)).batch(16)


def latest(path):
    return tf_psplugin.latest_checkpoint_info(path).path if os.path.isdir(path) else path


def tensors(path):
    reader = tf.train.load_checkpoint(latest(path))
    return {k: reader.get_tensor(k) for k in reader.get_variable_to_shape_map()
            if k.startswith(("model/", "optimizer/")) and "tf_psplugin_slot_order" not in k}


def compare(paths):
    out = []
    for a, b in zip(paths[::2], paths[1::2]):
        ta, tb = tensors(a), tensors(b)
        common = sorted(set(ta) & set(tb))
        diff = max(float(np.abs(ta[k].astype("float64") - tb[k].astype("float64")).max())
                   for k in common)
        slots = [k for k in common if k.startswith("optimizer/_variables/")
                 and ta[k].shape[:1] in ((V,), (V + 6,))]
        out.append({"diff": diff, "only": sorted(set(ta) ^ set(tb)), "table_slots": len(slots),
                    "shapes_equal": all(ta[k].shape == tb[k].shape for k in common)})
    print("RESULT " + json.dumps(out), flush=True)


def main():
    mode = sys.argv[1]
    if mode == "compare":
        compare(sys.argv[2:])
        print("DONE", flush=True)
        return
    if mode == "plain":
        name, source, out_dir = sys.argv[2:5]
        model = build_model()
        model.compile(OPTIMIZERS[name](), "mse")
        tf_psplugin.load_into(model, source, include_optimizer=True)
        root = tf.train.Checkpoint(model=model, optimizer=model.optimizer)
        root.write(os.path.join(out_dir, "restored"))
        model.fit(data(99), epochs=1, steps_per_epoch=1, verbose=0)
        root.write(os.path.join(out_dir, "stepped"))
        np.savez(os.path.join(out_dir, "weights.npz"), **logical_weights(model))
        print("DONE", flush=True)
        return
    tf_psplugin.start_server()
    strategy = tf_psplugin.HybridParameterServerStrategy(
        options=tf_psplugin.HybridOptions(stack_tables=sys.argv[2] == "stacked"))
    tf.keras.utils.set_random_seed(0)
    with strategy.scope():
        model = build_model()
        model.compile(OPTIMIZERS[sys.argv[3]](), "mse")
    if mode == "train":
        model.fit(data(1).repeat(), epochs=1, steps_per_epoch=4, verbose=0,
                  callbacks=[tf_psplugin.ChiefCheckpoint(sys.argv[4])])
    else:
        source, restored, stepped, out_dir = sys.argv[4:8]
        info = tf_psplugin.ChiefCheckpointManager(
            source, model=model, optimizer=model.optimizer).restore()
        tf_psplugin.ChiefCheckpointManager(
            restored, model=model, optimizer=model.optimizer).save(info.step, final=True)
        model.fit(data(99), epochs=1, steps_per_epoch=1, verbose=0)
        tf_psplugin.ChiefCheckpointManager(
            stepped, model=model, optimizer=model.optimizer).save(info.step + 1, final=True)
        np.savez(os.path.join(out_dir, "weights.npz"), **logical_weights(model))
    print("DONE", flush=True)


if __name__ == "__main__":
    main()
