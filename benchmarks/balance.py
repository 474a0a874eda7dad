"""Lookups per PS shard under Zipf ids: contiguous (range) vs interleaved sharding.

Why this module exists: with TF's contiguous row ranges, a vocabulary sorted
by frequency puts every hot id on shard 0, and one PS serves most lookups
(tensorflow issue 45291). tf_psplugin defaults to interleaved sharding (row
``i`` on shard ``i mod n``). This measures both, without a cluster:

* ``frequency_sorted`` ids: id = frequency rank, Zipf(s) over the vocabulary
  (the layout of a vocabulary built from counts; the case that hurts).
* ``synthetic_ctr`` ids: what `tf_psplugin.data.SyntheticCTR` generates (ranks
  scattered over the id space by a bijection, as hashing does).

Per shard it counts every lookup and, per batch, the distinct rows (what a
de-duplicated lookup fetches). Shard ``s`` of every table is assumed on PS
task ``s``, as the plugin places them.
"""

from typing import Dict, Iterator, List

import numpy as np

SCHEMES = ("contiguous", "interleaved")
TARGET_MAX_OVER_MEAN = 1.1


def shard_lookup_counts(ids, num_rows: int, num_shards: int, scheme: str) -> np.ndarray:
    """Lookups each shard serves; uses tf_psplugin.tables.sharded's version when present.

    Args:
        ids: Array-like of ids in ``[0, num_rows)``.
        num_rows: Table rows.
        num_shards: Shards.
        scheme: ``"contiguous"`` or ``"interleaved"``.

    Returns:
        int64 array of length `num_shards`.
    """
    try:
        from tf_psplugin.tables import sharded as sharding  # pylint: disable=g-import-not-at-top

        return np.asarray(sharding.shard_lookup_counts(ids, num_rows, num_shards, scheme))
    except (ImportError, AttributeError):
        pass
    ids = np.asarray(ids, dtype=np.int64).ravel()
    if scheme == "interleaved":
        owner = ids % num_shards
    else:
        base, extra = divmod(num_rows, num_shards)
        bounds = np.cumsum([base + (1 if s < extra else 0) for s in range(num_shards)])
        owner = np.searchsorted(bounds, ids, side="right")
    return np.bincount(owner, minlength=num_shards).astype(np.int64)


def zipf_ranks(rng: np.random.Generator, num_rows: int, exponent: float, shape) -> np.ndarray:
    """Ranks in ``[0, num_rows)`` with P(r) proportional to (r + 1) ** -exponent."""
    pmf = np.arange(1, num_rows + 1, dtype=np.float64) ** -exponent
    cdf = np.cumsum(pmf)
    cdf /= cdf[-1]
    return np.minimum(np.searchsorted(cdf, rng.random(shape), side="right"), num_rows - 1)


def _batches(source: str, num_rows: int, num_features: int, batch: int, num_batches: int,
             exponent: float, seed: int) -> Iterator[np.ndarray]:
    if source == "frequency_sorted":
        rng = np.random.default_rng(seed)
        for _ in range(num_batches):
            yield zipf_ranks(rng, num_rows, exponent, (batch, num_features))
        return
    from tf_psplugin.data import SyntheticCTR  # pylint: disable=g-import-not-at-top

    gen = SyntheticCTR(vocab_size=num_rows, num_categorical=num_features, seed=seed,
                       zipf_exponent=exponent)
    for features, _ in gen.dataset(batch, num_batches=num_batches):
        yield features["categorical"].numpy()


def measure(num_rows: int = 100_000, num_features: int = 26, batch: int = 1024,
            num_batches: int = 50, shard_counts=(2, 4, 8), exponent: float = 1.05,
            seed: int = 0, sources=("frequency_sorted", "synthetic_ctr")) -> List[Dict]:
    """Returns one record per (ids source, num_shards, scheme).

    Each record has ``lookups_per_shard`` (summed over every table and batch),
    ``max_over_mean`` for them, the same two for distinct rows per batch
    (``unique_*``), and ``meets_target`` (max/mean <= 1.1).
    """
    records = []
    for source in sources:
        batches = list(_batches(source, num_rows, num_features, batch, num_batches, exponent,
                                seed))
        for n in shard_counts:
            for scheme in SCHEMES:
                lookups = np.zeros(n, np.int64)
                unique = np.zeros(n, np.int64)
                for b in batches:
                    for f in range(num_features):
                        col = b[:, f]
                        lookups += shard_lookup_counts(col, num_rows, n, scheme)
                        unique += shard_lookup_counts(np.unique(col), num_rows, n, scheme)
                ratio = float(lookups.max() / lookups.mean())
                records.append({
                    "mode": "balance", "ids": source, "scheme": scheme, "num_shards": n,
                    "num_rows": num_rows, "num_tables": num_features, "batch": batch,
                    "num_batches": num_batches, "zipf_exponent": exponent,
                    "lookups_per_shard": lookups.tolist(), "max_over_mean": round(ratio, 4),
                    "unique_rows_per_shard": unique.tolist(),
                    "unique_max_over_mean": round(float(unique.max() / unique.mean()), 4),
                    "meets_target": ratio <= TARGET_MAX_OVER_MEAN,
                })
    return records


def format_table(records: List[Dict]) -> str:
    """A text table of `measure()` records."""
    lines = [f"{'ids':18s} {'shards':>6s} {'scheme':12s} {'max/mean':>9s} "
             f"{'uniq max/mean':>13s}  lookups per shard"]
    for r in records:
        lines.append(f"{r['ids']:18s} {r['num_shards']:6d} {r['scheme']:12s} "
                     f"{r['max_over_mean']:9.3f} {r['unique_max_over_mean']:13.3f}  "
                     f"{r['lookups_per_shard']}")
    return "\n".join(lines)
