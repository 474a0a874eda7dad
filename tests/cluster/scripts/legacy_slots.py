"""What a Keras legacy optimizer shows of a two-table model, stacked or not (issue 40).

Used by tests/cluster/test_legacy_slots.py. ``<stacked|unstacked>
<out_dir>`` (a chief): for each legacy optimizer (Adagrad, Adam,
SGD(momentum), Ftrl), in turn, a fresh two-table model (both tables 4 wide:
one stack when stacked) is trained 4 steps with `fit`, and the script
records ``<out_dir>/<optimizer>.json`` (names, shapes, order) and
``<out_dir>/<optimizer>.npz`` (values) of: `optimizer.variables()`,
`weights`, `get_slot_names()`, `get_slot(var, name)` of every variable the
model lists, `get_weights()`, the final checkpoint's variables
(`ChiefCheckpointManager`, `tf.train.list_variables`); then
`set_weights` with fixed values, one more `fit` step, and again
`get_weights()` and the model's weights. Prints ``DONE`` at the end.
"""

import json
import os
import sys

import numpy as np
import tensorflow as tf

import tf_psplugin
# (this directory: the script's own path)
from slot_order_resume import build_model, data
from stacked_resume import weights as logical_weights

OPTIMIZERS = {
    "adagrad": lambda: tf.keras.optimizers.legacy.Adagrad(0.3),
    "adam": lambda: tf.keras.optimizers.legacy.Adam(0.05),
    "sgd_momentum": lambda: tf.keras.optimizers.legacy.SGD(0.1, momentum=0.5),
    "ftrl": lambda: tf.keras.optimizers.legacy.Ftrl(0.1),
}


def _record(prefix, variables, names, values):
    for i, var in enumerate(variables):
        names.append([f"{prefix}/{i}", var.name, var.shape.as_list()])
        values[f"{prefix}/{i}"] = np.asarray(tf.convert_to_tensor(var))


def run(strategy, name, out_dir):
    tf.keras.utils.set_random_seed(0)
    with strategy.scope():
        model = build_model()
        model.compile(OPTIMIZERS[name](), "mse")
    model.fit(data(1).repeat(), epochs=1, steps_per_epoch=4, verbose=0)
    optimizer = model.optimizer
    found, values = {}, {}
    found["variables"], found["weights"] = [], []
    _record("variables", optimizer.variables(), found["variables"], values)
    _record("weights", optimizer.weights, found["weights"], values)
    found["slot_names"] = list(optimizer.get_slot_names())
    found["model_variables"] = [[v.name, v.shape.as_list()] for v in model.trainable_variables]
    found["get_slot"] = []
    for i, var in enumerate(model.trainable_variables):
        for slot_name in optimizer.get_slot_names():
            slot = optimizer.get_slot(var, slot_name)
            key = f"get_slot/{i}/{slot_name}"
            found["get_slot"].append([key, slot.name, slot.shape.as_list()])
            values[key] = np.asarray(tf.convert_to_tensor(slot))
    for i, value in enumerate(optimizer.get_weights()):
        values[f"get_weights/{i}"] = value
    model_dir = os.path.join(out_dir, f"{name}_ckpt")
    tf_psplugin.ChiefCheckpointManager(model_dir, model=model, optimizer=optimizer).save(
        4, final=True)
    path = tf_psplugin.latest_checkpoint_info(model_dir).path
    found["checkpoint"] = sorted([key, list(shape)] for key, shape in tf.train.list_variables(path))
    reader = tf.train.load_checkpoint(path)
    for key, _ in found["checkpoint"]:
        if key != "_CHECKPOINTABLE_OBJECT_GRAPH":
            values[f"checkpoint/{key}"] = reader.get_tensor(key)
    # set_weights with fixed values (the same in both runs: same shapes), one more step.
    rng = np.random.default_rng(3)
    new = [np.asarray(rng.uniform(0.1, 1.0, size=np.shape(w)), dtype=np.asarray(w).dtype)
           if np.ndim(w) else w for w in optimizer.get_weights()]
    optimizer.set_weights(new)
    for i, value in enumerate(optimizer.get_weights()):
        values[f"set_weights/{i}"] = value
        values[f"set_weights_given/{i}"] = new[i]
    model.fit(data(99), epochs=1, steps_per_epoch=1, verbose=0)
    for i, value in enumerate(optimizer.get_weights()):
        values[f"stepped/{i}"] = value
    for key, value in logical_weights(model).items():
        values[f"model/{key}"] = value
    with open(os.path.join(out_dir, f"{name}.json"), "w", encoding="utf-8") as f:
        json.dump(found, f)
    np.savez(os.path.join(out_dir, f"{name}.npz"), **values)


def main():
    stacking, out_dir = sys.argv[1:3]
    tf_psplugin.start_server()
    strategy = tf_psplugin.HybridParameterServerStrategy(
        options=tf_psplugin.HybridOptions(stack_tables=stacking == "stacked"))
    for name in OPTIMIZERS:
        run(strategy, name, out_dir)
        print("RAN", name, flush=True)
    print("DONE", flush=True)


if __name__ == "__main__":
    main()
