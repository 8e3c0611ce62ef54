"""The data_pipeline commands' shared plumbing: absl flags and one-line errors (cli.py), and a
quiet, CPU-only TensorFlow (tf_setup.py)."""

from __future__ import annotations

import textwrap

import pytest
from conftest import run_python

from bertjax import tf_setup

COMMANDS = {  # module → a flag its --help lists
    "data_pipeline.create_pretraining_data": "--max_predictions_per_seq",
    "data_pipeline.create_segments": "--report_seq_len",
    "bertjax.demos.rotten_tomatoes": "--source",
    "bertjax.demos.bbc_corpus": "--wheel",
    "bertjax.benchmarks.pretraining_input": "--dupe_factor",
}


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_help_shows_the_usage_and_the_flags(command):
    import importlib

    result = run_python(["-m", command, "--help"])
    first_line = importlib.import_module(command).__doc__.splitlines()[0]
    assert first_line in result.stdout and COMMANDS[command] in result.stdout, result.stdout
    assert "Traceback" not in result.stderr


def test_bad_command_lines_stop_with_one_error_line(tmp_path):
    cases = {
        (): "error: flag --source=None: Flag --source must have a value other than None.; flag "
            "--output_dir=None: Flag --output_dir must have a value other than None. (--help "
            "lists the flags)",
        ("--source=x", "--output_dir=y", "--nope=1"):
            "error: Unknown command line flag 'nope' (--help lists the flags)",
        ("--source=x", "--output_dir=y", "extra"):
            "error: unexpected arguments ['extra']; flags are --name=value",
        (f"--source={tmp_path}/nope.txt", f"--output_dir={tmp_path}/out"):  # a DataError
            f"error: {tmp_path}/nope.txt: no such file",
    }
    for args, line in cases.items():
        result = run_python(["-m", "bertjax.demos.rotten_tomatoes", *args])
        assert result.returncode == 1
        assert result.stderr.splitlines() == [line]
    # A setting out of range (a ConfigError, also a ValueError) names its flag.
    (tmp_path / "vocab.txt").write_text("[PAD]\n[UNK]\n[CLS]\n[SEP]\n[MASK]\nword\n")
    result = run_python(["-m", "data_pipeline.create_segments", "--input=x",
                         f"--output_dir={tmp_path}", f"--vocab={tmp_path}/vocab.txt",
                         "--max_seq_length=2"])
    assert result.returncode == 1
    assert result.stderr.splitlines() == ["error: --max_seq_length must be >= 3, got 2"]


@pytest.mark.slow
@pytest.mark.extended
def test_tensorflow_is_imported_quiet_and_without_accelerators():
    script = textwrap.dedent("""
        import os
        os.environ.pop("TF_CPP_MIN_LOG_LEVEL", None)  # as a user who never set it
        from bertjax.tf_setup import import_tensorflow
        tf = import_tensorflow()
        assert os.environ["TF_CPP_MIN_LOG_LEVEL"] == "2"
        assert not tf.config.get_visible_devices("GPU")
        assert not tf.config.get_visible_devices("TPU")
        assert import_tensorflow() is tf
        print(int(tf.reduce_sum(tf.range(4))))
    """)
    result = run_python(["-c", script])
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout == "6\n"
    assert result.stderr == ""  # no banners, no CUDA errors, no C++ INFO lines


def test_start_up_lines_hidden_by_log_level():
    lines = {  # line → the lowest TF_CPP_MIN_LOG_LEVEL that hides it (None: never hidden)
        "WARNING: All log messages before absl::InitializeLog() is called are written to "
        "STDERR": 1,
        "I0000 00:00:1795366378.230761    6764 cudart_stub.cc:31] Could not find cuda drivers "
        "on your machine, GPU will not be used.": 1,
        "I0000 00:00:1795366363.554125    6539 cpu_feature_guard.cc:227] This TensorFlow binary "
        "is optimized to use available CPU instructions in performance-critical operations.": 1,
        "To enable the following instructions: AVX2 FMA, in other operations, rebuild "
        "TensorFlow with the appropriate compiler flags.": 1,
        "2024-01-01 12:00:00.123456: I tensorflow/core/util/port.cc:113] oneDNN custom "
        "operations are on.": 1,
        "W0000 00:00:1795366378.5    6764 some_file.cc:12] a warning": 2,
        "E0000 00:00:1795366388.228753    6764 cuda_platform.cc:52] failed call to cuInit: "
        "INTERNAL: CUDA error: Failed call to cuInit: UNKNOWN ERROR (303)": 2,
        "E0000 00:00:1795366388.2    6764 some_file.cc:52] something else failed": None,
        "Traceback (most recent call last):": None,
    }
    for line, hidden_from in lines.items():
        for level in range(4):
            expected = hidden_from is not None and level >= hidden_from
            assert tf_setup.is_noise(line, level) == expected, (line, level)
