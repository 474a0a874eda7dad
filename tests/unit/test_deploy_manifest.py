"""The Kubeflow TFJob manifest gives every replica a TF_CONFIG the plugin accepts.

Builds each replica's TF_CONFIG the way Kubeflow's training operator
(kubeflow.org/v1) does (tests/_tfjob.py: job names are the lowercased replica
types, addresses are `<tfjob>-<type>-<index>.<namespace>.svc:<port>` with the
port of the `tensorflow` container's `tfjob-port`, 2222 by default, the
evaluator is in the cluster, and "environment": "cloud" is added). Each one is
then fed through the `tf_psplugin.config` command: the chief's as a pod runs
it (`python -m tf_psplugin.config`, a process importing TensorFlow), every
replica's through the command's `main` in this process (the same code; the
real process is also checked in tests/unit/test_config.py).
"""

import contextlib
import io
import json
import os
import subprocess
import sys

import pytest

from tf_psplugin.cluster import config_command

yaml = pytest.importorskip("yaml", reason="PyYAML (test extra) parses the manifest")

from tests._tfjob import (  # noqa: E402  (after the importorskip)
    DEFAULT_PORT, load_manifest, operator_tf_configs, replica_port)


def test_manifest_shape():
    docs = load_manifest()
    tfjob = docs["TFJob"]
    assert tfjob["apiVersion"] == "kubeflow.org/v1"
    specs = tfjob["spec"]["tfReplicaSpecs"]
    assert {k: v["replicas"] for k, v in specs.items()} == {
        "Chief": 1, "Worker": 2, "PS": 2, "Evaluator": 1}
    claim = docs["PersistentVolumeClaim"]["metadata"]["name"]
    assert "ReadWriteMany" in docs["PersistentVolumeClaim"]["spec"]["accessModes"]
    for rtype, spec in specs.items():
        pod = spec["template"]["spec"]
        (container,) = [c for c in pod["containers"] if c["name"] == "tensorflow"]
        argv = container["command"] + container.get("args", [])
        assert argv[:2] == ["python", "keras_examples/ctr.py"], rtype
        assert argv[argv.index("--model_dir") + 1] == "/mnt/shared/model", rtype
        mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
        volumes = {v["name"]: v["persistentVolumeClaim"]["claimName"] for v in pod["volumes"]}
        assert any(path == "/mnt/shared" and volumes.get(vol) == claim
                   for vol, path in mounts.items()), rtype
        assert replica_port(spec) == DEFAULT_PORT


def _in_process(tf_config):
    """((stdout, stderr), exit code) of the command's `main` on `tf_config`, in this process."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = config_command.main(["tf_psplugin.config"],
                                   environ=dict(os.environ, TF_CONFIG=json.dumps(tf_config)))
    return (out.getvalue(), err.getvalue()), code


@pytest.mark.timeout(300)
def test_every_replica_tf_config_is_accepted_by_the_cli():
    configs = operator_tf_configs(load_manifest()["TFJob"])
    assert len(configs) == 6
    results = {task: _in_process(tf_config) for task, tf_config in configs.items()}
    # The chief's as a pod runs it too: one process (each imports TensorFlow).
    pod = subprocess.run([sys.executable, "-m", "tf_psplugin.config"],
                         env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2",
                                  TF_CONFIG=json.dumps(configs[("chief", 0)])),
                         capture_output=True, text=True, timeout=240, check=False)
    assert (pod.returncode, pod.stdout) == (results[("chief", 0)][1], results[("chief", 0)][0][0]), (
        pod.returncode, pod.stderr[-3000:])
    for (task_type, index), ((out, err), code) in results.items():
        assert code == 0, (task_type, index, err)
        info = json.loads(out)
        assert (info["role"], info["task_index"]) == (task_type, index)
        assert info["source"] == "TF_CONFIG" and not info["chief_promoted_from_worker"]
        assert info["chief"] == "ctr-chief-0.default.svc:2222"
        assert info["training_cluster"]["ps"] == [
            "ctr-ps-0.default.svc:2222", "ctr-ps-1.default.svc:2222"]
        assert "evaluator" not in info["training_cluster"]
        assert info["evaluator"] == "ctr-evaluator-0.default.svc:2222"
        assert info["task_address"] == f"ctr-{task_type}-{index}.default.svc:2222"


def test_policies_are_the_ones_deploy_readme_explains():
    """cleanPodPolicy Running needs a chief that waits for the evaluator; see deploy/README."""
    from tests._tfjob import container

    tfjob = load_manifest()["TFJob"]
    run_policy, specs = tfjob["spec"]["runPolicy"], tfjob["spec"]["tfReplicaSpecs"]
    assert run_policy["cleanPodPolicy"] == "Running"
    assert "successPolicy" not in tfjob["spec"]  # Only matters without a Chief.
    assert specs["Chief"]["restartPolicy"] == "ExitCode"  # 138 retried, 1 permanent.
    for rtype in ("Worker", "PS", "Evaluator"):
        assert specs[rtype]["restartPolicy"] == "OnFailure", rtype
    # One worker failure costs Worker.replicas restarts of the shared budget.
    assert run_policy["backoffLimit"] > 2 * specs["Worker"]["replicas"]
    argv = container(specs["Chief"])["args"]
    assert float(argv[argv.index("--wait_for_evaluator_seconds") + 1]) > 0
