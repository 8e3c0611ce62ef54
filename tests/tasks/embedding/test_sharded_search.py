"""Exact search with the corpus sharded over a mesh (metrics.search(mesh=...)) gives the
one-device results bitwise, scores and rows: on 4 CPU devices of one process (meshes of one
and two axes) and on 2 processes of 2 devices each (the global mesh); hard-negative mining
over the mesh likewise."""

import os
import subprocess
import sys

import pytest
from conftest import ROOT, run_python
from multihost import devices_env, free_port

CASES = r"""
import numpy as np
from bertjax.tasks.embedding import metrics, mining

def cases():
    rng = np.random.default_rng(3)
    q = rng.normal(size=(13, 24)).astype(np.float32)
    # 103 rows: a multiple of neither the devices nor the chunk; equal vectors in one chunk
    # on two devices (51, 52), on one device (49, 50), and in two chunks (5, 77).
    c = (rng.normal(size=(103, 24)) * rng.uniform(0.5, 2, (103, 1))).astype(np.float32)
    c[77], c[52], c[50] = c[5], c[51], c[49]
    # k 30: more than a device's rows a step; 200: every row; chunk 1000: all on device 0.
    for k, similarity, chunk in ((30, "cosine", 16), (200, "dot", 10), (5, "cosine", 1000)):
        yield (q, c, k, similarity, chunk), f"{similarity} k={k} chunk={chunk}"
    yield (q, c[:3], 5, "cosine", 16), "3 rows, fewer than the devices"
"""

ONE_PROCESS = CASES + r"""
import jax
from jax.sharding import Mesh
assert len(jax.devices()) == 4
meshes = [Mesh(np.array(jax.devices()), ("corpus",)),
          Mesh(np.array(jax.devices()).reshape(2, 2), ("a", "b"))]
for (q, c, k, similarity, chunk), name in cases():
    one = metrics.search(q, c, k, similarity, chunk_rows=chunk, query_rows=8)
    assert one[1].shape == (13, min(k, len(c))), name
    for mesh in meshes:
        got = metrics.search(q, c, k, similarity, chunk_rows=chunk, query_rows=8, mesh=mesh)
        np.testing.assert_array_equal(got[1], one[1], err_msg=name)
        np.testing.assert_array_equal(got[0], one[0], err_msg=name)
        assert got[0].dtype == np.float32 and got[1].dtype == np.int64
rng = np.random.default_rng(0)
a, c = rng.normal(size=(20, 16)), rng.normal(size=(90, 16))
positives = [[i, 20 + i] if i % 4 == 0 else [i] for i in range(20)]
settings = dict(num_negatives=3, relative_margin=0.05, chunk_rows=8)
one = mining.mine_hard_negatives(a, c, positives, **settings)
got = mining.mine_hard_negatives(a, c, positives, mesh=meshes[0], **settings)
np.testing.assert_array_equal(got.negatives, one.negatives)
np.testing.assert_array_equal(got.scores, one.scores)
print("SHARDED_OK")
"""

TWO_PROCESSES = CASES + r"""
import hashlib, sys
import jax
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(f"localhost:{sys.argv[1]}", num_processes=2,
                           process_id=int(sys.argv[2]))
from jax.sharding import Mesh
assert len(jax.devices()) == 4 and len(jax.local_devices()) == 2
mesh = Mesh(np.array(jax.devices()), ("corpus",))
digest = hashlib.sha256()
for (q, c, k, similarity, chunk), name in cases():
    if len(c) < 100:
        continue
    one = metrics.search(q, c, k, similarity, chunk_rows=chunk, query_rows=8)
    got = metrics.search(q, c, k, similarity, chunk_rows=chunk, query_rows=8, mesh=mesh)
    np.testing.assert_array_equal(got[1], one[1], err_msg=name)
    np.testing.assert_array_equal(got[0], one[0], err_msg=name)
    digest.update(got[0].tobytes() + got[1].tobytes())
print("DIGEST", digest.hexdigest())
"""


def test_sharded_search_equals_one_device_bitwise():
    result = run_python(["-c", ONE_PROCESS], env=devices_env(4), timeout=300)
    assert "SHARDED_OK" in result.stdout, result.stdout + result.stderr[-3000:]


@pytest.mark.slow  # two processes joined by jax.distributed
def test_sharded_search_over_two_processes_equals_one_device():
    """Every process passes the same queries and corpus, sends its own devices' rows, and
    reads the same results."""
    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-c", TWO_PROCESSES, str(port), str(i)],
                              cwd=ROOT, env={**os.environ, **devices_env(2)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(2)]
    try:
        results = [proc.communicate(timeout=300) for proc in procs]
    finally:
        for proc in procs:  # one left waiting for its peer
            if proc.poll() is None:
                proc.kill()
    for proc, (_, err) in zip(procs, results):
        assert proc.returncode == 0, err[-3000:]
    digests = [[x for x in out.splitlines() if x.startswith("DIGEST")] for out, _ in results]
    assert len(digests[0]) == 1 and digests[0] == digests[1]
