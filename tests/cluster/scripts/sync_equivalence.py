"""Chief script: sync hybrid training vs single-process training on the global batch.

Run by tests/cluster/test_strategy.py under a LocalCluster (TF_CONFIG set).
Writes a JSON report to argv[1]: max |diff| per weight, replica equality,
placement (device strings), the losses and metrics Keras reported, and
graph checks of the traced step (ordering, collectives per step).
"""

import json
import sys

import numpy as np
import tensorflow as tf
from absl import logging

import tf_psplugin
from traced_graphs import ancestors, traced_graphs

OUT, OPT, SHARDING, UPDATES = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
SPE = int(sys.argv[5]) if len(sys.argv) > 5 else 1
# The variant (argv[6]): one or several of these joined by "+", e.g.
# "mixed_float16+stacked".
VARIANTS = set(sys.argv[6].split("+")) if len(sys.argv) > 6 else set()
# "dedup": the model looks up each distinct id once per batch, so the sparse
# gradient's row count changes from step to step.
DEDUP = "dedup" in VARIANTS
# "fused": the strategy looks both tables up together (experimental_fuse_lookups=True).
FUSED = bool(VARIANTS & {"fused", "stacked"})
# "stacked": both tables in one stack (stack_tables=True), looked up together.
STACKED = "stacked" in VARIANTS
# "bucketed": the dense gradients all-reduced in buckets of about 16 bytes
# (HybridOptions.dense_bucket_bytes): the MLP's four variables in three
# collectives, the output layer's first; every other case in one pack (0).
BUCKET_BYTES = 16 if "bucketed" in VARIANTS else 0
# "bf16wire" / "f16wire": the dense gradients all-reduced in bfloat16 /
# float16 (HybridOptions.dense_allreduce_dtype); every other case in their own.
ALLREDUCE_DTYPE = ("bfloat16" if "bf16wire" in VARIANTS
                   else "float16" if "f16wire" in VARIANTS else None)
EXCHANGE = sys.argv[7] if len(sys.argv) > 7 else "ps"
# "mixed_float16" / "mixed_bfloat16": Keras's mixed-precision policy, here and
# in the single-process reference; the output layer stays float32 (as Keras's
# guide says), and with float16 one example of step 3 overflows the loss
# scale, on one worker's batch only.
MIXED = next((v for v in sorted(VARIANTS) if v.startswith("mixed_")), None)
OVERFLOW_ROW = 3 * 2 * 8 + 9  # Step 3, worker 1's batch (2 workers, batch 8).
STEPS, BATCH, VOCAB, VOCAB2, DIM, FEATURES = 20, 8, 50, 30, 4, 3


class DedupEmbedding(tf.keras.layers.Embedding):
    """An Embedding that fetches each distinct id of the batch once."""

    def call(self, inputs):
        unique, index = tf.unique(tf.reshape(inputs, [-1]))
        rows = tf.gather(tf.nn.embedding_lookup(self.embeddings, unique), index)
        return tf.reshape(rows, tf.concat([tf.shape(inputs), [self.output_dim]], 0))


def make_model():
    inp = tf.keras.Input((FEATURES,), dtype="int64")
    embedding = DedupEmbedding if DEDUP else tf.keras.layers.Embedding
    # Two tables, so each worker's updates to a PS cover several shards.
    x = embedding(
        VOCAB, DIM, embeddings_initializer=tf.keras.initializers.RandomUniform(seed=1),
        name="table_a")(inp)
    y = embedding(
        VOCAB2, DIM, embeddings_initializer=tf.keras.initializers.RandomUniform(seed=4),
        name="table_b")(tf.keras.layers.Lambda(lambda t: t % VOCAB2)(inp))
    x = tf.keras.layers.Concatenate()([tf.keras.layers.Flatten()(x), tf.keras.layers.Flatten()(y)])
    x = tf.keras.layers.Dense(8, activation="relu",
                              kernel_initializer=tf.keras.initializers.GlorotUniform(seed=2))(x)
    out = tf.keras.layers.Dense(1, kernel_initializer=tf.keras.initializers.GlorotUniform(seed=3),
                                dtype="float32" if MIXED else None)(x)
    return tf.keras.Model(inp, out)


def make_metrics():
    """Two metrics (four ON_READ accumulators) besides Keras's loss tracker."""
    return [tf.keras.metrics.MeanAbsoluteError(name="mae"),
            tf.keras.metrics.MeanSquaredError(name="mse_metric")]


def make_optimizer():
    if OPT == "sgd":
        return tf.keras.optimizers.legacy.SGD(0.1)
    if OPT == "adam_new":  # Keras's new (non-legacy) optimizer.
        return tf.keras.optimizers.Adam(0.01)
    return tf.keras.optimizers.legacy.Adagrad(0.1)


def logical_weights(model):
    """Every layer's weights; a sharded table as its full logical value."""
    out = []
    for layer in model.layers:
        if isinstance(layer, tf.keras.layers.Embedding):
            out.append(tf.convert_to_tensor(layer.embeddings).numpy())
        else:
            out.extend(w.numpy() for w in layer.weights)
    return out


def weight_names(model):
    return [w.name for layer in model.layers for w in (
        [layer.embeddings] if isinstance(layer, tf.keras.layers.Embedding) else layer.weights)]


_PS_WRITES = {"AssignVariableOp", "AssignAddVariableOp", "AssignSubVariableOp",
              "ResourceScatterAdd", "ResourceScatterSub", "ResourceScatterUpdate",
              "ResourceSparseApplyAdagradV2", "ResourceSparseApplyAdagrad",
              "ResourceApplyGradientDescent", "ResourceSparseApplyGradientDescent",
              "ResourceApplyAdagradV2", "ResourceApplyAdam", "ResourceSparseApplyAdam"}


def sparse_exchange_ops(model):
    """Counts of the sparse exchange's ops, and worker ops fed by a PS-summed gradient.

    With experimental_sparse_exchange="ps" the global sparse gradient is taken from a
    queue on the PS and must stay there: any op not placed on a PS that
    consumes it (directly or through other ops) means it crossed the network
    again (an op without a device runs on the worker that runs the step).
    """
    counts = {"enqueue": 0, "dequeue_on_ps": 0, "all_gather": 0}
    on_workers = []
    for graph in traced_graphs(model):
        for op in graph.get_operations():
            if op.type.startswith("QueueEnqueue"):
                counts["enqueue"] += 1
            elif op.type.startswith("QueueDequeue") and "/job:ps" in op.device:
                counts["dequeue_on_ps"] += 1
                todo, seen = [c for t in op.outputs for c in t.consumers()], set()
                while todo:
                    consumer = todo.pop()
                    if consumer.name in seen:
                        continue
                    seen.add(consumer.name)
                    if "/job:ps" not in consumer.device:
                        on_workers.append(f"{consumer.type} {consumer.name}")
                    todo.extend(c for t in consumer.outputs for c in t.consumers())
            elif op.type.startswith("CollectiveGather"):
                counts["all_gather"] += 1
    return counts, on_workers


def writes_not_before_barrier(model):
    """PS writes of the traced sync steps that the end-of-step barrier does not wait for.

    A write the barrier does not wait for can land after another worker's
    next-step lookup (a timing-dependent, inexact result). The barrier is
    the step's last collective whose input is a constant with control
    inputs (collectives.barrier).
    """
    unordered, graphs = [], 0
    # Under loss scaling the updates and the barrier are in the tf.cond
    # branch that applies the step.
    for graph in traced_graphs(model, branches=MIXED == "mixed_float16"):
        ops = graph.get_operations()
        writes = [op for op in ops if op.type in _PS_WRITES and "/job:ps" in op.device]
        if not writes:
            continue  # A role that updates no table shard.
        graphs += 1
        barriers = [op for op in ops if op.type.startswith("CollectiveReduce")
                    and op.inputs[0].op.type == "Const" and op.inputs[0].op.control_inputs]
        if not barriers:
            unordered.append(f"{graph.name}: no barrier")
            continue
        seen = ancestors(barriers[-1])
        unordered += [f"{op.type} {op.name}" for op in writes if op.name not in seen]
    return unordered, graphs


def takes_before_all_hand_ins(model):
    """PS takes (dequeues) not ordered after a collective that waits for every hand-in.

    The PS exchange is exact only if no worker takes before every worker
    handed in: each take must wait for a collective (the barrier, or the
    dense all-reduce that doubles as it) that itself waits for every one of
    its graph's enqueues. Also returns the collectives per traced graph, and
    per graph with hand-ins the collectives that do not wait for any.
    """
    early, collectives_per_graph, before_hand_ins = [], [], []
    for graph in traced_graphs(model):
        ops = graph.get_operations()
        enqueues = {op.name for op in ops if op.type.startswith("QueueEnqueue")}
        collectives = [op for op in ops if op.type.startswith("Collective")]
        if collectives:
            collectives_per_graph.append(len(collectives))
        if not enqueues:
            continue
        # Collectives that may start before this worker's hand-ins (the
        # sparse gradients, the backward pass's last): the early buckets.
        before_hand_ins.append(sum(not enqueues & ancestors(op) for op in collectives))
        gates = {op.name for op in collectives if enqueues <= ancestors(op)}
        for op in ops:
            if op.type.startswith("QueueDequeue") and not gates & ancestors(op):
                early.append(f"{graph.name}: {op.type} {op.name}")
    return early, collectives_per_graph, before_hand_ins


def collective_dtypes(model):
    """Per traced graph with an all-reduce, the sorted dtypes its all-reduces sum."""
    out = []
    for graph in traced_graphs(model):
        dtypes = sorted(op.inputs[0].dtype.name for op in graph.get_operations()
                        if op.type == "CollectiveReduceV2")
        if dtypes:
            out.append(dtypes)
    return out


def data_loss(weights, ids, y):
    """The mean squared error of a plain model with `weights` on all of (`ids`, `y`)."""
    plain = make_model()
    set_logical_weights(plain, weights)
    return float(np.mean((plain(ids, training=False).numpy().astype("float64") - y) ** 2))


def skip_branch_writes(model):
    """PS writes and queue takes in the branch of LossScaleOptimizer's tf.cond that skips.

    Returns the number of conds whose other branch writes on a PS, and the
    ops found in their skipping branch (none expected: a skipped step
    changes nothing on a PS, and its gradients were taken before the cond).
    """
    conds, found = 0, []
    for graph in traced_graphs(model, branches=True):
        for op in graph.get_operations():
            true_graph = getattr(op, "_true_graph", None)
            if true_graph is None or not any(
                    o.type in _PS_WRITES and "/job:ps" in o.device
                    for g in _graphs_within(true_graph) for o in g.get_operations()):
                continue
            conds += 1
            found += [f"{o.type} {o.name}" for g in _graphs_within(op._false_graph)
                      for o in g.get_operations()
                      if "/job:ps" in o.device and (o.type in _PS_WRITES
                                                    or o.type.startswith("QueueDequeue"))]
    return conds, found


def _graphs_within(graph):
    yield graph
    for op in graph.get_operations():
        for name in ("_body_graph", "_true_graph", "_false_graph"):
            nested = getattr(op, name, None)
            if nested is not None:
                yield from _graphs_within(nested)


def fused_lookup_gathers(model):
    """Shard gathers of the fused lookups (tables/fusion.py) in the traced step."""
    return sum(1 for graph in traced_graphs(model) for op in graph.get_operations()
               if op.type == "ResourceGather" and "fused_lookups" in op.name)


def sparse_applies_per_graph(model):
    """Sparse optimizer applies (one per table shard, or per stack shard) in each trace."""
    return [sum(1 for op in graph.get_operations() if op.type.startswith("ResourceSparseApply"))
            for graph in traced_graphs(model)]


def loss_scale(optimizer):
    """The dynamic loss scale and its good-step counter (None without loss scaling)."""
    scale = getattr(optimizer, "loss_scale", None)
    if scale is None:
        return None
    return [float(tf.convert_to_tensor(scale)),
            float(tf.convert_to_tensor(optimizer.dynamic_counter))]


def worker_loss_scales(optimizer):
    """Every worker's replica of the loss scale and its counter: [[scale, counter], ...]."""
    # Keras keeps the dynamic loss scale's variables in a private object (no
    # public accessor for the variables themselves, only their values).
    state = optimizer._loss_scale  # pylint: disable=protected-access
    out = []
    for v in (state.current_loss_scale, state.counter):
        assert isinstance(v, tf_psplugin.ReplicatedVariable), v
        out.append([float(x) for x in v.replica_values()])
    return [list(pair) for pair in zip(*out)]


def max_diff(a, b):
    return max(float(np.abs(x - y).max()) for x, y in zip(a, b))


def custom_loop(strategy, ids, y):
    """mixed_float16 in a custom loop (LossScaleOptimizer by hand) vs one process.

    Returns the report's "custom_loop" part: weights against the reference,
    and per step every worker's loss scale and how much the weights moved.
    """
    num_workers = strategy.num_replicas_in_sync
    global_batch = BATCH * num_workers
    with strategy.scope():
        model = make_model()
        opt = tf.keras.mixed_precision.LossScaleOptimizer(tf.keras.optimizers.Adam(0.01))
    init = logical_weights(model)

    def loss_of(m, x, labels):
        return tf.keras.losses.mean_squared_error(labels, m(x, training=True))

    @tf.function
    def train_step(iterator):
        def replica_fn(x, labels):
            with tf.GradientTape() as tape:
                loss = tf.nn.compute_average_loss(loss_of(model, x, labels),
                                                  global_batch_size=global_batch)
                scaled = opt.get_scaled_loss(loss)
            grads = opt.get_unscaled_gradients(tape.gradient(scaled, model.trainable_variables))
            opt.apply_gradients(zip(grads, model.trainable_variables))
        x, labels = next(iterator)
        strategy.run(replica_fn, args=(x, labels))

    coordinator = tf.distribute.experimental.coordinator.ClusterCoordinator(strategy)
    it = iter(coordinator.create_per_worker_dataset(
        tf.data.Dataset.from_tensor_slices((ids, y)).batch(BATCH)))
    steps, before = [], init
    for _ in range(STEPS):
        coordinator.schedule(train_step, args=(it,))
        coordinator.join()
        after = logical_weights(model)
        steps.append({"scales": worker_loss_scales(opt), "moved": max_diff(after, before)})
        before = after

    ref = make_model()
    set_logical_weights(ref, init)
    ref_opt = tf.keras.mixed_precision.LossScaleOptimizer(tf.keras.optimizers.Adam(0.01))
    ref_scales = []
    for x, labels in tf.data.Dataset.from_tensor_slices((ids, y)).batch(global_batch).take(STEPS):
        with tf.GradientTape() as tape:
            scaled = ref_opt.get_scaled_loss(tf.reduce_mean(loss_of(ref, x, labels)))
        grads = ref_opt.get_unscaled_gradients(tape.gradient(scaled, ref.trainable_variables))
        ref_opt.apply_gradients(zip(grads, ref.trainable_variables))
        ref_scales.append(loss_scale(ref_opt))
    return {"steps": steps, "ref_scales": ref_scales,
            "diffs": {w: float(np.abs(a - b).max()) for a, b, w in
                      zip(logical_weights(model), logical_weights(ref), weight_names(ref))}}


def legacy_refusal(strategy, ids, y):
    """What fit says for a legacy optimizer under mixed_float16: [error type, message]."""
    with strategy.scope():
        model = make_model()
        model.compile(tf.keras.optimizers.legacy.Adam(0.01), "mse")
    try:
        model.fit(tf.data.Dataset.from_tensor_slices((ids, y)).batch(BATCH), epochs=1,
                  steps_per_epoch=1, verbose=0)
    except Exception as e:  # pylint: disable=broad-except  (reported, checked by the test)
        return [type(e).__name__, str(e)]
    return None


def set_logical_weights(model, weights):
    """Sets `model`'s layers (a plain model) to `weights`, in logical_weights' order."""
    for layer in model.layers:
        n = len(layer.weights)
        layer.set_weights(weights[:n])
        weights = weights[n:]


def stacked_checkpoint_manager(model):
    """The manager `stacked_checkpoint` saves with, made before `fit` as `ChiefCheckpoint` is.

    Made before the optimizer's slots, it lists Keras's new optimizers'
    table slots per table in logical row order (`slot_order`, with its
    marker), which a plain model loads.
    """
    import os  # pylint: disable=g-import-not-at-top

    model_dir = os.path.join(os.path.dirname(OUT), "stacked_ckpt")
    return model_dir, tf_psplugin.ChiefCheckpointManager(model_dir, model=model)


def stacked_checkpoint(model, got, manager, ref):
    """The stack checkpointed table by table: what a plain model loads of it.

    A plain model (one variable per table, no cluster) loads the tables and
    their optimizer slots: a legacy optimizer's Adagrad accumulators (which
    training moved off their initial 0.1) compared with the cluster's;
    Keras's new Adam's moments of both tables (`slot_order`'s logical
    layout) compared with those of `ref`, the single-process model trained
    on the same data (rows in the wrong order would differ by their size).
    """
    model_dir, manager = manager
    manager.save(STEPS, final=True)
    plain = make_model()
    plain.compile(make_optimizer(), "mse")
    out = {}
    tf_psplugin.load_into(plain, model_dir, include_optimizer=True)
    if OPT == "adam_new":
        def moments(m):
            inner = getattr(m.optimizer, "inner_optimizer", m.optimizer)
            return [v.numpy() for v in inner.variables if "table_" in v.name
                    and ("/m/" in "/" + v.name or "/v/" in "/" + v.name)]

        loaded, reference = moments(plain), moments(ref)
        out["adam_slots"] = len(loaded)
        # Per slot, the largest difference relative to the slot's largest value.
        out["adam_slots_vs_reference"] = max(
            float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))
            for a, b in zip(loaded, reference))
    else:
        slot = model.optimizer.get_slot(model.get_layer("table_b").embeddings, "accumulator")
        plain_slot = plain.optimizer.get_slot(plain.get_layer("table_b").embeddings,
                                              "accumulator")
        out["accumulator"] = float(np.abs(tf.convert_to_tensor(slot).numpy()
                                          - plain_slot.numpy()).max())
        out["accumulator_trained"] = float(np.abs(plain_slot.numpy() - 0.1).max())
    out["tables"] = max(float(np.abs(a - b).max()) for a, b in zip(logical_weights(plain), got))
    return out


def main():
    tf_psplugin.start_server()
    logging.set_verbosity(logging.INFO)
    if MIXED:
        tf.keras.mixed_precision.set_global_policy(MIXED)
    strategy = tf_psplugin.HybridParameterServerStrategy(
        options=tf_psplugin.HybridOptions(
            embedding_updates=UPDATES, experimental_sparse_exchange=EXCHANGE,
            experimental_fuse_lookups=FUSED, stack_tables=STACKED,
            dense_bucket_bytes=BUCKET_BYTES, dense_allreduce_dtype=ALLREDUCE_DTYPE),
        # Off: the other cases keep two tables.
        placement=tf_psplugin.PlacementPolicy(sharding=SHARDING))
    num_workers = strategy.num_replicas_in_sync
    rng = np.random.default_rng(0)
    ids = rng.integers(0, VOCAB, size=(STEPS * num_workers * BATCH, FEATURES)).astype("int64")
    y = rng.normal(size=(STEPS * num_workers * BATCH, 1)).astype("float32")
    if MIXED == "mixed_float16":
        y[OVERFLOW_ROW] = 500.0  # Its gradient overflows float16 at the initial scale.
    with strategy.scope():
        model = make_model()
        model.compile(make_optimizer(), "mse", metrics=make_metrics(), steps_per_execution=SPE)
    init = logical_weights(model)
    manager = stacked_checkpoint_manager(model) if STACKED else None
    hist = model.fit(tf.data.Dataset.from_tensor_slices((ids, y)).batch(BATCH),
                     epochs=1, steps_per_epoch=STEPS, verbose=2)
    got = logical_weights(model)
    records = [r.to_dict() for r in strategy.placement_records()]  # Before any other model.
    unordered, graphs_with_writes = writes_not_before_barrier(model)
    exchange_ops, summed_gradient_on_workers = sparse_exchange_ops(model)
    early_takes, collectives_per_graph, before_hand_ins = takes_before_all_hand_ins(model)

    replicas_identical = True
    optimizer_variables = model.optimizer.variables
    if callable(optimizer_variables):  # Keras's legacy optimizers: a method.
        optimizer_variables = optimizer_variables()
    for v in model.variables + list(optimizer_variables):
        if isinstance(v, tf_psplugin.ReplicatedVariable):
            vals = [r.numpy() for r in v.replica_values()]
            replicas_identical &= all(np.array_equal(vals[0], x) for x in vals[1:])

    ref = make_model()
    set_logical_weights(ref, init)
    ref.compile(make_optimizer(), "mse", metrics=make_metrics())
    ref_hist = ref.fit(tf.data.Dataset.from_tensor_slices((ids, y)).batch(BATCH * num_workers),
                       epochs=1, steps_per_epoch=STEPS, verbose=0)
    diffs = {w: float(np.abs(a - b).max())
             for a, b, w in zip(got, logical_weights(ref), weight_names(ref))}
    table = model.get_layer("table_a").embeddings
    checkpoint = stacked_checkpoint(model, got, manager, ref) if STACKED else {}
    float16 = {}
    if MIXED == "mixed_float16":
        float16 = {
            "overflow_step": OVERFLOW_ROW // (num_workers * BATCH),
            # Batch-level callbacks are refused under a ParameterServerStrategy:
            # fit is checked at its end (the custom loop step by step).
            "fit_scales": worker_loss_scales(model.optimizer),
            "skip_branch": skip_branch_writes(model),
            "custom_loop": custom_loop(strategy, ids, y),
            "legacy_refusal": legacy_refusal(strategy, ids, y),
        }
    report = {
        "float16": float16,
        "checkpoint": checkpoint,
        "loss_scale": loss_scale(model.optimizer),
        "ref_loss_scale": loss_scale(ref.optimizer),
        "diffs": diffs,
        "replicas_identical": bool(replicas_identical),
        "num_replicas_in_sync": num_workers,
        "table_devices": [v.device for v in table.variables],
        "records": records,
        "unordered_ps_writes": unordered,
        "graphs_with_ps_writes": graphs_with_writes,
        "sparse_exchange_ops": exchange_ops,
        "summed_gradient_on_workers": summed_gradient_on_workers,
        "early_takes": early_takes,
        "collectives_per_graph": collectives_per_graph,
        "collectives_before_hand_ins": before_hand_ins,
        "dense_bucket_bytes": strategy.options.dense_bucket_bytes,
        "dense_allreduce_dtype": strategy.options.dense_allreduce_dtype,
        "collective_dtypes": collective_dtypes(model),
        # The global data's loss (mse) with the initial and the trained weights.
        "data_loss": {"initial": data_loss(init, ids, y), "trained": data_loss(got, ids, y)},
        "fused_lookup_gathers": fused_lookup_gathers(model),
        "sparse_applies_per_graph": sparse_applies_per_graph(model),
        "tables_share_shards": all(
            a is b
            for a, b in zip(table.variables, model.get_layer("table_b").embeddings.variables)),
        "loss": hist.history["loss"][0],
        "ref_loss": ref_hist.history["loss"][0],
        "metrics": {k: hist.history[k][0] for k in ("mae", "mse_metric")},
        "ref_metrics": {k: ref_hist.history[k][0] for k in ("mae", "mse_metric")},
    }
    # The trained weights, for bit-for-bit comparisons between runs.
    np.savez(OUT + ".npz", **{f"{i}:{w}": a for i, (a, w) in enumerate(zip(got, weight_names(ref)))})
    with open(OUT, "w") as f:
        json.dump(report, f)
    print("RESULT ok")


if __name__ == "__main__":
    main()
