"""Cluster tests for the local launcher and the server entry point.

Real processes on loopback: a stock ParameterServerStrategy chief drives
servers started by `python -m tf_psplugin.launch`; every way the launcher can
end (normal exit, chief crash, SIGINT, SIGKILL of the launcher) must leave no
process behind; `--restart-failed` brings a killed worker back on the same
address.
"""

import json
import signal

import pytest

from tests.cluster import _cluster_util as cu

pytestmark = pytest.mark.cluster

# The chief creates one variable per PS and schedules closures until every
# worker has run one. ps/worker tasks run the same script (--servers command):
# server.start() serves there and never returns.
PSS_SCRIPT = """
import json, sys
from tf_psplugin.cluster import server

config = server.start()  # tf_psplugin: ps/worker tasks block here.
import tensorflow as tf

strategy = tf.distribute.experimental.ParameterServerStrategy(config.cluster_resolver())
coordinator = tf.distribute.experimental.coordinator.ClusterCoordinator(strategy)
with strategy.scope():
    variables = [tf.Variable(float(i), name=f"v{i}") for i in range(config.num_ps)]


@tf.function
def step():
    variables[0].assign_add(1.0)
    return tf.distribute.coordinator.experimental_get_current_worker_index()


seen, scheduled = set(), 0
for _ in range(25):
    values = [coordinator.schedule(step) for _ in range(2 * config.num_workers)]
    coordinator.join()
    scheduled += len(values)
    seen.update(int(v.fetch()) for v in values)
    if len(seen) == config.num_workers:
        break
# One write: a coordinator thread's log line cannot split it (PYTHONUNBUFFERED).
sys.stdout.write("RESULT " + json.dumps({
    "devices": [v.device for v in variables], "workers": sorted(seen),
    "v0": float(variables[0].numpy()), "scheduled": scheduled}) + "\\n")
"""

# No TensorFlow: the chief's behaviour is chosen by argv[1].
ROLES_SCRIPT = """
import json, os, sys, time

task = json.loads(os.environ["TF_CONFIG"])["task"]
print("ROLE", task["type"], task["index"], "pid", os.getpid(), flush=True)
print("stderr of", task["type"], file=sys.stderr, flush=True)
mode = sys.argv[1]
if task["type"] == "evaluator":
    time.sleep(2 if mode == "ok" else 600)
    print("EVAL DONE", flush=True)
elif mode == "crash":
    time.sleep(1)
    sys.exit(3)
elif mode == "hang":
    time.sleep(600)
"""


def launch_cmd(pid_file, *options):
    return [cu.PYTHON, "-m", "tf_psplugin.launch", "--pid-file", str(pid_file),
            "--grace-period", "5", *options]


def assert_all_gone(pid_file, procs, timeout=10.0):
    """Every pid the launcher recorded, and every tagged process, is dead."""
    pids = cu.read_pid_file(str(pid_file)).get("all", [])
    assert pids, "the launcher wrote no pids"
    assert cu.wait_until(lambda: not any(cu.pid_alive(p) for p in pids), timeout), (
        [p for p in pids if cu.pid_alive(p)])
    assert cu.wait_until(lambda: not cu.tagged_pids(procs.tag), timeout), cu.tagged_pids(procs.tag)
    return pids


@pytest.mark.timeout(60)
def test_stock_pss_chief_uses_every_ps_and_worker(tmp_path, procs):
    script = cu.python_script(tmp_path, PSS_SCRIPT, "pss_chief.py")
    pid_file = tmp_path / "pids.json"
    result = procs.run(launch_cmd(pid_file, "--workers", "2", "--ps", "2", "--servers",
                                  "command", "--", cu.PYTHON, script), timeout=55)
    out = result.stdout
    assert result.returncode == 0, out
    data = json.loads(cu.result_line(out))
    assert data["devices"] == ["/job:ps/replica:0/task:0/device:CPU:0",
                               "/job:ps/replica:0/task:1/device:CPU:0"], out
    assert data["workers"] == [0, 1], out
    assert data["v0"] == data["scheduled"]
    # Role prefixes: every task's server line, and the chief's result.
    for role in ("ps:0", "ps:1", "worker:0", "worker:1"):
        assert f"[{role}] tf_psplugin.server: {role} serving at 127.0.0.1:" in out, out
    assert "[chief] RESULT " in out and "[launch] chief exited (exit 0)" in out
    for line in out.splitlines():
        assert line.startswith(("[chief] ", "[worker:", "[ps:", "[launch] ")), line
    assert len(assert_all_gone(pid_file, procs)) == 5


@pytest.mark.timeout(60)
def test_normal_exit_waits_for_evaluator_and_leaves_nothing(tmp_path, procs):
    script = cu.python_script(tmp_path, ROLES_SCRIPT, "roles.py")
    pid_file = tmp_path / "pids.json"
    result = procs.run(launch_cmd(pid_file, "--workers", "1", "--ps", "1", "--evaluator",
                                  "--servers", "builtin", "--", cu.PYTHON, script, "ok"),
                       timeout=55)
    out = result.stdout
    assert result.returncode == 0, out
    assert "[chief] ROLE chief 0" in out and "[chief] stderr of chief" in out, out
    assert "[evaluator] ROLE evaluator 0" in out and "[evaluator] EVAL DONE" in out, out
    assert out.index("[launch] waiting for the evaluator") < out.index("[evaluator] EVAL DONE")
    assert len(assert_all_gone(pid_file, procs)) == 4


@pytest.mark.timeout(60)
def test_chief_crash_stops_everything_with_chief_exit_code(tmp_path, procs):
    script = cu.python_script(tmp_path, ROLES_SCRIPT, "roles.py")
    pid_file = tmp_path / "pids.json"
    result = procs.run(launch_cmd(pid_file, "--workers", "1", "--ps", "1", "--evaluator",
                                  "--servers", "builtin", "--", cu.PYTHON, script, "crash"),
                       timeout=55)
    out = result.stdout
    assert result.returncode == 3, out
    assert "[launch] chief exited (exit 3)" in out and "[evaluator] ROLE evaluator 0" in out, out
    assert "EVAL DONE" not in out
    assert len(assert_all_gone(pid_file, procs)) == 4


@pytest.mark.timeout(60)
@pytest.mark.parametrize("sig,code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_signal_to_launcher_stops_everything(tmp_path, procs, sig, code):
    script = cu.python_script(tmp_path, ROLES_SCRIPT, "roles.py")
    pid_file = tmp_path / "pids.json"
    proc = procs.popen(launch_cmd(pid_file, "--workers", "1", "--ps", "1", "--servers",
                                  "builtin", "--", cu.PYTHON, script, "hang"))
    reader = cu.LineReader(proc)
    assert reader.wait_for("serving at", count=2, timeout=45), reader.text()
    assert reader.wait_for("[chief] ROLE chief", timeout=5), reader.text()
    proc.send_signal(sig)  # What Ctrl-C does (to the launcher only: children have own sessions).
    assert proc.wait(timeout=20) == code, reader.text()
    out = reader.join()
    assert f"[launch] {signal.Signals(sig).name} received; stopping every task" in out, out
    assert "[ps:0] tf_psplugin.server: ps:0 stopping on SIGTERM" in out, out
    assert len(assert_all_gone(pid_file, procs)) == 3


@pytest.mark.timeout(60)
def test_sigkilled_launcher_leaves_nothing(tmp_path, procs):
    script = cu.python_script(tmp_path, ROLES_SCRIPT, "roles.py")
    pid_file = tmp_path / "pids.json"
    proc = procs.popen(launch_cmd(pid_file, "--workers", "1", "--ps", "1", "--evaluator",
                                  "--servers", "builtin", "--", cu.PYTHON, script, "hang"))
    reader = cu.LineReader(proc)
    assert reader.wait_for("ROLE", count=2, timeout=40), reader.text()
    pids = cu.read_pid_file(str(pid_file))["all"]
    assert len(pids) == 4 and all(cu.pid_alive(p) for p in pids)
    proc.kill()  # No cleanup code runs: only PR_SET_PDEATHSIG can save us.
    proc.wait(timeout=10)
    assert_all_gone(pid_file, procs, timeout=15)


@pytest.mark.timeout(60)
def test_restart_failed_worker_comes_back_on_same_address(make_cluster):
    cluster = make_cluster(num_workers=1, num_ps=1, restart_failed=True, max_restarts=2)
    cluster.start_servers()
    assert cluster.wait_for_output("serving at", count=2, timeout=45), cluster.output()
    address = cluster.config.cluster["worker"][0]
    old_pid = cluster.pids()["worker:0"]
    with open(f"/proc/{old_pid}/environ", "rb") as f:
        old_env = f.read()
    cluster.kill("worker", 0)
    assert cluster.wait_for_output("[launch] restarting worker:0 (exit -9), restart 1/2",
                                   timeout=10), cluster.output()
    assert cluster.wait_for_output(f"worker:0 serving at {address}", role="worker:0", count=2,
                                   timeout=40), cluster.output()
    new_pid = cluster.pids()["worker:0"]
    assert new_pid != old_pid and cu.pid_alive(new_pid) and not cu.pid_alive(old_pid)
    with open(f"/proc/{new_pid}/environ", "rb") as f:
        new_env = f.read()
    tf_config = [v for v in old_env.split(b"\0") if v.startswith(b"TF_CONFIG=")]
    assert tf_config and tf_config[0] in new_env.split(b"\0")
    host, port = address.rsplit(":", 1)
    assert cu.wait_for_port(host, int(port), timeout=5)
    assert cluster.restarts() == {"ps:0": 0, "worker:0": 1}
    cluster.stop()
    assert not any(cu.pid_alive(p) for p in cluster.all_pids())


@pytest.mark.timeout(60)
def test_bad_usage_exits_2_with_one_line(tmp_path, procs):
    result = procs.run([cu.PYTHON, "-m", "tf_psplugin.launch", "--workers", "1", "--ps", "0",
                        "--", cu.PYTHON, "-c", "pass"], timeout=55)
    assert result.returncode == 2, result.stdout
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tf_psplugin.launch: error: num_ps: ")
    assert "Traceback" not in result.stdout
