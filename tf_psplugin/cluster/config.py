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

Command line: `python -m tf_psplugin.config [flags]` prints what this process
would be as JSON; see `main()` and docs/cluster.md.
"""

import dataclasses
import difflib
import ipaddress
import json
import os
import re
import sys
import types
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

from absl import flags
from absl import logging

from tf_psplugin._internal import verbosity as verbosity_lib
from tf_psplugin.cluster import ports as _ports
from tf_psplugin.errors import RESTART_EXIT_CODE, ConfigError  # noqa: F401  (see errors.py)

__all__ = [
    "ClusterConfig",
    "ConfigError",
    "FLAGS",
    "define_flags",
    "from_flags",
    "from_tf_config",
    "local",
    "resolve",
]

# "1" if failed workers/PS tasks are restarted by something (the launcher's
# --restart-failed, a scheduler), "0" if not. The launcher sets it for every
# task; the chief's failover reads it (failover.FailoverPolicy.task_restarts).
# Defined here, not in failover.py, so the launcher needs no TensorFlow import.
TASK_RESTARTS_ENV = "TF_PSPLUGIN_TASK_RESTARTS"
# How many times the chief was restarted after such a failure; set by the
# launcher (and by tf_psplugin.elastic.run) for the restarted chief.
CHIEF_RESTARTS_ENV = "TF_PSPLUGIN_CHIEF_RESTARTS"

JOBS = ("chief", "worker", "ps", "evaluator")
TRAINING_JOBS = ("chief", "worker", "ps")
_SERVER_JOBS = ("worker", "ps")
_TF_CONFIG_EXAMPLE = (
    '\'{"cluster": {"worker": ["h1:2222"], "ps": ["h2:2222"]}, '
    '"task": {"type": "worker", "index": 0}}\''
)
_FLAGS_EXAMPLE = "--job_name=worker --task_index=0 --worker_hosts=h1:2222 --ps_hosts=h2:2222"


class _Names:
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


def _validate_cluster(cluster: Mapping[str, Sequence[str]], names: _Names) -> None:
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
    cluster: Mapping[str, Sequence[str]], task_type: str, task_index: int, names: _Names
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


def _check_index(value: Any, names: _Names) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        fix = 'write it as a JSON number, e.g. "index": 0' if names.source == "TF_CONFIG" else (
            "pass an int, e.g. 0")
        raise ConfigError(
            names.task_index(), f"must be an integer, got {type(value).__name__} {value!r}", fix
        )
    if value < 0:
        raise ConfigError(names.task_index(), f"is {value}, negative", "use an index >= 0")
    return value


def _check_role(value: Any, names: _Names, allowed: Sequence[str] = JOBS) -> str:
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


def _build(
    cluster: Mapping[str, Sequence[str]], task_type: str, task_index: int,
    rpc_layer: str, names: _Names,
) -> "ClusterConfig":
    _validate_cluster(cluster, names)
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
        names = _Names("explicit")
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
        _validate_cluster(cluster, names)
        if "chief" not in cluster:
            raise ConfigError("cluster.chief", "is missing",
                              "add a chief, or use from_tf_config()/from_flags() to promote "
                              "worker 0")
        _check_role(self.task_type, names)
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
        return self.task_type in _SERVER_JOBS

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
    names = _Names("TF_CONFIG")
    fix_json = f"export a JSON object, e.g. TF_CONFIG={_TF_CONFIG_EXAMPLE}"
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
    task_type = _check_role(task["type"], names)
    if "index" not in task:
        raise ConfigError("TF_CONFIG.task.index", "is missing", names.set_task(task_type, 0))
    task_index = _check_index(task["index"], names)
    rpc_layer = tf_config.get("rpc_layer", "grpc")
    if not isinstance(rpc_layer, str) or not re.fullmatch(r"[a-z0-9+_]+", rpc_layer):
        raise ConfigError("TF_CONFIG.rpc_layer", f"{rpc_layer!r} is not a protocol name",
                          'use "grpc" or drop the key')
    return _build(cluster, task_type, task_index, rpc_layer, names)


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
    _validate_cluster(plain, _Names(source))


# --- Flags -----------------------------------------------------------------

_FLAG_HELP = {
    "job_name": "This task's role: chief, worker, ps or evaluator. When set, the flags "
    "below describe the cluster and TF_CONFIG is ignored.",
    "ps_hosts": "Comma-separated host:port of the parameter servers.",
    "worker_hosts": "Comma-separated host:port of the workers. Without --chief_hosts the "
    "first worker is the chief.",
    "chief_hosts": "host:port of the chief (at most one).",
    "evaluator_hosts": "host:port of the evaluator (at most one; optional even with "
    "--job_name=evaluator).",
}
_HOST_FLAGS = ("chief_hosts", "worker_hosts", "ps_hosts", "evaluator_hosts")


def define_flags(flag_values: flags.FlagValues) -> None:
    """Defines --job_name --task_index --{chief,worker,ps,evaluator}_hosts.

    Flags already defined in `flag_values` are skipped, so this never collides
    with a user's own flags of the same name.

    Args:
      flag_values: e.g. `absl.flags.FLAGS` in an `app.run` script.
    """
    for name, help_text in _FLAG_HELP.items():
        if name not in flag_values:
            flags.DEFINE_string(name, None, help_text, flag_values=flag_values)
    if "task_index" not in flag_values:
        flags.DEFINE_integer("task_index", None, "Index of this task within --job_name.",
                             flag_values=flag_values)


FLAGS = flags.FlagValues()
define_flags(FLAGS)


def _flag(flag_values: flags.FlagValues, name: str) -> Any:
    return flag_values[name].value if name in flag_values else None


def _split_hosts(value: Any, name: str) -> List[str]:
    if value is None or value == "":
        return []
    if isinstance(value, (list, tuple)):  # A user's DEFINE_list flag of the same name.
        return [str(v).strip() for v in value]
    if not isinstance(value, str):
        raise ConfigError(f"--{name}", f"must be a comma-separated string, got {value!r}",
                          f"pass --{name}=host:port[,host:port...]")
    return [part.strip() for part in value.split(",")]


def from_flags(flag_values: Optional[flags.FlagValues] = None) -> ClusterConfig:
    """Builds the config from --job_name/--task_index/--*_hosts.

    Args:
      flag_values: parsed flags holding the plugin's flags (see
        `define_flags`); default: this module's `FLAGS`. If not parsed yet,
        `sys.argv` is parsed into it, ignoring unknown flags.

    Returns:
      The validated, promoted `ClusterConfig` with source "flags".

    Raises:
      ConfigError: on missing, malformed or inconsistent flags.
    """
    fv = FLAGS if flag_values is None else flag_values
    if not fv.is_parsed():
        _parse(fv, sys.argv, known_only=True)
    names = _Names("flags")
    job_name = _flag(fv, "job_name")
    if job_name in (None, ""):
        raise ConfigError("--job_name", "is missing",
                          f"pass the task's role, e.g. {_FLAGS_EXAMPLE}")
    task_type = _check_role(job_name, names)
    cluster = {}
    for name in _HOST_FLAGS:
        hosts = _split_hosts(_flag(fv, name), name)
        if hosts:
            cluster[name[: -len("_hosts")]] = hosts
    _validate_cluster(cluster, names)  # Address errors first: they explain count errors.
    index = _flag(fv, "task_index")
    if isinstance(index, str):
        if not index.strip().lstrip("-").isdigit():
            raise ConfigError("--task_index", f"must be an integer, got {index!r}",
                              "pass --task_index=0 (or another task number)")
        index = int(index)
    if index is None:
        count = len(cluster.get(task_type, ()))
        if task_type in _SERVER_JOBS and count > 1:
            raise ConfigError("--task_index", f"is missing and --{task_type}_hosts lists {count} "
                              "tasks", f"pass --task_index=N with N from 0 to {count - 1}")
        index = 0
    if index < 0:
        raise ConfigError("--task_index", f"is {index}, negative", "use an index >= 0")
    return _build(cluster, task_type, index, "grpc", names)


def _parse(fv: flags.FlagValues, argv: Sequence[str], known_only: bool) -> List[str]:
    """Parses argv into fv, turning absl's errors into ConfigError."""
    try:
        return fv(list(argv), known_only=known_only)
    except flags.CantOpenFlagFileError as e:
        raise ConfigError("--flagfile", str(e).replace("ERROR:: ", ""),
                          "pass the path of an existing flags file") from None
    except flags.Error as e:
        name = getattr(e, "flagname", None)
        match = re.search(r"--?([A-Za-z0-9_]+)", str(e))
        field = f"--{name}" if name else (f"--{match.group(1)}" if match else "argv")
        raise ConfigError(field, str(e).splitlines()[0] if str(e) else type(e).__name__,
                          "check the flag's spelling and value (python -m tf_psplugin.config "
                          "--help lists the flags)") from None


def _resolve_parsed(fv: flags.FlagValues, environ: Mapping[str, str]) -> ClusterConfig:
    job_name = _flag(fv, "job_name")
    tf_config = environ.get("TF_CONFIG", "")
    if job_name not in (None, ""):
        if tf_config.strip():
            logging.warning("tf_psplugin: both --job_name and TF_CONFIG are set; "
                            "the flags take precedence and TF_CONFIG is ignored.")
        return from_flags(fv)
    given = [f"--{n}" for n in ("task_index",) + _HOST_FLAGS if _flag(fv, n) not in (None, "")]
    if given:
        raise ConfigError("--job_name", f"is missing but {', '.join(given)} "
                          f"{'was' if len(given) == 1 else 'were'} given",
                          "pass --job_name=chief|worker|ps|evaluator with the host flags, "
                          "or drop the flags and set TF_CONFIG")
    if tf_config.strip():
        return from_tf_config(tf_config)
    raise ConfigError("TF_CONFIG", "is not set and no --job_name flag was given, so this "
                      "process does not know its role",
                      f"export TF_CONFIG={_TF_CONFIG_EXAMPLE} or pass {_FLAGS_EXAMPLE}")


def resolve(
    argv: Optional[Sequence[str]] = None,
    environ: Optional[Mapping[str, str]] = None,
    flag_values: Optional[flags.FlagValues] = None,
) -> ClusterConfig:
    """Finds this process's cluster config: the main entry point.

    Precedence: if --job_name is given, the flags describe the cluster and
    TF_CONFIG is ignored (with a warning if it is also set). Otherwise
    TF_CONFIG is used. Any other cluster flag without --job_name is an error,
    as is having neither.

    Args:
      argv: command line, program name first (absl convention). Default
        `sys.argv`. Unknown flags are ignored (they belong to the script).
      environ: where to read TF_CONFIG; default `os.environ`.
      flag_values: the user's `FlagValues` holding the plugin flags (see
        `define_flags`), already parsed or parsed here from `argv`. Default:
        this module's `FLAGS`, re-parsed from `argv` on every call.

    Returns:
      The validated `ClusterConfig`.

    Raises:
      ConfigError: if neither source is given or the given one is invalid.
    """
    environ = os.environ if environ is None else environ
    if flag_values is None:
        with verbosity_lib.quiet_tf_info(verbosity_lib.ROOT_LOGGER):  # absl logs at INFO.
            FLAGS.unparse_flags()
        _parse(FLAGS, sys.argv if argv is None else argv, known_only=True)
        flag_values = FLAGS
    elif argv is not None or not flag_values.is_parsed():
        _parse(flag_values, sys.argv if argv is None else argv, known_only=True)
    return _resolve_parsed(flag_values, environ)


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


# --- Command line ----------------------------------------------------------

_USAGE = f"""usage: python -m tf_psplugin.config [flags]

Prints, as JSON, the role and cluster this process would get from its flags or
from the TF_CONFIG environment variable (flags win when --job_name is given).
Exits 2 with one line on stderr if the configuration is invalid.

flags:
  --job_name        {_FLAG_HELP['job_name']}
  --task_index      Index of this task within --job_name.
  --chief_hosts     {_FLAG_HELP['chief_hosts']}
  --worker_hosts    {_FLAG_HELP['worker_hosts']}
  --ps_hosts        {_FLAG_HELP['ps_hosts']}
  --evaluator_hosts {_FLAG_HELP['evaluator_hosts']}
"""


def is_help(argv: Sequence[str]) -> bool:
    """True if a command line (program name first) asks for help."""
    return any(arg in ("-h", "--help", "-help", "--helpshort", "--helpfull") for arg in argv[1:])


def resolve_strict(
    argv: Sequence[str], environ: Optional[Mapping[str, str]] = None
) -> ClusterConfig:
    """Like `resolve()`, for command lines that hold only the plugin's flags.

    Used by the `python -m tf_psplugin.config` and `python -m tf_psplugin.server`
    command lines: unknown flags and positional arguments are errors here.

    Raises:
      ConfigError: on any invalid input, including unknown flags.
    """
    with verbosity_lib.quiet_tf_info(verbosity_lib.ROOT_LOGGER):  # absl logs at INFO.
        FLAGS.unparse_flags()
    extra = _parse(FLAGS, argv, known_only=False)[1:]
    if extra:
        raise ConfigError("argv", f"unexpected argument {extra[0]!r}",
                          "pass only --flag=value arguments (or none, to use TF_CONFIG)")
    return _resolve_parsed(FLAGS, os.environ if environ is None else environ)


def main(argv: Optional[Sequence[str]] = None, environ: Optional[Mapping[str, str]] = None) -> int:
    """Runs the CLI; returns the exit code (0 ok, 2 invalid configuration)."""
    argv = list(sys.argv if argv is None else argv)
    if is_help(argv):
        sys.stdout.write(_USAGE)
        return 0
    try:
        config = resolve_strict(argv, environ)
    except ConfigError as e:
        sys.stderr.write(f"tf_psplugin.config: error: {e}\n")
        return 2
    sys.stdout.write(json.dumps(config.to_json_dict(), indent=2) + "\n")
    return 0

