"""Optimizer updates of stacked tables: each table's own gradient, one apply per stack shard.

Why this module exists: with ``stack_tables=True`` Keras lists each table's
own rows (`stacking.TableView`) as the layer's weights, and the tape
gives each view its own gradient. What makes stacking fast is that a stack
shard is updated by ONE sparse apply with one set of slots, not one per
table. This module turns the views' gradients into that one update, and
only where no program can tell it from per-table updates.

How: the Keras 2 optimizers (new and legacy) are patched, once, when a
strategy with ``stack_tables=True`` is built (`install`); the patches do
nothing for a variable list without views.

* **Slots** are made for the stack shards, never for views. A legacy
  optimizer of `_ELEMENTWISE_NAMES` makes them from the views (those given
  a gradient, before the merge: `legacy_slots.making_slots_for`), and its
  `add_slot` lists, for a view, that table's rows of the stack shard's
  slot where an unstacked table's shard slot would be (`legacy_slots`);
  another's variable list has each view replaced by its stack shard
  (`substitute`, in `_create_all_weights`). The `build` of each new
  optimizer in `_ELEMENTWISE_NAMES` gets the views followed by their stack
  shards, and lists each table's rows of the stack shard's slot where an
  unstacked table's shard slot would be (`stacked_slots`: its checkpoint
  and `optimizer.variables` are per table); the stack shard's own slot,
  untracked, is what its apply uses.
* **The merge** (`merge`): the gradients of the views of one stack shard
  become one `IndexedSlices` of the stack shard (each view's rows shifted
  to its place). It happens when `apply_gradients` is entered, so that the
  stack shard's gradient is reduced across workers once -- unless the
  optimizer treats each variable on its own before applying (``clipnorm``,
  legacy ``gradient_transformers``, new ``weight_decay`` with its
  per-variable exclusions): then it happens after those, just before the
  applies (legacy `_distributed_apply`, new `_distributed_apply_gradients_fn`),
  and each view keeps its own clipping and decay.
* **`use_ema`** (new optimizers): the moving average is made for the stack
  shard, but updated and written back per table -- the rows of the views
  given a gradient in this call (`_update_model_variables_moving_average`),
  and at the end of `fit` (`finalize_variable_values`) or every
  ``ema_overwrite_frequency`` steps the rows of the tables it is given
  only, never another table's rows of the stack.
* **When one apply equals per-table applies.** An optimizer whose update
  is elementwise (SGD, Adagrad, Adam, ... -- `_ELEMENTWISE`) applied once
  to a stack shard equals its update of each table of the stack, if every
  table of the stack gets a gradient in this call. A table without one (a
  frozen layer's, another model's, one the loss does not use) must not
  move: with a row-local optimizer (`_ROW_LOCAL`: its sparse apply touches
  only the gradient's rows, e.g. Adagrad, SGD, Ftrl) it does not; with
  another (Adam's moment decay moves every row) the stack falls back
  (`stacked_fallback.keep_rows`, logged once per stack): the one apply is made, and then
  the rows of the tables without a gradient, in the stack shard and in each
  of its slots, are written back as they were before it -- per table what
  Keras does unstacked, where a variable without a gradient is not
  touched, bit for bit. An optimizer of another class (a subclass, a
  custom optimizer) gets each table of its model alone in a stack before
  the model's first traced call or its slots (`why_apart`,
  `stacking.separate_by_model`): its one apply is then the table's own.
  A Keras (non-legacy) one applies each view on its own wherever it
  is (`PER_TABLE`, `stacked_fallback.applying_per_table`; logged once per
  stack shared by several tables): its
  `update_step` writes the view's rows through the view's methods, with
  Keras's own slots per view (`slot_build_list` builds them so too), as it
  would an unstacked table's shard. A legacy one on a stack that could
  not be split before (a custom loop: no compiled model names it) stops
  the step's first trace (`SplitRequired`; its kernels would take the
  stack shard's handle): the coordinator splits its tables apart and
  traces the step again (`stacked_fallback.trace_splitting`). Only a stack something still
  holds (a recompile after a traced `fit`: Keras keeps that function) is
  refused, naming the fix. The placement report lists each stack's
  fallback (`note_fallback`).

Private Keras API (registered in `_tf_internal.PRIVATE_ATTRIBUTES`, checked on
Keras 2.15 and tf-keras 2.21): legacy `OptimizerV2._create_all_weights` and
`_distributed_apply`, new `Optimizer._distributed_apply_gradients_fn` and its
two moving-average functions are wrapped; there is no public hook between a
gradient and its apply, nor for the moving average.
"""

from typing import Optional, Sequence

from absl import logging
import tensorflow as tf

from tf_psplugin._internal import tf_objects
from tf_psplugin._internal import keras_members
from tf_psplugin._internal.compat import keras
from tf_psplugin.errors import StackingError  # noqa: F401  (see errors.py)
from tf_psplugin.tables import legacy_slots
from tf_psplugin.tables import slot_split, stack_rows
from tf_psplugin.tables import stacked_fallback
from tf_psplugin.tables import stacked_slots
from tf_psplugin.tables import stacking
from tf_psplugin.tables.stacked_fallback import SplitRequired, take_split_request
from tf_psplugin.tables.stacking import TableView

__all__ = ["PER_TABLE", "SplitRequired", "StackingError", "merge", "patch_keras_optimizers",
           "slot_build_list", "substitute", "take_split_request"]


def _legacy(name):
    return getattr(keras.optimizers.legacy, name, None)


def _new(name):
    return getattr(keras.optimizers, name, None)


def _classes(module_fn, names) -> tuple:
    return tuple(c for c in (module_fn(n) for n in names) if c is not None)


# Optimizers (exact classes) whose update of a variable is elementwise: one
# apply to a stack shard equals one apply to each of its tables.
_ELEMENTWISE_NAMES = ("SGD", "Adagrad", "Adam", "Adamax", "Nadam", "RMSprop", "Adadelta",
                      "Ftrl", "AdamW", "Lion")
# Of those, the ones whose sparse update touches only the gradient's rows
# (checked in their sources: legacy SGD/Adagrad/Ftrl/RMSprop/Adadelta use
# the ResourceSparseApply* kernels or a scatter; new Adagrad scatters; new
# SGD scatters without momentum only).
_LEGACY_ROW_LOCAL_NAMES = ("SGD", "Adagrad", "Ftrl", "RMSprop", "Adadelta")
_NEW_ROW_LOCAL_NAMES = ("Adagrad",)


def _unwrapped(optimizer):
    """The optimizer that applies the updates: a Keras `LossScaleOptimizer`'s inner one.

    A `LossScaleOptimizer` (`mixed_float16`; Keras's compile wraps the
    model's optimizer in one) unscales the gradients and then applies them
    all with its `inner_optimizer`, or skips the whole step: one apply to a
    stack equals per-table applies exactly when its inner optimizer's does.
    """
    while isinstance(optimizer, keras.mixed_precision.LossScaleOptimizer):
        optimizer = optimizer.inner_optimizer
    return optimizer


def _kind(optimizer) -> Optional[str]:
    """"row_local", "elementwise" or None (unknown) for `optimizer`'s class."""
    optimizer = _unwrapped(optimizer)
    cls = type(optimizer)
    legacy_row_local = _classes(_legacy, _LEGACY_ROW_LOCAL_NAMES)
    if cls in legacy_row_local:
        return "row_local"
    new_sgd = _new("SGD")
    if cls in _classes(_new, _NEW_ROW_LOCAL_NAMES) or (
            new_sgd is not None and cls is new_sgd and not _momentum(optimizer)):
        return "row_local"
    if cls in _classes(_legacy, _ELEMENTWISE_NAMES) + _classes(_new, _ELEMENTWISE_NAMES):
        return "elementwise"
    return None


def why_apart(optimizer) -> Optional[str]:
    """Why `optimizer`'s tables each need storage of their own, or None.

    One apply to a stack equals per-table applies only for the optimizers
    known to update elementwise (`_ELEMENTWISE_NAMES`, exact classes: a
    subclass may change the update). Another optimizer's tables are each
    left alone in a stack (`stacking.separate_by_model`), where one apply
    is the table's own.
    """
    if optimizer is None or _kind(optimizer) is not None:
        return None
    name = type(_unwrapped(optimizer)).__name__
    return (f"optimizer {name} is not one whose one update of a stack "
            "is known to equal its updates of each table")


def _momentum(optimizer) -> bool:
    momentum = getattr(optimizer, "momentum", 0.0)
    try:
        return bool(float(momentum) != 0.0)
    except (TypeError, ValueError):  # A tensor or schedule: assume momentum.
        return True


def has_views(variables: Sequence) -> bool:
    """Whether `variables` holds a stacked table's view."""
    return any(isinstance(v, TableView) for v in variables)


def substitute(var_list: Sequence) -> list:
    """`var_list` with each view replaced by its stack shard (once), for making slots."""
    out, seen = [], set()
    for var in var_list:
        if isinstance(var, TableView):
            shard = var.stack_shard
            if id(shard) in seen:
                continue
            seen.add(id(shard))
            var = shard
        out.append(var)
    return out


def merge(optimizer, grads_and_vars) -> list:
    """The views' gradients merged into one gradient per stack shard.

    Pairs of other variables, and views without a gradient (Keras warns
    about and drops those), are kept as they are, in their order; a stack
    shard's merged pair takes the place of its first view.

    Raises:
        SplitRequired: a legacy optimizer's one apply to a stack shard would
            not equal its per-table applies (see the module docstring).
    """
    grads_and_vars = list(grads_and_vars)
    if not any(isinstance(v, TableView) and g is not None for g, v in grads_and_vars):
        return grads_and_vars
    groups = {}
    for grad, var in grads_and_vars:
        if isinstance(var, TableView) and grad is not None:
            groups.setdefault(id(var.stack_shard), []).append((grad, var))
    applies = {key: _check(optimizer, members) for key, members in groups.items()}
    merged = []
    for grad, var in grads_and_vars:
        if not isinstance(var, TableView) or grad is None:
            merged.append((grad, var))
            continue
        key = id(var.stack_shard)
        keep = applies[key]
        if keep == PER_TABLE:
            merged.append((grad, var))  # Applied on its own, in place (`applying_per_table`).
            continue
        members = groups.pop(key, None)
        if members is None:
            continue  # Its stack shard's merged pair is in place of its first view.
        shard = var.stack_shard
        if keep:
            stacked_fallback.set_kept_rows(shard, keep)
        else:
            stacked_fallback.set_kept_rows(shard, [])
        merged.append((_merged_slices(shard, members), shard))
    return merged


def _merged_slices(shard, members) -> tf.IndexedSlices:
    # The usual case in a functional model: the views' gradients are the
    # pieces of one fused gather's gradient, unchanged; that gradient as is.
    whole = stack_rows.whole_gradient([g for g, _ in members])
    if whole is not None:
        return whole
    values, indices = [], []
    for grad, view in members:
        if isinstance(grad, tf.IndexedSlices):
            vals, idx = grad.values, grad.indices
        else:
            vals = tf.convert_to_tensor(grad)
            idx = tf.range(view.num_rows, dtype=tf.int64)
        values.append(vals)
        indices.append(tf.cast(idx, tf.int64) + view.offset)
    dense_shape = tf.constant(shard.shape.as_list(), tf.int32)
    if len(members) == 1:
        return tf.IndexedSlices(values[0], indices[0], dense_shape)
    return tf.IndexedSlices(tf.concat(values, axis=0), tf.concat(indices, axis=0), dense_shape)


def _check(optimizer, members):
    """How the optimizer applies the views' gradients of one stack shard.

    Returns:
        `PER_TABLE`: one apply per view, not merged (a new Keras optimizer
        not known to update a stack as each table, for a stack of several
        tables). Else a list: (first row, row count) of each table of the
        stack that gets no gradient here, if the optimizer's one apply would
        move them (it is not row-local, `keep_rows`); else nothing.

    Raises:
        SplitRequired: a legacy optimizer not known to update a stack as it
            updates each table, and the stack holds other tables too.
    """
    view = members[0][1]
    kind = _kind(optimizer)
    name = type(optimizer).__name__
    tables = list(view.stack.tables)
    if kind is None and _is_new(optimizer):
        # Applied per view, with slots per view (`slot_build_list`), as unstacked.
        if len(tables) > 1:
            _warn_once(view.stack, name, [], members, per_table=True)
        return PER_TABLE
    if kind is None and len(tables) == 1 and tables[0] is view.table:
        return []  # A table alone in its stack: the one apply is its own, for any optimizer.
    if kind is None:
        raise SplitRequired(name, [v.table for _, v in members], _ELEMENTWISE_NAMES)
    if kind == "row_local":
        return []
    present = {id(v) for _, v in members}
    absent = [t for t in view.stack.tables
              if t.views and id(t.views[view.index]) not in present]
    if not absent:
        return []
    _warn_once(view.stack, name, absent, members)
    return sorted((t.row_offsets[view.index], t.shard_counts[view.index]) for t in absent)


def _needs_split(optimizer, grads_and_vars) -> None:
    """Raises `SplitRequired` if a legacy unknown optimizer applies a view of a shared stack.

    Checked when `apply_gradients` is entered, before the optimizer makes
    any slot (which would hold the stack's row layout), also where the
    merge comes later (``clipnorm``).
    """
    if _kind(optimizer) is not None or _is_new(optimizer):
        return
    shared = [v.table for g, v in grads_and_vars
              if isinstance(v, TableView) and g is not None
              and len(list(v.stack.tables)) > 1]
    if shared:
        raise SplitRequired(type(_unwrapped(optimizer)).__name__, shared, _ELEMENTWISE_NAMES)


def note_fallback(stack, kind: str, text: str) -> None:
    """Records a stack's fallback for the placement report (``stack.fallbacks``)."""
    notes = getattr(stack, "fallbacks", None)
    if notes is not None and kind not in notes:
        notes[kind] = text


# Stacks whose fallback was logged (by name, once per process).
_WARNED = set()
# `_check`'s answer for a stack whose views are applied one by one.
PER_TABLE = "per_table"


def _is_new(optimizer) -> bool:
    """Whether `optimizer` applies through a Keras (non-legacy) optimizer's `update_step`."""
    optimizer = _unwrapped(optimizer)
    legacy = getattr(keras.optimizers.legacy, "Optimizer", None)
    return isinstance(optimizer, keras.optimizers.Optimizer) and not (
        legacy is not None and isinstance(optimizer, legacy))


def _warn_once(stack, name, absent, members, per_table=False) -> None:
    trained = sorted({v.table.display_name for _, v in members})
    if per_table:
        note_fallback(stack, "per_table", (
            f"tables {', '.join(sorted(t.display_name for t in stack.tables))} applied per "
            f"table ({name} is not known to update a stack elementwise)"))
    else:
        note_fallback(stack, "keep_rows", (
            f"tables {', '.join(sorted(t.display_name for t in absent))} kept as they were "
            f"while {', '.join(trained)} train ({name} changes every row it updates; they "
            "get no gradient)"))
    if stack.name in _WARNED:
        return
    _WARNED.add(stack.name)
    if per_table:
        logging.warning(
            "stack_tables=True: %s is not an optimizer whose one update of a stack is known to "
            "equal its updates of each table, and stack %s holds several tables (%s, ...): "
            "it updates each table's rows of the stack on its own, with slots of its own "
            "(exact, as unstacked; one apply per table). "
            "HybridParameterServerStrategy(options=HybridOptions(stack_tables=False)) "
            "avoids that cost.",
            name, stack.name, trained)
        return
    logging.warning(
        "stack_tables=True: tables %s share stack %s with tables this apply_gradients "
        "updates (%s) but get no gradient here (frozen, unused by the loss, or another "
        "model's), and %s changes every row of a variable it updates: after its one apply "
        "to the stack, their rows and slot rows are written back as they were (exact, as "
        "unstacked; one read and one write of those rows per step). "
        "HybridParameterServerStrategy(options=HybridOptions(stack_tables=False)) "
        "avoids that cost.",
        sorted(t.display_name for t in absent), stack.name, trained, name)


def _late(optimizer) -> bool:
    """Whether the optimizer treats each variable on its own before applying."""
    if getattr(optimizer, "clipnorm", None) is not None:
        return True
    if getattr(optimizer, "weight_decay", None):
        return True
    try:
        return bool(getattr(optimizer, "gradient_transformers", None))
    except (AttributeError, ValueError):
        return False


def patch_keras_optimizers():
    """Patches the Keras 2 optimizers (see the module docstring); returns the undo.

    Applied through `tf_psplugin._internal.patches` ("keras_stacked_updates").
    """
    undo = [_install_new(keras.optimizers.Optimizer)]
    legacy = getattr(keras.optimizers.legacy, "Optimizer", None)
    if legacy is not None:
        undo.append(_install_legacy(legacy))

    def undo_all():
        for restore in reversed(undo):
            restore()

    return undo_all


def _restorer(cls, names):
    """A function that puts back `cls`'s own attributes `names` as they are now."""
    saved = {name: vars(cls)[name] for name in names if name in vars(cls)}

    def restore():
        for name in names:
            if name in saved:
                setattr(cls, name, saved[name])
            elif name in vars(cls):
                delattr(cls, name)

    return restore


def _install_new(cls):
    # Each known optimizer's `build` makes slots for the stack shards (a user
    # may call `optimizer.build(model.trainable_variables)` before training,
    # as Keras's docs suggest); subclasses loop over the list they are given.
    restore = [_restorer(cls, ("apply_gradients", "_distributed_apply_gradients_fn",
                               "_update_model_variables_moving_average",
                               "_overwrite_model_variables_with_average_value",
                               "add_variable_from_reference"))]
    for known in _classes(_new, _ELEMENTWISE_NAMES):
        if "build" in vars(known) and vars(known)["build"] not in _PATCHED_BUILDS:
            restore.append(_restorer(known, ("build",)))
            known.build = _substituting_build(vars(known)["build"])
    apply_gradients = cls.apply_gradients
    add_variable_from_reference = cls.add_variable_from_reference
    distributed_apply = keras_members.distributed_apply_gradients_fn(cls)

    update_average, overwrite_with_average = keras_members.moving_average_functions(cls)

    def _apply_gradients(self, grads_and_vars, *args, **kwargs):
        grads_and_vars = list(grads_and_vars)
        variables = [v for _, v in grads_and_vars]
        if not has_views(variables):
            return apply_gradients(self, grads_and_vars, *args, **kwargs)
        if not tf_objects.optimizer_built(self) and _builds_per_table(self):
            # Slots per table (`stacked_slots`): built from the views, as
            # Keras's apply_gradients would, before the merge hides them.
            name = kwargs.get("name") or (args[0] if args else None)
            with tf.name_scope(name or self.name or "optimizer"), tf.init_scope():
                self.build(variables)
        # `use_ema` in this call sees the views given a gradient, not the stack shards.
        previous = _APPLYING_VIEWS.get(id(self))
        _APPLYING_VIEWS[id(self)] = _views_by_shard(grads_and_vars)
        try:
            if not _late(self):
                grads_and_vars = merge(self, grads_and_vars)
            return apply_gradients(self, grads_and_vars, *args, **kwargs)
        finally:
            if previous is None:
                _APPLYING_VIEWS.pop(id(self), None)
            else:
                _APPLYING_VIEWS[id(self)] = previous

    def _distributed_apply_gradients_fn(self, distribution, grads_and_vars, **kwargs):
        grads_and_vars = merge(self, grads_and_vars)
        distribution = stacked_fallback.keeping(distribution, self, grads_and_vars)
        if not has_views([v for _, v in grads_and_vars]):
            return distributed_apply(self, distribution, grads_and_vars, **kwargs)
        with stacked_fallback.applying_per_table_scope():
            return distributed_apply(self, distribution, grads_and_vars, **kwargs)

    def _update_model_variables_moving_average(self, var_list):
        others, views = _ema_targets(self, var_list)
        if views and self.use_ema:
            for view in views:
                _average_rows(self, view)
            var_list = others
        return update_average(self, var_list)

    def _overwrite_model_variables_with_average_value(self, var_list):
        others, views = _ema_targets(self, var_list)
        for view in views:
            view.assign(_average_of_view(self, view))
        return overwrite_with_average(self, others if views else var_list)

    def _add_variable_from_reference(self, model_variable, variable_name, shape=None,
                                     initial_value=None):
        slot = stacked_slots.add_slot(self, model_variable, variable_name, shape=shape,
                                      initial_value=initial_value)
        if slot is None:
            slot = add_variable_from_reference(self, model_variable, variable_name, shape=shape,
                                               initial_value=initial_value)
        if stacking.is_stack_shard(model_variable):
            # Its rows of a table without a gradient may have to be kept (`keep_rows`).
            stacked_fallback.record_slot(self, model_variable, slot)
        return slot

    cls.apply_gradients = _apply_gradients
    cls.add_variable_from_reference = _add_variable_from_reference
    keras_members.set_distributed_apply_gradients_fn(cls, _distributed_apply_gradients_fn)
    keras_members.set_moving_average_functions(cls, _update_model_variables_moving_average,
                                            _overwrite_model_variables_with_average_value)
    return lambda: [r() for r in reversed(restore)]


# id(optimizer) -> {id(stack shard): [views given a gradient]} while its
# apply_gradients runs: `use_ema`'s update and overwrite, which Keras runs
# on the merged list (stack shards), act on those views instead.
_APPLYING_VIEWS = {}


def _views_by_shard(grads_and_vars) -> dict:
    out = {}
    for grad, var in grads_and_vars:
        if isinstance(var, TableView) and grad is not None:
            out.setdefault(id(var.stack_shard), []).append(var)
    return out


def _ema_targets(optimizer, var_list):
    """`var_list` as (other variables, views): stack shards stand for their views in this call."""
    applying = _APPLYING_VIEWS.get(id(optimizer), {})
    others, views = [], []
    for var in var_list:
        if isinstance(var, TableView):
            views.append(var)
        elif id(var) in applying:
            views.extend(applying[id(var)])
        else:
            others.append(var)
    return others, views


def _view_rows(view) -> tf.Tensor:
    return tf.range(view.offset, view.offset + view.num_rows, dtype=tf.int64)


def _average_of_view(optimizer, view) -> tf.Tensor:
    """The view's rows of its stack shard's moving average (`use_ema`)."""
    average = keras_members.moving_average_of(optimizer, view.stack_shard)
    with tf.device(average.device):
        return average.sparse_read(_view_rows(view))


def _average_rows(optimizer, view) -> None:
    """Keras's moving-average update of one table: its rows of the stack shard's average."""
    average = keras_members.moving_average_of(optimizer, view.stack_shard)
    momentum = optimizer.ema_momentum
    with tf.device(average.device):
        new = momentum * _average_of_view(optimizer, view) + (1 - momentum) * view.value()
        average.scatter_update(tf.IndexedSlices(new, _view_rows(view)))


# The replacement `build` functions set on Keras optimizer classes (so a
# class is never patched twice, and `_builds_per_table` knows its own).
_PATCHED_BUILDS = set()


def _builds_per_table(optimizer) -> bool:
    """Whether `optimizer`'s `build` lists a stacked table's slots per table (`stacked_slots`).

    True for the optimizers of `_ELEMENTWISE_NAMES` (and their subclasses
    that keep their `build`); another optimizer's `build` is given the stack
    shards (`substitute`): each of its tables is alone in a stack.
    """
    return type(_unwrapped(optimizer)).build in _PATCHED_BUILDS


def slot_build_list(optimizer, var_list: Sequence) -> list:
    """What to give `optimizer.build` to make the slots of `var_list` (a model's variables)."""
    if _builds_per_table(optimizer) or (_kind(optimizer) is None and _is_new(optimizer)):
        return list(var_list)  # Slots per view (an unknown one's: Keras's own, `merge`).
    return substitute(var_list)


def _substituting_build(build):
    def _build(self, var_list):
        var_list = list(var_list)
        if tf_objects.optimizer_built(self) or not has_views(var_list):
            return build(self, substitute(var_list))
        # One slot per stack shard for the apply, listed per table (stacked_slots).
        listed = {id(v) for v in var_list}
        shards = [s for s in substitute(var_list) if id(s) not in listed]
        return stacked_slots.build_per_table(self, build, var_list, shards)

    _PATCHED_BUILDS.add(_build)
    return _build


def _install_legacy(cls):
    restore = _restorer(cls, ("apply_gradients", "_create_all_weights", "_distributed_apply",
                              "add_slot"))
    apply_gradients = cls.apply_gradients
    create_all_weights = tf_objects.create_all_weights_of(cls)
    distributed_apply = keras_members.distributed_apply(cls)
    add_slot = cls.add_slot

    def _apply_gradients(self, grads_and_vars, *args, **kwargs):
        grads_and_vars = list(grads_and_vars)
        if not has_views([v for _, v in grads_and_vars]):
            return apply_gradients(self, grads_and_vars, *args, **kwargs)
        _needs_split(self, grads_and_vars)
        if _late(self):  # Merged in `_distributed_apply`; Keras makes the slots of the views.
            return apply_gradients(self, grads_and_vars, *args, **kwargs)
        # Slots per table (`legacy_slots`): made for the views, as Keras's
        # apply_gradients would, though it is given the merged list.
        with legacy_slots.making_slots_for(self, [v for g, v in grads_and_vars if g is not None]):
            return apply_gradients(self, merge(self, grads_and_vars), *args, **kwargs)

    def _create_all_weights(self, var_list):
        if any(isinstance(v, TableView) or stacking.is_stack_shard(v) for v in var_list):
            slot_split.record_optimizer(self)  # Its slots of a stack move with a split.
        var_list = legacy_slots.slot_variables(self, var_list)
        if _kind(self) is not None:
            # A view's slot is its rows of the stack shard's (`add_slot`).
            return create_all_weights(self, var_list)
        # Another optimizer's tables are each alone in a stack: the stack shard's slots.
        return create_all_weights(self, substitute(var_list))

    def _add_slot(self, var, slot_name, initializer="zeros", shape=None):
        if isinstance(var, TableView):
            return legacy_slots.add_view_slot(self, add_slot, var, slot_name,
                                              initializer=initializer, shape=shape)
        return add_slot(self, var, slot_name, initializer=initializer, shape=shape)

    def _distributed_apply(self, distribution, grads_and_vars, *args, **kwargs):
        grads_and_vars = merge(self, grads_and_vars)
        return distributed_apply(self, stacked_fallback.keeping(distribution, self, grads_and_vars),
                                 grads_and_vars, *args, **kwargs)

    cls.apply_gradients = _apply_gradients
    cls.add_slot = _add_slot
    keras_members.set_create_all_weights(cls, _create_all_weights)
    keras_members.set_distributed_apply(cls, _distributed_apply)
    return restore

