"""Build and load the package's native CPU kernels (``*.cpp`` beside this file) at first use.

Why at run time: the kernels are a few hundred lines of portable C++ with GCC vector extensions,
compiled for the machine they run on (``-march=native``: AVX-512 where it exists) in about two
seconds, so no wheel per CPU has to be shipped. The shared library is cached under
``$SPLASH_NATIVE_CACHE`` (default ``~/.cache/splash_rollout/native``), keyed by the source, the
flags, the compiler and the CPU, and written atomically (ranks and test workers may build at once).
It links OpenMP as ``libgomp.so.1``, which resolves to the runtime torch already loaded, so the
kernels and torch's own ops share one thread pool and one thread count (``torch.set_num_threads``).

``load_native()`` returns the ``ctypes`` library or raises ``NativeUnavailable`` with the
compiler's message; callers fall back to the pure-torch path.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch  # loaded first, so the kernels' libgomp resolves to the OpenMP runtime torch loaded

SOURCES = tuple(sorted(Path(__file__).parent.glob("*.cpp")))  # compiled together into one library
HEADERS = tuple(sorted(Path(__file__).parent.glob("*.h")))
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++17", "-fno-math-errno")
DTYPES = {torch.float32: 0, torch.bfloat16: 1}
"""Element types the kernels take, with their ``dtype`` / ``kv`` argument codes."""
_lock = threading.Lock()
_loaded: ctypes.CDLL | None = None
_error: str | None = None


class NativeUnavailable(RuntimeError):
    """The native kernels could not be built or loaded here (no compiler, an unsupported CPU)."""


def cache_dir() -> Path:
    return Path(os.environ.get("SPLASH_NATIVE_CACHE", Path.home() / ".cache" / "splash_rollout" / "native"))


def _compiler() -> str:
    for name in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        if name and shutil.which(name):
            return name
    raise NativeUnavailable("no C++ compiler found (set CXX, or install g++)")


def _cpu_key() -> str:
    try:
        flags = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    except OSError:
        flags = ""
    return platform.machine() + flags


def library_path(compiler: str) -> Path:
    h = hashlib.sha256()
    for part in (*(src.read_bytes() for src in SOURCES + HEADERS), " ".join(FLAGS).encode(), compiler.encode(),
                 _cpu_key().encode()):
        h.update(part)
    return cache_dir() / f"splash_native_{h.hexdigest()[:16]}.so"


def _build(compiler: str, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        proc = subprocess.run([compiler, *FLAGS, "-o", tmp, *map(str, SOURCES)], capture_output=True, text=True,
                              timeout=300)
        if proc.returncode != 0:
            names = ", ".join(src.name for src in SOURCES)
            raise NativeUnavailable(f"{compiler} failed on {names}: {proc.stderr.strip()[-2000:]}")
        os.replace(tmp, target)  # atomic: a concurrent builder's copy is identical
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _declare(lib: ctypes.CDLL) -> None:
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.splash_paged_mla.restype = ctypes.c_int
    lib.splash_paged_mla.argtypes = [ctypes.c_int, ctypes.c_int, ptr, i64, i64, ptr, i64, i64, ptr, ptr, i64, ptr,
                                     ptr, i64, ptr, ptr, i64, i64, i64, i64, i64, i64, ctypes.c_double, ptr, i64,
                                     i64, ptr, i64, i64]
    lib.splash_small_matmul.restype = ctypes.c_int
    lib.splash_small_matmul.argtypes = [ctypes.c_int, i64, i64, i64, i64, ptr, i64, i64, ptr, i64, i64, i64, ptr,
                                        ptr, i64, i64]
    lib.splash_routed_experts.restype = ctypes.c_int
    lib.splash_routed_experts.argtypes = [ctypes.c_int, i64, i64, i64, ptr, i64, ptr, ptr, i64, ptr, i64, i64, ptr]
    lib.splash_rms_norm.restype = ctypes.c_int
    lib.splash_rms_norm.argtypes = [ctypes.c_int, i64, i64, ptr, i64, ptr, ctypes.c_double, ptr]
    lib.splash_rope.restype = ctypes.c_int
    lib.splash_rope.argtypes = [ctypes.c_int, i64, i64, i64, ptr, i64, i64, ptr, ptr, ctypes.c_int, ptr]
    lib.splash_sample_rows.restype = ctypes.c_int
    lib.splash_sample_rows.argtypes = [ctypes.c_int, i64, i64, ptr, i64, ptr, ptr, ptr, ptr, ptr]
    lib.splash_expanded_attention.restype = ctypes.c_int
    lib.splash_expanded_attention.argtypes = [ctypes.c_int, i64, i64, i64, i64, i64, i64, i64, ptr, i64, i64, ptr,
                                              i64, i64, ptr, ptr, ptr, ptr, i64, ctypes.c_double, ptr]


def load_native() -> ctypes.CDLL:
    """The native kernel library, built on first use; raises ``NativeUnavailable`` (remembered)."""
    global _loaded, _error
    with _lock:
        if _loaded is not None:
            return _loaded
        if _error is not None:
            raise NativeUnavailable(_error)
        try:
            compiler = _compiler()
            path = library_path(compiler)
            if not path.exists():
                _build(compiler, path)
            lib = ctypes.CDLL(str(path))
            _declare(lib)
        except NativeUnavailable as exc:
            _error = str(exc)
            raise
        except (OSError, subprocess.SubprocessError) as exc:
            _error = f"native kernels unavailable: {exc}"
            raise NativeUnavailable(_error) from exc
        _loaded = lib
        return lib


def native_available() -> bool:
    """Whether the native kernels build and load here."""
    try:
        load_native()
        return True
    except NativeUnavailable:
        return False


def library_or_none() -> ctypes.CDLL | None:
    """The library, or None where it cannot be built (callers that only use it for speed take their
    torch path then)."""
    if _loaded is not None:  # the hot path: no lock once loaded
        return _loaded
    try:
        return load_native()
    except NativeUnavailable:
        return None
