"""SASS of a Pallas qmm kernel for sm_90, compiled here (no GPU) with pip's Triton.

    python scripts/sass_report.py --mode affine --bits 4 --group 64 --m 1 --k 4096 --n 14336

Prints the kernel's resource use and an instruction histogram of its hottest
loop (the longest basic block that branches back to itself), per weight
element: the number that decides whether a GEMV can be memory-bound (the
budget on an H100 is ~7 issue slots and ~3.5 integer-pipe ops per element at
the copy bandwidth). `--dump FILE` writes the whole disassembly.

Note: jaxlib on the GPU machine compiles with its own bundled Triton; the
pip Triton here is close to it but not identical.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import tempfile

import jax
import jax.numpy as jnp

from jaxquant import quantize
from jaxquant.pallas import codecs, configs
from jaxquant.pallas.common import pow2_ceil, pow2_floor
from jaxquant.pallas.qmm import qmm as pallas_qmm
from jaxquant.tools import compile_check


def _nv_tool(name: str, cubin: bytes, *flags: str) -> str:
    """Run one of the CUDA binary tools that pip's Triton ships on a cubin."""
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([tool, *flags, f.name], check=True, capture_output=True,
                              text=True).stdout


def hottest_loop(sass: str):
    """Instructions of the longest block ending in a backward branch to its own label."""
    lines = sass.splitlines()
    labels, best = {}, []
    for i, line in enumerate(lines):
        m = re.match(r"^\.(L_x_\d+):", line.strip())
        if m:
            labels[m.group(1)] = i
    for i, line in enumerate(lines):
        m = re.search(r"BRA\s+`?\(?\.?(L_x_\d+)", line)
        if m and m.group(1) in labels and labels[m.group(1)] < i:
            body = [ln for ln in lines[labels[m.group(1)]:i + 1] if re.search(r"/\*[0-9a-f]{4}\*/", ln)]
            if len(body) > len(best):
                best = body
    return best


def opcode(line: str) -> str:
    text = line.split("*/", 1)[1].strip() if "*/" in line else line.strip()
    text = re.sub(r"^@!?U?P\w+\s+", "", text)
    return text.split()[0].rstrip(";") if text else "?"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", default="affine")
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--group", type=int, default=64)
    ap.add_argument("--m", type=int, default=1)
    ap.add_argument("--k", type=int, default=4096)
    ap.add_argument("--n", type=int, default=14336)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--config", default="", help="KernelConfig overrides, e.g. block_n=32,k_words=32")
    ap.add_argument("--dump", default="")
    a = ap.parse_args()

    kw = {} if a.mode != "affine" else dict(bits=a.bits, group_size=a.group)
    w = jnp.zeros((a.n, a.k), jnp.bfloat16)
    qw = jax.eval_shape(lambda w: quantize(w, mode=a.mode, **kw), w)
    x = jax.ShapeDtypeStruct((a.m, a.k), jnp.dtype(a.dtype))
    cfg = configs.select("cuda", True, a.m, a.n, a.k, qw.bits, qw.group_size, x.dtype)
    for item in filter(None, a.config.split(",")):
        key, val = item.split("=")
        cfg = cfg.replace(**{key: type(getattr(cfg, key))(int(val))})  # ints and bools
    print(cfg)
    fn = lambda x, qw: pallas_qmm(x, qw, platform="cuda", config=cfg)  # noqa: E731
    kernel = compile_check.triton_kernels(fn, x, qw, platform="cuda")[0]
    compiled = compile_check.compile_kernel(kernel, "cuda", 90, 32)
    cubin = compile_check.code_object(compiled)
    usage = _nv_tool("cuobjdump", cubin, "-res-usage")
    print(" ".join(ln.strip() for ln in usage.splitlines() if "REG" in ln))
    sass = _nv_tool("nvdisasm", cubin, "-c")
    if a.dump:
        with open(a.dump, "w") as f:
            f.write(sass)
    body = hottest_loop(sass)
    hist = collections.Counter(opcode(ln) for ln in body)
    # Elements per loop iteration: one step of the K loop for all rows of the program.
    geo = codecs.geometry(qw.bits, qw.group_size)
    bn = min(pow2_floor(cfg.block_n), pow2_ceil(a.n))
    bg = pow2_floor(max(1, cfg.k_words // geo.words_per_group))
    elems = bn * bg * qw.group_size
    threads = 32 * cfg.num_warps
    per_el = len(body) * threads / elems
    print(f"hot loop: {len(body)} instructions per thread per step, {elems} elements per step "
          f"over {threads} threads -> {per_el:.2f} issue slots per element")
    for op, c in hist.most_common():
        print(f"  {op:<14}{c:5d}  {c * threads / elems:6.2f}/el")


if __name__ == "__main__":
    main()
