"""A cluster resolver naming one chief, worker and PS on free loopback ports (no servers).

For unit tests of what a strategy does before it connects (its arguments,
its errors): the addresses are bindable but nothing listens on them.
"""

import socket

import tensorflow as tf


def free_address() -> str:
    """A ``127.0.0.1:port`` that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def chief_worker_ps_resolver() -> tf.distribute.cluster_resolver.ClusterResolver:
    """The chief's resolver for a cluster of one chief, one worker and one PS."""
    spec = tf.train.ClusterSpec({"chief": [free_address()], "worker": [free_address()],
                                 "ps": [free_address()]})
    return tf.distribute.cluster_resolver.SimpleClusterResolver(
        spec, task_type="chief", task_id=0, rpc_layer="grpc")
