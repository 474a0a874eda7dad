"""Per-worker datasets in synchronous mode: each worker its own shard of the input.

`HybridClusterCoordinator.create_per_worker_dataset` (what Keras's `fit` and
custom loops call) comes here. A `tf.data.Dataset` is sharded with tf.data's
auto-shard policy as MultiWorkerMirroredStrategy applies it (by file when it
reads files and there are enough of them, else by batch); a dataset function
shards itself. Finite input ends on every worker at the same step
(`epochs.SyncPerWorkerDataset`).
"""

import logging as std_logging
import warnings
from typing import Optional

import tensorflow as tf
from absl import logging

from tf_psplugin import epochs as epochs_lib
from tf_psplugin._tf_internal import cluster_coordinator, coordinator_values, input_ops


class WorkerDatasetsMixin:
    """Per-worker datasets and file sharding (moved as is)."""

    @property
    def examples_per_step(self) -> Optional[int]:
        """Examples one scheduled step consumes, from the last per-worker dataset.

        The dataset's static batch dimension times the workers a step runs
        on (all of them in synchronous mode, one otherwise); None when the
        batch dimension is not static (e.g. `batch` without
        `drop_remainder=True`).
        """
        return self._examples_per_step

    def create_per_worker_dataset(self, dataset_fn):
        """Creates a dataset on every worker; in sync mode each gets a shard.

        A `tf.data.Dataset` (or one distributed with
        `strategy.experimental_distribute_dataset`) is sharded with tf.data's
        auto-shard policy: by file when it reads files (worker `i` of `n`
        opens files `i, i+n, ...`), otherwise by batch (worker `i` reads
        batches `i, i+n, ...`, so one synchronous step consumes `n`
        consecutive batches and the global batch is `n` times the dataset's
        batch); `tf.data.Options().experimental_distribute.auto_shard_policy`
        chooses otherwise (OFF: every worker reads all of it). A dataset
        function runs on each worker and is expected to shard itself
        (`experimental_get_current_worker_index`).
        Finite data ends on every worker at the same step: training input
        is cut to the shortest worker's length, evaluation input padded to
        the longest with empty batches (see `epochs.py`).

        Args:
            dataset_fn: A dataset, distributed dataset, or a function.

        Returns:
            A per-worker dataset, as from the stock coordinator. Also
            records `examples_per_step`.
        """
        per_worker = self._create_per_worker_dataset(dataset_fn)
        self._examples_per_step = _static_batch_size(per_worker)
        if self._examples_per_step is not None and self._synchronous:
            self._examples_per_step *= self._num_workers
        return per_worker

    def _create_per_worker_dataset(self, dataset_fn):
        """Builds the per-worker dataset (see `create_per_worker_dataset`)."""
        if not self._synchronous:
            return super().create_per_worker_dataset(dataset_fn)
        evaluation = epochs_lib.building_evaluation_inputs()
        if callable(dataset_fn) and not isinstance(dataset_fn, tf.data.Dataset):
            per_worker = super().create_per_worker_dataset(dataset_fn)
            if _returns_dataset(per_worker):
                # The user's function shards itself: its lengths may differ
                # per worker, so the epoch length is agreed on (epochs.py).
                return epochs_lib.SyncPerWorkerDataset(
                    per_worker._dataset_fn, self, evaluation)  # pylint: disable=protected-access
            return per_worker  # E.g. Keras's DatasetCreator: steps are required.
        original = getattr(dataset_fn, "_original_dataset", dataset_fn)
        if not isinstance(original, tf.data.Dataset):
            return super().create_per_worker_dataset(dataset_fn)
        serialized = coordinator_values.serialize_dataset_to_graph(original)
        element_spec = original.element_spec
        num_workers = self._num_workers
        policy = original.options().experimental_distribute.auto_shard_policy

        def sharded_dataset_fn(by_element=False):
            ds = coordinator_values.deserialize_dataset_from_graph(serialized, element_spec)
            index = tf.distribute.coordinator.experimental_get_current_worker_index()
            if by_element:  # Batch i, i+W, ... (AUTO's fallback, see below).
                return ds.shard(num_workers, index)
            # tf.data's auto-shard rewrite, as MultiWorkerMirroredStrategy
            # applies it: by file where the input reads files (each worker
            # opens 1/W of them), else by element (here a batch: worker i
            # reads batches i, i+W, ...); `tf.data.Options` auto-shard
            # settings are honoured (OFF: every worker reads everything).
            if policy == tf.data.experimental.AutoShardPolicy.OFF:
                return ds
            with warnings.catch_warnings():
                # It reads the options in graph mode, which TF warns may be
                # stale; `policy` was read eagerly above.
                warnings.simplefilter("ignore", UserWarning)
                return input_ops.auto_shard_dataset(ds, num_workers, index,
                                                    num_replicas_in_sync=1)

        if policy == tf.data.experimental.AutoShardPolicy.AUTO and not (
                _reads_files(serialized) and self._file_sharding_applies(sharded_dataset_fn)):
            # In-memory input (no file reader: what AUTO would shard by
            # element anyway, without the rewrite), or too few files.
            return epochs_lib.SyncPerWorkerDataset(
                lambda: sharded_dataset_fn(by_element=True), self, evaluation)
        return epochs_lib.SyncPerWorkerDataset(sharded_dataset_fn, self, evaluation)

    def _file_sharding_applies(self, sharded_dataset_fn) -> bool:
        """Whether AUTO sharding of this input works on the workers (tried once).

        tf.data's AUTO policy shards by file when the input reads files, but
        fails (at the first element) when it reads fewer files than there are
        workers, where MultiWorkerMirroredStrategy users must switch the
        policy to DATA by hand. Here each worker builds its shard and takes
        one element; on that error the input is sharded by batch instead.
        """
        @tf.function
        def first_element():  # A tf.function: the worker index is read when it runs.
            return iter(sharded_dataset_fn()).get_next_as_optional().has_value()

        # The stock worker threads log a failed resource closure at ERROR;
        # this failure is expected and handled here.
        quiet = _DropMessages("FILE based sharding")
        tf_logger = std_logging.getLogger("tensorflow")
        tf_logger.addFilter(quiet)
        try:
            remote = self._create_per_worker_resources(first_element)
            for value in remote._values:  # pylint: disable=protected-access
                value.fetch()
        except (tf.errors.InvalidArgumentError, cluster_coordinator.ClosureInputError) as e:
            if "FILE based sharding" not in str(e):
                return True  # Another error: the input's own, raised where TF raises it.
            logging.info("tf_psplugin: the input reads fewer files than there are workers: "
                         "sharding it by batch instead of by file.")
            return False
        finally:
            tf_logger.removeFilter(quiet)
        return True


# tf.data's file readers (dataset op names, TF 2.15-2.21): what its FILE
# auto-sharding shards. Other sources are sharded by element.
_FILE_READER_OPS = ("TFRecordDataset", "TFRecordDatasetV2", "TextLineDataset",
                    "FixedLengthRecordDataset", "FixedLengthRecordDatasetV2")


def _reads_files(serialized_dataset: tf.Tensor) -> bool:
    """Whether a serialized dataset graph has a tf.data file reader (functions included)."""
    graph = tf.compat.v1.GraphDef()
    graph.ParseFromString(serialized_dataset.numpy())
    ops = {node.op for node in graph.node}
    ops.update(node.op for function in graph.library.function for node in function.node_def)
    return any(op in _FILE_READER_OPS for op in ops)


class _DropMessages(std_logging.Filter):
    """A logging filter that drops records containing `text`."""

    def __init__(self, text: str):
        super().__init__()
        self._text = text

    def filter(self, record) -> bool:
        return self._text not in record.getMessage()


def _static_batch_size(per_worker_dataset) -> Optional[int]:
    """The leading static dimension shared by every tensor of an element, or None."""
    try:
        specs = tf.nest.flatten(per_worker_dataset.element_spec)
    except (AttributeError, TypeError, ValueError):  # No element_spec on this type.
        return None
    sizes = set()
    for spec in specs:
        shape = getattr(spec, "shape", None)
        if shape is None or shape.rank is None or shape.rank < 1:
            return None
        sizes.add(shape[0])
    if len(sizes) != 1 or None in sizes:
        return None
    return int(sizes.pop())


def _returns_dataset(per_worker) -> bool:
    """Whether a stock per-worker dataset's function returns a `tf.data.Dataset`."""
    fn = getattr(per_worker, "_dataset_fn", None)
    return isinstance(getattr(fn, "structured_outputs", None), tf.data.Dataset)
