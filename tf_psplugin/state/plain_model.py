"""Reading a checkpoint into a plain, single-process Keras model (`load_into`).

Why this module exists: serving, debugging and the evaluator read a cluster
job's checkpoints without a cluster. Checkpoints hold full logical tables,
so a model of the same architecture with ordinary variables reads them as
TF's own `tf.train.Checkpoint` does; this adds what a cluster job's model
directory needs on top: the latest committed checkpoint (never an
uncommitted one), its chain of deltas (`incremental`), slots made before
the restore (`optimizer_slots`), and the refusal of slots saved out of a
single-process table's row order (checkpoints without `slot_order`'s
format marker, written before Keras's new optimizers' table slots were
saved per table in logical order).
"""

import tensorflow as tf

from tf_psplugin._internal import tf_objects
from tf_psplugin._internal.compat import keras
from tf_psplugin.state import incremental
from tf_psplugin.state import model_dir as model_dir_lib
from tf_psplugin.state import optimizer_slots
from tf_psplugin.state.model_dir import (CheckpointError, CheckpointInfo, checkpoint_chain,
                                         resolve_checkpoint)
from tf_psplugin.tables import dynamic as dynamic_lib
from tf_psplugin.tables import sharded_slots
from tf_psplugin.tables import slot_order

__all__ = ["load_into"]


def _table_slots_out_of_row_order(model, optimizer, info: CheckpointInfo, names) -> bool:
    """Whether `optimizer` would restore table slots a cluster job saved out of row order.

    A checkpoint with `slot_order`'s marker holds each table's slots of
    Keras's new optimizers as one logical ``[V, D]`` tensor under a plain
    model's key. One without it (written before that layout) lists them as
    the strategy made them: one per table shard on Keras 2.15, one
    `ShardedVariable` per table saved shard after shard on tf-keras 2.16+
    (rows ``i % n == s`` of an interleaved table are not a contiguous
    slice). A plain model's table slot is one variable in row order: on
    Keras 2.15 the shapes differ; on tf-keras 2.16+ they match and the rows
    would be silently permuted (measured on tf-keras 2.21). Legacy
    optimizers' table slots are saved per table in row order
    (`sharded_slots.install_interleaved_slot_lookup`). Only checkpoints a
    `ChiefCheckpointManager` committed are asked about (``model.save_weights``
    of a single process holds row-ordered slots).
    """
    if tf_objects.create_all_weights_of(optimizer) is not None:
        return False  # A legacy optimizer.
    if slot_order.is_marked(names):
        return False
    if not tf.io.gfile.exists(info.path + model_dir_lib.COMMIT_SUFFIX):
        return False
    return any(isinstance(m, (keras.layers.Embedding, dynamic_lib.DynamicEmbedding))
               and m.trainable_weights for m in [model] + list(model.submodules))


def load_into(model, source: str, include_optimizer: bool = False) -> CheckpointInfo:
    """Loads a checkpoint into a plain, single-process Keras model (no cluster).

    Builds nothing distributed: tables are read as full ``[V, D]`` tensors
    into ordinary variables. Use it for serving, debugging and the
    evaluator. Also reads `model.save_weights` checkpoints (e.g. stock
    `ModelCheckpoint(save_weights_only=True)`).

    Example:

    ```python
    model = build_ctr_model(vocab_size=1000)        # same architecture, no strategy
    info = tf_psplugin.load_into(model, "/shared/run1")
    print("step", info.step, model.predict(features))
    ```

    Args:
        model: A built Keras model of the architecture that was trained.
        source: A model directory (latest committed checkpoint) or a prefix.
        include_optimizer: Create `model.optimizer`'s slots first and restore
            them too (to continue training). Without it, a compiled model's
            optimizer step and hyperparameters still come along (Keras
            tracks the optimizer as part of the model), but not its slots.

    Returns:
        The checkpoint that was loaded.

    Raises:
        CheckpointError: no usable checkpoint, or one that does not match.
    """
    info = resolve_checkpoint(source)
    deltas = []
    if tf.io.gfile.isdir(model_dir_lib.resolve(source)):
        info, deltas = checkpoint_chain(source)
    names = tf.train.load_checkpoint(info.path).get_variable_to_shape_map()
    wrapped = any(name.startswith("model/") for name in names)
    optimizer = getattr(model, "optimizer", None) if include_optimizer else None
    if optimizer is not None and _table_slots_out_of_row_order(model, optimizer, info, names):
        raise CheckpointError(
            f"load_into({source!r}, include_optimizer=True) cannot restore "
            f"{type(optimizer).__name__}'s slots of the embedding tables: this checkpoint "
            "was written before tf_psplugin saved Keras's new optimizers' table slots per "
            "table in row order (it has no slot-order marker): they are saved per table "
            "shard (TF 2.15) or in the shards' row order (tf-keras 2.16+), so they would "
            "not load, or would load into the wrong rows. Fix: include_optimizer=False "
            "(the tables, dense weights and the optimizer's step load; the slots start "
            "afresh), or resume the job once with the same PS count and let it write a "
            "new checkpoint.")
    if optimizer is not None:
        sharded_slots.install_interleaved_slot_lookup(optimizer)
        optimizer_slots.build_slots(model, optimizer, None)
    if wrapped:
        root = tf.train.Checkpoint(model=model, **({"optimizer": optimizer} if optimizer else {}))
    else:
        root = tf.train.Checkpoint(root=model)
    try:
        status = root.read(info.path)
        status.expect_partial()
        status.assert_existing_objects_matched()
    except (AssertionError, ValueError) as e:
        raise CheckpointError(
            f"checkpoint {info.path} does not match this model: {str(e).splitlines()[0]} "
            "Fix: build the model with the same function and sizes as the trained one.") from None
    if deltas:
        model_optimizer = getattr(model, "optimizer", None)
        # Keys as the writer's root names them (model and optimizer at the top).
        keys_root = tf.train.Checkpoint(
            model=model, **({"optimizer": model_optimizer} if model_optimizer else {}))

        def skip(key):
            # Without include_optimizer, optimizer values the model has (its step) are
            # still applied; those it has not created (a compiled model that never
            # trained has no hyperparameter variables yet) are skipped.
            return (key.startswith("save_counter/")
                    or (optimizer is None and ".OPTIMIZER_SLOT/" in key)
                    or (optimizer is None and key.startswith("optimizer/")))

        for delta in deltas:
            incremental.apply_delta(keys_root, delta, skip=skip)
        info = deltas[-1]
    return info
