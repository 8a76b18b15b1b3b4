"""Where jaxquant's compiled libraries are looked for (the ffi backend's and the Metal
bridge's): $<env_var> first if set, then `lib/` under every entry of the package's
__path__ (an editable install keeps the built folder in site-packages beside a package
whose Python files stay in the source tree), then `lib/` beside the module."""

from __future__ import annotations

import ctypes
import os
import pathlib
import sys


def search_dirs(env_var: str, package: str, module_file: str) -> list[pathlib.Path]:
    dirs = [pathlib.Path(os.environ[env_var])] if os.environ.get(env_var) else []
    pkg = sys.modules.get(package)  # being imported; __path__ may be several dirs
    dirs += [pathlib.Path(p) / "lib" for p in getattr(pkg, "__path__", [])]
    dirs.append(pathlib.Path(module_file).resolve().parent / "lib")
    return list(dict.fromkeys(dirs))


def first_file(dirs: list[pathlib.Path], filename: str) -> pathlib.Path | None:
    return next((d / filename for d in dirs if (d / filename).is_file()), None)


def open_library(filename: str, dirs: list[pathlib.Path], why_missing: str, abi_symbol: str,
                 abi_version: int):
    """(path, handle, error): the first `filename` in dirs, opened, its ABI version
    (`abi_symbol()`) checked; error says why not (not built: `why_missing` and the dirs
    searched; failed to load; another ABI), with handle None."""
    path = first_file(dirs, filename)
    if path is None:
        return None, None, (f"{filename} was not built ({why_missing}); searched "
                            f"{', '.join(map(str, dirs))}")
    try:
        handle = ctypes.CDLL(str(path))
    except OSError as e:
        return path, None, f"{path} failed to load: {e}"
    try:
        version = getattr(handle, abi_symbol)()
    except AttributeError:
        version = None
    if version != abi_version:
        return path, None, (f"{path} has ABI version {version}, this jaxquant needs "
                            f"{abi_version}: rebuild with `pip install -e .`")
    return path, handle, None
