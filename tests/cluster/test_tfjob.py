"""The Kubeflow TFJob of deploy/kubeflow/tfjob.yaml, run end to end on emulated hosts (issue 32).

Each pod is its own host (`tf_psplugin.testing.hosts`: a network namespace
with its own address; needs root, as CI has). Every pod gets what the
training operator would give it (tests/_tfjob.py): the `TF_CONFIG` with
the Service names `ctr-<job>-<i>.default.svc:2222`, which resolve inside each
namespace to the emulated hosts' addresses through `/etc/netns/<ns>/hosts`
(`ip netns exec` mounts it over `/etc/hosts`), plus the container's `env`;
it runs the container's `command` and `args` in its `workingDir`. What the
test changes, and only that:

* the image's `python` and `/workspace` are this checkout's interpreter and
  root; the PVC mounted at `/mnt/shared` is a temporary directory shared by
  every pod (paths under the mount are rewritten);
* flags appended after the manifest's shorten the run (absl: the last
  value wins): fewer steps, a smaller table and batches, a shorter bound on
  the chief's wait for the evaluator.

Replica counts are the manifest's (1 chief, 2 workers, 2 PS, 1 evaluator).
It checks what deploy/README.md promises: the chief exits 0 with a committed
checkpoint of the final step in the shared directory, the evaluator scored
that checkpoint before the chief exited (so `cleanPodPolicy: Running`, which
then deletes every running pod, cannot cut it short) and exited 0, and the
ps/worker servers exit 0 when stopped as that policy stops them (SIGTERM).
"""

import contextlib
import json
import os
import shutil
import signal
import subprocess
import time

import pytest

from tests.cluster import _cluster_util as cu
from tf_psplugin.state import checkpoint as ckpt_lib
from tf_psplugin.state import model_dir as md
from tf_psplugin.testing import hosts as hosts_lib

pytest.importorskip("yaml", reason="PyYAML (test extra) parses the manifest")

from tests._tfjob import (  # noqa: E402  (after the importorskip)
    container, load_manifest, operator_tf_configs, service_name, tasks)

pytestmark = pytest.mark.cluster

STEPS = 30
SHORTER = ["--train_steps", str(STEPS), "--vocab_size", "50", "--batch_size", "32",
           "--steps_per_execution", "5", "--save_every_steps", "10", "--log_every_steps", "10",
           "--eval_steps", "2", "--eval_batch_size", "64", "--wait_for_evaluator_seconds", "150"]
IMAGE_PYTHON = "python"
IMAGE_WORKDIR = "/workspace"


@contextlib.contextmanager
def service_dns(hosts, names):
    """Writes /etc/netns/<ns>/hosts for every host: Service name -> emulated address."""
    root = "/etc/netns"
    created_root = not os.path.isdir(root)
    made = []
    lines = ["127.0.0.1 localhost"] + [f"{hosts.address(host)} {name}"
                                       for host, name in names.items()]
    try:
        for host in names:
            path = os.path.join(root, hosts.namespace(host))
            os.makedirs(path)
            made.append(path)
            with open(os.path.join(path, "hosts"), "w", encoding="utf-8") as f:
                f.write("\n".join(lines) + "\n")
        yield
    finally:
        for path in made:
            shutil.rmtree(path, ignore_errors=True)
        if created_root:
            with contextlib.suppress(OSError):
                os.rmdir(root)  # Only if empty: someone else may use it now.


def pod_argv_env(spec, tf_config, base_env, shared_dir):
    """The pod's command line and environment, as its container would run them here."""
    c = container(spec)
    (mount,) = [m["mountPath"] for m in c["volumeMounts"]]

    def on_host(arg):
        return shared_dir + arg[len(mount):] if arg.startswith(mount) else arg

    argv = [on_host(a) for a in c["command"] + c.get("args", [])] + SHORTER
    assert argv[0] == IMAGE_PYTHON, argv
    argv[0] = cu.PYTHON
    env = dict(base_env)
    env.update({e["name"]: e["value"] for e in c.get("env", [])})
    env["TF_CONFIG"] = json.dumps(tf_config)
    assert c["workingDir"] == IMAGE_WORKDIR
    return argv, env


@pytest.mark.timeout(420)  # ~35 s on the 2-core CI box.
def test_the_manifest_job_runs_to_the_end_on_emulated_hosts(procs, tmp_path):
    tfjob = load_manifest()["TFJob"]
    specs = tfjob["spec"]["tfReplicaSpecs"]
    pods = tasks(tfjob)
    configs = operator_tf_configs(tfjob)
    names = {f"{job}-{index}": service_name(tfjob, job, index) for _, job, index in pods}
    shared = str(tmp_path / "pvc")
    os.makedirs(shared)
    model_dir = os.path.join(shared, "model")
    procs_by_host, logs = {}, {}
    with hosts_lib.EmulatedHosts(list(names)) as hosts, service_dns(hosts, names):
        try:
            for rtype, job, index in pods:
                host = f"{job}-{index}"
                argv, env = pod_argv_env(specs[rtype], configs[(job, index)], procs.env(),
                                         shared)
                log = open(tmp_path / f"{host}.log", "w")  # pylint: disable=consider-using-with
                logs[host] = log
                procs_by_host[host] = hosts.popen(host, argv, env=env, cwd=cu.REPO_ROOT,
                                                  stdin=subprocess.DEVNULL, stdout=log,
                                                  stderr=subprocess.STDOUT)
            chief_code = procs_by_host["chief-0"].wait(timeout=300)
            chief_exit = time.time()
            evaluator_code = procs_by_host["evaluator-0"].wait(timeout=60)
            # cleanPodPolicy: Running: the operator deletes the pods still running.
            running = {h: p for h, p in procs_by_host.items() if p.poll() is None}
            for proc in running.values():
                proc.send_signal(signal.SIGTERM)
            stopped = {h: p.wait(timeout=60) for h, p in running.items()}
        finally:
            for f in logs.values():
                f.close()
    text = {h: (tmp_path / f"{h}.log").read_text() for h in names}
    assert chief_code == 0, text["chief-0"][-6000:]
    assert f"ctr: final step {STEPS}" in text["chief-0"]
    assert evaluator_code == 0, text["evaluator-0"][-6000:]
    assert sorted(stopped) == ["ps-0", "ps-1", "worker-0", "worker-1"], stopped
    assert set(stopped.values()) == {0}, {h: text[h][-2000:] for h in stopped}

    latest = ckpt_lib.latest_checkpoint_info(model_dir)
    assert latest is not None and latest.step == STEPS
    # One data file per task holding variables: the chief's and each PS task's
    # table shards, which the PS tasks wrote into the shared directory.
    data_files = [name for name in latest.files if ".data-" in name]
    assert len(data_files) == 1 + specs["PS"]["replicas"], latest.files
    assert md.read_training_done(model_dir)["step"] == STEPS
    with open(os.path.join(model_dir, "eval", "metrics.jsonl"), encoding="utf-8") as f:
        scored = {r["step"]: r for r in map(json.loads, f)}
    assert STEPS in scored, scored
    assert scored[STEPS]["wall_time"] <= chief_exit, "the chief exited before the final score"
    assert f"ctr: the evaluator scored step {STEPS}" in text["chief-0"]
