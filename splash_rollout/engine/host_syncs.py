"""Counting the host syncs a step would make on a GPU -- on any device, the CPU included.

A CUDA step that reads a device value on the host (``.item()``, ``bool(t)``, ``int(t)``,
``.tolist()``, ``.cpu()``, ``.numpy()``) or runs an op whose output shape depends on the data
(``nonzero``, boolean-mask indexing, ``unique``, ``masked_select``, ``repeat_interleave`` without
``output_size``) waits for the GPU to drain, and cannot be captured in a CUDA graph. ``HostSyncs``
counts both kinds while a block runs: a ``TorchFunctionMode`` sees host reads at the Python level,
and a ``TorchDispatchMode`` below it the data-dependent ops (a read's own ``_local_scalar_dense`` is
not counted twice). Every hit is kept with the package source line that made it, so a test failure
says where.

The engine's convention that makes this exact on the CPU: host bookkeeping lives in Python lists
and numpy, never in torch tensors, and a step reads device tensors back only through the calls above
(a ``.to("cpu")`` would not be seen: it looks like a host-to-device copy on a CPU machine). On a
GPU, ``torch.cuda.set_sync_debug_mode("error")`` is the ground truth (``scripts/device_check.py``).
"""
from __future__ import annotations

import collections
import os
import traceback
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

HOST_READS = frozenset({"item", "tolist", "numpy", "cpu", "__bool__", "__int__", "__float__", "__index__"})
"""Tensor methods that bring a value to the host."""
HOST_UPLOADS = frozenset({"tensor", "as_tensor", "from_numpy", "asarray"})
"""Functions that make a tensor of host data (a host-to-device copy follows; not a sync, but a CUDA
graph cannot capture it: the graphed part of a step has none)."""
SYNC_OPS = frozenset({"nonzero", "unique", "_unique", "_unique2", "unique_consecutive", "unique_dim", "masked_select",
                      "equal", "_local_scalar_dense", "is_nonzero", "item"})
"""aten ops whose output size or value the host must wait for."""
_INDEX_OPS = frozenset({"index", "index_put", "index_put_", "_index_put_impl_"})
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def _site() -> str:
    """The innermost package frame below this module: ``engine/kv_pool.py:129``."""
    for frame in reversed(traceback.extract_stack()):
        if frame.filename.startswith(_PACKAGE) and not frame.filename.endswith("host_syncs.py"):
            return f"{frame.filename[len(_PACKAGE):]}:{frame.lineno}"
    return "?"


def _bool_index(args: tuple) -> bool:
    indices = args[1] if len(args) > 1 else ()
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices or ())


class _Reads(TorchFunctionMode):
    def __init__(self, owner: "HostSyncs") -> None:
        super().__init__()
        self.owner = owner

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in HOST_UPLOADS:
            self.owner.uploads[f"{name} @ {_site()}"] += 1
        if name in HOST_READS:
            self.owner._hit(name)
            self.owner._inside_read += 1
            try:
                return func(*args, **(kwargs or {}))
            finally:
                self.owner._inside_read -= 1
        return func(*args, **(kwargs or {}))


class _Ops(TorchDispatchMode):
    def __init__(self, owner: "HostSyncs") -> None:
        super().__init__()
        self.owner = owner

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if self.owner.record_ops:
            self.owner.ops.append((name, tuple(tuple(a.shape) for a in args if isinstance(a, torch.Tensor))))
        if not self.owner._inside_read:
            if name in SYNC_OPS:
                self.owner._hit(name)
            elif name in _INDEX_OPS and _bool_index(args):
                self.owner._hit("boolean-mask indexing")
            elif name == "repeat_interleave" and kwargs.get("output_size") is None and len(args) < 4:
                self.owner._hit("repeat_interleave without output_size")
        return func(*args, **kwargs)


class HostSyncs:
    """``with HostSyncs() as syncs: ...`` then ``syncs.count``, ``syncs.sites`` (site -> hits),
    ``syncs.uploads`` (site -> tensors made from host data) and, with ``record_ops``, ``syncs.ops``: every aten op run, with its tensor arguments' shapes (two
    steps that replay one CUDA graph must run the same list)."""

    def __init__(self, record_ops: bool = False) -> None:
        self.record_ops = record_ops
        self.ops: list[tuple[str, tuple]] = []
        self.sites: collections.Counter = collections.Counter()
        self.uploads: collections.Counter = collections.Counter()
        """Site -> tensors made from host data (``HOST_UPLOADS``), counted apart from the syncs."""
        self._inside_read = 0
        self._modes = (_Reads(self), _Ops(self))

    def _hit(self, what: str) -> None:
        self.sites[f"{what} @ {_site()}"] += 1

    @property
    def count(self) -> int:
        return sum(self.sites.values())

    def __enter__(self) -> "HostSyncs":
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)
