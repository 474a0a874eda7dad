"""Layer 7, the top: the strategy and its coordinator, which wire the rest together.

`strategy` (`HybridParameterServerStrategy` and its extended object),
`coordinator` (every step dispatched to every worker) and `epochs` (what an
epoch is in synchronous mode). May use every layer below.
"""
