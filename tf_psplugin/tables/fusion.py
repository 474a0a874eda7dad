"""Automatic lookup fusion: a functional model's table lookups, one round trip per PS.

Why this module exists: a CTR model has one `tf.keras.layers.Embedding` per
feature, and each layer's lookup is its own set of cross-process transfers
(ids to every PS, rows back). `lookups.lookup_tables` looks many tables
up in one round trip per PS, but a user's model would have to call it.
This module makes Keras do it, with no change to the model.

How: Keras runs a functional model depth by depth
(`Functional._run_internal_graph`): every layer at one depth runs only after
all layers at greater depths, so all the `Embedding` layers at one depth have
their ids before the first of them runs. When Keras maps the first one's
arguments (`Node.map_arguments`, which receives the run's tensor dictionary),
this module reads the ids of its siblings at the same depth, looks their
tables up together (`lookup_tables`, one group per row width, dtype and PS
count), and each layer's `tf.nn.embedding_lookup` then returns its rows
(`take`, called by the lookup dispatcher of interleaved tables). Every layer
still runs its own `__call__`: input casts, masks, mixed precision, names and
regularizers stay Keras's; only where the rows come from changes, and the
rows and gradients are the same (tests/unit/test_lookup_fusion.py).

Measured (benchmarks/README, "Findings"): on loopback the default 26-table
benchmark model was no faster with it (11.6k vs 11.8k examples/s), so it is
off by default. The time goes to the 26 gathers and 26 updates per PS, not
to the transfers; stacking the tables into one variable removes those, and
this module is the lookup half of that (issue 14).

Scope: functional (and Sequential-in-functional) Keras models under a
`HybridParameterServerStrategy` with ``experimental_fuse_lookups=True`` (every table; off
by default) or ``stack_tables=True`` (the tables of one stack only:
`tables/stacking.py`), in a traced function, dense int32/int64 ids, `Embedding` layers
whose table is sharded over the PS tasks. Anything else (subclassed models, ragged or sparse
ids, feature columns, Estimator) takes the per-layer lookup as before.

Private Keras API (registered in `_tf_internal.PRIVATE_ATTRIBUTES`, checked on
Keras 2.15 and tf-keras 2.21): `Functional._run_internal_graph` is wrapped (to
know which model runs), `Node.map_arguments` is wrapped (to see the tensor
dictionary), and `_nodes_by_depth`, `_single_positional_tensor_passed` and
`_keras_inputs_ids_and_indices` are read. There is no public hook that sees
a functional model's layers before they run.
"""

import functools
from typing import Dict, List, Optional, Tuple

import tensorflow as tf

from tf_psplugin._internal import tf_internal as _tf_internal
from tf_psplugin._internal import tf_objects
from tf_psplugin._internal import keras_members
from tf_psplugin._internal.compat import keras
from tf_psplugin._internal.scopes import ThreadScope
from tf_psplugin.tables import host
from tf_psplugin.tables import prefetched
from tf_psplugin.tables import stacked_updates
from tf_psplugin.tables import stacking
from tf_psplugin.tables.lookups import lookup_tables
from tf_psplugin.tables.sharded import InterleavedShardedVariable



class _Run:
    """One call of a functional model: its depth map and the fused rows."""

    def __init__(self, model):
        self.model = model
        self.depth_of: Optional[Dict[int, int]] = None
        self.fetched = set()  # ids of nodes whose rows are (or will never be) fused
        # (id(table), id(ids)) -> (table, ids, rows); the entry holds the table
        # and the ids so that neither id can be reused during the run.
        self.rows: Dict[Tuple[int, int], tuple] = {}

    def depth(self, node) -> Optional[int]:
        if self.depth_of is None:
            self.depth_of = {id(n): d for d, nodes in tf_objects.nodes_by_depth(self.model).items()
                             for n in nodes}
        return self.depth_of.get(id(node))


def enabled() -> bool:
    """Whether the current strategy fuses lookups: of every table, or of stacked ones."""
    return fuse_all() or _stacking()


def fuse_all() -> bool:
    """Whether the current strategy asks for fused lookups of every table (fuse_lookups)."""
    extended = host.current()
    return extended is not None and bool(extended.fuse_lookups)


def _stacking() -> bool:
    """Whether the current strategy stacks tables (tables/stacking.py): their lookups fuse."""
    extended = host.current()
    return extended is not None and extended.table_stacks is not None


def _one_stack(tables) -> bool:
    """Whether the tables all live in one stack: then one gather per PS serves them."""
    first = tables[0].variables
    return all(len(t.variables) == len(first) and all(a is b for a, b in zip(t.variables, first))
               for t in tables[1:])


def _ids_of(node, tensor_dict):
    """The ids tensor `node` will be called with, without consuming it."""
    if not tf_objects.node_single_positional_tensor(node):
        return None
    kt_id, _ = tf_objects.node_input_ids(node)[0]
    pending = tensor_dict.get(kt_id)
    return pending[-1] if pending else None


def _fusible_table(node):
    """The node's sharded table if its layer is a plain dense-id Embedding."""
    layer = node.layer
    if not isinstance(layer, keras.layers.Embedding) or getattr(layer, "sparse", False):
        return None
    if type(layer).call is not keras.layers.Embedding.call:
        return None  # A subclass with its own call might not look up its input as is.
    table = getattr(layer, "embeddings", None)
    return table if isinstance(table, InterleavedShardedVariable) else None


def _fusible_ids(ids) -> bool:
    # Embedding.call casts other dtypes to int32 first, which makes a new
    # tensor: its lookup would not find these rows.
    return isinstance(ids, tf.Tensor) and ids.dtype in (tf.int32, tf.int64)


def _prefetch(run: _Run, node, tensor_dict) -> None:
    depth = run.depth(node)
    siblings = tf_objects.nodes_by_depth(run.model).get(depth, []) if depth is not None else []
    groups: Dict[tuple, List[tuple]] = {}
    for sibling in siblings:
        run.fetched.add(id(sibling))
        table = _fusible_table(sibling)
        ids = _ids_of(sibling, tensor_dict) if table is not None else None
        if table is None or not _fusible_ids(ids):
            continue
        key = (int(table.shape[-1]), table.dtype.base_dtype, len(table.variables))
        groups.setdefault(key, []).append((table, ids))
    run.fetched.add(id(node))  # Also when Keras gave it no depth (then no siblings).
    everything = fuse_all()
    for members in groups.values():
        if len(members) < 2:
            continue  # One table gains nothing: its own lookup is one round trip.
        tables, ids_list = zip(*members)
        if not everything and not _one_stack(tables):
            continue  # Only stacked tables gain (benchmarks/README, "Findings").
        for (table, ids), rows in zip(members, lookup_tables(tables, ids_list,
                                                             name="fused_lookups")):
            run.rows[(id(table), id(ids))] = (table, ids, rows)


# Inside a Keras model's `__call__` (patched by `patch_keras_functional`).
_IN_MODEL_CALL = ThreadScope()


def separate_before_slots(model) -> None:
    """Splits `model`'s stacks now, as its first traced call would, before slots seal them.

    A fresh run splits a model's stacks per model and per trainability when
    its first traced call starts (`patch_keras_functional`), before its
    optimizer makes slots. A restore (`ChiefCheckpoint`,
    `CheckpointManager`, `load_into`) and `build_optimizer_slots` make the
    slots before any call is traced, which seals the stacks: they call this
    first, so that the stacks, and so the slots a checkpoint holds, are the
    same in a fresh run, after a restore and after `build_optimizer_slots`.
    Any Keras model: functional, Sequential or subclassed, as the
    traced-call split.

    Args:
        model: A Keras model (anything else: nothing happens).
    """
    if isinstance(model, keras.Model):
        _separate(model)


def _separate(model) -> None:
    """`separate_by_model`, each table alone if the model's optimizer needs it."""
    stacking.separate_by_model(
        model, apart=stacked_updates.why_apart(getattr(model, "optimizer", None)))


def patch_keras_functional():
    """Wraps Keras's functional run and argument mapping, and `Model.__call__`; returns the undo.

    Applied through `tf_psplugin._internal.patches` ("keras_functional_fusion").
    A functional model's stacks are split in its run (`_run_internal_graph`),
    any other model's (subclassed: its `call` is the user's) in its
    `__call__`, the public entry of every call of a model, before its `call`
    looks anything up.
    """
    functional = _tf_internal.keras_private_module("engine.functional").Functional
    node_cls = _tf_internal.keras_private_module("engine.node").Node
    run_graph = keras_members.functional_run_internal_graph(functional)
    map_arguments = node_cls.map_arguments
    model_call = vars(keras.Model)["__call__"]  # Keras 2.15, tf-keras 2.16-2.21: Model's own.

    def _run_internal_graph(self, inputs, training=None, mask=None):
        if not (enabled() and tf.inside_function()):
            return run_graph(self, inputs, training=training, mask=mask)
        if _stacking():
            # Before anything reads its stacks: its tables in stacks of
            # their own (not another model's, not its frozen tables').
            _separate(self)
        runs = prefetched.runs()
        runs.append(_Run(self))
        try:
            return run_graph(self, inputs, training=training, mask=mask)
        finally:
            runs.pop()

    def _map_arguments(self, tensor_dict):
        runs = prefetched.runs()
        if runs and id(self) not in runs[-1].fetched and _fusible_table(self) is not None:
            _prefetch(runs[-1], self, tensor_dict)
        return map_arguments(self, tensor_dict)

    def _model_call(self, *args, **kwargs):
        if _IN_MODEL_CALL.active():  # A model inside another: split by the outer one.
            return model_call(self, *args, **kwargs)
        with _IN_MODEL_CALL.scope():
            if not isinstance(self, functional) and tf.inside_function() and _stacking():
                # A subclassed model, before its call reads its stacks: its
                # tables in stacks of their own, as a functional model's run
                # does (and as `separate_before_slots` does for this model).
                _separate(self)
            return model_call(self, *args, **kwargs)

    keras_members.set_functional_run_internal_graph(functional, _run_internal_graph)
    node_cls.map_arguments = _map_arguments
    keras.Model.__call__ = functools.wraps(model_call)(_model_call)

    def undo():
        keras_members.set_functional_run_internal_graph(functional, run_graph)
        node_cls.map_arguments = map_arguments
        keras.Model.__call__ = model_call

    return undo
