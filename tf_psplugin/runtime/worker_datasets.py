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

from tf_psplugin._internal import tf_objects
from tf_psplugin._internal.tf_internal import cluster_coordinator, coordinator_values, input_ops
from tf_psplugin.runtime import epochs as epochs_lib


class WorkerDatasets:
    """The coordinator's per-worker datasets: each worker its shard of the input.

    One per `HybridClusterCoordinator` (its `_datasets`), which keeps the
    public `create_per_worker_dataset` and `examples_per_step` and hands
    the work here.

    Example (what the coordinator does):

    ```python
    datasets = WorkerDatasets(coordinator, synchronous=True, num_workers=2)
    per_worker = datasets.create(dataset, stock_create)
    datasets.examples_per_step  # the dataset's batch x 2, when static
    ```

    Args:
        coordinator: The `HybridClusterCoordinator` (it runs the dataset
            functions on the workers; `epochs.SyncPerWorkerDataset` agrees
            on epoch lengths through it).
        synchronous: Whether every step runs on every worker.
        num_workers: Workers in the cluster.
    """

    def __init__(self, coordinator, synchronous: bool, num_workers: int):
        self._coordinator = coordinator
        self._synchronous = synchronous
        self._num_workers = num_workers
        # Examples one scheduled step consumes, from the last per-worker
        # dataset (`HybridClusterCoordinator.examples_per_step`).
        self.examples_per_step: Optional[int] = None

    def create(self, dataset_fn, stock_create):
        """`HybridClusterCoordinator.create_per_worker_dataset` (see there).

        Args:
            dataset_fn: A dataset, distributed dataset, or a function.
            stock_create: Stock `ClusterCoordinator.create_per_worker_dataset`
                (bound): what asynchronous mode, Keras's `DatasetCreator` and
                inputs that are no `tf.data.Dataset` get.

        Returns:
            A per-worker dataset. Also records `examples_per_step`.
        """
        per_worker = self._create(dataset_fn, stock_create)
        self.examples_per_step = _static_batch_size(per_worker)
        if self.examples_per_step is not None and self._synchronous:
            self.examples_per_step *= self._num_workers
        return per_worker

    def _create(self, dataset_fn, stock_create):
        if not self._synchronous:
            return stock_create(dataset_fn)
        evaluation = epochs_lib.building_evaluation_inputs()
        if callable(dataset_fn) and not isinstance(dataset_fn, tf.data.Dataset):
            per_worker = stock_create(dataset_fn)
            if _returns_dataset(per_worker):
                # The user's function shards itself: its lengths may differ
                # per worker, so the epoch length is agreed on (epochs.py).
                return epochs_lib.SyncPerWorkerDataset(
                    tf_objects.per_worker_dataset_fn(per_worker), self._coordinator,
                    evaluation)
            return per_worker  # E.g. Keras's DatasetCreator: steps are required.
        original = tf_objects.original_dataset_fn(dataset_fn)
        if not isinstance(original, tf.data.Dataset):
            return stock_create(dataset_fn)
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
                lambda: sharded_dataset_fn(by_element=True), self._coordinator, evaluation)
        return epochs_lib.SyncPerWorkerDataset(sharded_dataset_fn, self._coordinator, evaluation)

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
            remote = tf_objects.create_per_worker_resources(self._coordinator, first_element)
            for value in tf_objects.per_worker_values(remote):
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
    fn = tf_objects.per_worker_dataset_fn(per_worker)
    return isinstance(getattr(fn, "structured_outputs", None), tf.data.Dataset)
