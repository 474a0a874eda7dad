"""The bottom layer: what every other layer may use, and nothing of theirs.

* `compat`: which TensorFlow and Keras the plugin runs on; the import-time
  version gate.
* `tf_internal`: every private TensorFlow/Keras module the plugin imports,
  and every private attribute it reads or sets on their objects, with why.
* `cli`, `deprecation`, `scopes`, `verbosity`: small helpers with no
  TensorFlow state of their own.

Nothing here imports from another `tf_psplugin` subpackage.
"""
