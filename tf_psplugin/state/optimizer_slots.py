"""Optimizer slots made before a restore, so that it fills them at once.

Why this module exists: Keras makes an optimizer's slots in its first
`apply_gradients`, and a restore before that defers the slots' values to a
variable training then discards (tensorflow 62215, for sharded tables).
`ChiefCheckpointManager`, `load_into` and users of stock Keras checkpoint
callbacks (`build_optimizer_slots`) make the slots first, the same way the
model's first traced step would: its stacks split per model first
(`tables.fusion.separate_before_slots`), a stacked table's slots listed per
table (`tables.stacked_updates.slot_build_list`), in the strategy's scope.
"""

import tensorflow as tf

from tf_psplugin._internal import tf_objects
from tf_psplugin.tables import fusion
from tf_psplugin.tables import sharded_slots
from tf_psplugin.tables import slot_order
from tf_psplugin.tables import stacked_updates

__all__ = ["build_optimizer_slots", "build_slots", "install_checkpoint_listing",
           "match_checkpoint"]


def install_checkpoint_listing(optimizer) -> None:
    """Makes `optimizer` checkpoint its table slots per table in logical row order.

    Legacy optimizers through `sharded_slots`, Keras's new ones through
    `slot_order` (with its format marker). Call before the optimizer makes
    its slots; idempotent.
    """
    sharded_slots.install_interleaved_slot_lookup(optimizer)
    slot_order.install(optimizer)


def match_checkpoint(model, optimizer, path: str):
    """Lists the optimizer's table slots as checkpoint `path` does (`slot_order.match_checkpoint`).

    Args:
        model: The model (its `optimizer` is used when `optimizer` is None).
        optimizer: The optimizer restored into, or None.
        path: The checkpoint prefix about to be restored.

    Returns:
        The optimizer (for `slot_order.end_restore` once the restore is done).
    """
    if optimizer is None:
        optimizer = getattr(model, "optimizer", None)
    slot_order.match_checkpoint(optimizer, path)
    return optimizer


def build_slots(model, optimizer, strategy) -> None:
    """Creates the optimizer's slots now, so that a restore fills them at once."""
    if model is None or optimizer is None or not getattr(model, "trainable_variables", None):
        return
    # Slots seal the stacks they are made for: split the model's stacks first,
    # as its first traced call does in a fresh run (same stacks, same slots).
    fusion.separate_before_slots(model)
    # Keras 2 legacy optimizers have no public "create slots" call (they
    # create them in the first apply_gradients); `_create_all_weights` is what
    # that calls (tf.keras 2.15, tf-keras 2.16-2.21). New optimizers: `build`.
    create = tf_objects.create_all_weights_of(optimizer)
    # In the strategy's scope, as in `fit` (ChiefCheckpoint restores there): the
    # strategy makes the slots (a half-precision table's are float32).
    scope = strategy.scope() if strategy is not None else tf.distribute.get_strategy().scope()
    if create is None:
        build = getattr(optimizer, "build", None)
        if build is not None:
            with scope:
                # Idempotent. A stacked table's slots are its stack shards', listed
                # per table by Keras's known optimizers (tables/stacked_slots.py).
                build(stacked_updates.slot_build_list(optimizer, model.trainable_variables))
        return
    with scope:
        create(model.trainable_variables)


def build_optimizer_slots(model) -> None:
    """Creates `model.optimizer`'s slots now; call before stock Keras restores.

    `ChiefCheckpoint`, `ChiefCheckpointManager` and `load_into` do this
    themselves. Call it once after `compile` (inside or outside
    `strategy.scope()`) when you use stock `ModelCheckpoint`,
    `BackupAndRestore` or `model.load_weights` with sharded tables: Keras
    restores the slots of a table that have not been created yet into a
    variable that training then discards (tensorflow 62215), so without this
    the embedding accumulators restart from their initial value. It also
    makes slots of interleaved tables checkpoint in logical row order, so
    they restore into another number of PS tasks (legacy and new Keras
    optimizers; call it before the first training step).

    Args:
        model: A compiled Keras model.
    """
    optimizer = getattr(model, "optimizer", None)
    install_checkpoint_listing(optimizer)
    build_slots(model, optimizer, getattr(model, "distribute_strategy", None))
