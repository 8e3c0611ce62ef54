"""Cloud TPU slices by name, and their devices for ahead-of-time compiles on any machine.

`parse("v5p-128")` → a `Slice` (chip family, chips, HBM, peak FLOP/s, the topology string the
TPU compiler takes); `devices(slice_)` → its TPU devices, described by libtpu (the `tpu`
extra) without any TPU attached, so that `jax.jit(...).lower(...).compile()` over a mesh of them
runs the real TPU compiler on a CPU machine.

Names: the Cloud accelerator types `v4-32`, `v5p-128`, `v5litepod-16` (or `v5e-16`), `v6e-64`,
and `family:shape` (`v5p:4x4x4`, `v5e:4x4`). Cloud TPU counts TensorCores in v4 and v5p names
(two per chip: v5p-128 is 64 chips, 4x4x4) and chips in v5e and v6e names (one TensorCore per
chip: v6e-64 is 64 chips, 8x8). Figures per chip from the Cloud TPU system architecture pages.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import re
import tempfile

from bertjax.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class Chip:
    family: str  # as in topology strings: v4, v5p, v5e, v6e
    hbm_gib: float  # HBM per chip
    peak_bf16_tflops: float  # dense bf16 peak per chip
    cores_per_chip: int  # TensorCores; 2 = megacore (one JAX device drives both)
    dims: int  # 3-D torus (v4, v5p) or 2-D (v5e, v6e)
    max_chips: int  # largest single slice offered
    hbm_gbps: float  # HBM bandwidth per chip, GB/s
    # TensorCore clock: the peak over the MXUs' multiply-adds per cycle (4 MXUs per core, of
    # 128 x 128, or 256 x 256 on v6e). Turns the TPU compiler's cycle estimates into seconds.
    clock_ghz: float

    @property
    def clock_hz(self) -> float:
        return self.clock_ghz * 1e9


CHIPS = {
    "v4": Chip("v4", 32.0, 275.0, 2, 3, 4096, 1200.0, 1.05),
    "v5p": Chip("v5p", 95.0, 459.0, 2, 3, 4096, 2765.0, 1.75),
    "v5e": Chip("v5e", 16.0, 197.0, 1, 2, 256, 819.0, 1.5),
    "v6e": Chip("v6e", 32.0, 918.0, 1, 2, 256, 1640.0, 1.75),
}
# Cloud accelerator-type prefixes → chip family.
_PREFIXES = {"v4": "v4", "v5p": "v5p", "v5e": "v5e", "v5litepod": "v5e", "v6e": "v6e"}

ACCEPTED = ("v4-N (N = TensorCores: 8, 16, 32, ..., 8192), v5p-N (the same), v5litepod-N or "
            "v5e-N (N = chips: 1, 4, 8, 16, ..., 256), v6e-N (the same), or FAMILY:SHAPE "
            "(v4:2x2x4, v5p:4x4x4, v5e:4x8, v6e:8x8)")


@dataclasses.dataclass(frozen=True)
class Slice:
    chip: Chip
    shape: tuple[int, ...]  # chips along each torus axis

    @property
    def num_chips(self) -> int:
        return math.prod(self.shape)

    @property
    def topology_name(self) -> str:
        """The compiler's name of the slice, e.g. "v5p:4x4x4"."""
        return f"{self.chip.family}:{'x'.join(map(str, self.shape))}"

    @property
    def accelerator_type(self) -> str:
        """The Cloud accelerator type, e.g. "v5p-128" (TensorCores for v4/v5p)."""
        prefix = "v5litepod" if self.chip.family == "v5e" else self.chip.family
        return f"{prefix}-{self.num_chips * self.chip.cores_per_chip}"

    @property
    def hbm_bytes(self) -> float:
        return self.chip.hbm_gib * 1024.0**3

    @property
    def peak_flops(self) -> float:
        """Dense bf16 FLOP/s of one chip."""
        return self.chip.peak_bf16_tflops * 1e12


def slice_shape(chip: Chip, num_chips: int) -> tuple[int, ...] | None:
    """The standard Cloud shape of a slice of `num_chips`, or None if there is none.

    3-D: 2x2x1 (4 chips), then each doubling doubles the last of the smallest axes: 2x2x2,
    2x2x4, 2x4x4, 4x4x4, 4x4x8, ...; 2-D: 1x1, then 1x2 → 2x2, 2x4, 4x4, 4x8, 8x8, ... (no
    2-chip slice is offered).
    """
    if num_chips < 1 or num_chips & (num_chips - 1) or num_chips > chip.max_chips:
        return None
    if chip.dims == 3:
        if num_chips < 4:
            return None
        shape, size = [2, 2, 1], 4
    else:
        if num_chips == 2:
            return None
        shape, size = [1, 1], 1
    while size < num_chips:
        smallest = min(shape)
        axis = max(i for i, n in enumerate(shape) if n == smallest)
        shape[axis] *= 2
        size *= 2
    return tuple(shape)


def parse(name: str) -> Slice:
    """A Cloud accelerator type or FAMILY:SHAPE → Slice; anything else is a ConfigError
    (one line listing the accepted forms)."""
    text = name.strip().lower()
    bad = ConfigError(f"--topology={name!r} is not a TPU slice; give {ACCEPTED}")
    if m := re.fullmatch(r"(v4|v5p|v5e|v5litepod|v6e):(\d+(?:x\d+)+)", text):
        chip = CHIPS[_PREFIXES[m.group(1)]]
        shape = tuple(int(n) for n in m.group(2).split("x"))
        if len(shape) != chip.dims or min(shape) < 1:
            raise bad
        return Slice(chip, shape)
    if m := re.fullmatch(r"(v4|v5p|v5e|v5litepod|v6e)-(\d+)", text):
        chip = CHIPS[_PREFIXES[m.group(1)]]
        count = int(m.group(2))
        if count % chip.cores_per_chip:
            raise bad
        shape = slice_shape(chip, count // chip.cores_per_chip)
        if shape is None:
            raise bad
        return Slice(chip, shape)
    raise bad


@contextlib.contextmanager
def _quiet_stderr():
    """libtpu writes start-up warnings meant for TPU VMs (no accelerator type, no worker
    hostnames) straight to file descriptor 2; keep them out of the report."""
    saved = os.dup(2)
    with tempfile.TemporaryFile() as sink:
        os.dup2(sink.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)


def devices(slice_: Slice) -> list:
    """The TPU devices of `slice_` (one per chip), from libtpu's topology description.

    Raises ConfigError when libtpu is not installed (`pip install -e '.[tpu]'`) or does not
    know the shape.
    """
    import importlib.util

    if importlib.util.find_spec("libtpu") is None:
        raise ConfigError("--topology needs libtpu for the TPU compiler: pip install -e "
                          "'.[tpu]'")
    from jax.experimental import topologies

    # Only descriptions, no TPU is driven: no worker hostnames to look up for a pod, and no
    # lock file that lets one process at a time use libtpu (tests run in parallel).
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    megacore = slice_.chip.cores_per_chip == 2
    try:
        with _quiet_stderr():
            topology = topologies.get_topology_desc(
                topology_name=slice_.topology_name, platform="tpu",
                chip_config_name="megacore" if megacore else "default")
    except Exception as e:  # libtpu reports unknown shapes as XlaRuntimeError
        raise ConfigError(f"--topology={slice_.topology_name}: libtpu cannot describe this "
                          f"slice ({str(e).splitlines()[0]})") from None
    found = list(topology.devices)
    if len(found) != slice_.num_chips:
        raise ConfigError(f"--topology={slice_.topology_name}: libtpu describes "
                          f"{len(found)} devices, expected {slice_.num_chips} chips")
    return found
