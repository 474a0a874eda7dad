"""tf_psplugin.state.serving: an export kept fresh from deltas, in one process.

Deltas are written by hand in the documented format (as in
test_incremental_unit.py); tests/cluster/test_incremental_checkpoint.py
follows deltas a real cluster wrote, and benchmarks/incremental.py
measures freshness with a separate serving process.
"""

import json
import os
import threading
import time

import numpy as np
import pytest
import tensorflow as tf

import tf_psplugin
from tf_psplugin.state import incremental
from tf_psplugin.state import model_dir as md
from tf_psplugin.state import serving
from tests.unit.test_incremental_unit import DIM, TABLE_KEY, tiny_model, write_delta, write_full

IDS = np.array([[1, 5], [7, 19], [0, 3]], np.int64)


@pytest.fixture(autouse=True)
def no_tf_config(monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)


def served_weights(model):
    return [v.numpy() for v in model.loaded.variables]


def reference(model_dir):
    """A plain model restored from the same chain by `load_into`."""
    model = tiny_model()
    info = tf_psplugin.load_into(model, model_dir)
    return model, info


def assert_serves_like(served, model):
    for mine, theirs in zip(served_weights(served), model.get_weights()):
        np.testing.assert_array_equal(mine, theirs)
    np.testing.assert_allclose(served(tf.constant(IDS)).numpy(),
                               model(IDS).numpy(), rtol=1e-6)


def train_a_little(model, ids, scale):
    """Changes the rows `ids` and every dense weight (what a step would do)."""
    table = model.get_layer("table").embeddings
    rows = table.numpy()[ids] + scale
    table.scatter_update(tf.IndexedSlices(tf.constant(rows), tf.constant(ids, tf.int64)))
    for w in model.get_layer("out").weights:
        w.assign(w + scale)
    return rows


def test_export_records_keys_and_its_checkpoint(tmp_path):
    model_dir = str(tmp_path / "run")
    write_full(model_dir, 2)
    export = tf_psplugin.export_from_checkpoint(tiny_model, model_dir, str(tmp_path / "export"))
    with open(os.path.join(export, serving.SERVING_METADATA)) as f:
        data = json.load(f)
    assert data["checkpoint"] == {"name": "ckpt-2", "step": 2, "base": "ckpt-2"}
    assert [v["key"] for v in data["variables"]][0] == TABLE_KEY
    assert all(v["key"].startswith("model/layer_with_weights-") for v in data["variables"])
    # The export is still an ordinary SavedModel.
    assert tf.saved_model.load(export)(tf.constant(IDS)).shape == (3, 1)


def test_follows_the_chain_torn_delta_and_a_newer_full(tmp_path):
    model_dir = str(tmp_path / "run")
    trained = tiny_model()
    write_full(model_dir, 2, trained)
    export = tf_psplugin.export_from_checkpoint(tiny_model, model_dir, str(tmp_path / "export"))
    served = tf_psplugin.ServingModel(export, model_dir=model_dir)
    assert (served.checkpoint, served.step) == ("ckpt-2", 2)
    assert served.poll() == []
    assert_serves_like(served, trained)

    before = served(tf.constant(IDS)).numpy()
    rows = train_a_little(trained, [1, 5], 0.25)
    write_delta(model_dir, 4, "ckpt-2", "ckpt-2", model=trained, ids=[1, 5], rows=rows)
    rows = train_a_little(trained, [7, 5], -0.5)
    write_delta(model_dir, 6, "ckpt-2", "delta-4", model=trained, ids=[7, 5], rows=rows)
    assert [i.name for i in served.poll()] == ["delta-4", "delta-6"]
    assert (served.checkpoint, served.step) == ("delta-6", 6)
    model, info = reference(model_dir)
    assert info.name == "delta-6"
    assert_serves_like(served, model)
    assert_serves_like(served, trained)
    assert not np.allclose(before, served(tf.constant(IDS)).numpy())
    assert served.poll() == []

    # delta-8 is torn (a file shorter than its marker says): neither it nor
    # delta-10 (whose rows are relative to it) is applied.
    kept = [w.copy() for w in served_weights(served)]
    rows = train_a_little(trained, [0], 1.0)
    torn = write_delta(model_dir, 8, "ckpt-2", "delta-6", model=trained, ids=[0], rows=rows)
    data = [n for n in torn.files if n.startswith("delta-8/ps-0.data")][0]
    with open(os.path.join(model_dir, data), "r+b") as f:
        f.truncate(4)
    rows = train_a_little(trained, [3], 1.0)
    write_delta(model_dir, 10, "ckpt-2", "delta-8", model=trained, ids=[3], rows=rows)
    assert served.poll() == []
    assert served.step == 6
    for mine, theirs in zip(served_weights(served), kept):
        np.testing.assert_array_equal(mine, theirs)

    # A newer full checkpoint: its tables and dense weights reloaded whole, then its chain.
    newer = tiny_model()
    train_a_little(newer, list(range(20)), 2.0)
    write_full(model_dir, 12, newer)
    rows = train_a_little(newer, [2], 0.5)
    write_delta(model_dir, 14, "ckpt-12", "ckpt-12", model=newer, ids=[2], rows=rows)
    assert [i.name for i in served.poll()] == ["ckpt-12", "delta-14"]
    assert (served.checkpoint, served.step) == ("delta-14", 14)
    assert_serves_like(served, newer)


def test_an_export_of_a_delta_follows_from_that_delta(tmp_path):
    model_dir = str(tmp_path / "run")
    trained = tiny_model()
    write_full(model_dir, 2, trained)
    rows = train_a_little(trained, [4], 0.25)
    write_delta(model_dir, 4, "ckpt-2", "ckpt-2", model=trained, ids=[4], rows=rows)
    export = tf_psplugin.export_from_checkpoint(tiny_model, model_dir, str(tmp_path / "export"))
    served = tf_psplugin.ServingModel(export, model_dir=model_dir)
    assert (served.checkpoint, served.step) == ("delta-4", 4)
    rows = train_a_little(trained, [9], 0.25)
    write_delta(model_dir, 6, "ckpt-2", "delta-4", model=trained, ids=[9], rows=rows)
    assert [i.name for i in served.poll()] == ["delta-6"]
    assert_serves_like(served, trained)


def test_wrong_base_is_refused_with_the_fix(tmp_path):
    write_full(str(tmp_path / "a"), 20)
    export = tf_psplugin.export_from_checkpoint(tiny_model, str(tmp_path / "a"),
                                                str(tmp_path / "export"))
    other = str(tmp_path / "b")
    write_full(other, 10)
    served = tf_psplugin.ServingModel(export, model_dir=other)
    with pytest.raises(tf_psplugin.ServingError) as e:
        served.poll()
    message = str(e.value)
    assert "ckpt-20" in message and "ckpt-10" in message, message
    assert "Fix: follow the model_dir the export was made from" in message, message
    assert "export_from_checkpoint" in message, message
    assert isinstance(e.value, tf_psplugin.CheckpointError)


def test_an_export_without_metadata_is_refused(tmp_path):
    tiny_model().save(str(tmp_path / "plain"), save_format="tf", include_optimizer=False)
    with pytest.raises(tf_psplugin.ServingError, match="Fix: export it again"):
        tf_psplugin.ServingModel(str(tmp_path / "plain"), model_dir=str(tmp_path))


def test_live_export_loads_the_latest_chain_first(tmp_path):
    model_dir = str(tmp_path / "run")
    trained = tiny_model()
    export = tf_psplugin.export_saved_model(trained, str(tmp_path / "export"), model_fn=tiny_model)
    served = tf_psplugin.ServingModel(export, model_dir=model_dir)
    assert served.checkpoint is None and served.poll() == []  # Nothing saved yet.
    rows = train_a_little(trained, [1], 0.5)
    write_full(model_dir, 3, trained)
    rows = train_a_little(trained, [1], 0.5)
    write_delta(model_dir, 5, "ckpt-3", "ckpt-3", model=trained, ids=[1], rows=rows)
    assert [i.name for i in served.poll()] == ["ckpt-3", "delta-5"]
    assert_serves_like(served, trained)


def test_background_poller_and_requests_see_one_checkpoint(tmp_path, monkeypatch):
    """Requests during polls see the table and the dense weights of the same step."""
    target = serving.ServingModel._target

    def slow_target(self, key, where):  # Widens the window between two assignments.
        time.sleep(0.005)
        return target(self, key, where)

    monkeypatch.setattr(serving.ServingModel, "_target", slow_target)
    model_dir = str(tmp_path / "run")
    trained = tiny_model()
    table = trained.get_layer("table").embeddings
    table.assign(tf.zeros_like(table))
    write_full(model_dir, 0, trained)
    export = tf_psplugin.export_from_checkpoint(tiny_model, model_dir, str(tmp_path / "export"))
    served = tf_psplugin.ServingModel(export, model_dir=model_dir)
    kernel = served.loaded.variables[1]
    seen, stop = [], threading.Event()

    def requests():
        call = served.signature()
        while not stop.is_set():
            out = call(ids=tf.constant([[0, 0]], tf.int64))
            seen.append(next(iter(out.values())).numpy().ravel()[0])

    # Step s sets row 0 to s and every kernel entry to 1/s, bias 0: a
    # consistent state answers 2 * DIM * s * (1/s) = 2 * DIM.
    out = trained.get_layer("out")
    out.bias.assign(tf.zeros_like(out.bias))
    thread = threading.Thread(target=requests)
    served.start(poll_seconds=0.01)
    thread.start()
    try:
        parent = "ckpt-0"
        for s in range(1, 9):
            out.kernel.assign(tf.fill(out.kernel.shape, 1.0 / s))
            write_delta(model_dir, s, "ckpt-0", parent, model=trained, ids=[0],
                        rows=np.full([1, DIM], float(s), np.float32))
            parent = f"delta-{s}"
        deadline = time.time() + 30
        while served.step != 8 and time.time() < deadline:
            time.sleep(0.05)
    finally:
        stop.set()
        thread.join()
        served.stop()
    assert served.step == 8 and served.last_error is None
    assert kernel.numpy().ravel()[0] == pytest.approx(1 / 8)
    consistent = [v for v in seen if v == pytest.approx(2 * DIM, rel=1e-5)]
    initial = [v for v in seen if v == 0.0]
    assert len(consistent) + len(initial) == len(seen), sorted(set(seen))[:10]
    assert consistent, "no request was answered after the first delta"


def test_a_delta_removed_while_read_is_tried_again(tmp_path, monkeypatch):
    model_dir = str(tmp_path / "run")
    trained = tiny_model()
    write_full(model_dir, 2, trained)
    export = tf_psplugin.export_from_checkpoint(tiny_model, model_dir, str(tmp_path / "export"))
    served = tf_psplugin.ServingModel(export, model_dir=model_dir)
    rows = train_a_little(trained, [1], 0.25)
    write_delta(model_dir, 4, "ckpt-2", "ckpt-2", model=trained, ids=[1], rows=rows)
    listed = serving.model_dir_lib.checkpoint_chain(model_dir)
    # The chief's retention deletes it (marker first) between listing and reading.
    marker = os.path.join(model_dir, "delta-4.commit")
    with open(marker) as f:
        kept = f.read()
    os.remove(marker)
    monkeypatch.setattr(serving.model_dir_lib, "checkpoint_chain", lambda _: listed)
    assert served.poll() == [] and served.step == 2
    monkeypatch.undo()
    with open(marker, "w") as f:
        f.write(kept)
    assert [i.name for i in served.poll()] == ["delta-4"]
    assert_serves_like(served, trained)


def dynamic_setup(tmp_path, **kwargs):
    """A DynamicEmbedding model trained in one process, tracked as the saver would track it."""
    from tests.unit import test_incremental_dynamic as tid  # pylint: disable=g-import-not-at-top

    def model_fn():
        return tid.layer_model(**kwargs)[1]

    model, layer, table, stamps, generation = tid.tracked_model(**kwargs)
    return model_fn, model, layer, table, stamps, generation, tid.start_save


def write_dynamic_delta(model_dir, step, base, parent, model, table, stamps, since):
    """A delta of the layer's rows changed since the last save, in the documented format."""
    prefix = os.path.join(model_dir, f"delta-{step}")
    tf.io.gfile.makedirs(prefix)
    local = table.dirty_rows(0, stamps, since)
    pieces = {table.table_key + "/.DELTA/ids": local.numpy(),
              table.table_key + "/.DELTA/rows": tf.gather(table.layer.embeddings, local).numpy()}

    def add(name, tensor):
        pieces[name] = tensor.numpy()

    table.add_row_pieces(0, local, local, add)
    if table.sketch is not None:
        table.add_sketch_pieces(0, add)
    tf.raw_ops.SaveV2(prefix=os.path.join(prefix, "ps-0"), tensor_names=list(pieces),
                      shape_and_slices=[""] * len(pieces), tensors=list(pieces.values()))
    variables, _, _ = incremental.object_keys(tf.train.Checkpoint(model=model))
    [clock_key] = [k for k, v in variables.items() if v is table.layer.clock]
    tf.raw_ops.SaveV2(prefix=os.path.join(prefix, "dense"), tensor_names=[clock_key],
                      shape_and_slices=[""], tensors=[table.layer.clock.numpy()])
    layer = table.layer
    manifest = {"tables": {table.table_key: {"shape": [layer.capacity, layer.output_dim],
                                             "dtype": "float32", "slots": []}},
                "row_files": [f"delta-{step}/ps-0"], "dense": f"delta-{step}/dense",
                "dynamic": {table.path: table.manifest()}}
    return md.commit_delta(prefix, step, None, base=base, parent=parent, manifest=manifest)


def assert_serves_keys_like(served, model, probe, model_fn, model_dir):
    """Served vectors for raw keys == the live model's at inference == `load_into`'s."""
    want = model(probe, training=False).numpy()
    np.testing.assert_allclose(served(probe).numpy(), want, rtol=0, atol=1e-6)
    restored = model_fn()
    tf_psplugin.load_into(restored, model_dir)
    np.testing.assert_array_equal(restored(probe, training=False).numpy(), want)
    for mine, theirs in zip(served_weights(served), restored.get_weights()):
        np.testing.assert_array_equal(mine, theirs)
    return want


@pytest.mark.parametrize("key_dtype", ["int64", "string"])
def test_dynamic_embedding_keys_follow_admission_eviction_and_expiry(tmp_path, key_dtype):
    """New keys get their rows, evicted and expired keys read the default, as in training."""
    kwargs = dict(capacity=6, eviction="lru", expire_after_steps=2, default_value=0.25,
                  key_dtype=tf.as_dtype(key_dtype), admit_after=1 if key_dtype == "string" else 2)
    model_fn, model, layer, table, stamps, generation, start_save = dynamic_setup(
        tmp_path, **kwargs)
    keys = (np.arange(40, dtype=np.int64) * 7919 - 2**40 if key_dtype == "int64"
            else np.array([f"item-{i}".encode() for i in range(40)], object))

    def train(*batches):
        for batch in batches:
            layer(tf.constant(keys[np.asarray(batch)].reshape(-1, 2)), training=True)

    def mapped():
        exported, _ = layer.key_index.export()
        return {k for k in exported.numpy().tolist()}

    model_dir = str(tmp_path / "run")
    train(*[[0, 1, 2, 3]] * 3)
    tf.train.Checkpoint(model=model).write(os.path.join(model_dir, "ckpt-2"))
    md.commit_checkpoint(os.path.join(model_dir, "ckpt-2"), 2, None)
    start_save(table, generation, full=True)
    export = tf_psplugin.export_from_checkpoint(model_fn, model_dir, str(tmp_path / "export"))
    served = tf_psplugin.ServingModel(export, model_dir=model_dir)
    probe = tf.constant(keys[:16].reshape(8, 2))
    assert_serves_keys_like(served, model, probe, model_fn, model_dir)
    at_full = mapped()

    # Delta 4: keys 4.. fill the table and evict 0..3; delta 6: only key 10
    # is used, the others expire. Both applied by one poll.
    train(*[[4, 5, 6, 7], [8, 9, 10, 11]] * 2)
    since = start_save(table, generation, full=False)
    write_dynamic_delta(model_dir, 4, "ckpt-2", "ckpt-2", model, table, stamps, since)
    at_4 = mapped()
    train(*[[10, 10]] * 4)
    since = start_save(table, generation, full=False)
    write_dynamic_delta(model_dir, 6, "ckpt-2", "delta-4", model, table, stamps, since)
    stats = layer.table_stats()[0]
    assert stats["evicted"] > 0 and stats["expired"] > 0, stats
    assert [i.name for i in served.poll()] == ["delta-4", "delta-6"]
    want = assert_serves_keys_like(served, model, probe, model_fn, model_dir)
    now = mapped()
    gone, new = at_full - now, (at_4 | now) - at_full
    assert gone and new and now, (at_full, at_4, now)
    # An evicted or expired key reads the default; a mapped key its row.
    flat = probe.numpy().reshape(-1)
    vectors = want.reshape(-1, layer.output_dim)
    for key, vector in zip(flat.tolist(), vectors):
        if key in now:
            assert not np.all(vector == 0.25), key
        else:
            np.testing.assert_array_equal(vector, 0.25)

    # A newer full checkpoint (after a key came back) is reloaded whole.
    train(*[[0, 1, 10, 10]] * 2)
    tf.train.Checkpoint(model=model).write(os.path.join(model_dir, "ckpt-8"))
    md.commit_checkpoint(os.path.join(model_dir, "ckpt-8"), 8, None)
    assert [i.name for i in served.poll()] == ["ckpt-8"]
    assert_serves_keys_like(served, model, probe, model_fn, model_dir)
    assert {keys[0].item() if key_dtype == "int64" else keys[0]} <= mapped()


def test_dynamic_embedding_exports_of_older_versions_and_unknown_layers_are_refused(tmp_path):
    """An export that does not say where its key maps are, or lacks a delta's layer."""
    model_fn, model, layer, *_ = dynamic_setup(tmp_path, capacity=16)
    export = str(tmp_path / "export")
    tf_psplugin.export_saved_model(model, export, model_fn=model_fn)
    path = os.path.join(export, serving.SERVING_METADATA)
    with open(path) as f:
        metadata = json.load(f)
    [entry] = metadata["dynamic_tables"]
    assert entry["name"] == "dyn" and entry["key_index"] == entry["path"] + "/key_index", entry
    tf_psplugin.ServingModel(export)  # Serving it as it is works.
    # The metadata an older version wrote: layer names only.
    del metadata["dynamic_tables"]
    metadata["dynamic_embeddings"] = ["dyn"]
    with open(path, "w") as f:
        json.dump(metadata, f)
    served = tf_psplugin.ServingModel(export, model_dir=str(tmp_path / "run"))
    with pytest.raises(tf_psplugin.ServingError, match=r"dyn: the export does not record.*Fix:"):
        served.poll()
    # A delta that changes a DynamicEmbedding's keys, followed by an export
    # without that layer: refused.
    model_dir = str(tmp_path / "plain")
    write_full(model_dir, 2)
    plain = tf_psplugin.export_from_checkpoint(tiny_model, model_dir, str(tmp_path / "e2"))
    delta = write_delta(model_dir, 4, "ckpt-2", "ckpt-2")
    marker = delta.path + ".commit"
    with open(marker) as f:
        data = json.load(f)
    data["manifest"]["dynamic"] = {"model/layer_with_weights-0": {
        "key_index": "model/layer_with_weights-0/key_index"}}
    with open(marker, "w") as f:
        json.dump(data, f)
    with pytest.raises(tf_psplugin.ServingError, match="which the export .* has not got"):
        tf_psplugin.ServingModel(plain, model_dir=model_dir).poll()
