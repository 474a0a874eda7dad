"""Throughput, memory, load-balance and scaling benchmarks for tf_psplugin.

Entry point: `python -m benchmarks.run` (see benchmarks/README.md). Modules:

* `model`: the benchmark's CTR model, optimizer and cached input pipeline,
  identical in every setup.
* `child`: what one benchmark process runs (single-process Keras, the chief of
  a PS cluster, one MultiWorkerMirroredStrategy worker); prints one result line.
* `procs`: starting those processes (LocalCluster for PS clusters, a small
  process-group runner for MWMS), reading their peak RSS, never leaking any.
* `balance`: lookups per PS shard for contiguous vs interleaved sharding.
* `run`: argument parsing, the modes, JSON lines and tables.

Nothing here is imported by `tf_psplugin`; the parent process (`run`) does
not import TensorFlow except for `--balance`.
"""
