"""The sharded model across processes (JAX's multi-controller runtime, CPU
collectives): two processes of two CPU devices each decode the same tokens as one
process holding the same tp=2 x ep=2 mesh, and as one unsharded device; the
quantized dense model in the CUDA default kernel layout (cuda_mma, its
row-parallel matrices in the split layout)."""

import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _free_port():
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _launch(nproc):
    port = str(_free_port())
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    procs = [subprocess.Popen([sys.executable, "-m", "tests.multiprocess_cases", str(i),
                               str(nproc), port], cwd=ROOT, env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for i in range(nproc)]
    outs = []
    for p in procs:
        try:
            stdout, stderr = p.communicate(timeout=420)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        assert p.returncode == 0, stderr[-4000:]
        outs.append(json.loads(stdout.strip().splitlines()[-1]))
    return outs


# a subprocess of a minute of CPU: CI's full matrix (tests/conftest.py), not the README's run
@pytest.mark.full
@pytest.mark.slow
def test_two_processes_decode_like_one():
    (one,) = _launch(1)
    two = _launch(2)
    assert one["process_count"] == 1 and all(o["process_count"] == 2 for o in two)
    assert one["devices"] == 4 and all(o["devices"] == 4 for o in two)
    cases = sorted(k for k in one if k.endswith("/sharded"))
    assert len(cases) == 3
    assert one["layouts"] == two[0]["layouts"] == ["cuda_mma", "cuda_mma/k2"], one["layouts"]
    for case in cases:
        ref = one[case.replace("/sharded", "/unsharded")]
        for got in (one[case], two[0][case], two[1][case]):
            assert got["tokens"] == ref["tokens"], case
            np.testing.assert_allclose(got["logits"], ref["logits"], rtol=1e-3, atol=1e-3,
                                       err_msg=case)
