"""benchmarks.profile_stats: self times, categories, RPC counts, TCP bytes per task pair.

Pure functions on plain values: no TensorFlow, no processes.
"""

import json

import pytest

from benchmarks import profile_stats as ps

# Two real socket entries of `ss -tinpH state established` (shortened
# tcp_info), both ends of one loopback connection, plus a foreign process.
SS_BEFORE = """\
0      0      [::ffff:127.0.0.1]:40001 [::ffff:127.0.0.1]:52000 users:(("python",pid=11,fd=11))
\t bbr wscale:10,10 rto:212 mss:32768 bytes_sent:150 bytes_acked:100 bytes_received:1000 segs_out:2
0      0      [::ffff:127.0.0.1]:52000 [::ffff:127.0.0.1]:40001 users:(("python",pid=22,fd=9))
\t bbr wscale:10,10 rto:212 mss:32768 bytes_sent:1000 bytes_acked:1000 bytes_received:100 segs_out:3
0      0      127.0.0.1:6000 127.0.0.1:6001 users:(("other",pid=99,fd=3))
\t cubic bytes_acked:5 bytes_received:7
"""
SS_AFTER = """\
0      0      [::ffff:127.0.0.1]:40001 [::ffff:127.0.0.1]:52000 users:(("python",pid=11,fd=11))
\t bbr wscale:10,10 rto:212 mss:32768 bytes_sent:450 bytes_acked:400 bytes_received:9000 segs_out:2
0      0      [::ffff:127.0.0.1]:52000 [::ffff:127.0.0.1]:40001 users:(("python",pid=22,fd=9))
\t bbr wscale:10,10 rto:212 mss:32768 bytes_sent:9000 bytes_acked:9000 bytes_received:400 segs_out:3
0      0      [::ffff:127.0.0.1]:52010 [::ffff:127.0.0.1]:40001 users:(("python",pid=33,fd=9))
\t bbr bytes_acked:70 bytes_received:30
0      0      [::ffff:127.0.0.1]:40001 [::ffff:127.0.0.1]:52010 users:(("python",pid=11,fd=12))
\t bbr bytes_acked:30 bytes_received:70
0      0      127.0.0.1:6000 127.0.0.1:6001 users:(("other",pid=99,fd=3))
\t cubic bytes_acked:50 bytes_received:70
"""


def test_self_times_subtract_children_and_add_up_to_busy_time():
    # A function (0-100) holding two ops (10-30, 40-90), the second holding
    # one (50-60); then an op after the function (120-130).
    events = [(40, 50, "b"), (0, 100, "fn"), (10, 20, "a"), (50, 10, "c"), (120, 10, "d")]
    got = dict(ps.self_times(events))
    assert got == {"fn": 30, "a": 20, "b": 40, "c": 10, "d": 10}
    assert sum(got.values()) == 100 + 10  # busy time: the function plus the op after it


def test_self_times_clip_a_child_that_outlives_its_parent():
    got = ps.self_times([(0, 10, "p"), (5, 20, "late")])
    assert dict(got) == {"p": 5, "late": 5}


def test_aggregate_keys_by_op_type_over_lines():
    lines = [[(0, 10, "dense/MatMul:MatMul"), (20, 5, "dense_1/MatMul:MatMul")],
             [(0, 7, "tensorflow::EagerService::Enqueue")]]
    got = ps.aggregate(lines)
    assert got == {"MatMul": [15, 2], "tensorflow::EagerService::Enqueue": [7, 1]}


@pytest.mark.parametrize("name,task,category", [
    # Names as TF 2.15's traces of the benchmark's tasks record them.
    ("CollectiveReduceV2", "worker", "collective"), ("Loop", "worker", "collective"),
    ("CollectiveExecutor::RunClosure", "worker", "collective"),
    ("_Send", "worker", "send_recv"), ("ExecutorState::ProcessAsync::Done", "ps", "send_recv"),
    ("ResourceGather", "ps", "embedding"), ("ResourceSparseApplyAdagradV2", "ps", "embedding"),
    ("UnsortedSegmentSum", "ps", "embedding"), ("FloorMod", "worker", "embedding"),
    ("DynamicPartition", "worker", "embedding"),
    # Generic ops: dense work on a worker, table work on a PS.
    ("Tile", "worker", "dense_compute"), ("Tile", "ps", "embedding"),
    ("_MklMatMul", "worker", "dense_compute"),
    ("ResourceApplyAdagradV2", "ps", "dense_compute"),  # stock PSS: the MLP on the PS
    ("ParallelFor", "ps", "op_pool"), ("IteratorGetNextOp::DoCompute", "worker", "input"),
    ("ExecutorState::Process", "worker", "dispatch_runtime"),
    ("EagerCopyToDevice", "chief", "rpc_serialize"),
    # Threads blocked until a function's ops or a remote result are done.
    ("KernelAndDeviceFunc::Run", "worker", "blocked"), ("Enqueue", "worker", "blocked"),
    (" __inference_train_function_8282", "worker", "blocked"),
    ("EagerExecute", "chief", "blocked"), ("SomethingNew", "worker", "other"),
])
def test_category_of(name, task, category):
    assert ps.category_of(name, task) == category


def test_by_category_shares_leave_blocked_out_and_rpc_counts():
    ops = {"_MklMatMul": [6.0, 4], "FloorMod": [2.0, 2], "_Send": [2.0, 10],
           "KernelAndDeviceFunc::Run": [90.0, 1], "Enqueue": [0.0, 3],
           "CollectiveReduceV2": [0.0, 2]}
    cats = ps.by_category(ops)
    assert cats == {"dense_compute": 6.0, "embedding": 2.0, "send_recv": 2.0,
                    "blocked": 90.0, "collective": 0.0}
    share = ps.shares(cats)
    assert "blocked" not in share and share["dense_compute"] == pytest.approx(0.6)
    assert ps.shares({"a": 0.0}) == {"a": 0.0}
    assert ps.rpc_counts(ops) == {"tensors_sent": 10, "eager_requests_served": 3,
                                  "collectives": 2}


def test_ops_run_counts_kernels_not_runtime_events():
    ops = {"_MklMatMul": [1.0, 4], "_Send": [1.0, 3], "CollectiveReduceV2": [1.0, 2],
           "Loop": [9.0, 2], "ParallelFor": [1.0, 50], "ExecutorState::Process": [1.0, 90],
           "KernelAndDeviceFunc::Run": [50.0, 1], " __inference_train_function_1": [0.1, 1],
           "MemoryAllocation": [0.0, 70], "0_7450454252568010208_0": [0.1, 2]}
    assert ps.ops_run(ops) == 4 + 3 + 2
    assert ps.ops_run({" Identity": [0.4, 15], " ReadVariableOp": [0.2, 12],
                       "EagerExecute": [5000.0, 49]}) == 27  # the chief's eager ops


def test_parse_ss_reads_ports_pid_and_acked_received_bytes():
    socks = ps.parse_ss(SS_BEFORE)
    assert socks[0] == {"pid": 11, "local_port": 40001, "peer_port": 52000, "sent": 100,
                        "received": 1000}
    assert [s["pid"] for s in socks] == [11, 22, 99]


def test_bytes_by_peer_pairs_both_ends_and_counts_new_connections_from_zero():
    roles = {11: "ps:0", 22: "worker:0", 33: "worker:1"}
    got = ps.bytes_by_peer(ps.parse_ss(SS_BEFORE), ps.parse_ss(SS_AFTER), roles)
    assert got == {
        "ps:0": {"worker:0": {"sent": 300, "received": 8000},
                 "worker:1": {"sent": 30, "received": 70}},
        "worker:0": {"ps:0": {"sent": 8000, "received": 300}},
        "worker:1": {"ps:0": {"sent": 70, "received": 30}},
    }  # pid 99 (not ours) is left out


def test_cpu_between_epochs_starts_after_the_warm_up():
    # marks[0]: training starts; marks[k + 1]: epoch k ends (epoch 0 = warm-up).
    marks = [{"self": 0.0, "ps:0": 0.0}, {"self": 9.0, "ps:0": 5.0},
             {"self": 9.5, "ps:0": 6.0}, {"self": 10.0, "ps:0": 7.5}]
    assert ps.cpu_between_epochs(marks, 0, 2) == {"chief": 1.0, "ps:0": 2.5}
    with pytest.raises(ValueError, match="not within"):
        ps.cpu_between_epochs(marks, 0, 3)


def test_per_unit_and_its_error():
    assert ps.per_unit({"a": 10.0, "b": 1.0}, 4) == {"a": 2.5, "b": 0.25}
    with pytest.raises(ValueError, match="units must be positive"):
        ps.per_unit({"a": 1.0}, 0)


def test_steps_from_markers_per_setup():
    worker = {"IteratorGetNextOp::DoCompute": [3.0, 56], "_MklMatMul": [1.0, 100]}
    ps_ops = {" __inference_train_function_8282_14739277573299513312_1": [0.1, 7],
              " __inference_train_function_11281_9968225934714668023_2": [0.1, 7]}
    # Hybrid: a global step is one step of every worker; a PS sees both workers'.
    assert ps.steps_from_markers(worker, "hybrid_sync", "worker:0", 2, 8) == 56.0
    assert ps.steps_from_markers(ps_ops, "hybrid_sync", "ps:1", 2, 8) == 56.0
    # Stock PSS: a step is one worker's (a global batch); a worker counts its own.
    stock_worker = {"IteratorGetNextAsOptionalOp::DoCompute": [2.5, 37]}
    assert ps.steps_from_markers(stock_worker, "stock_pss", "worker:0", 2, 8) == 37.0
    assert ps.steps_from_markers(ps_ops, "stock_pss", "ps:0", 2, 8) == 112.0
    assert ps.steps_from_markers({"_MklMatMul": [1.0, 5]}, "hybrid_sync", "worker:0", 2, 8) is None
    assert ps.steps_from_markers(worker, "hybrid_sync", "chief", 2, 8) is None


def test_stacked_bars_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    recs = [{"mode": "profile", "setup": s, "role": r,
             "category_share": {"dense_compute": 0.5, "collective": 0.3, "other": 0.2}}
            for s in ("stock_pss", "hybrid_sync") for r in ("worker:0", "ps:0")]
    path = ps.stacked_bars(recs + recs + [{"mode": "profile_run"}], str(tmp_path / "c.png"))
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_recompute_rewrites_per_step_figures_from_stored_sums(tmp_path):
    from benchmarks import profile  # pylint: disable=g-import-not-at-top

    line = {"mode": "profile", "setup": "stock_pss", "role": "worker:1",
            "steps_per_execution": 8, "ops_run_per_step": 8504.0,
            "ops": {"IteratorGetNextAsOptionalOp::DoCompute": [1.7, 16], "_Send": [9.0, 32],
                    "_MklMatMul": [8.0, 64]}}
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps(line) + "\n" + json.dumps({"mode": "profile_run"}) + "\n")
    args = profile.build_parser().parse_args([])
    recs = profile.recompute(str(path), args)
    assert recs[0]["steps_in_trace"] == 16.0 and recs[0]["ops_run_per_step"] == 6.0
    assert recs[0]["rpcs_per_step"] == {"tensors_sent": 2.0}
    assert [json.loads(x) for x in path.read_text().splitlines()] == recs
