"""Compile the Pallas kernels' Triton IR ahead of time with the pip `triton` package.

A test helper of the ROCm/CUDA compile checks (tests/test_pallas_compile.py and the
other *_compile tests), which run on a CPU-only machine:

  1. lower a jitted function with `lowering_platforms=("rocm",)` (or "cuda");
  2. take the Triton module (MLIR bytecode) out of each `__gpu$xla.gpu.triton`
     custom call's backend_config `ir`;
  3. print it as text with jaxlib's MLIR context (jaxlib's bytecode is not
     readable by another Triton build; its text is);
  4. `triton.compile(path, target=GPUTarget(...))` the text.

jaxlib > 0.10.2 compiles the Triton module inside the lowering rule instead of
emitting `__gpu$xla.gpu.triton`; there step 2 intercepts the module at that
call (`_capture_modules`), which needs no GPU either.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import tempfile

import jax

TRITON_CALL = "__gpu$xla.gpu.triton"

# (backend, arch, warp size) that the checks compile for.
ROCM_TARGETS = (("hip", "gfx90a", 64), ("hip", "gfx942", 64), ("hip", "gfx950", 64),
                ("hip", "gfx1100", 32))
CUDA_TARGETS = (("cuda", 90, 32), ("cuda", 80, 32))


@dataclasses.dataclass
class TritonKernel:
    name: str
    ir_bytecode: bytes
    num_warps: int
    num_stages: int

    def text(self) -> str:
        """The module as MLIR text, printed with jaxlib's Triton dialect."""
        from jax._src.lib.mlir import ir
        from jaxlib.triton import dialect as tt_dialect

        ctx = ir.Context()
        tt_dialect.register_dialect(ctx)
        with ctx:
            module = ir.Module.parse(self.ir_bytecode)
            return module.operation.get_asm(enable_debug_info=False)


def _walk(op, out):
    from jax._src.lib.mlir import ir

    for region in op.regions:
        for block in region.blocks:
            for child in block.operations:
                if child.name == "stablehlo.custom_call":
                    target = ir.StringAttr(child.attributes["call_target_name"]).value
                    if target == TRITON_CALL:
                        out.append(_from_custom_call(child))
                _walk(child, out)


def _from_custom_call(op) -> TritonKernel:
    from jax._src.lib.mlir import ir

    for named in op.attributes:
        attr = op.attributes[named] if isinstance(named, str) else named.attr
        if isinstance(attr, ir.DictAttr) and "ir" in attr:
            return TritonKernel(
                name=ir.StringAttr(attr["name"]).value,
                ir_bytecode=ir.StringAttr(attr["ir"]).value_bytes,
                num_warps=ir.IntegerAttr(attr["num_warps"]).value,
                num_stages=ir.IntegerAttr(attr["num_stages"]).value)
    raise ValueError("custom call without a Triton backend_config")


@contextlib.contextmanager
def _capture_modules(found):
    """jaxlib > 0.10.2: record the Triton modules that the lowering compiles."""
    from jax._src.pallas.triton import pallas_call_registration as reg

    real = reg.triton.compile

    def fake_compile(platform, ir_bytes, arch, *, num_warps, num_stages, **kw):
        found.append(TritonKernel("kernel", bytes(ir_bytes), num_warps, num_stages))
        raise _Captured()

    reg.triton.compile = fake_compile
    try:
        yield
    finally:
        reg.triton.compile = real


class _Captured(Exception):
    pass


def triton_kernels(fn, *args, platform: str = "rocm") -> list[TritonKernel]:
    """The Triton kernels of `jax.jit(fn)(*args)` lowered for `platform`."""
    lowered = None
    found: list[TritonKernel] = []
    try:
        lowered = jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,))
    except _Captured:
        pass
    if lowered is not None:
        _walk(lowered.compiler_ir("stablehlo").operation, found)
        if found:
            return found
    # Newer jaxlib compiles inside the lowering rule: capture the module there (the
    # capture aborts the lowering, so this returns the first kernel of `fn`).
    with _capture_modules(found):
        try:
            jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,))
        except _Captured:
            pass
    return found


def compile_kernel(kernel: TritonKernel, backend: str, arch, warp_size: int):
    """triton.compile the kernel's text for one target; returns the CompiledKernel."""
    import triton
    from triton.backends.compiler import GPUTarget

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, f"{kernel.name}.ttir")
        with open(path, "w") as f:
            f.write(kernel.text())
        return triton.compile(path, target=GPUTarget(backend, arch, warp_size),
                              options=dict(num_warps=kernel.num_warps,
                                           num_stages=kernel.num_stages))


def compile_all(kernels, targets):
    """Compile every kernel for every (backend, arch, warp size) target; each must give
    a code object (AssertionError naming the target otherwise)."""
    for kernel in kernels:
        for backend, arch, warp in targets:
            compiled = compile_kernel(kernel, backend, arch, warp)
            assert len(code_object(compiled)) > 0, (kernel.name, backend, arch)


def code_object(compiled) -> bytes:
    """The binary a compile produced: hsaco (AMD) or cubin (NVIDIA)."""
    asm = compiled.asm
    blob = asm.get("hsaco") or asm.get("cubin")
    return blob if isinstance(blob, (bytes, bytearray)) else (blob or b"")
