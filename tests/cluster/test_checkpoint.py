"""Multi-process checkpoint tests: chief-only writing, exact restores into any shape, export.

One module-scoped training run (chief + 2 workers + 2 PS on loopback) writes
a model directory with committed checkpoints at steps 3 and 6 and dumps the
exact values (weights, optimizer slots, step) at each, plus the chief's
predictions and a SavedModel export. The other tests restore that directory
into other cluster shapes, into a plain Keras model with no cluster, and from
torn copies of it, and compare with `np.testing.assert_array_equal`.

Model: keras_examples/ctr.py's `build_ctr_model`, tiny (26 x 40-row fused table, width
4), interleaved sharding (the default), legacy Adagrad (table slots on PS).
"""

import json
import os
import shutil

import numpy as np
import pytest

from tests.cluster import _cluster_util as cu

pytestmark = pytest.mark.cluster

COMMON = """
import importlib.util, json, os, sys
import numpy as np
import tensorflow as tf
import tf_psplugin
from tf_psplugin.data import SyntheticCTR
from tf_psplugin.state import checkpoint as ckpt_lib
from tf_psplugin.state import checkpoint_write
from tf_psplugin.state import export as export_lib
# The model of keras_examples/ctr.py (a script, so loaded from its path).
_spec = importlib.util.spec_from_file_location(
    "ctr_example", os.path.join({repo!r}, "keras_examples", "ctr.py"))
_ctr = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_ctr)
build_ctr_model, compile_ctr_model = _ctr.build_ctr_model, _ctr.compile_ctr_model

V, B = 40, 8


def model_fn():
    return build_ctr_model(vocab_size=V, embedding_dim=4, bottom_mlp=(8,), top_mlp=(8,), seed=3)


def new_model(strategy=None):
    if strategy is None:
        return compile_ctr_model(model_fn(), learning_rate=0.1)
    with strategy.scope():
        return compile_ctr_model(model_fn(), learning_rate=0.1)


def logical_trainables(model):
    out, seen = [], set()
    for w in model.trainable_variables:
        ref = getattr(w, "_sharded_container", None)
        container = ref() if callable(ref) else None
        if container is not None:
            if id(container) in seen:
                continue
            seen.add(id(container))
            w = container
        out.append(w)
    return out


def state(model):
    opt = model.optimizer
    values = {{"iter": np.asarray(opt.iterations.numpy())}}
    for i, w in enumerate(logical_trainables(model)):
        values[f"w{{i}}"] = tf.convert_to_tensor(w).numpy()
        values[f"slot{{i}}"] = tf.convert_to_tensor(opt.get_slot(w, "accumulator")).numpy()
    return values


def replicas_match_primaries(model):
    ok = True
    for v in model.variables + model.optimizer.variables():
        if isinstance(v, tf_psplugin.ReplicatedVariable):
            primary = v.primary.numpy()
            ok = ok and all(np.array_equal(r.numpy(), primary) for r in v.replica_values())
    return bool(ok)


def table_shards(model):
    table = model.get_layer("embedding").embeddings
    sharded = isinstance(table, tf.__internal__.distribute.ShardedVariable)
    return len(table.variables) if sharded else 1


def features():  # Not at import: the strategy must come before any TF op.
    return next(iter(SyntheticCTR(vocab_size=V, seed=9).dataset(16, num_batches=1)))[0]
"""

TRAIN = COMMON + """
config = tf_psplugin.start_server()
model_dir, out = sys.argv[1], sys.argv[2]
strategy = tf_psplugin.HybridParameterServerStrategy(
    options=tf_psplugin.HybridOptions(log_placement=False))
gen = SyntheticCTR(vocab_size=V, seed=5)
report = {{}}

# m1 trains 3 steps with the callback (ckpt-3), then keeps going in memory
# without it: the uninterrupted reference for steps 4..6.
m1 = new_model(strategy)
cb1 = tf_psplugin.ChiefCheckpoint(model_dir, save_every_steps=3, final_step=6)
m1.fit(gen.dataset(B), epochs=1, steps_per_epoch=3, verbose=0, callbacks=[cb1])
np.savez(os.path.join(out, "ref3.npz"), **state(m1))
report["done_after_3"] = os.path.exists(os.path.join(model_dir, "TRAINING_DONE"))

# m2 is a fresh model: the callback restores ckpt-3 at train begin; the
# input resumes at the recorded position.
m2 = new_model(strategy)
latest = ckpt_lib.latest_checkpoint_info(model_dir)
report["resume_from"] = [latest.step, latest.input_position]


class AfterRestore(tf.keras.callbacks.Callback):
    def on_train_begin(self, logs=None):
        report["m2_restored_equal_ref3"] = all(
            np.array_equal(v, np.load(os.path.join(out, "ref3.npz"))[k])
            for k, v in state(self.model).items())
        report["m2_replicas_pushed"] = replicas_match_primaries(self.model)


cb2 = tf_psplugin.ChiefCheckpoint(model_dir, save_every_steps=3, final_step=6)
m2.fit(gen.dataset(B, offset_batches=latest.input_position), epochs=1, steps_per_epoch=3,
       verbose=0, callbacks=[cb2, AfterRestore()])
report["restored"] = cb2.restored.step
np.savez(os.path.join(out, "ref6.npz"), **state(m2))
m1.fit(gen.dataset(B, offset_batches=6), epochs=1, steps_per_epoch=3, verbose=0)
np.savez(os.path.join(out, "uninterrupted6.npz"), **state(m1))
report["replicas_identical"] = replicas_match_primaries(m2)

# Chief predictions and a cluster-free export.
np.save(os.path.join(out, "chief_predictions.npy"), m2(features(), training=False).numpy())
report["export"] = export_lib.export_saved_model(m2, os.path.join(out, "export"),
                                                 model_fn=model_fn)
report["listing"] = sorted(os.listdir(model_dir))
report["table_shards"] = table_shards(m2)
# Repeated multi-device saves reuse one traced write (TF's eager path traces
# a new function per save, which stays registered on every PS task).
traced = checkpoint_write.TracedWriteCheckpoint(model=m2, optimizer=m2.optimizer)
for i in range(3):
    traced.write(os.path.join(out, "traced", "w%d" % i))
report["traced_write_traces"] = (traced._write_cache.traces
                                 * traced._write_cache.write.experimental_get_tracing_count())
with open(os.path.join(out, "report.json"), "w") as f:
    json.dump(report, f)
print("RESULT ok")
"""

RESTORE = COMMON + """
config = tf_psplugin.start_server()
out = sys.argv[1]
strategy = tf_psplugin.HybridParameterServerStrategy(
    options=tf_psplugin.HybridOptions(log_placement=False))
report = {{}}
for name, model_dir in zip(sys.argv[2::2], sys.argv[3::2]):
    model = new_model(strategy)
    manager = ckpt_lib.ChiefCheckpointManager(model_dir, model=model, optimizer=model.optimizer)
    info = manager.restore_or_initialize()
    np.savez(os.path.join(out, name + ".npz"), **state(model))
    report[name] = {{"step": info.step, "path": info.path, "shards": table_shards(model),
                    "replicas": replicas_match_primaries(model),
                    "workers": config.num_workers}}
    # Training goes on from the restored state.
    model.fit(SyntheticCTR(vocab_size=V, seed=5).dataset(B), epochs=1, steps_per_epoch=1,
              verbose=0)
    report[name]["iter_after_step"] = int(model.optimizer.iterations.numpy())
with open(os.path.join(out, "report.json"), "w") as f:
    json.dump(report, f)
print("RESULT ok")
"""

PLAIN = COMMON + """
out, model_dir = sys.argv[1], sys.argv[2]
assert "TF_CONFIG" not in os.environ
model = new_model()
info = ckpt_lib.load_into(model, model_dir, include_optimizer=True)
np.savez(os.path.join(out, "plain.npz"), **state(model))
np.save(os.path.join(out, "plain_predictions.npy"), model(features(), training=False).numpy())
print("RESULT", json.dumps({{"step": info.step, "devices": sorted({{v.device for v in
                                                                 model.variables}})}}))
"""

STOCK = COMMON + """
config = tf_psplugin.start_server()
work = sys.argv[1]
strategy = tf_psplugin.HybridParameterServerStrategy(
    options=tf_psplugin.HybridOptions(log_placement=False))
gen = SyntheticCTR(vocab_size=V, seed=5)
wpath, backup = os.path.join(work, "weights", "w"), os.path.join(work, "backup")
report, snap = {{}}, {{}}


class Snap(tf.keras.callbacks.Callback):
    def on_epoch_end(self, epoch, logs=None):
        snap[epoch] = state(self.model)


class Preempt(tf.keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        if epoch == 1:
            raise RuntimeError("simulated preemption")


def same(values, keys=None):
    return all(np.array_equal(values[k], snap[0][k]) for k in (keys or values))


def model_with_slots():
    model = new_model(strategy)
    ckpt_lib.build_optimizer_slots(model)  # Before any stock restore.
    return model


m1 = model_with_slots()
try:
    m1.fit(gen.dataset(B), epochs=2, steps_per_epoch=2, verbose=0, callbacks=[
        tf.keras.callbacks.ModelCheckpoint(wpath, save_weights_only=True),
        tf.keras.callbacks.BackupAndRestore(backup), Snap(), Preempt()])
except RuntimeError as e:
    report["preempted"] = str(e)

m2 = model_with_slots()
m2.load_weights(wpath)
report["load_weights_exact"] = same(state(m2))


class AfterRestore(tf.keras.callbacks.Callback):
    def on_train_begin(self, logs=None):
        report["backup_restore_exact"] = same(state(self.model))


m3 = model_with_slots()
history = m3.fit(gen.dataset(B), epochs=2, steps_per_epoch=2, verbose=0, callbacks=[
    tf.keras.callbacks.BackupAndRestore(backup), AfterRestore()])
report["epochs_after_restore"] = len(history.history["loss"])
report["replicas_identical"] = replicas_match_primaries(m3)
report["backup_deleted"] = not os.path.exists(os.path.join(backup, "chief"))

# Without build_optimizer_slots, model weights still restore exactly.
m4 = new_model(strategy)
m4.load_weights(wpath)
report["load_weights_no_helper_weights_exact"] = all(
    np.array_equal(tf.convert_to_tensor(w).numpy(), snap[0][f"w{{i}}"])
    for i, w in enumerate(logical_trainables(m4)))

# write_on_chief: the chief writes every file; restore is exact too.
manager = ckpt_lib.ChiefCheckpointManager(os.path.join(work, "on_chief"), model=m3,
                                          optimizer=m3.optimizer, write_on_chief=True)
info = manager.save(int(m3.optimizer.iterations.numpy()), final=True)
expected = state(m3)
m5 = new_model(strategy)
ckpt_lib.ChiefCheckpointManager(info.path.rsplit("/", 1)[0], model=m5, optimizer=m5.optimizer,
                                write_on_chief=True).restore()
report["write_on_chief_files"] = sorted(info.files)
report["write_on_chief_exact"] = all(np.array_equal(v, expected[k])
                                     for k, v in state(m5).items())
# One write: a coordinator thread's log line cannot split it (PYTHONUNBUFFERED).
sys.stdout.write("RESULT " + json.dumps(report) + "\\n")
"""

SERVE = """
import json, os, sys
import numpy as np
import tensorflow as tf
from tf_psplugin.data import SyntheticCTR
assert "TF_CONFIG" not in os.environ
features = next(iter(SyntheticCTR(vocab_size=40, seed=9).dataset(16, num_batches=1)))[0]
result = {}
# Grappler off first: the same kernels as the chief's eager call, bit for bit.
# Then the default (grappler fuses MatMul+BiasAdd+Relu; last-bit rounding).
for name, no_grappler in (("exact", True), ("default", False)):
    tf.config.optimizer.set_experimental_options({"disable_meta_optimizer": no_grappler})
    serve = tf.saved_model.load(sys.argv[1]).signatures["serving_default"]
    np.save(os.path.join(sys.argv[2], name + ".npy"), list(serve(**features).values())[0].numpy())
    result["signature_inputs"] = sorted(serve.structured_input_signature[1])
print("RESULT", json.dumps(result))
"""


@pytest.fixture(scope="module")
def trained(tmp_path_factory, _cluster_pool):
    """Runs TRAIN once on chief + 2 workers + 2 PS (the shared ones); yields its directories
    and report."""
    root = tmp_path_factory.mktemp("ckpt_run")
    model_dir, out = root / "model", root / "out"
    out.mkdir()
    with _cluster_pool.borrowed(2, 2) as cluster:
        report = cu.run_chief_for_report(
            cluster, [cu.PYTHON, cu.script(root, TRAIN, "train.py"), str(model_dir), str(out)],
            out, timeout=240)
    yield {"model_dir": model_dir, "out": out, "report": report, "root": root}


def _run_restore(shared_cluster, tmp_path, workers, ps, dirs):
    out = tmp_path / "restore_out"
    out.mkdir()
    args = []
    for name, path in dirs.items():
        args += [name, str(path)]
    cluster = shared_cluster(num_workers=workers, num_ps=ps)
    return out, cu.run_chief_for_report(
        cluster, [cu.PYTHON, cu.script(tmp_path, RESTORE, "restore.py"), str(out)] + args, out,
        timeout=200)


@pytest.mark.timeout(300)
def test_resume_is_exact_and_only_checkpoint_files_are_written(trained):
    report, out = trained["report"], trained["out"]
    # The callback saved at 3 (periodic and train end coincide), no TRAINING_DONE
    # before the final step; the fresh model restored ckpt-3 at train begin.
    assert report["done_after_3"] is False
    assert report["resume_from"] == [3, 6]  # 3 steps x 2 workers' batches.
    assert report["restored"] == 3
    assert report["m2_restored_equal_ref3"], "restore at train begin is not exact"
    assert report["m2_replicas_pushed"], "restored dense values did not reach the workers"
    assert report["replicas_identical"]
    assert report["table_shards"] == 2
    assert report["traced_write_traces"] == 1
    # Restore + resume at the recorded input position == never stopping.
    cu.assert_same_npz(out / "ref6.npz", out / "uninterrupted6.npz")
    # Only the chief's checkpoint files: no temp dirs, no other task's files.
    expected = {"checkpoint", "TRAINING_DONE"}
    for step in (3, 6):
        expected |= {f"ckpt-{step}.index", f"ckpt-{step}.commit"} | {
            f"ckpt-{step}.data-0000{i}-of-00003" for i in range(3)}
    assert set(report["listing"]) == expected, report["listing"]
    with open(trained["model_dir"] / "TRAINING_DONE") as f:
        assert json.load(f)["step"] == 6
    with open(trained["model_dir"] / "ckpt-6.commit") as f:
        marker = json.load(f)
    assert marker["step"] == 6 and marker["input_position"] == 12
    assert set(marker["files"]) == {n for n in expected if n.startswith("ckpt-6.")} - {
        "ckpt-6.commit"}


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_restore_into_three_ps_and_one_worker(trained, shared_cluster, tmp_path):
    out, report = _run_restore(shared_cluster, tmp_path, workers=1, ps=3,
                               dirs={"three_ps": trained["model_dir"]})
    assert report["three_ps"]["step"] == 6 and report["three_ps"]["shards"] == 3
    assert report["three_ps"]["workers"] == 1
    assert report["three_ps"]["replicas"]
    assert report["three_ps"]["iter_after_step"] == 7
    cu.assert_same_npz(trained["out"] / "ref6.npz", out / "three_ps.npz")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_restore_into_one_ps_and_from_torn_checkpoints(trained, shared_cluster, tmp_path):
    src = trained["model_dir"]
    # Torn 1: a PS-written data shard of the newest checkpoint is truncated.
    truncated = tmp_path / "truncated"
    shutil.copytree(src, truncated)
    shard = truncated / "ckpt-6.data-00001-of-00003"
    shard.write_bytes(shard.read_bytes()[:-16])
    # Torn 2: the crash came after TF's state file named ckpt-6 but before the
    # commit marker; ckpt-6's index is gone too.
    uncommitted = tmp_path / "uncommitted"
    shutil.copytree(src, uncommitted)
    (uncommitted / "ckpt-6.commit").unlink()
    (uncommitted / "ckpt-6.index").unlink()
    out, report = _run_restore(shared_cluster, tmp_path, workers=2, ps=1, dirs={
        "one_ps": src, "truncated": truncated, "uncommitted": uncommitted})
    assert report["one_ps"]["step"] == 6 and report["one_ps"]["shards"] == 1
    assert report["one_ps"]["replicas"]
    cu.assert_same_npz(trained["out"] / "ref6.npz", out / "one_ps.npz")
    for torn in ("truncated", "uncommitted"):
        assert report[torn]["step"] == 3, report[torn]
        cu.assert_same_npz(trained["out"] / "ref3.npz", out / f"{torn}.npz")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_stock_keras_checkpoint_callbacks_and_write_on_chief(shared_cluster, tmp_path):
    cluster = shared_cluster(num_workers=2, num_ps=2)
    result = cluster.run_chief([cu.PYTHON, cu.script(tmp_path, STOCK, "stock.py"), str(tmp_path)],
                               timeout=240)
    assert result.returncode == 0, result.stdout[-8000:]
    report = json.loads(cu.result_line(result.stdout))
    assert report["preempted"] == "simulated preemption"
    assert report["load_weights_exact"], "ModelCheckpoint(save_weights_only) + load_weights"
    assert report["backup_restore_exact"], "BackupAndRestore did not restore exactly"
    assert report["epochs_after_restore"] == 1  # Resumed at epoch 1 of 2.
    assert report["replicas_identical"]
    assert report["backup_deleted"]
    assert report["load_weights_no_helper_weights_exact"]
    assert report["write_on_chief_exact"]
    assert report["write_on_chief_files"] == ["ckpt-4.data-0000{}-of-00003".format(i)
                                              for i in range(3)] + ["ckpt-4.index"]


@pytest.mark.timeout(120)
def test_restore_into_plain_keras_model_without_cluster(trained, procs, tmp_path):
    result = procs.run([cu.PYTHON, cu.script(tmp_path, PLAIN, "plain.py"), str(tmp_path),
                        str(trained["model_dir"])], timeout=100)
    assert result.returncode == 0, result.stdout[-6000:]
    data = json.loads(cu.result_line(result.stdout))
    assert data["step"] == 6
    assert all("/job:" not in d or "localhost" in d for d in data["devices"]), data
    cu.assert_same_npz(trained["out"] / "ref6.npz", tmp_path / "plain.npz")
    np.testing.assert_array_equal(np.load(tmp_path / "plain_predictions.npy"),
                                  np.load(trained["out"] / "chief_predictions.npy"))


@pytest.mark.timeout(120)
def test_export_serves_without_cluster(trained, procs, tmp_path):
    export_dir = trained["report"]["export"]
    assert os.path.isabs(export_dir) and os.path.exists(os.path.join(export_dir,
                                                                     "saved_model.pb"))
    assert not [p for p in os.listdir(os.path.dirname(export_dir)) if ".tmp-" in p]
    script = cu.python_script(tmp_path, SERVE, "serve.py")
    result = procs.run([cu.PYTHON, script, export_dir, str(tmp_path)], timeout=100)
    assert result.returncode == 0, result.stdout[-6000:]
    assert json.loads(cu.result_line(result.stdout))["signature_inputs"] == [
        "categorical", "dense"]
    chief = np.load(trained["out"] / "chief_predictions.npy")
    np.testing.assert_array_equal(np.load(tmp_path / "exact.npy"), chief)
    np.testing.assert_allclose(np.load(tmp_path / "default.npy"), chief, rtol=1e-6, atol=1e-7)


@pytest.mark.timeout(400)
def test_resumed_jobs_continue_each_workers_input(shared_cluster, tmp_path):
    """save_input_position / input_iterator: resumed weights equal an uninterrupted run's."""
    cluster = shared_cluster(num_workers=2, num_ps=1)
    script = os.path.join(os.path.dirname(__file__), "scripts", "input_resume.py")
    result = cluster.run_chief([cu.PYTHON, script, str(tmp_path)], timeout=300)
    cu.assert_checks_passed(result, (
        "fit_resumed_input_continues", "input_state_written_by_each_worker",
        "fit_resumed_without_it_starts_over", "custom_loop_resumed_input_continues"))
