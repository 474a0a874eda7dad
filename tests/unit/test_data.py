"""Unit tests for tf_psplugin.data: the synthetic CTR stream and the Criteo TSV reader."""

import math
import os

import numpy as np
import pytest
import tensorflow as tf

from tf_psplugin import data, testing

SMALL = data.SyntheticCTR(vocab_size=1000, seed=7)


def _collect(ds):
    """Materialises a dataset as a list of (dense, categorical, label) numpy triples."""
    return [(x["dense"].numpy(), x["categorical"].numpy(), y.numpy()) for x, y in ds]


def _assert_batches_equal(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        for a, b in zip(g, w):
            np.testing.assert_array_equal(a, b)


def _concat(batches):
    return tuple(np.concatenate(parts) for parts in zip(*batches))


# ---- SyntheticCTR: structure and determinism --------------------------------


def test_schema_constants():
    assert data.NUM_INTEGER_FEATURES == 13 and data.NUM_CATEGORICAL_FEATURES == 26
    assert data.INTEGER_FEATURE_NAMES == tuple(f"I{i}" for i in range(1, 14))
    assert data.CATEGORICAL_FEATURE_NAMES[0] == "C1"
    assert data.CATEGORICAL_FEATURE_NAMES[-1] == "C26"
    assert len(data.CATEGORICAL_FEATURE_NAMES) == 26


def test_element_structure_shapes_and_values():
    ds = SMALL.dataset(batch_size=64, num_batches=2)
    features, label = ds.element_spec
    assert features["dense"] == tf.TensorSpec([64, 13], tf.float32)
    assert features["categorical"] == tf.TensorSpec([64, 26], tf.int64)
    assert label == tf.TensorSpec([64, 1], tf.float32)
    batches = _collect(ds)
    assert len(batches) == 2
    dense, cat, y = _concat(batches)
    assert set(np.unique(y)) <= {0.0, 1.0}
    assert dense.min() >= 0.0
    # dense is log1p of an integer count, like the Criteo reader's output.
    np.testing.assert_allclose(np.expm1(dense.astype(np.float64)), np.round(np.expm1(dense)), 1e-4)
    assert cat.min() >= 0 and cat.max() < 1000


def test_deterministic_by_seed():
    again = data.SyntheticCTR(vocab_size=1000, seed=7)
    _assert_batches_equal(_collect(again.dataset(32, 3)), _collect(SMALL.dataset(32, 3)))
    other = _collect(data.SyntheticCTR(vocab_size=1000, seed=8).dataset(32, 1))[0]
    assert not np.array_equal(other[1], _collect(SMALL.dataset(32, 1))[0][1])


def test_rows_do_not_depend_on_batch_size():
    # Odd sizes too: rows are padded so no element takes Eigen's scalar tail path.
    reference = _concat(_collect(SMALL.dataset(40, 3)))
    for batch_size in (3, 40 * 3):
        got = _concat(_collect(SMALL.dataset(batch_size, 40 * 3 // batch_size)))
        for a, b in zip(got, reference):
            np.testing.assert_array_equal(a, b)


def test_shards_are_disjoint_and_cover_the_stream():
    full = _collect(SMALL.dataset(16, 7))
    shards = [_collect(SMALL.dataset(16, 7, shard_index=i, num_shards=3)) for i in range(3)]
    for i in range(3):
        _assert_batches_equal(shards[i], full[i::3])
    assert sum(len(s) for s in shards) == len(full)
    seen = {b[1].tobytes() for s in shards for b in s}
    assert len(seen) == len(full)


def test_shard_batches_concatenate_to_the_global_batch():
    # k workers with batch B at step t see exactly batch t of size k * B.
    k, b = 4, 8
    shards = [_collect(SMALL.dataset(b, 3 * k, shard_index=i, num_shards=k)) for i in range(k)]
    global_batches = _collect(SMALL.dataset(k * b, 3))
    for step in range(3):
        joined = _concat([shards[i][step] for i in range(k)])
        for a, g in zip(joined, global_batches[step]):
            np.testing.assert_array_equal(a, g)


@pytest.mark.parametrize("num_shards", [1, 2])
def test_offset_equals_skip(num_shards):
    full = _collect(SMALL.dataset(16, 9))
    for i in range(num_shards):
        got = _collect(SMALL.dataset(16, 9, i, num_shards, offset_batches=3))
        _assert_batches_equal(got, full[3:][i::num_shards])


def test_offset_does_not_generate_skipped_batches():
    offset = 10**15  # generating the skipped data would take decades
    got = _collect(SMALL.dataset(8, offset_batches=offset).take(1))[0]
    ex = SMALL._examples(tf.constant(offset * 8, tf.int64), 8)
    np.testing.assert_array_equal(got[1], ex["categorical"].numpy())


def test_invalid_arguments():
    with pytest.raises(ValueError, match="vocab_size"):
        data.SyntheticCTR(vocab_size=0)
    with pytest.raises(ValueError, match="ctr"):
        data.SyntheticCTR(ctr=1.0)
    with pytest.raises(ValueError, match="batch_size"):
        SMALL.dataset(0)
    with pytest.raises(ValueError, match="shard_index"):
        SMALL.dataset(8, shard_index=2, num_shards=2)
    with pytest.raises(ValueError, match="num_batches=k [+] n"):
        SMALL.dataset(8, num_batches=20, offset_batches=1 << 40)
    assert not _collect(SMALL.dataset(8, num_batches=5, offset_batches=5))  # resumed at the end


def test_to_named_columns():
    x, _ = next(iter(SMALL.dataset(5, 1)))
    cols = data.to_named_columns(x)
    assert list(cols) == list(data.INTEGER_FEATURE_NAMES + data.CATEGORICAL_FEATURE_NAMES)
    assert cols["I13"].shape == [5] and cols["I13"].dtype == tf.float32
    assert cols["C26"].dtype == tf.int64
    np.testing.assert_array_equal(cols["C3"].numpy(), x["categorical"][:, 2].numpy())


# ---- SyntheticCTR: distributions ---------------------------------------------


@pytest.fixture(scope="module")
def default_sample():
    gen = data.SyntheticCTR()
    x, y = next(iter(gen.dataset(32768, 1)))
    return gen, x["dense"].numpy(), x["categorical"].numpy(), y.numpy()


def test_ids_follow_the_documented_power_law(default_sample):
    gen, _, cat, _ = default_sample
    assert cat.min() >= 0 and cat.max() < gen.vocab_size
    p = gen._params
    pmf = np.diff(gen._rank_cdf(np.arange(6, dtype=np.float64)))
    assert 0.07 < pmf[0] < 0.08  # P(rank 0) for N = 1e5, s = 1.05
    for r in range(5):  # the id of rank r is (a * r + b) mod N
        ids_r = (p.perm_a * r + p.perm_b) % gen.vocab_size
        freq = np.mean(cat == ids_r[None, :])
        sd = math.sqrt(pmf[r] * (1 - pmf[r]) / cat.size)
        assert abs(freq - pmf[r]) < 5 * sd, (r, freq, pmf[r])


def test_ids_are_heavy_tailed_and_scattered(default_sample):
    gen, _, cat, _ = default_sample
    shares, hot_partitions = [], []
    for f in range(cat.shape[1]):
        counts = np.sort(np.bincount(cat[:, f], minlength=gen.vocab_size))[::-1]
        shares.append(counts[: gen.vocab_size // 100].sum() / counts.sum())
        top100 = np.argsort(np.bincount(cat[:, f], minlength=gen.vocab_size))[-100:]
        hot_partitions.append(np.bincount(top100 * 4 // gen.vocab_size, minlength=4))
    assert np.mean(shares) > 0.6  # the top 1% of ids take ~2/3 of lookups
    # Hot ids are spread evenly over the id range: each of 4 row-range shards of
    # a table gets about a quarter of the 100 most frequent ids.
    assert min(min(h) for h in hot_partitions) >= 15


def test_label_rate_is_calibrated(default_sample):
    assert abs(float(np.mean(default_sample[3])) - 0.25) < 0.02
    for gen in (SMALL, data.SyntheticCTR(seed=3, signal=1.0, ctr=0.1)):
        _, y = next(iter(gen.dataset(8192, 1)))
        assert abs(float(np.mean(y)) - gen.ctr) < 0.025


def test_labels_follow_the_hidden_logits(default_sample):
    gen, dense, cat, y = default_sample
    logit = gen.logits({"dense": dense, "categorical": cat}).numpy()
    assert logit.shape == y.shape and logit.dtype == np.float32
    prob = 1.0 / (1.0 + np.exp(-logit[:, 0]))
    bins = np.digitize(prob, np.quantile(prob, [0.25, 0.5, 0.75]))
    for b in range(4):  # calibration per quartile of the true probability
        assert abs(y[bins == b].mean() - prob[bins == b].mean()) < 0.03


def test_expected_auc_is_a_computed_ceiling(default_sample):
    gen, dense, cat, y = default_sample
    auc = gen.expected_auc(num_examples=16384)
    assert 0.65 < auc < 0.95
    # Agrees with the ordinary AUC of the true logits against sampled labels.
    logit = gen.logits({"dense": dense, "categorical": cat}).numpy()[:, 0]
    assert abs(data._soft_auc(y[:, 0], logit) - auc) < 0.02
    weaker = data.SyntheticCTR(signal=0.25).expected_auc(num_examples=8192)
    assert 0.5 < weaker < auc - 0.05


def test_soft_auc_matches_pairwise_definition():
    rng = np.random.default_rng(0)
    scores = rng.integers(0, 5, 60).astype(np.float64)  # many ties
    labels = (rng.random(60) < 0.4).astype(np.float64)
    pos, neg = scores[labels == 1], scores[labels == 0]
    pairs = (pos[:, None] > neg[None, :]) + 0.5 * (pos[:, None] == neg[None, :])
    assert data._soft_auc(labels, scores) == pytest.approx(pairs.mean())


def test_hidden_model_is_learnable_from_counts(default_sample):
    # Even a counting model (smoothed per-id log-odds, summed, dense features
    # ignored) fit on 24k examples beats AUC 0.65 on held-out rows: the signal
    # sits on frequent ids. (An embedding + MLP reaches ~0.73 in 300 steps.)
    gen, _, cat, y = default_sample
    train, held_out = slice(0, 24576), slice(24576, None)
    base = y[train].mean()
    score = np.zeros(len(y[held_out]))
    for f in range(cat.shape[1]):
        pos = np.bincount(cat[train, f], weights=y[train, 0], minlength=gen.vocab_size)
        tot = np.bincount(cat[train, f], minlength=gen.vocab_size)
        rate = (pos + 50 * base) / (tot + 50)
        score += np.log(rate / (1 - rate))[cat[held_out, f]]
    assert data._soft_auc(y[held_out, 0], score) > 0.65


def test_numpy_twin_of_the_hash_matches_tensorflow():
    keys = np.array([data._key(0, 1, j) for j in range(3)], np.uint64)
    counters = np.array([[0], [1], [2**40 + 3], [2**63 + 9]], np.uint64)
    bits_tf = data._bits_tf(tf.constant(keys), tf.constant(counters)).numpy()
    np.testing.assert_array_equal(bits_tf, data._bits_np(keys, counters))
    np.testing.assert_allclose(
        data._normal_tf(tf.constant(bits_tf)).numpy(), data._normal_np(bits_tf), rtol=1e-12
    )


# ---- Criteo TSV reader -------------------------------------------------------


def _write_lines(path, lines):
    with open(path, "w") as f:
        f.write("".join(line + "\n" for line in lines))
    return str(path)


def test_reader_decodes_known_rows(tmp_path):
    ints = ["5", "", "-3", "0", "1", "2", "3", "4", "1000", "", "7", "8", "9"]
    cats = ["68fd1e64", "", "05db9164"] + ["abc"] * 23
    path = _write_lines(tmp_path / "known.tsv", ["\t".join(["1"] + ints + cats)] * 2)
    x, y = next(iter(data.criteo_tsv_dataset(path, batch_size=2)))
    np.testing.assert_array_equal(y.numpy(), [[1.0], [1.0]])
    want = [math.log1p(max(float(v or 0), 0.0)) for v in ints]
    np.testing.assert_allclose(x["dense"].numpy()[0], want, rtol=1e-6)
    cat = x["categorical"].numpy()[0]
    # Fingerprint64-based: these values are stable across runs, machines and TF versions.
    np.testing.assert_array_equal(cat[:4], [87238, 0, 33037, 18054])
    assert data.criteo_tsv_dataset(path, 2, vocab_size=10).element_spec[0]["dense"].shape == [2, 13]
    small = next(iter(data.criteo_tsv_dataset(path, 2, vocab_size=10)))[0]["categorical"].numpy()
    assert small.min() >= 0 and small.max() < 10 and small[0, 1] == 0


def test_reader_round_trips_the_generator(tmp_path):
    path = testing.write_criteo_fixture(str(tmp_path / "f.tsv"), 300, seed=5, generator=SMALL)
    x, y = next(iter(data.criteo_tsv_dataset(path, batch_size=300)))
    ex = {k: v.numpy() for k, v in SMALL._examples(tf.constant(0, tf.int64), 300).items()}
    np.testing.assert_array_equal(y.numpy(), ex["label"])
    dense, cat = x["dense"].numpy(), x["categorical"].numpy()
    present = dense != 0
    np.testing.assert_array_equal(dense[present], ex["dense"][present])
    assert 0.07 < np.mean(cat == 0) < 0.13  # missing_rate = 0.1
    assert cat.max() < 100_000
    for f in range(26):  # generator id -> reader id is a function (a stable hash)
        seen = {}
        for gid, rid in zip(ex["categorical"][:, f], cat[:, f]):
            if rid:
                assert seen.setdefault(gid, rid) == rid


def test_reader_reads_multiple_files_in_parallel(tmp_path):
    paths = [
        testing.write_criteo_fixture(str(tmp_path / f"p{i}.tsv"), 60, seed=i, generator=SMALL)
        for i in range(3)
    ]
    each = [_concat(_collect(data.criteo_tsv_dataset(p, 60))) for p in paths]
    ds = data.criteo_tsv_dataset(str(tmp_path / "p*.tsv"), 30, num_parallel_reads=3)
    got = _concat(_collect(ds))
    assert len(got[0]) == 180

    def rows(dense, cat, y):
        return sorted(d.tobytes() + c.tobytes() + l.tobytes() for d, c, l in zip(dense, cat, y))

    assert rows(*got) == rows(*_concat(each))
    # Interleaved: the first batch already holds rows of every file.
    first = set(rows(*_collect(ds.take(1))[0]))
    assert all(first & set(rows(*e)) for e in each)


def test_reader_shards_by_file_or_by_line(tmp_path):
    paths = [
        testing.write_criteo_fixture(str(tmp_path / f"s{i}.tsv"), 40, seed=i, generator=SMALL)
        for i in range(2)
    ]
    by_file = [
        _collect(data.criteo_tsv_dataset(paths, 40, shard_index=i, num_shards=2)) for i in (0, 1)
    ]
    for i in (0, 1):
        _assert_batches_equal(by_file[i], _collect(data.criteo_tsv_dataset(paths[i], 40)))
    whole = _concat(_collect(data.criteo_tsv_dataset(paths[0], 40)))
    by_line = [
        _concat(_collect(data.criteo_tsv_dataset(paths[0], 10, shard_index=i, num_shards=4)))
        for i in range(4)
    ]
    for i in range(4):
        np.testing.assert_array_equal(by_line[i][0], whole[0][i::4])


def test_reader_remainder_and_repeat(tmp_path):
    path = testing.write_criteo_fixture(str(tmp_path / "r.tsv"), 25, seed=0, generator=SMALL)
    assert [b[2].shape[0] for b in _collect(data.criteo_tsv_dataset(path, 10))] == [10, 10]
    ds = data.criteo_tsv_dataset(path, 10, drop_remainder=False)
    assert [b[2].shape[0] for b in _collect(ds)] == [10, 10, 5]
    assert len(_collect(data.criteo_tsv_dataset(path, 10, repeat=True).take(7))) == 7


def test_reader_reports_a_pattern_that_matches_nothing(tmp_path):
    pattern = os.path.join(str(tmp_path), "day_*.tsv")
    with pytest.raises(ValueError, match="matched no file") as err:
        data.criteo_tsv_dataset(pattern, 8)
    assert pattern in str(err.value) and "write_criteo_fixture" in str(err.value)
    with pytest.raises(ValueError, match="vocab_size"):
        data.criteo_tsv_dataset(pattern, 8, vocab_size=1)
