"""Layer 5, task failures: save what survives, then restart or recover.

`failover` (a dead worker or PS: emergency checkpoint, exit for the
restart) and `elastic` (opt-in recovery inside one process). Uses `state`
and the layers below. The public face is `tf_psplugin.elastic`.
"""
