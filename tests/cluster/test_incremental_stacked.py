"""Incremental checkpoints of tables sharing a stack restore bit for bit (issue 41 item 3).

A chief + 2 workers + 2 PS train a model of three same-width tables, which
``stack_tables=True`` (the default) stores in ONE stack, with
`ChiefCheckpoint(save_every_steps=5, full_every_saves=100)`: ckpt-5 (full), then,
after a write outside the optimizer to one table of the stack (a reset of
table ``b``, a `scatter_update` of two rows of table ``c``), delta-10 and
delta-15. The tables must stay in one stack (full_every no longer gives each
its own), and the deltas hold each table's own rows: all of ``b`` after its
reset, only the changed rows of ``a`` and ``c`` (every row a step changed
is in the next delta). With Keras's (new) Adagrad, each table's slots are
its rows of the stack shards' slot (`stacked_slots.SlotView`), checkpointed
per table in logical order (`slot_order`, as legacy slots): the deltas
hold them by the table's own changed rows too (logical ids, as legacy
slots), also after writes through the views (an ``assign`` of b's, a
``scatter_update`` of two rows of a's), and a delta stays a small
fraction of a full save. The chain (full + 2 deltas) is restored

* into a fresh stacked model on the cluster: equal to a full save of step
  15 restored the same way, and to the live model (tables, every optimizer
  variable, step);
* into an unstacked model (``stack_tables=False``) on the cluster, by a
  second chief, slots included;
* into a plain single-process model (`load_into(include_optimizer=True)`:
  one variable per table, another PS count), slots included;

each time equal, bit for bit, to the full save restored the same way. A
model built after the manager whose tables join its stack makes the next
save fail with a `CheckpointError` (the stamps no longer cover the stack).
"""

import json

import numpy as np
import pytest

from tests.cluster import _cluster_util as cu
from tests.cluster.test_checkpoint import COMMON
from tests.cluster.test_incremental_writes import OPTIMIZERS
from tf_psplugin._internal.compat import TF_VERSION

pytestmark = pytest.mark.cluster

MODEL = COMMON + """
from tf_psplugin.state import incremental
from tf_psplugin.state import model_dir as model_dir_lib
from tf_psplugin.tables import slot_order, stacked_slots, stacking
# Large enough that a delta (5 steps of 2 x 8 examples) touches a few percent of the rows.
TABLES = {{"a": 20000, "b": 200, "c": 6000}}


def stacked_model(optimizer_src):
    inputs = {{n: tf.keras.Input((2,), dtype=tf.int64, name="ids_" + n) for n in TABLES}}
    init = lambda i: tf.keras.initializers.RandomUniform(seed=i)
    looked = [tf.keras.layers.Flatten()(tf.keras.layers.Embedding(
        v, 4, name=n, embeddings_initializer=init(i))(inputs[n]))
        for i, (n, v) in enumerate(TABLES.items())]
    out = tf.keras.layers.Dense(1, name="out", kernel_initializer=init(9))(
        tf.keras.layers.Concatenate()(looked))
    model = tf.keras.Model({{"ids_" + n: x for n, x in inputs.items()}}, out)
    model.compile(optimizer=eval(optimizer_src), loss="mse")
    return model


def dataset(offset):
    rng = np.random.default_rng(11)
    n = 64 * 8
    x = {{"ids_" + name: rng.integers(0, v, size=(n, 2)) for name, v in TABLES.items()}}
    y = rng.normal(size=(n, 1)).astype("float32")
    return tf.data.Dataset.from_tensor_slices((x, y)).repeat().skip(offset * 8).batch(8)


def tables(model):
    return {{n: model.get_layer(n).embeddings for n in TABLES}}


def accumulator(opt, t):
    \"\"\"Table `t`'s accumulator in logical row order (legacy: get_slot; Keras's: slot_order).\"\"\"
    if hasattr(opt, "get_slot"):
        return opt.get_slot(t, "accumulator")
    slot = slot_order.logical_slot(opt, t, "accumulator")  # A cluster model's.
    if slot is not None:
        return slot
    name = "accumulator/" + t.name.split(":")[0]  # A plain model's: one variable.
    found, = [v for v in opt.variables if name in v.name]
    return found


def logical(model, with_slots):
    \"\"\"Layout-free values: each table, its legacy slots, the dense weights, the step.\"\"\"
    opt = model.optimizer
    values = {{"iter": np.asarray(opt.iterations.numpy())}}
    for n, t in tables(model).items():
        values[n] = tf.convert_to_tensor(t).numpy()
        if with_slots:
            values[n + "/accumulator"] = tf.convert_to_tensor(accumulator(opt, t)).numpy()
    for w in model.get_layer("out").weights:
        values[w.name.split(":")[0]] = w.numpy()
    return values
"""

TRAIN = MODEL + """
config = tf_psplugin.start_server()
root, out, optimizer_src, legacy = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4] == "1"
strategy = tf_psplugin.HybridParameterServerStrategy(
    options=tf_psplugin.HybridOptions(log_placement=False))
report = {{}}


def make():
    with strategy.scope():
        return stacked_model(optimizer_src)


def opt_vars(model):
    opt = model.optimizer
    return opt.variables() if callable(opt.variables) else opt.variables


def snapshot(model):
    values = {{"iter": np.asarray(model.optimizer.iterations.numpy())}}
    for n, t in tables(model).items():
        values[n] = tf.convert_to_tensor(t).numpy()
    for w in model.get_layer("out").weights:
        values[w.name] = w.numpy()
    for i, v in enumerate(opt_vars(model)):
        values[f"opt{{i}}"] = tf.convert_to_tensor(v).numpy()
    return values


def slot_views(model, name):
    \"\"\"(SlotView, shard indices) of table `name`'s slots (Keras's new optimizers).\"\"\"
    t = tables(model)[name]
    spans = [(s.device, o, c) for s, o, c in zip(t.variables, t.row_offsets, t.shard_counts)]
    found = []
    for v in opt_vars(model):
        if isinstance(v, stacked_slots.SlotView):
            mine = [(slot.device, start, count) for slot, start, count in v.pieces]
            if all(p in spans for p in mine):
                found.append((v, [spans.index(p) for p in mine]))
    return found


def diff(a, b):
    if sorted(a) != sorted(b):
        return f"keys differ: {{sorted(set(a) ^ set(b))}}"
    return [(k, int(np.sum(a[k] != b[k]))) for k in a if not np.array_equal(a[k], b[k])]


def restored(model_dir):
    model = make()
    info = ckpt_lib.ChiefCheckpointManager(model_dir, model=model,
                                           optimizer=model.optimizer).restore()
    return model, info


def delta_ids(model_dir, name):
    \"\"\"Table name -> the logical ids a delta holds for it (every PS file).\"\"\"
    variables = incremental.object_keys(tf.train.Checkpoint(model=model))[0]
    layer_of = {{key: n for key, var in variables.items() for n, t in tables(model).items()
                if var is t}}
    marker = model_dir_lib.read_json(os.path.join(model_dir, name + ".commit"))
    found = {{}}
    for row_file in marker["manifest"]["row_files"]:
        reader = tf.train.load_checkpoint(os.path.join(model_dir, row_file))
        for key in marker["manifest"]["tables"]:
            found.setdefault(layer_of[key], []).extend(
                reader.get_tensor(key + "/.DELTA/ids").tolist())
    return {{n: sorted(ids) for n, ids in found.items()}}


def delta_slot_ids_match(model_dir, name):
    \"\"\"Whether each slot's rows in a delta are its table's (per-shard slots: local ids).\"\"\"
    marker = model_dir_lib.read_json(os.path.join(model_dir, name + ".commit"))
    result = []
    for row_file in marker["manifest"]["row_files"]:
        reader = tf.train.load_checkpoint(os.path.join(model_dir, row_file))
        for key, meta in marker["manifest"]["tables"].items():
            table_ids = reader.get_tensor(key + "/.DELTA/ids")
            local = sorted(set((table_ids // 2).tolist()))  # Interleaved over 2 PS.
            slot_names = [k + "/.DELTA/" for k in meta.get("shard_slots", [])]
            slot_names += [f"{{k}}/.DELTA/part-{{s}}/" for k in meta.get("sharded_slots", {{}})
                           for s in range(2)]
            # Slots saved per table (legacy; Keras's listed by slot_order): the table's ids.
            result += [len(reader.get_tensor(k + "/.DELTA/rows")) == len(table_ids)
                       for k in meta["slots"] if reader.has_tensor(k + "/.DELTA/rows")]
            for slot_name in slot_names:
                if reader.has_tensor(slot_name + "ids"):
                    slot_ids = reader.get_tensor(slot_name + "ids").tolist()
                    rows = reader.get_tensor(slot_name + "rows")
                    result.append(sorted(slot_ids) == local and len(rows) == len(slot_ids))
    return result


model_dir = os.path.join(root, "incr")
model = make()
callback = tf_psplugin.ChiefCheckpoint(model_dir, save_every_steps=5, full_every_saves=100)
fit = lambda steps, offset: model.fit(dataset(offset), epochs=1, steps_per_epoch=steps,
                                      verbose=0, callbacks=[callback])
fit(5, 0)  # ckpt-5 (full)
live = tables(model)
report["stacked"] = [isinstance(t, stacking.StackedTable) for t in live.values()]
report["one_stack"] = len({{id(t.stack) for t in live.values()}}) == 1
report["offsets"] = [list(t.row_offsets) for t in live.values()]
# Writes outside the optimizer to two tables of the shared stack.
live["b"].assign(tf.zeros(live["b"].shape))
live["c"].scatter_update(tf.IndexedSlices(tf.ones([2, 4]), tf.constant([3, 17], tf.int64)))
report["view_rows_a"] = []
if not legacy:
    # Writes outside the optimizer to the stack shards' slot, through the
    # per-table views: all of b's slot rows, two rows of a's (in shard 1).
    views_b = slot_views(model, "b")
    report["views_b"] = sum(len(shards) for _, shards in views_b)
    for view, _ in views_b:
        view.assign(tf.fill(view.shape, 0.25))
    for view, shards in slot_views(model, "a"):
        if shards == [1]:  # Keras 2.15: one view per shard (tf-keras: the table's whole slot).
            view.scatter_update(tf.IndexedSlices(tf.fill([2, 4], 0.5),
                                                 tf.constant([5, 9], tf.int64)))
            report["view_rows_a"] = [5 * 2 + 1, 9 * 2 + 1]  # Logical ids (interleaved).
fit(5, 5)  # delta-10
at10 = logical(model, False)
fit(5, 10)  # delta-15
at15 = logical(model, False)
report["ids10"] = delta_ids(model_dir, "delta-10")
report["ids15"] = delta_ids(model_dir, "delta-15")
# Every row a step changed is in the delta, by table.
report["changed15_missing"] = {{
    n: sorted(set(np.nonzero(np.any(at10[n] != at15[n], axis=1))[0].tolist())
              - set(report["ids15"][n])) for n in TABLES}}
report["changed15"] = {{n: int(np.sum(np.any(at10[n] != at15[n], axis=1))) for n in TABLES}}
markers = {{n: model_dir_lib.read_json(os.path.join(model_dir, n + ".commit"))
           for n in ("ckpt-5", "delta-10", "delta-15")}}
report["kinds"] = [m["kind"] for m in markers.values()]
report["bytes"] = {{n: sum(m["files"].values()) for n, m in markers.items()}}
report["delta_slot_ids_match"] = delta_slot_ids_match(model_dir, "delta-15")
report["slots"] = {{  # Per table: its slots, per-shard slots (Keras's new optimizers).
    n: [len(t["slots"]), len(t.get("shard_slots", [])), sum(t.get("sharded_slots", {{}}).values())]
    for n, t in markers["delta-15"]["manifest"]["tables"].items()}}
live_values = snapshot(model)
np.savez(os.path.join(out, "live.npz"), **logical(model, True))
full_dir = os.path.join(root, "full")
ckpt_lib.ChiefCheckpointManager(full_dir, model=model, optimizer=model.optimizer).save(15)
chain_model, info = restored(model_dir)
full_model, _ = restored(full_dir)
report["restored"] = [info.name, info.step]
report["chain_stacked"] = all(isinstance(t, stacking.StackedTable)
                              for t in tables(chain_model).values())
report["chain_vs_full"] = diff(snapshot(chain_model), snapshot(full_model))
report["chain_vs_live"] = diff(snapshot(chain_model), live_values)
# A model built after the manager whose tables join the tracked stack: the
# stamps no longer cover the stack's rows, so the save refuses (not a wrong delta).
fresh = make()
late = ckpt_lib.ChiefCheckpointManager(os.path.join(root, "late"), model=fresh,
                                       optimizer=fresh.optimizer, full_every_saves=3)
joined = make()
report["joined_same_stack"] = any(t.stack is tables(fresh)["a"].stack
                                  for t in tables(joined).values())
try:
    late.save(0)
    report["late_join"] = None
except ckpt_lib.CheckpointError as e:
    report["late_join"] = str(e)
with open(os.path.join(out, "report.json"), "w") as f:
    json.dump(report, f)
print("RESULT ok")
"""

UNSTACKED = MODEL + """
config = tf_psplugin.start_server()
root, out, optimizer_src = sys.argv[1], sys.argv[2], sys.argv[3]
strategy = tf_psplugin.HybridParameterServerStrategy(
    options=tf_psplugin.HybridOptions(log_placement=False, stack_tables=False))
result = {{}}
for name in ("incr", "full"):
    with strategy.scope():
        model = stacked_model(optimizer_src)
    info = ckpt_lib.ChiefCheckpointManager(os.path.join(root, name), model=model,
                                           optimizer=model.optimizer).restore()
    result[name] = [info.name, any(isinstance(t, stacking.StackedTable)
                                   for t in tables(model).values())]
    np.savez(os.path.join(out, f"unstacked_{{name}}.npz"), **logical(model, True))
print("RESULT", json.dumps(result))
"""

PLAIN = MODEL + """
root, out, optimizer_src, legacy = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4] == "1"
assert "TF_CONFIG" not in os.environ
result = {{}}
for name in ("incr", "full"):
    model = stacked_model(optimizer_src)
    info = ckpt_lib.load_into(model, os.path.join(root, name), include_optimizer=True)
    result[name] = [info.name, info.kind]
    np.savez(os.path.join(out, f"plain_{{name}}.npz"), **logical(model, True))
print("RESULT", json.dumps(result))
"""


@pytest.mark.timeout(600)
@pytest.mark.parametrize("optimizer", ["legacy_adagrad", "keras_adagrad"])
def test_tables_sharing_a_stack_restore_from_deltas_bit_for_bit(tmp_path, shared_cluster, procs,
                                                                 optimizer):
    legacy = "1" if optimizer.startswith("legacy") else "0"
    out, root = tmp_path / "out", tmp_path / "dirs"
    out.mkdir()
    cluster = shared_cluster(num_workers=2, num_ps=2)
    report = cu.run_chief_for_report(
        cluster, [cu.PYTHON, cu.script(tmp_path, TRAIN, "train.py"), str(root), str(out),
                  OPTIMIZERS[optimizer], legacy], out, timeout=400)
    # One stack for the three tables, each at its own rows.
    assert report["stacked"] == [True, True, True] and report["one_stack"], report
    assert len({tuple(o) for o in report["offsets"]}) == 3, report["offsets"]
    assert report["kinds"] == ["full", "delta", "delta"], report["kinds"]
    # Each table's own rows: all of the reset table, a part of the others.
    ids10, ids15 = report["ids10"], report["ids15"]
    assert ids10["b"] == list(range(200)), ids10["b"][:20]
    for name, rows in (("a", 20000), ("c", 6000)):
        for ids in (ids10[name], ids15[name]):
            assert 0 < len(ids) < rows // 2 and len(set(ids)) == len(ids), (name, len(ids))
            assert all(0 <= i < rows for i in ids), name
    assert {3, 17} <= set(ids10["c"]), ids10["c"][:20]
    # A write through a slot view stamps the table's rows of the stack shard
    # (only those: a and c stay partial above).
    assert set(report["view_rows_a"]) <= set(ids10["a"]), report["view_rows_a"]
    assert 0 < len(ids15["b"]) < 200, len(ids15["b"])
    assert report["changed15_missing"] == {"a": [], "b": [], "c": []}, report
    assert all(report["changed15"][n] > 0 for n in "abc"), report["changed15"]
    ratio = report["bytes"]["delta-15"] / report["bytes"]["ckpt-5"]
    print(f"delta-15 / ckpt-5 bytes: {ratio:.3f} {report['bytes']}")
    # Every slot row-tracked: a delta is a few percent of a full save (a
    # slot saved whole would make it more than half of one).
    assert ratio < 0.1, report["bytes"]
    # The accumulator of each table, under the table's slot key, by the
    # table's logical ids: legacy slots, and Keras's new optimizers' (each
    # table's rows of the stack shards' slot, listed per table in logical
    # order by slot_order; writes through the per-table views of it,
    # stacked_slots, are stamped: the table's rows).
    slots = sorted(report["slots"].values())
    assert slots == [[1, 0, 0]] * 3, report["slots"]
    assert report["delta_slot_ids_match"] and all(report["delta_slot_ids_match"]), report
    if legacy == "0":
        assert report["views_b"] == 2, report
        assert report["view_rows_a"] or TF_VERSION >= (2, 16), report
    # Restored stacked on the cluster: the full save's and the live model's values.
    assert report["restored"] == ["delta-15", 15], report["restored"]
    assert report["chain_stacked"] is True
    assert report["chain_vs_full"] == [], report["chain_vs_full"]
    assert report["chain_vs_live"] == [], report["chain_vs_live"]
    assert report["joined_same_stack"] is True
    assert "another table joined its stack" in (report["late_join"] or ""), report["late_join"]
    # Slots saved per table: an unstacked model restores them too.
    res = cluster.run_chief([cu.PYTHON, cu.script(tmp_path, UNSTACKED, "unstacked.py"),
                             str(root), str(out), OPTIMIZERS[optimizer]], timeout=200)
    assert res.returncode == 0, res.stdout[-6000:]
    assert json.loads(cu.result_line(res.stdout)) == {
        "incr": ["delta-15", False], "full": ["ckpt-15", False]}
    cu.assert_same_npz(out / "unstacked_incr.npz", out / "unstacked_full.npz")
    cu.assert_same_npz(out / "unstacked_incr.npz", out / "live.npz")
    # One process, one variable per table (another PS count): same as the full save.
    res = procs.run([cu.PYTHON, cu.script(tmp_path, PLAIN, "plain.py"), str(root), str(out),
                     OPTIMIZERS[optimizer], legacy], timeout=180)
    assert res.returncode == 0, res.stdout[-6000:]
    assert json.loads(cu.result_line(res.stdout)) == {
        "incr": ["delta-15", "delta"], "full": ["ckpt-15", "full"]}
    cu.assert_same_npz(out / "plain_incr.npz", out / "plain_full.npz")
    cu.assert_same_npz(out / "plain_incr.npz", out / "live.npz")
