"""Ps/worker script as stock ParameterServerStrategy's guide writes it: no tf_psplugin.

Run by tests/cluster/test_partitioner.py on every ps and worker task, to
show that the plugin's chief trains with servers started the stock way.
"""

import os

import tensorflow as tf

os.environ["GRPC_FAIL_FAST"] = "use_caller"
resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
server = tf.distribute.Server(
    resolver.cluster_spec(), job_name=resolver.task_type, task_index=resolver.task_id,
    protocol=resolver.rpc_layer or "grpc", start=True)
server.join()
