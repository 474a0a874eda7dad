"""Helpers for tests and demos of code that uses tf_psplugin (public as a module).

* `write_criteo_fixture(path, num_rows, ...)`: a small Criteo-format TSV file
  whose rows are `tf_psplugin.data.SyntheticCTR` examples.
* `tf_psplugin.testing.hosts` (imported on its own; needs root and iproute2):
  `EmulatedHosts`, one network namespace per host with its own address,
  link rate, partitions and byte counters, for multi-host tests and the
  `benchmarks.run --network` benchmark.
"""

from tf_psplugin.testing.criteo_fixture import write_criteo_fixture

__all__ = ["write_criteo_fixture"]
