"""Test setup: CPU only, quiet logs. Multi-device tests start their own subprocess."""

import os
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# XLA compiles dominate the end-to-end tests, and many subprocesses (a run, its resumed twin,
# every mesh) compile the same programs: share them through JAX's persistent cache. A cached
# executable is the one a fresh compile would give, so results are unchanged.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR",
                      os.path.join(tempfile.gettempdir(), f"bertjax-tests-jax-cache-{os.getuid()}"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import pytest  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def run_python(args, env=None, timeout=600):
    """Runs `python <args>` from the project root; returns the CompletedProcess."""
    full_env = dict(os.environ, **(env or {}))
    return subprocess.run(
        [sys.executable, *args],
        cwd=ROOT,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture
def project_root():
    return ROOT
