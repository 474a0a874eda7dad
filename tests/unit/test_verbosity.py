"""Quiet by default: TF's INFO lines hidden inside the plugin's calls, and the switch."""

import logging
import threading

import pytest
import tensorflow as tf

from tf_psplugin._internal import compat as _compat
from tf_psplugin._internal import verbosity


@pytest.fixture
def tf_records():
    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    handler = Keep(level=logging.DEBUG)
    logger = logging.getLogger(verbosity.TF_LOGGER)
    saved = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    yield records
    logger.removeHandler(handler)
    logger.setLevel(saved)


def test_info_is_hidden_inside_and_restored_after(tf_records, monkeypatch):
    monkeypatch.delenv(verbosity.VERBOSITY_ENV, raising=False)
    with verbosity.quiet_tf_info():
        tf.get_logger().info("chatter")
        tf.get_logger().warning("a warning always shows")
        with verbosity.quiet_tf_info():  # Nested: the outer block restores.
            tf.get_logger().info("nested chatter")
        tf.get_logger().info("still inside")
    tf.get_logger().info("user's own info")
    assert tf_records == ["a warning always shows", "user's own info"]
    assert logging.getLogger(verbosity.TF_LOGGER).level == logging.INFO


def test_the_switch_shows_everything(tf_records, monkeypatch):
    monkeypatch.setenv(verbosity.VERBOSITY_ENV, "INFO")
    with verbosity.quiet_tf_info():
        tf.get_logger().info("shown")
    assert tf_records == ["shown"]


def test_a_bad_switch_value_names_the_variable_and_the_choices(monkeypatch):
    monkeypatch.setenv(verbosity.VERBOSITY_ENV, "loud")
    with pytest.raises(ValueError, match="TF_PSPLUGIN_VERBOSITY='loud'.*warning, info"):
        with verbosity.quiet_tf_info():
            pass


def test_threads_leaving_in_any_order_restore_the_level(monkeypatch):
    monkeypatch.delenv(verbosity.VERBOSITY_ENV, raising=False)
    logger = logging.getLogger("absl")
    saved = logger.level
    logger.setLevel(logging.DEBUG)
    try:
        inside, release = threading.Barrier(3), threading.Event()

        def hold():
            with verbosity.quiet_tf_info(verbosity.ABSL_LOGGER):
                inside.wait()
                release.wait()

        threads = [threading.Thread(target=hold) for _ in range(2)]
        for t in threads:
            t.start()
        inside.wait()
        assert logger.level == logging.WARNING
        release.set()
        for t in threads:
            t.join()
        assert logger.level == logging.DEBUG
    finally:
        logger.setLevel(saved)


TF215_IMPORT = (
    "2026-11-24 01:26:43.602532: I tensorflow/core/util/port.cc:113] oneDNN custom operations "
    "are on.\n"
    "2026-11-24 01:26:43.960627: I tensorflow/core/platform/cpu_feature_guard.cc:182] This "
    "TensorFlow binary is optimized.\n"
    "To enable the following instructions: AVX2 FMA, in other operations, rebuild.\n"
    "2026-11-24 01:26:44.000000: W tensorflow/core/something.cc:1] a real warning\n"
    "/site-packages/numpy/x.py:3: UserWarning: kept\n")
TF221_IMPORT = (
    "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR\n"
    "I0000 00:00:1764000000.000000   123 port.cc:153] oneDNN custom operations are on.\n"
    "E0000 00:00:1764000000.000000   123 cuda.cc:1] an error\n"
    "I1124 01:33:40.088477 139898661202816 checkpoint.py:397] tf_psplugin: a Python line\n")


def test_import_time_info_lines_are_dropped_and_warnings_kept():
    assert _compat._filter_import_log(TF215_IMPORT, 1) == (
        "2026-11-24 01:26:44.000000: W tensorflow/core/something.cc:1] a real warning\n"
        "/site-packages/numpy/x.py:3: UserWarning: kept\n")
    assert _compat._filter_import_log(TF221_IMPORT, 1) == (
        "E0000 00:00:1764000000.000000   123 cuda.cc:1] an error\n"
    "I1124 01:33:40.088477 139898661202816 checkpoint.py:397] tf_psplugin: a Python line\n")
    assert _compat._filter_import_log(TF215_IMPORT, 0) == TF215_IMPORT
    assert _compat._filter_import_log(TF215_IMPORT, 3) == (
        "/site-packages/numpy/x.py:3: UserWarning: kept\n")
