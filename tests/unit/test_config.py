"""Unit tests for tf_psplugin.config: parsing, validation, promotion, CLI."""

import json
import os
import socket
import subprocess
import sys

import pytest
from absl import flags

from tf_psplugin.cluster import config as cfg
from tf_psplugin.cluster.config import ClusterConfig, ConfigError

A, B, C, D, E = ("h0:2222", "h1:2222", "h2:2222", "h3:2222", "h4:2222")


def tfc(cluster, task_type="worker", index=0, **extra):
    """A TF_CONFIG dict."""
    return {"cluster": cluster, "task": {"type": task_type, "index": index}, **extra}


def resolve_flags(*args, environ=None):
    return cfg.resolve(argv=["train.py", *args], environ=environ or {})


# --- Malformed inputs: (id, input kind, input, expected field, text in the fix) ---
# kind "tf": from_tf_config(input); kind "flags": resolve(argv=[prog, *input]).
W2P1 = {"worker": [A, B], "ps": [C]}
BAD_INPUTS = [
    ("json-syntax", "tf", "{not json", "TF_CONFIG", "JSON object"),
    ("json-list", "tf", "[1, 2]", "TF_CONFIG", "JSON object"),
    ("json-string", "tf", '"cluster"', "TF_CONFIG", "JSON object"),
    ("json-number", "tf", 42, "TF_CONFIG", "JSON object"),
    ("no-cluster", "tf", {"task": {"type": "ps", "index": 0}}, "TF_CONFIG.cluster", "JSON object"),
    ("cluster-list", "tf", {"cluster": [A], "task": {}}, "TF_CONFIG.cluster", '"chief"'),
    ("cluster-empty", "tf", tfc({}), "TF_CONFIG.cluster", '"worker"'),
    ("job-master", "tf", tfc({"master": [A], "ps": [B]}), "TF_CONFIG.cluster.master", "chief"),
    ("job-typo", "tf", tfc({"workers": [A], "ps": [B]}), "TF_CONFIG.cluster.workers", "worker"),
    ("hosts-string", "tf", tfc({"worker": [A], "ps": B}), "TF_CONFIG.cluster.ps", '["host:port"'),
    ("hosts-dict", "tf", tfc({"worker": {"0": A}, "ps": [B]}), "TF_CONFIG.cluster.worker", "["),
    ("hosts-empty", "tf", tfc({"worker": [A], "ps": []}), "TF_CONFIG.cluster.ps", "host:port"),
    ("host-int", "tf", tfc({"worker": [A], "ps": [B, 2222]}), "TF_CONFIG.cluster.ps[1]",
     "host:port"),
    ("host-none", "tf", tfc({"worker": [None], "ps": [B]}), "TF_CONFIG.cluster.worker[0]",
     "host:port"),
    ("no-port", "tf", tfc({"worker": [A], "ps": ["h1"]}), "TF_CONFIG.cluster.ps[0]", "h1:2222"),
    ("port-zero", "tf", tfc({"worker": ["h0:0"], "ps": [B]}), "TF_CONFIG.cluster.worker[0]",
     "1 to 65535"),
    ("port-too-big", "tf", tfc({"worker": [A], "ps": ["h1:70000"]}), "TF_CONFIG.cluster.ps[0]",
     "1 to 65535"),
    ("port-name", "tf", tfc({"worker": [A], "ps": ["h1:grpc"]}), "TF_CONFIG.cluster.ps[0]",
     "host:port"),
    ("empty-host", "tf", tfc({"worker": [":2222"], "ps": [B]}), "TF_CONFIG.cluster.worker[0]",
     "host:port"),
    ("empty-address", "tf", tfc({"worker": [""], "ps": [B]}), "TF_CONFIG.cluster.worker[0]",
     "host:port"),
    ("ipv6-no-brackets", "tf", tfc({"worker": ["::1:2222"], "ps": [B]}),
     "TF_CONFIG.cluster.worker[0]", "brackets"),
    ("ipv6-bad", "tf", tfc({"worker": ["[zz::q]:2222"], "ps": [B]}),
     "TF_CONFIG.cluster.worker[0]", "[::1]:2222"),
    ("url-scheme", "tf", tfc({"worker": ["grpc://h0:2222"], "ps": [B]}),
     "TF_CONFIG.cluster.worker[0]", "drop the scheme"),
    ("whitespace", "tf", tfc({"worker": ["h0 :2222"], "ps": [B]}), "TF_CONFIG.cluster.worker[0]",
     "remove the spaces"),
    ("bad-host-chars", "tf", tfc({"worker": ["h/0:2222"], "ps": [B]}),
     "TF_CONFIG.cluster.worker[0]", "host:port"),
    ("two-chiefs", "tf", tfc({"chief": [A, B], "ps": [C]}, "chief"), "TF_CONFIG.cluster.chief",
     "keep one"),
    ("two-evaluators", "tf", tfc({"chief": [A], "ps": [B], "evaluator": [C, D]}, "chief"),
     "TF_CONFIG.cluster.evaluator", "keep one"),
    ("no-ps", "tf", tfc({"chief": [A], "worker": [B]}), "TF_CONFIG.cluster.ps", '"ps"'),
    ("only-ps", "tf", tfc({"ps": [A]}, "ps"), "TF_CONFIG.cluster.worker", "first worker"),
    ("dup-across-jobs", "tf", tfc({"worker": [A, B], "ps": [B]}), "TF_CONFIG.cluster.ps[0]",
     "own host:port"),
    ("dup-in-job", "tf", tfc({"worker": [A, A], "ps": [B]}), "TF_CONFIG.cluster.worker[1]",
     "own host:port"),
    ("dup-case", "tf", tfc({"worker": ["H0:2222"], "ps": ["h0:2222"]}), "TF_CONFIG.cluster.ps[0]",
     "own host:port"),
    ("no-task", "tf", {"cluster": W2P1}, "TF_CONFIG.task", '"task"'),
    ("task-list", "tf", {"cluster": W2P1, "task": ["worker", 0]}, "TF_CONFIG.task", '"type"'),
    ("no-type", "tf", {"cluster": W2P1, "task": {"index": 0}}, "TF_CONFIG.task.type", '"type"'),
    ("type-master", "tf", tfc(W2P1, "master"), "TF_CONFIG.task.type", "chief"),
    ("type-typo", "tf", tfc(W2P1, "wroker"), "TF_CONFIG.task.type", "worker"),
    ("type-int", "tf", tfc(W2P1, 1), "TF_CONFIG.task.type", "worker"),
    ("no-index", "tf", {"cluster": W2P1, "task": {"type": "ps"}}, "TF_CONFIG.task.index",
     '"index": 0'),
    ("index-bool", "tf", tfc(W2P1, "ps", True), "TF_CONFIG.task.index", "JSON number"),
    ("index-string", "tf", tfc(W2P1, "ps", "0"), "TF_CONFIG.task.index", "JSON number"),
    ("index-float", "tf", tfc(W2P1, "ps", 0.0), "TF_CONFIG.task.index", "JSON number"),
    ("index-null", "tf", tfc(W2P1, "ps", None), "TF_CONFIG.task.index", "JSON number"),
    ("index-negative", "tf", tfc(W2P1, "ps", -1), "TF_CONFIG.task.index", ">= 0"),
    ("index-range", "tf", tfc(W2P1, "worker", 2), "TF_CONFIG.task.index", "count from 0"),
    ("ps-index-range", "tf", tfc(W2P1, "ps", 1), "TF_CONFIG.task.index", "count from 0"),
    ("evaluator-index", "tf", tfc(dict(W2P1, evaluator=[D]), "evaluator", 1),
     "TF_CONFIG.task.index", '"index": 0'),
    ("chief-without-chief", "tf", tfc(W2P1, "chief"), "TF_CONFIG.task.type",
     '"type": "worker", "index": 0'),
    ("worker-without-workers", "tf", tfc({"chief": [A], "ps": [B]}, "worker"),
     "TF_CONFIG.task.type", '"worker"'),
    ("rpc-layer-int", "tf", tfc(W2P1, rpc_layer=1), "TF_CONFIG.rpc_layer", "grpc"),
    # Flags.
    ("index-without-job", "flags", ["--task_index=0"], "--job_name", "--job_name="),
    ("hosts-without-job", "flags", ["--ps_hosts=" + A], "--job_name", "TF_CONFIG"),
    ("empty-job", "flags", ["--job_name=", "--worker_hosts=" + A], "--job_name", "--job_name="),
    ("job-master", "flags", ["--job_name=master", "--worker_hosts=" + A, "--ps_hosts=" + B],
     "--job_name", "chief"),
    ("job-ps-no-ps-hosts", "flags", ["--job_name=ps", "--worker_hosts=" + A], "--ps_hosts",
     "--ps_hosts="),
    ("job-chief-no-chief-hosts", "flags",
     ["--job_name=chief", "--worker_hosts=" + A, "--ps_hosts=" + B], "--job_name",
     "--job_name=worker --task_index=0"),
    ("job-worker-no-workers", "flags", ["--job_name=worker", "--chief_hosts=" + A,
                                        "--ps_hosts=" + B], "--job_name", "--worker_hosts="),
    ("no-workers-no-chief", "flags", ["--job_name=ps", "--ps_hosts=" + A], "--worker_hosts",
     "first worker"),
    ("index-not-int", "flags", ["--job_name=ps", "--task_index=abc", "--ps_hosts=" + A],
     "--task_index", "flag"),
    ("index-negative", "flags", ["--job_name=ps", "--task_index=-1", "--ps_hosts=" + A,
                                 "--worker_hosts=" + B], "--task_index", ">= 0"),
    ("index-range", "flags", ["--job_name=ps", "--task_index=1", "--ps_hosts=" + A,
                              "--worker_hosts=" + B], "--task_index", "count from 0"),
    ("index-missing-2-workers", "flags", ["--job_name=worker", "--worker_hosts=" + A + "," + B,
                                          "--ps_hosts=" + C], "--task_index", "--task_index=N"),
    ("empty-entry", "flags", ["--job_name=ps", "--ps_hosts=" + A, "--worker_hosts=" + B + ",," + C],
     "--worker_hosts", "host:port"),
    ("trailing-comma", "flags", ["--job_name=ps", "--ps_hosts=" + A + ",", "--worker_hosts=" + B],
     "--ps_hosts", "host:port"),
    ("flag-no-port", "flags", ["--job_name=ps", "--ps_hosts=h0", "--worker_hosts=" + B],
     "--ps_hosts", "h0:2222"),
    ("flag-ipv6", "flags", ["--job_name=ps", "--ps_hosts=::1:2222", "--worker_hosts=" + B],
     "--ps_hosts", "brackets"),
    ("two-chief-hosts", "flags",
     ["--job_name=ps", "--ps_hosts=" + A, "--chief_hosts=" + B + "," + C],
     "--chief_hosts", "keep one"),
    ("two-evaluator-hosts", "flags", ["--job_name=ps", "--ps_hosts=" + A, "--worker_hosts=" + B,
                                      "--evaluator_hosts=" + C + "," + D], "--evaluator_hosts",
     "keep one"),
    ("evaluator-index-1", "flags", ["--job_name=evaluator", "--task_index=1", "--ps_hosts=" + A,
                                    "--worker_hosts=" + B], "--task_index", "--task_index=0"),
    ("flag-duplicate", "flags", ["--job_name=ps", "--ps_hosts=" + A, "--worker_hosts=" + A],
     "--ps_hosts", "own host:port"),
    ("nothing", "flags", [], "TF_CONFIG", "--job_name="),
]


@pytest.mark.parametrize(
    "kind,value,field,fix_text",
    [case[1:] for case in BAD_INPUTS],
    ids=[f"{case[1]}-{case[0]}" for case in BAD_INPUTS],
)
def test_malformed_input_names_field_and_fix(kind, value, field, fix_text):
    with pytest.raises(ConfigError) as info:
        if kind == "tf":
            cfg.from_tf_config(value if isinstance(value, (str, int)) else json.dumps(value))
        else:
            resolve_flags(*value)
    err = info.value
    assert err.field == field, str(err)
    assert fix_text in err.fix, str(err)
    assert str(err) == f"{err.field}: {err.problem}. Fix: {err.fix}"
    assert "\n" not in str(err) and len(str(err)) < 400


def test_table_is_big_enough():
    assert len(BAD_INPUTS) >= 35
    assert len({(case[1], case[0]) for case in BAD_INPUTS}) == len(BAD_INPUTS)


def test_dict_input_is_validated_like_json():
    with pytest.raises(ConfigError, match=r"^TF_CONFIG\.task\.index: "):
        cfg.from_tf_config(tfc(W2P1, "ps", True))


def test_config_error_is_a_value_error_with_attributes():
    err = ConfigError("--worker_hosts", "entry 0 is empty.", "pass host:port.")
    assert isinstance(err, ValueError)
    assert (err.field, err.problem, err.fix) == (
        "--worker_hosts", "entry 0 is empty", "pass host:port")
    assert str(err) == "--worker_hosts: entry 0 is empty. Fix: pass host:port"


# --- Chief promotion -----------------------------------------------------------


@pytest.mark.parametrize("index,task", [(0, ("chief", 0)), (1, ("worker", 0)), (2, ("worker", 1))])
def test_first_worker_becomes_chief_in_tf_config(index, task):
    config = cfg.from_tf_config(tfc({"worker": [A, B, C], "ps": [D]}, "worker", index))
    assert (config.task_type, config.task_index) == task
    assert config.chief_promoted_from_worker
    assert dict(config.cluster) == {"chief": (A,), "worker": (B, C), "ps": (D,)}
    assert config.source == "TF_CONFIG"


@pytest.mark.parametrize("index,task", [(0, ("chief", 0)), (1, ("worker", 0)), (2, ("worker", 1))])
def test_first_worker_becomes_chief_with_flags(index, task):
    config = resolve_flags("--job_name=worker", f"--task_index={index}",
                           f"--worker_hosts={A},{B},{C}", f"--ps_hosts={D}")
    assert (config.task_type, config.task_index) == task
    assert config.chief_promoted_from_worker and config.source == "flags"
    assert config.chief_address == A
    assert config.training_cluster == {"chief": [A], "worker": [B, C], "ps": [D]}


def test_single_worker_promoted_leaves_no_worker_job():
    config = resolve_flags("--job_name=ps", f"--worker_hosts={A}", f"--ps_hosts={B}")
    assert config.training_cluster == {"chief": [A], "ps": [B]}
    assert config.num_workers == 0 and config.num_ps == 1 and config.task_address == B


def test_explicit_chief_is_not_promoted():
    config = cfg.from_tf_config(tfc({"chief": [A], "worker": [B, C], "ps": [D]}, "worker", 1))
    assert (config.task_type, config.task_index, config.task_address) == ("worker", 1, C)
    assert not config.chief_promoted_from_worker


def test_single_worker_without_index_defaults_to_zero():
    config = resolve_flags("--job_name=worker", f"--worker_hosts={A}", f"--ps_hosts={B}")
    assert config.is_chief


# --- Evaluator -------------------------------------------------------------------


def test_evaluator_excluded_from_training_cluster():
    config = cfg.from_tf_config(tfc({"chief": [A], "worker": [B], "ps": [C], "evaluator": [D]},
                                    "evaluator", 0))
    assert config.is_evaluator and not config.is_chief and not config.is_server
    assert config.has_evaluator and config.task_address == D
    assert "evaluator" not in config.training_cluster
    assert sorted(config.cluster_spec().jobs) == ["chief", "ps", "worker"]
    resolver = config.cluster_resolver()
    assert (resolver.task_type, resolver.task_id, resolver.rpc_layer) == ("evaluator", 0, "grpc")
    assert "evaluator" not in resolver.cluster_spec().as_dict()
    assert config.tf_config()["cluster"]["evaluator"] == [D]


def test_evaluator_may_be_absent_from_cluster():
    config = resolve_flags("--job_name=evaluator", f"--worker_hosts={A}", f"--ps_hosts={B}")
    assert config.is_evaluator and config.task_address is None and not config.has_evaluator
    assert config.to_json_dict()["evaluator"] is None


# --- Round trips, immutability, local() -----------------------------------------


def test_tf_config_round_trip_for_every_task():
    base = cfg.from_tf_config(tfc({"worker": [A, B, C], "ps": [D], "evaluator": [E]}, "ps", 0))
    for job, hosts in base.cluster.items():
        for i in range(len(hosts)):
            task = base.for_task(job, i)
            again = cfg.from_tf_config(json.dumps(task.tf_config()))
            assert again == task and hash(again) == hash(task)
            assert (again.task_type, again.task_index, again.task_address) == (job, i, hosts[i])


def test_tf_config_round_trip_through_tensorflow_resolver():
    import tensorflow as tf

    config = cfg.from_tf_config(tfc({"chief": [A], "worker": [B], "ps": [C]}, "worker", 0))
    resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TF_CONFIG", json.dumps(config.tf_config()))
        assert resolver.cluster_spec().as_dict() == config.cluster_spec().as_dict()
        assert (resolver.task_type, resolver.task_id) == ("worker", 0)


def test_config_is_immutable_and_hashable():
    config = cfg.local(1, 1)
    with pytest.raises(TypeError):
        config.cluster["ps"] = ("x:1",)
    with pytest.raises(AttributeError):
        config.task_index = 3
    assert config.training_cluster is not config.training_cluster  # Fresh copies.
    assert len({config, config.for_task("chief", 0)}) == 1


def test_for_task_validates():
    config = cfg.local(2, 1)
    assert config.for_task("worker", 1).task_address == config.cluster["worker"][1]
    with pytest.raises(ConfigError) as info:
        config.for_task("worker", 2)
    assert info.value.field == "task_index"
    with pytest.raises(ConfigError) as info:
        config.for_task("evaluator", 1)
    assert info.value.field == "task_index"


def test_explicit_construction_is_validated():
    config = ClusterConfig(cluster={"chief": [A], "ps": [B]}, task_type="ps", task_index=0)
    assert isinstance(config.cluster["chief"], tuple) and config.source == "explicit"
    for kwargs, field in [
        (dict(cluster={"worker": [A], "ps": [B]}, task_type="ps", task_index=0), "cluster.chief"),
        (dict(cluster={"chief": [A], "ps": B}, task_type="ps", task_index=0), "cluster.ps"),
        (dict(cluster={"chief": [A], "ps": [B], "boss": [C]}, task_type="ps", task_index=0),
         "cluster.boss"),
        (dict(cluster={"chief": [A], "ps": [B]}, task_type="ps", task_index=True), "task_index"),
        (dict(cluster={"chief": [A], "ps": [B]}, task_type="pss", task_index=0), "task_type"),
        (dict(cluster=[A], task_type="ps", task_index=0), "cluster"),
    ]:
        with pytest.raises(ConfigError) as info:
            ClusterConfig(**kwargs)
        assert info.value.field == field


def test_local_picks_distinct_bindable_ports():
    config = cfg.local(2, 2, evaluator=True)
    addresses = [a for hosts in config.cluster.values() for a in hosts]
    assert len(addresses) == len(set(addresses)) == 6
    assert config.is_chief and config.source == "explicit" and config.num_workers == 2
    for address in addresses:
        host, port = address.rsplit(":", 1)
        assert host == "127.0.0.1"
        with socket.socket() as s:
            s.bind((host, int(port)))


def test_local_ipv6_and_explicit_ports():
    config = cfg.local(1, 1, host="::1", ports=[1001, 1002, 1003])
    assert config.training_cluster == {"chief": ["[::1]:1001"], "worker": ["[::1]:1002"],
                                       "ps": ["[::1]:1003"]}
    with pytest.raises(ConfigError) as info:
        cfg.local(1, 1, ports=[1, 2])
    assert info.value.field == "ports"
    with pytest.raises(ConfigError) as info:
        cfg.local(1, 0)
    assert info.value.field == "num_ps"


def test_valid_address_forms():
    config = cfg.from_tf_config(tfc({"chief": ["[::1]:1"], "worker": ["my-host.svc.local:65535"],
                                     "ps": ["10.0.0.1:2222", "ps_1:3"]}, "ps", 1))
    assert config.task_address == "ps_1:3" and config.rpc_layer == "grpc"


def test_extra_tf_config_keys_are_ignored_and_rpc_layer_kept():
    config = cfg.from_tf_config(tfc(W2P1, "ps", 0, environment="cloud", job={"x": 1},
                                    rpc_layer="grpc+verbs"))
    assert config.rpc_layer == "grpc+verbs"
    assert config.cluster_resolver().rpc_layer == "grpc+verbs"


def test_to_json_dict():
    config = resolve_flags("--job_name=worker", "--task_index=1", f"--worker_hosts={A},{B}",
                           f"--ps_hosts={C}", f"--evaluator_hosts={D}")
    out = json.loads(json.dumps(config.to_json_dict()))
    assert out["role"] == "worker" and out["task"] == "worker:0" and out["task_address"] == B
    assert out["is_chief"] is False and out["chief"] == A
    assert out["chief_promoted_from_worker"] is True and out["source"] == "flags"
    assert out["training_cluster"] == {"chief": [A], "worker": [B], "ps": [C]}
    assert out["evaluator"] == D
    assert out["tf_config"]["task"] == {"type": "worker", "index": 0}


# --- resolve() precedence and flags plumbing ---------------------------------------


def test_resolve_uses_tf_config_without_flags():
    environ = {"TF_CONFIG": json.dumps(tfc(W2P1, "ps", 0))}
    config = cfg.resolve(argv=["train.py", "--user_flag=1"], environ=environ)
    assert config.source == "TF_CONFIG" and config.task_type == "ps"


def test_resolve_flags_win_over_tf_config():
    environ = {"TF_CONFIG": json.dumps(tfc(W2P1, "ps", 0))}
    config = resolve_flags("--job_name=worker", f"--worker_hosts={A}", f"--ps_hosts={C}",
                           environ=environ)
    assert config.source == "flags" and config.is_chief


def test_resolve_ignores_blank_tf_config_and_reparses_each_call():
    with pytest.raises(ConfigError) as info:
        cfg.resolve(argv=["p"], environ={"TF_CONFIG": "  "})
    assert info.value.field == "TF_CONFIG"
    resolve_flags("--job_name=ps", f"--worker_hosts={A}", f"--ps_hosts={B}")
    with pytest.raises(ConfigError):  # No leftovers from the previous call.
        cfg.resolve(argv=["p"], environ={})


def test_define_flags_on_user_flag_values_skips_existing():
    fv = flags.FlagValues()
    flags.DEFINE_string("job_name", "ps", "the user's own flag", flag_values=fv)
    flags.DEFINE_integer("steps", 10, "another user flag", flag_values=fv)
    cfg.define_flags(fv)
    cfg.define_flags(fv)  # Idempotent.
    assert fv["job_name"].help == "the user's own flag"
    fv(["train.py", "--steps=3", f"--worker_hosts={A}", f"--ps_hosts={B}"])
    config = cfg.resolve(environ={}, flag_values=fv)
    assert config.task_type == "ps" and config.source == "flags" and fv.steps == 3


def test_from_flags_with_user_list_flag():
    fv = flags.FlagValues()
    flags.DEFINE_list("worker_hosts", [A, B], "list-typed", flag_values=fv)
    cfg.define_flags(fv)
    fv(["train.py", "--job_name=worker", "--task_index=1", f"--ps_hosts={C}"])
    assert cfg.from_flags(fv).task_address == B


# --- CLI ---------------------------------------------------------------------------


@pytest.mark.parametrize("argv", [
    ["--bogus"], ["--job_name"], ["--task_index=1.5"], ["positional"], ["--", "x"],
    ["--flagfile=/nonexistent/flags.txt"], ["-"], ["--job_name=ps", "--ps_hosts=\u00e9:1"],
    ["--job_name=ps", "--ps_hosts=a:1", "--worker_hosts=a:1"], ["--job_name=\x01"],
    ["--task_index", "--job_name=ps"], ["--ps_hosts=[::1]:2", "--job_name=ps", "--chief_hosts=c"],
])
def test_cli_main_rejects_garbage_with_one_line(argv, capsys):
    assert cfg.main(["tf_psplugin.config", *argv], environ={}) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.count("\n") == 1 and err.startswith("tf_psplugin.config: error: ")
    assert ". Fix: " in err


def test_cli_main_prints_json(capsys):
    environ = {"TF_CONFIG": json.dumps(tfc(W2P1, "worker", 1))}
    assert cfg.main(["tf_psplugin.config"], environ=environ) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["task"] == "worker:0" and out["source"] == "TF_CONFIG"
    assert cfg.main(["tf_psplugin.config", "--help"], environ={}) == 0
    assert "--worker_hosts" in capsys.readouterr().out


# Real subprocesses (the way users run it). They are started concurrently once
# per module because each one imports TensorFlow (seconds on a 2-core box).
CLI_CASES = {
    "flags-ok": (["--job_name=worker", "--task_index=1", f"--worker_hosts={A},{B}",
                  f"--ps_hosts={C}"], None, 0),
    "tf-config-ok": ([], json.dumps(tfc(W2P1, "ps", 0)), 0),
    "garbage-flag": (["--no_such_flag=1"], None, 2),
    "bad-json": ([], "{oops", 2),
}


@pytest.fixture(scope="module")
def cli_results():
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    env.pop("TF_CONFIG", None)
    procs = {}
    for name, (args, tf_config, _) in CLI_CASES.items():
        case_env = dict(env, **({"TF_CONFIG": tf_config} if tf_config else {}))
        procs[name] = subprocess.Popen(
            [sys.executable, "-m", "tf_psplugin.config", *args], env=case_env,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    results = {}
    try:
        for name, proc in procs.items():
            out, err = proc.communicate(timeout=400)
            results[name] = (proc.returncode, out, err)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return results


@pytest.mark.timeout(450)
@pytest.mark.parametrize("name", sorted(CLI_CASES))
def test_cli_subprocess(name, cli_results):
    code, out, err = cli_results[name]
    assert code == CLI_CASES[name][2], (out, err)
    assert "Traceback" not in out + err
    if code == 0:
        assert json.loads(out)["tf_config"]["task"]
    else:
        assert out == ""
        assert err.count("\n") == 1, err
        assert err.startswith("tf_psplugin.config: error: ") and ". Fix: " in err
