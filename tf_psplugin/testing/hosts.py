"""Emulated hosts on one Linux box: one network namespace per task, real links.

Why this module exists: every other test runs the whole cluster on
127.0.0.1, with unlimited bandwidth and no per-host byte counts. Here every
host is its own network namespace with its own address; the hosts meet on a
bridge inside a hub namespace, so no traffic and no interface ever touches
the box's own network namespace. Each host's link can be rate-limited with
`tc` (token bucket, both directions) and cut and restored (a network
partition), and the exact bytes each host sent and received are read from
its interface counters.

    with EmulatedHosts(["chief", "worker0", "ps0"], rate_mbit=100) as hosts:
        proc = hosts.popen("ps0", [sys.executable, "-m", "tf_psplugin.server", ...])
        hosts.address("ps0")            # "10.213.<k>.3"
        hosts.counters("ps0")           # {"rx_bytes": ..., "tx_bytes": ...}
        hosts.set_link("worker0", up=False)   # partition worker0

Layout, per run (names carry this process's pid, so runs never collide and a
later run can remove what a killed run left behind):

    hub namespace  tfps<pid>-hub: bridge br0, one port p<i> per host
    host namespace tfps<pid>-<i>: lo and eth0 (10.213.<k>.<i+2>/24), veth to p<i>

Needs root (CAP_NET_ADMIN) and iproute2 (`ip`, `tc`). Where namespaces cannot
be created, the constructor raises `HostsUnavailableError` saying why. Every
namespace and every process started through `popen` (and any other process
left inside the namespaces) is removed on exit, also when the body raises,
and at interpreter exit if the object was never closed.

Link emulation available on this kernel: `tbf` (rate) and link down/up
(partition). `netem` (delay, loss) is used when the kernel has it
(`HostsUnavailableError` names it otherwise, when a delay or loss is asked
for); `tc qdisc add ... netem` fails with "Specified qdisc kind is unknown"
on kernels built without sch_netem.
"""

import atexit
import json
import os
import re
import shutil
import signal
import subprocess
import time
from typing import Dict, List, Optional, Sequence

_PREFIX = "tfps"
_SUBNET_BASE = "10.213"
_NAME_RE = re.compile(r"^tfps(\d+)-")


class HostsUnavailableError(RuntimeError):
    """Network namespaces (or a link feature) cannot be used on this machine."""


def _run(argv: Sequence[str], check: bool = True, **kwargs) -> subprocess.CompletedProcess:
    result = subprocess.run(list(argv), capture_output=True, text=True, **kwargs)
    if check and result.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({result.returncode}): "
                           f"{result.stderr.strip() or result.stdout.strip()}")
    return result


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _namespaces() -> List[str]:
    result = _run(["ip", "netns", "list"], check=False)
    return [line.split()[0] for line in result.stdout.splitlines() if line.strip()]


def _kill_namespace(ns: str) -> None:
    """Kills every process inside `ns`, then deletes it."""
    pids = _run(["ip", "netns", "pids", ns], check=False).stdout.split()
    for pid in pids:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass
    deadline = time.monotonic() + 5.0
    while pids and time.monotonic() < deadline:
        pids = [p for p in pids if _pid_alive(int(p))]
        time.sleep(0.05)
    _run(["ip", "netns", "del", ns], check=False)


def remove_stale_namespaces() -> List[str]:
    """Removes namespaces of earlier runs whose process is gone; returns their names."""
    removed = []
    for ns in _namespaces():
        match = _NAME_RE.match(ns)
        if match and int(match.group(1)) != os.getpid() and not _pid_alive(int(match.group(1))):
            _kill_namespace(ns)
            removed.append(ns)
    return removed


def check_available() -> None:
    """Raises HostsUnavailableError unless namespaces, veths and tbf can be made here."""
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            raise HostsUnavailableError(
                f"`{tool}` is not installed. Fix: install iproute2 "
                "(Debian: apt-get install iproute2).")
    if os.geteuid() != 0:
        raise HostsUnavailableError(
            "emulated hosts need root (CAP_NET_ADMIN) to create network namespaces; "
            f"this process runs as uid {os.geteuid()}.")


class EmulatedHosts:
    """Hosts as network namespaces on one bridge; see the module docstring.

    Args:
        names: one name per host (any strings; `address(name)` etc. take them).
        rate_mbit: link rate of every host in Mbit/s, each direction (None: unlimited).
        delay_ms: one-way delay per host link (needs netem).
        loss_pct: random loss per host link, % (needs netem).
        subnet_index: third octet of 10.213.<k>.0/24 (default: from the pid,
            so concurrent runs use different subnets; they are in different
            namespaces anyway).
    """

    def __init__(self, names: Sequence[str], rate_mbit: Optional[float] = None,
                 delay_ms: float = 0.0, loss_pct: float = 0.0,
                 subnet_index: Optional[int] = None):
        if len(set(names)) != len(names) or not names:
            raise ValueError(f"host names must be unique and non-empty, got {list(names)}")
        if len(names) > 250:
            raise ValueError("at most 250 hosts per run")
        check_available()
        remove_stale_namespaces()
        self._names = list(names)
        self._run_id = f"{_PREFIX}{os.getpid()}-{id(self) % 10000}"
        self._hub = f"{self._run_id}-hub"
        self._ns = {name: f"{self._run_id}-{i}" for i, name in enumerate(self._names)}
        k = subnet_index if subnet_index is not None else os.getpid() % 250
        self._address = {name: f"{_SUBNET_BASE}.{k}.{i + 2}" for i, name in enumerate(self._names)}
        self._port = {name: f"p{i}" for i, name in enumerate(self._names)}
        self._procs: List[subprocess.Popen] = []
        self._closed = False
        atexit.register(self.close)
        try:
            self._create(rate_mbit, delay_ms, loss_pct)
        except Exception:
            self.close()
            raise

    # -- set-up and tear-down ------------------------------------------------

    def _create(self, rate_mbit, delay_ms, loss_pct):
        try:
            _run(["ip", "netns", "add", self._hub])
        except RuntimeError as e:
            raise HostsUnavailableError(f"cannot create a network namespace: {e}") from None
        _run(["ip", "-n", self._hub, "link", "set", "lo", "up"])
        _run(["ip", "-n", self._hub, "link", "add", "br0", "type", "bridge"])
        _run(["ip", "-n", self._hub, "link", "set", "br0", "up"])
        for name in self._names:
            ns, port = self._ns[name], self._port[name]
            _run(["ip", "netns", "add", ns])
            _run(["ip", "-n", ns, "link", "set", "lo", "up"])
            # Both ends are created inside our namespaces: nothing in the root one.
            _run(["ip", "-n", self._hub, "link", "add", port, "type", "veth",
                  "peer", "name", "eth0", "netns", ns])
            _run(["ip", "-n", self._hub, "link", "set", port, "master", "br0"])
            _run(["ip", "-n", self._hub, "link", "set", port, "up"])
            _run(["ip", "-n", ns, "addr", "add", f"{self._address[name]}/24", "dev", "eth0"])
            _run(["ip", "-n", ns, "link", "set", "eth0", "up"])
            self.set_link_shape(name, rate_mbit=rate_mbit, delay_ms=delay_ms, loss_pct=loss_pct)

    def close(self) -> None:
        """Kills every process started here and removes every namespace (idempotent)."""
        if self._closed:
            return
        self._closed = True
        for proc in self._procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    proc.kill()
        for proc in self._procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        for ns in list(getattr(self, "_ns", {}).values()) + [getattr(self, "_hub", "")]:
            if ns and ns in _namespaces():
                _kill_namespace(ns)
        try:
            atexit.unregister(self.close)
        except Exception:  # pylint: disable=broad-except
            pass

    def __enter__(self) -> "EmulatedHosts":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- hosts -----------------------------------------------------------------

    @property
    def names(self) -> List[str]:
        return list(self._names)

    def namespace(self, name: str) -> str:
        return self._ns[name]

    def address(self, name: str) -> str:
        """The host's IPv4 address on the bridge."""
        return self._address[name]

    def namespaces(self) -> List[str]:
        """Every namespace this run created (hosts and hub)."""
        return list(self._ns.values()) + [self._hub]

    def popen(self, name: str, argv: Sequence[str], **kwargs) -> subprocess.Popen:
        """Starts `argv` on host `name` in its own process group; killed on close."""
        if self._closed:
            raise RuntimeError("EmulatedHosts is closed")
        proc = subprocess.Popen(["ip", "netns", "exec", self._ns[name], *argv],
                                start_new_session=True, **kwargs)
        self._procs.append(proc)
        return proc

    def run(self, name: str, argv: Sequence[str], timeout: float = 60.0,
            check: bool = True) -> subprocess.CompletedProcess:
        """Runs `argv` on host `name` to completion (for short commands)."""
        return _run(["ip", "netns", "exec", self._ns[name], *argv], check=check,
                    timeout=timeout)

    # -- links -----------------------------------------------------------------

    def counters(self, name: str) -> Dict[str, int]:
        """Bytes and packets host `name` sent and received on its link since creation."""
        out = _run(["ip", "-n", self._ns[name], "-s", "-j", "link", "show", "eth0"]).stdout
        stats = json.loads(out)[0]["stats64"]
        return {"rx_bytes": int(stats["rx"]["bytes"]), "tx_bytes": int(stats["tx"]["bytes"]),
                "rx_packets": int(stats["rx"]["packets"]),
                "tx_packets": int(stats["tx"]["packets"])}

    def all_counters(self) -> Dict[str, Dict[str, int]]:
        return {name: self.counters(name) for name in self._names}

    def set_link(self, name: str, up: bool) -> None:
        """Cuts (up=False) or restores host `name`'s link, at the bridge port.

        The host keeps its own interface and address; its packets go nowhere
        (like a pulled cable or a dead switch port), so TCP peers see
        timeouts, not resets.
        """
        _run(["ip", "-n", self._hub, "link", "set", self._port[name], "up" if up else "down"])

    def set_link_shape(self, name: str, rate_mbit: Optional[float] = None,
                       delay_ms: float = 0.0, loss_pct: float = 0.0) -> None:
        """Sets host `name`'s link rate (both directions), delay and loss; None/0 = none."""
        for ns, dev in ((self._ns[name], "eth0"), (self._hub, self._port[name])):
            _run(["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"], check=False)
            parent = ["root"]
            if delay_ms or loss_pct:
                netem = ["netem"]
                if delay_ms:
                    netem += ["delay", f"{delay_ms / 2.0:g}ms"]  # half each way
                if loss_pct:
                    netem += ["loss", f"{loss_pct:g}%"]
                result = _run(["tc", "-n", ns, "qdisc", "add", "dev", dev, "root",
                               "handle", "1:", *netem], check=False)
                if result.returncode != 0:
                    raise HostsUnavailableError(
                        f"link delay/loss needs the kernel's netem qdisc: tc said "
                        f"{result.stderr.strip()!r}. Use rate limits and set_link() "
                        "partitions on this kernel.")
                parent = ["parent", "1:1"]
            if rate_mbit:
                rate_bits = float(rate_mbit) * 1e6
                # Burst: 10 ms of traffic (min 64 KiB) so gRPC's large frames pass;
                # queue: 200 ms of traffic (min 1 MiB), deep enough for TCP.
                burst = max(int(rate_bits / 8 * 0.01), 65536)
                limit = max(int(rate_bits / 8 * 0.2), 1 << 20)
                _run(["tc", "-n", ns, "qdisc", "add", "dev", dev, *parent, "handle", "10:",
                      "tbf", "rate", f"{rate_bits:.0f}bit", "burst", str(burst),
                      "limit", str(limit)])
