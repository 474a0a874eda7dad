"""What an epoch is in synchronous training, and how finite data ends.

In synchronous mode every step runs on every worker and meets its peers in
collectives, so a worker may not simply stop when its own data runs out:
its peers would wait in the step's all-reduce for a part that never comes.
Stock ParameterServerStrategy has no such problem (a step runs on one
worker; the first `OutOfRangeError` ends the epoch) and no such guarantee
either (which worker reads which batch is up to the scheduler).

Here the end of an epoch is agreed on by every worker. When each
worker's number of batches ``c_i`` is known from its dataset's cardinality
(no pass over the data), it is agreed on before the epoch starts (below).
When it is not (a `filter`, a file reader), it is agreed on step by step:
each worker's iterator is an `AgreedIterator`, whose ``next`` all-reduces
"I still have a batch" with the step's other workers (one scalar
collective per step) and ends the epoch on every worker at the same step
(`OutOfRangeError` everywhere), by the same rule as below. So the first
step is dispatched at once, for an endless stream too, and each worker
reads its input once per epoch. `fit` without ``steps_per_epoch`` on such
input does what Keras does for one process: the first epoch runs until
the step that finds the agreed end (Keras waits for each step of an epoch
of unknown length, `tf_objects.wait_for_each_step_while_length_unknown`),
and later epochs know its length. Only `evaluate` (and `fit`'s validation
data) given neither ``steps``/``validation_steps`` nor a known cardinality,
and `fit` with ``steps_per_execution > 1`` (Keras needs the epoch length to
run one), count each worker's batches first (one extra pass over the
worker's input, done once per dataset); ``dataset.apply(
tf.data.experimental.assert_cardinality(n))`` avoids that pass. Then:

* **Training** (`fit`, custom loops): an epoch is ``min(c_i)`` steps, the
  steps every worker can take. Each worker's data is cut to that length, so
  all workers run out at the same step and ``OutOfRangeError`` (custom
  loops) ends the epoch everywhere. The remainder is dropped (at most
  ``n - 1`` batches when the coordinator shards a `tf.data.Dataset` over
  ``n`` workers): every step then trains on a full global batch, which keeps
  synchronous training equal to one process on the global batch.
* **Evaluation** (`evaluate`, `fit`'s validation): an epoch is
  ``max(c_i)`` steps. A worker whose data ends first reads empty batches
  (zero examples, the same structure) until the others finish. Metric
  updates are all-reduced sums, so every example counts exactly once, as
  with stock PSS's exact evaluation.

`model.fit`/`evaluate` without ``steps_per_epoch``/``steps`` get the agreed
length as their epoch length (the progress bar shows it too; when it is
agreed step by step, from the second epoch on, as Keras does). With
``steps_per_epoch`` given, nothing is counted and Keras's own rule applies
(data that runs out early ends training with Keras's warning, on every
worker at the same step). `predict` runs on the chief, as
with stock PSS, and needs none of this.

Which of the two a dataset is for is known only to Keras's data handler, so
`install_data_handler_hook` wraps Keras's `get_data_handler` (evaluation
handlers are the ones built with ``pss_evaluation_shards``), once per
process, for models under this strategy only.
"""

import contextlib
import threading
from typing import List, Optional

import tensorflow as tf
from absl import logging

from tf_psplugin._internal import identity
from tf_psplugin._internal import tf_internal as _tf_internal
from tf_psplugin._internal import tf_objects
from tf_psplugin._internal.tf_internal import coordinator_values, iterator_ops

_local = threading.local()
# How often a running counting pass is reported (`_SlowCountNotice`).
COUNT_NOTICE_SECONDS = 30.0


@contextlib.contextmanager
def evaluation_inputs(evaluation: bool = True):
    """Marks per-worker datasets created inside as evaluation inputs."""
    previous = getattr(_local, "evaluation", False)
    _local.evaluation = evaluation
    try:
        yield
    finally:
        _local.evaluation = previous


def building_evaluation_inputs() -> bool:
    """Whether the per-worker dataset being created is for evaluation."""
    return getattr(_local, "evaluation", False)


class _NoEmptyBatch(Exception):
    """The element structure has a part no empty batch can be built for."""


def _relax_batch_dimension(dataset: tf.data.Dataset) -> tf.data.Dataset:
    """The dataset with the leading (batch) dimension of every tensor unknown.

    An empty padding batch must match the element spec, which a static batch
    size (``batch(..., drop_remainder=True)``) does not allow.
    """
    def relax(element):
        def one(t):
            if isinstance(t, tf.Tensor) and t.shape.rank and t.shape[0] is not None:
                return tf.compat.v1.placeholder_with_default(t, [None] + t.shape[1:].as_list())
            return t
        return tf.nest.map_structure(one, element)

    # zip((ds,)) makes every element a 1-tuple, so `map` passes the original
    # element (any structure) as one argument.
    return tf.data.Dataset.zip((dataset,)).map(relax)


def _empty_batch(element_spec):
    """An element of `element_spec` holding zero examples."""
    def one(spec):
        if isinstance(spec, tf.TensorSpec) and spec.shape.rank:
            if spec.shape[0] not in (None, 0):
                raise _NoEmptyBatch(f"static batch dimension in {spec}")
            dims = [0] + [d if d is not None else 0 for d in spec.shape[1:].as_list()]
            return tf.zeros(dims, spec.dtype)
        if isinstance(spec, tf.RaggedTensorSpec) and spec.shape.rank and spec.shape[0] is None:
            dense = tf.zeros([0] * spec.shape.rank, spec.dtype)
            return tf.RaggedTensor.from_tensor(dense, ragged_rank=spec.ragged_rank,
                                               row_splits_dtype=spec.row_splits_dtype)
        if isinstance(spec, tf.SparseTensorSpec) and spec.shape.rank and spec.shape[0] is None:
            rank = spec.shape.rank
            dims = [0] + [d if d is not None else 0 for d in spec.shape[1:].as_list()]
            return tf.SparseTensor(tf.zeros([0, rank], tf.int64), tf.zeros([0], spec.dtype),
                                   tf.constant(dims, tf.int64))
        raise _NoEmptyBatch(f"no empty batch for {spec}")
    return tf.nest.map_structure(one, element_spec)


def _count_batches(dataset: tf.data.Dataset):
    """The dataset's length: its cardinality, or counted when unknown (-1: infinite)."""
    cardinality = dataset.cardinality()

    def count():
        ones = dataset.map(lambda *_: tf.constant(1, tf.int64))
        return ones.reduce(tf.constant(0, tf.int64), lambda total, one: total + one)

    return tf.cond(tf.equal(cardinality, tf.data.UNKNOWN_CARDINALITY), count,
                   lambda: cardinality)


def _end_of_input() -> tf.Tensor:
    """An op that fails with `OutOfRangeError` when it runs (the next of an empty dataset)."""
    return next(iter(tf.data.Dataset.range(0)))


class AgreedIterator(iterator_ops.OwnedIterator):
    """A worker's iterator whose epoch ends on every worker at the same step.

    For input of unknown length (see the module docstring). Each ``next``
    inside a synchronous step takes this worker's element as an optional,
    sums "has an element" over the step's workers with one scalar
    all-reduce, and then:

    * training input: returns the element if every worker has one, else
      raises `OutOfRangeError` on every worker (elements already taken on
      the others are dropped, as the shortest-worker rule drops them);
    * evaluation input: returns the element, or an empty batch on a worker
      whose data has ended while another's has not; `OutOfRangeError` once
      none has one.

    Outside a traced step (eager) it is a plain iterator.

    Private TF API: a subclass of `iterator_ops.OwnedIterator` with its own
    `IteratorSpec` (`AgreedIteratorSpec`), so that a traced step
    reconstructs this class and runs its `_next_internal`; there is no
    public hook into an iterator's ``next``. Checked on TF 2.15.1 and 2.21.0.
    """

    def __init__(self, dataset=None, components=None, element_spec=None,
                 evaluation: bool = False):
        super().__init__(dataset=dataset, components=components, element_spec=element_spec)
        self._evaluation = bool(evaluation)

    @property
    def _type_spec(self):
        return AgreedIteratorSpec(self.element_spec, self._evaluation)

    def _next_internal(self):
        group = getattr(tf.distribute.get_strategy().extended, "collective_group", None)
        if tf.executing_eagerly() or group is None:
            return super()._next_internal()
        optional = self.get_next_as_optional()
        has = optional.has_value()
        workers_with_data = group.all_reduce(tf.cast(has, tf.float32))

        def ended():
            with tf.control_dependencies([_end_of_input()]):
                return optional.get_value()

        if not self._evaluation:
            return tf.cond(workers_with_data > group.group_size - 0.5,
                           optional.get_value, ended)
        spec = self.element_spec
        return tf.cond(
            workers_with_data > 0.5,
            lambda: tf.cond(has, optional.get_value, lambda: _empty_batch(spec)),
            ended)


class AgreedIteratorSpec(iterator_ops.IteratorSpec):
    """The TypeSpec of `AgreedIterator` (the same component: one iterator resource)."""

    def __init__(self, element_spec, evaluation: bool = False):
        super().__init__(element_spec)
        self._elements = element_spec  # IteratorSpec keeps it in a private slot.
        self._evaluation = bool(evaluation)

    @property
    def value_type(self):
        return AgreedIterator

    def _serialize(self):
        return (self._elements, self._evaluation)

    def _from_components(self, components):
        return AgreedIterator(components=components, element_spec=self._elements,
                              evaluation=self._evaluation)


class _SlowCountNotice:
    """Says, every `COUNT_NOTICE_SECONDS`, that a counting pass is still running.

    A counting pass over an endless input of unknown length never ends, and
    no step is dispatched meanwhile: without this, the job would be silent.
    """

    def __init__(self, every: Optional[float] = None):
        self._every = COUNT_NOTICE_SECONDS if every is None else every
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tf_psplugin-count-notice",
                                        daemon=True)

    def _run(self):
        waited = 0.0
        while not self._done.wait(self._every):
            waited += self._every
            logging.warning(
                "tf_psplugin: still counting each worker's batches after %.0f s: evaluate (or "
                "fit with steps_per_execution > 1) got input of unknown length and no "
                "steps/steps_per_epoch, so every worker reads its input once before the first "
                "step (an endless input never ends). Fix: pass steps (or steps_per_epoch), or "
                "dataset.apply(tf.data.experimental.assert_cardinality(n)).", waited)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._done.set()
        self._thread.join()


# Per-worker iterators of an input whose dataset function failed when its
# length was read -> that first error (see `SyncPerWorkerDataset.__iter__`).
_FIRST_INPUT_ERRORS = identity.IdentityMap()


def first_input_error(structured) -> Optional[BaseException]:
    """The first error of a failed input among the iterators in `structured`, if any.

    A dataset function that failed on the workers when its length was read
    is called again to make its iterator, and TF answers a second call of a
    function that failed remotely with another error ("Primary device is not
    remote", stock PSS too). The coordinator reports the first one, which
    names the cause, as stock does for its single call.
    """
    for value in tf.nest.flatten(structured):
        error = _FIRST_INPUT_ERRORS.get(value)
        if error is not None:
            return error
    return None


class SyncPerWorkerDataset(coordinator_values.PerWorkerDatasetFromDatasetFunction):
    """A per-worker dataset whose epochs end on every worker at the same step.

    Created by `HybridClusterCoordinator.create_per_worker_dataset` in
    synchronous mode (see the module docstring for what an epoch is).

    Args:
        dataset_fn: A function returning a `tf.data.Dataset`, called on each
            worker (it may shard by `experimental_get_current_worker_index`).
        coordinator: The `HybridClusterCoordinator`.
        evaluation: Whether this is evaluation input (pad to the longest
            worker) rather than training input (cut to the shortest).
    """

    def __init__(self, dataset_fn, coordinator, evaluation: bool = False):
        super().__init__(dataset_fn, coordinator)
        self._evaluation = False
        self._padding_spec = None
        if evaluation:
            base = self._dataset_fn
            relaxed = tf.function(lambda: _relax_batch_dimension(base())).get_concrete_function()
            try:
                _empty_batch(relaxed.structured_outputs.element_spec)
                self._dataset_fn = relaxed
                self._evaluation = True
            except _NoEmptyBatch as e:
                logging.warning(
                    "tf_psplugin: evaluation input cannot be padded with empty batches (%s): "
                    "each epoch ends where the shortest worker's data ends, so up to one step of "
                    "examples per worker is not evaluated. Fix: give tensors, ragged or sparse "
                    "tensors whose batch dimension is dynamic.", e)
        # Counted by `batches_per_worker` (-1: infinite), or None.
        self._lengths: Optional[List[int]] = None
        # (lengths, per-worker dataset) of the last epoch cut to agreed lengths.
        self._epoch_dataset = None
        self._counted = False
        # The dataset function's error when its length was read, if it failed.
        self._input_error: Optional[BaseException] = None

    @property
    def evaluation(self) -> bool:
        """Whether epochs are padded to the longest worker (evaluation input)."""
        return self._evaluation

    def batches_per_worker(self) -> Optional[List[int]]:
        """Each worker's number of batches, or None (infinite, or not countable).

        Counted once (on the workers, in parallel; one pass over each
        worker's input when its cardinality is unknown) and then reused:
        like Keras's own inferred epoch length, it assumes the data has the
        same length every epoch (each later epoch asserts that it does).
        Only `evaluate` without a step count, and `fit` without one whose
        end is not agreed step by step (see `patch_data_handler`), call this.
        """
        if not self._counted:
            self._counted = True
            with _SlowCountNotice():
                self._lengths = self._lengths_on_workers(count=True)  # -1: infinite
        lengths = self._lengths
        return None if lengths is None or min(lengths) < 0 else lengths

    def epoch_steps(self) -> Optional[int]:
        """Steps in one epoch on every worker (see the module docstring), or None."""
        lengths = self.batches_per_worker()
        if lengths is None:
            return None
        return max(lengths) if self._evaluation else min(lengths)

    def ends_step_by_step(self) -> bool:
        """Whether an epoch's end is agreed step by step (no worker's length is known).

        True when some worker's input has unknown cardinality (a `filter`, a
        file reader): `__iter__` then returns `AgreedIterator`s. False when
        every length is known (or infinite), or the input cannot be built.
        """
        lengths = self._lengths if self._counted else self._lengths_on_workers(count=False)
        return lengths is not None and tf.data.UNKNOWN_CARDINALITY in lengths

    def steps_per_pass(self) -> Optional[int]:
        """Training steps in one pass over data of known length (no counting), or None."""
        lengths = self._lengths_on_workers(count=False)
        if not lengths or min(lengths) < 0:
            return None
        return min(lengths)

    def _lengths_on_workers(self, count: bool) -> Optional[List[int]]:
        """Each worker's batches: cardinality (-1 infinite, -2 unknown), or counted.

        Returns None if the input could not be built (its iterator will raise
        that error where TF raises it).
        """
        fn = self._dataset_fn
        measure = ((lambda: _count_batches(fn())) if count
                   else (lambda: fn().cardinality()))
        # One resource closure per worker (they run in parallel on the stock
        # worker threads), as the stock class creates its iterators.
        remote = tf_objects.create_per_worker_resources(self._coordinator, measure)
        try:
            return [int(v.fetch()) for v in tf_objects.per_worker_values(remote)]
        except Exception as e:  # noqa: BLE001 - the iterator will raise it where TF raises it.
            logging.debug("tf_psplugin: could not read the input's length: %r", e)
            self._input_error = getattr(e, "original_exception", None) or e
            return None

    def __iter__(self):
        lengths = self._lengths if self._counted else self._lengths_on_workers(count=False)
        if lengths is None:
            # The input fails: its iterator raises where TF raises it, with
            # the first error (`first_input_error`).
            iterator = super().__iter__()
            if self._input_error is not None:
                _FIRST_INPUT_ERRORS[iterator] = self._input_error
            return iterator
        if tf.data.UNKNOWN_CARDINALITY in lengths or (
                tf.data.INFINITE_CARDINALITY in lengths and max(lengths) >= 0):
            # No length to agree on beforehand: agree step by step.
            return self._agreed_iterator()
        if min(lengths) < 0:  # Endless on every worker: no end to agree on.
            return super().__iter__()
        key = tuple(lengths)
        if self._epoch_dataset is None or self._epoch_dataset[0] != key:
            self._epoch_dataset = (key, self._cut_to_agreed_length(lengths))
        # One traced epoch function for every epoch of this length: a new
        # one per epoch would add a function to every worker's library each
        # epoch (measured: worker RSS +14 MiB over 1,400 epochs).
        return iter(self._epoch_dataset[1])

    def _cut_to_agreed_length(self, lengths: List[int]):
        """A per-worker dataset of one epoch: this input cut (or padded) to the agreed length."""
        steps = max(lengths) if self._evaluation else min(lengths)
        fn = self._dataset_fn
        evaluation = self._evaluation
        index = tf.distribute.coordinator.experimental_get_current_worker_index

        def epoch_dataset():
            dataset = fn()
            # Later epochs must have the lengths that were agreed on: a worker
            # running out early would leave its peers waiting in a collective.
            expected = tf.gather(tf.constant(lengths, tf.int64), index())
            dataset = dataset.apply(tf.data.experimental.assert_cardinality(expected))
            if evaluation:
                padding = tf.data.Dataset.from_tensors(_empty_batch(dataset.element_spec))
                dataset = dataset.concatenate(padding.repeat())
            return dataset.take(steps)

        # Its closures read only their own function, also when a restarted
        # worker re-creates its iterator.
        return coordinator_values.PerWorkerDatasetFromDatasetFunction(
            tf.function(epoch_dataset).get_concrete_function(), self._coordinator)

    def _agreed_iterator(self):
        """Per-worker `AgreedIterator`s over this input (see the module docstring)."""
        fn = self._dataset_fn
        evaluation = self._evaluation
        per_worker = tf_objects.create_per_worker_resources(
            self._coordinator,
            lambda: AgreedIterator(fn(), evaluation=evaluation))
        # What a traced step sees of each worker's iterator (the stock class
        # sets the dataset's IteratorSpec here).
        spec = AgreedIteratorSpec(fn.structured_outputs.element_spec, evaluation)
        for remote in tf_objects.per_worker_values(per_worker):
            tf_objects.set_remote_type_spec(remote, spec)
        return coordinator_values.PerWorkerDistributedIterator(
            tf_objects.per_worker_values(per_worker))


def patch_data_handler():
    """Gives Keras's fit/evaluate the agreed epoch length; returns the undo.

    Applied through `tf_psplugin._internal.patches` ("keras_data_handler").

    Wraps ``<keras>.src.engine.data_adapter.get_data_handler`` (private
    Keras API, same name and signature in Keras 2.15 and tf-keras
    2.16-2.21). For a model whose coordinator dispatches synchronously it
    marks evaluation handlers (Keras builds those, and only those, with a
    ``pss_evaluation_shards`` argument) so their per-worker dataset is
    padded, and, when no step count was given, sets the handler's epoch
    length to `SyncPerWorkerDataset.epoch_steps` -- except for training
    input whose end is agreed step by step (`SyncPerWorkerDataset.
    ends_step_by_step`) and one step per execution: that handler keeps an
    unknown length and waits for each step until the epoch's end is found,
    as Keras does for one process (each worker reads its input once); when
    ``steps_per_epoch`` is
    one pass over data of known length (its batches divided over the
    workers), it makes Keras start every epoch over, as Keras does when
    ``steps_per_epoch`` equals a dataset's batches. Every other model goes
    through Keras's function unchanged.
    """
    data_adapter = _tf_internal.keras_private_module("engine.data_adapter")
    original = data_adapter.get_data_handler

    def get_data_handler(*args, **kwargs):
        coordinator = tf_objects.model_cluster_coordinator(kwargs.get("model"))
        if not getattr(coordinator, "synchronous", False):
            return original(*args, **kwargs)
        evaluation = "pss_evaluation_shards" in kwargs
        with evaluation_inputs(evaluation):
            handler = original(*args, **kwargs)
        dataset = tf_objects.data_handler_dataset(handler)
        if (kwargs.get("steps_per_epoch") is None and isinstance(dataset, SyncPerWorkerDataset)
                and not evaluation
                and _steps_per_execution(kwargs.get("steps_per_execution")) == 1
                and dataset.ends_step_by_step()):
            # No counting pass: the first epoch ends at the step the workers
            # agree has no data (`AgreedIterator`), which Keras then sees as
            # that step's OutOfRangeError; later epochs know the length.
            tf_objects.wait_for_each_step_while_length_unknown(handler, coordinator.join)
        elif kwargs.get("steps_per_epoch") is None and isinstance(dataset, SyncPerWorkerDataset):
            steps = dataset.epoch_steps()
            if steps == 0:
                raise ValueError(
                    "tf_psplugin: the input has no complete step for the "
                    f"{coordinator.num_workers} workers (batches per worker: "
                    f"{dataset.batches_per_worker()}). Fix: give at least one batch per "
                    "worker, or a smaller batch size.")
            if steps is not None:
                tf_objects.set_data_handler_inferred_steps(handler, steps)
        elif isinstance(dataset, SyncPerWorkerDataset) and not dataset.evaluation:
            if kwargs.get("steps_per_epoch") == dataset.steps_per_pass():
                # One pass over the data per epoch: Keras starts each
                # epoch over only when steps_per_epoch equals the
                # dataset's batches, but a step here reads one batch on
                # every worker, so a pass is W times fewer steps.
                adapter = tf_objects.data_handler_adapter(handler)
                adapter.should_recreate_iterator = lambda: True
        return handler

    data_adapter.get_data_handler = get_data_handler

    def undo():
        data_adapter.get_data_handler = original

    return undo


def _steps_per_execution(value) -> int:
    """Keras's ``steps_per_execution`` (a variable, a number, or None: 1) as an int."""
    if value is None:
        return 1
    return int(value.numpy()) if hasattr(value, "numpy") else int(value)
