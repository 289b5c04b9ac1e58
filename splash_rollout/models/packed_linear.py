"""Large float32 products on the CPU through oneDNN, with each weight packed once.

Why it exists: a prefill chunk multiplies up to ``max_num_batched_tokens`` rows by every weight of
the model, and those products were most of a float32 prefill step. torch's float32 ``F.linear``
goes to MKL, which re-packs the weight on every call; oneDNN's matmul over a weight reordered once
into its blocked layout runs the same products faster (development machine, AMD EPYC, 2 threads:
2,048 x 512 x 1,024 at 194 GFLOP/s against MKL's 123-175), and in the engine a float32 prefill step
of 2,048 rows took 750 ms instead of 813 (1.08x, 32 steps per arm alternated in one process).
Not used below ``MIN_ROWS`` rows: a decode step of 256 rows measured no gain, and products whose
row count changes every call (a MoE expert's share of a chunk) pay oneDNN's per-shape setup.
bfloat16 is not packed: torch already sends it to oneDNN, and packing measured no gain.

Fast numerics only (the caller checks): results differ from MKL's by float32 rounding order.
The packed copy is made at a weight's first large product and kept beside it, keyed by the weight
tensor and remade when its storage or version changes (a weight update ``copy_``s in place, which
bumps the version; sleep and wake move the storage). Only tensors that own their storage are packed
(model parameters and the shards a layout keeps), not views made per call. Each packed weight is one
more copy of it: sleep drops them all (made again at the next large product after wake), and
``set_packed_weights(False)`` turns the path off and frees them.
"""
from __future__ import annotations

import weakref

import torch

MIN_ROWS = 512
"""Fewest activation rows sent to oneDNN (a prefill chunk, not a decode step)."""


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
        """id(weight) -> (its finalizer, data_ptr and version when packed, the packed copy)."""

    def get(self, weight: torch.Tensor) -> torch.Tensor:
        """The packed copy of ``weight`` [N, K], made or remade as its storage and version require."""
        key = id(weight)
        entry = self._packed.get(key)
        stamp = (weight.data_ptr(), weight._version)
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
