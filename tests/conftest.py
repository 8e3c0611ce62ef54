"""Test setup: CPU only, quiet logs. Multi-device tests start their own subprocess."""

import os
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

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
