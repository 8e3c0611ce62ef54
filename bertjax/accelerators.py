"""Which accelerators this machine has, read without starting JAX, and the one start-up
choice that follows from it (imported by `bertjax/__init__.py`, before JAX starts a backend).
"""

from __future__ import annotations

import glob
import importlib.util
import os
import sys

# PCI vendor ids: Google (TPU), NVIDIA, AMD.
_VENDORS = {"0x1ae0", "0x10de", "0x1002"}


def attached() -> bool:
    """Whether a TPU or GPU PCI device is attached (read from sysfs)."""
    for path in glob.glob("/sys/bus/pci/devices/*/vendor"):
        try:
            with open(path) as f:
                if f.read().strip() in _VENDORS:
                    return True
        except OSError:
            continue
    return False


def skip_absent_tpu() -> None:
    """With libtpu installed (the `tpu` extra, and the test extra for ahead-of-time TPU
    compiles), JAX tries a TPU backend at start-up even where there is none, and libtpu prints
    errors meant for TPU VMs ("Failed to find host bounds ..."). Where no accelerator is
    attached, the CPU is JAX's only platform: the commands and the library imported in Python
    stay quiet. A JAX_PLATFORMS set by the user wins; so does a backend already started."""
    if "JAX_PLATFORMS" in os.environ or importlib.util.find_spec("libtpu") is None:
        return
    if attached():
        return
    os.environ["JAX_PLATFORMS"] = "cpu"
    if "jax" in sys.modules:  # imported before bertjax: it read the variable already
        sys.modules["jax"].config.update("jax_platforms", "cpu")
