"""Shared helpers for cluster tests: real processes on loopback, never leaked.

Why this module exists: every cluster test starts TF servers and scripts as
subprocesses, and a test that fails halfway must not leave servers running
(they hold ports and the 2 CPU cores every other test needs). These helpers
make that the default. Reuse them instead of writing your own Popen code.

The pieces, from the bottom up:

* `free_port(host)`, `wait_for_port(host, port, timeout)`: loopback ports.
* `python_script(tmp_path, code, name)`: writes a dedented script file, with
  the repo on `sys.path`, and returns its path (run it with `PYTHON`).
* `ProcessTracker` (fixture `procs` in conftest.py): starts subprocesses in
  their own process groups, tags each with a unique
  `TF_PSPLUGIN_LAUNCH_ID` environment value, and at teardown kills every
  group it started *and* every process on the machine carrying its tag
  (which catches grandchildren and restarted servers too).
  `procs.run(cmd, timeout)` runs to completion, killing the group on
  timeout; `procs.popen(cmd)` starts in the background.
* `make_cluster` fixture (conftest.py): builds `tf_psplugin.launch.LocalCluster`
  objects tagged the same way and stops them at teardown.
* `shared_cluster` fixture (conftest.py): a started cluster of a given shape
  lent to one test at a time and kept for the next tests that lend one, in
  any module of tests/cluster (`ClusterPool`, `LentCluster` below; the pool
  is package-scoped, its clusters stopped before a test that lends none): for
  tests that only run chiefs on it (no task kills, no restarts, no
  per-process measurements), it saves the servers' start-up (~8 s on an
  idle box, more under the suite's load) per test.
* `pid_alive(pid)`, `tagged_pids(tag)`, `wait_until(predicate, timeout)`:
  assertions about what is still running.

Typical use in a test module (fixtures come from tests/cluster/conftest.py):

    import pytest
    from tests.cluster import _cluster_util as cu

    @pytest.mark.cluster
    @pytest.mark.timeout(60)
    def test_something(tmp_path, make_cluster):
        script = cu.python_script(tmp_path, '''
            from tf_psplugin import server
            config = server.start()
            print("RESULT", config.task_type)
        ''')
        cluster = make_cluster(num_workers=1, num_ps=1)
        cluster.start_servers()
        result = cluster.run_chief([cu.PYTHON, script], timeout=45)
        assert result.returncode == 0, result.stdout
        assert cu.result_line(result.stdout) == "chief"

Keep clusters small (1-2 workers, 1-2 PS): the box has 2 cores and each
TF process takes seconds just to import TensorFlow.
"""

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from typing import Callable, Dict, List, Optional, Sequence

import numpy as np

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PYTHON = sys.executable
LAUNCH_ID_ENV = "TF_PSPLUGIN_LAUNCH_ID"  # Same name as tf_psplugin.launch.LAUNCH_ID_ENV.


def free_port(host: str = "127.0.0.1") -> int:
    """Returns a TCP port that is free on `host` right now (racy, like all such)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def wait_for_port(host: str, port: int, timeout: float = 30.0) -> bool:
    """True once something accepts TCP connections on host:port; False on timeout."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, port), timeout=1.0):
                return True
        except OSError:
            time.sleep(0.1)
    return False


def wait_until(predicate: Callable[[], bool], timeout: float, interval: float = 0.1) -> bool:
    """Polls `predicate` until it is true; returns its last value."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return bool(predicate())


def script(tmp_path, body: str, name: str) -> str:
    """`python_script` of `body` with ``{repo}`` replaced by the repo root."""
    return python_script(tmp_path, body.format(repo=REPO_ROOT), name)


def assert_same_npz(a_path, b_path) -> None:
    """Asserts two .npz files hold the same arrays, bit for bit, under the same keys."""
    a, b = np.load(a_path), np.load(b_path)
    assert sorted(a.files) == sorted(b.files)
    for key in a.files:
        np.testing.assert_array_equal(a[key], b[key], err_msg=f"{key} differs")


def python_script(tmp_path, code: str, name: str = "script.py") -> str:
    """Writes `code` (dedented) to `tmp_path/name` and returns the path.

    The repo root is put on `sys.path` first, so the script imports this
    checkout's `tf_psplugin` and `tests` even without an editable install.
    """
    header = f"import sys\nsys.path.insert(0, {REPO_ROOT!r})\n"
    path = os.path.join(str(tmp_path), name)
    with open(path, "w", encoding="utf-8") as f:
        f.write(header + textwrap.dedent(code).lstrip("\n"))
    return path


def result_line(output: str, marker: str = "RESULT") -> Optional[str]:
    """The text after the last `marker ` in a (role-prefixed) log, or None.

    Test scripts print e.g. `RESULT {"devices": [...]}`; the launcher turns it
    into `[chief] RESULT {...}`. Use json.loads on what this returns.
    """
    found = None
    for line in output.splitlines():
        head, sep, tail = line.partition(marker + " ")
        if sep and (not head or head.startswith("[")):
            found = tail.strip()
    return found


def run_chief_for_report(cluster, command: Sequence[str], out, timeout: float) -> Dict:
    """Starts `cluster`'s servers, runs `command` as its chief and returns its report.

    The chief must exit 0 (else the assertion shows its log's tail) and
    write its findings as JSON to ``out/report.json``.
    """
    cluster.start_servers()
    result = cluster.run_chief(command, timeout=timeout)
    assert result.returncode == 0, result.stdout[-8000:]
    with open(os.path.join(str(out), "report.json"), encoding="utf-8") as f:
        return json.load(f)


def assert_checks_passed(result, checks) -> None:
    """Asserts a chief script's `CHECK <name> ok|FAIL <why>` lines: each in `checks`
    present, none failed, and the script ended with `DONE` and exit 0."""
    verdicts = {}
    for line in result.stdout.splitlines():
        if "CHECK " in line:
            name, verdict = (line.split("CHECK ", 1)[1].split(" ", 1) + [""])[:2]
            verdicts.setdefault(name, []).append(verdict)
    failed = {name: v for name, v in verdicts.items() if any(x != "ok" for x in v)}
    assert not failed, failed
    missing = [name for name in checks if name not in verdicts]
    assert not missing, (missing, result.stdout[-6000:])
    assert result.returncode == 0 and "DONE" in result.stdout, result.stdout[-6000:]


def pid_alive(pid: int) -> bool:
    """True if `pid` exists and is not a zombie (zombies are dead, just unreaped)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8", errors="replace") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state not in ("Z", "X")


def tagged_pids(tag: str) -> List[int]:
    """Live pids whose environment holds `TF_PSPLUGIN_LAUNCH_ID=<tag>` (Linux /proc)."""
    needle = f"{LAUNCH_ID_ENV}={tag}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = f.read().split(b"\0")
        except OSError:  # Gone, or not ours to read.
            continue
        if needle in env and pid_alive(int(entry)):
            found.append(int(entry))
    return found


def kill_group(pid: int, sig: int = signal.SIGKILL) -> None:
    """Signals a process group, ignoring groups that are already gone."""
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


class ProcessTracker:
    """Starts tagged subprocesses and kills all of them (and their kin) on cleanup.

    Attributes:
      tag: unique value of `TF_PSPLUGIN_LAUNCH_ID` for everything started
        here; `tf_psplugin.launch` passes an inherited value on to its
        children, so launcher-started tasks carry it too.
    """

    def __init__(self):
        self.tag = f"test-{uuid.uuid4().hex}"
        self._procs: List[subprocess.Popen] = []

    def env(self, extra: Optional[Dict[str, str]] = None) -> Dict[str, str]:
        """os.environ + quiet TF logs + the tag + `extra`, TF_CONFIG removed."""
        env = dict(os.environ)
        env.pop("TF_CONFIG", None)
        env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
        env["PYTHONUNBUFFERED"] = "1"
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO_ROOT, env.get("PYTHONPATH")]))
        env[LAUNCH_ID_ENV] = self.tag
        env.update(extra or {})
        return env

    def popen(self, cmd: Sequence[str], env: Optional[Dict[str, str]] = None,
              **kwargs) -> subprocess.Popen:
        """Starts `cmd` in its own process group with stdout+stderr merged (text)."""
        proc = subprocess.Popen(
            list(cmd), env=self.env(env), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True, start_new_session=True, **kwargs)
        self._procs.append(proc)
        return proc

    def run(self, cmd: Sequence[str], timeout: float, env: Optional[Dict[str, str]] = None,
            **kwargs) -> subprocess.CompletedProcess:
        """Runs `cmd` to completion; on timeout kills its group and fails the test.

        Returns:
          CompletedProcess with merged output in `stdout`.
        """
        proc = self.popen(cmd, env=env, **kwargs)
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_group(proc.pid)
            out, _ = proc.communicate()
            raise AssertionError(f"{cmd} did not finish in {timeout} s; output:\n{out}") from None
        return subprocess.CompletedProcess(list(cmd), proc.returncode, stdout=out)

    def cleanup(self) -> List[int]:
        """Kills everything started here or tagged; returns pids that were still alive."""
        leftovers = []
        for proc in self._procs:
            if proc.poll() is None:
                leftovers.append(proc.pid)
            kill_group(proc.pid)
        for pid in tagged_pids(self.tag):
            leftovers.append(pid)
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for proc in self._procs:
            try:
                proc.communicate(timeout=10)
            except (subprocess.TimeoutExpired, ValueError):
                pass
        return sorted(set(leftovers))


class LineReader:
    """Collects a background process's text output, line by line, in a thread.

    Use with `procs.popen(...)` when a test must react to output while the
    process still runs (e.g. send SIGINT once servers are up):

        proc = procs.popen([cu.PYTHON, "-m", "tf_psplugin.launch", ...])
        reader = cu.LineReader(proc)
        assert reader.wait_for("serving at", count=2, timeout=40), reader.text()
    """

    def __init__(self, proc: subprocess.Popen):
        self._lines: List[str] = []
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._read, args=(proc,), daemon=True)
        self._thread.start()

    def _read(self, proc: subprocess.Popen) -> None:
        for line in proc.stdout:
            with self._lock:
                self._lines.append(line)

    def lines(self) -> List[str]:
        with self._lock:
            return list(self._lines)

    def text(self) -> str:
        return "".join(self.lines())

    def wait_for(self, text: str, timeout: float, count: int = 1) -> bool:
        """True once `count` lines contain `text`; False on timeout."""
        return wait_until(lambda: sum(text in ln for ln in self.lines()) >= count, timeout)

    def join(self, timeout: float = 10.0) -> str:
        """Waits for end of output (process exited); returns all text."""
        self._thread.join(timeout)
        return self.text()

    def wait_exit(self, proc: subprocess.Popen, timeout: float, tail: int = 12000) -> int:
        """`proc`'s exit code; on timeout, fails the test with the output so far."""
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"process {proc.pid} still running after {timeout:g} s; its output:\n"
                + self.text()[-tail:]) from None


def read_pid_file(path: str) -> Dict:
    """Reads a `tf_psplugin.launch --pid-file` JSON ({} if it does not exist yet)."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (FileNotFoundError, ValueError):
        return {}


class LentCluster:
    """A started `LocalCluster` lent to one test: its chiefs' runs see this test's log only.

    `run_chief` returns, as `stdout`, the cluster's lines since the lending
    (what a cluster started for the test would have shown), so an earlier
    test's `RESULT`, `CHECK` or `DONE` line can never satisfy this test.
    `start_servers()` is a no-op (the servers run already) and `stop()` is
    refused: the pool stops the cluster. Anything else is the cluster's.
    """

    def __init__(self, cluster, mark: int):
        self._cluster = cluster
        self._mark = mark

    def start_servers(self) -> None:
        """The servers are up already."""

    def stop(self) -> None:
        raise RuntimeError("a shared cluster is stopped by its pool; use make_cluster "
                           "for a cluster the test stops itself")

    def output(self, role: Optional[str] = None) -> List[str]:
        """The role-prefixed lines since this test got the cluster."""
        lines = self._cluster.output()[self._mark:]
        return lines if role is None else [ln for ln in lines if ln.startswith(f"[{role}] ")]

    def run_chief(self, command: Sequence[str], timeout: Optional[float] = None
                  ) -> subprocess.CompletedProcess:
        result = self._cluster.run_chief(command, timeout=timeout)
        result.stdout = "".join(self.output())
        return result

    def __getattr__(self, name):
        return getattr(self._cluster, name)


class ClusterPool:
    """Started LocalClusters, one per shape, lent to one test at a time (fixture `shared_cluster`).

    A lent cluster whose ps or worker task died, or that served
    `max_lends` tests, is stopped and replaced by a fresh one; so is one
    lent to a test that failed (`discard`), so a broken cluster never fails
    the next test. At most `max_clusters` clusters are kept (the least
    recently lent is stopped first): an idle TF server holds ~0.5 GB.
    """

    def __init__(self, tracker: "ProcessTracker", max_lends: int = 30, max_clusters: int = 2):
        self._tracker = tracker
        self._max_lends = max_lends
        self._max_clusters = max_clusters
        self._clusters: Dict[tuple, list] = {}  # shape -> [cluster, lends], least recent first
        self._leaked: List[int] = []

    def lend(self, num_workers: int, num_ps: int) -> LentCluster:
        from tf_psplugin.launch import LocalCluster

        shape = (num_workers, num_ps)
        entry = self._clusters.get(shape)
        if entry is not None and (entry[1] >= self._max_lends or not self._alive(entry[0])):
            self.discard(shape)
            entry = None
        if entry is None:
            while len(self._clusters) >= self._max_clusters:
                self.discard(next(iter(self._clusters)))
            cluster = LocalCluster(num_workers, num_ps, env=self._tracker.env())
            cluster.start_servers()
            entry = [cluster, 0]
        self._clusters.pop(shape, None)
        self._clusters[shape] = entry  # Now the most recently lent.
        entry[1] += 1
        return LentCluster(entry[0], len(entry[0].output()))

    @contextlib.contextmanager
    def borrowed(self, num_workers: int, num_ps: int):
        """`lend` for a block (e.g. a module fixture's run): a block that raises
        (a failed assertion, a timeout) discards the cluster, as `shared_cluster`
        does after a failed test."""
        try:
            yield self.lend(num_workers, num_ps)
        except BaseException:
            self.discard((num_workers, num_ps))
            raise

    @staticmethod
    def _alive(cluster) -> bool:
        return all(pid_alive(pid) for role, pid in cluster.pids().items()
                   if role.startswith(("ps:", "worker:")))

    def discard(self, shape: tuple) -> None:
        """Stops the cluster of `shape` (if any); the next lend starts a fresh one."""
        entry = self._clusters.pop(shape, None)
        if entry is not None:
            entry[0].stop()
            # Checked now, not at `close`: by then (the pool lives for all the
            # cluster tests) another program may have been given a reaped pid.
            self._leaked += [pid for pid in entry[0].all_pids() if pid_alive(pid)]

    def close(self) -> List[int]:
        """Stops every cluster (a later `lend` starts one anew); returns the pids found
        alive right after a stop (should be none)."""
        for shape in list(self._clusters):
            self.discard(shape)
        return list(self._leaked)
