"""Safetensors loading and saving with HF parameter names.

Reads a checkpoint folder: ``config.json`` plus one ``model.safetensors`` or shards listed in
``model.safetensors.index.json`` (any ``*.safetensors`` otherwise). Understands:

* per-expert names ``mlp.experts.{e}.{gate,up,down}_proj.weight`` (what the hubs ship and what
  transformers 5 ``save_pretrained`` writes) and the packed transformers-internal form
  ``mlp.experts.gate_up_proj`` [E, 2I, hidden] / ``mlp.experts.down_proj`` [E, hidden, I];
* fp8 block-scaled weights (``X.weight`` float8_e4m3fn with ``X.weight_scale_inv`` [ceil(out/b),
  ceil(in/b)], b = 128 unless ``quantization_config.weight_block_size`` says otherwise), dequantised
  to float32 on load before the cast to the model dtype;
* MTP layers (index >= num_hidden_layers, ``num_nextn_predict_layers``), skipped with a note.

Errors name the tensor: missing names, unexpected names, shape mismatches (expected vs got).
"""
from __future__ import annotations

import json
import logging
import os
import re
from typing import Iterable

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from splash_rollout.models.config import ModelConfig

log = logging.getLogger(__name__)

_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.")
_PACKED_RE = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)$")
_IGNORED = re.compile(r"(rotary_emb\.inv_freq|\.rotary_emb\.)")
DEFAULT_FP8_BLOCK = (128, 128)


class CheckpointError(ValueError):
    """A checkpoint does not match the model: the message names the tensors."""


def checkpoint_files(path: str | os.PathLike) -> list[str]:
    path = os.fspath(path)
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(path, n) for n in names]
    single = os.path.join(path, "model.safetensors")
    if os.path.isfile(single):
        return [single]
    files = sorted(os.path.join(path, n) for n in os.listdir(path) if n.endswith(".safetensors"))
    if not files:
        raise CheckpointError(f"checkpoint {path!r}: no *.safetensors files")
    return files


def dequantize_fp8(weight: torch.Tensor, scale_inv: torch.Tensor,
                   block: tuple[int, int] = DEFAULT_FP8_BLOCK) -> torch.Tensor:
    """weight [out, in] float8 and scale_inv [ceil(out/bo), ceil(in/bi)] -> float32 [out, in]."""
    out_dim, in_dim = weight.shape
    bo, bi = block
    expected = (-(-out_dim // bo), -(-in_dim // bi))
    if tuple(scale_inv.shape) != expected:
        raise CheckpointError(f"fp8 scale_inv: expected shape {expected} for weight {tuple(weight.shape)}, "
                              f"got {tuple(scale_inv.shape)}")
    scale = scale_inv.float().repeat_interleave(bo, 0)[:out_dim].repeat_interleave(bi, 1)[:, :in_dim]
    return weight.float() * scale


def quantize_fp8(weight: torch.Tensor, block: tuple[int, int] = DEFAULT_FP8_BLOCK
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-scaled float8_e4m3fn quantisation (DeepSeek's format): returns (weight_fp8, scale_inv)."""
    out_dim, in_dim = weight.shape
    bo, bi = block
    rows, cols = -(-out_dim // bo), -(-in_dim // bi)
    padded = torch.zeros(rows * bo, cols * bi, dtype=torch.float32)
    padded[:out_dim, :in_dim] = weight.float()
    blocks = padded.view(rows, bo, cols, bi)
    amax = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12)  # [rows, cols]
    scale_inv = amax / torch.finfo(torch.float8_e4m3fn).max
    q = (blocks / scale_inv[:, None, :, None]).view(rows * bo, cols * bi)[:out_dim, :in_dim]
    return q.to(torch.float8_e4m3fn), scale_inv


def read_checkpoint(path: str | os.PathLike, config: ModelConfig | None = None) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint folder, float8 weights dequantised to float32, packed experts
    split per expert, MTP layers dropped. Names are HF names."""
    path = os.fspath(path)
    config = config or ModelConfig.from_hf(path)
    block = tuple((config.extra.get("quantization_config") or {}).get("weight_block_size", DEFAULT_FP8_BLOCK))
    raw: dict[str, torch.Tensor] = {}
    for file in checkpoint_files(path):
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                raw[name] = f.get_tensor(name)
    tensors: dict[str, torch.Tensor] = {}
    skipped_layers: set[int] = set()
    for name, t in raw.items():
        m = _LAYER_RE.match(name)
        if m and int(m.group(1)) >= config.num_layers:
            skipped_layers.add(int(m.group(1)))
            continue
        if name.endswith("weight_scale_inv") or _IGNORED.search(name):
            continue
        if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            scale = raw.get(name + "_scale_inv")
            if scale is None:
                raise CheckpointError(f"{name}: float8 weight without {name}_scale_inv")
            t = dequantize_fp8(t, scale, block)  # type: ignore[arg-type]
        packed = _PACKED_RE.match(name)
        if packed:
            prefix, kind = packed.groups()
            for e in range(t.shape[0]):
                if kind == "gate_up_proj":
                    gate, up = t[e].chunk(2, dim=0)
                    tensors[f"{prefix}.{e}.gate_proj.weight"] = gate
                    tensors[f"{prefix}.{e}.up_proj.weight"] = up
                else:
                    tensors[f"{prefix}.{e}.down_proj.weight"] = t[e]
            continue
        tensors[name] = t
    if skipped_layers:
        log.info("checkpoint %s: skipped MTP layers %s (num_nextn_predict_layers=%s); not modelled",
                 path, sorted(skipped_layers), config.extra.get("num_nextn_predict_layers"))
    return tensors


def load_state(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Copy HF-named tensors into ``model`` (keeping each parameter's dtype). Raises CheckpointError
    listing missing / unexpected names and every shape mismatch."""
    targets = model.state_dict(keep_vars=True)  # includes both names of tied weights
    tied = getattr(getattr(model, "config", None), "tie_word_embeddings", False)
    missing = sorted(n for n in targets if n not in tensors and not (tied and n == "lm_head.weight"))
    unexpected = sorted(n for n in tensors if n not in targets)
    problems: list[str] = []
    if missing:
        problems.append(f"missing tensors ({len(missing)}): {_preview(missing)}")
    if unexpected:
        problems.append(f"unexpected tensors ({len(unexpected)}): {_preview(unexpected)}")
    for name, t in tensors.items():
        if name in targets and tuple(targets[name].shape) != tuple(t.shape):
            problems.append(f"shape mismatch for {name}: expected {tuple(targets[name].shape)}, got {tuple(t.shape)}")
    if problems:
        raise CheckpointError("checkpoint does not match the model: " + "; ".join(problems))
    with torch.no_grad():
        for name, t in tensors.items():
            dst = targets[name]
            dst.copy_(t.to(dst.dtype))


def _preview(names: Iterable[str], limit: int = 8) -> str:
    names = list(names)
    more = f" ... (+{len(names) - limit} more)" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def load_checkpoint(path: str | os.PathLike, dtype: torch.dtype = torch.float32):
    """Build an MLAForCausalLM from a HF checkpoint folder."""
    from splash_rollout.models.model import MLAForCausalLM, cast_model

    config = ModelConfig.from_hf(path)
    tensors = read_checkpoint(path, config)
    model = cast_model(MLAForCausalLM(config), dtype)
    load_state(model, tensors)
    return model


def save_checkpoint(model, path: str | os.PathLike) -> None:
    """Write ``config.json`` + ``model.safetensors`` with HF names (readable by ``load_checkpoint``)."""
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(model.config.to_hf_dict(), f, indent=2)
