"""Creates embedding tables as row shards on the PS tasks, in TF1 graph mode.

Why this module exists: an unmodified Estimator model creates its embedding
tables itself (``tf.feature_column.embedding_column`` through a Keras
``DenseFeatures`` layer, or ``tf.compat.v1.get_variable`` in a custom
``model_fn``), as ONE variable of the full shape. The only place the plugin
sees that variable before it exists is the distribution strategy's variable
creator. This module turns such a request into ``num_ps`` row shards, one per
PS task, wrapped in a ``PartitionedVariable`` -- the TF1 container every
consumer of a table already understands:

* ``tf.nn.embedding_lookup`` and ``safe_embedding_lookup_sparse`` (what
  feature columns call) accept it and route each id to its shard;
* Keras ``add_weight`` unpacks it into its shards, so each shard gets its own
  optimizer slots, created next to it on the same PS;
* the V1 ``Saver`` writes the shards as slices of ONE logical tensor named
  like the unsharded variable, so a checkpoint restores into a plain
  single-process estimator (the evaluator), or into a different number of PS
  tasks.

Rows are split in contiguous ranges (TF's ``div`` layout), not interleaved:
the lookup code in an unmodified model is not ours, and both the feature
column lookups and checkpoint slices assume ranges. An interleaved layout would
silently send ids to the wrong rows.

Private TensorFlow APIs (checked against TF 2.15.1), imported from `_tf_internal`:
``tensorflow.python.ops.variables.PartitionedVariable`` (not exported; it is
what ``get_variable(partitioner=...)`` returns) and
``Variable._set_save_slice_info`` (how ``get_variable`` marks a shard as a
slice of the full checkpoint tensor).
"""

import re
from typing import Any, Callable, List, Optional, Sequence

import tensorflow as tf
from absl import logging

from tf_psplugin._internal import tf_objects
from tf_psplugin._internal.tf_internal import tf_variables
from tf_psplugin.cluster.devices import ps_device
from tf_psplugin.tables import placement as placement_lib
from tf_psplugin.tables.shard_init import shape_and_dtype

_PART_SUFFIX = re.compile(r"/part_\d+$")
_LARGE_INIT_ELEMENTS = 1 << 24


def shards_of(variable: Any) -> List[Any]:
    """The shards of a `PartitionedVariable`, or ``[variable]``."""
    if isinstance(variable, tf_variables.PartitionedVariable):
        return list(variable)
    return [variable]


def row_offsets(num_rows: int, num_shards: int) -> List[int]:
    """Returns shard start rows plus ``num_rows``, TF's ``div`` layout.

    The first ``num_rows % num_shards`` shards get one extra row, exactly as
    ``tf.compat.v1.get_variable`` partitions and as
    ``embedding_lookup(partition_strategy="div")`` expects.

    Args:
        num_rows: Rows of the full table.
        num_shards: Number of shards (>= 1, <= num_rows).

    Returns:
        ``num_shards + 1`` offsets, starting at 0 and ending at ``num_rows``.
    """
    base, extra = divmod(num_rows, num_shards)
    offsets = [0]
    for i in range(num_shards):
        offsets.append(offsets[-1] + base + (1 if i < extra else 0))
    return offsets


def already_partitioned(name: Optional[str]) -> bool:
    """True if ``name`` is one partition of a model's own partitioned variable."""
    return bool(name) and bool(_PART_SUFFIX.search(str(name).split(":")[0]))


def is_table_request(policy: placement_lib.PlacementPolicy, kwargs: dict) -> bool:
    """Applies the shared placement rule to a variable-creator request.

    Args:
        policy: The placement rule.
        kwargs: The keyword arguments a variable creator received.

    Returns:
        True if the requested variable is an embedding table.
    """
    shape, dtype = shape_and_dtype(kwargs)
    if shape is None or shape.rank is None:
        return placement_lib.in_embedding_table_scope()
    dtype_size = dtype.size if dtype is not None else 4
    return policy.is_table(kwargs.get("name"), shape.as_list(), dtype_size)


def _shard_initial_value(
    initial_value: Any, name: str, shape: tf.TensorShape, offsets: Sequence[int], index: int
) -> Callable[[], tf.Tensor]:
    """Returns a callable computing shard ``index``'s initial value.

    Keras initializers accept ``partition_shape``/``partition_offset`` and then
    generate only the shard (no full-size tensor anywhere). Other initial
    values are computed in full on the shard's device and sliced, as
    ``ParameterServerStrategy`` does (with a warning for large tables).
    """
    rows = offsets[index + 1] - offsets[index]
    partition_shape = (rows,) + tuple(shape.as_list()[1:])
    partition_offset = (offsets[index],) + (0,) * (shape.rank - 1)

    def compute():
        if callable(initial_value):
            try:
                value = initial_value(
                    partition_shape=partition_shape, partition_offset=partition_offset
                )
            except (TypeError, ValueError):  # Not a partition-aware initializer.
                value = initial_value()
        else:
            value = initial_value
        value = tf.convert_to_tensor(value)
        if tuple(value.shape.as_list()) == partition_shape:
            return value
        if index == 0 and shape.num_elements() and shape.num_elements() > _LARGE_INIT_ELEMENTS:
            logging.warning(
                "tf_psplugin: the initializer of table %s does not support partitions; each "
                "shard computes the full %s value and slices it.", name, shape,
            )
        return value[offsets[index] : offsets[index + 1]]

    return compute


def create_sharded_table(
    next_creator: Callable[..., tf.Variable],
    kwargs: dict,
    num_ps: int,
    collections: Optional[List[str]] = None,
) -> Any:
    """Creates a table as contiguous row shards, shard ``i`` on PS task ``i``.

    Args:
        next_creator: The next variable creator in the chain.
        kwargs: The creator's keyword arguments for the full table.
        num_ps: Number of PS tasks (>= 1).
        collections: Graph collections for the shards; None keeps TF's
            default (global variables). Non-chief workers pass ``[]`` so they
            never initialize, restore or save the shared shards.

    Returns:
        A ``PartitionedVariable`` (several shards) or a single variable placed
        on PS task 0 when the table has fewer rows than PS tasks would need,
        or when its shape is not known before initialization.
    """
    kwargs = dict(kwargs)
    kwargs.pop("colocate_with", None)
    if collections is not None:
        kwargs["collections"] = list(collections)
    shape, dtype = shape_and_dtype(kwargs)
    name = kwargs.get("name") or "table"
    if shape is None or shape.rank is None or not shape.is_fully_defined() or shape.rank < 1:
        logging.warning(
            "tf_psplugin: table %s has no static shape, so it is placed whole on %s instead of "
            "being sharded.", name, ps_device(0),
        )
        return create_on_device(next_creator, kwargs, ps_device(0))
    num_shards = max(1, min(num_ps, shape[0]))
    if num_shards == 1:
        return create_on_device(next_creator, kwargs, ps_device(0))
    offsets = row_offsets(shape[0], num_shards)
    initial_value = kwargs.get("initial_value")
    shards = []
    for i in range(num_shards):
        shard_kwargs = dict(kwargs)
        shard_kwargs["name"] = f"{name}/part_{i}"
        shard_kwargs["shape"] = tf.TensorShape([offsets[i + 1] - offsets[i]] + shape.as_list()[1:])
        shard_kwargs["initial_value"] = _shard_initial_value(initial_value, name, shape, offsets, i)
        shards.append(create_on_device(next_creator, shard_kwargs, ps_device(i % num_ps)))
    full_name = _PART_SUFFIX.sub("", shards[0].op.name)
    for i, shard in enumerate(shards):
        # Private API (TF 2.15.1, via the adapter): marks the shard as rows [offsets[i],
        # offsets[i+1]) of the checkpoint tensor `full_name`, exactly what
        # get_variable(partitioner=...) does. No public API sets it.
        tf_objects.set_save_slice_info(
            shard,
            tf.Variable.SaveSliceInfo(
                full_name,
                shape.as_list(),
                [offsets[i]] + [0] * (shape.rank - 1),
                shard.shape.as_list(),
            )
        )
    # Private API (TF 2.15.1): the container get_variable returns for a
    # partitioned variable; lookups, Keras and the Saver all accept it.
    return tf_variables.PartitionedVariable(
        name=full_name,
        shape=shape.as_list(),
        dtype=dtype or shards[0].dtype,
        variable_list=shards,
        partitions=[num_shards] + [1] * (shape.rank - 1),
    )


def create_on_device(next_creator: Callable[..., tf.Variable], kwargs: dict, device: str):
    """Creates one variable on ``device``, ignoring any colocation in scope."""
    kwargs = dict(kwargs)
    kwargs.pop("colocate_with", None)
    with tf.compat.v1.colocate_with(None, ignore_existing=True), tf.device(device):
        return next_creator(**kwargs)

