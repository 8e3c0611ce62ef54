"""The attention kernels' cycles on a TPU, read from the schedule the compiler gave them.

XLA sees a Pallas kernel only through its `cost_estimate`: FLOPs and HBM bytes. Their roofline
leaves out the kernel's vector work (scale, masks, softmax, the dropout hash, casts), which in
BERT's attention takes longer than its matmuls. libtpu writes the final VLIW bundles of every
program it compiles when asked (`--xla_jf_dump_llo_text`). A kernel is one software-pipelined
loop over its grid steps, one bundle per cycle, so its cycles are the bundles outside the loop
plus the loop body's bundles times the loop's trip count: its static schedule. That leaves out
stalls (DMA waits, which the kernels' double buffering hides while a grid step is
compute-bound), so it is a lower bound, like the roofline; the dry run takes the larger.

Two families are read this way: `dropout_attention`'s flash kernels (BERT, `flash_kernels`)
and `splash_attention`'s block-sparse ones (ModernBERT, `splash_kernels`). A global splash
kernel's steps are data-dependent (a dead block pair computes nothing); its schedule counts
every step the grid walks as computed, as its cost estimate counts every block pair.

libtpu reads its flags once per process, so the kernels are compiled in a child process
(`compile_kernels`) for one chip of the slice.
"""

from __future__ import annotations

import dataclasses
import functools
import glob
import json
import os
import re
import subprocess
import sys
import tempfile

_BUNDLE = re.compile(r"^\s*(?:0x[0-9a-f]+|0)\s+(?:[A-Z]{2})?:?\s*(>?)\s*\{", re.M)
_TRIP = re.compile(r"scmp\.ge\.s32\.totalorder %s\w+, (\d+) /\* loop exit test \*/")
_OPERANDS = re.compile(r"shape: (\w+)\[[\d,]*\], index: \d+, kind: (input|output)")
_FORWARD_RESULT = re.compile(
    r"\(bf16\[(\d+),(\d+),(\d+)\][^ ]*, f32\[\d+,(\d+),1,\d+\][^ ]*\) custom-call\(.*"
    r'custom_call_target="tpu_custom_call"')
# splash_attention's forward: o [batch, seq, heads·head_dim] and the log-sum-exp rows
# [batch, heads, 8, seq].
_SPLASH_FORWARD_RESULT = re.compile(
    r"\(bf16\[(\d+),(\d+),(\d+)\][^ ]*, f32\[\d+,(\d+),8,\2\][^ ]*\) custom-call\(.*"
    r'custom_call_target="tpu_custom_call"')


@dataclasses.dataclass(frozen=True)
class FlashKernels:
    """What `dropout_attention`'s two kernels compile to, for one chip's shard."""

    batch: int
    seq: int
    heads: int
    head_dim: int
    rate: float
    causal: bool


@dataclasses.dataclass(frozen=True)
class SplashKernels:
    """What `splash_attention`'s kernels compile to for one chip's shard, in a global
    layer (radius None) or a local one."""

    batch: int
    seq: int  # padded
    heads: int
    head_dim: int
    radius: int | None


def scheduled_cycles(bundles: str) -> int:
    """Cycles of one run of a compiled program from its final bundles (libtpu's
    `*-final_bundles.txt`): bundles outside its loop + loop-body bundles (marked `>`) × the
    loop's trip count (its exit test's bound). A program without a loop: its bundles."""
    marks = _BUNDLE.findall(bundles)
    body = sum(1 for m in marks if m)
    trips = _TRIP.findall(bundles)
    if body and len(set(trips)) != 1:
        raise ValueError(f"expected one loop with a constant trip count, found {trips or 'none'}")
    return len(marks) - body + body * (int(trips[0]) if body else 0)


def flash_kernels(hlo_text: str, rate: float, causal: bool) -> set[FlashKernels]:
    """The flash kernels of a compiled step (its optimized HLO), one per distinct shape: the
    forward kernel's results are the output [batch, seq, heads·head_dim] and the log-sum-exp
    [batch, heads, 1, seq] float32."""
    found = set()
    for batch, seq, width, heads in _FORWARD_RESULT.findall(hlo_text):
        found.add(FlashKernels(int(batch), int(seq), int(heads), int(width) // int(heads),
                               rate, causal))
    return found


def splash_kernels(hlo_text: str, radii: tuple[int | None, ...]) -> set[SplashKernels]:
    """The splash kernels of a compiled step, one per distinct shape and each of `radii` (the
    model's global and local layers share shapes; their estimates, the keys, differ)."""
    return {SplashKernels(int(batch), int(seq), int(heads), int(width) // int(heads), radius)
            for batch, seq, width, heads in _SPLASH_FORWARD_RESULT.findall(hlo_text)
            for radius in radii}


def _compiled_bundles(topology: str, kernels) -> tuple[dict, dict[str, str]]:
    """Compiles `kernels` (FlashKernels or SplashKernels) for one chip of `topology` in a child
    process: ({kernel: (FLOPs, bytes) of its cost estimate}, {bundle file name: its text})."""
    with tempfile.TemporaryDirectory() as dump:
        flags = (f"--xla_jf_dump_to={dump} --xla_jf_dump_llo_text=true "
                 "--xla_jf_dump_llo_pass_label_regex=final_bundles")
        env = dict(os.environ, LIBTPU_INIT_ARGS=f"{os.environ.get('LIBTPU_INIT_ARGS', '')} "
                   f"{flags}".strip(), JAX_PLATFORMS="")
        spec = json.dumps({"topology": topology, "family": type(kernels).__name__,
                           **dataclasses.asdict(kernels)})
        done = subprocess.run([sys.executable, "-c", _CHILD, spec], env=env,
                              capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"compiling the attention kernels for {topology} failed: "
                               f"{done.stderr.strip().splitlines()[-1:]}")
        keys = {k: tuple(v) for k, v in json.loads(done.stdout.splitlines()[-1]).items()}
        bundles = {}
        for path in glob.glob(os.path.join(dump, "*-final_bundles.txt")):
            text = open(path).read()
            if "schedule-analysis" not in path and "custom-call(" in text:
                bundles[os.path.basename(path)] = text
    return keys, bundles


@functools.cache
def flash_cycles(topology: str, kernels: FlashKernels) -> dict[tuple[int, int], int]:
    """{(FLOPs, HBM bytes) of a kernel's cost_estimate: its scheduled cycles} for the forward
    and backward kernels of `kernels` on one chip of `topology` (compiled in a child process)."""
    keys, bundles = _compiled_bundles(topology, kernels)
    cycles = {}
    for text in bundles.values():
        operands = _OPERANDS.findall(text)
        if operands:
            # The backward kernel's inputs include the float32 log-sum-exp.
            name = "backward" if ("f32", "input") in operands else "forward"
            cycles[keys[name]] = scheduled_cycles(text)
    if len(cycles) != 2:
        raise RuntimeError(f"expected the forward and backward kernels' bundles, found "
                           f"{len(cycles)}")
    return cycles


@functools.cache
def splash_cycles(topology: str, kernels: SplashKernels) -> dict[tuple[int, int], int]:
    """As `flash_cycles`, for the splash kernels (forward, backward, di: named in their bundle
    files)."""
    keys, bundles = _compiled_bundles(topology, kernels)
    cycles = {keys[kind]: scheduled_cycles(text) for name, text in bundles.items()
              for kind in keys if f"splash_{kind}" in name}
    if len(cycles) != len(keys):
        raise RuntimeError(f"expected the {sorted(keys)} splash kernels' bundles, found "
                           f"{len(cycles)}")
    return cycles


def _compile_splash(spec: dict) -> dict[str, tuple[int, int]]:
    """`compile_kernels` for SplashKernels: a global or local layer's forward and backward."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from bertjax.aot import topology
    from bertjax.models.kernels import flash_attention, splash_attention

    k = SplashKernels(**{f.name: spec[f.name] for f in dataclasses.fields(SplashKernels)})
    device = topology.devices(topology.parse(spec["topology"]))[0]
    mesh = Mesh(np.array([device]), ("data",))  # Pallas reads the chip from the mesh
    sharding = NamedSharding(mesh, PartitionSpec())
    width = k.heads * k.head_dim
    qkv = jax.ShapeDtypeStruct((k.batch, k.seq, 3 * width), jnp.bfloat16, sharding=sharding)
    mask = jax.ShapeDtypeStruct((k.batch, k.seq), jnp.int32, sharding=sharding)

    def forward_and_backward(qkv, mask):
        out, vjp = jax.vjp(lambda qkv: splash_attention.splash_attention(
            qkv, mask, None, k.radius, k.heads), qkv)
        return vjp(out)

    with jax.set_mesh(mesh), flash_attention.sharded_like(sharding):  # the chip, as a step's
        jax.jit(forward_and_backward).lower(qkv, mask).compile()
    static = splash_attention.Static(k.seq, splash_attention.block_size(k.seq), k.radius,
                                     k.heads, k.head_dim)
    shaped = jax.ShapeDtypeStruct((k.batch, k.seq, width), jnp.bfloat16)
    return {name: (int(c.flops), int(c.bytes_accessed))
            for name, c in splash_attention.kernel_costs(static, shaped).items()}


_CHILD = ("import json, sys\nfrom bertjax.aot import kernel_schedule\n"
          "print(json.dumps(kernel_schedule.compile_kernels(json.loads(sys.argv[1]))))")


def compile_kernels(spec: dict) -> dict[str, tuple[int, int]]:
    """Compiles the kernels' forward and backward for one chip of spec["topology"]; returns
    each one's cost_estimate (FLOPs, bytes), the key under which the step's HLO carries it."""
    if spec.pop("family") == "SplashKernels":
        return _compile_splash(spec)
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from bertjax.aot import topology
    from bertjax.models.kernels import dropout_attention, flash_attention

    k = FlashKernels(**{f.name: spec[f.name] for f in dataclasses.fields(FlashKernels)})
    device = topology.devices(topology.parse(spec["topology"]))[0]
    mesh = Mesh(np.array([device]), ("data",))  # Pallas reads the chip from the mesh
    sharding = NamedSharding(mesh, PartitionSpec())

    def arg(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

    qkv = arg((k.batch, k.seq, 3 * k.heads * k.head_dim), jnp.bfloat16)

    def forward_and_backward(qkv, bias, segments, seed):
        out, vjp = jax.vjp(lambda qkv, bias: dropout_attention.dropout_attention(
            qkv, bias, segments, seed, k.rate, k.heads, k.causal), qkv, bias)
        return vjp(out)

    with jax.set_mesh(mesh):
        jax.jit(forward_and_backward).lower(
            qkv, arg((3 * k.heads * k.head_dim,), jnp.bfloat16),
            arg((k.batch, k.seq), jnp.int32), arg((1,), jnp.int32)).compile()
    shape = flash_attention.Shape(k.batch, k.heads, k.seq, k.head_dim, 2)
    static = dropout_attention.Static(k.causal, k.head_dim ** -0.5, k.rate, k.heads, k.head_dim,
                                      dropout_attention.rows_per_step(k.batch, k.seq))
    return {name: (int(c.flops), int(c.bytes_accessed)) for name, c in (
        ("forward", dropout_attention.forward_cost(shape, static)),
        ("backward", dropout_attention.backward_cost(shape, static)))}

