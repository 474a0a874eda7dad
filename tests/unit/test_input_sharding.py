"""Which inputs the coordinator shards by file: `coordinator._reads_files`.

The cluster tests (tests/cluster/test_finite_data.py, "file_sharding_*")
check what each worker then reads; this checks the decision on the chief.
"""

import os

import tensorflow as tf

from tf_psplugin._internal.tf_internal import coordinator_values
from tf_psplugin.runtime import coordinator


def _reads_files(dataset):
    return coordinator._reads_files(  # pylint: disable=protected-access
        coordinator_values.serialize_dataset_to_graph(dataset))


def test_file_readers_are_found_also_inside_functions(tmp_path):
    path = os.path.join(str(tmp_path), "a.tfrecord")
    with tf.io.TFRecordWriter(path) as writer:
        writer.write(b"x")
    assert _reads_files(tf.data.TFRecordDataset([path]).batch(2))
    assert _reads_files(tf.data.TextLineDataset([path]).map(tf.strings.length).batch(2))
    listed = tf.data.Dataset.list_files(os.path.join(str(tmp_path), "*"))
    assert _reads_files(listed.interleave(tf.data.TFRecordDataset).batch(2))


def test_in_memory_inputs_are_not_file_based():
    assert not _reads_files(tf.data.Dataset.range(10).batch(2))
    assert not _reads_files(tf.data.Dataset.from_tensor_slices(([1, 2], [3, 4])).repeat())
