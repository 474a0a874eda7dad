"""Layer 6, what a Keras user sees: the progress bar and training summaries.

Uses `state` and the layers below.
"""
