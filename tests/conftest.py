"""Shared pytest configuration: quiet TF logs for every test process."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
