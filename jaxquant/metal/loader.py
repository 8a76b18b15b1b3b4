"""Loading the Metal bridge (macOS): `lib/libjaxquant_metal.dylib` and the metallibs
beside it, found like the ffi libraries (every entry of the package's __path__, then
$JAXQUANT_METAL_LIB_DIR first if set). A missing or broken library records why; nothing
here raises at import."""

from __future__ import annotations

import ctypes
import dataclasses
import pathlib

import jax

from jaxquant._native import open_library, search_dirs

# FFI target name -> handler symbol in the bridge
TARGETS = {
    "jaxquant_metal_dequantize": "jq_metal_dequantize",
    "jaxquant_metal_qmv": "jq_metal_qmv",
    "jaxquant_metal_qmm": "jq_metal_qmm",
    "jaxquant_metal_rms_norm": "jq_metal_rms_norm",
    "jaxquant_metal_add_rms_norm": "jq_metal_add_rms_norm",
    "jaxquant_metal_gated_rms_norm": "jq_metal_gated_rms_norm",
}
ABI_VERSION = 1
LIBRARY = "libjaxquant_metal.dylib"


@dataclasses.dataclass
class Library:
    path: pathlib.Path | None = None
    handle: ctypes.CDLL | None = None
    error: str | None = None
    device: str | None = None  # the GPU's name, once initialized


def load() -> Library:
    lib = Library()
    dirs = search_dirs("JAXQUANT_METAL_LIB_DIR", __package__, __file__)
    lib.path, handle, lib.error = open_library(
        LIBRARY, dirs, "CMake builds it on macOS with Xcode's metal compiler",
        "jq_metal_abi_version", ABI_VERSION)
    if handle is None:
        return lib
    path = lib.path
    try:
        # Opens the default GPU and the metallibs in path's folder; a message on failure.
        handle.jq_metal_init.restype = ctypes.c_char_p
        handle.jq_metal_init.argtypes = [ctypes.c_char_p]
        why = handle.jq_metal_init(str(path.parent).encode())
        if why:
            lib.error = why.decode()
            return lib
        handle.jq_metal_device_name.restype = ctypes.c_char_p
        lib.device = handle.jq_metal_device_name().decode()
        for target, symbol in TARGETS.items():
            jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(handle, symbol)),
                                        platform="cpu")
    except Exception as e:  # noqa: BLE001 - a broken library removes the backend only
        lib.error = f"loading {path} failed: {type(e).__name__}: {e}"
        return lib
    lib.handle = handle
    return lib
