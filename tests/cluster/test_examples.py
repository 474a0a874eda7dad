"""CI runs every Keras example for a few steps: a broken example is a broken product.

Each example runs exactly as its README says, under the local launcher
(`python -m tf_psplugin.launch --workers 2 --ps 1 -- python <example>`,
every task of the cluster started from the same command line), and must exit
0 with its progress lines in the role-prefixed log. One more test starts the
tasks by hand with `--job_name/--task_index/--*_hosts` flags, the other way
the README documents.

`dynamic_ctr.py` runs on generated raw ids and on Criteo-format raw string
ids, restarted with another PS count from its checkpoint.

`online_ctr.py` trains on its endless stream with incremental checkpoints,
the evaluator and the serving process following.

`first_model.py` is README's first model (tests/unit/test_doc_examples.py
checks that the two are the same code); it runs twice, the second run
resuming from the first one's checkpoint.

Not here: keras_examples/ctr.py (tests/cluster/test_ctr_example.py) and
estimator_examples/ (tests/cluster/test_estimator.py) have their own modules. These tests run in both CI environments (TF 2.15 and
the newest TF with tf-keras, `make test`), so they hold the examples to both.
"""

import os
import re

import pytest

from tests.cluster import _cluster_util as cu

pytestmark = pytest.mark.cluster

EXAMPLES = os.path.join(cu.REPO_ROOT, "keras_examples")


def launch(procs, example, *args, timeout=85, env=None):
    """Runs an example under the launcher (2 workers, 1 PS); returns (code, log)."""
    cmd = [cu.PYTHON, "-m", "tf_psplugin.launch", "--workers", "2", "--ps", "1",
           "--timeout", str(timeout - 5), "--", cu.PYTHON, os.path.join(EXAMPLES, example),
           *args]
    result = procs.run(cmd, timeout=timeout, cwd=cu.REPO_ROOT, env=env)
    return result.returncode, result.stdout


def assert_clean_exit(code, out):
    assert code == 0, out
    assert "[launch] chief exited (exit 0)" in out, out
    for role in ("ps:0", "worker:0", "worker:1"):
        assert f"[{role}] tf_psplugin.server: {role} serving at" in out, out


@pytest.mark.timeout(90)
def test_minimal_fits_under_the_launcher(procs):
    code, out = launch(procs, "minimal.py")
    assert_clean_exit(code, out)
    # The plugin's progress bar (the default verbose="auto"), one final line per epoch
    # here: 10 steps take less than its 15 s line interval.
    assert "[chief] Epoch 1/2" in out and "[chief] Epoch 2/2" in out, out
    epochs = re.findall(r"^\[chief\] 10/10 \[=+\] - \d+s \d+ms/step - .*loss: (\d+\.\d+)$",
                        out, re.M)
    assert len(epochs) == 2, out
    final = re.search(r"^\[chief\] minimal: done, final loss (\d+\.\d+)$", out, re.M)
    assert final, out
    # The label is learnable from the ids: the loss must go down.
    assert float(final.group(1)) < float(epochs[0]), out


@pytest.mark.timeout(190)
def test_the_readmes_first_model_trains_checkpoints_and_resumes(procs, tmp_path):
    """README's first model, as README says to run it, twice: the second run restores."""
    model_dir = tmp_path / "model"
    for run, step in ((1, 20), (2, 40)):
        code, out = launch(procs, "first_model.py", env={"MODEL_DIR": str(model_dir)})
        assert_clean_exit(code, out)
        assert f"[chief] first_model: done at step {step}\n" in out, (run, out)
        assert (model_dir / f"ckpt-{step}.index").exists(), (run, sorted(os.listdir(model_dir)))


@pytest.mark.timeout(90)
def test_custom_loop_trains_on_every_worker_under_the_launcher(procs):
    code, out = launch(procs, "custom_loop.py", "--steps", "20", "--log_every", "10")
    assert_clean_exit(code, out)
    progress = re.findall(
        r"^\[chief\] custom_loop: step (\d+)/20 loss (\d+\.\d+) accuracy (\d\.\d+) .*2 workers",
        out, re.M)
    assert [p[0] for p in progress] == ["10", "20"], out
    for _, loss, accuracy in progress:
        assert 0.0 < float(loss) < 5.0 and 0.0 <= float(accuracy) <= 1.0, out
    # One optimizer iteration per scheduled step, although each step ran on
    # both workers: the replicas apply the same all-reduced update once each.
    assert "[chief] custom_loop: done, 20 steps, optimizer iterations 20" in out, out


@pytest.mark.timeout(90)
def test_custom_loop_by_hand_with_flags(procs):
    """Every task started with the same flags; the first worker is the chief."""
    workers = [f"127.0.0.1:{cu.free_port()}" for _ in range(3)]
    ps = f"127.0.0.1:{cu.free_port()}"
    script = os.path.join(EXAMPLES, "custom_loop.py")
    common = [f"--worker_hosts={','.join(workers)}", f"--ps_hosts={ps}", "--steps", "6",
              "--log_every", "3"]
    servers = []
    for job, index in (("ps", 0), ("worker", 1), ("worker", 2)):
        proc = procs.popen([cu.PYTHON, script, f"--job_name={job}", f"--task_index={index}",
                            *common], cwd=cu.REPO_ROOT)
        servers.append((proc, cu.LineReader(proc)))
    for proc, reader in servers:
        assert reader.wait_for("serving at", timeout=60), reader.text()
    chief = procs.run([cu.PYTHON, script, "--job_name=worker", "--task_index=0", *common],
                      timeout=60, cwd=cu.REPO_ROOT)
    assert chief.returncode == 0, chief.stdout
    assert "custom_loop: step 3/6" in chief.stdout, chief.stdout
    assert "custom_loop: done, 6 steps, optimizer iterations 6" in chief.stdout, chief.stdout
    # The chief leaves the servers running, as on a real cluster; the servers
    # were promoted to worker:0/worker:1 (worker 0 of the flags is the chief).
    texts = [reader.text() for _, reader in servers]
    assert "ps:0 serving at" in texts[0] and "worker:0 serving at" in texts[1], texts
    assert "worker:1 serving at" in texts[2], texts


@pytest.mark.timeout(120)
def test_dynamic_ctr_trains_on_raw_ids_and_exports(procs, tmp_path):
    code, out = launch(procs, "dynamic_ctr.py", "--train_steps", "20", "--capacity", "5000",
                       "--batch_size", "128", "--steps_per_execution", "5",
                       "--export_dir", str(tmp_path / "export"), timeout=115)
    assert_clean_exit(code, out)
    auc = re.search(r"^\[chief\] dynamic_ctr: held-out loss (\d\.\d+)  AUC (\d\.\d+)", out, re.M)
    assert auc and 0.0 < float(auc.group(2)) <= 1.0, out
    rows = re.search(r"^\[chief\] dynamic_ctr: table rows (\d+) of 5000; admitted (\d+), "
                     r"evicted (\d+)", out, re.M)
    assert rows and 0 < int(rows.group(1)) <= 5000, out
    # 20 steps x 2 workers x 128 examples x 26 features, admit_after=2: the
    # generated stream has more ids seen twice (~17k) than rows; LRU makes room.
    assert int(rows.group(2)) > 5000 and int(rows.group(3)) > 0, out
    assert os.path.exists(tmp_path / "export" / "saved_model.pb"), out


@pytest.mark.timeout(200)
def test_dynamic_ctr_string_ids_resume_on_another_ps_count(procs, tmp_path):
    from tf_psplugin.testing import write_criteo_fixture

    write_criteo_fixture(str(tmp_path / "day_0.tsv"), 3000)
    common = ["--train_steps", "10", "--capacity", "4000", "--batch_size", "64",
              "--steps_per_execution", "5", "--data", str(tmp_path / "day_*"),
              "--model_dir", str(tmp_path / "model")]
    code, out = launch(procs, "dynamic_ctr.py", *common, timeout=95)
    assert_clean_exit(code, out)
    # Restarted with 2 PS tasks instead of 1: the checkpoint (string keys
    # included) restores into the new layout and training goes on.
    cmd = [cu.PYTHON, "-m", "tf_psplugin.launch", "--workers", "2", "--ps", "2",
           "--timeout", "90", "--", cu.PYTHON, os.path.join(EXAMPLES, "dynamic_ctr.py"), *common]
    result = procs.run(cmd, timeout=95, cwd=cu.REPO_ROOT)
    assert result.returncode == 0, result.stdout
    assert "per PS: /job:ps/replica:0/task:0" in result.stdout
    assert "/job:ps/replica:0/task:1" in result.stdout, result.stdout


@pytest.mark.timeout(150)
def test_online_ctr_with_deltas_evaluator_and_serving(procs, tmp_path):
    model_dir = tmp_path / "online"
    cmd = [cu.PYTHON, "-m", "tf_psplugin.launch", "--workers", "2", "--ps", "1", "--evaluator",
           "--timeout", "130", "--", cu.PYTHON, os.path.join(EXAMPLES, "online_ctr.py"),
           "--model_dir", str(model_dir), "--epochs", "3", "--steps_per_epoch", "10",
           "--save_every_steps", "5", "--full_every_saves", "3", "--steps_per_execution", "5",
           "--batch_size", "64", "--vocab_size", "1000", "--serve",
           "--serving_poll_seconds", "0.3", "--serving_timeout_seconds", "100",
           "--wait_for_evaluator_seconds", "100", "--eval_steps", "2",
           "--eval_batch_size", "128", "--eval_idle_timeout_seconds", "100"]
    result = procs.run(cmd, timeout=140, cwd=cu.REPO_ROOT)
    out = result.stdout
    assert_clean_exit(result.returncode, out)
    assert "[chief] Epoch 3/3" in out, out
    # Saves every 5 steps, every 3rd full: ckpt-5, delta-10, delta-15, ckpt-20, delta-25,
    # delta-30 (the final one); max_to_keep=2 keeps both chains.
    assert ("[chief] online_ctr: trained to step 30; last save delta-30 (delta); saves in "
            "model_dir: ckpt-20, ckpt-5, delta-10, delta-15, delta-25, delta-30") in out, out
    # The evaluator follows the deltas: it scores the final one, then the chief exits.
    assert re.search(r"^\[chief\] online_ctr: the evaluator scored step 30: AUC 0\.\d+$",
                     out, re.M), out
    # The serving process (started by the chief, no cluster) applied deltas in place and
    # answered after each update, up to the final step.
    served = re.findall(r"^\[chief\] online_ctr serving: step (\d+) \(applied ([^)]*)\) "
                        r"answered (\d+\.\d+) s after the chief committed it; mean "
                        r"predicted CTR (0\.\d+)$", out, re.M)
    assert served, out
    assert any("delta-" in applied for _, applied, _, _ in served), out
    assert served[-1][0] == "30", out
    assert "[chief] online_ctr serving: done at the final step 30" in out, out
    assert "[chief] online_ctr: the serving process exited (0)" in out, out
