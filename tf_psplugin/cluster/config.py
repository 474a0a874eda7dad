"""Cluster configuration: who is in the cluster, and which task this process is.

Why this module exists: every process of a tf_psplugin job (chief, workers,
parameter servers, evaluator) must agree on the cluster and know its own role
before TensorFlow connects anything. Schedulers describe that in two ways:
the `TF_CONFIG` environment variable (Kubeflow's TFJob, Vertex AI, SageMaker)
and the TF1-era flags `--job_name --task_index --ps_hosts --worker_hosts`.
TensorFlow parses TF_CONFIG in `TFConfigClusterResolver` but validates almost
nothing: a typo becomes a hang or a gRPC error minutes later on another host.
This module turns either form into one immutable `ClusterConfig`, rejects bad
input with a one-line `ConfigError` that names the field and the fix, and
hands TensorFlow its own objects (`tf.train.ClusterSpec`,
`SimpleClusterResolver`) for the training cluster.

Two rules apply to both forms:

* No chief given: the first worker becomes the chief (`chief:0`), and the
  remaining workers are renumbered (`worker:k` becomes `worker:k-1`).
  The plugin's coordinator design has exactly one client process; schedulers
  of the flag-style world name no chief and run it on the first worker's host.
* The evaluator is never part of the training cluster (`cluster_spec()`,
  `cluster_resolver()`): a coordinator that connects to it hangs
  (tensorflow issue 46169). It stays in `tf_config()` so that the exported
  TF_CONFIG is the standard form every scheduler writes.

The flag form and `resolve()` (flags first, then TF_CONFIG) are in
`cluster/flags.py`; the command `python -m tf_psplugin.config` is in
`cluster/config_command.py`.
"""

import dataclasses
import difflib
import ipaddress
import json
import re
import types
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

from tf_psplugin.cluster import ports as _ports
from tf_psplugin.errors import ConfigError  # noqa: F401  (see errors.py)

__all__ = [
    "ClusterConfig",
    "ConfigError",
    "from_tf_config",
    "local",
    "validate_cluster_spec",
]

JOBS = ("chief", "worker", "ps", "evaluator")
TRAINING_JOBS = ("chief", "worker", "ps")
SERVER_JOBS = ("worker", "ps")
TF_CONFIG_EXAMPLE = (
    '\'{"cluster": {"worker": ["h1:2222"], "ps": ["h2:2222"]}, '
    '"task": {"type": "worker", "index": 0}}\''
)


class FieldNames:
    """How to name fields, and phrase fixes, for one input form."""

    def __init__(self, source: str):
        self.source = source

    def job(self, job: str) -> str:
        return {
            "TF_CONFIG": f"TF_CONFIG.cluster.{job}",
            "flags": f"--{job}_hosts",
            "cluster_resolver": f"cluster_resolver.cluster_spec()[{job!r}]",
        }.get(self.source, f"cluster.{job}")

    def entry(self, job: str, index: int) -> str:
        if self.source == "flags":
            return f"--{job}_hosts"
        return f"{self.job(job)}[{index}]"

    def task_type(self) -> str:
        return {"TF_CONFIG": "TF_CONFIG.task.type", "flags": "--job_name"}.get(
            self.source, "task_type"
        )

    def task_index(self) -> str:
        return {"TF_CONFIG": "TF_CONFIG.task.index", "flags": "--task_index"}.get(
            self.source, "task_index"
        )

    def set_hosts(self, job: str, what: str = "host:port") -> str:
        more = "" if job in ("chief", "evaluator") else ", ..."
        if self.source == "TF_CONFIG":
            return f'set "{job}": ["{what}"{more}] in TF_CONFIG.cluster'
        if self.source == "flags":
            return f"pass --{job}_hosts={what}" + ("" if not more else f"[,{what}...]")
        return f'set cluster["{job}"] = ("{what}"{more})'

    def set_task(self, task_type: str, index: int) -> str:
        if self.source == "TF_CONFIG":
            return f'set "task": {{"type": "{task_type}", "index": {index}}}'
        if self.source == "flags":
            return f"pass --job_name={task_type} --task_index={index}"
        return f"use task_type={task_type!r}, task_index={index}"


def _address_problem(address: Any) -> Optional[Tuple[str, str]]:
    """Returns (problem, fix) if `address` is not a valid `host:port`, else None."""
    example = "write it as host:port, e.g. 'ps-0.example.com:2222' or '[::1]:2222'"
    if not isinstance(address, str):
        return f"must be a 'host:port' string, got {type(address).__name__} {address!r}", example
    if not address.strip():
        return "is an empty address", example
    if any(c.isspace() for c in address):
        return f"{address!r} contains whitespace", "remove the spaces around host:port"
    if "://" in address:
        return f"{address!r} has a URL scheme", "drop the scheme (grpc://) and write host:port"
    if address.startswith("["):
        match = re.fullmatch(r"\[([^\]]*)\]:([^:]*)", address)
        if not match:
            return f"{address!r} is not '[ipv6]:port'", example
        host, port = match.groups()
        try:
            ipaddress.IPv6Address(host.split("%")[0])
        except ValueError:
            return f"{address!r} has an invalid IPv6 address in brackets", example
    else:
        if ":" not in address:
            return f"{address!r} has no port", f"write it as '{address}:2222' (host:port)"
        if address.count(":") > 1:
            return (
                f"{address!r} looks like an IPv6 address without brackets",
                "put IPv6 hosts in brackets, e.g. '[::1]:2222'",
            )
        host, port = address.rsplit(":", 1)
        if not host:
            return f"{address!r} has an empty host", example
        if not re.fullmatch(r"[A-Za-z0-9_]([A-Za-z0-9._-]*[A-Za-z0-9_])?", host):
            return f"host {host!r} in {address!r} has invalid characters", example
    if not port.isdigit() or not port.isascii():
        return f"port {port!r} in {address!r} is not a number", example
    if not 1 <= int(port) <= 65535:
        return f"port {port} in {address!r} is out of range", "use a port from 1 to 65535"
    return None


def validate_cluster(cluster: Mapping[str, Sequence[str]], names: FieldNames) -> None:
    """Validates jobs, addresses and counts of a cluster before chief promotion."""
    for job, hosts in cluster.items():
        for i, address in enumerate(hosts):
            bad = _address_problem(address)
            if bad:
                problem, fix = bad
                if names.source == "flags":
                    problem = f"entry {i} {problem}"
                raise ConfigError(names.entry(job, i), problem, fix)
    for job in ("chief", "evaluator"):
        if len(cluster.get(job, ())) > 1:
            raise ConfigError(
                names.job(job),
                f"lists {len(cluster[job])} addresses but a cluster has at most one {job}",
                f"keep one address in {names.job(job)}",
            )
    if not cluster.get("ps"):
        raise ConfigError(
            names.job("ps"),
            "no parameter server is given; embedding tables need at least one PS task",
            names.set_hosts("ps"),
        )
    if not cluster.get("chief") and not cluster.get("worker"):
        raise ConfigError(
            names.job("worker"),
            "the cluster has neither a chief nor a worker",
            names.set_hosts("worker") + " (the first worker becomes the chief)",
        )
    seen: Dict[str, str] = {}
    for job, hosts in cluster.items():
        for i, address in enumerate(hosts):
            key = address.lower()
            here = names.entry(job, i) if names.source != "flags" else f"{names.job(job)} entry {i}"
            if key in seen:
                raise ConfigError(
                    names.entry(job, i),
                    f"address {address} is used twice ({seen[key]} and {here})",
                    "give every task its own host:port",
                )
            seen[key] = here


def _validate_task(
    cluster: Mapping[str, Sequence[str]], task_type: str, task_index: int, names: FieldNames
) -> None:
    """Validates the task against the (unpromoted) cluster."""
    if task_type == "evaluator":
        if task_index != 0:
            raise ConfigError(
                names.task_index(),
                f"is {task_index} but there is only one evaluator (index 0)",
                names.set_task("evaluator", 0),
            )
        return  # The evaluator may be absent from the cluster (TF's convention).
    hosts = cluster.get(task_type, ())
    if task_type == "chief" and not hosts:
        raise ConfigError(
            names.task_type(),
            "is chief but no chief address is given; without one, worker 0 is the chief",
            names.set_hosts("chief") + ", or " + names.set_task("worker", 0),
        )
    if not hosts:
        raise ConfigError(
            names.task_type(),
            f"is {task_type} but the cluster has no {task_type} addresses",
            names.set_hosts(task_type),
        )
    if not 0 <= task_index < len(hosts):
        raise ConfigError(
            names.task_index(),
            f"is {task_index} but {names.job(task_type)} has {len(hosts)} "
            f"address{'es' if len(hosts) != 1 else ''} (valid: 0..{len(hosts) - 1})",
            names.set_task(task_type, 0) + " (indices count from 0)",
        )


def _check_index(value: Any, names: FieldNames) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        fix = 'write it as a JSON number, e.g. "index": 0' if names.source == "TF_CONFIG" else (
            "pass an int, e.g. 0")
        raise ConfigError(
            names.task_index(), f"must be an integer, got {type(value).__name__} {value!r}", fix
        )
    if value < 0:
        raise ConfigError(names.task_index(), f"is {value}, negative", "use an index >= 0")
    return value


def check_role(value: Any, names: FieldNames, allowed: Sequence[str] = JOBS) -> str:
    if not isinstance(value, str):
        raise ConfigError(
            names.task_type(),
            f"must be a string, got {type(value).__name__} {value!r}",
            f"use one of {', '.join(allowed)}",
        )
    if value not in allowed:
        hint = "; TF1's 'master' is called 'chief' now" if value == "master" else ""
        close = difflib.get_close_matches(value, allowed, n=1)
        hint += f" (did you mean {close[0]!r}?)" if close and not hint else ""
        raise ConfigError(
            names.task_type(), f"{value!r} is not a known role{hint}",
            f"use one of {', '.join(allowed)}",
        )
    return value


def _promote(
    cluster: Mapping[str, Sequence[str]], task_type: str, task_index: int
) -> Tuple[Dict[str, Tuple[str, ...]], str, int, bool]:
    """Applies the first-worker-is-chief rule. Returns (cluster, type, index, promoted)."""
    out = {job: tuple(cluster[job]) for job in JOBS if cluster.get(job)}
    if "chief" in out:
        return out, task_type, task_index, False
    workers = out.pop("worker")
    out["chief"] = workers[:1]
    if workers[1:]:
        out["worker"] = workers[1:]
    if task_type == "worker":
        task_type, task_index = ("chief", 0) if task_index == 0 else ("worker", task_index - 1)
    return {job: out[job] for job in JOBS if job in out}, task_type, task_index, True


def build_config(
    cluster: Mapping[str, Sequence[str]], task_type: str, task_index: int,
    rpc_layer: str, names: FieldNames,
) -> "ClusterConfig":
    validate_cluster(cluster, names)
    _validate_task(cluster, task_type, task_index, names)
    promoted_cluster, task_type, task_index, promoted = _promote(cluster, task_type, task_index)
    return ClusterConfig(
        cluster=promoted_cluster, task_type=task_type, task_index=task_index,
        rpc_layer=rpc_layer, chief_promoted_from_worker=promoted, source=names.source,
    )


@dataclasses.dataclass(frozen=True)
class ClusterConfig:
    """One task's view of a validated cluster (after chief promotion).

    Build it with `resolve()` (flags or TF_CONFIG), `from_tf_config()`,
    `from_flags()` or `local()`; constructing it directly validates too.
    Equality ignores `source` and `chief_promoted_from_worker`.

    Example:

      config = tf_psplugin.config.from_tf_config({
          "cluster": {"worker": ["h0:2222", "h1:2222"], "ps": ["h2:2222"]},
          "task": {"type": "worker", "index": 1}})
      assert config.task_type == "worker" and config.task_index == 0
      assert config.training_cluster == {"chief": ["h0:2222"],
                                         "worker": ["h1:2222"], "ps": ["h2:2222"]}

    Attributes:
      cluster: read-only mapping job -> tuple of addresses, jobs among
        chief/worker/ps/evaluator, always with exactly one chief.
      task_type: "chief", "worker", "ps" or "evaluator".
      task_index: index of this task within its job.
      rpc_layer: TensorFlow's protocol, "grpc" unless TF_CONFIG says otherwise.
      chief_promoted_from_worker: True if no chief was given and the first
        worker became the chief.
      source: "TF_CONFIG", "flags" or "explicit".
    """

    cluster: Mapping[str, Tuple[str, ...]]
    task_type: str
    task_index: int
    rpc_layer: str = "grpc"
    chief_promoted_from_worker: bool = dataclasses.field(default=False, compare=False)
    source: str = dataclasses.field(default="explicit", compare=False)

    def __post_init__(self):
        names = FieldNames("explicit")
        if not isinstance(self.cluster, Mapping):
            raise ConfigError("cluster", f"must be a mapping, got {type(self.cluster).__name__}",
                              "pass {'chief': [...], 'worker': [...], 'ps': [...]}")
        for job, hosts in self.cluster.items():
            if job not in JOBS:
                raise ConfigError(f"cluster.{job}", "is not a known job", f"use {', '.join(JOBS)}")
            if isinstance(hosts, str) or not isinstance(hosts, Sequence):
                raise ConfigError(f"cluster.{job}", "must be a sequence of 'host:port' strings",
                                  f"wrap it in a list: [{hosts!r}]")
        cluster = {job: tuple(self.cluster[job]) for job in JOBS if self.cluster.get(job)}
        validate_cluster(cluster, names)
        if "chief" not in cluster:
            raise ConfigError("cluster.chief", "is missing",
                              "add a chief, or use from_tf_config()/from_flags() to promote "
                              "worker 0")
        check_role(self.task_type, names)
        _check_index(self.task_index, names)
        _validate_task(cluster, self.task_type, self.task_index, names)
        if not isinstance(self.rpc_layer, str) or not self.rpc_layer:
            raise ConfigError("rpc_layer", f"must be a non-empty string, got {self.rpc_layer!r}",
                              "use 'grpc'")
        object.__setattr__(self, "cluster", types.MappingProxyType(cluster))

    def __hash__(self):
        return hash((tuple(self.cluster.items()), self.task_type, self.task_index, self.rpc_layer))

    @property
    def is_chief(self) -> bool:
        """True for the chief: the single coordinator client."""
        return self.task_type == "chief"

    @property
    def is_evaluator(self) -> bool:
        return self.task_type == "evaluator"

    @property
    def is_server(self) -> bool:
        """True for ps and worker tasks, which only run a tf.distribute.Server."""
        return self.task_type in SERVER_JOBS

    @property
    def num_workers(self) -> int:
        """Number of worker tasks, not counting the chief."""
        return len(self.cluster.get("worker", ()))

    @property
    def num_ps(self) -> int:
        return len(self.cluster.get("ps", ()))

    @property
    def has_evaluator(self) -> bool:
        return "evaluator" in self.cluster

    @property
    def chief_address(self) -> str:
        return self.cluster["chief"][0]

    @property
    def task_address(self) -> Optional[str]:
        """This task's host:port; None for an evaluator absent from the cluster."""
        hosts = self.cluster.get(self.task_type, ())
        return hosts[self.task_index] if self.task_index < len(hosts) else None

    @property
    def training_cluster(self) -> Dict[str, List[str]]:
        """The cluster without the evaluator: a fresh dict of chief/worker/ps lists."""
        return {job: list(self.cluster[job]) for job in TRAINING_JOBS if job in self.cluster}

    def cluster_spec(self):
        """Returns the training cluster (no evaluator) as a `tf.train.ClusterSpec`."""
        import tensorflow as tf  # Lazy: the CLI and launcher do not need TF.

        return tf.train.ClusterSpec(self.training_cluster)

    def cluster_resolver(self):
        """Returns a `SimpleClusterResolver` for the training cluster and this task."""
        import tensorflow as tf

        return tf.distribute.cluster_resolver.SimpleClusterResolver(
            self.cluster_spec(), task_type=self.task_type, task_id=self.task_index,
            rpc_layer=self.rpc_layer,
        )

    def tf_config(self) -> Dict[str, Any]:
        """The standard TF_CONFIG for this task (evaluator included, chief explicit)."""
        return {
            "cluster": {job: list(hosts) for job, hosts in self.cluster.items()},
            "task": {"type": self.task_type, "index": self.task_index},
            "rpc_layer": self.rpc_layer,
        }

    def for_task(self, task_type: str, task_index: int) -> "ClusterConfig":
        """The same cluster seen from another task (e.g. what the launcher gives it).

        Raises:
          ConfigError: if that task is not in the cluster.
        """
        return dataclasses.replace(self, task_type=task_type, task_index=task_index)

    def to_json_dict(self) -> Dict[str, Any]:
        """A JSON-ready summary: what `python -m tf_psplugin.config` prints."""
        return {
            "role": self.task_type,
            "task_index": self.task_index,
            "task": f"{self.task_type}:{self.task_index}",
            "task_address": self.task_address,
            "is_chief": self.is_chief,
            "chief": self.chief_address,
            "chief_promoted_from_worker": self.chief_promoted_from_worker,
            "training_cluster": self.training_cluster,
            "evaluator": self.cluster.get("evaluator", (None,))[0],
            "tf_config": self.tf_config(),
            "source": self.source,
        }


def from_tf_config(tf_config: Union[str, Mapping[str, Any]]) -> ClusterConfig:
    """Parses and validates a TF_CONFIG (JSON text or the decoded dict).

    Keys other than cluster, task and rpc_layer (e.g. "environment", Vertex
    AI's "job") are ignored.

    Args:
      tf_config: the value of the TF_CONFIG environment variable, or a dict.

    Returns:
      The validated, promoted `ClusterConfig` with source "TF_CONFIG".

    Raises:
      ConfigError: on any malformed or inconsistent input.
    """
    names = FieldNames("TF_CONFIG")
    fix_json = f"export a JSON object, e.g. TF_CONFIG={TF_CONFIG_EXAMPLE}"
    if isinstance(tf_config, (str, bytes)):
        try:
            tf_config = json.loads(tf_config)
        except ValueError as e:  # JSONDecodeError and UnicodeDecodeError.
            raise ConfigError("TF_CONFIG", f"is not valid JSON ({e})", fix_json) from None
    if not isinstance(tf_config, Mapping):
        raise ConfigError("TF_CONFIG", f"must be a JSON object, got {type(tf_config).__name__}",
                          fix_json)
    cluster = tf_config.get("cluster")
    if cluster is None:
        raise ConfigError("TF_CONFIG.cluster", "is missing", fix_json)
    if not isinstance(cluster, Mapping) or not cluster:
        raise ConfigError("TF_CONFIG.cluster", f"must be a non-empty object, got {cluster!r}",
                          'write {"chief": [...], "worker": [...], "ps": [...]}')
    for job, hosts in cluster.items():
        if job not in JOBS:
            hint = " (TF1's 'master' is called 'chief' now)" if job == "master" else ""
            close = difflib.get_close_matches(str(job), JOBS, n=1)
            hint = hint or (f" (did you mean {close[0]!r}?)" if close else "")
            raise ConfigError(f"TF_CONFIG.cluster.{job}", f"is not a known job{hint}",
                              f"use only the jobs {', '.join(JOBS)}")
        if isinstance(hosts, str) or not isinstance(hosts, list):
            raise ConfigError(names.job(job),
                              f"must be a list of 'host:port' strings, got {hosts!r}",
                              f'write "{job}": ["host:port", ...]')
        if not hosts:
            raise ConfigError(names.job(job), "is an empty list",
                              f'list at least one "host:port", or remove "{job}"')
    task = tf_config.get("task")
    if task is None:
        raise ConfigError("TF_CONFIG.task", "is missing; every process needs its own task",
                          names.set_task("worker", 0))
    if not isinstance(task, Mapping):
        raise ConfigError("TF_CONFIG.task", f"must be an object, got {task!r}",
                          names.set_task("worker", 0))
    if "type" not in task:
        raise ConfigError("TF_CONFIG.task.type", "is missing", names.set_task("worker", 0))
    task_type = check_role(task["type"], names)
    if "index" not in task:
        raise ConfigError("TF_CONFIG.task.index", "is missing", names.set_task(task_type, 0))
    task_index = _check_index(task["index"], names)
    rpc_layer = tf_config.get("rpc_layer", "grpc")
    if not isinstance(rpc_layer, str) or not re.fullmatch(r"[a-z0-9+_]+", rpc_layer):
        raise ConfigError("TF_CONFIG.rpc_layer", f"{rpc_layer!r} is not a protocol name",
                          'use "grpc" or drop the key')
    return build_config(cluster, task_type, task_index, rpc_layer, names)


def validate_cluster_spec(cluster: Mapping[str, Any], source: str = "cluster_resolver") -> None:
    """Validates a cluster given as a dict or `tf.train.ClusterSpec` (e.g. a resolver's).

    The checks `from_tf_config` applies to TF_CONFIG's cluster: known jobs,
    host:port addresses, at most one chief, at least one PS, a chief or a
    worker, no address used twice. Indexed (sparse) job dicts are read in
    index order.

    Args:
      cluster: ``{"worker": [...], "ps": [...], ...}`` or a ClusterSpec.
      source: Names the input in messages, e.g. ``"cluster_resolver"``.

    Raises:
      ConfigError: naming the field and the fix.
    """
    if hasattr(cluster, "as_dict"):
        cluster = cluster.as_dict()
    field = f"{source}.cluster_spec()"
    if not isinstance(cluster, Mapping) or not cluster:
        raise ConfigError(field, f"must be a non-empty cluster, got {cluster!r}",
                          'describe {"chief": [...], "worker": [...], "ps": [...]}')
    plain: Dict[str, List[str]] = {}
    for job, hosts in cluster.items():
        if job not in JOBS:
            close = difflib.get_close_matches(str(job), JOBS, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(f"{field}[{job!r}]", f"is not a known job{hint}",
                              f"use only the jobs {', '.join(JOBS)}")
        if isinstance(hosts, Mapping):  # ClusterSpec.as_dict() of a sparse job.
            hosts = [hosts[i] for i in sorted(hosts)]
        if isinstance(hosts, str) or not isinstance(hosts, (list, tuple)) or not hosts:
            raise ConfigError(f"{field}[{job!r}]", f"must be a non-empty list of 'host:port', "
                              f"got {hosts!r}", f"list at least one address for {job}")
        plain[job] = list(hosts)
    validate_cluster(plain, FieldNames(source))


def local(
    num_workers: int, num_ps: int, evaluator: bool = False, host: str = "127.0.0.1",
    ports: Optional[Sequence[int]] = None,
) -> ClusterConfig:
    """The chief's config for a single-host cluster on free ports.

    Args:
      num_workers: worker tasks besides the chief (>= 0).
      num_ps: parameter-server tasks (>= 1).
      evaluator: whether to add an evaluator task.
      host: the host every task listens on, e.g. "127.0.0.1" or "::1".
      ports: optional ports in the order chief, workers, ps, evaluator;
        default: free ports picked now.

    Returns:
      A `ClusterConfig` for chief:0 with source "explicit"; use
      `for_task()` for the other tasks.

    Raises:
      ConfigError: on bad counts or ports.
    """
    for name, value, low in (("num_workers", num_workers, 0), ("num_ps", num_ps, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ConfigError(name, f"must be an integer >= {low}, got {value!r}",
                              f"pass {name}={max(low, 1)} or more")
    total = 1 + num_workers + num_ps + (1 if evaluator else 0)
    if ports is None:
        ports = _ports.pick_free_ports(total, host)
    elif len(ports) != total:
        raise ConfigError("ports", f"has {len(ports)} entries but the cluster has {total} tasks",
                          "pass one port per task: chief, workers, ps, evaluator")
    addresses = iter(_ports.format_address(host, port) for port in ports)
    cluster = {"chief": [next(addresses)], "worker": [next(addresses) for _ in range(num_workers)],
               "ps": [next(addresses) for _ in range(num_ps)]}
    if evaluator:
        cluster["evaluator"] = [next(addresses)]
    return ClusterConfig(cluster=cluster, task_type="chief", task_index=0)
