"""Starting benchmark processes, collecting their results and peak RSS.

Why this module exists: every setup needs its own processes (a TF process
joins one cluster only), and on a shared 2-core box a leaked TF server eats
the CPU every later measurement needs. PS clusters are started with
`tf_psplugin.launch.LocalCluster` (process groups, PDEATHSIG, stop() on
exit); MultiWorkerMirroredStrategy has no PS task, which `ClusterConfig`
requires, so its two workers are started here, each in its own session and
killed by process group in a ``finally``.

Peak RSS: every child reports its own VmHWM in its result line; for PS and
worker servers (which never return) the parent reads `/proc/<pid>/status`
just before stopping the cluster.
"""

import json
import os
import resource
import signal
import socket
import subprocess
import sys
import time
from typing import Dict, List, Optional

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULT_PREFIX = "BENCH_RESULT "
# Printed by the soak chief after every epoch (benchmarks/child.py, benchmarks/soak.py).
SOAK_PROGRESS_PREFIX = "SOAK_PROGRESS "


class BenchmarkProcessError(RuntimeError):
    """A benchmark process failed or timed out; the message has its log tail."""


def strategy_options(job: dict) -> Dict[str, object]:
    """The HybridParameterServerStrategy arguments a hybrid job runs with.

    benchmarks/child.py builds the strategy from exactly these, and the
    result lines record them, so a figure always says which options made it
    (an option not listed here is the strategy's default).
    """
    return {"embedding_updates": job.get("embedding_updates", "sync"),
            "sharding": job.get("sharding") or None,
            "sparse_exchange": job.get("sparse_exchange", "ps"),
            "stack_tables": bool(job.get("stack_tables", True)),
            # "float32": the strategy's default (table_dtype=None, the tables in
            # the dtype their layer asks for); "bfloat16"/"float16": stored so.
            "table_dtype": job.get("table_dtype", "float32"),
            # HybridOptions.dense_bucket_bytes (None: the strategy's default;
            # 0: one packed all-reduce of the dense gradients).
            "dense_bucket_bytes": job.get("dense_bucket_bytes"),
            # HybridOptions.dense_allreduce_dtype (None: the gradients' own dtype).
            "dense_allreduce_dtype": job.get("dense_allreduce_dtype")}


def strategy_kwargs(job: dict) -> Dict[str, object]:
    """`strategy_options` as HybridParameterServerStrategy's keyword arguments.

    ``table_dtype`` "float32" is the strategy's default, ``table_dtype=None``:
    it is left out, so a plugin copy from before the option
    (``run --plugin_path``) is measured too; so are ``dense_bucket_bytes``
    and ``dense_allreduce_dtype`` None.
    """
    options = strategy_options(job)
    if options["table_dtype"] == "float32":
        del options["table_dtype"]
    for knob in ("dense_bucket_bytes", "dense_allreduce_dtype"):
        if options[knob] is None:  # Likewise: the default, or a copy without it.
            del options[knob]
    return options


def strategy_arguments(job: dict, plugin, log_placement: bool = False) -> Dict[str, object]:
    """`strategy_kwargs` in the spelling of `plugin`, the tf_psplugin the job imports.

    The current plugin takes its knobs as ``options=HybridOptions(...)`` and
    sharding as ``placement=PlacementPolicy(sharding=...)`` (knobs as
    keywords are deprecated); a plugin copy from before `HybridOptions`
    (``run --plugin_path`` at an older commit) takes them as keywords.

    Args:
        job: The benchmark job.
        plugin: The imported ``tf_psplugin`` module.
        log_placement: The strategy's placement log.

    Returns:
        Keyword arguments of ``plugin.HybridParameterServerStrategy``.
    """
    knobs = dict(strategy_kwargs(job), log_placement=log_placement)
    if not hasattr(plugin, "HybridOptions"):
        return knobs
    sharding = knobs.pop("sharding", None)
    knobs["experimental_sparse_exchange"] = knobs.pop("sparse_exchange")
    arguments: Dict[str, object] = {"options": plugin.HybridOptions(**knobs)}
    if sharding is not None:
        arguments["placement"] = plugin.PlacementPolicy(sharding=sharding)
    return arguments


def log_name(job: dict) -> str:
    """The job's log file name (without ``.log``): its setup, policy and table dtype.

    A run of several policies or table dtypes keeps one log per variant.
    """
    name = job["setup"]
    if job.get("mixed_precision", "float32") != "float32":
        name += f"-{job['mixed_precision']}"
    if job.get("table_dtype", "float32") != "float32":
        name += f"-{job['table_dtype']}-tables"
    return name


def write_result(result: dict, tf_version: str) -> None:
    """Prints a child's result line (`RESULT_PREFIX` + JSON) with its peak RSS and TF version."""
    result["peak_rss_mb"] = peak_rss_mb()
    result["tf_version"] = tf_version
    sys.stdout.write(RESULT_PREFIX + json.dumps(result) + "\n")
    sys.stdout.flush()


def peak_rss_mb(pid: str = "self") -> float:
    """Peak resident set size (VmHWM) of a process in MiB; ru_maxrss as fallback."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    if pid == "self":
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
    return float("nan")


def cpu_seconds(pid: str = "self") -> float:
    """User + system CPU seconds a process has used so far (nan if gone)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return float("nan")


def current_rss_mb(pid: int) -> float:
    """Current resident set size (VmRSS) of a process in MiB (nan if gone)."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return float("nan")


PLUGIN_PATH_ENV = "TF_PSPLUGIN_BENCH_PLUGIN_PATH"


def plugin_root() -> str:
    """Directory holding the `tf_psplugin` the children import.

    `$TF_PSPLUGIN_BENCH_PLUGIN_PATH` (set by ``run --plugin_path``) names a
    patched copy to measure; children put it first on sys.path.
    """
    return os.path.abspath(os.environ.get(PLUGIN_PATH_ENV) or REPO_ROOT)


def child_env(extra: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    """Environment for benchmark children: repo importable, quiet TF logs."""
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO_ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH")
                                     else "")
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env


def child_command(job: dict) -> List[str]:
    return [sys.executable, "-m", "benchmarks.child", json.dumps(job)]


def parse_result(text: str, prefix: str = "") -> dict:
    """The last ``BENCH_RESULT`` line of `text` (lines optionally role-prefixed)."""
    found = None
    for line in text.splitlines():
        if line.startswith(prefix + RESULT_PREFIX):
            found = json.loads(line[len(prefix + RESULT_PREFIX):])
    if found is None:
        tail = "\n".join(text.splitlines()[-25:])
        raise BenchmarkProcessError(f"no result line; last output:\n{tail}")
    return found


def _tail(path: str, lines: int = 25) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError:
        return ""


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        pass


def run_single(job: dict, log_dir: str, timeout: float) -> dict:
    """Runs a single-process job; returns its result with ``peak_rss_mb`` per role."""
    log = os.path.join(log_dir, f"{log_name(job)}.log")
    with open(log, "w", encoding="utf-8") as out:
        proc = subprocess.Popen(child_command(job), env=child_env(), stdout=out,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise BenchmarkProcessError(f"timed out after {timeout:.0f} s; log {log}") from None
        finally:
            _kill_group(proc)
    with open(log, encoding="utf-8", errors="replace") as f:
        result = parse_result(f.read())
    result["peak_rss_mb"] = {"single": result["peak_rss_mb"]}
    result["timed_cpu_seconds"] = {"single": result["timed_cpu_seconds"]["self"]}
    return result


def run_ps_cluster(job: dict, num_workers: int, num_ps: int, log_dir: str,
                   timeout: float, attempts: int = 3) -> dict:
    """Starts chief + workers + PS on loopback, runs the chief, reads every peak RSS.

    A server that cannot bind its port (the free-port race documented in
    `tf_psplugin.cluster.ports`) makes the whole cluster restart on fresh ports, at
    most `attempts` times.

    Returns:
        The chief's result, with ``peak_rss_mb`` for every role,
        ``baseline_rss_mb`` (each server's RSS once serving, before the chief
        connected) and ``timed_cpu_seconds`` per role.
    """
    for attempt in range(1, attempts + 1):
        log = os.path.join(log_dir, f"{log_name(job)}.log")
        try:
            return _run_ps_cluster_once(job, num_workers, num_ps, log, timeout)
        except PortClash:
            if attempt == attempts:
                raise BenchmarkProcessError(
                    f"servers could not bind their ports {attempts} times; log {log}") from None


class PortClash(Exception):
    """A server could not bind its port (free-port race): restart on fresh ports."""


def wait_until_serving(cluster, count: int, log: str, timeout: float = 300.0) -> None:
    """Waits until `count` servers of a `LocalCluster` print ``serving at``.

    Raises:
        PortClash: a server could not bind its port; start a new cluster.
        BenchmarkProcessError: the servers did not come up within `timeout` seconds.
    """
    deadline = time.monotonic() + timeout
    while sum("serving at" in ln for ln in cluster.output()) < count:
        if any("could not start its server" in ln for ln in cluster.output()):
            raise PortClash()
        if time.monotonic() > deadline:
            raise BenchmarkProcessError(f"servers did not start; log {log}")
        time.sleep(0.2)


def _run_ps_cluster_once(job, num_workers, num_ps, log, timeout):
    from tf_psplugin.launch import LocalCluster  # pylint: disable=g-import-not-at-top

    with open(log, "w", encoding="utf-8") as out:
        with LocalCluster(num_workers=num_workers, num_ps=num_ps, servers="builtin",
                          env=child_env(), output=out, grace_period=2.0) as cluster:
            cluster.start_servers()
            wait_until_serving(cluster, num_workers + num_ps, log, timeout=min(timeout, 300))
            servers = {role: pid for role, pid in cluster.pids().items() if role != "chief"}
            baseline = {role: current_rss_mb(pid) for role, pid in servers.items()}
            job = dict(job, cpu_pids=servers)
            try:
                done = cluster.run_chief(child_command(job), timeout=timeout)
            except subprocess.TimeoutExpired:
                raise BenchmarkProcessError(
                    f"chief timed out after {timeout:.0f} s; log {log}") from None
            peaks = {role: peak_rss_mb(str(pid)) for role, pid in servers.items()}
            if done.returncode != 0:
                raise BenchmarkProcessError(
                    f"chief exited {done.returncode}; log {log}:\n{_tail(log)}")
            result = parse_result(done.stdout, prefix="[chief] ")
    peaks["chief"] = result["peak_rss_mb"]
    result["peak_rss_mb"] = dict(sorted(peaks.items()))
    result["baseline_rss_mb"] = dict(sorted(baseline.items()))
    cpu = result.get("timed_cpu_seconds", {})
    cpu["chief"] = cpu.pop("self", float("nan"))
    result["timed_cpu_seconds"] = dict(sorted(cpu.items()))
    return result


def _free_ports(n: int) -> List[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def run_mwms(job: dict, num_workers: int, log_dir: str, timeout: float,
             attempts: int = 3) -> dict:
    """Runs `num_workers` MultiWorkerMirroredStrategy workers; returns worker 0's result.

    A worker that cannot bind its port (free-port race) makes the group
    restart on fresh ports, at most `attempts` times.
    """
    for attempt in range(1, attempts + 1):
        try:
            return _run_mwms_once(job, num_workers, log_dir, timeout)
        except PortClash:
            if attempt == attempts:
                raise BenchmarkProcessError(
                    f"MWMS workers could not bind their ports {attempts} times") from None
    raise AssertionError("unreachable")


def _run_mwms_once(job: dict, num_workers: int, log_dir: str, timeout: float) -> dict:
    hosts = [f"127.0.0.1:{p}" for p in _free_ports(num_workers)]
    procs, logs, files = [], [], []
    try:
        for i in range(num_workers):
            tf_config = {"cluster": {"worker": hosts}, "task": {"type": "worker", "index": i}}
            log = os.path.join(log_dir, f"{log_name(job)}-worker-{i}.log")
            f = open(log, "w", encoding="utf-8")  # noqa: SIM115 - closed in finally.
            files.append(f)
            logs.append(log)
            procs.append(subprocess.Popen(
                child_command(job), env=child_env({"TF_CONFIG": json.dumps(tf_config)}),
                stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True))
        deadline = time.monotonic() + timeout
        while any(p.poll() is None for p in procs):
            if time.monotonic() > deadline:
                raise BenchmarkProcessError(f"MWMS timed out after {timeout:.0f} s; logs {logs}")
            if any(p.poll() not in (None, 0) for p in procs):
                bad = next(i for i, p in enumerate(procs) if p.poll() not in (None, 0))
                if "Could not start gRPC server" in _tail(logs[bad], 200):
                    raise PortClash()
                raise BenchmarkProcessError(
                    f"MWMS worker {bad} exited {procs[bad].returncode}:\n{_tail(logs[bad])}")
            time.sleep(0.2)
    finally:
        for p in procs:
            _kill_group(p)
        for f in files:
            f.close()
    results = []
    for i, log in enumerate(logs):
        with open(log, encoding="utf-8", errors="replace") as f:
            results.append(parse_result(f.read()))
    result = results[0]
    result["peak_rss_mb"] = {f"worker:{i}": r["peak_rss_mb"] for i, r in enumerate(results)}
    result["timed_cpu_seconds"] = {f"worker:{i}": r["timed_cpu_seconds"]["self"]
                                   for i, r in enumerate(results)}
    return result


def json_lines_emitter(output: Optional[str]):
    """A function that prints a record as one JSON line (and appends it to `output`)."""

    def emit(record: dict) -> None:
        line = json.dumps(record)
        print(line, flush=True)
        if output:
            with open(output, "a", encoding="utf-8") as f:
                f.write(line + "\n")

    return emit


def save_chart(fig, plt, path: str) -> str:
    """Lays out and writes `fig` as a PNG at `path` (parents made), closes it; returns `path`."""
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path

