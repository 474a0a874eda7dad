"""Incremental checkpoints lose no write and survive a crash at any file (issue 41).

A chief + 2 workers + 2 PS train keras_examples/ctr.py's tiny model with
`ChiefCheckpoint(save_every_steps=5, full_every_saves=100)` (a full save at step 5,
deltas after), with each optimizer incremental checkpoints accept, and write
the tables outside the optimizer between saves:

* ``reset``: `embeddings.assign(zeros)` and a `scatter_update` of a few rows
  after the full save, then 5 more steps (delta-10);
* ``early_stop``: `EarlyStopping(restore_best_weights=True)` sets the
  weights of epoch 1 back after delta-10, so the train-end save writes step
  10 again, in full (ckpt-10: a delta of the same step would not follow its
  parent), then 5 more steps (delta-15 on ckpt-10);
* ``mid_chain``: `ChiefCheckpointManager.restore` of delta-10 after delta-15
  was written, then 10 more steps (a full ckpt-15, delta-20).

Each chain, restored into a fresh model on the cluster, must equal bit for
bit a full save of the same step restored the same way, and the live model
(weights, every optimizer variable, step); loaded into a plain process with
`load_into`, the chain's weights must equal the full save's. ``crash``:
the directory is copied before and after every file delta-15 writes (what a
chief killed at that point leaves); each copy's chain must end at delta-10
and restore exactly the model of step 10, and the copy after the commit
restores step 15.
"""

import json

import pytest

from tests.cluster import _cluster_util as cu
from tests.cluster.test_checkpoint import COMMON

pytestmark = pytest.mark.cluster

OPTIMIZERS = {
    "legacy_adagrad": "tf.keras.optimizers.legacy.Adagrad(0.1)",
    "keras_adagrad": "tf.keras.optimizers.Adagrad(0.1)",
    "legacy_sgd": "tf.keras.optimizers.legacy.SGD(0.1, momentum=0.5)",
    "legacy_ftrl": "tf.keras.optimizers.legacy.Ftrl(0.1)",
    "lazy_adam": "tf_psplugin.LazyAdam(0.01)",
}

TRAIN = COMMON + """
import shutil
from tf_psplugin.state import model_dir as model_dir_lib
config = tf_psplugin.start_server()
root, out, optimizer_src, scenarios = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
strategy = tf_psplugin.HybridParameterServerStrategy(
    options=tf_psplugin.HybridOptions(log_placement=False))
gen = SyntheticCTR(vocab_size=V, seed=5)
report = {{}}


def make():
    with strategy.scope():
        return compile_ctr_model(model_fn(), optimizer=eval(optimizer_src))


def opt_vars(model):
    opt = model.optimizer
    return opt.variables() if callable(opt.variables) else opt.variables


def snapshot(model):
    values = {{"iter": np.asarray(model.optimizer.iterations.numpy())}}
    for i, w in enumerate(logical_trainables(model)):
        values[f"w{{i}}"] = tf.convert_to_tensor(w).numpy()
    for i, v in enumerate(opt_vars(model)):
        values[f"opt{{i}}"] = tf.convert_to_tensor(v).numpy()
    return values


def diff(a, b):
    if sorted(a) != sorted(b):
        return f"keys differ: {{sorted(set(a) ^ set(b))}}"
    bad = [k for k in a if not np.array_equal(a[k], b[k])]
    return [(k, int(np.sum(a[k] != b[k]))) for k in bad]


def restored(model_dir, checkpoint=None):
    model = make()
    manager = ckpt_lib.ChiefCheckpointManager(model_dir, model=model, optimizer=model.optimizer)
    info = manager.restore(checkpoint)
    return model, info


def fit(model, steps, offset, callbacks=(), epochs=1):
    model.fit(gen.dataset(B, offset_batches=offset), epochs=epochs, steps_per_epoch=steps,
              verbose=0, callbacks=list(callbacks))


def check(name, model, model_dir, step):
    live = snapshot(model)
    full_dir = model_dir + "_full"
    ckpt_lib.ChiefCheckpointManager(full_dir, model=model, optimizer=model.optimizer).save(step)
    chain_model, info = restored(model_dir)
    full_model, _ = restored(full_dir)
    chain, full = snapshot(chain_model), snapshot(full_model)
    report[name] = {{"restored": [info.name, info.step], "chain_vs_full": diff(chain, full),
                    "chain_vs_live": diff(chain, live),
                    "chain": [d.name for d in model_dir_lib.checkpoint_chain(model_dir)[1]]}}


for scenario in scenarios:
    model_dir = os.path.join(root, scenario)
    model = make()
    callback = tf_psplugin.ChiefCheckpoint(model_dir, save_every_steps=5, full_every_saves=100)
    if scenario == "reset":
        fit(model, 5, 0, [callback])  # ckpt-5 (full)
        table = model.get_layer("embedding").embeddings
        table.assign(tf.zeros(table.shape))  # A reset outside the optimizer.
        table.scatter_update(tf.IndexedSlices(tf.ones([2, table.shape[1]]),
                                              tf.constant([3, 17], tf.int64)))
        fit(model, 5, 5, [callback])  # delta-10
        check(scenario, model, model_dir, 10)
    elif scenario == "early_stop":
        # mode="max" on a falling loss: epoch 1 stays the best, so at the end of
        # epoch 2 (after delta-10) EarlyStopping sets epoch 1's weights back.
        stop = tf.keras.callbacks.EarlyStopping(monitor="loss", mode="max", patience=1,
                                                restore_best_weights=True)
        fit(model, 5, 0, [callback, stop], epochs=4)
        report["early_stop_steps"] = int(model.optimizer.iterations.numpy())
        report["early_stop_saves"] = sorted(
            [i.name for i in model_dir_lib.list_checkpoints(model_dir)]
            + [d.name for d in model_dir_lib.list_deltas(model_dir)])
        fit(model, 5, 10, [callback])  # delta-15
        check(scenario, model, model_dir, 15)
    elif scenario == "mid_chain":
        fit(model, 15, 0, [callback])  # ckpt-5, delta-10, delta-15
        [delta10] = [d for d in model_dir_lib.list_deltas(model_dir) if d.step == 10]
        callback.manager.restore(delta10)
        report["mid_chain_step"] = int(model.optimizer.iterations.numpy())
        fit(model, 10, 20, [callback])  # ckpt-15 (full after a restore), delta-20
        check(scenario, model, model_dir, 20)
    elif scenario == "crash":
        fit(model, 10, 0, [callback])  # ckpt-5, delta-10
        live10 = snapshot(model)
        copies, save_v2, commit = [], tf.raw_ops.SaveV2, model_dir_lib.commit_delta

        def copy(when):
            path = os.path.join(root, f"crash_{{len(copies)}}")
            shutil.copytree(model_dir, path)
            copies.append((path, when))

        def saving(**kwargs):
            copy("before " + os.path.basename(str(kwargs["prefix"])))
            result = save_v2(**kwargs)
            copy("after " + os.path.basename(str(kwargs["prefix"])))
            return result

        def committing(*args, **kwargs):
            copy("before the commit marker")
            return commit(*args, **kwargs)

        tf.raw_ops.SaveV2, model_dir_lib.commit_delta = saving, committing
        try:
            fit(model, 5, 10, [callback])  # delta-15
        finally:
            tf.raw_ops.SaveV2, model_dir_lib.commit_delta = save_v2, commit
        live15 = snapshot(model)
        copy("after the commit")
        markers = {{name: model_dir_lib.read_json(os.path.join(model_dir, name + ".commit"))
                   for name in ("ckpt-5", "delta-15")}}
        report["tables"] = markers["delta-15"]["manifest"]["tables"]
        report["bytes"] = {{name: sum(m["files"].values()) for name, m in markers.items()}}
        report["crash"] = []
        for path, when in copies:
            expected = live15 if when == "after the commit" else live10
            crashed, info = restored(path)
            report["crash"].append({{"when": when, "restored": [info.name, info.step],
                                    "diff": diff(snapshot(crashed), expected)}})
with open(os.path.join(out, "report.json"), "w") as f:
    json.dump(report, f)
print("RESULT ok")
"""

PLAIN = COMMON + """
out, root, scenarios = sys.argv[1], sys.argv[2], sys.argv[3:]
assert "TF_CONFIG" not in os.environ
result = {{}}
for scenario in scenarios:
    loaded = {{}}
    for name in (scenario, scenario + "_full"):
        model = compile_ctr_model(model_fn())
        info = ckpt_lib.load_into(model, os.path.join(root, name))
        loaded[name] = ([tf.convert_to_tensor(w).numpy() for w in model.weights], info.kind)
    (chain, kind), (full, _) = loaded[scenario], loaded[scenario + "_full"]
    result[scenario] = [kind, sum(int(np.sum(a != b)) for a, b in zip(chain, full))]
print("RESULT", json.dumps(result))
"""


def run(tmp_path, shared_cluster, optimizer, scenarios):
    out, root = tmp_path / "out", tmp_path / "dirs"
    out.mkdir()
    return cu.run_chief_for_report(
        shared_cluster(num_workers=2, num_ps=2),
        [cu.PYTHON, cu.script(tmp_path, TRAIN, "train.py"), str(root), str(out),
         OPTIMIZERS[optimizer]] + scenarios, out, timeout=400)


def assert_exact(entry, last, chain):
    assert entry["restored"] == last, entry
    assert entry["chain"] == chain, entry
    assert entry["chain_vs_full"] == [], entry
    assert entry["chain_vs_live"] == [], entry


@pytest.mark.timeout(600)
@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_writes_outside_the_optimizer_reach_the_next_delta(tmp_path, shared_cluster, procs,
                                                          optimizer):
    scenarios = ["reset", "early_stop", "mid_chain"]
    report = run(tmp_path, shared_cluster, optimizer, scenarios)
    assert_exact(report["reset"], ["delta-10", 10], ["delta-10"])
    assert report["early_stop_steps"] == 10, report
    # The best weights, set back after delta-10, saved again at train end (in full).
    assert report["early_stop_saves"] == ["ckpt-10", "ckpt-5", "delta-10"], report
    assert_exact(report["early_stop"], ["delta-15", 15], ["delta-15"])
    assert report["mid_chain_step"] == 10, report
    assert_exact(report["mid_chain"], ["delta-20", 20], ["delta-20"])
    # A plain process loads the chain's weights exactly like the full save's.
    res = procs.run([cu.PYTHON, cu.script(tmp_path, PLAIN, "plain.py"), str(tmp_path / "out"),
                     str(tmp_path / "dirs")] + scenarios, timeout=180)
    assert res.returncode == 0, res.stdout[-6000:]
    assert json.loads(cu.result_line(res.stdout)) == {
        "reset": ["delta", 0], "early_stop": ["delta", 0], "mid_chain": ["delta", 0]}


@pytest.mark.timeout(600)
def test_a_crash_between_any_two_files_of_a_delta_keeps_the_previous_save(
        tmp_path, shared_cluster):
    report = run(tmp_path, shared_cluster, "keras_adagrad", ["crash"])
    points = report["crash"]
    whens = [p["when"] for p in points]
    # Every file of the delta (row bundles of both PS tasks, the dense bundle, the
    # workers' input positions) has a point before and after it.
    assert {"before ps-0", "after ps-0", "before ps-1", "after ps-1", "before dense",
            "after dense", "before the commit marker", "after the commit"} <= set(whens), whens
    for point in points[:-1]:
        assert point["restored"] == ["delta-10", 10], point
        assert point["diff"] == [], point
    assert points[-1]["restored"] == ["delta-15", 15], points[-1]
    assert points[-1]["diff"] == [], points[-1]
    # Keras's Adagrad keeps one accumulator per table shard (with the table
    # stacked, per-table views of the stack shards' slots,
    # tables/stacked_slots.py), checkpointed per table in logical order
    # (tables/slot_order.py): saved row by row (logical ids) like the table,
    # under the table's slot key, not whole with the dense state.
    [table] = report["tables"].values()
    assert len(table["slots"]) == 1, table
    assert not table.get("shard_slots") and not table.get("sharded_slots"), table
    assert report["bytes"]["delta-15"] < report["bytes"]["ckpt-5"], report["bytes"]
