"""How the chief joins the training cluster: resolve, validate, wait, connect.

Why this module exists: stock ParameterServerStrategy connects in its
constructor and reports problems late and vaguely -- a cluster spec that
can never work waits out a connection timeout, a missing task surfaces after
minutes as an UnavailableError naming nobody, and its device filters hide
workers from one another, which makes collectives between them impossible.
The strategy calls, in order: `resolve_cluster` (flags/TF_CONFIG or a
resolver, validated before any connection, chief only), `wait_for_tasks`
(one TCP probe per task, one error naming every missing task), and
`connect` (device filters that let workers see each other, the collective
leader configured before connecting).
"""

import os
from typing import Optional


from tf_psplugin._internal.tf_internal import context, parameter_server_strategy_v2, remote, server_lib
from tf_psplugin.cluster import config as config_lib
from tf_psplugin.cluster import liveness
from tf_psplugin.errors import RESTART_EXIT_CODE, StrategyError, TasksUnreachableError  # noqa: F401  (see errors.py)


def connect(cluster_resolver, coordinator_name: str, workers_see_each_other: bool) -> None:
    """Connects this process (the coordinator) to the cluster, like stock PSS.

    Stock PSS gives workers device filters that hide other workers, which
    makes collectives between them impossible; with `workers_see_each_other`
    they see each other and the eager context is told who leads collective
    groups before connecting (it cannot be changed after). Both measured to
    work on TF 2.15.1 and 2.21.0.

    Mirrors `ParameterServerStrategyV2._connect_to_cluster` (TF 2.15.1 and
    2.21.0: device filters, the two environment variables, connect, server-def
    retries, `ensure_initialized`). Differences: the worker filter may include
    `/job:worker`, collective ops are configured before connecting, the
    replica gauges (monitoring only) are not set, the coordinator name is
    always "chief" (TF's check against "worker"/"ps" is moot), and
    `_num_workers`/`_num_ps` are set by the strategy's `_connect_to_cluster`.

    Args:
        cluster_resolver: The training cluster (chief, workers, PS).
        coordinator_name: This process's job name ("chief").
        workers_see_each_other: True for the AllReduce group.

    Raises:
        StrategyError: if this process already ran a TensorFlow op, after
            which collectives can no longer be configured.
    """
    spec = cluster_resolver.cluster_spec()
    num_workers = len(spec.as_dict().get("worker", ()))
    num_ps = len(spec.as_dict().get("ps", ()))
    filters = server_lib.ClusterDeviceFilters()
    worker_view = ["/job:ps", f"/job:{coordinator_name}"]
    if workers_see_each_other:
        worker_view.append("/job:worker")
    for i in range(num_workers):
        filters.set_device_filters("worker", i, worker_view)
    for i in range(num_ps):
        filters.set_device_filters("ps", i, ["/job:worker", f"/job:{coordinator_name}"])
    # What stock ParameterServerStrategyV2.__init__ sets before connecting.
    os.environ["TF_ENABLE_EAGER_CLIENT_STREAMING_ENQUEUE"] = "False"
    os.environ["TF_PS_DISABLE_ASYNC_EXECUTOR_GLOBALLY"] = "True"
    if workers_see_each_other:
        try:
            context.context().configure_collective_ops(
                collective_leader="/job:worker/replica:0/task:0")
        except RuntimeError as e:  # "Collective ops must be configured at program startup"
            raise StrategyError(
                "HybridParameterServerStrategy must be constructed before this process "
                f"runs any TensorFlow op ({e}). Fix: build the strategy right after "
                "tf_psplugin.start_server(), before creating tensors, datasets or "
                "models (tf.io.gfile calls are fine).") from None
    remote.connect_to_cluster(spec, job_name=coordinator_name,
                              protocol=cluster_resolver.rpc_layer or "grpc",
                              cluster_device_filters=filters)
    # As stock PSS: retry setting the server def if a task is preempted while
    # the chief connects (ParameterServerStrategyV2._connect_to_cluster, the
    # last two statements, TF 2.15.1 and 2.21.0; the retry count is TF's).
    context.set_server_def_retries(parameter_server_strategy_v2._SET_SERVER_DEF_RETRIES)  # pylint: disable=protected-access
    context.ensure_initialized()


def wait_for_tasks(cluster_spec, timeout_seconds: float, poll_seconds: float = 0.5) -> None:
    """Waits until every worker and PS task accepts TCP connections.

    TensorFlow's own connection retries for minutes and then fails with an
    UnavailableError that does not say which task is missing; checking first
    gives one clear error.

    Args:
        cluster_spec: The training cluster.
        timeout_seconds: Give up after this long.
        poll_seconds: Interval between attempts.

    Raises:
        TasksUnreachableError: naming every task that never answered
            (a `StrategyError`; uncaught, exit status 138: retry me).
    """
    addresses = {f"{job}:{index}": address for job in ("worker", "ps")
                 for index, address in enumerate(cluster_spec.as_dict().get(job, []))}
    pending = liveness.wait_for_listeners(addresses, timeout_seconds, poll_seconds,
                                              connect_timeout=2.0)
    if pending:
        missing = ", ".join(f"{role} at {addresses[role]}" for role in pending)
        raise TasksUnreachableError(
            f"cannot reach {missing} after {timeout_seconds:g} s; the chief exits with status "
            f"{RESTART_EXIT_CODE} so that a restart policy (TFJob restartPolicy: "
            "ExitCode, the launcher's --restart-failed) retries it while tasks are still being "
            "scheduled. Fix: start those tasks (they run the same script, which calls "
            "tf_psplugin.start_server() first, or `python -m tf_psplugin.server`), check their "
            "addresses in TF_CONFIG / --worker_hosts / --ps_hosts and the firewall, or raise "
            "connect_timeout_seconds.")


def resolve_cluster(cluster_resolver, config: Optional[config_lib.ClusterConfig]):
    """The chief's cluster resolver, validated; raises StrategyError on any other task."""
    if cluster_resolver is not None:
        if cluster_resolver.task_type not in (None, "chief"):
            raise StrategyError(_not_chief_message(cluster_resolver.task_type,
                                                   cluster_resolver.task_id))
        # Before connecting: a spec that can never work fails now, not after
        # connect_timeout_seconds of "cannot reach".
        try:
            config_lib.validate_cluster_spec(cluster_resolver.cluster_spec())
        except config_lib.ConfigError as e:
            raise StrategyError(f"cannot use the cluster resolver: {e}") from None
        return cluster_resolver
    if config is None:
        try:
            config = config_lib.resolve()
        except config_lib.ConfigError as e:
            raise StrategyError(f"cannot resolve the cluster: {e}") from None
    if config.task_type != "chief":
        raise StrategyError(_not_chief_message(config.task_type, config.task_index))
    return config.cluster_resolver()


def _not_chief_message(task_type, task_id) -> str:
    if task_type in ("worker", "ps"):
        fix = ("call `tf_psplugin.start_server()` first in the script: on a worker or PS task "
               "it starts the TF server and blocks, and only the chief goes on to build the "
               "strategy")
    elif task_type == "evaluator":
        fix = ("the evaluator never joins the training cluster; run `tf_psplugin.run_evaluator"
               "(...)` there instead of building the strategy")
    else:
        fix = "build the strategy only in the chief process"
    return (f"HybridParameterServerStrategy must be constructed on the chief (the coordinator), "
            f"but this process is {task_type}:{task_id}. Fix: {fix}.")
