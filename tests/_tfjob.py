"""The Kubeflow TFJob manifest (deploy/kubeflow/tfjob.yaml), read as the training operator does.

Shared by the manifest's unit tests and tests/cluster/test_tfjob.py, which
runs the job on emulated hosts. What the operator (kubeflow.org/v1,
training-operator v1.x: `pkg/controller.v1/tensorflow/tensorflow.go`
`genClusterSpec`/`genTFConfigJSONStr`) gives every pod as `TF_CONFIG`:

* job names are the replica types lowercased (`chief`, `worker`, `ps`,
  `evaluator`); every replica type is in the cluster, the evaluator
  included (it was left out before v1.0);
* replica *i* is `<tfjob>-<job>-<i>.<namespace>.svc:<port>`, the port being
  the `tensorflow` container's `tfjob-port` (2222 if absent);
* `"task": {"type": <job>, "index": i}` and `"environment": "cloud"`.
"""

import os
from typing import Dict, List, Optional, Tuple

import yaml

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MANIFEST = os.path.join(REPO_ROOT, "deploy", "kubeflow", "tfjob.yaml")
DEFAULT_PORT = 2222
CONTAINER = "tensorflow"  # The operator's TFJobDefaultContainerName.


def load_manifest(path: str = MANIFEST) -> Dict[str, dict]:
    """The manifest's documents by kind (`TFJob`, `PersistentVolumeClaim`)."""
    with open(path, encoding="utf-8") as f:
        docs = [doc for doc in yaml.safe_load_all(f) if doc]
    return {doc["kind"]: doc for doc in docs}


def container(spec: dict) -> dict:
    """The replica's `tensorflow` container."""
    (found,) = [c for c in spec["template"]["spec"]["containers"] if c["name"] == CONTAINER]
    return found


def replica_port(spec: dict) -> int:
    for port in container(spec).get("ports", []):
        if port.get("name") == "tfjob-port":
            return port["containerPort"]
    return DEFAULT_PORT


def service_name(tfjob: dict, job: str, index: int) -> str:
    """The DNS name of a replica's headless Service."""
    namespace = tfjob["metadata"].get("namespace", "default")
    return f"{tfjob['metadata']['name']}-{job}-{index}.{namespace}.svc"


def replica_counts(tfjob: dict) -> Dict[str, int]:
    """{replica type: replicas} (the operator's default is 1)."""
    specs = tfjob["spec"]["tfReplicaSpecs"]
    return {rtype: spec.get("replicas", 1) for rtype, spec in specs.items()}


def tasks(tfjob: dict, replicas: Optional[Dict[str, int]] = None) -> List[Tuple[str, str, int]]:
    """[(replica type, job name, index)] for every pod, chief first."""
    counts = dict(replica_counts(tfjob), **(replicas or {}))
    order = ["Chief", "Worker", "PS", "Evaluator"]
    return [(rtype, rtype.lower(), i)
            for rtype in sorted(counts, key=lambda r: order.index(r) if r in order else 99)
            for i in range(counts[rtype])]


def operator_tf_configs(tfjob: dict,
                        replicas: Optional[Dict[str, int]] = None) -> Dict[Tuple[str, int], dict]:
    """{(job, index): TF_CONFIG dict}, as the training operator builds them.

    Args:
        tfjob: The TFJob document.
        replicas: Replica counts to use instead of the manifest's, by type.
    """
    specs = tfjob["spec"]["tfReplicaSpecs"]
    all_tasks = tasks(tfjob, replicas)
    cluster: Dict[str, List[str]] = {}
    for rtype, job, index in all_tasks:
        cluster.setdefault(job, []).append(
            f"{service_name(tfjob, job, index)}:{replica_port(specs[rtype])}")
    return {(job, index): {"cluster": cluster, "task": {"type": job, "index": index},
                           "environment": "cloud"}
            for _, job, index in all_tasks}
