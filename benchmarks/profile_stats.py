"""Pure arithmetic of `benchmarks.profile`: self time, categories, RPCs, TCP bytes.

Why this module exists: a profiler trace lists thousands of events per
task, nested (a function's event contains its ops' events) and spread over
dozens of threads; `ss` lists every TCP connection of the box. To say where
one synchronous step's time goes, the profile needs figures per step that
add up: each event's *self* time (its duration minus its children's, so
nothing is counted twice), op names grouped into a few categories, gRPC
handlers counted as RPCs, and each task's bytes sent to and received from
each other task. These functions take plain Python values (no TensorFlow,
no processes) so that unit tests pin them down.
"""

import collections
import re
from typing import Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

# Events that only say a thread is blocked until remote or pooled work is
# done (a function run waiting for its ops, the chief waiting for a
# worker's result, an RPC handler running a function): their self time is
# waiting, not work, so they are kept out of the busy categories.
BLOCKED = (r"^Enqueue$|^EagerExecute$|^EagerKernelExecute$|^KernelAndDeviceFunc::Run$|"
           r"^\s*__inference_|^train_function$|^TFE_Py_ExecuteCancelable$|"
           r"^EagerLocalExecute|^train$")

# Op or TraceMe name -> category, first match wins. The names are the op
# types TF's executor records ("name:OpType" is cut to "OpType" first) and
# the runtime's own TraceMe names (TF 2.15).
OP_CATEGORIES = (
    # The ring all-reduce: "Loop" is RingReducer's wait for its peers' chunks.
    ("collective", r"^Collective|^BaseCollectiveExecutor|RecvBuf|CompleteGroup|"
                   r"CompleteInstance|^Loop$|RingReducer|RingGatherer|HierarchicalTree|"
                   r"Permuter"),
    ("send_recv", r"^_Send$|^_Recv$|^_HostSend$|^_HostRecv$|RecvTensor|Rendezvous|"
                  r"^ExecutorState::ProcessAsync"),
    ("rpc_serialize", r"grpc|Grpc|proto|Proto|Serializ|Deserializ|EagerService|"
                      r"RunComponentFunction|WorkerService|SendTensor|EagerCopyToDevice|"
                      r"CopyInputToExpectedDevice"),
    # Ids to shards and rows back: routing on the worker, gathers, dedup and
    # sparse applies on the PS.
    ("embedding", r"ResourceGather|^GatherV2$|^Gather$|Unique|UnsortedSegment|SegmentSum|"
                  r"DynamicPartition|DynamicStitch|ResourceSparseApply|SparseApply|"
                  r"ScatterAdd|ResourceScatter|ScatterNd|SparseSegment|RaggedGather|"
                  r"EmbeddingLookup|FloorMod|FloorDiv"),
    # Eigen's shards of an op, run on the intra-op pool (any op's).
    ("op_pool", r"^ParallelFor$"),
    ("dense_compute", r"MatMul|BiasAdd|Relu|Sigmoid|Softplus|Tanh|Conv|"
                      r"ResourceApply|ApplyAdagrad|Adagrad|Mul$|^Add|AddN|Sub$|"
                      r"RealDiv|Div$|Neg$|Log|Exp|Sqrt|Rsqrt|Square|Sum$|Mean$|Max$|"
                      r"Select|Cast|Greater|Less|Equal|ConcatV2|Concat|Split|"
                      r"Reshape|Tile|Pad|Slice|StridedSlice|Pack|Unpack|Transpose|"
                      r"ZerosLike|OnesLike|Fill|Maximum|Minimum|Abs|Sign|"
                      r"BroadcastGradientArgs|BroadcastTo|Range|ExpandDims|Squeeze|"
                      r"ReadVariableOp|AssignVariableOp|AssignAddVariableOp|"
                      r"AssignSubVariableOp|VarHandleOp|Identity|Shape|Size|Rank|"
                      r"Const|NoOp|Reciprocal|LogicalAnd|LogicalOr|IsFinite|All$|Any$|"
                      r"Prod$|Cumsum|Where|Round|Floor|Ceil|TopK"),
    ("input", r"Iterator|Dataset|MakeIterator|GetNext|Prefetch|OptionalGetValue|"
              r"OptionalHasValue|tf_data"),
    ("dispatch_runtime", r"Executor|Function|function|__forward|__backward|"
                         r"EagerCopy|EagerKernel|KernelAndDevice|StatefulPartitionedCall|"
                         r"PartitionedCall|ThreadPool|Schedule|Instantiate|Process|"
                         r"ValidateInputTypeAndPlacement|TFE_|convert_to_tensor|tf\.constant"),
    ("memory", r"^Memory"),
)

# On a PS every op but a dense variable's apply serves the tables (in the
# hybrid the PS holds only tables; stock PSS also applies the MLP there).
_PS_DENSE = r"ResourceApply|ApplyAdagrad$|MatMul"

# Requests and transfers, counted from the events each task records (TF
# 2.15's servers record no event per RPC handler): a `_Send` to another
# task is one tensor the peer fetches (a RecvTensor request), `Enqueue` one
# eager request served, a collective one all-reduce (its ring exchanges).
RPC_NAMES = (
    ("tensors_sent", r"^_Send$"),
    ("eager_requests_served", r"^Enqueue$"),
    ("collectives", r"^CollectiveReduceV2$|^CollectiveGatherV2$|^CollectiveBcast"),
    ("functions_dispatched", r"^train_function$"),
)


def category_of(name: str, task: str = "worker") -> str:
    """The category of an op type or TraceMe name on a task ("worker", "ps", "chief").

    "blocked" for `BLOCKED` events, else the first `OP_CATEGORIES` match
    ("other" if none); on a PS, compute other than a dense apply is
    "embedding".
    """
    if re.search(BLOCKED, name):
        return "blocked"
    label = "other"
    for cat, pattern in OP_CATEGORIES:
        if re.search(pattern, name):
            label = cat
            break
    if task == "ps" and label == "dense_compute" and not re.search(_PS_DENSE, name):
        return "embedding"
    return label


def rpc_kind(name: str) -> Optional[str]:
    """The RPC an event name stands for (see `RPC_NAMES`), or None."""
    for label, pattern in RPC_NAMES:
        if re.search(pattern, name):
            return label
    return None


def op_key(name: str) -> str:
    """One row per op type: ``"dense/MatMul:MatMul"`` -> ``"MatMul"`` (C++ ``::`` names kept)."""
    return name.rsplit(":", 1)[-1] if ":" in name and "::" not in name else name


def self_times(events: Sequence[Tuple[int, int, str]]) -> List[Tuple[str, int]]:
    """Each event's self time on one thread: its duration minus its children's.

    Events on one trace line (thread) nest: a function's event contains its
    ops' events. Summing durations would count the ops twice; self times
    add up to the thread's busy time exactly.

    Args:
        events: ``(offset, duration, name)`` of one line, in any order; an
            event that starts inside another and ends after it is clipped to
            its parent (the profiler's events nest, this keeps sums exact).

    Returns:
        ``(name, self_duration)`` per event, in start order (ties: the
        longer event first, as the parent).
    """
    out: List[Tuple[str, int]] = []
    # stack of [end, name, child_total, duration]
    stack: List[list] = []

    def pop():
        end, name, child_total, duration = stack.pop()
        out.append((name, max(duration - child_total, 0)))

    for offset, duration, name in sorted(events, key=lambda e: (e[0], -e[1])):
        while stack and offset >= stack[-1][0]:
            pop()
        end = offset + duration
        if stack:
            end = min(end, stack[-1][0])
            stack[-1][2] += end - offset
        stack.append([end, name, 0, end - offset])
    while stack:
        pop()
    return out


def aggregate(lines: Iterable[Sequence[Tuple[int, int, str]]]) -> Dict[str, List[float]]:
    """Self time (ps) and count per op key over every line: ``{key: [self_ps, count]}``."""
    totals: Dict[str, List[float]] = collections.defaultdict(lambda: [0, 0])
    for events in lines:
        for name, self_ps in self_times(events):
            row = totals[op_key(name)]
            row[0] += self_ps
            row[1] += 1
    return dict(totals)


# Runtime TraceMes that share the op names' shape (no "::"): not ops.
_NOT_OPS = (r"^(Loop|ParallelFor|FunctionRun|EagerExecute|Enqueue|EagerKernelExecute|"
            r"EagerCopyToDevice|EagerLocalExecute|ValidateInputTypeAndPlacement|Memory\w*|"
            r"MemCpyAsync|PrefetchProduce|TFE_\w+|train|train_function|convert_to_tensor|"
            r"tf\.constant|\d+(_\d+)*|CopyInputToExpectedDevice|ExecutorDoneCallback)$")


def ops_run(ops: Mapping[str, Sequence[float]]) -> int:
    """How many TF ops (kernels) the events record: op types, not runtime TraceMes."""
    # (Eager ops on the chief are recorded as " OpType", with a space.)
    return int(sum(count for key, (_, count) in ops.items()
                   if "::" not in key and not re.search(_NOT_OPS, key.strip())
                   and not re.search(BLOCKED, key)))


def by_category(ops: Mapping[str, Sequence[float]], task: str = "worker") -> Dict[str, float]:
    """Sums self time per category: ``{key: [self_ms, count]}`` -> ``{category: ms}``."""
    out: Dict[str, float] = collections.Counter()
    for key, (ms, _) in ops.items():
        out[category_of(key, task)] += ms
    return dict(out)


def rpc_counts(ops: Mapping[str, Sequence[float]]) -> Dict[str, int]:
    """How many requests of each `RPC_NAMES` kind the events record."""
    out: Dict[str, int] = collections.Counter()
    for key, (_, count) in ops.items():
        kind = rpc_kind(key)
        if kind:
            out[kind] += int(count)
    return dict(out)


def shares(values: Mapping[str, float], leave_out: Sequence[str] = ("blocked",)
           ) -> Dict[str, float]:
    """Each value's share of their sum, `leave_out` keys left out (zero sum: all 0)."""
    kept = {k: v for k, v in values.items() if k not in leave_out}
    total = sum(kept.values())
    return {k: (v / total if total > 0 else 0.0) for k, v in kept.items()}


# -- TCP bytes per pair of tasks, from `ss -tinpH` --------------------------------

_SS_HEAD = re.compile(r"^\s*\d+\s+\d+\s+(\S+):(\d+)\s+(\S+):(\d+)\s+users:\(\(.*?pid=(\d+)")
_SS_FIELD = re.compile(r"\b(bytes_acked|bytes_received):(\d+)")


def parse_ss(text: str) -> List[Dict[str, int]]:
    """Parses ``ss -tinpH state established`` output into one dict per socket.

    Args:
        text: Lines alternating between a socket line (queues, local and
            peer address:port, ``users:((...pid=N...))``) and its indented
            ``tcp_info`` line (``bytes_acked:N bytes_received:N ...``).

    Returns:
        ``{"pid", "local_port", "peer_port", "sent", "received"}`` per
        socket with a pid (sent = bytes the peer acknowledged).
    """
    out: List[Dict[str, int]] = []
    current: Optional[Dict[str, int]] = None
    for line in text.splitlines():
        m = _SS_HEAD.match(line)
        if m:
            current = {"pid": int(m.group(5)), "local_port": int(m.group(2)),
                       "peer_port": int(m.group(4)), "sent": 0, "received": 0}
            out.append(current)
            continue
        if current is not None:
            for field, value in _SS_FIELD.findall(line):
                current["sent" if field == "bytes_acked" else "received"] = int(value)
    return out


def bytes_by_peer(before: Sequence[Mapping[str, int]], after: Sequence[Mapping[str, int]],
                  roles: Mapping[int, str]) -> Dict[str, Dict[str, Dict[str, int]]]:
    """Bytes each task sent to and received from each other task between two `parse_ss`s.

    Both ends of a loopback connection are in the listing: the peer of a
    socket is the process owning the socket whose local port is its peer
    port. Sockets of processes not in `roles` are ignored; a connection
    opened between the two listings counts from zero.

    Args:
        before: `parse_ss` at the start of the window.
        after: `parse_ss` at its end.
        roles: pid -> role (``"worker:0"``, ...).

    Returns:
        ``{role: {peer_role: {"sent": n, "received": n}}}``.
    """
    owner = {s["local_port"]: s["pid"] for s in after}
    start = {(s["pid"], s["local_port"], s["peer_port"]): s for s in before}
    out: Dict[str, Dict[str, Dict[str, int]]] = {}
    for s in after:
        role = roles.get(s["pid"])
        peer = roles.get(owner.get(s["peer_port"], -1))
        if role is None or peer is None or peer == role:
            continue
        b = start.get((s["pid"], s["local_port"], s["peer_port"]), {})
        row = out.setdefault(role, {}).setdefault(peer, {"sent": 0, "received": 0})
        row["sent"] += max(s["sent"] - b.get("sent", 0), 0)
        row["received"] += max(s["received"] - b.get("received", 0), 0)
    return out


def cpu_between_epochs(marks: Sequence[Mapping[str, float]], first: int, last: int
                       ) -> Dict[str, float]:
    """CPU-seconds per role from the end of epoch `first` to the end of epoch `last`.

    Args:
        marks: `benchmarks.child.EpochTimer`'s CPU marks: ``marks[0]`` at the
            start of training, ``marks[k + 1]`` at the end of epoch ``k``;
            each ``{role: cpu_seconds}``, the chief's own as ``"self"``.
        first: The epoch whose end starts the window (0: after the warm-up).
        last: The epoch whose end closes it.

    Returns:
        ``{role: seconds}``, the chief as ``"chief"``.
    """
    if not 0 <= first < last < len(marks) - 1:
        raise ValueError(f"epochs {first}..{last} are not within the {len(marks) - 1} "
                         "epochs marked")
    start, end = marks[first + 1], marks[last + 1]
    out = {role: end[role] - start[role] for role in end if role in start}
    if "self" in out:
        out["chief"] = out.pop("self")
    return out


def per_unit(values: Mapping[str, float], units: float, digits: int = 3) -> Dict[str, float]:
    """Every value divided by `units` (steps, thousands of examples), rounded."""
    if units <= 0:
        raise ValueError(f"units must be positive, got {units}: the window held no step")
    return {k: round(v / units, digits) for k, v in values.items()}


def stacked_bars(records: Sequence[Mapping], path: str, title: str = "") -> Optional[str]:
    """PNG: one stacked bar per (setup, task) of its share of traced self time per category.

    Args:
        records: `benchmarks.profile` lines (``mode == "profile"``) with
            ``category_share`` and ``role``, of one or more setups.
        path: Where the PNG goes.
        title: The chart's title.

    Returns:
        `path`, or None when matplotlib is missing.
    """
    try:
        import matplotlib  # pylint: disable=g-import-not-at-top

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
    except ImportError:
        return None
    from benchmarks import procs  # pylint: disable=g-import-not-at-top

    runs: Dict[Tuple[str, str], List[Mapping[str, float]]] = {}
    for r in records:
        if r.get("mode") == "profile" and r.get("category_share"):
            runs.setdefault((r["setup"], r["role"]), []).append(r["category_share"])
    # One bar per (setup, task): the mean share over that task's runs.
    rows = [{"category_share": {c: sum(x.get(c, 0.0) for x in xs) / len(xs)
                                for c in set().union(*xs)}}
            for xs in runs.values()]
    labels = [f"{setup}\n{role}" + (f"\n({len(xs)} runs)" if len(xs) > 1 else "")
              for (setup, role), xs in runs.items()]
    cats = [c for c, _ in OP_CATEGORIES] + ["other"]
    fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(rows) + 2), 5))
    bottom = [0.0] * len(rows)
    for cat in cats:
        vals = [100.0 * r["category_share"].get(cat, 0.0) for r in rows]
        if not any(vals):
            continue
        ax.bar(range(len(rows)), vals, bottom=bottom, label=cat)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels(labels, fontsize=8)
    ax.set_ylabel("% of the task's traced busy thread time")
    ax.set_title(title or "Where one step's time goes, per task")
    ax.legend(fontsize=8, bbox_to_anchor=(1.01, 1), loc="upper left")
    return procs.save_chart(fig, plt, path)


# What counts a task's steps in a trace cut by time: a worker runs one
# `IteratorGetNext` per step of its own; a PS runs one component function
# per worker execution (``steps_per_execution`` steps of that worker).
STEP_MARKERS = {
    # (Stock PSS's workers read through an optional: IteratorGetNextAsOptional.)
    "worker": r"^IteratorGetNext(AsOptional)?Op::DoCompute$",
    "ps": r"^\s*__inference_\w+_\d+_\d+_\d+$",
}


def steps_from_markers(ops: Mapping[str, Sequence[float]], setup: str, role: str,
                       num_workers: int, steps_per_execution: int) -> Optional[float]:
    """The steps a worker's or PS's trace holds: a worker's own, a PS's global ones.

    A worker's figures are per step of its own: in the hybrid one global
    step (its 1/num_workers of the global batch), in stock PSS one whole
    global batch (its steps are asynchronous and need not alternate evenly
    between workers). A PS serves every worker, so its figures are per
    global step (one global batch): a hybrid global step is one step of
    every worker, a stock PSS step one worker's.

    Returns:
        The number of steps, or None when the trace has no marker.
    """
    task = role.split(":")[0]
    pattern = STEP_MARKERS.get(task)
    if pattern is None:
        return None
    found = sum(count for key, (_, count) in ops.items() if re.search(pattern, key))
    if not found:
        return None
    if task == "worker":
        return float(found)
    worker_steps = found * steps_per_execution  # Every worker's, through this PS.
    return float(worker_steps / num_workers if setup != "stock_pss" else worker_steps)
