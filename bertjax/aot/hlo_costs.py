"""Where a compiled step's HBM traffic and FLOPs go: its optimized HLO, op by op.

XLA's `cost_analysis()` gives totals only. This reads `compiled.as_text()` (the HLO after the
TPU compiler's fusion and memory-space assignment) and costs each top-level instruction of the
program (the entry computation and the bodies of its loops, times their trip counts):

- bytes: its operands plus its result, counting only arrays in HBM (a TPU layout's `S(n)`
  memory space other than 0 is on-chip: VMEM, SMEM, semaphores) at their logical size (tile
  padding is not counted). A prefetch (`copy-start`) counts its source and destination once.
- FLOPs: 2 per multiply-add of each convolution / dot inside it (the TPU compiler turns every
  matmul into a convolution, windowed, strided or dilated to express batched matmuls;
  elementwise work is not counted).
- seconds: its roofline, max(FLOPs / peak, bytes / HBM bandwidth), a lower bound per op.
- cycles: the TPU compiler's own cost-model estimate for the op (`estimated_cycles` in its
  backend config). A Pallas kernel's `custom-call` carries none: its `cost_estimate`'s
  roofline stands in, or, for the flash kernels, the larger of that and the cycles of the
  schedule the compiler gave the kernel (bertjax/aot/kernel_schedule.py). Summed and
  divided by the chip's clock, they are the dry run's step time: a model of its own, not
  XLA's `optimal_seconds` (−4…+9% from it at 128 tokens, +36…46% at 512; docs/tpu_aot.md,
  "Two models of the step"), and libtpu annotates them on v4, v5e and v6e too, where it
  gives no `optimal_seconds`.

Each op falls in a category by its opcode and the `op_name` its metadata carries (the Flax
module path, e.g. `.../bert/encoder/layer_3/attention/query/dot_general`).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterable

# Categories in the order they are tested against an op (first match wins).
CATEGORIES = ("collectives", "dropout + RNG", "layer norm", "attention", "FFN", "embeddings",
              "heads + loss", "optimizer update", "other")
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
# Instructions that move no data of their own (or whose data their `-start` counted).
NO_TRAFFIC = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "copy-done",
              "partition-id", "replica-id", "after-all", "opt-barrier", "while", "call",
              "conditional", "all-reduce-done", "all-gather-done", "collective-permute-done",
              "async-done", "slice-done"}
# Ops that read only the part of their first operand they return (the TPU compiler's
# asynchronous `slice-start` result is (operands, slice, context)).
SLICES = {"slice", "dynamic-slice", "slice-start"}
BYTES_PER_ELEMENT = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
                     "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8,
                     "c128": 16, "s4": 0.5, "u4": 0.5, "token": 0}

_ARRAY = re.compile(r"\b([a-z]+[0-9]*(?:e[0-9]m[0-9][a-z0-9]*)?)\[([0-9,]*)\](\{[^}]*\})?")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*")
_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\{\s*$")


@dataclasses.dataclass(frozen=True)
class Instruction:
    name: str
    shape: str  # result shape, e.g. "bf16[64,128]{1,0:T(8,128)(2,1)}" or a tuple "(...)"
    opcode: str
    operands: tuple[str, ...]  # instruction names
    attributes: str  # the rest of the line: window=, dim_labels=, calls=, metadata=, ...


@dataclasses.dataclass(frozen=True)
class OpCost:
    name: str
    opcode: str
    op_name: str  # metadata op_name, layer index replaced by N ("layer_N")
    category: str
    bytes: float
    flops: float
    count: float = 1.0  # executions per step (a loop body's trip count)
    cycles: float = 0.0  # the TPU cost model's estimate, per step (see `estimated_cycles`)
    # The same without kernels' schedules: a Pallas kernel as XLA's cost model sees it.
    unscheduled_cycles: float = 0.0


def _closing(text: str, start: int) -> int:
    """Index of the bracket closing the one at text[start]."""
    pairs = {"(": ")", "[": "]", "{": "}"}
    opening, depth = text[start], 0
    for i in range(start, len(text)):
        if text[i] == opening:
            depth += 1
        elif text[i] == pairs[opening]:
            depth -= 1
            if depth == 0:
                return i
    raise ValueError(f"unbalanced {opening!r} in HLO line: {text[:120]}")


def parse_instruction(line: str) -> Instruction | None:
    """One HLO instruction line → Instruction (None for anything else)."""
    match = _INSTRUCTION.match(line)
    if not match:
        return None
    rest = line[match.end():]
    if rest.startswith("("):
        end = _closing(rest, 0) + 1
    else:
        end = rest.index(" ") if " " in rest else len(rest)
        brace = rest.find("{")
        if 0 <= brace < end:  # a layout may hold spaces: "{1,0:T(8,128)}"
            end = _closing(rest, brace) + 1
    shape, rest = rest[:end], rest[end:].lstrip()
    paren = rest.find("(")
    if paren < 0:
        return None
    opcode = rest[:paren].strip()
    close = _closing(rest, paren)
    operands = tuple(re.findall(r"%([\w.\-]+)", rest[paren + 1:close]))
    return Instruction(match.group(1), shape, opcode, operands, rest[close + 1:])


def logical_lines(text: str) -> list[str]:
    """The module's lines with each instruction on one: an attribute may span lines (a Pallas
    kernel's `frontend_attributes={kernel_metadata={...}}` does, and its continuation starts
    with "}}"), so a line that starts no instruction, header or closing brace continues the
    one before it."""
    out: list[str] = []
    for line in text.splitlines():
        starts = (_INSTRUCTION.match(line) or _HEADER.match(line) or line.strip() == "}"
                  or not out or line.startswith("HloModule"))
        if starts:
            out.append(line)
        else:
            out[-1] += "\n" + line
    return out


def parse_module(text: str) -> tuple[dict[str, list[Instruction]], str]:
    """HLO module text → ({computation name: its instructions}, name of the entry)."""
    computations: dict[str, list[Instruction]] = {}
    entry, current = "", None
    for line in logical_lines(text):
        header = _HEADER.match(line)
        if header and not _INSTRUCTION.match(line):
            current = header.group(2)
            computations[current] = []
            if header.group(1):
                entry = current
        elif line.strip() == "}":
            current = None
        elif current is not None and (instruction := parse_instruction(line)):
            computations[current].append(instruction)
    if not entry:
        raise ValueError("no ENTRY computation in the HLO text")
    return computations, entry


def arrays(shape: str) -> list[tuple[str, tuple[int, ...], str]]:
    """The arrays of a (tuple) shape: [(dtype, dims, layout)]."""
    return [(dtype, tuple(int(d) for d in dims.split(",") if d), layout or "")
            for dtype, dims, layout in _ARRAY.findall(shape)]


def _in_hbm(layout: str) -> bool:
    space = re.search(r"S\((\d+)\)", layout)
    return space is None or space.group(1) == "0"


def hbm_bytes(shape: str, first_only: bool = False) -> float:
    """Bytes of the arrays of `shape` that live in HBM (logical size, no tile padding)."""
    found = arrays(shape)[:1] if first_only else arrays(shape)
    return float(sum(math.prod(dims) * BYTES_PER_ELEMENT.get(dtype, 4)
                     for dtype, dims, layout in found if _in_hbm(layout)))


def slice_bytes(instruction: Instruction, shapes: dict[str, str]) -> float:
    """HBM bytes of a slice: the slice read from its source and written to its destination,
    each where it is in HBM (a `slice-start` fetching into VMEM reads HBM only)."""
    found = arrays(instruction.shape)
    dtype, dims, layout = found[1] if instruction.opcode == "slice-start" else found[0]
    size = math.prod(dims) * BYTES_PER_ELEMENT.get(dtype, 4)
    source = arrays(shapes.get(instruction.operands[0], "")) if instruction.operands else []
    reads = bool(source) and _in_hbm(source[0][2] or "")
    return float(size * (reads + _in_hbm(layout or "")))


def _attribute(attributes: str, key: str) -> str | None:
    match = re.search(rf"\b{key}=([^\s,]+(?:\{{[^}}]*\}})?)", attributes)
    return match.group(1) if match else None


def _window(attributes: str) -> dict[str, list[list[int]]]:
    """window={size=64x2 stride=63x1 pad=0_0x1_1 lhs_dilate=64x2} → lists per spatial dim."""
    match = re.search(r"window=\{([^}]*)\}", attributes)
    fields = {}
    for item in (match.group(1).split() if match else []):
        key, value = item.split("=")
        fields[key] = [[int(v) for v in part.split("_")] for part in value.split("x")]
    return fields


def _valid_taps(out: int, kernel: int, size: int, stride: int, pad_low: int, lhs_dilate: int,
                rhs_dilate: int) -> int:
    """(output position, kernel position) pairs of one spatial dimension that read a real input
    element (not padding, not a hole of lhs dilation)."""
    total = 0
    dilated = (size - 1) * lhs_dilate + 1
    for k in range(kernel):
        positions = range(-pad_low + k * rhs_dilate,
                          -pad_low + k * rhs_dilate + out * stride, stride)
        total += sum(1 for p in positions if 0 <= p < dilated and p % lhs_dilate == 0)
    return total


def convolution_flops(instruction: Instruction, shapes: dict[str, str]) -> float:
    """2 × multiply-adds of a convolution: output batch × output features × input features per
    group × the valid (output, kernel) pairs of every spatial dimension."""
    labels = _attribute(instruction.attributes, "dim_labels")
    lhs_labels, rest = labels.split("_", 1)
    rhs_labels, out_labels = rest.split("->")
    lhs = arrays(shapes[instruction.operands[0]])[0][1]
    rhs = arrays(shapes[instruction.operands[1]])[0][1]
    out = arrays(instruction.shape)[0][1]
    window = _window(instruction.attributes)
    spatial = len(lhs_labels) - 2
    taps = 1
    for d in range(spatial):
        label = str(d)
        get = lambda key, default, d=d: window.get(key, [[default]] * spatial)[d]  # noqa: E731
        taps *= _valid_taps(out[out_labels.index(label)], rhs[rhs_labels.index(label)],
                            lhs[lhs_labels.index(label)], get("stride", 1)[0],
                            get("pad", 0)[0], get("lhs_dilate", 1)[0], get("rhs_dilate", 1)[0])
    batch = out[out_labels.index("b")]
    return 2.0 * batch * out[out_labels.index("f")] * rhs[rhs_labels.index("i")] * taps


def dot_flops(instruction: Instruction, shapes: dict[str, str]) -> float:
    """2 × output elements × the product of the contracted dimensions."""
    lhs = arrays(shapes[instruction.operands[0]])[0][1]
    out = arrays(instruction.shape)[0][1]
    dims = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", instruction.attributes)
    contracted = [lhs[int(d)] for d in dims.group(1).split(",") if d] if dims else []
    return 2.0 * math.prod(out) * math.prod(contracted)


def _called(instruction: Instruction) -> list[str]:
    return re.findall(r"(?:calls|to_apply|body|condition)=%?([\w.\-]+)", instruction.attributes)


def matmul_flops(instruction: Instruction, computations: dict[str, list[Instruction]],
                 shapes: dict[str, str]) -> float:
    """FLOPs of the convolutions and dots an instruction runs (inside its fusions too)."""
    if instruction.opcode == "convolution":
        return convolution_flops(instruction, shapes)
    if instruction.opcode == "dot":
        return dot_flops(instruction, shapes)
    if instruction.opcode != "fusion":
        return 0.0
    return sum(matmul_flops(inner, computations, shapes)
               for called in _called(instruction) for inner in computations.get(called, []))


def op_name(instruction: Instruction) -> str:
    """The metadata op_name without its `jit(train_step)/` prefix, layers as `layer_N` (BERT's
    `layer_3`) or `layers_N` (ModernBERT's `layers_3`); "" for none, or one the compiler made
    up ("broadcast.2168")."""
    match = re.search(r'op_name="(jit\([^)]*\)/[^"]*)"', instruction.attributes)
    name = re.sub(r"^jit\([^)]*\)/", "", match.group(1)) if match else ""
    return re.sub(r"(layers?)_\d+", r"\1_N", name)


KERNELS, KERNEL_ESTIMATES, XLA_OPS = "Pallas kernels", "Pallas kernels' cost estimates", "XLA ops"


def source(op: OpCost) -> str:
    """Whose estimate an op's time is: a Pallas kernel's (a custom call: its compiled schedule
    or cost estimate, `estimated_cycles`), else the TPU compiler's (KERNELS or XLA_OPS)."""
    return KERNELS if op.opcode == "custom-call" else XLA_OPS


def short_label(op: OpCost) -> str:
    """"category: fwd|bwd path" for a table: the op_name without the model class, `bert/` and
    `encoder/` (fwd: the forward pass, under jvp; bwd: the backward pass, under transpose)."""
    name = op.op_name
    direction = ("bwd " if name.startswith("transpose(") else
                 "fwd " if name.startswith("jvp(") else "")
    if direction:
        # jvp(BertForPreTraining)/x, transpose(jvp(jit(log_softmax)))/x, jvp()/x → x
        name = re.sub(r"^(transpose\()?jvp\((jit\((\w+)\)|\w*)\)\)?/?", r"\3/", name)
        name = name.lstrip("/")
    name = re.sub(r"^bert/(encoder/)?", "", name)
    return f"{op.category}: {direction}{name or op.opcode}"


def category(opcode: str, name: str, shape: str = "") -> str:
    """The category of an op from its opcode, normalised op_name and result shape (see
    CATEGORIES)."""
    lowered = name.lower()
    if opcode.removesuffix("-start") in COLLECTIVES:
        return "collectives"
    if "dropout" in lowered or "threefry" in lowered or "random_bits" in lowered:
        return "dropout + RNG"
    if not name and shape.lstrip("(").startswith("u32["):
        return "dropout + RNG"  # unnamed: random bits are the step's only u32 arrays
    # A ModernBERT's norms are "norm", "attn_norm", "mlp_norm", "final_norm".
    if ("layer_norm" in lowered or "layernorm" in lowered
            or re.search(r"/(attn_|mlp_|final_)?norm/", lowered)):
        return "layer norm"
    if "/attention/" in lowered or "/attn/" in lowered:  # BERT's, a ModernBERT's
        return "attention"
    # intermediate (and its GELU) and output dense, a ModernBERT's GeGLU; remat puts the layer
    # under "checkpoint/"
    if re.search(r"/encoder/(checkpoint/)?layer_n/", lowered) or "/mlp/" in lowered:
        return "FFN"
    if "/embeddings/" in lowered:
        return "embeddings"
    # The heads (the pooler feeds NSP) and the loss computed outside the model: what is left
    # of the forward and backward passes outside bert/.
    if "/pooler/" in lowered or ("jvp(" in name and "/bert/" not in name):
        return "heads + loss"
    if name and "jvp(" not in name and "transpose(" not in name:
        return "optimizer update"  # after the gradient: clipping, moments, the update
    return "other"


def estimated_cycles(instruction: Instruction, clock_hz: float, peak_flops: float,
                     hbm_bytes_per_s: float,
                     kernel_cycles: dict[tuple[int, int], float] | None = None) -> float:
    """The TPU compiler's cycle estimate for one execution of an op (0 where it has none); for
    a Pallas kernel, the roofline of the `cost_estimate` it was given, in cycles (XLA's cost
    model sees a kernel only through that estimate), or the kernel's scheduled cycles where
    `kernel_cycles` ({(FLOPs, bytes) of its cost_estimate: cycles}) has them and they are
    more."""
    match = re.search(r'"estimated_cycles":"(\d+)"', instruction.attributes)
    if match:
        return float(match.group(1))
    kernel = re.search(r'"cost_estimate":\{"flops":"(\d+)","transcendentals":"\d+",'
                       r'"bytes_accessed":"(\d+)"', instruction.attributes)
    if not kernel or not clock_hz:
        return 0.0
    flops, bytes_ = int(kernel.group(1)), int(kernel.group(2))
    roofline = clock_hz * max(flops / peak_flops, bytes_ / hbm_bytes_per_s)
    return max(roofline, (kernel_cycles or {}).get((flops, bytes_), 0.0))


def _trip_count(instruction: Instruction) -> float:
    match = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', instruction.attributes)
    return float(match.group(1)) if match else 1.0


def _prefetch_names(computations: dict[str, list[Instruction]]) -> dict[str, str]:
    """{copy-start name: op_name of the op that reads what it prefetched} (a prefetch carries
    no metadata of its own)."""
    done = {i.operands[0]: i.name for body in computations.values() for i in body
            if i.opcode == "copy-done" and i.operands}
    reader: dict[str, str] = {}
    for body in computations.values():
        for i in body:
            for operand in i.operands:
                reader.setdefault(operand, op_name(i))
    return {start: reader.get(d, "") for start, d in done.items()}


def op_costs(text: str, clock_hz: float = 0.0, peak_flops: float = 1.0,
             hbm_bytes_per_s: float = 1.0,
             kernel_cycles: dict[tuple[int, int], float] | None = None) -> list[OpCost]:
    """The cost of every top-level op of a compiled program's HLO text (see the module doc);
    ops in a loop body are counted its trip count times (once when it is unknown). The chip's
    clock and rates turn a Pallas kernel's cost estimate into cycles (`estimated_cycles`;
    kernel_cycles: the kernels' scheduled cycles by their estimates' FLOPs and bytes)."""
    computations, entry = parse_module(text)
    shapes = {i.name: i.shape for body in computations.values() for i in body}
    prefetched = _prefetch_names(computations)
    costs: list[OpCost] = []

    def walk(name: str, count: float) -> None:
        for instruction in computations.get(name, []):
            if instruction.opcode in ("while", "call", "conditional"):
                for called in _called(instruction):
                    walk(called, count * _trip_count(instruction))
                continue
            if instruction.opcode in NO_TRAFFIC:
                continue
            if instruction.opcode in SLICES:
                moved = slice_bytes(instruction, shapes)
            else:
                prefetch = instruction.opcode == "copy-start"  # (destination, source, ...)
                moved = hbm_bytes(instruction.shape, first_only=prefetch) + sum(
                    hbm_bytes(shapes.get(o, "")) for o in instruction.operands)
            label = op_name(instruction) or prefetched.get(instruction.name, "")
            rates = (clock_hz, peak_flops, hbm_bytes_per_s)
            costs.append(OpCost(instruction.name, instruction.opcode, label,
                                category(instruction.opcode, label, instruction.shape),
                                moved * count,
                                matmul_flops(instruction, computations, shapes) * count, count,
                                estimated_cycles(instruction, *rates, kernel_cycles) * count,
                                estimated_cycles(instruction, *rates) * count))

    walk(entry, 1.0)
    return costs


@dataclasses.dataclass(frozen=True)
class Group:
    """Ops of one category or one op_name: totals per step, per chip."""

    key: str
    count: float
    bytes: float
    flops: float
    seconds: float  # sum of the ops' rooflines
    model_seconds: float = 0.0  # sum of the cost model's estimates (cycles / clock)


def group(costs: Iterable[OpCost], key, peak_flops: float, hbm_bytes_per_s: float,
          clock_hz: float = 0.0) -> dict[str, Group]:
    """Totals of `costs` by key(op) → {key: Group}; seconds are per-op rooflines summed,
    model_seconds the cost model's cycle estimates over the clock."""
    totals: dict[str, list[float]] = {}
    for c in costs:
        t = totals.setdefault(key(c), [0.0, 0.0, 0.0, 0.0, 0.0])
        t[0] += c.count
        t[1] += c.bytes
        t[2] += c.flops
        t[3] += max(c.flops / peak_flops, c.bytes / hbm_bytes_per_s)
        t[4] += c.cycles / clock_hz if clock_hz else 0.0
    return {k: Group(k, *v) for k, v in totals.items()}


def extrapolate_groups(one: dict[str, Group], two: dict[str, Group], layers: int
                       ) -> dict[str, Group]:
    """Groups of an L-layer step from those of the 1- and 2-layer steps: each figure is
    fixed + L × per-layer, i.e. one + (L - 1) × (two - one) (from n and n + 1 layers, pass
    L - n + 1); a group absent from one side counts zero there."""
    empty = Group("", 0.0, 0.0, 0.0, 0.0, 0.0)
    fields = ("count", "bytes", "flops", "seconds", "model_seconds")
    out = {}
    for k in dict.fromkeys([*one, *two]):
        a, b = one.get(k, empty), two.get(k, empty)
        values = [max(0.0, getattr(a, f) + (layers - 1) * (getattr(b, f) - getattr(a, f)))
                  for f in fields]
        out[k] = Group(k, *values)
    return out


def table(groups: dict[str, Group], title: str, top: int | None = None) -> list[str]:
    """Lines of a table of groups, largest cost-model time first (roofline time where the
    compiler gave no estimates), with each one's share of it."""
    timed = any(g.model_seconds for g in groups.values())

    def seconds(g: Group) -> float:
        return g.model_seconds if timed else g.seconds

    rows = sorted(groups.values(), key=lambda g: -seconds(g))
    total = Group("total", *(sum(getattr(g, f) for g in rows)
                             for f in ("count", "bytes", "flops", "seconds", "model_seconds")))
    width = max([len(title), 5] + [len(g.key) for g in rows[:top]])
    width = min(width, 90)
    lines = [f"  {title:<{width}} {'ops':>6} {'GB':>8} {'TFLOP':>8} {'bound ms':>9} "
             f"{'model ms':>9} {'share':>6}"]
    for g in [*rows[:top], total]:
        share = seconds(g) / seconds(total) if seconds(total) else 0.0
        key = g.key if len(g.key) <= width else "…" + g.key[-width + 1:]
        model = f"{g.model_seconds * 1e3:>9.2f}" if timed else f"{'—':>9}"
        lines.append(f"  {key:<{width}} {g.count:>6.0f} {g.bytes / 1e9:>8.2f} "
                     f"{g.flops / 1e12:>8.3f} {g.seconds * 1e3:>9.2f} {model} "
                     f"{100 * share:>5.1f}%")
    return lines
