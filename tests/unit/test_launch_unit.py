"""Fast tests of the launcher and server entry point (plain Python children, no TF servers)."""

import json
import os
import time
import signal
import subprocess
import sys

import pytest

from tf_psplugin.cluster import config as cfg
from tf_psplugin.cluster import flags as cfg_flags
from tf_psplugin.cluster import launch
from tf_psplugin.cluster import local_cluster
from tf_psplugin.cluster import server
from tf_psplugin.cluster.config import ConfigError
from tf_psplugin.cluster.local_cluster import LocalCluster
from tf_psplugin.errors import RESTART_EXIT_CODE

PY = sys.executable


@pytest.mark.parametrize("argv,field", [
    (["--workers", "2"], "COMMAND"),
    (["--workers", "x", "--", PY], "--workers"),
    (["--workers", "--", PY], "--workers"),
    (["--bogus", "--", PY], "--bogus"),
    (["--servers", "remote", "--", PY], "--servers"),
    (["--grace-period=-1", "--", PY], "--grace-period"),
    (["--max-restarts", "-2", "--", PY], "--max-restarts"),
    (["--verbosity", "loud", "--", PY], "--verbosity"),
])
def test_parse_args_errors(argv, field):
    with pytest.raises(ConfigError) as info:
        launch._parse_args(argv)
    assert info.value.field == field


def test_parse_args_values():
    opts = launch._parse_args(["--workers=3", "--ps", "2", "--evaluator", "--restart-failed",
                               "--servers", "builtin", "--timeout", "9.5", "--", PY, "-c", "x"])
    assert (opts["workers"], opts["ps"], opts["evaluator"], opts["restart_failed"]) == (
        3, 2, True, True)
    assert opts["servers"] == "builtin" and opts["timeout"] == 9.5
    assert opts["command"] == [PY, "-c", "x"]
    assert launch._parse_args(["--", PY])["servers"] == "command"


@pytest.mark.parametrize("command,problem", [
    ([], "is empty"),
    (["no-such-program-xyz"], "not an executable"),
    ([PY, "train.py", "--job_name=ps"], "--job_name"),
    ([PY, "train.py", "--worker_hosts", "a:1"], "--worker_hosts"),
])
def test_check_command(command, problem):
    with pytest.raises(ConfigError, match=problem):
        local_cluster.check_command(command)


def test_the_former_import_paths_still_work():
    import tf_psplugin.launch as public  # pylint: disable=g-import-not-at-top

    assert launch.LocalCluster is public.LocalCluster is LocalCluster
    assert public.main is launch.main


def test_main_usage(capsys):
    assert launch.main(["--help"]) == 0
    assert "--restart-failed" in capsys.readouterr().out
    assert launch.main(["--ps", "0", "--", PY, "-c", "pass"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("tf_psplugin.launch: error: num_ps: ")


def test_cluster_argument_errors():
    with pytest.raises(ConfigError):
        LocalCluster(1, 1, servers="remote")
    with LocalCluster(1, 1, servers="command") as cluster:
        with pytest.raises(ConfigError):
            cluster.start_servers()
        with pytest.raises(ConfigError):
            cluster.start_evaluator([PY, "-c", "pass"])


def test_run_chief_prefixes_output_and_writes_logs(tmp_path):
    code = ("import json, os, sys; t = json.loads(os.environ['TF_CONFIG'])['task'];"
            "print('task', t['type'], t['index'], os.environ['PYTHONUNBUFFERED']);"
            "print('oops', file=sys.stderr); sys.stdout.write('no newline'); sys.exit(4)")
    pid_file = str(tmp_path / "pids.json")
    with open(os.devnull, "w") as devnull:
        with LocalCluster(1, 1, log_dir=str(tmp_path / "logs"), output=devnull,
                          pid_file=pid_file) as cluster:
            result = cluster.run_chief([PY, "-c", code], timeout=30)
    assert result.returncode == 4
    assert "[chief] task chief 0 1\n" in result.stdout
    assert "[chief] oops\n" in result.stdout and "[chief] no newline\n" in result.stdout
    assert "[launch] chief exited (exit 4)\n" in result.stdout
    with open(tmp_path / "logs" / "chief.log") as f:
        assert "task chief 0" in f.read()
    data = json.load(open(pid_file))
    assert data["tasks"]["chief"] == data["all"][0] == cluster.pids()["chief"]


_CHIEF_THAT_FAILS = (
    "import os, sys, signal; n = int(os.environ['TF_PSPLUGIN_CHIEF_RESTARTS']);"
    "print('attempt', n, flush=True); codes = [int(c) for c in sys.argv[1:]];"
    "code = codes[n] if n < len(codes) else 0;"
    "os.kill(os.getpid(), signal.SIGKILL) if code == -9 else sys.exit(code)")


@pytest.mark.parametrize("codes,restart_failed,expected_code,attempts", [
    (["138", "138"], True, 0, 3),  # TaskFailedError twice: restarted, then done.
    (["-9"], True, 0, 2),  # Killed (OOM killer): restarted.
    (["138"], False, 138, 1),  # Without --restart-failed: the job's result.
    (["1"], True, 1, 1),  # A bug is not retried.
    (["138", "138", "138"], True, 138, 3),  # Budget (max_restarts=2) spent.
])
def test_chief_restarts_on_the_restart_exit_code(codes, restart_failed, expected_code,
                                                 attempts):
    with open(os.devnull, "w") as devnull:
        with LocalCluster(1, 1, output=devnull, restart_failed=restart_failed,
                          max_restarts=2) as cluster:
            result = cluster.run_chief([PY, "-c", _CHIEF_THAT_FAILS] + codes, timeout=60)
    assert result.returncode == expected_code, result.stdout
    seen = [line for line in result.stdout.splitlines() if line.startswith("[chief] attempt")]
    assert seen == [f"[chief] attempt {i}" for i in range(attempts)], result.stdout
    if attempts > 1:
        assert "[launch] restarting chief (exit " in result.stdout
    if expected_code == 138 and restart_failed:
        assert "no restarts left (2 used)" in result.stdout


@pytest.mark.parametrize("verbosity,expected", [
    ("warning", "TF_CPP_MIN_LOG_LEVEL=1 TF_PSPLUGIN_VERBOSITY=None"),
    ("info", "TF_CPP_MIN_LOG_LEVEL=0 TF_PSPLUGIN_VERBOSITY=info"),
])
def test_verbosity_reaches_every_task(monkeypatch, verbosity, expected):
    monkeypatch.delenv("TF_CPP_MIN_LOG_LEVEL", raising=False)
    monkeypatch.delenv("TF_PSPLUGIN_VERBOSITY", raising=False)
    opts = launch._parse_args(["--verbosity", verbosity, "--", PY])
    code = ("import os; e = os.environ; print('TF_CPP_MIN_LOG_LEVEL=' + e['TF_CPP_MIN_LOG_LEVEL'],"
            " 'TF_PSPLUGIN_VERBOSITY=' + str(e.get('TF_PSPLUGIN_VERBOSITY')))")
    with open(os.devnull, "w") as devnull:
        with LocalCluster(1, 1, output=devnull,
                          env=launch._VERBOSITY_ENV[opts["verbosity"]]) as cluster:
            result = cluster.run_chief([PY, "-c", code], timeout=30)
    assert f"[chief] {expected}\n" in result.stdout, result.stdout


def test_run_chief_timeout_kills_it():
    with open(os.devnull, "w") as devnull:
        with LocalCluster(1, 1, output=devnull) as cluster:
            with pytest.raises(subprocess.TimeoutExpired):
                cluster.run_chief([PY, "-c", "import time; print('x'); time.sleep(60)"],
                                  timeout=2)
            pid = cluster.pids()["chief"]
    assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] in "ZX"


def test_stop_is_idempotent_and_kills_grandchildren():
    code = ("import subprocess, sys, time;"
            "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']);"
            "print('grandchild', p.pid, flush=True); time.sleep(60)")
    cluster = LocalCluster(1, 1, output=open(os.devnull, "w"), grace_period=1)
    task = cluster._start("ps", 0, [PY, "-c", code])
    assert cluster.wait_for_output("grandchild", timeout=20)
    grandchild = int(cluster.output("ps:0")[0].split()[-1])
    cluster.stop()
    cluster.stop()
    assert task.proc.returncode is not None

    def alive():
        try:
            with open(f"/proc/{grandchild}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] not in "ZX"
        except FileNotFoundError:
            return False

    # SIGKILL is delivered asynchronously: allow it a moment to land.
    deadline = time.monotonic() + 5
    while alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive()


def test_server_start_returns_on_chief_and_exports_tf_config(monkeypatch):
    monkeypatch.delenv("GRPC_FAIL_FAST", raising=False)
    monkeypatch.delenv("TF_CONFIG", raising=False)
    config = cfg_flags.resolve(argv=["x", "--job_name=worker", "--task_index=0",
                               "--worker_hosts=h0:1,h1:2", "--ps_hosts=h2:3"], environ={})
    assert server.start(config) is config
    assert os.environ["GRPC_FAIL_FAST"] == "use_caller"
    exported = json.loads(os.environ["TF_CONFIG"])
    assert exported["cluster"]["chief"] == ["h0:1"] and exported["task"]["type"] == "chief"
    assert cfg.from_tf_config(os.environ["TF_CONFIG"]) == config


def test_server_start_bad_config_exits_2(monkeypatch, capsys):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    with pytest.raises(SystemExit) as info:
        server.start(argv=["x", "--job_name=ps"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("tf_psplugin.server: error: --ps_hosts: ") and err.count("\n") == 1


def test_run_server_refuses_chief_and_cli_explains(capsys):
    with pytest.raises(ConfigError):
        server.run_server(cfg.local(1, 1))
    assert server.main(["x", "--job_name=chief", "--chief_hosts=h0:1", "--ps_hosts=h1:2"]) == 2
    err = capsys.readouterr().err
    assert "runs the training script" in err and err.count("\n") == 1


def test_kill_unknown_task():
    with LocalCluster(1, 1) as cluster:
        with pytest.raises(KeyError):
            cluster.kill("worker", 0, signal.SIGTERM)


# -- Restart budget accounting (no processes: exits are fed to the launcher) --


class _ExitedProc:
    """What the launcher reads of a task's process once it has exited."""

    def __init__(self, returncode):
        self.pid = -1
        self.returncode = returncode

    def poll(self):
        return self.returncode


class _BudgetCluster:
    """A LocalCluster whose tasks' exits are injected one at a time."""

    def __init__(self, monkeypatch, max_restarts=2, max_total_restarts=None, workers=2):
        monkeypatch.setattr(local_cluster, "_kill_group", lambda pid, sig: None)
        self.cluster = LocalCluster(workers, 1, restart_failed=True, max_restarts=max_restarts,
                                    max_total_restarts=max_total_restarts,
                                    output=open(os.devnull, "w"))
        self.spawned = []
        monkeypatch.setattr(self.cluster, "_spawn", self._spawn)
        self.now = 1000.0
        self.cluster._clock = lambda: self.now
        roles = [("ps", 0)] + [("worker", i) for i in range(workers)] + [("chief", 0)]
        for job, index in roles:
            task = local_cluster._Task(job, index, [PY])
            self.cluster._tasks[task.role] = task

    def _spawn(self, task):
        self.spawned.append(task.role)
        task.proc, task.handled, task.restart_at = None, False, None

    def task(self, role):
        return self.cluster._tasks[role]

    def exit(self, role, code):
        """A ps/worker exits with `code`; returns whether the launcher restarts it."""
        task = self.task(role)
        task.proc, task.handled = _ExitedProc(code), False
        self.now += 1.0
        with self.cluster._lock:
            self.cluster._on_exit(task, self.now)
            if task.restart_at is not None:
                self._spawn(task)
        return not task.finished.is_set()

    def chief_exit(self, code):
        """The chief exits with `code`; returns whether the launcher restarts it."""
        task = self.task("chief")
        task.proc = _ExitedProc(code)
        with self.cluster._lock:
            return self.cluster._restart_chief(task, code)

    def failures(self):
        return self.cluster.failures()

    def log(self):
        return "".join(self.cluster.output())


def test_budget_counts_own_failures_not_coordinated_restarts(monkeypatch):
    """4 worker kills in turn with max_restarts=2: each worker failed twice, all restarted."""
    c = _BudgetCluster(monkeypatch, max_restarts=2)
    for n in range(4):
        dead, survivor = f"worker:{n % 2}", f"worker:{1 - n % 2}"
        assert c.exit(dead, -signal.SIGKILL)  # Its own failure.
        assert c.exit(survivor, -signal.SIGABRT)  # Aborted by the chief's failover.
        assert c.exit(dead, -signal.SIGABRT)  # Its restarted process, aborted too.
        assert c.chief_exit(RESTART_EXIT_CODE)  # Coordinated: free.
    assert c.failures() == {"ps:0": 0, "worker:0": 2, "worker:1": 2, "chief": 0}
    assert c.cluster.restarts() == {"ps:0": 0, "worker:0": 6, "worker:1": 6, "chief": 4}
    assert c.cluster.total_failures == 4
    assert "not counted against its budget" in c.log()
    assert "worker:1 failed; not counted against the chief's budget" in c.log()
    # A fifth failure of a worker whose budget is spent ends the job: the
    # worker stays down and the chief is not restarted to wait for it.
    assert not c.exit("worker:0", -signal.SIGKILL)
    assert "worker:0 exited (exit -9); no restarts left (2 used)" in c.log()
    assert not c.chief_exit(RESTART_EXIT_CODE)
    assert "not restarting it: worker:0 will not come back" in c.log()


def test_a_failure_and_the_abort_it_causes_seen_in_one_pass_are_handled_failure_first(
        monkeypatch):
    """The launcher's pass sees worker:0's abort and worker:1's kill at once (a loaded box).

    worker:0 comes first in task order; its abort is still free, because the
    kill that caused it is handled first and opens the recovery.
    """
    c = _BudgetCluster(monkeypatch, max_restarts=2)
    for _ in range(2):  # Kills of worker:1; worker:0 is aborted each time.
        for role, code in (("worker:0", -signal.SIGABRT), ("worker:1", -signal.SIGKILL)):
            task = c.task(role)
            task.proc, task.handled, task.restart_at = _ExitedProc(code), False, None
        c.now += 1.0
        with c.cluster._lock:
            c.cluster._poll_tasks(c.now)
        assert not c.task("worker:0").finished.is_set(), c.log()
        assert c.chief_exit(RESTART_EXIT_CODE)
    assert c.failures() == {"ps:0": 0, "worker:0": 0, "worker:1": 2, "chief": 0}, c.log()
    assert c.log().count("aborted by the chief's failover after worker:1 failed") == 2


def test_a_crash_loop_spends_the_budget_within_one_recovery(monkeypatch):
    c = _BudgetCluster(monkeypatch, max_restarts=3)
    assert c.exit("worker:1", -signal.SIGKILL)
    # Exits other than the chief's abort are the task's own, recovery or not.
    assert [c.exit("worker:1", 1) for _ in range(3)] == [True, True, False]
    # The chief's abort is free once per task and recovery: a second SIGABRT
    # of the same task in the same recovery is its own.
    assert c.exit("worker:0", -signal.SIGABRT)
    assert c.cluster.failures()["worker:0"] == 0
    assert c.exit("worker:0", -signal.SIGABRT)
    assert c.cluster.failures()["worker:0"] == 1


def test_sigabrt_with_no_failure_seen_counts(monkeypatch):
    """E.g. a TF check failure: nothing else failed, so the abort is the task's own."""
    c = _BudgetCluster(monkeypatch)
    assert c.exit("worker:0", -signal.SIGABRT)
    assert c.cluster.failures()["worker:0"] == 1


def test_chief_restarts_count_unless_a_task_failure_caused_them(monkeypatch):
    c = _BudgetCluster(monkeypatch, max_restarts=2)
    assert c.chief_exit(-signal.SIGKILL)  # Killed: its own failure.
    assert c.chief_exit(RESTART_EXIT_CODE)  # 138 with no failed task seen: counted.
    assert c.cluster.failures()["chief"] == 2
    assert c.exit("ps:0", -signal.SIGKILL)
    assert c.chief_exit(RESTART_EXIT_CODE)  # After a PS failure: free.
    assert not c.chief_exit(RESTART_EXIT_CODE)  # Nothing failed since: budget spent.
    assert "chief exited (exit 138); no restarts left (2 used)" in c.log()


def test_cluster_wide_budget_ends_failures_spread_over_tasks(monkeypatch):
    c = _BudgetCluster(monkeypatch, max_restarts=5, max_total_restarts=2, workers=3)
    assert c.exit("worker:0", -signal.SIGKILL)
    assert c.chief_exit(RESTART_EXIT_CODE)
    assert c.exit("worker:1", -signal.SIGKILL)
    assert c.chief_exit(RESTART_EXIT_CODE)
    assert not c.exit("worker:2", -signal.SIGKILL)
    assert "the cluster's restart budget is spent (2 task failures restarted)" in c.log()


def test_parse_max_total_restarts():
    assert launch._parse_args(["--", PY])["max_total_restarts"] is None
    assert launch._parse_args(["--max-total-restarts", "7", "--", PY])["max_total_restarts"] == 7
    with pytest.raises(ConfigError) as info:
        launch._parse_args(["--max-total-restarts=-1", "--", PY])
    assert info.value.field == "--max-total-restarts"


_SLEEPER = ("import resource, time; resource.setrlimit(resource.RLIMIT_CORE, (0, 0));"
            "time.sleep(120)")

# Plays the chief's failover with real signals: on attempt n < 4 it kills
# worker n % 2 (SIGKILL), then aborts the other one (SIGABRT, as TF's Abort
# op does) and exits 138; attempt 4 finishes.
_CHIEF_THAT_KILLS_WORKERS = '''
import json, os, signal, sys, time
n, pid_file = int(os.environ["TF_PSPLUGIN_CHIEF_RESTARTS"]), sys.argv[1]
print("attempt", n, flush=True)
if n >= 4:
    sys.exit(0)

def running(role):
    try:
        pid = json.load(open(pid_file))["tasks"][role]
        with open(f"/proc/{pid}/stat") as f:
            return pid if f.read().rsplit(")", 1)[1].split()[0] not in "ZX" else None
    except (OSError, KeyError, ValueError):
        return None

deadline = time.time() + 30
while not (running("worker:0") and running("worker:1")) and time.time() < deadline:
    time.sleep(0.05)
os.kill(running(f"worker:{n % 2}"), signal.SIGKILL)
time.sleep(1.0)
os.kill(running(f"worker:{1 - n % 2}"), signal.SIGABRT)
time.sleep(0.5)
sys.exit(138)
'''


def test_four_worker_kills_with_budget_two_finish_with_real_processes(tmp_path):
    pid_file = str(tmp_path / "pids.json")
    with open(os.devnull, "w") as devnull:
        with LocalCluster(2, 1, servers="command", restart_failed=True, max_restarts=2,
                          output=devnull, pid_file=pid_file) as cluster:
            cluster.start_servers([PY, "-c", _SLEEPER])
            result = cluster.run_chief([PY, "-c", _CHIEF_THAT_KILLS_WORKERS, pid_file],
                                       timeout=120)
            failures = cluster.failures()
    assert result.returncode == 0, result.stdout
    assert failures == {"ps:0": 0, "worker:0": 2, "worker:1": 2, "chief": 0}, result.stdout
    assert result.stdout.count("not counted against the chief's budget") == 4
    assert "(exit -6: aborted by the chief's failover after worker:" in result.stdout
