"""Chief script of the composition suite: one Keras job per cell, stacked or unstacked.

Used by tests/cluster/test_composition.py (issue 40 item 3) and
tests/cluster/test_half_tables.py (issue 42). Arguments:
``<stacked|unstacked>[+<table_dtype>][+wire_<dtype>] <root> <run|resume> <cell>...``, a cell
being ``<optimizer>.<mode>.<situation>[+<policy>]`` (the names in
`OPTIMIZERS`, `MODES`, `SITUATIONS`; ``+bfloat16`` / ``+float16``: the
strategy stores the tables in that dtype, ``HybridOptions.table_dtype``;
``+wire_bfloat16``: the dense gradients are all-reduced in bfloat16,
``HybridOptions.dense_allreduce_dtype``; ``+buckets_<bytes>``: in buckets of
about that many bytes, ``HybridOptions.dense_bucket_bytes``, what the
default chooses on workers of several hosts;
``+mixed_float16`` / ``+mixed_bfloat16``: the cell's models are built and
compiled under that Keras policy). Every cell is the same small job, as a Keras user writes it:
a model with three `Embedding` tables (40 rows of one width, so they share
a stack; each cell has a width of its own, so cells never share one)
and a `Dense` head, trained 2 epochs x 4 steps on deterministic data (8
batches, repeated; with W workers the strategy gives worker i batches i,
i+W, ..., so a step reads W consecutive batches), plus what its mode and
situation add:

Modes:

* ``fit``: `ChiefCheckpoint(save_every_steps=4)`.
* ``kill``: the same job killed after its step-4 checkpoint and restarted.
  Phase ``run`` trains an uninterrupted copy (model dir ``ref``), then runs
  the job again in ``model`` and kills it at step 6: the last kill cell of
  the process with a real SIGKILL of this chief, the others by an exception
  out of `fit` (the fit stops where it is: no final checkpoint). Phase
  ``resume`` (a new chief process) restarts each killed job as the
  docs/checkpoints.md recipe does: restore at train begin, the data from
  the checkpoint's input position (``latest_checkpoint_info(...)
  .input_position``: the batches consumed by then, steps x workers, so the
  restart reads what the uninterrupted job read next on any number of
  workers), ``initial_epoch`` from its step.
* ``full_every``: `ChiefCheckpoint(save_every_steps=2, full_every_saves=3)`
  (ckpt-2, deltas 4 and 6, ckpt-8); the chain is then restored into a new
  model, which must equal the live one bit for bit (``restore_diff``).
* ``export``: after `fit`, `export_saved_model` and a `ServingModel`
  following the model dir; its scores for fixed ids must equal the scores
  computed in numpy from the live weights (``serving_diff``).

Situations:

* ``frozen``: the user table is built with ``trainable=False``.
* ``second_model``: a second model (a target network) built in the same
  scope, never trained; its weights are compared too.
* ``subclassed``: the model is a `tf.keras.Model` subclass.
* ``ema``: the optimizer has ``use_ema=True`` (overwrite every 3 steps and
  at the end of `fit`).
* ``subclassed_second`` (outside the matrix: a known gap): a subclassed
  model and a second one of the same class in scope.
* ``early_stop``: `EarlyStopping(monitor="loss", mode="max", patience=1,
  restore_best_weights=True)`: the loss falls, so epoch 1 stays the best and
  its weights are set back at the end of epoch 2 (`set_weights` on tables).

For each cell it writes ``<root>/<stacking>/<cell>/result.json``: ``status``
``ok`` or ``refused`` (``error``: the exception's type and message,
``step``: the optimizer's iterations when it was raised), the mode's own
differences (a resumed kill cell: ``resumed_from``, the checkpoint's step,
and ``input_position``, the batches its dataset skipped), ``tables`` (each table of the cell's models as placed: name,
dtype, stack), and ``weights.npz`` (every weight of the models in the cell,
tables as ``[V, D]`` in id order, and every tensor of the final checkpoint
under ``ckpt/<key>``; ``resumed.npz`` / ``ref.npz`` for kill cells).
"""

import json
import os
import signal
import sys
import time

import numpy as np
import tensorflow as tf

import tf_psplugin
from stacked_resume import weights as layer_weights  # tests/cluster/scripts/stacked_resume.py

V, BATCH, STEPS, EPOCHS = 40, 16, 4, 2
KILL_AT = 6  # After the step-4 checkpoint, before the end of epoch 2.
SERVE_IDS = np.array([[i % V, (7 * i) % V, (3 * i + 1) % V] for i in range(12)], "int64")

OPTIMIZERS = {
    "adagrad": lambda **kw: tf.keras.optimizers.Adagrad(0.1, **kw),
    "adam": lambda **kw: tf.keras.optimizers.Adam(0.05, **kw),
    "sgd": lambda **kw: tf.keras.optimizers.SGD(0.1, momentum=0.5, **kw),
    "ftrl": lambda **kw: tf.keras.optimizers.Ftrl(0.1, **kw),
    "legacy_adagrad": lambda **kw: tf.keras.optimizers.legacy.Adagrad(0.1, **kw),
}
MODES = ("fit", "kill", "full_every", "export")
SITUATIONS = ("frozen", "second_model", "subclassed", "ema", "early_stop")


class Killed(Exception):
    """Ends a kill cell's first fit where it stands (no final checkpoint)."""


class Tower(tf.keras.Model):
    """The subclassed form of `functional_model`: three tables and a head."""

    def __init__(self, prefix, dim, frozen_user=False):
        super().__init__(name=f"{prefix}_model")
        self.item = tf.keras.layers.Embedding(V, dim, name=f"{prefix}_item")
        self.user = tf.keras.layers.Embedding(V, dim, trainable=not frozen_user,
                                              name=f"{prefix}_user")
        self.ctx = tf.keras.layers.Embedding(V, dim, name=f"{prefix}_ctx")
        self.head = tf.keras.layers.Dense(1, name=f"{prefix}_dense")

    def call(self, ids):
        return self.head(tf.concat(
            [self.item(ids[:, 0]), self.user(ids[:, 1]), self.ctx(ids[:, 2])], axis=1))


def functional_model(prefix, dim, frozen_user=False):
    ids = tf.keras.Input((3,), dtype="int64", name=f"{prefix}_ids")
    item = tf.keras.layers.Embedding(V, dim, name=f"{prefix}_item")(ids[:, 0])
    user = tf.keras.layers.Embedding(V, dim, trainable=not frozen_user,
                                     name=f"{prefix}_user")(ids[:, 1])
    ctx = tf.keras.layers.Embedding(V, dim, name=f"{prefix}_ctx")(ids[:, 2])
    x = tf.keras.layers.Concatenate()([item, user, ctx])
    return tf.keras.Model(ids, tf.keras.layers.Dense(1, name=f"{prefix}_dense")(x))


def builder(prefix, dim, situation):
    """A function building the cell's trained model (also the export's `model_fn`)."""
    def build():
        tf.keras.utils.set_random_seed(7)
        if situation.startswith("subclassed"):
            model = Tower(prefix, dim)
            model(tf.zeros([1, 3], tf.int64))  # Built eagerly, as `Input` builds a functional one.
            return model
        return functional_model(prefix, dim, frozen_user=(situation == "frozen"))
    return build


def dataset(offset_batches=0):
    rng = np.random.default_rng(3)
    ids = rng.integers(0, V, (BATCH * STEPS * EPOCHS, 3)).astype("int64")
    y = ((ids[:, :1] + ids[:, 2:]) % 3).astype("float32")
    data = tf.data.Dataset.from_tensor_slices((ids, y)).batch(BATCH)
    return data.repeat().skip(offset_batches)


def checkpoint_tensors(model_dir):
    """Every tensor of the latest checkpoint, keyed ``ckpt/<key>`` (tables, slots, dense)."""
    info = tf_psplugin.latest_checkpoint_info(model_dir)
    reader = tf.train.load_checkpoint(info.path)
    return {f"ckpt/{key}": reader.get_tensor(key)
            for key in reader.get_variable_to_shape_map()
            if not key.startswith("_CHECKPOINTABLE_OBJECT_GRAPH")}


def numpy_scores(weights, prefix):
    """The model's scores for `SERVE_IDS`, from its weights in numpy."""
    x = np.concatenate([weights[f"{prefix}_{t}/embeddings"][SERVE_IDS[:, i]]
                        for i, t in enumerate(("item", "user", "ctx"))], axis=1)
    return x @ weights[f"{prefix}_dense/0"] + weights[f"{prefix}_dense/1"]


class KillAt(tf.keras.callbacks.Callback):
    """Kills the job at step `KILL_AT` (SIGKILL of this process, or `Killed`)."""

    def __init__(self, hard):
        super().__init__()
        self._supports_tf_logs = True  # Batch hook under PSS: logs are RemoteValues.
        self.hard = hard

    def on_train_batch_end(self, batch, logs=None):
        if int(self.model.optimizer.iterations.numpy()) >= KILL_AT:
            if self.hard:
                print("KILLING chief", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            raise Killed(f"killed at step {KILL_AT}")


class Cell:
    """One cell's job; `train` runs it in a model dir, returns the models' weights."""

    def __init__(self, strategy, cell, index):
        self.strategy, self.name = strategy, cell
        self.optimizer, self.mode, situation = cell.split(".")
        self.situation, _, self.policy = situation.partition("+")
        self.first_record = len(strategy.placement_records())  # Its tables' come after.
        self.prefix = f"c{index}"
        # A row width of its own: no table of another cell (an earlier job of
        # this process) ever shares a stack with this cell's tables.
        self.dim = 2 + index

    def make(self, tag):
        """Builds and compiles the cell's model(s) in scope; returns (model, others)."""
        prefix = f"{self.prefix}{tag}"
        ema = ({"use_ema": True, "ema_momentum": 0.9, "ema_overwrite_frequency": 3}
               if self.situation == "ema" else {})
        before = tf.keras.mixed_precision.global_policy()
        if self.policy:  # Layers and compile's LossScaleOptimizer take it when made.
            tf.keras.mixed_precision.set_global_policy(self.policy)
        try:
            with self.strategy.scope():
                model = builder(prefix, self.dim, self.situation)()
                others = []
                if self.situation == "second_model":
                    others.append(functional_model(prefix + "t", self.dim))  # A target network.
                if self.situation == "subclassed_second":
                    others.append(builder(prefix + "t", self.dim, self.situation)())
                model.compile(OPTIMIZERS[self.optimizer](**ema), loss="mse")
        finally:
            tf.keras.mixed_precision.set_global_policy(before)
        return model, others

    def tables(self):
        """The cell's tables as placed (every copy: name, dtype, stack)."""
        return [{"name": r.name, "dtype": r.dtype, "stack": r.stack}
                for r in self.strategy.placement_records()[self.first_record:]
                if r.kind == "table"]

    def train(self, model_dir, tag="", kill=None):
        """Runs the job in `model_dir` (resuming what it holds); returns its weights."""
        model, others = self.make(tag)
        self.model = model
        every = 2 if self.mode == "full_every" else STEPS
        callbacks = [tf_psplugin.ChiefCheckpoint(
            model_dir, save_every_steps=every,
            full_every_saves=3 if self.mode == "full_every" else None)]
        if self.situation == "early_stop":
            callbacks.append(tf.keras.callbacks.EarlyStopping(
                monitor="loss", mode="max", patience=1, restore_best_weights=True))
        if kill is not None:
            callbacks.append(KillAt(hard=kill))
        info = tf_psplugin.latest_checkpoint_info(model_dir)
        step = info.step if info else 0
        # The batches the checkpointed job consumed: one per worker per step
        # (the step alone is one worker's count).
        offset = info.input_position if info else 0
        model.fit(dataset(offset), epochs=EPOCHS, initial_epoch=step // STEPS,
                  steps_per_epoch=STEPS, verbose=0, callbacks=callbacks)
        weights = layer_weights(model)
        for other in others:
            weights.update(layer_weights(other))
        weights = untagged(weights, self.prefix, tag)
        weights.update(checkpoint_tensors(model_dir))
        return model, {key: widened(value) for key, value in weights.items()}


def restore_diff(cell, model_dir, live):
    """Restores `model_dir`'s chain into a new model; max abs diff to `live`'s weights.

    The manager has the job's own ``full_every``, as the job's restart has:
    with stacking, Keras's new optimizers' slots restore only into the same
    stacks (docs/composition.md, "Known gaps"), and ``full_every`` gives each
    table a stack of its own.
    """
    model, _ = cell.make("r")
    tf_psplugin.ChiefCheckpointManager(model_dir, model=model, optimizer=model.optimizer,
                                       full_every_saves=3).restore()
    restored = untagged(layer_weights(model), cell.prefix, "r")
    return max(float(np.max(np.abs(widened(restored[key]) - widened(value))))
               for key, value in layer_weights(live).items())


def widened(value):
    """`value` as a numpy array, bfloat16 ones as float32 (exact; np.savez cannot store them)."""
    value = np.asarray(value)
    return value.astype(np.float32) if value.dtype.name == "bfloat16" else value


def untagged(weights, prefix, tag):
    """`weights` with the layer names of the copy `tag` renamed to the cell's own."""
    return {key.replace(f"{prefix}{tag}", prefix, 1) if tag else key: value
            for key, value in weights.items()}


def serving_diff(cell, model, weights, export_dir, model_dir):
    """Exports `model`, serves it following `model_dir`; returns (scores, diff to numpy)."""
    tf_psplugin.export_saved_model(model, export_dir, model_fn=builder(
        cell.prefix, cell.dim, cell.situation))
    serving = tf_psplugin.ServingModel(export_dir, model_dir=model_dir)
    serving.poll()
    scores = np.asarray(serving(tf.constant(SERVE_IDS)))
    return scores, float(np.max(np.abs(scores - numpy_scores(weights, cell.prefix))))


def run_cell(strategy, root, phase, cell_name, index, hard_kill):
    cell = Cell(strategy, cell_name, index)
    out = os.path.join(root, cell_name)
    os.makedirs(out, exist_ok=True)
    result, start = {"status": "ok"}, time.monotonic()
    try:
        if cell.mode == "kill" and phase == "run":
            _, ref = cell.train(os.path.join(out, "ref"), tag="u")
            np.savez(os.path.join(out, "ref.npz"), **ref)
            try:
                cell.train(os.path.join(out, "model"), kill=hard_kill)
                result = {"status": "not killed"}
            except Killed:
                result = {"status": "killed"}
        elif cell.mode == "kill":
            info = tf_psplugin.latest_checkpoint_info(os.path.join(out, "model"))
            result["resumed_from"] = info.step if info else None
            result["input_position"] = info.input_position if info else None
            _, weights = cell.train(os.path.join(out, "model"))
            np.savez(os.path.join(out, "resumed.npz"), **weights)
        else:
            model_dir = os.path.join(out, "model")
            model, weights = cell.train(model_dir)
            if cell.mode == "full_every":
                result["restore_diff"] = restore_diff(cell, model_dir, model)
            if cell.mode == "export":
                scores, result["serving_diff"] = serving_diff(
                    cell, model, weights, os.path.join(out, "export"), model_dir)
                weights["serving"] = scores
            np.savez(os.path.join(out, "weights.npz"), **weights)
    except Exception as e:  # pylint: disable=broad-except  (recorded; the test judges it)
        model = getattr(cell, "model", None)
        step = (int(model.optimizer.iterations.numpy())
                if model is not None and model.optimizer is not None else 0)
        result = {"status": "refused", "error": f"{type(e).__name__}: {e}", "step": step}
    result["tables"] = cell.tables()
    # What the cell ran with: the dense all-reduce's dtype, and how many workers sum it.
    result["dense_allreduce_dtype"] = strategy.extended.dense_allreduce_dtype
    result["dense_bucket_bytes"] = strategy.extended.dense_bucket_bytes
    result["workers"] = (tf.distribute.cluster_resolver.TFConfigClusterResolver()
                         .cluster_spec().num_tasks("worker"))
    result["seconds"] = round(time.monotonic() - start, 1)
    with open(os.path.join(out, "result.json"), "w", encoding="utf-8") as f:
        json.dump(result, f)
    print("CELL", cell_name, result["status"], result["seconds"], "s", flush=True)


# A mode's suffix ``+wire_<dtype>``: `HybridOptions.dense_allreduce_dtype` (its own test,
# tests/cluster/test_compose_allreduce_dtype.py, on 2 workers); ``+buckets_<bytes>``:
# `HybridOptions.dense_bucket_bytes` (the same test).
WIRE = "wire_"
BUCKETS = "buckets_"


def main():
    mode, root, phase, cells = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
    tf_psplugin.start_server()
    stacking, *extras = mode.split("+")
    table_dtype = next((x for x in extras if not x.startswith((WIRE, BUCKETS))), None)
    wire = next((x[len(WIRE):] for x in extras if x.startswith(WIRE)), None)
    buckets = next((int(x[len(BUCKETS):]) for x in extras if x.startswith(BUCKETS)), None)
    strategy = tf_psplugin.HybridParameterServerStrategy(
        options=tf_psplugin.HybridOptions(stack_tables=(stacking == "stacked"),
                                          table_dtype=table_dtype or None,
                                          dense_allreduce_dtype=wire,
                                          dense_bucket_bytes=buckets))
    root = os.path.join(root, mode)
    # Kill cells last: the last of them kills this process for real.
    order = sorted(range(len(cells)), key=lambda i: ".kill." in cells[i])
    last_kill = max([i for i in order if ".kill." in cells[i]], default=None)
    for i in order:
        if phase == "resume" and ".kill." not in cells[i]:
            continue  # Only the killed jobs restart.
        run_cell(strategy, root, phase, cells[i], i, hard_kill=(i == last_kill))
    print("DONE", flush=True)


if __name__ == "__main__":
    main()
