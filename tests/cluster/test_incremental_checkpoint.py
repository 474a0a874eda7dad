"""Incremental checkpoints on a real cluster: full + 2 deltas restore bit-exact.

A chief + 2 workers + 2 PS (and, in other runs, 1 PS: the table is then
one variable; 2 PS with contiguous sharding: TF's row-range layout) train
keras_examples/ctr.py's tiny model with
`ChiefCheckpoint(full_every_saves=3, save_every_steps=2)`: ckpt-2 (full), then
delta-4 and delta-6. The same model is then saved in full at step 6 into
another directory (the reference). The test checks that

* restoring full + deltas into a fresh model on the same cluster,
* and into a plain single-process model (`load_into`: tables as one
  variable, i.e. another shard count than the 2-PS writer's),
* and into an export of the full checkpoint followed by a
  `tf_psplugin.ServingModel` (the serving loader) through both deltas,

give exactly (np.testing.assert_array_equal) the weights, table slots and
step of the full save, and that the deltas hold only the touched rows.
"""

import json

import pytest

from tests.cluster import _cluster_util as cu
from tests.cluster.test_checkpoint import COMMON

pytestmark = pytest.mark.cluster

TRAIN = COMMON + """
config = tf_psplugin.start_server()
incr_dir, full_dir, out, sharding = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
strategy = tf_psplugin.HybridParameterServerStrategy(
    options=tf_psplugin.HybridOptions(log_placement=False),
    placement=tf_psplugin.PlacementPolicy(sharding=sharding))
gen = SyntheticCTR(vocab_size=V, seed=5)
report = {{}}
model = new_model(strategy)
callback = tf_psplugin.ChiefCheckpoint(incr_dir, save_every_steps=2, full_every_saves=3,
                                       final_step=6)
model.fit(gen.dataset(B), epochs=1, steps_per_epoch=6, verbose=0, callbacks=[callback])
np.savez(os.path.join(out, "live6.npz"), **state(model))
full = ckpt_lib.ChiefCheckpointManager(full_dir, model=model, optimizer=model.optimizer)
full.save(6)
report["listing"] = sorted(os.listdir(incr_dir))
markers = {{}}
for name in report["listing"]:
    if name.endswith(".commit"):
        with open(os.path.join(incr_dir, name)) as f:
            data = json.load(f)
        markers[name] = {{k: data.get(k) for k in ("kind", "step", "base", "parent")}}
        markers[name]["bytes"] = sum(data["files"].values())
        manifest = data.get("manifest") or {{}}
        markers[name]["tables"] = sorted(manifest.get("tables", {{}}))
report["markers"] = markers
full_markers = [n for n in os.listdir(full_dir) if n.endswith(".commit")]
with open(os.path.join(full_dir, full_markers[0])) as f:
    report["full_bytes"] = sum(json.load(f)["files"].values())
delta = tf.train.load_checkpoint(os.path.join(incr_dir, "delta-6", "ps-0"))
report["delta6_ps0_names"] = sorted(delta.get_variable_to_shape_map())

# A fresh model on this cluster restores the chain (from a copy: the original
# stays as it is for the single-process load).
import shutil
copy_dir = incr_dir + "_copy"
shutil.copytree(incr_dir, copy_dir)
restored = new_model(strategy)
manager = ckpt_lib.ChiefCheckpointManager(copy_dir, model=restored, optimizer=restored.optimizer,
                                          full_every_saves=3, max_to_keep=1)
info = manager.restore_or_initialize()
report["restored"] = [info.path.rsplit("/", 1)[-1], info.step, info.kind]
np.savez(os.path.join(out, "restored.npz"), **state(restored))
report["replicas"] = replicas_match_primaries(restored)
# Training goes on; the first save after a restore is full.
restored.fit(gen.dataset(B, offset_batches=12), epochs=1, steps_per_epoch=1, verbose=0)
report["after_restore_save"] = manager.save(7).kind
# max_to_keep=1 counts chains: ckpt-2 went, and its deltas with it.
report["copy_after_save"] = sorted(n for n in os.listdir(copy_dir)
                                   if n.startswith(("ckpt-", "delta-")))

# Guards: a second incremental manager for the same model, and tracking set
# up after a step was traced, would both miss updates: refused.
def refusal(make):
    try:
        make()
    except Exception as e:  # StrategyError
        return str(e)
    return None


report["second_manager"] = refusal(lambda: ckpt_lib.ChiefCheckpointManager(
    copy_dir + "_2", model=restored, optimizer=restored.optimizer, full_every_saves=3))
late = new_model(strategy)
late.fit(gen.dataset(B), epochs=1, steps_per_epoch=1, verbose=0)
report["after_a_step"] = refusal(lambda: ckpt_lib.ChiefCheckpointManager(
    copy_dir + "_3", model=late, optimizer=late.optimizer, full_every_saves=3))
with open(os.path.join(out, "report.json"), "w") as f:
    json.dump(report, f)
print("RESULT ok")
"""

PLAIN = COMMON + """
out = sys.argv[1]
assert "TF_CONFIG" not in os.environ
result = {{}}
for name, model_dir in zip(sys.argv[2::2], sys.argv[3::2]):
    model = new_model()
    info = ckpt_lib.load_into(model, model_dir, include_optimizer=True)
    np.savez(os.path.join(out, name + ".npz"), **state(model))
    result[name] = [info.step, info.kind]
# A serving process follows the same chain from an export of its full checkpoint.
incr = sys.argv[3]
export = tf_psplugin.export_from_checkpoint(model_fn, os.path.join(incr, "ckpt-2"),
                                            os.path.join(out, "export"))
serving = tf_psplugin.ServingModel(export, model_dir=incr)
result["serving"] = [i.name for i in serving.poll()] + [serving.step]
reference = new_model()
ckpt_lib.load_into(reference, incr)
result["serving_same_weights"] = all(
    np.array_equal(a.numpy(), b) for a, b in zip(serving.loaded.variables,
                                                 reference.get_weights()))
features, _ = next(iter(SyntheticCTR(vocab_size=V, seed=9).dataset(16)))
result["serving_same_output"] = bool(np.allclose(serving(features).numpy(),
                                                 reference(features).numpy(), rtol=1e-5))
print("RESULT", json.dumps(result))
"""


@pytest.mark.timeout(240)
@pytest.mark.parametrize("num_ps,sharding", [(2, "interleaved"), (1, "interleaved"),
                                             (2, "contiguous")])
def test_full_plus_deltas_restore_exactly_like_a_full_save(tmp_path, shared_cluster, procs, num_ps,
                                                           sharding):
    incr_dir, full_dir, out = tmp_path / "incr", tmp_path / "full", tmp_path / "out"
    out.mkdir()
    cluster = shared_cluster(num_workers=2, num_ps=num_ps)
    report = cu.run_chief_for_report(
        cluster, [cu.PYTHON, cu.script(tmp_path, TRAIN, "train.py"), str(incr_dir), str(full_dir),
                  str(out), sharding], out, timeout=200)
    markers = report["markers"]
    assert {k: (v["kind"], v["step"], v["base"], v["parent"]) for k, v in markers.items()} == {
        "ckpt-2.commit": ("full", 2, None, None),
        "delta-4.commit": ("delta", 4, "ckpt-2", "ckpt-2"),
        "delta-6.commit": ("delta", 6, "ckpt-2", "delta-4"),
    }, report
    # The one (fused) table, under its full-checkpoint key.
    [table_key] = markers["delta-6.commit"]["tables"]
    assert table_key.endswith("/embeddings/.ATTRIBUTES/VARIABLE_VALUE"), table_key
    assert table_key + "/.DELTA/ids" in report["delta6_ps0_names"]
    # 2 steps of 8 examples touch a fraction of the 26 x 40 rows: smaller than a full save.
    assert markers["delta-6.commit"]["bytes"] < report["full_bytes"], report
    assert report["restored"] == ["delta-6", 6, "delta"]
    assert report["replicas"] is True
    assert report["after_restore_save"] == "full"
    assert [n for n in report["copy_after_save"] if not n.startswith("ckpt-7")] == [], report
    assert "already tracked" in (report["second_manager"] or ""), report["second_manager"]
    late = report["after_a_step"] or ""
    assert "was traced before row tracking" in late, late
    cu.assert_same_npz(out / "restored.npz", out / "live6.npz")
    # The reference full save and the chain load identically into one process.
    res = procs.run([cu.PYTHON, cu.script(tmp_path, PLAIN, "plain.py"), str(out),
                     "plain_incr", str(incr_dir), "plain_full", str(full_dir)], timeout=120)
    assert res.returncode == 0, res.stdout[-6000:]
    assert json.loads(cu.result_line(res.stdout)) == {
        "plain_incr": [6, "delta"], "plain_full": [6, "full"],
        # tf_psplugin.ServingModel applied the two deltas the cluster wrote, in order.
        "serving": ["delta-4", "delta-6", 6], "serving_same_weights": True,
        "serving_same_output": True}
    cu.assert_same_npz(out / "plain_full.npz", out / "live6.npz")
    cu.assert_same_npz(out / "plain_incr.npz", out / "plain_full.npz")
