"""Finding, loading and registering the compiled libraries of the ffi backend.

The libraries live in `jaxquant/ffi/lib/` (CMakeLists.txt installs them
there). In an editable install (scikit-build-core's redirect mode) that
folder sits in site-packages next to a package whose Python files stay in the
source tree, so every entry of `jaxquant.ffi.__path__` is searched, then
$JAXQUANT_FFI_LIB_DIR if set (searched first).

A library that is missing or fails to load removes its platform from the
backend and records why; nothing here raises at import.
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import pathlib

import jax

from jaxquant._native import first_file, open_library, search_dirs

# platform (as JAX lowers: ctx.module_context.platforms) -> library stem, XLA platform name
PLATFORMS = {
    "cpu": ("jaxquant_cpu", "cpu"),
    "cuda": ("jaxquant_cuda", "CUDA"),
    "rocm": ("jaxquant_rocm", "ROCM"),
}

# Handler symbols: the CPU library prefixes its targets with jq_cpu_, the GPU ones with jq_gpu_.
SYMBOL_PREFIX = {"cpu": "jq_cpu_", "cuda": "jq_gpu_", "rocm": "jq_gpu_"}

# include/jq/ffi_common.h: JQ_ABI_VERSION
ABI_VERSION = 3


@dataclasses.dataclass
class Library:
    platform: str
    path: pathlib.Path | None = None
    handle: ctypes.CDLL | None = None
    error: str | None = None  # why it is not usable
    # What the library says it has (include/jq/ffi_common.h, JQ_FFI_DEFINE_LIBRARY):
    targets: tuple[str, ...] = ()  # registered as FFI targets "jaxquant_<target>"
    format_ids: dict[str, int] = dataclasses.field(default_factory=dict)  # codec.h's format list


def _search_dirs() -> list[pathlib.Path]:
    return search_dirs("JAXQUANT_FFI_LIB_DIR", __package__, __file__)


def build_decision(dirs: list[pathlib.Path], platform: str) -> str | None:
    """Why the build left `platform`'s library out, as it said (CMakeLists.txt writes one
    line a GPU platform to native_build.txt beside the libraries, e.g. "cuda: not built:
    nvcc found but no NVIDIA GPU visible ..."); None where it recorded no such line."""
    path = first_file(dirs, "native_build.txt")
    if path is None:
        return None
    prefix = f"{platform}: not built: "
    return next((line[len(prefix):] for line in path.read_text().splitlines()
                 if line.startswith(prefix)), None)


def _filename(stem: str) -> str:
    return f"lib{stem}.so" if os.name != "nt" else f"{stem}.dll"


def load(platform: str) -> Library:
    stem, _ = PLATFORMS[platform]
    lib = Library(platform)
    dirs = _search_dirs()
    why = build_decision(dirs, platform) or {
        "cpu": "no C++ compiler or CMake at build time, or jaxquant was not installed "
               "with `pip install -e .`",
        "cuda": "nvcc was not found when jaxquant was built",
        "rocm": "no HIP compiler (or CMake < 3.27) when jaxquant was built"}[platform]
    lib.path, handle, lib.error = open_library(_filename(stem), dirs, why,
                                               "jq_abi_version", ABI_VERSION)
    if handle is None:
        return lib
    lib.targets, lib.format_ids = describe(handle)
    lib.handle = handle
    return lib


def describe(handle: ctypes.CDLL) -> tuple[tuple[str, ...], dict[str, int]]:
    """A library's own description: its FFI targets (jq_ffi_targets) and its
    format ids (jq_format_name(i): the order of include/jq/codec.h's format list)."""
    handle.jq_ffi_targets.restype = ctypes.c_char_p
    handle.jq_format_name.restype = ctypes.c_char_p
    handle.jq_format_name.argtypes = [ctypes.c_int]
    targets = tuple(t for t in handle.jq_ffi_targets().decode().split(",") if t)
    format_ids = {}
    while (name := handle.jq_format_name(len(format_ids))) is not None:
        format_ids[name.decode()] = len(format_ids)
    return targets, format_ids


def register(lib: Library) -> None:
    """Register lib's handlers as the FFI targets of its platform."""
    if lib.handle is None:
        return
    _, xla_platform = PLATFORMS[lib.platform]
    try:
        for target in lib.targets:
            fn = getattr(lib.handle, SYMBOL_PREFIX[lib.platform] + target)
            jax.ffi.register_ffi_target("jaxquant_" + target, jax.ffi.pycapsule(fn),
                                        platform=xla_platform)
    except Exception as e:  # noqa: BLE001 - a broken library removes its platform only
        lib.error = f"registering {lib.path}'s handlers failed: {type(e).__name__}: {e}"
        lib.handle = None
