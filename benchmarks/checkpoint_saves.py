"""`python -m benchmarks.checkpoint_saves`: memory and time of repeated multi-device saves.

Why this module exists: the 60-minute soak showed the chief's and the PS
tasks' RSS rising with every checkpoint. TF's eager `MultiDeviceSaver.save`
traces a new `tf.function` per save when variables span several devices,
and the remote tasks never release it. `tf_psplugin.state.checkpoint_write`
writes through one traced function instead. This benchmark saves the same
variables N times with each writer, side by side in one run, on a fresh
cluster per writer (2 PS + 1 worker servers on loopback, chief in this
process), and reports the RSS growth of every task and the time per save.

    python -m benchmarks.checkpoint_saves                 # 300 saves per writer
    python -m benchmarks.checkpoint_saves --saves 100 --output saves.jsonl

Output: one JSON line per writer (`kind: "checkpoint_saves"`) with RSS MB
of ps:0, ps:1 and the chief after `--warmup_saves` saves and after the
measured `--saves`, growth per 100 saves, and seconds per save; then one `kind:
"checkpoint_saves_ratio"` line (tf.train.Checkpoint / traced).
"""

import argparse
import json
import shutil
import subprocess
import sys
import tempfile

from benchmarks import procs

WRITERS = ("tf_checkpoint", "traced")

_SERVER = ("import json, os, tensorflow as tf\n"
           "c = json.loads(os.environ['TF_CONFIG'])\n"
           "tf.distribute.Server(tf.train.ClusterSpec(c['cluster']), job_name=c['task']['type'],"
           " task_index=c['task']['index'], protocol='grpc', start=True).join()\n")

_CHIEF = """
import json, os, sys, time
import tensorflow as tf
from tf_psplugin.state import checkpoint_write

writer, saves, out_dir, pids = sys.argv[1], int(sys.argv[2]), sys.argv[3], json.loads(sys.argv[4])
warmup = int(sys.argv[6])


def rss(pid):
    with open("/proc/%d/status" % pid) as f:
        for line in f:
            if line.startswith("VmRSS"):
                return int(line.split()[1]) / 1024.0


def sample():
    return {"ps0": rss(pids[0]), "ps1": rss(pids[1]), "chief": rss(os.getpid())}


strategy = tf.distribute.experimental.ParameterServerStrategy(
    tf.distribute.cluster_resolver.TFConfigClusterResolver())
with strategy.scope():
    tables = [tf.Variable(tf.random.uniform([20000, 16], seed=i)) for i in range(8)]
cls = checkpoint_write.TracedWriteCheckpoint if writer == "traced" else tf.train.Checkpoint
ckpt = cls(tables=tables)
prefix = os.path.join(out_dir, "ckpt")
for _ in range(warmup):
    ckpt.write(prefix)
first = sample()
start = time.perf_counter()
for _ in range(saves):
    ckpt.write(prefix)
seconds = time.perf_counter() - start
last = sample()
restored = [tf.Variable(tf.zeros([20000, 16])) for _ in range(8)]
tf.train.Checkpoint(tables=restored).read(prefix).assert_consumed()
exact = all(bool(tf.reduce_all(r == t.read_value())) for r, t in zip(restored, tables))
print(sys.argv[5] + json.dumps({"first": first, "last": last, "seconds": seconds, "exact": exact}))
"""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.checkpoint_saves", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--saves", type=int, default=300, help="measured saves per writer")
    p.add_argument("--warmup_saves", type=int, default=20,
                   help="saves before the first RSS sample (allocator and caches warm up)")
    p.add_argument("--output", default="", help="also append the JSON lines to this file")
    p.add_argument("--timeout", type=float, default=900.0)
    return p


def run_writer(writer: str, saves: int, warmup: int, timeout: float) -> dict:
    """Starts a fresh 2-PS cluster, saves `warmup` + `saves` times with `writer`, stops it."""
    ports = procs._free_ports(4)  # pylint: disable=protected-access
    cluster = {"ps": [f"127.0.0.1:{p}" for p in ports[:2]], "worker": [f"127.0.0.1:{ports[2]}"],
               "chief": [f"127.0.0.1:{ports[3]}"]}
    work = tempfile.mkdtemp(prefix="ckpt_saves_")
    servers = []
    try:
        for job, count in (("ps", 2), ("worker", 1)):
            for index in range(count):
                env = procs.child_env({"TF_CONFIG": json.dumps(
                    {"cluster": cluster, "task": {"type": job, "index": index}})})
                servers.append(subprocess.Popen([sys.executable, "-c", _SERVER], env=env,
                                                stdout=subprocess.DEVNULL,
                                                stderr=subprocess.DEVNULL,
                                                start_new_session=True))
        env = procs.child_env({"TF_CONFIG": json.dumps(
            {"cluster": cluster, "task": {"type": "chief", "index": 0}})})
        pids = json.dumps([servers[0].pid, servers[1].pid])
        done = subprocess.run([sys.executable, "-c", _CHIEF, writer, str(saves), work, pids,
                               procs.RESULT_PREFIX, str(warmup)],
                              env=env, capture_output=True, text=True, timeout=timeout,
                              check=False)
        if done.returncode != 0:
            raise procs.BenchmarkProcessError(
                f"{writer}: chief exited {done.returncode}: {done.stderr[-3000:]}")
        return procs.parse_result(done.stdout)
    finally:
        for server in servers:
            procs._kill_group(server)  # pylint: disable=protected-access
        shutil.rmtree(work, ignore_errors=True)


def summarize(writer: str, saves: int, warmup: int, result: dict) -> dict:
    per100 = 100.0 / saves
    rec = {"kind": "checkpoint_saves", "writer": writer, "saves": saves, "warmup_saves": warmup,
           "seconds_per_save": round(result["seconds"] / saves, 4),
           "restore_exact": result["exact"]}
    for role in ("ps0", "ps1", "chief"):
        first, last = result["first"][role], result["last"][role]
        rec[f"{role}_rss_mb_first"] = round(first, 1)
        rec[f"{role}_rss_mb_last"] = round(last, 1)
        rec[f"{role}_rss_mb_per_100_saves"] = round((last - first) * per100, 2)
    return rec


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.saves < 1 or args.warmup_saves < 1:
        raise SystemExit("--saves and --warmup_saves must be >= 1")
    records = []
    for writer in WRITERS:
        result = run_writer(writer, args.saves, args.warmup_saves, args.timeout)
        records.append(summarize(writer, args.saves, args.warmup_saves, result))
    base, traced = records
    records.append({
        "kind": "checkpoint_saves_ratio", "saves": args.saves,
        "seconds_per_save_ratio": round(base["seconds_per_save"]
                                        / max(traced["seconds_per_save"], 1e-9), 2),
        **{f"{role}_growth_mb_per_100_saves": [base[f"{role}_rss_mb_per_100_saves"],
                                               traced[f"{role}_rss_mb_per_100_saves"]]
           for role in ("ps0", "ps1", "chief")}})
    for rec in records:
        line = json.dumps(rec)
        print(line, flush=True)
        if args.output:
            with open(args.output, "a") as f:
                f.write(line + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
