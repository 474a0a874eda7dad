"""Helpers for tests and demos of code that uses tf_psplugin (public as a module).

* `write_criteo_fixture(path, num_rows, ...)`: a small Criteo-format TSV file
  whose rows are `tf_psplugin.data.SyntheticCTR` examples.
"""

from tf_psplugin.testing.criteo_fixture import write_criteo_fixture

__all__ = ["write_criteo_fixture"]
