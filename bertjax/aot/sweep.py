"""`--sweep`: meshes (data / fsdp / tensor), batch sizes and remat policies compiled for a
slice, the configurations that fit ranked by estimated sequences/s, with their flags."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

from bertjax.aot import topology as topology_lib
from bertjax.aot.measure import GIB, StageCost, compile_stages
from bertjax.aot.report import duration
from bertjax.errors import ConfigError

REMAT_POLICIES = ("none", "dots", "full")
PER_REPLICA_BATCHES = (64, 32, 16, 8)  # sequences per data-parallel replica, largest first


def mesh_candidates(num_chips: int, num_heads: int) -> list[tuple[int, int, int]]:
    """(data, fsdp, tensor): data parallel, fully sharded (FSDP), and each with 2- and 4-way
    tensor parallelism where the heads and chips divide."""
    meshes = []
    for tensor in (1, 2, 4):
        if num_chips % tensor or num_heads % tensor or tensor > num_chips:
            continue
        rest = num_chips // tensor
        for fsdp in (1, rest):
            mesh = (rest // fsdp, fsdp, tensor)
            if mesh not in meshes:
                meshes.append(mesh)
    return meshes


@dataclasses.dataclass
class Candidate:
    mesh: tuple[int, int, int]
    remat: str
    batch_size: int  # global
    costs: list[StageCost]

    @property
    def fits(self) -> bool:
        return bool(self.costs) and all(c.fits for c in self.costs)

    @property
    def sequences_per_second(self) -> float | None:
        """Over the whole run: sequences of every stage over the time of every stage."""
        seconds = [c.seconds for c in self.costs]
        if not self.fits or not all(seconds):
            return None
        return sum(c.steps * c.batch_size for c in self.costs) / sum(seconds)

    def flags(self) -> str:
        data, fsdp, tensor = self.mesh
        return (f"--config.mesh.data={data} --config.mesh.fsdp={fsdp} "
                f"--config.mesh.tensor={tensor} --config.train.batch_size={self.batch_size} "
                f"--config.model.remat_policy={self.remat} --config.model.scan_layers=false")


def _try(make_job, config, slice_, devices, mesh, remat, batch_size, exact) -> Candidate:
    config = config.copy_and_resolve_references()
    config.mesh.data, config.mesh.fsdp, config.mesh.tensor = mesh
    config.train.batch_size = batch_size
    with config.unlocked():  # fine-tuning's config.model holds only the fields it overrides
        config.model.remat_policy = remat
    costs, _ = compile_stages(make_job, config, slice_, devices, exact, until_misfit=True)
    return Candidate(mesh, remat, batch_size, costs)


def sweep(make_job: Callable[[Any], Any], config, topology: str, print_fn=print,
          budget_seconds: float = 600.0, exact: bool = False) -> list[Candidate]:
    """Tries meshes (data / fsdp / tensor), batch sizes and remat policies on a slice (layers
    unrolled, estimated as in compile_stages); prints the configurations that fit, by estimated
    sequences/s, with the flags that select each. For each mesh and remat, batches are tried
    largest first and the first that fits is kept (a larger batch would not fit; a smaller one
    is rarely faster).

    make_job(config) -> the job of a config (pre-training or fine-tuning). Compiles stop after
    `budget_seconds`; the candidates not tried are counted.
    """
    slice_ = topology_lib.parse(topology)
    devices = topology_lib.devices(slice_)
    heads = make_job(config).model_config.num_heads
    keys = [(mesh, remat) for remat in REMAT_POLICIES
            for mesh in mesh_candidates(slice_.num_chips, heads)]
    print_fn(f"Sweep on {slice_.accelerator_type} ({slice_.topology_name}, {slice_.num_chips} "
             f"chips): {len(keys)} mesh/remat settings x batches "
             f"{'/'.join(map(str, PER_REPLICA_BATCHES))} per replica, largest first "
             f"(budget {budget_seconds:.0f} s)")
    start, results, untried = time.time(), [], 0
    for mesh, remat in keys:
        for per_replica in PER_REPLICA_BATCHES:
            if time.time() - start > budget_seconds:
                untried += 1
                break
            batch = per_replica * mesh[0] * mesh[1]
            tic = time.time()
            try:
                candidate = _try(make_job, config, slice_, devices, mesh, remat, batch, exact)
            except ConfigError as e:  # e.g. a batch the mesh cannot split
                print_fn(f"  skipped mesh {mesh} batch {batch}: {e}")
                continue
            speed = candidate.sequences_per_second
            worst = max(candidate.costs, key=lambda c: c.total_bytes / c.hbm_bytes)
            verdict = (f"{speed:,.0f} seq/s" if speed else
                       "fits (no cost-model time on this chip)" if candidate.fits else
                       f"{worst.name} does not fit ({worst.total_bytes / GIB:.1f} of "
                       f"{worst.hbm_bytes / GIB:.1f} GiB)")
            print_fn(f"  mesh data/fsdp/tensor {'x'.join(map(str, mesh)):<8} batch {batch:>6} "
                     f"remat {remat:<4}: {verdict} "
                     f"({time.time() - tic:.0f} s)")
            results.append(candidate)
            if candidate.fits:
                break
    ranked = sorted((c for c in results if c.sequences_per_second),
                    key=lambda c: -c.sequences_per_second)
    print_fn(f"Configurations that fit, fastest first ({len(results)} compiled in "
             f"{time.time() - start:.0f} s" + (f", {untried} settings not tried within the "
                                               "budget" if untried else "") + "):")
    print_fn(f"  {'#':>2} {'seq/s':>9} {'MFU':>6} {'max GiB':>8} {'time':>9}  flags")
    for rank, c in enumerate(ranked, 1):
        model_flops = sum(s.model_flops * s.steps for s in c.costs)
        mfu = model_flops / (sum(s.seconds for s in c.costs) * slice_.num_chips
                             * slice_.peak_flops)
        print_fn(f"  {rank:>2} {c.sequences_per_second:>9,.0f} {100 * mfu:>5.1f}% "
                 f"{max(s.total_bytes for s in c.costs) / GIB:>8.2f} "
                 f"{duration(sum(s.seconds for s in c.costs)):>9}  {c.flags()}")
    if not ranked:
        print_fn("  none ranked: " + ("the compiler gave no time estimates for "
                                      f"{slice_.chip.family}" if any(c.fits for c in results)
                                      else "every configuration tried runs out of HBM"))
    return ranked
