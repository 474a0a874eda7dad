"""A small Criteo-format TSV file with a learnable signal, for tests and demos.

Why this module exists: the Criteo reader (`tf_psplugin.data.
criteo_tsv_dataset`) needs files, and the real logs are 1 TB. The fixture's
rows are `SyntheticCTR` examples written in Criteo's format, so reading them
back gives known features and labels. It lives under `tf_psplugin.testing`,
not in the data module users train from.
"""

import os
from typing import Optional

import numpy as np
import tensorflow as tf

from tf_psplugin import data


def write_criteo_fixture(
    path: str,
    num_rows: int,
    seed: int = 0,
    missing_rate: float = 0.1,
    generator: Optional[data.SyntheticCTR] = None,
) -> str:
    """Writes a small Criteo-format TSV file for tests and demos (needs eager mode).

    Rows are examples `[0, num_rows)` of `generator` (default
    `data.SyntheticCTR(seed=seed)`), so the labels carry a learnable signal: each
    integer is the generator's raw count and each categorical is its id
    scattered by a per-feature bijection of 32-bit space, printed as 8 hex
    digits. Every feature field is independently left empty with probability
    `missing_rate`; reading the file back gives the generator's `dense`
    wherever a value is present.

    Args:
        path: Output file (parent directories are created).
        num_rows: Number of lines.
        seed: Seeds the data (if no `generator`) and which fields are missing.
        missing_rate: Probability that a feature field is empty.
        generator: Source of the rows; must have 13 dense and 26 categorical features.

    Returns:
        `path`.

    Raises:
        ValueError: If `generator` does not have Criteo's 13 + 26 features.
    """
    gen = generator if generator is not None else data.SyntheticCTR(seed=seed)
    if (gen.num_integer, gen.num_categorical) != (data.NUM_INTEGER_FEATURES, data.NUM_CATEGORICAL_FEATURES):
        raise ValueError("write_criteo_fixture needs a generator with 13 dense, 26 categorical.")
    keys = data.fixture_field_keys(seed)
    salts = keys[data.NUM_INTEGER_FEATURES:] & np.uint64(0xFFFFFFFF)
    tf.io.gfile.makedirs(os.path.dirname(os.path.abspath(path)))
    with tf.io.gfile.GFile(path, "w") as out:
        for start in range(0, num_rows, 1 << 14):
            n = min(1 << 14, num_rows - start)
            with tf.init_scope():
                examples_fn = gen.examples_fn(n)
                ex = examples_fn(tf.constant(start, tf.int64))
                ex = {k: v.numpy() for k, v in ex.items()}
            rows = np.arange(start, start + n, dtype=np.uint64)[:, None]
            missing = data.fixture_uniform(keys, rows) < missing_rate
            hexed = ex["categorical"].astype(np.uint64) * np.uint64(0x9E3779B1) + salts
            hexed &= np.uint64(0xFFFFFFFF)
            for r in range(n):
                fields = [str(int(ex["label"][r, 0]))]
                fields += [str(v) for v in ex["counts"][r]]
                fields += [f"{v:08x}" for v in hexed[r]]
                for j in np.flatnonzero(missing[r]):
                    fields[1 + j] = ""
                out.write("\t".join(fields) + "\n")
    return path
