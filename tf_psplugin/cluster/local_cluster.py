"""Local cluster: a whole tf_psplugin job on one host, one process per task.

Why this module exists: ParameterServerStrategy needs a chief, workers and
parameter servers as separate processes, each told its role through
TF_CONFIG. Doing that by hand (free ports, N environment variables,
interleaved logs, killing leftovers) is the main obstacle between a user and
a first run, and leftover servers from a crashed run hold ports and CPU. This
module starts every task on loopback with its own TF_CONFIG, prefixes each
output line with its role, restarts failed servers on request, and never
leaves a process behind.

The command line (`python -m tf_psplugin.launch`) is `cluster/launch.py`;
which failures earn a restart is `cluster/restart_budget.py`.

Server modes (`--servers`):

* `command` (CLI default): ps and worker tasks run the same COMMAND; the
  script must call `tf_psplugin.start_server()` first, which serves and never
  returns on those tasks. This is how the job runs on a real cluster.
* `builtin` (`LocalCluster` default): ps and worker tasks run
  `python -m tf_psplugin.server`; only the chief and the evaluator run
  COMMAND. Faster to start, and works with scripts that never call `start()`.

No orphans: each child runs in its own session (process group), which is
killed with SIGTERM and then SIGKILL after a grace period when the chief
finishes or crashes, on SIGINT/SIGTERM/SIGHUP to the launcher, and on
`LocalCluster.stop()`. On Linux each child also gets PR_SET_PDEATHSIG=SIGKILL
(set by a tiny exec shim, not `preexec_fn`, which is unsafe with the
launcher's reader threads), so even a SIGKILLed launcher leaves nothing.
"""

import collections
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from typing import Dict, IO, List, Optional, Sequence

from tf_psplugin._internal import verbosity as verbosity_lib
from tf_psplugin.cluster import config as config_lib
from tf_psplugin.cluster import restart_budget as restart_budget_lib
from tf_psplugin.cluster import restarts as restarts_lib
from tf_psplugin.cluster.config import ClusterConfig, ConfigError

__all__ = ["LocalCluster", "check_command"]

LAUNCH_ID_ENV = "TF_PSPLUGIN_LAUNCH_ID"
SERVER_MODES = ("command", "builtin")
# Runs in the child between fork and the user's command: ask the kernel for
# SIGKILL when the launcher dies, bail out if it already has, then exec.
_PDEATHSIG_SHIM = (
    "import ctypes, os, signal, sys\n"
    "ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL), 0, 0, 0)\n"
    "if os.getppid() != int(sys.argv[1]): os._exit(1)\n"
    "try: os.execvp(sys.argv[2], sys.argv[2:])\n"
    "except OSError as e:\n"
    "    sys.stderr.write('tf_psplugin.launch: cannot run %r: %s\\n' % (sys.argv[2], e.strerror))\n"
    "    os._exit(127)\n"
)
_ROLE_FLAGS = ("--job_name", "--task_index", "--worker_hosts", "--ps_hosts", "--chief_hosts",
               "--evaluator_hosts")


def _exit_text(code: int) -> str:
    return f"exit {code}"


def _kill_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):  # Already gone (or reused: not ours).
        pass


class _Task:
    """One task's process (replaced on restart) and its bookkeeping."""

    def __init__(self, task_type: str, index: int, command: List[str]):
        self.task_type = task_type
        self.index = index
        self.role = task_type if task_type in ("chief", "evaluator") else f"{task_type}:{index}"
        self.command = command
        self.proc: Optional[subprocess.Popen] = None
        self.reader: Optional[threading.Thread] = None
        self.restarts = 0  # Every restart, whatever its cause.
        self.handled = False  # The current process's exit has been dealt with.
        self.restart_at: Optional[float] = None
        self.finished = threading.Event()  # Exited and will not be restarted.


class LocalCluster:
    """Starts a loopback cluster as subprocesses and guarantees their cleanup.

    Every task gets `TF_CONFIG` from `config.for_task(...)`,
    `PYTHONUNBUFFERED=1`, `TF_CPP_MIN_LOG_LEVEL=1` (unless set: TF's C++
    INFO lines hidden, warnings shown),
    `GRPC_FAIL_FAST=use_caller` (unless set) and `TF_PSPLUGIN_LAUNCH_ID`
    (inherited if set, else random; tests use it to find strays).

    Example:

        with LocalCluster(num_workers=2, num_ps=1) as cluster:
            cluster.start_servers()
            result = cluster.run_chief([sys.executable, "train.py"], timeout=300)
            print(result.returncode, result.stdout)  # stdout: role-prefixed log.

    Args:
      num_workers: worker tasks besides the chief.
      num_ps: parameter servers (>= 1).
      evaluator: add an evaluator task (it runs the chief's command).
      restart_failed: restart a ps/worker that exits before the chief
        finished, an evaluator that exits nonzero, and a chief that exits
        with `errors.RESTART_EXIT_CODE` (138: a task failed, resume from the
        checkpoint) or is killed by SIGKILL, with the same address, command
        and TF_CONFIG, within the budgets below.
      servers: "builtin" (ps/worker run `python -m tf_psplugin.server`) or
        "command" (they run the command given to `start_servers`).
      env: extra environment for every child.
      log_dir: if set, each task's raw output is also appended to
        `<log_dir>/<role>.log` (role with ":" as "-").
      host: loopback host for every task.
      max_restarts: restart budget per task: how many of its *own*
        failures a task is restarted after. Restarts the plugin causes
        itself are free: after a worker or PS fails, the chief's exit 138
        and the surviving workers its failover aborts (SIGABRT, collective
        members restart together) are not counted. A chief exit 138 with no
        failed task seen counts against the chief.
      max_total_restarts: budget of own failures summed over every task
        (None: only the per-task budget), so a job whose tasks keep
        failing in turn still ends.
      output: stream for role-prefixed lines; default `sys.stdout` (looked
        up at write time).
      grace_period: seconds between SIGTERM and SIGKILL when stopping.
      pid_file: if set, JSON `{"launcher": pid, "tasks": {role: pid},
        "all": [every pid started]}` is kept up to date there.
      config: use this chief config instead of `config.local(...)`.
    """

    def __init__(self, num_workers: int, num_ps: int, evaluator: bool = False,
                 restart_failed: bool = False, servers: str = "builtin",
                 env: Optional[Dict[str, str]] = None, log_dir: Optional[str] = None,
                 host: str = "127.0.0.1", max_restarts: int = 3,
                 output: Optional[IO[str]] = None, grace_period: float = 5.0,
                 pid_file: Optional[str] = None, config: Optional[ClusterConfig] = None,
                 max_total_restarts: Optional[int] = None):
        if servers not in SERVER_MODES:
            raise ConfigError("servers", f"{servers!r} is not a server mode",
                              f"use one of {', '.join(SERVER_MODES)}")
        self.config = config or config_lib.local(num_workers, num_ps, evaluator, host)
        self.servers = servers
        self.restart_failed = restart_failed
        self.max_restarts = max_restarts
        self.max_total_restarts = max_total_restarts
        self._clock = time.monotonic  # For restart times and recoveries (tests inject one).
        self._budget = restart_budget_lib.RestartBudget(
            max_restarts, max_total_restarts, clock=lambda: self._clock())
        self.grace_period = grace_period
        self.launch_id = (env or {}).get(LAUNCH_ID_ENV) or os.environ.get(LAUNCH_ID_ENV) or (
            uuid.uuid4().hex)
        self._env = dict(env or {})
        self._log_dir = log_dir
        self._output = output
        self._pid_file = pid_file
        self._tasks: Dict[str, _Task] = {}
        self._all_pids: List[int] = []
        self._lines = collections.deque(maxlen=200_000)
        self._lock = threading.RLock()
        self._out_lock = threading.RLock()  # Re-entrant: the CLI's signal handler logs.
        self._stopping = threading.Event()
        self._force = threading.Event()
        self._chief_done = threading.Event()
        self._stopped = False
        self._monitor: Optional[threading.Thread] = None
        if log_dir:
            os.makedirs(log_dir, exist_ok=True)

    # -- Context manager ----------------------------------------------------

    def __enter__(self) -> "LocalCluster":
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()

    # -- Output -------------------------------------------------------------

    def log(self, message: str) -> None:
        """Writes a `[launch] ` line to the output."""
        self._emit("launch", message + "\n")

    def _emit(self, role: str, text: str) -> None:
        line = f"[{role}] {text}"
        with self._out_lock:
            self._lines.append(line)
            stream = self._output or sys.stdout
            try:
                stream.write(line)
                stream.flush()
            except (OSError, ValueError):  # Closed stdout (e.g. `| head`): keep running.
                pass

    def output(self, role: Optional[str] = None) -> List[str]:
        """Role-prefixed lines so far (all roles, or one, e.g. "worker:1")."""
        with self._out_lock:
            lines = list(self._lines)
        return lines if role is None else [ln for ln in lines if ln.startswith(f"[{role}] ")]

    def wait_for_output(self, text: str, role: Optional[str] = None,
                        timeout: float = 60.0, count: int = 1) -> bool:
        """Waits until `count` lines (of `role`) contain `text`; False on timeout."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if sum(text in ln for ln in self.output(role)) >= count:
                return True
            time.sleep(0.1)
        return False

    def _read(self, task: _Task, proc: subprocess.Popen) -> None:
        log_file = None
        if self._log_dir:
            log_file = open(os.path.join(self._log_dir, task.role.replace(":", "-") + ".log"),
                            "a", encoding="utf-8")
        # TF >= 2.16 prints import-time INFO lines whatever TF_CPP_MIN_LOG_LEVEL says;
        # the task's level is applied here (its log file keeps every line).
        keep = verbosity_lib.CppLogFilter(verbosity_lib.cpp_log_level(self._child_env(task)))
        try:
            for raw in iter(proc.stdout.readline, b""):
                text = raw.decode("utf-8", errors="replace")
                if not text.endswith("\n"):
                    text += "\n"
                if keep(text):
                    self._emit(task.role, text)
                if log_file:
                    log_file.write(text)
                    log_file.flush()
        finally:
            proc.stdout.close()
            if log_file:
                log_file.close()

    # -- Processes ----------------------------------------------------------

    def _child_env(self, task: _Task) -> Dict[str, str]:
        env = dict(os.environ)
        env.update(self._env)
        env["TF_CONFIG"] = json.dumps(self.config.for_task(task.task_type, task.index).tf_config())
        env["PYTHONUNBUFFERED"] = "1"
        env.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")
        env.setdefault("GRPC_FAIL_FAST", "use_caller")
        env[LAUNCH_ID_ENV] = self.launch_id
        # Tells the chief's failover whether a dead worker/PS will come back
        # (else it stops at once instead of waiting for it).
        env[restarts_lib.TASK_RESTARTS_ENV] = "1" if self.restart_failed else "0"
        if task.task_type == "chief":
            env[restarts_lib.CHIEF_RESTARTS_ENV] = str(task.restarts)
        return env

    def _spawn(self, task: _Task) -> None:
        """Starts (or restarts) a task's process. Call with the lock held."""
        argv = list(task.command)
        if sys.platform.startswith("linux"):
            argv = [sys.executable, "-S", "-c", _PDEATHSIG_SHIM, str(os.getpid())] + argv
        proc = subprocess.Popen(
            argv, env=self._child_env(task), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, start_new_session=True)
        task.proc, task.handled, task.restart_at = proc, False, None
        self._all_pids.append(proc.pid)
        task.reader = threading.Thread(target=self._read, args=(task, proc),
                                       name=f"launch-read-{task.role}", daemon=True)
        task.reader.start()
        self._write_pid_file()

    def _start(self, task_type: str, index: int, command: Sequence[str]) -> _Task:
        command = check_command(command)
        with self._lock:
            if self._stopping.is_set():
                raise RuntimeError("LocalCluster was stopped; create a new one")
            task = _Task(task_type, index, command)
            if task.role in self._tasks and self._tasks[task.role].proc.poll() is None:
                raise RuntimeError(f"{task.role} is already running")
            self._tasks[task.role] = task
            self._spawn(task)
            if self._monitor is None:
                self._monitor = threading.Thread(target=self._watch, name="launch-monitor",
                                                 daemon=True)
                self._monitor.start()
        return task

    def start_servers(self, command: Optional[Sequence[str]] = None) -> None:
        """Starts every ps and worker task.

        Args:
          command: what ps/worker tasks run in "command" mode (required
            there; the script must call `tf_psplugin.start_server()`);
            ignored in "builtin" mode.
        """
        if self.servers == "builtin":
            command = [sys.executable, "-m", "tf_psplugin.server"]
        elif not command:
            raise ConfigError("command", "is required with servers='command'",
                              "pass the training command, or use servers='builtin'")
        for job in ("ps", "worker"):
            for index in range(len(self.config.cluster.get(job, ()))):
                self._start(job, index, command)

    def start_evaluator(self, command: Sequence[str]) -> None:
        """Starts the evaluator task running `command`."""
        if not self.config.has_evaluator:
            raise ConfigError("evaluator", "this cluster has no evaluator",
                              "create the LocalCluster with evaluator=True")
        self._start("evaluator", 0, command)

    def run_chief(self, command: Sequence[str], timeout: Optional[float] = None
                  ) -> subprocess.CompletedProcess:
        """Runs the chief to completion.

        Args:
          command: the chief's command line.
          timeout: seconds; None waits forever.

        Returns:
          `CompletedProcess` with the chief's `returncode` and, as `stdout`,
          the whole cluster's role-prefixed log so far (what the terminal
          shows).

        Raises:
          subprocess.TimeoutExpired: after killing the chief, on timeout
            (`output` holds the log).
        """
        task = self._start("chief", 0, command)
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            while task.proc.poll() is None:
                if deadline is not None and time.monotonic() > deadline:
                    _kill_group(task.proc.pid, signal.SIGKILL)
                    task.proc.wait()
                    self._chief_done.set()
                    raise subprocess.TimeoutExpired(command, timeout,
                                                    output="".join(self.output()))
                time.sleep(0.05)
            _kill_group(task.proc.pid, signal.SIGKILL)  # Leftover children of the chief, if any.
            task.reader.join(timeout=10)
            code = task.proc.returncode
            with self._lock:
                if not self._restart_chief(task, code):
                    break
        self._chief_done.set()
        task.finished.set()
        self.log(f"chief exited ({_exit_text(code)})")
        return subprocess.CompletedProcess(list(command), code, stdout="".join(self.output()))

    def _restart_chief(self, task: _Task, code: int) -> bool:
        """Restarts the chief if it asked for it; returns whether it did. Lock held.

        With `restart_failed`, a chief whose exit is retryable
        (`restart_budget.chief_exit_is_retryable`: exit 138 or SIGKILL) is
        restarted with the same command, within the budget; it resumes from
        the latest checkpoint. It is not restarted when a ps or worker task
        will not come back (its budget is spent). Any other exit is the
        job's result.
        """
        retryable = restart_budget_lib.chief_exit_is_retryable(code)
        if not (self.restart_failed and retryable) or self._stopping.is_set():
            return False
        self._reap_exited()  # Survivors the chief aborted before exiting.
        gone = [t.role for t in self._tasks.values()
                if t.task_type in ("ps", "worker") and t.finished.is_set()]
        if gone:
            self.log(f"chief exited ({_exit_text(code)}); not restarting it: "
                     f"{', '.join(gone)} will not come back")
            return False
        decision = self._budget.chief_exited(code)
        if not decision.restart:
            self.log(f"chief exited ({_exit_text(code)}); {decision.reason}")
            return False
        task.restarts += 1
        self.log(f"restarting chief ({_exit_text(code)}: {decision.reason}; it resumes from "
                 "the latest checkpoint)")
        self._spawn(task)
        return True

    def _reap_exited(self) -> None:
        """Handles ps/worker exits the monitor has not seen yet. Lock held."""
        now = self._clock()
        for other in self._tasks.values():
            if (other.task_type in ("ps", "worker") and other.proc is not None
                    and not other.handled and other.restart_at is None
                    and other.proc.poll() is not None):
                self._on_exit(other, now)

    def run(self, command: Sequence[str], timeout: Optional[float] = None) -> int:
        """The whole CLI flow: servers, evaluator, chief, evaluator's end, stop.

        Returns:
          The chief's exit code as a shell sees it (128+N if killed by
          signal N), or 124 on timeout.
        """
        start = time.monotonic()
        try:
            self.start_servers(command)
            if self.config.has_evaluator:
                self.start_evaluator(command)
            try:
                code = self.run_chief(command, timeout=timeout).returncode
            except subprocess.TimeoutExpired:
                self.log(f"timeout after {timeout:g} s; stopping the cluster")
                return 124
            evaluator = self._tasks.get("evaluator")
            if code == 0 and evaluator is not None:
                self.log("waiting for the evaluator to finish")
                while not evaluator.finished.wait(0.2):
                    if timeout is not None and time.monotonic() - start > timeout:
                        self.log(f"timeout after {timeout:g} s; stopping the cluster")
                        return 124
            return code if code >= 0 else 128 - code
        finally:
            self.stop()

    def kill(self, task_type: str, index: int = 0, sig: int = signal.SIGKILL) -> None:
        """Sends `sig` to a task's process group (fault injection)."""
        role = task_type if task_type in ("chief", "evaluator") else f"{task_type}:{index}"
        with self._lock:
            task = self._tasks.get(role)
            if task is None or task.proc is None:
                raise KeyError(f"no process for {role}")
            _kill_group(task.proc.pid, sig)

    def pids(self) -> Dict[str, int]:
        """Latest pid per role ("chief", "worker:0", "ps:1", "evaluator"), alive or not."""
        with self._lock:
            return {role: task.proc.pid for role, task in self._tasks.items() if task.proc}

    def all_pids(self) -> List[int]:
        """Every pid this cluster ever started (restarts included)."""
        with self._lock:
            return list(self._all_pids)

    def restarts(self) -> Dict[str, int]:
        """How many times each task was restarted."""
        with self._lock:
            return {role: task.restarts for role, task in self._tasks.items()}

    def failures(self) -> Dict[str, int]:
        """Each task's own failures it was restarted after (what the budget counts)."""
        with self._lock:
            return {role: self._budget.failures(role) for role in self._tasks}

    @property
    def total_failures(self) -> int:
        """Own failures restarted, summed over every task."""
        return self._budget.total_failures

    @property
    def stopping(self) -> bool:
        """Whether `stop()` has begun."""
        return self._stopping.is_set()

    def skip_grace_period(self) -> None:
        """Makes a `stop()` in progress (or the next one) SIGKILL without waiting.

        For a second interrupt: the user does not want to wait any longer.
        """
        self._force.set()

    def _write_pid_file(self) -> None:
        if not self._pid_file:
            return
        data = {"launcher": os.getpid(), "launch_id": self.launch_id,
                "tasks": {r: t.proc.pid for r, t in self._tasks.items() if t.proc},
                "all": self._all_pids}
        tmp = f"{self._pid_file}.tmp{os.getpid()}"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(data, f)
        os.replace(tmp, self._pid_file)

    def _watch(self) -> None:
        """Monitor thread: notices exits of non-chief tasks, restarts them if asked."""
        while not self._stopping.wait(0.1):
            with self._lock:
                if self._stopping.is_set():
                    return
                self._poll_tasks(self._clock())

    def _poll_tasks(self, now: float) -> None:
        """One pass of `_watch`: restarts due tasks, handles the exits seen. Lock held.

        The exits one pass sees are handled SIGABRT last: a failover's abort
        of a surviving worker follows the failure that caused it, but on a
        loaded box both can be seen in one pass, and the abort is free only
        once that failure has opened the recovery (`RestartBudget`).
        Handled in task order, a survivor listed first was charged for its
        abort (seen: worker:0's abort counted, its budget spent, the job
        ended).
        """
        exited = []
        for task in self._tasks.values():
            if task.task_type == "chief" or task.proc is None:
                continue
            if task.restart_at is not None and now >= task.restart_at:
                self._spawn(task)
                continue
            if task.handled or task.proc.poll() is None:
                continue
            exited.append(task)
        for task in sorted(exited, key=lambda t: t.proc.returncode == -signal.SIGABRT):
            self._on_exit(task, now)

    def _on_exit(self, task: _Task, now: float) -> None:
        """Restarts a ps/worker/evaluator that exited, if wanted and in budget. Lock held.

        Whether a restart is wanted is decided here (a ps/worker before the
        chief finished, an evaluator that failed); whether it is granted,
        and after which delay, by the restart budget.
        """
        task.handled = True
        code = task.proc.returncode
        _kill_group(task.proc.pid, signal.SIGKILL)  # Its children, if any.
        if task.task_type == "evaluator":
            wanted = code != 0
        else:
            wanted = not self._chief_done.is_set()
        if not (self.restart_failed and wanted):
            if wanted or task.task_type == "evaluator":
                self.log(f"{task.role} exited ({_exit_text(code)})")
            task.finished.set()
            return
        decision = self._budget.task_failed(task.role, task.task_type, code)
        if not decision.restart:
            self.log(f"{task.role} exited ({_exit_text(code)}); {decision.reason}")
            task.finished.set()
            return
        task.restarts += 1
        task.restart_at = now + decision.delay
        if decision.counted:
            self.log(f"restarting {task.role} ({_exit_text(code)}), {decision.reason}")
        else:
            self.log(f"restarting {task.role} ({_exit_text(code)}: {decision.reason})")

    def stop(self) -> None:
        """Stops every process this cluster started. Idempotent.

        SIGTERM to every process group, SIGKILL to what is left after
        `grace_period` seconds (at once after a second interrupt), then
        reaps everything and joins the reader threads.
        """
        with self._lock:
            if self._stopped:
                return
            self._stopping.set()  # No more starts or restarts from here on.
            procs = [t.proc for t in self._tasks.values() if t.proc is not None]
        for proc in procs:
            if proc.poll() is None:
                _kill_group(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + self.grace_period
        for proc in procs:
            while proc.poll() is None and time.monotonic() < deadline and not self._force.is_set():
                time.sleep(0.05)
        for proc in procs:
            _kill_group(proc.pid, signal.SIGKILL)  # Leaders still alive and any stragglers.
        for proc in procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.log(f"pid {proc.pid} did not die after SIGKILL")
        if self._monitor is not None and self._monitor is not threading.current_thread():
            self._monitor.join(timeout=5)
        for task in list(self._tasks.values()):
            if task.reader is not None:
                task.reader.join(timeout=5)
        with self._lock:
            self._stopped = True  # Only now: an interrupted stop() runs again in full.
        self._write_pid_file()


def check_command(command: Sequence[str]) -> List[str]:
    """A task's command line as strings, checked before anything starts.

    Raises:
      ConfigError: (field "COMMAND") it is empty, passes a role or host
        flag the launcher's TF_CONFIG would contradict, or its program is
        not on PATH.
    """
    command = [str(arg) for arg in command]
    if not command:
        raise ConfigError("COMMAND", "is empty", "put the command after --, e.g. "
                          "-- python train.py")
    for arg in command:
        if arg.split("=")[0] in _ROLE_FLAGS:
            raise ConfigError("COMMAND", f"passes {arg.split('=')[0]}, which would override the "
                              "TF_CONFIG the launcher gives each task",
                              "drop the role and host flags from the command")
    if shutil.which(command[0]) is None:
        raise ConfigError("COMMAND", f"{command[0]!r} is not an executable on PATH",
                          "check the program name, e.g. -- python train.py")
    return command

