"""Export for serving: a SavedModel with full tables that needs no cluster.

Why this module exists: a model trained with `HybridParameterServerStrategy`
holds its tables as shards on PS tasks and its dense weights as replicated
variables, and `model.save()` on the chief would record that distributed
structure (and, for interleaved tables, their shard layout) in the
SavedModel, which then cannot be loaded where the cluster is gone. Serving
wants the opposite: one ordinary ``[V, D]`` variable per table and plain
dense variables. So the chief builds a plain local copy of the model outside
the strategy (same architecture, via a model-building function or
`tf.keras.models.clone_model`), copies every weight into it -- tables as
full tensors in logical row order, dense weights from the chief's primaries
(pulled from worker 0) -- and saves that copy. Only the chief writes the
export, into a temporary directory renamed into place when complete.

`export_from_checkpoint` does the same offline from a committed checkpoint
(with its chain of deltas), with no cluster at all.

Every export also carries ``assets.extra/tf_psplugin_serving.json``: each
variable's checkpoint key and, for `export_from_checkpoint`, the checkpoint
it holds, so that `tf_psplugin.ServingModel` can update it in place from
the chief's later deltas (see `tf_psplugin.state.serving`).
"""

import os
import uuid
from typing import Callable, List, Optional

import numpy as np
import tensorflow as tf

from tf_psplugin._internal import tf_objects
from tf_psplugin._internal import verbosity as verbosity_lib
from tf_psplugin.errors import ExportError  # noqa: F401  (see errors.py)
from tf_psplugin.state import checkpoint as checkpoint_lib
from tf_psplugin.state import model_dir as model_dir_lib
from tf_psplugin.state import serving as serving_lib
from tf_psplugin.tables import dynamic as dynamic_lib

__all__ = ["ExportError", "export_from_checkpoint", "export_saved_model", "logical_weights"]


def logical_weights(model) -> List[np.ndarray]:
    """`model.get_weights()` with every sharded table as ONE full array.

    Keras lists a sharded table's shards as separate weights; here they are
    replaced (at the first shard's position) by the whole table in logical
    row order, so the list lines up with a plain model's `get_weights()`.
    Replicated dense weights are read from the chief's primaries, which
    first waits for in-flight steps and pulls worker 0's values.

    Args:
        model: A Keras model, distributed or not.

    Returns:
        One numpy array per logical weight.
    """
    values, seen = [], set()
    for weight in model.weights:
        # TF sets `_sharded_container` (a weakref) on every shard of a
        # ShardedVariable (2.15-2.21); Keras lists the shards, not the table.
        # (A stacked table sets it on its views, which Keras lists.)
        container = tf_objects.sharded_container(weight)
        if container is not None:
            if id(container) in seen:
                continue
            seen.add(id(container))
            values.append(tf.convert_to_tensor(container).numpy())
        else:
            values.append(weight.numpy())
    return values


def _copy_weights(source, target) -> None:
    values = logical_weights(source)
    if len(values) != len(target.weights):
        raise ExportError(
            f"the local copy has {len(target.weights)} weights but the trained model has "
            f"{len(values)} (tables counted once). Fix: pass model_fn= that builds exactly the "
            "trained architecture (subclassed models cannot be cloned).")
    for value, weight in zip(values, target.weights):
        if tuple(value.shape) != tuple(weight.shape):
            raise ExportError(
                f"weight {weight.name} of the local copy has shape {tuple(weight.shape)}, the "
                f"trained value has {tuple(value.shape)}. Fix: build the local copy with the "
                "same sizes (vocab_size, embedding_dim, ...).")
    target.set_weights(values)
    for mine, theirs in zip(_dynamic_layers(target), _dynamic_layers(source)):
        mine.copy_key_index_from(theirs)  # The key -> row maps are not weights.


def _dynamic_layers(model):
    return [m for m in model.submodules if isinstance(m, dynamic_lib.DynamicEmbedding)]


def _save_atomically(model, export_dir: str, overwrite: bool,
                     checkpoint: Optional[model_dir_lib.CheckpointInfo] = None) -> str:
    export_dir = model_dir_lib.resolve(export_dir)
    if tf.io.gfile.exists(export_dir):
        if not overwrite:
            raise ExportError(f"export directory {export_dir} already exists. Fix: pass "
                              "overwrite=True or choose a new directory (e.g. one per step).")
    parent = os.path.dirname(export_dir.rstrip("/"))
    if parent:
        model_dir_lib.ensure_writable(parent)
    tmp = f"{export_dir.rstrip('/')}.tmp-{uuid.uuid4().hex[:8]}"
    for layer in _dynamic_layers(model):
        layer.freeze_for_serving()  # Its maps saved with it; lookups only.
    metadata = serving_lib.serving_metadata(model, checkpoint)
    try:
        # SavedModel writing logs "Assets written to", "Writing fingerprint" at INFO.
        with verbosity_lib.quiet_tf_info(verbosity_lib.TF_LOGGER, verbosity_lib.ABSL_LOGGER):
            model.save(tmp, save_format="tf", include_optimizer=False)
        serving_lib.write_metadata(tmp, metadata)  # For a ServingModel following deltas.
        if tf.io.gfile.exists(export_dir):
            tf.io.gfile.rmtree(export_dir)
        tf.io.gfile.rename(tmp, export_dir)
    finally:
        if tf.io.gfile.exists(tmp):
            tf.io.gfile.rmtree(tmp)
    return export_dir


def _local_copy(model, model_fn: Optional[Callable[[], tf.keras.Model]]):
    if tf.distribute.has_strategy():
        raise ExportError(
            "export was called inside strategy.scope(), where every new variable would be "
            "distributed again. Fix: call it after the `with strategy.scope():` block "
            "(e.g. after model.fit returns).")
    try:
        local = model_fn() if model_fn is not None else tf.keras.models.clone_model(model)
    except (ValueError, TypeError, NotImplementedError) as e:
        raise ExportError(f"cannot build a local copy of the model ({e}). Fix: pass model_fn= "
                          "that builds the same architecture with no strategy.") from None
    if not local.built:
        raise ExportError("the local copy is not built (no weights yet). Fix: make model_fn "
                          "return a built model (functional, or call it once on inputs).")
    return local


def export_saved_model(model, export_dir: str,
                       model_fn: Optional[Callable[[], tf.keras.Model]] = None,
                       overwrite: bool = False) -> str:
    """Exports a distributed Keras model as a SavedModel that needs no cluster.

    Call it on the chief, outside `strategy.scope()`, e.g. after `model.fit`.
    The SavedModel has the plain model's call signature (``serving_default``)
    and no optimizer; load it with `tf.saved_model.load` or
    `tf.keras.models.load_model` anywhere.

    Example:

    ```python
    model.fit(...)
    tf_psplugin.export_saved_model(model, "/shared/run1/export/300",
                                   model_fn=lambda: build_ctr_model(vocab_size=1000))
    ```

    Args:
        model: The trained model (built in `strategy.scope()`).
        export_dir: Where the SavedModel goes (local or remote path).
        model_fn: Builds the same architecture; default
            `tf.keras.models.clone_model(model)` (functional/Sequential only).
        overwrite: Replace an existing `export_dir`.

    Returns:
        The absolute export directory.

    Raises:
        ExportError: inside a strategy scope, in a non-chief task, for an
            architecture mismatch, or an existing `export_dir`.
    """
    if not model_dir_lib.is_chief_task():
        raise ExportError("only the chief exports (other tasks never write). Fix: call "
                          "export_saved_model in the chief's branch of the script.")
    local = _local_copy(model, model_fn)
    _copy_weights(model, local)
    return _save_atomically(local, export_dir, overwrite)


def export_from_checkpoint(model_fn: Callable[[], tf.keras.Model], source: str,
                           export_dir: str, overwrite: bool = False) -> str:
    """Exports a committed checkpoint as a SavedModel, offline (no cluster).

    Args:
        model_fn: Builds the trained architecture (no strategy).
        source: A model directory (its latest committed checkpoint) or a
            checkpoint prefix.
        export_dir: Where the SavedModel goes.
        overwrite: Replace an existing `export_dir`.

    Returns:
        The absolute export directory.

    Raises:
        ExportError, CheckpointError: as for `export_saved_model`/`load_into`.
    """
    local = _local_copy(None, model_fn)
    info = checkpoint_lib.load_into(local, source)
    return _save_atomically(local, export_dir, overwrite, checkpoint=info)
