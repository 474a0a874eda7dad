"""The main example across emulated hosts: each task its own namespace and address (issue 13).

Every task runs keras_examples/ctr.py with the TF1-style flags a user gives
on real hosts (`--job_name --task_index --chief_hosts --worker_hosts
--ps_hosts`), bound to its own host's address, not 127.0.0.1. Sync training
is deterministic, so the checkpoint must equal the same job's checkpoint on
loopback under `python -m tf_psplugin.launch`; the hosts' interface counters
show the traffic really crossed the links.
"""

import os
import subprocess

import numpy as np
import pytest
import tensorflow as tf

from tests.cluster import _cluster_util as cu
from tf_psplugin import checkpoint as ckpt_lib
from tf_psplugin.testing import hosts as hosts_lib

pytestmark = pytest.mark.cluster

CTR = os.path.join(cu.REPO_ROOT, "keras_examples", "ctr.py")
JOB = ["--train_steps", "20", "--vocab_size", "50", "--batch_size", "32",
       "--steps_per_execution", "5", "--save_every_steps", "10", "--log_every_steps", "10"]
PORT = 2222  # every host has its own port space


def _variables(model_dir):
    path = ckpt_lib.latest_checkpoint(model_dir).path
    reader = tf.train.load_checkpoint(path)
    return {name: reader.get_tensor(name) for name in reader.get_variable_to_shape_map()
            if "save_counter" not in name and "_CHECKPOINTABLE_OBJECT_GRAPH" not in name}


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_ctr_across_emulated_hosts_equals_loopback(procs, tmp_path):
    loopback_dir, hosts_dir = tmp_path / "loopback", tmp_path / "hosts"
    result = procs.run([cu.PYTHON, "-m", "tf_psplugin.launch", "--workers", "2", "--ps", "2",
                        "--timeout", "150", "--", cu.PYTHON, CTR, "--model_dir",
                        str(loopback_dir), *JOB], timeout=170)
    assert result.returncode == 0, result.stdout[-6000:]

    roles = {"chief": ["chief:0"], "worker": ["worker:0", "worker:1"], "ps": ["ps:0", "ps:1"]}
    names = [t for tasks in roles.values() for t in tasks]
    with hosts_lib.EmulatedHosts(names, rate_mbit=1000) as hosts:
        flags = [f"--{role}_hosts=" + ",".join(f"{hosts.address(t)}:{PORT}" for t in tasks)
                 for role, tasks in roles.items()]
        logs, tasks = {}, {}
        for name in names:
            role, index = name.split(":")
            logs[name] = open(tmp_path / f"{role}-{index}.log", "w")  # pylint: disable=consider-using-with
            tasks[name] = hosts.popen(
                name, [cu.PYTHON, CTR, "--model_dir", str(hosts_dir), *JOB, *flags,
                       f"--job_name={role}", f"--task_index={index}"],
                env=procs.env(), stdout=logs[name], stderr=subprocess.STDOUT)
        before = hosts.all_counters()
        try:
            code = tasks["chief:0"].wait(timeout=240)
        finally:
            for f in logs.values():
                f.close()
        chief_log = (tmp_path / "chief-0.log").read_text()
        assert code == 0, chief_log[-6000:]
        assert "ctr: final step 20" in chief_log
        after = hosts.all_counters()
        moved = {n: after[n]["rx_bytes"] + after[n]["tx_bytes"]
                 - before[n]["rx_bytes"] - before[n]["tx_bytes"] for n in names}
    # Every host took part over its own link (ps and worker servers carry
    # lookups, gradients and the all-reduce; the chief drives them).
    assert all(moved[n] > 100_000 for n in names), moved

    expected, got = _variables(loopback_dir), _variables(hosts_dir)
    assert sorted(got) == sorted(expected)
    for name, value in expected.items():
        if np.asarray(value).dtype.kind in "SUO":  # strings (e.g. the input position)
            assert got[name] == value, name
        else:
            np.testing.assert_allclose(got[name], value, rtol=1e-6, atol=1e-6, err_msg=name)
