"""Multi-process tests of layers.DynamicEmbedding under HybridParameterServerStrategy."""

import os

import numpy as np
import pytest

from tests.cluster.test_strategy import run_chief_script


@pytest.mark.cluster
@pytest.mark.timeout(420)
def test_sync_dynamic_table_matches_one_process_and_restores_into_any_layout(
        make_cluster, tmp_path):
    ckpt = str(tmp_path / "ckpt" / "dyn")
    report, _ = run_chief_script(make_cluster, tmp_path, "dynamic_embedding.py",
                                 ["train", ckpt, "sync"], num_workers=2, num_ps=2)
    # Keys hash to both PS tasks; each holds its own rows.
    assert report["num_shards"] == 2
    assert [("/job:ps" in d) for d in report["shard_devices"]] == [True, True]
    assert all(s["admitted"] > 0 for s in report["stats"]), report["stats"]
    # Some keys were seen once only: admit_after=2 keeps them out.
    assert 0 < report["admitted_keys"] < 40
    assert report["size"] == report["ref_size"] == report["admitted_keys"]
    # Exact: the same rows and dense weights as one process on the global batch.
    assert report["key_vector_diff"] <= 1e-5, report["key_vector_diff"]
    assert report["dense_diff"] <= 1e-5, report["dense_diff"]
    assert abs(report["loss"] - report["ref_loss"]) <= 1e-5
    trained = np.array(report["vectors"])

    for num_ps in (3, 1):
        sub = tmp_path / f"restore{num_ps}"
        sub.mkdir()
        restored, _ = run_chief_script(make_cluster, sub, "dynamic_embedding.py",
                                       ["restore", ckpt, "sync"], num_workers=1, num_ps=num_ps)
        assert restored["num_shards"] == num_ps
        assert restored["size"] == report["size"]
        np.testing.assert_array_equal(np.array(restored["vectors"]), trained)
        assert restored["single_size"] == report["size"]
        np.testing.assert_array_equal(np.array(restored["single_vectors"]), trained)
        assert restored["size_after_training"] >= restored["size"]
