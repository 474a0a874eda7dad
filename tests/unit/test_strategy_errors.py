"""Clear errors from HybridParameterServerStrategy that need no running cluster.

Each case must fail before TensorFlow connects anywhere, with one message that
names what is wrong and the fix.
"""

import os
import socket
import subprocess
import sys
import time

import pytest
import tensorflow as tf

import tf_psplugin
from tf_psplugin.cluster import config as config_lib
from tf_psplugin.cluster import connection


_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _closed_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _resolver(cluster, task_type="chief", task_id=0):
    return tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec(cluster), task_type=task_type, task_id=task_id, rpc_layer="grpc")


def _addr():
    return f"127.0.0.1:{_closed_port()}"


def test_no_ps_task():
    resolver = _resolver({"chief": [_addr()], "worker": [_addr()]})
    with pytest.raises(tf_psplugin.StrategyError,
                       match=r"\['ps'\]: no parameter server is given.*Fix:.*ps"):
        tf_psplugin.HybridParameterServerStrategy(resolver)


@pytest.mark.parametrize("cluster,needle", [
    ({"chief": ["A", "B"], "worker": ["C"], "ps": ["D"]},
     r"\['chief'\]: lists 2 addresses but a cluster has at most one chief"),
    ({"chief": ["A"], "workers": ["C"], "ps": ["D"]},
     r"\['workers'\]: is not a known job \(did you mean 'worker'\?\)"),
    ({"chief": ["A"], "worker": ["C"], "ps": ["A"]}, r"address .* is used twice"),
])
def test_resolver_that_can_never_work_fails_before_connecting(cluster, needle):
    """Not after connect_timeout_seconds (300 s) of 'cannot reach'."""
    addresses = {}
    cluster = {job: [addresses.setdefault(h, _addr()) for h in hosts]
               for job, hosts in cluster.items()}
    start = time.monotonic()
    with pytest.raises(tf_psplugin.StrategyError, match=needle + r".*Fix:"):
        tf_psplugin.HybridParameterServerStrategy(_resolver(cluster))
    assert time.monotonic() - start < 5.0


def test_no_worker_task():
    resolver = _resolver({"chief": [_addr()], "ps": [_addr()]})
    with pytest.raises(tf_psplugin.StrategyError, match=r"no worker task.*Fix:"):
        tf_psplugin.HybridParameterServerStrategy(resolver)


@pytest.mark.parametrize("task_type,needle", [
    ("worker", "start_server"),
    ("ps", "start_server"),
    ("evaluator", "evaluator never joins"),
])
def test_constructed_outside_the_chief(task_type, needle):
    config = config_lib.from_tf_config({
        "cluster": {"chief": [_addr()], "worker": [_addr()], "ps": [_addr()],
                    "evaluator": [_addr()]},
        "task": {"type": task_type, "index": 0}})
    with pytest.raises(tf_psplugin.StrategyError, match=rf"must be constructed on the chief.*{needle}"):
        tf_psplugin.HybridParameterServerStrategy(config=config)


def test_worker_resolver_rejected():
    resolver = _resolver({"chief": [_addr()], "worker": [_addr()], "ps": [_addr()]},
                         task_type="worker", task_id=0)
    with pytest.raises(tf_psplugin.StrategyError, match="this process is worker:0"):
        tf_psplugin.HybridParameterServerStrategy(resolver)


@pytest.mark.parametrize("arguments,needle", [
    (lambda: {"options": tf_psplugin.HybridOptions(embedding_updates="eventually")},
     "embedding_updates"),
    (lambda: {"options": tf_psplugin.HybridOptions(dense_placement="gpu")}, "dense_placement"),
    (lambda: {"placement": tf_psplugin.PlacementPolicy(sharding="random")}, "sharding"),
    (lambda: {"options": tf_psplugin.HybridOptions(experimental_sparse_exchange="gossip")},
     "experimental_sparse_exchange"),
], ids=["embedding_updates", "dense_placement", "sharding", "experimental_sparse_exchange"])
def test_bad_options(arguments, needle):
    resolver = _resolver({"chief": [_addr()], "worker": [_addr()], "ps": [_addr()]})
    with pytest.raises(ValueError, match=rf"{needle}.*Fix:"):
        tf_psplugin.HybridParameterServerStrategy(resolver, **arguments())


def test_unreachable_tasks_named_within_timeout():
    worker, ps = _addr(), _addr()
    resolver = _resolver({"chief": [_addr()], "worker": [worker], "ps": [ps]})
    with pytest.raises(tf_psplugin.StrategyError) as info:
        tf_psplugin.HybridParameterServerStrategy(
            resolver, options=tf_psplugin.HybridOptions(connect_timeout_seconds=0.5))
    message = str(info.value)
    assert f"worker:0 at {worker}" in message and f"ps:0 at {ps}" in message
    assert "Fix:" in message
    # Pods still being scheduled: retryable (138), not a permanent exit 1.
    assert isinstance(info.value, tf_psplugin.TasksUnreachableError)
    assert info.value.exit_code == tf_psplugin.RESTART_EXIT_CODE == 138


def test_unreachable_tasks_uncaught_exit_with_the_retryable_status(tmp_path):
    script = tmp_path / "chief.py"
    script.write_text(
        "import sys, tf_psplugin\n"
        "import tensorflow as tf\n"
        "spec = tf.train.ClusterSpec({'chief': [sys.argv[1]], 'worker': [sys.argv[2]],\n"
        "                             'ps': [sys.argv[3]]})\n"
        "resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(\n"
        "    spec, task_type='chief', task_id=0, rpc_layer='grpc')\n"
        "try:\n"
        "    tf_psplugin.HybridParameterServerStrategy(\n"
        "        resolver, options=tf_psplugin.HybridOptions(connect_timeout_seconds=0.5))\n"
        "finally:\n"
        "    print('finally ran', flush=True)\n")
    path = os.pathsep.join(filter(None, [_REPO_ROOT, os.environ.get("PYTHONPATH")]))
    result = subprocess.run([sys.executable, str(script), _addr(), _addr(), _addr()],
                            capture_output=True, text=True, timeout=120,
                            env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=path))
    assert result.returncode == 138, result.stderr
    assert "finally ran" in result.stdout
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("tf_psplugin: cannot reach worker:0 at ") and "status 138" in last
    assert "Traceback" not in result.stderr


def test_no_cluster_configured_at_all(monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    with pytest.raises(tf_psplugin.StrategyError, match="cannot resolve the cluster"):
        tf_psplugin.HybridParameterServerStrategy()


def test_wait_for_tasks_returns_when_listening():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(4)
        addr = f"127.0.0.1:{server.getsockname()[1]}"
        connection.wait_for_tasks(tf.train.ClusterSpec({"worker": [addr], "ps": [addr]}), 2.0)
