"""Process-wide CPU settings the engine makes wherever it computes: in the calling process (a
one-rank engine, or a trainer computing beside it) and in every spawned rank. One owner, so both
places apply the same ``compute`` options the same way.

* ``flush_denormal``: softmax tails of long histories are denormal floats, and CPU matmuls slow
  down ~7x on them.
* ``retain_heap``: glibc hands every allocation above its mmap threshold straight to the kernel and
  returns it on free, so each step's large temporaries (a prefill chunk's [2048, 1024] float32 is
  8 MiB) are fresh pages the kernel must fault in and zero, every layer of every step. Raising the
  mmap threshold to glibc's largest (32 MiB), the trim threshold to 1 GiB and the top pad to
  256 MiB keeps freed blocks in the heap for the next step. Measured on the wide workload of
  ``benchmarks/peer_engines.py`` (T = 1, float32, glibc malloc): 1.10-1.22x tokens/s in alternated
  rounds. Not glibc (musl, macOS) or an allocator preloaded in its place (tcmalloc): nothing to do.
* ``pack_weights``: float32 products of more than a few rows through oneDNN over weights packed once
  (``models/packed_linear.py``).

``freeze_heap`` is for processes that hold only an engine (a spawned rank, the server), never a
caller's: what exists once the engine is built lives as long as the process, and Python's full
collections walked it again and again -- 127 and 269 ms pauses of the serving engine (and of every
stream it feeds) on 240-260 k objects during one Poisson trace of ``benchmarks/serving.py``; 17 ms
on the ~35 k objects made after the freeze.
"""
from __future__ import annotations

import ctypes
import gc

import torch

from splash_rollout.models.packed_linear import set_packed_weights

M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3
"""glibc's mallopt parameters (malloc.h)."""
HEAP_SETTINGS = ((M_MMAP_THRESHOLD, 32 << 20), (M_TRIM_THRESHOLD, 1 << 30), (M_TOP_PAD, 256 << 20))
"""(parameter, value): allocations up to 32 MiB from the heap; up to 1 GiB of free heap kept; the heap
grown 256 MiB beyond each request (address space: pages are only backed once touched)."""


def freeze_heap() -> None:
    """Collect once, then move every object this process has into the collector's permanent
    generation, so later collections walk only what is made after."""
    gc.collect()
    gc.freeze()


def retain_heap() -> bool:
    """Keep freed large blocks in this process's heap (``HEAP_SETTINGS``). Returns whether glibc took
    every setting (False where there is no glibc ``mallopt``)."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return all(mallopt(param, value) == 1 for param, value in HEAP_SETTINGS)


def apply_cpu_process_settings(compute, device) -> None:
    """Apply ``compute``'s process-wide options (a ``ComputeOptions``) when ``device`` ("cpu", "cuda",
    "cuda:1", ...) is the CPU."""
    if not str(device).startswith("cpu"):
        return
    if compute.flush_denormal:
        torch.set_flush_denormal(True)
    if compute.retain_heap:
        retain_heap()
    set_packed_weights(compute.pack_weights)
