"""Layer 1, the cluster: who is in the job, and how the chief joins it.

`config` (flags and `TF_CONFIG`, validated), `ports`, `server` (a ps or
worker task's entry point), `launch` (a whole job on one host) and
`connection` (resolve, wait for every task, connect). Uses `_internal` only.
The public faces are `tf_psplugin.config`, `tf_psplugin.server` and
`tf_psplugin.launch`.
"""
