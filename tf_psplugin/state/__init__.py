"""Layer 4, what outlives a process: the model directory and what is in it.

`model_dir` (layout and catalogue), `checkpoint` and `checkpoint_write`
(the chief's saves and any-shape restores), `incremental` (deltas),
`input_state` (each worker's input position), `export` (SavedModels with full
tables) and `evaluator` (the sidecar). Uses `tables`, `sync`, `cluster` and
`_internal`.
"""
