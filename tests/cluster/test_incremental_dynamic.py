"""Incremental checkpoints of a DynamicEmbedding on a real cluster: full + deltas restore bit-exact.

A chief + 2 workers + 2 PS train a model whose only table is a
`DynamicEmbedding` (capacity 16: 8 rows per PS, admission after 2
sightings, LRU eviction, expiry after 2 steps) on a key pool that drifts
every 2 steps, so keys are admitted, evicted and expired between every two
saves. `ChiefCheckpointManager(full_every_saves=4)` saves at steps 2 (full), 4, 6 and
8 (deltas); the live model is then saved in full at step 8 into another
directory (the reference). The test checks that

* the deltas hold freed rows (deletions) and sketch counters,
* restoring full + deltas into a fresh model on the same cluster (2 PS),
* into a cluster of 3 PS (another PS count, as full checkpoints of the
  layer allow; the chain is restored by a second, 1-worker cluster),
* and into a plain single-process model (`load_into`: one shard),

give exactly (np.testing.assert_array_equal) every variable the full save
holds for the layer (rows, Adagrad slots, last use, hits, admission sketch,
clock), its key -> row pairs, the dense weights and slots, and the
optimizer step; and that the restored maps are consistent.

A second test trains the same model with `ChiefCheckpoint(full_every_saves=3)`
while a `ServingModel` in a separate process (no cluster) follows the
model directory: after every save (full, delta, delta, full, delta) the
served predictions for raw keys (mapped, newly admitted, evicted or
expired, never seen) equal the chief's `model.predict` and a
single-process `load_into` model's within 1e-6.
"""

import json

import numpy as np
import pytest

from tests.cluster import _cluster_util as cu

pytestmark = pytest.mark.cluster

COMMON = """
import json, os, sys
import numpy as np
import tensorflow as tf
import tf_psplugin
from tf_psplugin.state import checkpoint as ckpt_lib
from tf_psplugin import layers

FEATURES, BATCH, DIM, CAPACITY = 3, 8, 4, 24
ROUNDS, STEPS_PER_ROUND = 4, 2


def make_model():
    inp = tf.keras.Input((FEATURES,), dtype=tf.int64)
    x = layers.DynamicEmbedding(DIM, capacity=CAPACITY, admit_after=2, eviction="lru",
                                expire_after_steps=2, name="dyn")(inp)
    x = tf.keras.layers.Flatten()(x)
    x = tf.keras.layers.Dense(4, activation="relu", name="hidden",
                              kernel_initializer=tf.keras.initializers.GlorotUniform(seed=2))(x)
    out = tf.keras.layers.Dense(1, name="out",
                                kernel_initializer=tf.keras.initializers.GlorotUniform(seed=3))(x)
    model = tf.keras.Model(inp, out)
    model.compile(tf.keras.optimizers.legacy.Adagrad(0.1), "mse")
    return model


def round_data(k):
    # A pool of 24 raw keys that moves on by 8 keys every round: old keys
    # stop appearing (expire), new ones fill the table (evict).
    rng = np.random.RandomState(k)
    pool = np.arange(8 * k, 8 * k + 24, dtype=np.int64) * 7919 - 2**40
    p = 1.0 / np.arange(1, len(pool) + 1) ** 0.8
    ids = pool[rng.choice(len(pool), size=(STEPS_PER_ROUND * 2 * BATCH, FEATURES),
                          p=p / p.sum())]
    y = rng.normal(size=(len(ids), 1)).astype("float32")
    return tf.data.Dataset.from_tensor_slices((ids, y)).batch(BATCH)


def logical(var):
    ref = getattr(var, "_sharded_container", None)
    container = ref() if callable(ref) else None
    return var if container is None else container


def state(model):
    dyn, opt = model.get_layer("dyn"), model.optimizer
    out = {"iterations": np.asarray(opt.iterations.numpy())}
    for name in ("embeddings", "row_last_used", "row_hits", "admission_counts", "clock"):
        out[name] = tf.convert_to_tensor(getattr(dyn, name)).numpy()
    out["embeddings_slot"] = tf.convert_to_tensor(
        opt.get_slot(logical(dyn.embeddings), "accumulator")).numpy()
    keys, rows = (t.numpy() for t in dyn.key_index.export())
    order = np.argsort(keys)
    out["map_keys"], out["map_rows"] = keys[order], rows[order]
    for layer in (model.get_layer("hidden"), model.get_layer("out")):
        for w in layer.weights:
            name = w.name.split(":")[0]
            out[name] = w.numpy()
            out[name + "/slot"] = tf.convert_to_tensor(opt.get_slot(w, "accumulator")).numpy()
    return out
"""

TRAIN = COMMON + """
config = tf_psplugin.start_server()
incr_dir, full_dir, out = sys.argv[1], sys.argv[2], sys.argv[3]
strategy = tf_psplugin.HybridParameterServerStrategy(
    options=tf_psplugin.HybridOptions(log_placement=False))
with strategy.scope():
    model = make_model()
manager = ckpt_lib.ChiefCheckpointManager(incr_dir, model=model, optimizer=model.optimizer,
                                          full_every_saves=ROUNDS)
report = {"kinds": [], "stats": []}
for k in range(ROUNDS):
    model.fit(round_data(k), epochs=1, steps_per_epoch=STEPS_PER_ROUND, verbose=0)
    step = (k + 1) * STEPS_PER_ROUND
    report["kinds"].append(manager.save(step).kind)
    stats = model.get_layer("dyn").table_stats()
    report["stats"].append({name: sum(s[name] for s in stats)
                            for name in ("admitted", "evicted", "expired")})
np.savez(os.path.join(out, "live.npz"), **state(model))
report["live_problems"] = model.get_layer("dyn").check_consistency()
ckpt_lib.ChiefCheckpointManager(full_dir, model=model, optimizer=model.optimizer).save(
    ROUNDS * STEPS_PER_ROUND)

# What the deltas hold: freed rows (held False) and sketch counters.
report["deltas"] = {}
for name in sorted(os.listdir(incr_dir)):
    if not (name.startswith("delta-") and name.endswith(".commit")):
        continue
    with open(os.path.join(incr_dir, name)) as f:
        manifest = json.load(f)["manifest"]
    [entry] = manifest["dynamic"].values()
    freed = held = sketch = 0
    for row_file in manifest["row_files"]:
        reader = tf.train.load_checkpoint(os.path.join(incr_dir, row_file))
        flags = reader.get_tensor(entry["key_index"] + "/.DELTA/held")
        held += int(flags.sum())
        freed += int((~flags).sum())
        sketch += len(reader.get_tensor(entry["sketch"] + "/.DELTA/ids"))
    report["deltas"][name] = {"held": held, "freed": freed, "sketch": sketch,
                              "tables": sorted(manifest["tables"])}

# A fresh model on the same cluster restores the chain.
with strategy.scope():
    restored = make_model()
again = ckpt_lib.ChiefCheckpointManager(incr_dir, model=restored, optimizer=restored.optimizer,
                                        full_every_saves=ROUNDS)
info = again.restore()
report["restored"] = [info.name, info.kind]
np.savez(os.path.join(out, "restored.npz"), **state(restored))
report["restored_problems"] = restored.get_layer("dyn").check_consistency()
with open(os.path.join(out, "report.json"), "w") as f:
    json.dump(report, f)
print("RESULT ok")
"""

RESTORE = COMMON + """
config = tf_psplugin.start_server()
incr_dir, out = sys.argv[1], sys.argv[2]
strategy = tf_psplugin.HybridParameterServerStrategy(
    options=tf_psplugin.HybridOptions(log_placement=False))
with strategy.scope():
    model = make_model()
manager = ckpt_lib.ChiefCheckpointManager(incr_dir, model=model, optimizer=model.optimizer,
                                          full_every_saves=ROUNDS)
info = manager.restore()
dyn = model.get_layer("dyn")
np.savez(os.path.join(out, "restored3.npz"), **state(model))
report = {"restored": [info.name, info.kind], "shards": dyn.num_shards,
          "problems": dyn.check_consistency()}
# Training goes on in the new layout (keys admitted, evicted, expired).
model.fit(round_data(ROUNDS), epochs=1, steps_per_epoch=STEPS_PER_ROUND, verbose=0)
report["problems_after_training"] = dyn.check_consistency()
print("RESULT", json.dumps(report))
"""

PLAIN = COMMON + """
out = sys.argv[1]
assert "TF_CONFIG" not in os.environ
result = {}
for name, model_dir in zip(sys.argv[2::2], sys.argv[3::2]):
    model = make_model()
    info = ckpt_lib.load_into(model, model_dir, include_optimizer=True)
    np.savez(os.path.join(out, name + ".npz"), **state(model))
    result[name] = [info.name, model.get_layer("dyn").check_consistency()]
print("RESULT", json.dumps(result))
"""


@pytest.fixture(scope="module")
def trained(tmp_path_factory, _cluster_pool):
    """Runs TRAIN once on chief + 2 workers + 2 PS (the shared ones); yields its directories
    and report."""
    root = tmp_path_factory.mktemp("incr_dynamic")
    incr_dir, full_dir, out = root / "incr", root / "full", root / "out"
    out.mkdir()
    with _cluster_pool.borrowed(2, 2) as cluster:
        report = cu.run_chief_for_report(
            cluster, [cu.PYTHON, cu.python_script(root, TRAIN, "train.py"), str(incr_dir),
                      str(full_dir), str(out)], out, timeout=200)
    print("REPORT", json.dumps(report))
    yield {"incr": incr_dir, "full": full_dir, "out": out, "report": report}


@pytest.mark.timeout(240)
def test_dynamic_embedding_full_plus_deltas_restore_exactly_like_a_full_save(trained, procs,
                                                                            tmp_path):
    report, out = trained["report"], trained["out"]
    assert report["kinds"] == ["full", "delta", "delta", "delta"], report
    first, last = report["stats"][0], report["stats"][-1]
    # Keys were admitted, evicted and expired after the full save.
    for name in ("admitted", "evicted", "expired"):
        assert last[name] > first[name], report["stats"]
    deltas = report["deltas"]
    assert sorted(deltas) == ["delta-4.commit", "delta-6.commit", "delta-8.commit"]
    assert sum(d["freed"] for d in deltas.values()) > 0, deltas
    assert all(d["held"] > 0 and d["sketch"] > 0 for d in deltas.values()), deltas
    # The layer's rows are a table of the delta (a serving loader patches them).
    assert all(any(t.endswith("/embeddings/.ATTRIBUTES/VARIABLE_VALUE") for t in d["tables"])
               for d in deltas.values()), deltas
    assert report["live_problems"] == []
    assert report["restored"] == ["delta-8", "delta"]
    assert report["restored_problems"] == []
    cu.assert_same_npz(out / "restored.npz", out / "live.npz")
    # One process, one shard: the chain and the reference full save load identically.
    res = procs.run([cu.PYTHON, cu.python_script(tmp_path, PLAIN, "plain.py"), str(tmp_path),
                     "plain_incr", str(trained["incr"]), "plain_full", str(trained["full"])],
                    timeout=120)
    assert res.returncode == 0, res.stdout[-6000:]
    assert json.loads(cu.result_line(res.stdout)) == {"plain_incr": ["delta-8", []],
                                                      "plain_full": ["ckpt-8", []]}
    cu.assert_same_npz(tmp_path / "plain_full.npz", out / "live.npz")
    cu.assert_same_npz(tmp_path / "plain_incr.npz", tmp_path / "plain_full.npz")


@pytest.mark.timeout(240)
def test_dynamic_embedding_chain_restores_exactly_into_3_ps(trained, shared_cluster, tmp_path):
    cluster = shared_cluster(num_workers=1, num_ps=3)
    result = cluster.run_chief([cu.PYTHON, cu.python_script(tmp_path, RESTORE, "restore.py"),
                                str(trained["incr"]), str(tmp_path)], timeout=200)
    assert result.returncode == 0, result.stdout[-8000:]
    report = json.loads(cu.result_line(result.stdout))
    assert report == {"restored": ["delta-8", "delta"], "shards": 3, "problems": [],
                      "problems_after_training": []}, report
    cu.assert_same_npz(tmp_path / "restored3.npz", trained["out"] / "live.npz")


SERVE_COMMON = COMMON + """
import time
SERVE_ROUNDS = 5  # Saves at steps 2 (full), 4, 6 (deltas), 8 (full), 10 (delta).
# Every key the rounds draw from, one round's new keys no round trains on,
# and keys no pool has: each probe row is one key three times, so a row's
# prediction depends on that key alone.
PROBE_KEYS = np.concatenate([
    np.arange(0, 8 * (SERVE_ROUNDS + 1) + 24, dtype=np.int64) * 7919 - 2**40,
    np.array([0, -1, 2**62 + 5], np.int64)])
PROBE = np.repeat(PROBE_KEYS[:, None], FEATURES, axis=1)


def save_npz(path, **arrays):
    np.savez(path + ".tmp.npz", **arrays)
    os.replace(path + ".tmp.npz", path)  # Whole or absent for the other process.


def wait_for(path, seconds):
    deadline = time.time() + seconds
    while not os.path.exists(path):
        if time.time() > deadline:
            raise TimeoutError(f"{path} did not appear in {seconds} s")
        time.sleep(0.2)
"""

SERVE_TRAIN = SERVE_COMMON + """
config = tf_psplugin.start_server()
model_dir, out = sys.argv[1], sys.argv[2]
strategy = tf_psplugin.HybridParameterServerStrategy(
    options=tf_psplugin.HybridOptions(log_placement=False))
with strategy.scope():
    model = make_model()
callback = tf_psplugin.ChiefCheckpoint(model_dir, save_every_steps=STEPS_PER_ROUND,
                                       full_every_saves=3)
report = {"kinds": [], "stats": []}
for k in range(SERVE_ROUNDS):
    model.fit(round_data(k), epochs=1, steps_per_epoch=STEPS_PER_ROUND, verbose=0,
              callbacks=[callback])
    step = (k + 1) * STEPS_PER_ROUND
    full = os.path.exists(os.path.join(model_dir, f"ckpt-{step}.commit"))
    delta = os.path.exists(os.path.join(model_dir, f"delta-{step}.commit"))
    report["kinds"].append("full" if full else "delta" if delta else None)
    stats = model.get_layer("dyn").table_stats()
    report["stats"].append({name: sum(s[name] for s in stats)
                            for name in ("admitted", "evicted", "expired")})
    keys, _ = model.get_layer("dyn").key_index.export()
    # The trained model at this checkpoint, as the chief predicts.
    live = model.predict(PROBE, batch_size=len(PROBE), verbose=0)
    save_npz(os.path.join(out, f"live-{step}.npz"), pred=live, keys=keys.numpy(),
             probe=PROBE_KEYS)
    wait_for(os.path.join(out, f"served-{step}.npz"), 180)  # Then train on.
with open(os.path.join(out, "report.json"), "w") as f:
    json.dump(report, f)
print("RESULT ok")
"""

SERVE = SERVE_COMMON + """
assert "TF_CONFIG" not in os.environ
model_dir, out = sys.argv[1], sys.argv[2]
steps = [(k + 1) * STEPS_PER_ROUND for k in range(SERVE_ROUNDS)]
wait_for(os.path.join(out, f"live-{steps[0]}.npz"), 300)
export = tf_psplugin.export_from_checkpoint(
    make_model, os.path.join(model_dir, f"ckpt-{steps[0]}"), os.path.join(out, "export"))
serving = tf_psplugin.ServingModel(export, model_dir=model_dir)
applied = {}
for step in steps:
    wait_for(os.path.join(out, f"live-{step}.npz"), 300)
    deadline, names = time.time() + 120, []
    while serving.step != step:
        if time.time() > deadline:
            raise TimeoutError(f"serving did not reach step {step}: at {serving.step}")
        names += [i.name for i in serving.poll()]
        time.sleep(0.2)
    applied[step] = names
    served = serving(tf.constant(PROBE)).numpy()
    # A single-process model restored from the same chain.
    reference = make_model()
    info = ckpt_lib.load_into(reference, model_dir)
    assert info.step == step, (info.step, step)
    keys, _ = reference.get_layer("dyn").key_index.export()
    save_npz(os.path.join(out, f"served-{step}.npz"), pred=served,
             reference=reference(PROBE, training=False).numpy(), keys=keys.numpy())
print("RESULT", json.dumps(applied))
"""


@pytest.mark.timeout(600)
def test_serving_model_follows_keys_admitted_evicted_and_expired_like_the_trained_model(
        shared_cluster, procs, tmp_path):
    model_dir, out = tmp_path / "run", tmp_path / "out"
    out.mkdir()
    server = procs.popen([cu.PYTHON, cu.python_script(tmp_path, SERVE, "serve.py"),
                          str(model_dir), str(out)])
    server_output = cu.LineReader(server)
    cluster = shared_cluster(num_workers=2, num_ps=2)
    result = cluster.run_chief([cu.PYTHON, cu.python_script(tmp_path, SERVE_TRAIN, "train.py"),
                                str(model_dir), str(out)], timeout=480)
    assert result.returncode == 0, result.stdout[-8000:] + server_output.text()[-4000:]
    assert server_output.wait_exit(server, timeout=60) == 0, server_output.text()[-8000:]
    applied = json.loads(cu.result_line(server_output.join()))
    with open(out / "report.json") as f:
        report = json.load(f)
    assert report["kinds"] == ["full", "delta", "delta", "full", "delta"], report
    # Each save reached serving as it was written: deltas applied in place,
    # the newer full checkpoint reloaded whole.
    assert applied == {"2": [], "4": ["delta-4"], "6": ["delta-6"], "8": ["ckpt-8"],
                       "10": ["delta-10"]}, applied
    first, last = report["stats"][0], report["stats"][-1]
    for name in ("admitted", "evicted", "expired"):
        assert last[name] > first[name], report["stats"]
    previous = set()
    seen = {"new": 0, "gone": 0, "unmapped": 0}
    for step in (2, 4, 6, 8, 10):
        live = np.load(out / f"live-{step}.npz")
        served = np.load(out / f"served-{step}.npz")
        np.testing.assert_allclose(served["pred"], live["pred"], rtol=0, atol=1e-6,
                                   err_msg=f"step {step}: served vs the chief's predict")
        np.testing.assert_allclose(served["reference"], live["pred"], rtol=0, atol=1e-6,
                                   err_msg=f"step {step}: load_into vs the chief's predict")
        mapped = set(live["keys"].tolist())
        assert set(served["keys"].tolist()) == mapped, step
        probe = live["probe"]
        is_mapped = np.isin(probe, live["keys"])
        # Keys without a row (never seen, waiting, evicted, expired) read the
        # default vector: one prediction for all of them.
        unmapped = served["pred"][~is_mapped]
        assert len(unmapped) and np.all(unmapped == unmapped[0]), step
        seen["unmapped"] += len(unmapped)
        if step > 2:
            seen["new"] += len(set(probe[is_mapped].tolist()) - previous)
            seen["gone"] += len(previous - set(probe[is_mapped].tolist()))
        previous = set(probe[is_mapped].tolist())
        print(f"step {step}: served - live max {np.abs(served['pred'] - live['pred']).max():.2e}, "
              f"mapped {int(is_mapped.sum())} of {len(probe)} probe keys, seen {seen}")
    assert seen["new"] > 0 and seen["gone"] > 0, seen

