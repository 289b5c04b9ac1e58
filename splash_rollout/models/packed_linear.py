"""float32 products on the CPU through oneDNN, with each weight packed once.

Why it exists: torch's float32 ``F.linear`` goes to MKL, which re-packs the weight on every call
and, on the AMD Zen 5 machine the project now runs on, reaches a third to a half of oneDNN's speed
over a weight reordered once into its blocked layout (2 threads, microseconds MKL / packed):
256 x 512 x 256 (a MoE expert's share of a prefill chunk) 338 / 142; 256 x 512 x 1,024 (a decode
step's query projection) 1,449 / 514; 32 x 512 x 4,096 (the LM head over 32 rows) 991 / 272. On
the whole float32 wide benchmark (256 prompts, 64 new tokens, in-process, arms alternated) the
products took 5.8 s instead of 7.2 s and the call 14.1 s instead of 15.5. So every float32 product
with more rows than the few-rows native kernel takes (``MIN_ROWS``) is packed: decode steps,
prefill chunks and the experts' shares of them. (On the previous machine only prefill-sized
products gained, and the path started at 512 rows.)
bfloat16 is not packed: torch already sends it to oneDNN, and packing measured 3-7 % at most.

oneDNN makes a primitive per product shape (0.2-0.9 ms, cached: its primitive cache holds 1,024),
so the first step at a new row count pays that once per weight shape.

Fast numerics only (the caller checks): results differ from MKL's by float32 rounding order.
The packed copy is made at a weight's first product of ``MIN_ROWS`` rows or more and kept beside
it, keyed by the weight tensor and remade when its storage or version changes (a ``copy_`` bumps
the version; sleep and wake move the storage). The shards a live switch builds are inference
tensors, whose in-place writes leave no version: the engine's weight update, the one writer of
weights in place, drops every packed copy. Only tensors that own their storage are packed (model
parameters and the shards a layout keeps), not views made per call. Each packed weight is one more
copy of it (a float32 model's weights take twice their memory once it has run a batch of
``MIN_ROWS`` rows): sleep drops them all (made again at the next such product after wake), and
``set_packed_weights(False)`` turns the path off and frees them.
"""
from __future__ import annotations

import weakref

import torch

from splash_rollout.native.small_matmul import MAX_ROWS as SMALL_MATMUL_MAX_ROWS

MIN_ROWS = SMALL_MATMUL_MAX_ROWS + 1
"""Fewest activation rows sent to oneDNN: fewer go to the few-rows native kernel (``small_matmul``),
which at 4-16 rows is level with oneDNN and has no per-shape setup."""


def _onednn_linear_available() -> bool:
    try:
        return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    except (AttributeError, RuntimeError):
        return False


ONEDNN_LINEAR = _onednn_linear_available()
"""Whether this torch build has oneDNN's packed linear (the path is off without it)."""


class PackedWeights:
    """oneDNN-packed copies of CPU weights, one per live weight tensor (weakly held)."""

    def __init__(self) -> None:
        self.enabled = ONEDNN_LINEAR
        self._packed: dict[int, tuple[weakref.finalize, int, int, torch.Tensor]] = {}
        """id(weight) -> (its finalizer, data_ptr and version when packed, the packed copy). An inference
        tensor (a shard a live switch built inside a serving step) has no version counter: its version
        reads -1, and the engine's weight update, the one place that writes weights in place, drops
        every packed copy instead (``clear``)."""

    def get(self, weight: torch.Tensor) -> torch.Tensor:
        """The packed copy of ``weight`` [N, K], made or remade as its storage and version require."""
        key = id(weight)
        entry = self._packed.get(key)
        stamp = (weight.data_ptr(), -1 if weight.is_inference() else weight._version)
        if entry is not None and entry[1:3] == stamp:
            return entry[3]
        # one finalizer per entry, kept while the entry is remade: the entry goes with the weight, so
        # an id in the table always names the live weight it was made for
        gone = entry[0] if entry is not None else weakref.finalize(weight, self._packed.pop, key, None)
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
        self._packed[key] = (gone, *stamp, packed)
        return packed

    def clear(self) -> None:
        for gone, *_ in self._packed.values():
            gone.detach()  # the weights live on; their finalizers would only pop what is gone
        self._packed.clear()

    def __len__(self) -> int:
        return len(self._packed)


PACKED = PackedWeights()


def set_packed_weights(enabled: bool) -> None:
    """Process-wide: take the packed path where it applies (default, where oneDNN is present) or not
    (packed copies are dropped)."""
    PACKED.enabled = bool(enabled) and ONEDNN_LINEAR
    if not PACKED.enabled:
        PACKED.clear()


def applies(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether ``packed_linear`` takes x [..., K] times ``weight`` [N, K]: float32 on the CPU, at
    least MIN_ROWS rows, a weight that owns its storage, no gradient needed."""
    return (PACKED.enabled and weight.dtype == torch.float32 and x.dtype == torch.float32 and weight.dim() == 2
            and weight.device.type == "cpu" and x.device.type == "cpu" and weight._base is None
            and x.dim() >= 2 and x.numel() >= MIN_ROWS * x.shape[-1]
            and (bias is None or (bias.dtype == torch.float32 and bias.device.type == "cpu"))
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad
                                                  or (bias is not None and bias.requires_grad))))


def packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """F.linear(x [..., K], weight [N, K], bias [N]) -> [..., N] through the packed weight, or None
    where it does not apply (the caller takes torch's path)."""
    if not applies(x, weight, bias):
        return None
    rows = x.reshape(-1, x.shape[-1])
    if not rows.is_contiguous():
        rows = rows.contiguous()
    y = torch.ops.mkldnn._linear_pointwise(rows, PACKED.get(weight), None if bias is None else bias.detach(),
                                           "none", [], "")
    return y.view(*x.shape[:-1], weight.shape[0])
