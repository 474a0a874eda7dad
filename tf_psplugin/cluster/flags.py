"""The cluster flags, and `resolve`: which task this process is, from flags or TF_CONFIG.

Why this module exists: TF1-era schedulers and scripts describe the cluster
with `--job_name --task_index --ps_hosts --worker_hosts`, newer ones with
`TF_CONFIG`. This module owns the absl flags (defined on the plugin's own
`FLAGS`, or on the user's `FlagValues` with `define_flags`), turns them into
a `ClusterConfig` with the same validation and chief promotion as
`config.from_tf_config`, and decides between the two forms (`resolve`:
flags first, then TF_CONFIG). The plugin's commands parse their whole
command line here too (`resolve_strict`, `is_help`).
"""

import os
import re
import sys
from typing import Any, List, Mapping, Optional, Sequence

from absl import flags
from absl import logging

from tf_psplugin._internal import verbosity as verbosity_lib
from tf_psplugin.cluster.config import (
    SERVER_JOBS,
    TF_CONFIG_EXAMPLE,
    ClusterConfig,
    ConfigError,
    FieldNames,
    build_config,
    check_role,
    from_tf_config,
    validate_cluster,
)

__all__ = ["FLAGS", "define_flags", "from_flags", "resolve", "resolve_strict", "is_help"]

_FLAGS_EXAMPLE = "--job_name=worker --task_index=0 --worker_hosts=h1:2222 --ps_hosts=h2:2222"

FLAG_HELP = {
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
    for name, help_text in FLAG_HELP.items():
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
    names = FieldNames("flags")
    job_name = _flag(fv, "job_name")
    if job_name in (None, ""):
        raise ConfigError("--job_name", "is missing",
                          f"pass the task's role, e.g. {_FLAGS_EXAMPLE}")
    task_type = check_role(job_name, names)
    cluster = {}
    for name in _HOST_FLAGS:
        hosts = _split_hosts(_flag(fv, name), name)
        if hosts:
            cluster[name[: -len("_hosts")]] = hosts
    validate_cluster(cluster, names)  # Address errors first: they explain count errors.
    index = _flag(fv, "task_index")
    if isinstance(index, str):
        if not index.strip().lstrip("-").isdigit():
            raise ConfigError("--task_index", f"must be an integer, got {index!r}",
                              "pass --task_index=0 (or another task number)")
        index = int(index)
    if index is None:
        count = len(cluster.get(task_type, ()))
        if task_type in SERVER_JOBS and count > 1:
            raise ConfigError("--task_index", f"is missing and --{task_type}_hosts lists {count} "
                              "tasks", f"pass --task_index=N with N from 0 to {count - 1}")
        index = 0
    if index < 0:
        raise ConfigError("--task_index", f"is {index}, negative", "use an index >= 0")
    return build_config(cluster, task_type, index, "grpc", names)


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
                      f"export TF_CONFIG={TF_CONFIG_EXAMPLE} or pass {_FLAGS_EXAMPLE}")


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
