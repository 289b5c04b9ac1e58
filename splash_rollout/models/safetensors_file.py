"""One safetensors file as zero-copy tensor views over a memory map.

Why not ``safetensors.safe_open``: its ``get_tensor`` and ``get_slice`` copy what they return into
new (anonymous) memory, so reading a slice costs the slice twice on the way into a model. Here the
file is mapped once (``mmap``, private copy-on-write: nothing is ever written back) and every
tensor is a ``torch.frombuffer`` view of the mapped bytes; indexing a view is free and copying
it into a model parameter reads only the pages that slice covers. Those pages are the kernel's page
cache, shared by every rank on the host and reclaimable, not a process's anonymous memory; they
leave the process's resident set when the file is closed.

The format (safetensors 0.4): an 8-byte little-endian header length, a JSON header
``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}``, then the data,
offsets relative to its start.
"""
from __future__ import annotations

import json
import mmap
import os
import struct
import warnings
from dataclasses import dataclass

import torch

DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


class SafetensorsFormatError(ValueError):
    """The file is not a safetensors file this reader understands (the message names the file)."""


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor lives in its file."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    """Byte offset of its data in the file."""
    end: int


class SafetensorsFile:
    """The tensors of one file; ``view(name)`` is a zero-copy tensor over the mapped bytes."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = os.fspath(path)
        with open(self.path, "rb") as f:
            head = f.read(8)
            if len(head) != 8:
                raise SafetensorsFormatError(f"{self.path}: shorter than a safetensors header")
            (length,) = struct.unpack("<Q", head)
            size = os.fstat(f.fileno()).st_size
            if length > size - 8:
                raise SafetensorsFormatError(f"{self.path}: header length {length} exceeds the file ({size} bytes)")
            try:
                header = json.loads(f.read(length))
            except ValueError as e:
                raise SafetensorsFormatError(f"{self.path}: header is not JSON ({e})") from None
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) if size else None
        data = 8 + length
        self.metadata: dict = header.pop("__metadata__", None) or {}
        self.entries: dict[str, TensorEntry] = {}
        for name, info in header.items():
            dtype = DTYPES.get(info.get("dtype"))
            if dtype is None:
                raise SafetensorsFormatError(f"{self.path}: {name}: dtype {info.get('dtype')!r} is not one of "
                                             f"{sorted(DTYPES)}")
            begin, end = info["data_offsets"]
            shape = tuple(int(d) for d in info["shape"])
            numel = 1
            for d in shape:
                numel *= d
            if end - begin != numel * torch.empty((), dtype=dtype).element_size() or data + end > size:
                raise SafetensorsFormatError(f"{self.path}: {name}: data offsets {begin}..{end} do not hold "
                                             f"{dtype} {list(shape)} inside the file")
            self.entries[name] = TensorEntry(name, dtype, shape, data + begin, data + end)

    def view(self, name: str) -> torch.Tensor:
        """The tensor ``name``: a read-only-in-spirit view of the mapped file (never write to it)."""
        e = self.entries[name]
        if e.begin == e.end:
            return torch.empty(e.shape, dtype=e.dtype)
        with warnings.catch_warnings():  # frombuffer warns on buffers it cannot prove writable
            warnings.simplefilter("ignore")
            flat = torch.frombuffer(self._map, dtype=torch.uint8, count=e.end - e.begin, offset=e.begin)
        return flat.view(e.dtype).view(e.shape)

    def close(self) -> None:
        """Let the mapping go: it is unmapped once the last view of it is gone (every view holds a
        reference to it; an explicit ``mmap.close`` under a live view would leave the view dangling)."""
        self._map = None
