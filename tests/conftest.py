"""Shared pytest configuration: quiet TF logs for every test process, and
tf_psplugin's own deprecations turned into errors."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

# tf_psplugin warns about every former name or spelling with
# PluginDeprecationWarning (a DeprecationWarning subclass); in this suite it is
# an error, so no test, example or benchmark run in-process uses a deprecated
# spelling (the tests of a deprecation catch it with pytest.warns). TF's and
# Keras's own DeprecationWarnings stay ignored (setup.cfg). The filter is added
# here, not in setup.cfg: pytest resolves a filter's category by importing its
# module, and from setup.cfg that import (and TensorFlow's) would come before
# this file sets TF_CPP_MIN_LOG_LEVEL. Later filters take precedence.
PLUGIN_DEPRECATIONS_ARE_ERRORS = (
    "error::tf_psplugin._internal.deprecation.PluginDeprecationWarning")


def pytest_configure(config):
    config.addinivalue_line("filterwarnings", PLUGIN_DEPRECATIONS_ARE_ERRORS)
