"""Layer 2, synchronisation among the workers.

`collectives` (all-reduce, all-gather, barriers), `sparse_exchange`
(embedding gradients summed on their PS), `on_read_updates` (metric and
batch-norm updates in a sync step) and `replicated` (`ReplicatedVariable`,
dense variables with one replica per worker). Uses `cluster` and `_internal`.
"""
