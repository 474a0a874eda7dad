"""Keras jobs whose stacks cannot be split before they are traced, stacked or unstacked.

Used by tests/cluster/test_stacked_fallback.py (issue 40 item 1: any
optimizer works on stacked tables, never an error). Arguments:
``<stacked|unstacked>[-async] <out_dir> <case>...`` (``-async``: the
strategy's asynchronous mode, ``dense_placement="ps"``, whose steps the
stock coordinator schedules). Each case is one small job, as a
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

* ``legacy_loop``: a custom loop (``ClusterCoordinator.schedule`` of a
  `tf.function` that calls ``apply_gradients``), no `compile`, with a
  user's subclass of the legacy Adagrad whose sparse update is not
  elementwise (its step scaled by the whole variable's RMS): the stack is
  split apart when the step is first traced, and the step traced again.
* ``legacy_recompile``: after a first `fit` with Keras Adam, the model is
  compiled again with that legacy subclass and trained on. The first fit's
  traced function, which Keras keeps, still reads the stack: the stack is
  split all the same at the second fit's first trace (rows copied) and
  that old function's storage emptied. Stacked, the case then schedules
  the old function once more (a user who kept ``model.train_tf_function``)
  and prints ``OLD_REFUSED`` and the error: traced again, it would run the
  legacy optimizer, not the Adam its old trace ran (as unstacked), and it
  must not train stale rows either.
* ``step_after_split``: a custom loop's step with legacy SGD (no slots) is
  scheduled, then a step with the legacy subclass on the same tables
  (stacked: the stack is split, the SGD step's storage emptied), then the
  SGD step again: the coordinator traces it anew on the new stacks and it
  trains on, as unstacked (``moved_after_split``: which weights its last
  run changed, by name).

* ``predict_after_split``: a custom loop with the legacy subclass, no
  `compile` of an optimizer (the model is compiled with a loss only, for
  `predict`). Before the first scheduled step, on the chief: `model.predict`
  (Keras keeps its traced ``predict_function``), a user's `tf.function`
  forward (``model(ids)``) and a user's `tf.function` lookup of the ``user``
  table (`tf.nn.embedding_lookup`). Then the scheduled step (stacked: the
  stack those three read is split apart), and the same three calls again,
  outside the coordinator. Their outputs, before (``*_before``) and after
  (``*_after``), are compared with unstacked.

* ``slots_split_legacy``: a first `fit` with legacy Adagrad, then a
  custom loop with the legacy subclass on the same tables while the
  Adagrad lives (stacked: the stack is split, and each of Adagrad's slots
  of it with it), then `fit` with the Adagrad again.
* ``slots_split_keras``: the same with Keras's (new) SGD with momentum
  first: its slots of the stack (listed per table, one per stack shard
  for the apply) are split with the stack, and it trains on. The case
  also records what Keras lists of the SGD (``opt0/variables/<j>/<name>``)
  and every tensor of a checkpoint of the model and the SGD written at the
  end (``ckpt/<key>``).

It writes ``<out_dir>/<case>.npz``: every weight of the case's models
(tables as ``[V, D]`` in id order) and, for Keras's new optimizers, every
variable each optimizer lists (``opt<i>/<j>``), for legacy ones each
table's slots (``opt<i>/<layer>/<slot>``, ``[V, D]``), and prints ``DONE``.
"""

import os
import sys

import numpy as np
import tensorflow as tf

import tf_psplugin

V = 40
WIDTHS = {"frozen_after": 3, "frozen_after_legacy": 5, "second_model": 6, "custom_after": 7,
          "legacy_loop": 9, "legacy_recompile": 10, "step_after_split": 11,
          "slots_split_legacy": 14, "slots_split_keras": 12, "predict_after_split": 15}


class RmsScaledAdagrad(tf.keras.optimizers.legacy.Adagrad):
    """A user's legacy optimizer: Adagrad whose step is scaled by the variable's RMS."""

    def _resource_apply_sparse(self, grad, var, indices, apply_state=None):
        scale = tf.sqrt(tf.reduce_mean(tf.square(tf.convert_to_tensor(var)))) + 0.1
        return super()._resource_apply_sparse(grad * scale, var, indices,
                                              apply_state=apply_state)


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
        if isinstance(optimizer, tf.keras.optimizers.legacy.Optimizer):
            # Each table's slots, [V, D] in id order, however they are stored.
            for layer in models[0].layers:
                if isinstance(layer, tf.keras.layers.Embedding):
                    for slot_name in optimizer.get_slot_names():
                        out[f"opt{i}/{layer.name}/{slot_name}"] = legacy_slot(
                            optimizer, layer.embeddings, slot_name)
        elif isinstance(optimizer, tf.keras.optimizers.Optimizer):
            for j, var in enumerate(optimizer.variables):
                out[f"opt{i}/{j}"] = np.asarray(tf.convert_to_tensor(var))
    return out


def legacy_slot(optimizer, table, slot_name):
    """A table's legacy slot as [V, D], from its shards' slots (interleaved rows)."""
    shards = list(table.variables)
    n = len(shards)
    rows = np.zeros(table.shape.as_list(), np.float32)
    for s, shard in enumerate(shards):
        slot = np.asarray(tf.convert_to_tensor(optimizer.get_slot(shard, slot_name)))
        start = table.row_offsets[s] if hasattr(table, "row_offsets") else 0
        count = len(range(s, V, n))
        rows[s::n] = slot[start:start + count]
    return rows


def make_step(model, optimizer):
    """The PSS tutorial's custom loop step: a tf.function that applies the gradients."""
    strategy = tf.distribute.get_strategy()

    @tf.function
    def step(iterator):
        def replica_fn(batch):
            ids, y = batch
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(model(ids, training=True) - y))
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            return loss

        return strategy.run(replica_fn, args=(next(iterator),))

    return step


def run_steps(step, seed, steps=3):
    """Schedules `step` `steps` times on a per-worker dataset, then joins."""
    strategy = tf.distribute.get_strategy()
    coordinator = tf.distribute.experimental.coordinator.ClusterCoordinator(strategy)
    iterator = iter(coordinator.create_per_worker_dataset(lambda: data(seed)))
    for _ in range(steps):
        coordinator.schedule(step, args=(iterator,))
    coordinator.join()


def custom_loop(model, optimizer, seed, steps=3):
    """The PSS tutorial's custom loop: a scheduled tf.function that applies the gradients."""
    run_steps(make_step(model, optimizer), seed, steps)


def step_after_split(model):
    """A step traced before a split, scheduled after it: traced anew, it trains on."""
    # Legacy SGD: no slots (the split goes ahead), and a legacy optimizer
    # applies any variable (a Keras one built before the split would not
    # know the new stacks' shards).
    sgd = tf.keras.optimizers.legacy.SGD(0.05)
    sgd_step = make_step(model, sgd)
    run_steps(sgd_step, 1)
    legacy = RmsScaledAdagrad(0.1)
    run_steps(make_step(model, legacy), 2)  # Stacked: splits the stack sgd_step read.
    before = weights([model], [])
    run_steps(sgd_step, 3)
    found = weights([model], [legacy, sgd])
    # 1 for each weight (sorted by name) the last run changed.
    found["moved_after_split"] = np.array(
        [int(not np.array_equal(before[k], found[k])) for k in sorted(before)], np.int32)
    return found


def predict_after_split(strategy):
    """Calls outside the coordinator, traced before a split and called after it.

    The model is built and trained in the strategy's scope; `predict` and
    the user's functions are called outside it, on the chief (Keras's
    `predict` runs there under a parameter-server strategy).
    """
    dim = WIDTHS["predict_after_split"]
    with strategy.scope():
        tf.keras.utils.set_random_seed(dim)
        model, _, user = two_tables(f"c{dim}", dim)
        model.compile(loss="mse")  # For `predict` (no optimizer: the loop applies its own).
    rng = np.random.default_rng(7)
    ids = rng.integers(0, V, (24, 2)).astype("int64")

    @tf.function
    def forward(x):
        return model(x, training=False)

    @tf.function
    def lookup(x):
        return tf.nn.embedding_lookup(user.embeddings, x[:, 1])

    def outputs(when):
        return {f"predict_{when}": model.predict(ids, batch_size=8, verbose=0),
                f"forward_{when}": forward(tf.constant(ids)).numpy(),
                f"lookup_{when}": lookup(tf.constant(ids)).numpy()}

    found = outputs("before")
    with strategy.scope():
        legacy = RmsScaledAdagrad(0.1)
        custom_loop(model, legacy, 1)  # Stacked: splits the stack the three calls read.
    found.update(outputs("after"))
    with strategy.scope():
        found.update(weights([model], [legacy]))
    return found


def slots_split(model, case):
    """A split while the first optimizer, still alive, has slots for the stack."""
    first = (tf.keras.optimizers.legacy.Adagrad(0.1) if case == "slots_split_legacy"
             else tf.keras.optimizers.SGD(0.05, momentum=0.5))
    model.compile(first, "mse")
    fit(model, 1)
    legacy = RmsScaledAdagrad(0.1)
    custom_loop(model, legacy, 2)  # Stacked: splits the stack `first` has slots for.
    fit(model, 3)  # The first optimizer again, on the new stacks.
    found = weights([model], [first, legacy])
    if case == "slots_split_keras":
        # What Keras shows of the SGD after the split (its slots per table,
        # `stacked_slots`, re-pointed at the new stacks): names, shapes and
        # values as unstacked; and a checkpoint of the model and the SGD.
        for j, variable in enumerate(first.variables):
            found[f"opt0/variables/{j}/{variable.name}"] = np.asarray(
                tf.convert_to_tensor(variable))
        path = tf.train.Checkpoint(model=model, optimizer=first).write(
            os.path.join(sys.argv[2], "slots_split_keras_ckpt", "ckpt"))
        reader = tf.train.load_checkpoint(path)
        for key in reader.get_variable_to_shape_map():
            if key != "_CHECKPOINTABLE_OBJECT_GRAPH":
                found[f"ckpt/{key}"] = reader.get_tensor(key)
    if case == "slots_split_legacy":
        # What Keras shows of the first optimizer after the split (its slots per
        # table, `legacy_slots`, re-pointed at the new stacks): the same list,
        # names, shapes and values as unstacked.
        for j, (variable, value) in enumerate(zip(first.variables(), first.get_weights())):
            found[f"opt0/weights/{j}/{variable.name}"] = np.asarray(value)
    return found


def run_case(case):
    dim = WIDTHS[case]
    tf.keras.utils.set_random_seed(dim)
    model, ids, user = two_tables(f"c{dim}", dim)
    if case.startswith("slots_split"):
        return slots_split(model, case)
    if case == "legacy_loop":
        legacy = RmsScaledAdagrad(0.1)
        custom_loop(model, legacy, 1)
        return weights([model], [legacy])
    if case == "step_after_split":
        return step_after_split(model)
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
    elif case == "legacy_recompile":
        # The first optimizer is let go (as `model.compile(Adam())` does):
        # while it lives, its slots of the stack keep it whole (an error).
        del models, optimizers, adam
        old = model.train_tf_function  # A user kept the first fit's function.
        legacy = RmsScaledAdagrad(0.1)
        model.compile(legacy, "mse")
        fit(model, 2)
        found = weights([model], [legacy])
        if is_stacked():
            schedule_old(old)
        return found
    return weights(models, optimizers)


def is_stacked():
    return sys.argv[1].startswith("stacked")


def schedule_old(old):
    """Schedules the first fit's function after the split: refused, naming why (printed)."""
    strategy = tf.distribute.get_strategy()
    coordinator = tf.distribute.experimental.coordinator.ClusterCoordinator(strategy)
    iterator = iter(coordinator.create_per_worker_dataset(lambda: data(3)))
    try:
        coordinator.schedule(old, args=(iterator,))
        coordinator.join()
    except tf_psplugin.StackingError as e:
        print("OLD_REFUSED", str(e).replace("\n", " "), flush=True)
        return
    print("OLD_RAN", flush=True)


def main():
    stacking, out_dir = sys.argv[1:3]
    tf_psplugin.start_server()
    strategy = tf_psplugin.HybridParameterServerStrategy(
        options=tf_psplugin.HybridOptions(
            stack_tables=is_stacked(),
            dense_placement="ps" if stacking.endswith("-async") else "allreduce"))
    for case in sys.argv[3:]:
        if case == "predict_after_split":  # Enters the scope itself: predict runs outside.
            found = predict_after_split(strategy)
        else:
            with strategy.scope():
                found = run_case(case)
        np.savez(os.path.join(out_dir, f"{case}.npz"), **found)
        print("CASE", case, flush=True)
    with open(os.path.join(out_dir, "placement.txt"), "w", encoding="utf-8") as f:
        f.write(strategy.placement_report())
    print("DONE", flush=True)


if __name__ == "__main__":
    main()
