"""The Kubeflow TFJob manifest gives every replica a TF_CONFIG the plugin accepts.

Builds each replica's TF_CONFIG the way Kubeflow's training operator
(kubeflow.org/v1) does: job names are the lowercased replica types, addresses
are `<tfjob>-<type>-<index>.<namespace>.svc:<port>` with the port of the
`tensorflow` container's `tfjob-port` (2222 by default), the Evaluator is left
out of the cluster, and "environment": "cloud" is added. Each one is then fed
through `python -m tf_psplugin.config`, as a pod would.
"""

import json
import os
import subprocess
import sys

import pytest

yaml = pytest.importorskip("yaml", reason="PyYAML (test extra) parses the manifest")

MANIFEST = os.path.join(os.path.dirname(__file__), "..", "..", "deploy", "kubeflow", "tfjob.yaml")
DEFAULT_PORT = 2222


def load_manifest():
    with open(MANIFEST, encoding="utf-8") as f:
        docs = [doc for doc in yaml.safe_load_all(f) if doc]
    return {doc["kind"]: doc for doc in docs}


def replica_port(spec):
    for container in spec["template"]["spec"]["containers"]:
        if container["name"] == "tensorflow":
            for port in container.get("ports", []):
                if port.get("name") == "tfjob-port":
                    return port["containerPort"]
    return DEFAULT_PORT


def operator_tf_configs(tfjob):
    """{(type, index): TF_CONFIG dict}, as the training operator builds them."""
    name = tfjob["metadata"]["name"]
    namespace = tfjob["metadata"].get("namespace", "default")
    specs = tfjob["spec"]["tfReplicaSpecs"]
    cluster = {}
    for rtype, spec in specs.items():
        if rtype == "Evaluator":  # "evaluator is not part of training cluster"
            continue
        job = rtype.lower()
        cluster[job] = [f"{name}-{job}-{i}.{namespace}.svc:{replica_port(spec)}"
                        for i in range(spec.get("replicas", 1))]
    return {
        (rtype.lower(), i): {"cluster": cluster, "task": {"type": rtype.lower(), "index": i},
                             "environment": "cloud"}
        for rtype, spec in specs.items() for i in range(spec.get("replicas", 1))
    }


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


@pytest.mark.timeout(450)
def test_every_replica_tf_config_is_accepted_by_the_cli():
    configs = operator_tf_configs(load_manifest()["TFJob"])
    assert len(configs) == 6
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    procs = {}
    try:
        # Concurrently: each one imports TensorFlow.
        for task, tf_config in configs.items():
            procs[task] = subprocess.Popen(
                [sys.executable, "-m", "tf_psplugin.config"],
                env=dict(env, TF_CONFIG=json.dumps(tf_config)),
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        results = {task: (p.communicate(timeout=400), p.returncode) for task, p in procs.items()}
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
    for (task_type, index), ((out, err), code) in results.items():
        assert code == 0, (task_type, index, err)
        info = json.loads(out)
        assert (info["role"], info["task_index"]) == (task_type, index)
        assert info["source"] == "TF_CONFIG" and not info["chief_promoted_from_worker"]
        assert info["chief"] == "ctr-chief-0.default.svc:2222"
        assert info["training_cluster"]["ps"] == [
            "ctr-ps-0.default.svc:2222", "ctr-ps-1.default.svc:2222"]
        assert "evaluator" not in info["training_cluster"]
        if task_type == "evaluator":
            assert info["task_address"] is None
        else:
            assert info["task_address"] == f"ctr-{task_type}-{index}.default.svc:2222"
