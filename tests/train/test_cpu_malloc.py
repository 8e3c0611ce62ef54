"""Commands on a CPU machine restart themselves with huge pages for malloc (cli.run →
runtime.restart_with_malloc_tunable), because
XLA:CPU maps a step's temporary buffers afresh on every call."""

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, run_python

from bertjax import accelerators, runtime

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc"
    or accelerators.attached(), reason="the restart is for glibc machines without an "
    "accelerator")

PRINT_TUNABLES = ("import os; from bertjax import cli; "
                  "cli.run(lambda argv: print(os.getpid(), os.environ.get('GLIBC_TUNABLES')))")


def _command_sees(tunables: str | None) -> tuple[int, str]:
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    if tunables is not None:
        env["GLIBC_TUNABLES"] = tunables
    process = subprocess.Popen([sys.executable, "-c", PRINT_TUNABLES], cwd=ROOT, env=env,
                               stdout=subprocess.PIPE, text=True)
    out, _ = process.communicate(timeout=120)
    assert process.returncode == 0
    pid, seen = out.split()
    assert int(pid) == process.pid  # restarted in place: the same process
    return seen


def test_a_command_restarts_with_the_tunable_and_keeps_the_users():
    assert _command_sees(None) == runtime.MALLOC_TUNABLE
    assert _command_sees("glibc.malloc.arena_max=2") == (
        f"glibc.malloc.arena_max=2:{runtime.MALLOC_TUNABLE}")
    assert _command_sees("glibc.malloc.hugetlb=0") == "glibc.malloc.hugetlb=0"  # the user's


# Minor page faults of 20 calls of the gradient of an MLM-like softmax: its [2048, 8000]
# logits (64 MB) are a temporary buffer of every call.
COUNT_FAULTS = """
import resource, jax, jax.numpy as jnp
f = jax.jit(jax.grad(lambda h, e: jax.nn.logsumexp(h @ e.T, axis=-1).sum(), argnums=(0, 1)))
h, e = jnp.full((2048, 128), 0.01), jnp.full((8000, 128), 0.01)
jax.block_until_ready(f(h, e))
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    jax.block_until_ready(f(h, e))
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@pytest.mark.slow
def test_huge_pages_cut_the_page_faults_of_a_steps_temporaries():
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not thp.exists() or "[never]" in thp.read_text():
        pytest.skip("transparent huge pages are off on this machine")
    faults = {}
    for setting in ("glibc.malloc.hugetlb=0", runtime.MALLOC_TUNABLE):
        result = run_python(["-c", COUNT_FAULTS],
                            env={"GLIBC_TUNABLES": setting, "JAX_PLATFORMS": "cpu"})
        assert result.returncode == 0, result.stderr
        faults[setting] = int(result.stdout.split()[-1])
    # 4 KiB pages: 16k faults per call and 64 MB buffer; 2 MiB pages: 32.
    assert faults["glibc.malloc.hugetlb=0"] > 20 * 8_000
    assert faults[runtime.MALLOC_TUNABLE] * 10 < faults["glibc.malloc.hugetlb=0"], faults
