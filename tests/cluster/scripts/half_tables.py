"""Chief script: tables stored in half precision (``HybridOptions.table_dtype``, issue 42).

Run by tests/cluster/test_half_tables.py and
tests/cluster/test_mixed_half_tables.py under a LocalCluster of 2 workers
and 2 PS. Arguments: ``<mode> <table_dtype|none>[+<policy>] <model_dir>
<out_dir> [<target_dir>]``; ``+mixed_bfloat16`` / ``+mixed_float16``: the
trained model is built and compiled under that Keras policy (its output
layer in float32, as Keras's guide says; `compile` wraps the optimizer in a
`LossScaleOptimizer` under ``mixed_float16``), the single-process reference
too; the plain model the checkpoint loads into and the export stay float32.
Modes:

* ``train``: fits a two-table functional model (Keras Adagrad, lr 0.1) for
  12 steps with ``ChiefCheckpoint(save_every_steps=4, full_every_saves=4)`` (a
  full checkpoint, then deltas), and compares it with single-process
  training on the global batch that rounds as the PS does (`emulate`) and
  with float32 training. Then the checkpoint chain is loaded into a plain
  float32 model (`load_into`, optimizer included), exported
  (`export_from_checkpoint`) and served (`ServingModel`), which follows a
  delta written by 4 more steps. Writes ``report.json`` and ``weights.npz``.
  With a policy it also saves the step-12 state in one full checkpoint
  (``<out_dir>/full``, loaded into a plain model beside the chain) and
  copies the model dir at step 12 to ``<out_dir>/restart`` for ``resume``.
* ``resume``: a new chief restarts from ``<model_dir>`` (a copy of a
  ``train`` run's model dir at step 12) with ``ChiefCheckpoint`` and trains
  the same 4 more steps; writes ``weights.npz`` and ``optimizer.npz``.
* ``convert``: a strategy with `table_dtype` restores the latest checkpoint
  of `model_dir` (`ChiefCheckpointManager.restore`, full and deltas), writes the
  restored weights and slots to ``restored.npz``, trains 4 steps, saves
  into `target_dir` and writes ``weights.npz`` (the trained weights).
"""

import json
import os
import shutil
import sys

import numpy as np
import tensorflow as tf

import tf_psplugin
from traced_graphs import traced_graphs

STEPS, BATCH, VOCAB, VOCAB2, DIM, FEATURES, LR = 12, 8, 50, 30, 4, 3, 0.1
TABLES = ("table_a", "table_b")


def make_model():
    inp = tf.keras.Input((FEATURES,), dtype="int64")
    x = tf.keras.layers.Embedding(
        VOCAB, DIM, embeddings_initializer=tf.keras.initializers.RandomUniform(seed=1),
        name="table_a")(inp)
    y = tf.keras.layers.Embedding(
        VOCAB2, DIM, embeddings_initializer=tf.keras.initializers.RandomUniform(seed=4),
        name="table_b")(tf.keras.layers.Lambda(lambda t: t % VOCAB2)(inp))
    x = tf.keras.layers.Concatenate()([tf.keras.layers.Flatten()(x), tf.keras.layers.Flatten()(y)])
    x = tf.keras.layers.Dense(8, activation="tanh", name="hidden",
                              kernel_initializer=tf.keras.initializers.GlorotUniform(seed=2))(x)
    out = tf.keras.layers.Dense(1, name="out", dtype="float32",  # (float32 under a policy)
                                kernel_initializer=tf.keras.initializers.GlorotUniform(seed=3))(x)
    return tf.keras.Model(inp, out)


class Policy:
    """Builds models and optimizers under a Keras policy (None: float32), then sets it back."""

    def __init__(self, name):
        self.name = name

    def __enter__(self):
        self.before = tf.keras.mixed_precision.global_policy()
        if self.name:
            tf.keras.mixed_precision.set_global_policy(self.name)

    def __exit__(self, *exc):
        tf.keras.mixed_precision.set_global_policy(self.before)


def data(num_workers, steps, seed):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, VOCAB, size=(steps * num_workers * BATCH, FEATURES)).astype("int64")
    y = rng.normal(size=(steps * num_workers * BATCH, 1)).astype("float32")
    return ids, y


def weights(model):
    """Every weight by layer, tables as float32 ``[V, D]`` in id order."""
    out = {}
    for layer in model.layers:
        if isinstance(layer, tf.keras.layers.Embedding):  # (Keras lists a table's shards.)
            out[f"{layer.name}/0"] = np.asarray(
                tf.cast(tf.convert_to_tensor(layer.embeddings), tf.float32))
            continue
        for i, w in enumerate(layer.weights):
            out[f"{layer.name}/{i}"] = w.numpy()
    return out


def round_to(value, dtype):
    return tf.cast(tf.cast(value, dtype), tf.float32)


def emulate(init, ids, y, num_workers, table_dtype, policy=None):
    """Single-process training on the global batch, rounding as the PS does.

    The tables' rows are `table_dtype` values kept in float32 variables; the
    gradient of each looked-up row is rounded to `table_dtype` (the workers
    send it in the table's dtype) and the rows of one id summed in float32
    (as on the PS), the Adagrad update is computed in float32 with float32
    accumulators (starting at 0.1 rounded, as Keras makes them in the
    variable's dtype) and the new rows are rounded. None: plain float32.
    `policy`: the model computes under that Keras policy; ``mixed_float16``
    scales the loss with Keras's `LossScaleOptimizer` (which applies the
    dense update), the table gradients unscaled as the workers do. Returns
    (weights, the number of steps with a non-finite gradient).
    """
    with Policy(policy):
        model = make_model()
        optimizer = tf.keras.optimizers.Adagrad(LR)
        if policy == "mixed_float16":
            optimizer = tf.keras.mixed_precision.LossScaleOptimizer(optimizer)
    model.set_weights([init[k] for k in weights(model)])
    tables = [model.get_layer(n).embeddings for n in TABLES]
    dense = [v for v in model.trainable_variables if all(v is not t for t in tables)]
    scaled = policy == "mixed_float16"
    overflows = 0
    start = 0.1 if table_dtype is None else float(round_to(0.1, table_dtype))
    accumulators = [np.full(t.shape, start, np.float32) for t in tables]
    global_batch = BATCH * num_workers
    for step in range(len(ids) // global_batch):
        x = ids[step * global_batch:(step + 1) * global_batch]
        target = y[step * global_batch:(step + 1) * global_batch]
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x) - target))
            if scaled:
                loss = optimizer.get_scaled_loss(loss)
        grads = tape.gradient(loss, tables + dense)
        if scaled:
            grads = optimizer.get_unscaled_gradients(grads)
        if not all(np.isfinite(tf.convert_to_tensor(g).numpy()).all() for g in grads):
            overflows += 1  # (The strategy would skip the step; the test expects none.)
        optimizer.apply_gradients(zip(grads[len(tables):], dense))
        for table, grad, acc in zip(tables, grads[:len(tables)], accumulators):
            if table_dtype is not None:  # Each looked-up row's gradient, as sent.
                grad = tf.IndexedSlices(round_to(grad.values, table_dtype), grad.indices,
                                        grad.dense_shape)
            g = tf.convert_to_tensor(grad).numpy()  # Duplicate ids summed in float32.
            acc += g * g
            new = table.numpy() + (-LR * g / np.sqrt(acc + 1e-7)).astype(np.float32)
            table.assign(new if table_dtype is None else round_to(new, table_dtype))
    return weights(model), overflows


def committed(model_dir):
    """Names of the committed checkpoints, full and deltas."""
    return sorted(os.path.basename(p)[:-len(".commit")]
                  for p in tf.io.gfile.glob(os.path.join(model_dir, "*.commit")))


def optimizer_values(model):
    """The optimizer's variables in order (its step, then each slot), with their dtypes."""
    out = {}
    for i, v in enumerate(model.optimizer.variables):
        value = tf.convert_to_tensor(v)
        out[f"{i}:{value.dtype.name}"] = value.numpy()
    return out


def lookup_gather_dtypes(model):
    """dtypes of the traced step's gathers on the PS tasks (lookups and slot reads)."""
    found = set()
    for graph in traced_graphs(model):
        for op in graph.get_operations():
            if op.type == "ResourceGather" and "/job:ps" in op.device:
                found.add(op.get_attr("dtype").name)
    return sorted(found)


def ps_variables(strategy):
    """Placement records of the tables and their slots: dtype and bytes."""
    return [{"name": r.name, "kind": r.kind, "dtype": r.dtype, "num_bytes": r.num_bytes,
             "shape": list(r.shape)}
            for r in strategy.placement_records() if r.kind.startswith("table")]


def shard_dtypes(model):
    return sorted({v.dtype.name for n in TABLES for v in model.get_layer(n).embeddings.variables})


def compiled_model(strategy, policy):
    """The trained model, built and compiled in `strategy`'s scope under `policy`."""
    with Policy(policy), strategy.scope():
        model = make_model()
        model.compile(tf.keras.optimizers.Adagrad(LR), "mse")
    return model


def loss_scale(model):
    """The dynamic loss scale and its counter ([] without loss scaling)."""
    optimizer = model.optimizer
    if not hasattr(optimizer, "dynamic_counter"):
        return []
    return [float(tf.convert_to_tensor(optimizer.loss_scale)),
            float(tf.convert_to_tensor(optimizer.dynamic_counter))]


def _job(table_dtype, policy, model_dir):
    """What `train` and `resume` share: the strategy, the data, the model and its checkpoints."""
    strategy = tf_psplugin.HybridParameterServerStrategy(
        options=tf_psplugin.HybridOptions(table_dtype=table_dtype))
    num_workers = strategy.num_replicas_in_sync
    ids, y = data(num_workers, STEPS + 4, seed=0)
    model = compiled_model(strategy, policy)
    first = STEPS * num_workers * BATCH
    callback = tf_psplugin.ChiefCheckpoint(model_dir, save_every_steps=4, full_every_saves=4)
    return strategy, num_workers, ids, y, model, first, callback


def train(table_dtype, policy, model_dir, out_dir):
    strategy, num_workers, ids, y, model, first, callback = _job(table_dtype, policy, model_dir)
    init = weights(model)
    model.fit(tf.data.Dataset.from_tensor_slices((ids[:first], y[:first])).batch(BATCH),
              epochs=1, steps_per_epoch=STEPS, verbose=0, callbacks=[callback])
    got = weights(model)
    report = {"shard_dtypes": shard_dtypes(model), "ps_variables": ps_variables(strategy),
              "gather_dtypes": lookup_gather_dtypes(model),
              "checkpoints": committed(model_dir), "loss_scale": loss_scale(model)}
    emulated, report["emulated_overflows"] = emulate(init, ids[:first], y[:first], num_workers,
                                                     table_dtype, policy)
    float32, _ = emulate(init, ids[:first], y[:first], num_workers, None)
    report["vs_emulated"] = {k: float(np.abs(got[k] - emulated[k]).max()) for k in got}
    report["vs_float32"] = {k: float(np.abs(got[k] - float32[k]).max()) for k in got}
    report["max_abs"] = {k: float(np.abs(got[k]).max()) for k in got}
    if policy:
        full_and_restart_copy(model, model_dir, out_dir, got, report)

    # The checkpoint chain (full + deltas) in a plain float32 model. (Without
    # the optimizer: Keras's new optimizers save a table's slots per shard,
    # which restore into a strategy of as many PS tasks: `convert` checks them.)
    plain = make_model()
    info = tf_psplugin.load_into(plain, model_dir)
    report["loaded_step"] = info.step
    loaded = weights(plain)
    report["loaded_dtypes"] = sorted({w.dtype.name for w in plain.weights})
    report["loaded_vs_trained"] = {k: float(np.abs(loaded[k] - got[k]).max()) for k in got}
    # The tables load as their half-precision values, upcast: rounding changes nothing.
    report["loaded_tables_unrounded"] = {
        k: float(np.abs(loaded[k] - round_to(loaded[k], table_dtype)).max())
        for k in (f"{n}/0" for n in TABLES)} if table_dtype else {}

    # Export for serving, then follow a delta of 4 more steps.
    export_dir = os.path.join(out_dir, "export")
    tf_psplugin.export_from_checkpoint(make_model, model_dir, export_dir)
    serving = tf_psplugin.ServingModel(export_dir, model_dir=model_dir)
    rest = tf.data.Dataset.from_tensor_slices((ids[first:], y[first:])).batch(BATCH)
    model.fit(rest, epochs=1, steps_per_epoch=4, verbose=0, callbacks=[callback])
    serving.poll()
    later = weights(model)
    report["loss_scale_after"] = loss_scale(model)
    probe = ids[:64]
    plain_now = make_model()
    plain_now.set_weights([later[k] for k in weights(plain_now)])
    report["serving_step"] = int(serving.step)
    report["serving_vs_trained"] = float(np.abs(
        np.asarray(serving(tf.constant(probe))) - plain_now(probe).numpy()).max())
    report["checkpoints_after"] = committed(model_dir)
    np.savez(os.path.join(out_dir, "weights.npz"), **later)
    np.savez(os.path.join(out_dir, "optimizer.npz"), **optimizer_values(model))
    with open(os.path.join(out_dir, "report.json"), "w", encoding="utf-8") as f:
        json.dump(report, f)


def full_and_restart_copy(model, model_dir, out_dir, got, report):
    """At step 12: one full checkpoint of the state, loaded beside the chain; a restart copy.

    ``full_vs_chain``: a plain float32 model loading the chain (full + deltas)
    against one loading the full checkpoint, per weight (bit for bit is 0.0).
    """
    full_dir = os.path.join(out_dir, "full")
    step = int(model.optimizer.iterations.numpy())
    tf_psplugin.ChiefCheckpointManager(full_dir, model=model, optimizer=model.optimizer).save(
        step, final=True)
    chain, full = make_model(), make_model()
    report["chain_step"] = tf_psplugin.load_into(chain, model_dir).step
    report["full_step"] = tf_psplugin.load_into(full, full_dir).step
    chain, full = weights(chain), weights(full)
    report["full_vs_chain"] = {k: float(np.abs(chain[k] - full[k]).max()) for k in got}
    # The restart's model dir: this job's checkpoints as they stand at step 12.
    shutil.copytree(model_dir, os.path.join(out_dir, "restart"))


def resume(table_dtype, policy, model_dir, out_dir):
    """Restarts a `train` job from its step-12 copy; trains its last 4 steps (a new chief)."""
    _, _, ids, y, model, first, callback = _job(table_dtype, policy, model_dir)
    rest = tf.data.Dataset.from_tensor_slices((ids[first:], y[first:])).batch(BATCH)
    model.fit(rest, epochs=1, steps_per_epoch=4, verbose=0, callbacks=[callback])
    np.savez(os.path.join(out_dir, "weights.npz"), **weights(model))
    np.savez(os.path.join(out_dir, "optimizer.npz"), **optimizer_values(model))
    with open(os.path.join(out_dir, "report.json"), "w", encoding="utf-8") as f:
        json.dump({"step": int(model.optimizer.iterations.numpy()),
                   "loss_scale_after": loss_scale(model)}, f)


def convert(table_dtype, model_dir, out_dir, target_dir):
    strategy = tf_psplugin.HybridParameterServerStrategy(
        options=tf_psplugin.HybridOptions(table_dtype=table_dtype))
    num_workers = strategy.num_replicas_in_sync
    with strategy.scope():
        model = make_model()
        model.compile(tf.keras.optimizers.Adagrad(LR), "mse")
    # As the job that wrote it (full_every: each table in a stack of its own).
    manager = tf_psplugin.ChiefCheckpointManager(model_dir, model=model, optimizer=model.optimizer,
                                                 full_every_saves=4)
    info = manager.restore()
    restored = weights(model)
    np.savez(os.path.join(out_dir, "restored.npz"), **restored)
    np.savez(os.path.join(out_dir, "restored_optimizer.npz"), **optimizer_values(model))
    ids, y = data(num_workers, 4, seed=7)
    model.fit(tf.data.Dataset.from_tensor_slices((ids, y)).batch(BATCH), epochs=1,
              steps_per_epoch=4, verbose=0)
    tf_psplugin.ChiefCheckpointManager(target_dir, model=model, optimizer=model.optimizer).save(
        info.step + 4, final=True)
    np.savez(os.path.join(out_dir, "weights.npz"), **weights(model))
    with open(os.path.join(out_dir, "report.json"), "w", encoding="utf-8") as f:
        json.dump({"restored_step": info.step, "shard_dtypes": shard_dtypes(model),
                   "ps_variables": ps_variables(strategy)}, f)


def main():
    mode, table_dtype, model_dir, out_dir = sys.argv[1:5]
    table_dtype, _, policy = table_dtype.partition("+")
    table_dtype = None if table_dtype == "none" else table_dtype
    tf_psplugin.start_server()
    if mode == "train":
        train(table_dtype, policy or None, model_dir, out_dir)
    elif mode == "resume":
        resume(table_dtype, policy or None, model_dir, out_dir)
    else:
        convert(table_dtype, model_dir, out_dir, sys.argv[5])
    print("DONE", flush=True)


if __name__ == "__main__":
    main()
