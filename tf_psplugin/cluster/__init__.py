"""Layer 1, the cluster: who is in the job, and how the chief joins it.

`config` (`ClusterConfig`, `TF_CONFIG`, validated), `flags` (the cluster
flags, `resolve`), `config_command`, `restarts` (the environment a restarted
task reads), `ports`, `server` (a ps or worker task's entry point),
`local_cluster` (a whole job on one host), `restart_budget` (which failures
earn a restart), `launch` (its command) and `connection` (resolve, wait for
every task, connect). Uses `_internal` only.
The public faces are `tf_psplugin.config`, `tf_psplugin.server` and
`tf_psplugin.launch`.
"""
