"""The sampler's rows without truncation in one native call (``sample_rows.cpp``), for inference.

Through torch a step's sampling is a log_softmax, an exp and a cumsum over the [R, vocab] logits,
each writing a float temporary the next one reads back; the native kernel walks each row three
times in cache (max, sum of exponentials, the scan to the drawn point) and writes one token and one
logprob. Same distribution and same counter-based draw as the torch path, the sums taken in another
order: callers use it under fast numerics only, and only for rows that ``sample_plain`` takes.
"""
from __future__ import annotations

import torch

from splash_rollout.native.build import DTYPES, library_or_none


def sample_plain(logits: torch.Tensor, temperature: torch.Tensor, uniform: torch.Tensor,
                 greedy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """logits [R, V] float32 or bfloat16 (elements contiguous), temperature [R] float32 (1 on greedy
    rows), uniform [R] float64 in [0, 1), greedy [R] bool -> (tokens [R] int64, logprobs [R]
    float32), refused rows -1 and NaN (sampler.py's rules); None where the kernel does not apply
    (another device or dtype, a gradient needed, no compiler) and the caller takes its torch path."""
    if (logits.dim() != 2 or logits.device.type != "cpu" or logits.dtype not in DTYPES or logits.stride(-1) != 1
            or logits.shape[1] == 0 or (torch.is_grad_enabled() and logits.requires_grad)):
        return None
    lib = library_or_none()
    if lib is None:
        return None
    rows = logits.shape[0]
    temperature = temperature.to(device="cpu", dtype=torch.float32).contiguous()
    uniform = uniform.to(device="cpu", dtype=torch.float64).contiguous()
    greedy = greedy.to(device="cpu", dtype=torch.uint8).contiguous()
    if temperature.shape != (rows,) or uniform.shape != (rows,) or greedy.shape != (rows,):
        raise ValueError(f"sample_plain: temperature / uniform / greedy must be [{rows}], got "
                         f"{tuple(temperature.shape)} / {tuple(uniform.shape)} / {tuple(greedy.shape)}")
    tokens = torch.empty(rows, dtype=torch.int64)
    logprobs = torch.empty(rows, dtype=torch.float32)
    code = lib.splash_sample_rows(DTYPES[logits.dtype], rows, logits.shape[1], logits.data_ptr(), logits.stride(0),
                                  temperature.data_ptr(), uniform.data_ptr(), greedy.data_ptr(), tokens.data_ptr(),
                                  logprobs.data_ptr())
    if code != 0:
        raise RuntimeError(f"sample_plain: the native kernel refused {logits.dtype} (code {code})")
    return tokens, logprobs
