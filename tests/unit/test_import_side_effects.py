"""`import tf_psplugin` changes nothing process-wide; building a strategy changes what docs list.

Each check runs in a fresh Python process, because what is being checked is
the state of a whole process (warning filters, `sys.excepthook`, atexit
handlers, Keras's module functions, file descriptor 2 during TF's import).
"""

import json
import os
import subprocess
import sys
import textwrap

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Records the process-wide state a library could change, imports
# TensorFlow and Keras first (their own import may change it), then
# tf_psplugin, and prints what differs.
PROBE = textwrap.dedent("""
    import atexit, json, sys, warnings
    import tensorflow as tf
    keras = tf.keras
    training = sys.modules[keras.layers.Layer.__module__.split(".")[0] + ".src.engine.training"]
    data_adapter = sys.modules[training.__name__.replace(".training", ".data_adapter")]

    def state():
        return {
            "warning_filters": [repr(f) for f in warnings.filters],
            "excepthook": repr(sys.excepthook),
            "atexit_handlers": atexit._ncallbacks(),
            "keras_get_verbosity": repr(training._get_verbosity),
            "keras_get_data_handler": repr(data_adapter.get_data_handler),
        }

    before = state()
    import tf_psplugin
    from tf_psplugin import layers, elastic, data, testing
    after = state()
    print(json.dumps({k: [before[k], after[k]] for k in before if before[k] != after[k]}))
""")


# Writes a C++-style INFO line to fd 2 while TensorFlow is being imported
# (a meta path hook that fires on TF's first submodule: `sitecustomize` is
# too early). Were fd 2 redirected during the import, it would be held back
# and filtered.
WRITE_DURING_TF_IMPORT = textwrap.dedent("""
        import os, sys
        class Hook:
            fired = False
            def find_spec(self, name, path=None, target=None):
                if name.startswith("tensorflow.") and not Hook.fired:
                    Hook.fired = True
                    os.write(2, b"I0000 00:00:1.0 1 port.cc:1] probe line during TF import\\n")
                return None
        sys.meta_path.insert(0, Hook())
""")


def _run(code, env_extra=None):
    env = dict(os.environ, PYTHONPATH=REPO_ROOT)
    env.pop("TF_CPP_MIN_LOG_LEVEL", None)
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=300)


def test_import_changes_no_process_wide_state():
    result = _run(PROBE)
    assert result.returncode == 0, result.stderr[-3000:]
    changed = json.loads(result.stdout.strip().splitlines()[-1])
    assert changed == {}, f"import tf_psplugin changed process-wide state: {changed}"


def test_import_leaves_tensorflows_import_output_alone():
    """A program importing tf_psplugin before TF sees TF's import as TF prints it.

    The probe prints a line to fd 2 from C while TensorFlow imports (through
    a module TF's import runs: `sitecustomize` is too early, so the probe
    writes from a meta path hook that fires on TF's first submodule). Were
    fd 2 redirected during the import, the line would be held back and
    filtered.
    """
    code = WRITE_DURING_TF_IMPORT + textwrap.dedent("""
        import tf_psplugin
        assert Hook.fired
    """)
    result = _run(code)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "probe line during TF import" in result.stderr


def test_the_plugins_commands_still_drop_tensorflows_import_info_lines():
    # The same INFO line, in `python -m tf_psplugin.config`, is dropped.
    code = WRITE_DURING_TF_IMPORT + textwrap.dedent("""
        sys.orig_argv = [sys.executable, "-m", "tf_psplugin.config", "--help"]
        import tf_psplugin
        assert Hook.fired
        print("imported")
    """)
    result = _run(code)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "imported" in result.stdout
    assert "probe line during TF import" not in result.stderr


def test_building_a_strategy_installs_the_exit_hook_and_the_keras_hooks():
    """What docs/api.md ("What building a strategy changes") lists, checked."""
    code = PROBE.replace("after = state()", textwrap.dedent("""
        from tf_psplugin.cluster import ports as _ports
        ports = _ports.pick_free_ports(4)
        cluster = tf.train.ClusterSpec({
            "chief": [f"127.0.0.1:{ports[0]}"], "ps": [f"127.0.0.1:{ports[1]}"],
            "worker": [f"127.0.0.1:{p}" for p in ports[2:]]})
        servers = [tf.distribute.Server(cluster, job_name=job, task_index=i, start=True)
                   for job, i in (("ps", 0), ("worker", 0), ("worker", 1))]
        resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
            cluster, task_type="chief", task_id=0, rpc_layer="grpc")
        tf_psplugin.HybridParameterServerStrategy(
            resolver, options=tf_psplugin.HybridOptions(log_placement=False))
        after = state()
    """))
    result = _run(code)
    assert result.returncode == 0, result.stderr[-3000:]
    changed = json.loads(result.stdout.strip().splitlines()[-1])
    assert set(changed) >= {"excepthook", "atexit_handlers", "keras_get_verbosity",
                            "keras_get_data_handler"}, changed
    assert "warning_filters" not in changed
