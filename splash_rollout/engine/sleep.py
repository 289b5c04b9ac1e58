"""Sleep / wake for one rank: give the KV pool's and the weights' memory back between rollout calls.

A trainer sharing the ranks (GRPO: the engine and DeepSpeed in the same processes) wants the memory
while it trains. Sleeping does two different things:

* The KV pool holds nothing worth keeping once no request runs, so ``KVPool.release`` drops its
  tensors and ``KVPool.restore`` allocates zeroed ones of the same shapes.
* The weights must come back bit for bit. ``TensorOffload`` copies the *storage* of every weight
  tensor out of the process's tensor memory and then shrinks the storage to zero bytes in place
  (``UntypedStorage.resize_(0)``, what FSDP does to free unsharded parameters). Every tensor and view
  sharing that storage — parameters, projection shards, a shard that is a view of a parameter —
  keeps its identity, so waking needs no re-wiring: the storage is resized back and refilled.
  Where the bytes wait depends on the device: a CUDA (or other accelerator) storage goes to a
  host tensor (pinned when CUDA is available, so the copy back is a fast DMA); a CPU storage goes
  to an unnamed temporary file, which takes it out of the process's resident memory (the kernel's
  page cache may keep the file's pages, but they are reclaimable and not this process's RSS).

While asleep, the tensors' metadata (shape, dtype) is intact but their storage is empty: reading
them is an error, so the engine refuses every call but ``wake_up`` until then.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import tempfile
from typing import Iterable

import torch

from splash_rollout.models.packed_linear import PACKED


def unique_storages(tensors: Iterable[torch.Tensor]) -> list[torch.UntypedStorage]:
    """The distinct storages under ``tensors`` (views of one storage counted once)."""
    seen: dict[tuple, torch.UntypedStorage] = {}
    for t in tensors:
        st = t.untyped_storage()
        seen.setdefault((st.device.type, st.device.index, st.data_ptr()), st)  # freed ones all map to 0
    return list(seen.values())


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes actually allocated under ``tensors``: the sum over their distinct storages (0 while asleep)."""
    return sum(st.nbytes() for st in unique_storages(tensors))


def _host_view(st: torch.UntypedStorage) -> memoryview:
    """A zero-copy byte view of a CPU storage (for file reads and writes)."""
    return memoryview((ctypes.c_char * st.nbytes()).from_address(st.data_ptr())).cast("B")


class TensorOffload:
    """The storages under a set of tensors, moved out of tensor memory (``release``) and back
    (``restore``) without changing any tensor object. Not thread-safe; one release per restore."""

    def __init__(self, tensors: Iterable[torch.Tensor], directory: str | None = None) -> None:
        self.storages = [st for st in unique_storages(tensors) if st.nbytes() > 0]
        self.nbytes = [st.nbytes() for st in self.storages]
        self.directory = directory
        self._file = None  # CPU storages: one unnamed temporary file, storages back to back
        self._offsets: list[int | None] = []
        self._host: list[torch.Tensor | None] = []  # accelerator storages: a host copy each
        self.released = False

    @property
    def total_bytes(self) -> int:
        return sum(self.nbytes)

    @torch.inference_mode()  # switch-built state is inference tensors (see weight_update.apply_update)
    def release(self) -> None:
        if self.released:
            raise RuntimeError("TensorOffload.release: already released")
        pin = torch.cuda.is_available()
        offset = 0
        for st, n in zip(self.storages, self.nbytes):
            if st.device.type == "cpu":
                if self._file is None:
                    self._file = tempfile.TemporaryFile(dir=self.directory)
                self._file.write(_host_view(st))
                self._offsets.append(offset)
                self._host.append(None)
                offset += n
            else:
                host = torch.empty(n, dtype=torch.uint8, pin_memory=pin)
                host.copy_(torch.empty(0, dtype=torch.uint8, device=st.device).set_(st))
                self._offsets.append(None)
                self._host.append(host)
        if self._file is not None:
            self._file.flush()
        for st in self.storages:
            st.resize_(0)
        self.released = True
        trim_host_heap()

    @torch.inference_mode()  # switch-built state is inference tensors (see weight_update.apply_update)
    def restore(self) -> None:
        if not self.released:
            raise RuntimeError("TensorOffload.restore: nothing released")
        for st, n, offset, host in zip(self.storages, self.nbytes, self._offsets, self._host):
            st.resize_(n)
            if host is None:
                self._file.seek(offset)
                got = self._file.readinto(_host_view(st))
                if got != n:
                    raise RuntimeError(f"TensorOffload.restore: read {got} of {n} bytes back")
            else:
                torch.empty(0, dtype=torch.uint8, device=st.device).set_(st).copy_(host)
        if self._file is not None:
            self._file.close()
        self._file, self._offsets, self._host = None, [], []
        self.released = False


def trim_host_heap() -> None:
    """Ask glibc to return freed heap pages to the OS. Large tensors are mmap'ed and go back on
    free, but glibc raises its mmap threshold after such frees, so re-allocated tensors of the same
    size land on the heap, where a free alone does not lower the resident size. No-op elsewhere."""
    if os.name != "posix":
        return
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        if libc is not None and hasattr(libc, "malloc_trim"):
            libc.malloc_trim(0)
    except OSError:
        pass


def process_rss_bytes() -> int | None:
    """This process's resident set size (Linux ``/proc/self/statm``); None where unavailable."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def process_anon_bytes(pid: int | str = "self") -> int | None:
    """A process's resident anonymous memory (``RssAnon`` of Linux ``/proc/PID/status``): its own
    allocations, without the file pages it maps (a memory-mapped checkpoint's page cache is the
    kernel's, shared and reclaimable); None where unavailable."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def weight_tensors(model: torch.nn.Module, shards: Iterable) -> list[torch.Tensor]:
    """Every weight tensor a rank holds: the model's parameters and buffers and the projection
    shards (which the engine keeps outside the modules)."""
    out = [p for p in model.parameters()] + [b for b in model.buffers()]
    for shard in shards:
        out.extend(shard.tensors().values())
    return out


def release_memory(pool, model: torch.nn.Module, shards: Iterable) -> TensorOffload:
    """Sleep, on one rank: free the KV pool's tensors, drop the packed copies of weights (made again
    at their next large product) and move every weight storage out; returns the offload
    ``restore_memory`` brings back."""
    pool.release()
    PACKED.clear()
    offload = TensorOffload(weight_tensors(model, shards))
    offload.release()
    return offload


def restore_memory(offload: TensorOffload, pool) -> None:
    """Wake, on one rank: the weights back bit for bit and a zeroed KV pool of the size it had."""
    offload.restore()
    pool.restore()


def memory_stats(pool, model: torch.nn.Module, shards: Iterable, tracked_bytes: int) -> dict[str, int | None]:
    """Measured bytes of one rank: ``tracked_bytes`` (projection shards + KV pool, as given),
    ``kv_pool``, ``weights`` (allocated storages under every weight tensor), the process ``rss`` and
    its anonymous part ``rss_anon`` (without mapped file pages)."""
    return {"tracked_bytes": tracked_bytes, "kv_pool": pool.nbytes,
            "weights": storage_bytes(weight_tensors(model, shards)), "rss": process_rss_bytes(),
            "rss_anon": process_anon_bytes()}
