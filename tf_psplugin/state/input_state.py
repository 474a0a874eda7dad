"""Where each worker's input stands: saved with a checkpoint, restored on resume.

Why this module exists: a restarted job must not read its input again from
the start to find where it stopped. Skipping (`Dataset.skip`) reads and
parses every skipped record, so a restart late in a long job spent minutes
re-reading, and with input sharded by file each worker would have to know
how much of its own files to skip. tf.data can save an iterator's exact
state instead (`SerializeIterator`: a `TextLineDataset` or
`TFRecordDataset` saves its file and byte offset, an interleave its open
inputs, a shuffle its buffer), and restoring it seeks without reading: the
time to the first step does not grow with the steps already done.

Under a parameter-server strategy the iterators live on the workers, one
per worker, and only the chief runs Python. Stock PSS cannot checkpoint
them. Here the chief runs two ops on each worker's own device, against that
worker's iterator resource: `SerializeIterator` then `SaveV2` into
``<checkpoint>.input/worker-<i>`` in the shared model directory (each
worker writes its own file, as PS tasks write their table shards), and on
resume `RestoreV2` then `DeserializeIterator` into the new iterator. Nothing
passes through the chief.

The saved state belongs to one input pipeline and one number of workers
(each worker's shard differs): `restore` checks both and otherwise leaves
the input at its start with a warning that says why.

Private TF API: the iterator resource of an `OwnedIterator`
(`_iterator_resource`) and the per-worker values of a per-worker iterator
(`_values`, `RemoteValueImpl._get_values`); registered in
`_tf_internal.PRIVATE_ATTRIBUTES`. The ops are public (`tf.raw_ops`).
"""

import json
import os
from typing import Any, List, Optional

import tensorflow as tf
from absl import logging

from tf_psplugin.errors import InputStateError  # noqa: F401  (see errors.py)

# A pipeline with external state (a `py_function`, a stateful op whose state
# lives outside the iterator) cannot be saved faithfully: fail its save
# (caught below: the checkpoint is still written, without input state).
_FAIL_ON_EXTERNAL_STATE = 2  # tf.data.experimental.ExternalStatePolicy.FAIL
_TENSOR_NAME = "iterator"
META_FILE = "meta.json"


def state_dir(checkpoint_path: str) -> str:
    """The directory holding the input state saved with `checkpoint_path` (`ckpt-N`)."""
    return checkpoint_path + ".input"


def _worker_prefix(directory: str, worker: int) -> str:
    return os.path.join(directory, f"worker-{worker}")


def _per_worker_iterators(iterator) -> Optional[List[Any]]:
    """Each worker's `OwnedIterator` behind a per-worker iterator, or None."""
    values = getattr(iterator, "_values", None)  # PerWorkerValues / PerWorkerDistributedIterator
    if not values:
        return None
    owned = []
    for value in values:
        get = getattr(value, "_get_values", None)  # RemoteValueImpl: the worker's value
        it = get() if get is not None else None
        if getattr(it, "_iterator_resource", None) is None:
            return None
        owned.append(it)
    return owned


def _element_spec_text(owned) -> str:
    return repr(getattr(owned[0], "element_spec", None))


def _worker_device(worker: int) -> str:
    return f"/job:worker/replica:0/task:{worker}"


def save(iterator, checkpoint_path: str) -> bool:
    """Saves every worker's position in `iterator` beside `checkpoint_path`.

    Call it with no step in flight (the checkpoint code joins first), so the
    positions are those after the checkpoint's step.

    Args:
        iterator: The per-worker iterator the training steps read
            (`iter(coordinator.create_per_worker_dataset(...))`).
        checkpoint_path: The checkpoint's prefix (``<model_dir>/ckpt-<step>``).

    Returns:
        True if saved; False (after a warning) if the input cannot be saved,
        e.g. a pipeline with external state; the checkpoint is valid either way.
    """
    owned = _per_worker_iterators(iterator)
    if owned is None:
        logging.warning("tf_psplugin: the training input is not a per-worker iterator; its "
                        "position is not saved with %s.", checkpoint_path)
        return False
    directory = state_dir(checkpoint_path)
    tf.io.gfile.makedirs(directory)
    try:
        for worker, it in enumerate(owned):
            with tf.device(_worker_device(worker)):
                state = tf.raw_ops.SerializeIterator(
                    resource_handle=it._iterator_resource,  # pylint: disable=protected-access
                    external_state_policy=_FAIL_ON_EXTERNAL_STATE)
                tf.raw_ops.SaveV2(prefix=_worker_prefix(directory, worker),
                                  tensor_names=[_TENSOR_NAME], shape_and_slices=[""],
                                  tensors=[state])
    except (tf.errors.FailedPreconditionError, tf.errors.UnimplementedError,
            tf.errors.InvalidArgumentError) as e:
        logging.warning(
            "tf_psplugin: the input's position cannot be saved (%s); %s holds the model but not "
            "where each worker's input stands, so a job resumed from it reads its input from the "
            "start. Fix: keep stateful Python (py_function) out of the input pipeline.",
            getattr(e, "message", e), checkpoint_path)
        tf.io.gfile.rmtree(directory)
        return False
    meta = {"num_workers": len(owned), "element_spec": _element_spec_text(owned)}
    with tf.io.gfile.GFile(os.path.join(directory, META_FILE), "w") as f:
        f.write(json.dumps(meta))
    return True


def saved(checkpoint_path: str) -> bool:
    """Whether input state was saved with `checkpoint_path`."""
    return tf.io.gfile.exists(os.path.join(state_dir(checkpoint_path), META_FILE))


def restore(iterator, checkpoint_path: str) -> bool:
    """Moves every worker's `iterator` to where it stood at `checkpoint_path`.

    Call it on a fresh iterator, before its first step.

    Args:
        iterator: The new per-worker iterator over the same input.
        checkpoint_path: The checkpoint the model was restored from.

    Returns:
        True if every worker's position was restored; False (after a warning
        naming why) if the checkpoint has no input state, or it belongs to
        another number of workers or another input: the input then starts
        from its beginning.
    """
    directory = state_dir(checkpoint_path)
    meta_path = os.path.join(directory, META_FILE)
    if not tf.io.gfile.exists(meta_path):
        logging.warning("tf_psplugin: %s holds no input position; the input starts from its "
                        "beginning.", checkpoint_path)
        return False
    with tf.io.gfile.GFile(meta_path) as f:
        meta = json.loads(f.read())
    owned = _per_worker_iterators(iterator)
    if owned is None:
        logging.warning("tf_psplugin: the training input is not a per-worker iterator; its "
                        "position in %s is not restored.", checkpoint_path)
        return False
    why = None
    if meta.get("num_workers") != len(owned):
        why = (f"it was saved by {meta.get('num_workers')} workers and this job has {len(owned)} "
               "(each worker's share of the input differs)")
    elif meta.get("element_spec") != _element_spec_text(owned):
        why = (f"it was saved for input elements {meta.get('element_spec')}, and this input has "
               f"{_element_spec_text(owned)}")
    errors = (tf.errors.NotFoundError, tf.errors.InvalidArgumentError,
              tf.errors.FailedPreconditionError, tf.errors.DataLossError)
    states = []
    if why is None:
        try:  # Read every worker's state first: all or nothing.
            for worker in range(len(owned)):
                with tf.device(_worker_device(worker)):
                    states.append(tf.raw_ops.RestoreV2(
                        prefix=_worker_prefix(directory, worker), tensor_names=[_TENSOR_NAME],
                        shape_and_slices=[""], dtypes=[tf.variant])[0])
        except errors as e:
            why = f"reading it failed ({getattr(e, 'message', e)})"
    for worker, (it, state) in enumerate(zip(owned, states) if why is None else ()):
        try:
            with tf.device(_worker_device(worker)):
                tf.raw_ops.DeserializeIterator(
                    resource_handle=it._iterator_resource,  # pylint: disable=protected-access
                    serialized=state)
        except errors as e:
            if worker > 0:  # Earlier workers moved already: no consistent way back.
                raise InputStateError(
                    f"the input position saved with {checkpoint_path} was restored on workers "
                    f"0-{worker - 1} but not on worker {worker} ({getattr(e, 'message', e)}). "
                    "Fix: resume with the input pipeline the checkpoint was written with, or "
                    f"delete {directory} to start the input from its beginning.") from None
            why = (f"it does not fit this input pipeline ({getattr(e, 'message', e)}); is it the "
                   "one the checkpoint was written with?")
            break
    if why is not None:
        logging.warning("tf_psplugin: the input position saved with %s is not restored: %s. The "
                        "input starts from its beginning.", checkpoint_path, why)
        return False
    logging.info("tf_psplugin: each worker's input continues where it stood at %s",
                 checkpoint_path)
    return True


def remove(checkpoint_path: str) -> None:
    """Deletes the input state saved with `checkpoint_path` (with the checkpoint)."""
    directory = state_dir(checkpoint_path)
    if tf.io.gfile.exists(directory):
        tf.io.gfile.rmtree(directory)
