"""Estimator front-end on a real loopback cluster: chief, workers, PS, evaluator.

Every task is a separate process running one of the scripts in
estimator_examples/, exactly as a user launches them: by TF_CONFIG, or by the
seed's flag lines without --chief_hosts (the first worker becomes the chief).
The chief and every worker write a JSON placement report
(`PlacementReportHook`), which is what the placement assertions read.

All processes are started through `_cluster_util.ProcessTracker`, which kills
every process group it started (and anything carrying its tag) at teardown,
even when a test fails.
"""

import glob
import json
import os
import re
import sys
import time

import pytest

from tests.cluster import _cluster_util as cu
from tf_psplugin._internal import compat as _compat

pytestmark = [
    pytest.mark.cluster,
    pytest.mark.tf215_only,
    pytest.mark.skipif(
        not _compat.HAS_ESTIMATOR,
        reason=f"tf.estimator was removed in TensorFlow 2.16; this is {_compat.TF_VERSION}",
    ),
]

EXAMPLES = os.path.join(cu.REPO_ROOT, "estimator_examples")
CANNED = os.path.join(EXAMPLES, "canned_wide_deep.py")
CUSTOM = os.path.join(EXAMPLES, "custom_model_fn.py")
TRAIN_STEPS = 60
RESUME_STEPS = 80


class _Job:
    """The processes of one launch: role -> (Popen, LineReader)."""

    def __init__(self, procs: cu.ProcessTracker):
        self._procs = procs
        self.tasks = {}

    def start(self, role: str, argv, env=None) -> None:
        proc = self._procs.popen([sys.executable] + list(argv), env=env)
        self.tasks[role] = (proc, cu.LineReader(proc))

    def output(self, role: str) -> str:
        return self.tasks[role][1].text()

    def wait(self, roles, timeout: float) -> None:
        """Waits until every role in `roles` exited 0; fails fast on any failure."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for role, (proc, _) in self.tasks.items():
                code = proc.poll()
                if code not in (None, 0):
                    pytest.fail(f"{role} exited with {code}:\n{self._tail(role)}")
            if all(self.tasks[r][0].poll() == 0 for r in roles):
                return
            time.sleep(0.5)
        pytest.fail(f"{roles} did not finish in {timeout} s:\n"
                    + "\n".join(self._tail(r, 15) for r in self.tasks))

    def _tail(self, role: str, lines: int = 40) -> str:
        # Drop absl's duplicate "I1121 10:00:00.0 ..." copies of Python log lines.
        text = [ln for ln in self.output(role).splitlines() if not re.match(r"[IWE]\d{4} ", ln)]
        return f"--- {role} ---\n" + "\n".join(text[-lines:])


def _addresses(n: int):
    return [f"127.0.0.1:{cu.free_port()}" for _ in range(n)]


def _tf_config(cluster, task_type, index) -> dict:
    return {"TF_CONFIG": json.dumps({"cluster": cluster, "task": {"type": task_type,
                                                                   "index": index}})}


def _placement(model_dir: str, task: str):
    with open(os.path.join(model_dir, "placement", f"placement_{task}.json")) as f:
        return json.load(f)


def _assert_hybrid_placement(records, num_ps: int) -> None:
    tables = [r for r in records if r["kind"] == "table"]
    dense = [r for r in records if r["kind"] == "dense"]
    assert tables and dense, records
    for r in tables + [r for r in records if r["kind"] == "table_slot"]:
        assert all(d.startswith("/job:ps/") for d in r["devices"]), r
    for r in dense:
        assert not any("/job:ps" in d for d in r["devices"]), f"dense variable on PS: {r}"
    used_ps = {d.split("/task:")[1].split("/")[0] for r in tables for d in r["devices"]}
    assert used_ps == {str(i) for i in range(num_ps)}, f"tables not sharded over all PS: {used_ps}"


def _scalars(event_glob: str, tag: str):
    import tensorflow as tf  # In the test process only for reading event files.

    points = []
    for path in glob.glob(event_glob):
        for event in tf.compat.v1.train.summary_iterator(path):
            for value in event.summary.value:
                if value.tag == tag:
                    points.append((event.step, value.simple_value))
    return sorted(points)


def _latest_step(model_dir: str) -> int:
    import tensorflow as tf

    path = tf.train.latest_checkpoint(model_dir)
    return int(path.rsplit("-", 1)[1]) if path else -1


def _launch_tf_config(procs, model_dir, cluster, steps, with_evaluator):
    job = _Job(procs)
    args = [CANNED, f"--model_dir={model_dir}", f"--train_steps={steps}",
            "--save_checkpoints_steps=30", "--vocab_size=200",
            f"--placement_report_dir={model_dir}/placement"]
    for job_name in ("ps", "chief", "worker"):
        for i in range(len(cluster[job_name])):
            job.start(f"{job_name}:{i}", args, env=_tf_config(cluster, job_name, i))
    if with_evaluator:
        job.start("evaluator", args, env=_tf_config(cluster, "evaluator", 0))
    return job


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Trains the canned wide & deep model for TRAIN_STEPS steps (TF_CONFIG launch).

    Yields:
        (model_dir, finished job, seconds).
    """
    procs = cu.ProcessTracker()
    try:
        model_dir = str(tmp_path_factory.mktemp("wide_deep"))
        hosts = _addresses(6)
        cluster = {"chief": hosts[:1], "worker": hosts[1:3], "ps": hosts[3:5],
                   "evaluator": hosts[5:]}
        start = time.monotonic()
        job = _launch_tf_config(procs, model_dir, cluster, TRAIN_STEPS, with_evaluator=True)
        job.wait(["chief:0", "worker:0", "worker:1", "evaluator"], timeout=170)
        seconds = time.monotonic() - start
    finally:
        procs.cleanup()  # The PS tasks serve forever; the job is over.
    yield model_dir, job, seconds


@pytest.mark.timeout(180)
def test_canned_wide_deep_trains_hybrid_with_evaluator(trained):
    model_dir, job, seconds = trained
    print(f"train_and_evaluate, chief + 2 workers + 2 PS + evaluator: {seconds:.0f} s")
    # Placement: tables (and their optimizer slots) sharded over both PS tasks,
    # nothing dense on a PS, on the chief and on every worker.
    for task in ("chief_0", "worker_0", "worker_1"):
        _assert_hybrid_placement(_placement(model_dir, task), num_ps=2)
    chief = {r["name"]: r for r in _placement(model_dir, "chief_0")}
    assert any(n.endswith("C1_embedding/embedding_weights/part_1") for n in chief), chief.keys()
    # The chief checkpoints; the checkpoint holds each table as ONE logical
    # tensor of the full shape (what the plain evaluator restores).
    assert _latest_step(model_dir) == TRAIN_STEPS
    import tensorflow as tf

    shapes = dict(tf.train.list_variables(model_dir))
    name = "dnn/input_from_feature_columns/input_layer/C1_embedding/embedding_weights"
    assert shapes[name] == [200, 8]
    # Loss falls (chief's training summaries) and the evaluator evaluated the
    # final checkpoint, writing eval event files.
    losses = [v for _, v in _scalars(os.path.join(model_dir, "events.out.*"), "loss")]
    assert len(losses) >= 4, losses
    assert sum(losses[-3:]) / 3 < losses[0] - 0.05, losses
    evals = _scalars(os.path.join(model_dir, "eval", "events.out.*"), "average_loss")
    assert evals and evals[-1][0] == TRAIN_STEPS, evals
    assert evals[-1][1] < 0.6, evals
    assert "Saving dict for global step 60" in job.output("evaluator")


@pytest.mark.timeout(180)
def test_restarted_job_resumes_step_count(trained):
    model_dir, _, _ = trained
    hosts = _addresses(6)  # The restarted job may come up anywhere.
    cluster = {"chief": hosts[:1], "worker": hosts[1:3], "ps": hosts[3:5], "evaluator": hosts[5:]}
    procs = cu.ProcessTracker()
    try:
        start = time.monotonic()
        job = _launch_tf_config(procs, model_dir, cluster, RESUME_STEPS, with_evaluator=False)
        job.wait(["chief:0", "worker:0", "worker:1"], timeout=150)
        print(f"resume {TRAIN_STEPS} -> {RESUME_STEPS}: {time.monotonic() - start:.0f} s")
    finally:
        procs.cleanup()
    chief = job.output("chief:0")
    assert f"Restoring parameters from {model_dir}/model.ckpt-{TRAIN_STEPS}" in chief
    assert f"step = {TRAIN_STEPS}" in chief  # The first logged step continues the count.
    assert "step = 0" not in chief.split("Restoring parameters")[-1]
    assert _latest_step(model_dir) == RESUME_STEPS


def _launch_flags(procs, script, model_dir, steps, extra=(), evaluator=True):
    """Starts every task with the seed's flag lines; no --chief_hosts."""
    workers, ps, ev = _addresses(2), _addresses(2), _addresses(1)
    common = [f"--model_dir={model_dir}", f"--train_steps={steps}",
              f"--placement_report_dir={model_dir}/placement", *extra]
    hosts = [f"--ps_hosts={','.join(ps)}", f"--worker_hosts={','.join(workers)}"]
    if evaluator:
        hosts.append(f"--evaluator_hosts={ev[0]}")
    job = _Job(procs)
    for job_name, count in (("ps", 2), ("worker", 2)):
        for i in range(count):
            job.start(f"{job_name}:{i}", [script, *hosts, f"--job_name={job_name}",
                                          f"--task_index={i}", *common])
    if evaluator:
        job.start("evaluator", [script, *hosts, "--job_name=evaluator", "--task_index=0",
                                *common])
    return job


@pytest.mark.timeout(180)
def test_custom_model_fn_flag_launch_without_chief_hosts(tmp_path, procs):
    model_dir = str(tmp_path / "custom")
    start = time.monotonic()
    job = _launch_flags(procs, CUSTOM, model_dir, 40)
    job.wait(["worker:0", "worker:1", "evaluator"], timeout=170)
    print(f"flag launch, 2 workers (first = chief) + 2 PS + evaluator: "
          f"{time.monotonic() - start:.0f} s")
    # --job_name=worker --task_index=0 became the chief: it wrote the
    # checkpoints and its placement report says chief_0.
    assert _latest_step(model_dir) == 40
    _assert_hybrid_placement(_placement(model_dir, "chief_0"), num_ps=2)
    _assert_hybrid_placement(_placement(model_dir, "worker_0"), num_ps=2)
    assert not os.path.exists(os.path.join(model_dir, "placement", "placement_worker_1.json"))
    aucs = _scalars(os.path.join(model_dir, "eval", "events.out.*"), "auc")
    assert aucs and aucs[-1][0] == 40 and aucs[-1][1] > 0.55, aucs


@pytest.mark.timeout(180)
def test_ps_async_fallback_puts_everything_on_ps(tmp_path, procs):
    model_dir = str(tmp_path / "fallback")
    job = _launch_flags(procs, CUSTOM, model_dir, 30, extra=["--dense_placement=ps"],
                        evaluator=False)
    job.wait(["worker:0", "worker:1"], timeout=170)
    records = _placement(model_dir, "chief_0")
    tables = [r for r in records if r["kind"] == "table"]
    assert {r["devices"][0].split("/device")[0] for r in tables} == {"/job:ps/task:0",
                                                                      "/job:ps/task:1"}
    for r in records:
        assert all(d.startswith("/job:ps/") for d in r["devices"]), r
    assert _latest_step(model_dir) >= 30


@pytest.mark.timeout(180)
@pytest.mark.parametrize("embedding_updates, optimizer", [
    ("sync", "sgd"),
    ("sync", "adagrad"),  # Adaptive: exact only because the chief applies the sum once.
    ("async", "sgd"),  # Per-worker sparse updates add up for SGD.
])
def test_hybrid_training_matches_single_process(tmp_path, procs, embedding_updates, optimizer):
    """2 workers x batch B == 1 process x batch 2B, to float precision.

    Both runs start from the distributed job's step-0 checkpoint, so they share
    initial values; SyntheticCTR gives worker i of 2 exactly half of each
    global batch.
    """
    import shutil

    import numpy as np
    import tensorflow as tf

    steps, batch = 8, 32
    dist_dir, local_dir = str(tmp_path / "dist"), str(tmp_path / "local")
    flags_common = [f"--optimizer={optimizer}", "--learning_rate=0.5",
                    "--save_checkpoints_steps=1000", "--vocab_size=50"]
    job = _launch_flags(procs, CUSTOM, dist_dir, steps, evaluator=False,
                        extra=[*flags_common, f"--batch_size={batch}",
                               f"--embedding_updates={embedding_updates}"])
    job.wait(["worker:0", "worker:1"], timeout=150)
    assert _latest_step(dist_dir) == steps
    os.makedirs(local_dir)
    for path in glob.glob(os.path.join(dist_dir, "model.ckpt-0.*")):
        shutil.copy(path, local_dir)
    with open(os.path.join(local_dir, "checkpoint"), "w") as f:
        f.write('model_checkpoint_path: "model.ckpt-0"\n')
    result = procs.run([sys.executable, CUSTOM, f"--model_dir={local_dir}",
                        f"--train_steps={steps}", f"--batch_size={2 * batch}", *flags_common],
                       timeout=120)
    assert result.returncode == 0, result.stdout[-3000:]
    assert _latest_step(local_dir) == steps
    dist = tf.train.load_checkpoint(tf.train.latest_checkpoint(dist_dir))
    local = tf.train.load_checkpoint(tf.train.latest_checkpoint(local_dir))
    names = sorted(local.get_variable_to_shape_map())
    assert "embedding/C1/embeddings" in names and "hidden_0/kernel" in names
    initial = tf.train.load_checkpoint(os.path.join(dist_dir, "model.ckpt-0"))
    moved, worst = 0, 0.0
    for name in names:
        want, got = local.get_tensor(name), dist.get_tensor(name)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=name)
        worst = max(worst, float(np.max(np.abs(np.asarray(got, np.float64) - want))))
        moved += int(not np.array_equal(want, initial.get_tensor(name)))
    print(f"{embedding_updates}/{optimizer}: {len(names)} variables, max |diff| {worst:.2e}")
    assert moved >= 5, "training did not change the variables"
