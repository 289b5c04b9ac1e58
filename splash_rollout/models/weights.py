"""Weights under HF names, read a part at a time: checkpoints, seeded presets, in-memory tensors.

Why parts: a rank of a T-rank engine holds a slice of most tensors (its heads of the attention
projections, its experts, its share of the dense blocks), and DeepSeek-V3's 671 B parameters are
~690 GB of float8: nothing may read a whole checkpoint into memory to keep a slice of it. So a
``WeightSource`` answers ``read(name, index)`` -- the values of ``full[name][index]`` -- and
``load_into`` copies into each of a model's tensors exactly the part it holds (``Target``: a tensor
and the index of the full tensor it holds). Who holds which part is the engine's business
(``engine/rank_weights.py``); a whole model (a trainer's) holds every part of every tensor.

``CheckpointSource`` reads a checkpoint folder: ``config.json`` plus one ``model.safetensors`` or
shards listed in ``model.safetensors.index.json`` (any ``*.safetensors`` otherwise), each file a
memory map (``safetensors_file.py``) whose tensors are zero-copy views: a slice read is one copy
from the page cache into its parameter. It understands:

* per-expert names ``mlp.experts.{e}.{gate,up,down}_proj.weight`` (what the hubs ship and what
  transformers 5 ``save_pretrained`` writes) and the packed transformers-internal form
  ``mlp.experts.gate_up_proj`` [E, 2I, hidden] / ``mlp.experts.down_proj`` [E, hidden, I], served
  per expert;
* fp8 block-scaled weights (``X.weight`` float8_e4m3fn with ``X.weight_scale_inv`` [ceil(out/b),
  ceil(in/b)], b = 128 unless ``quantization_config.weight_block_size`` says otherwise),
  dequantised to float32 slice by slice (only the scale blocks a slice touches) before the cast to
  the model dtype;
* MTP modules (layers at index >= num_hidden_layers, ``num_nextn_predict_layers``): read under the
  model's names (``model.mtp_layers.{k}.*``, models/mtp.py) when the config asks for them
  (``ModelConfig.num_mtp_layers``), their copies of the embedding and LM head left out (they are the
  main model's); layers beyond that are skipped with a note. A checkpoint whose config declares MTP
  modules but whose files hold none of their tensors (transformers' ``save_pretrained`` drops
  them) loads without them, with a note.

``PresetSource`` is a preset's seeded random init, one tensor at a time; ``StateSource`` a dict of
full tensors. Errors name the tensor: missing names, unexpected names, shape mismatches (expected
vs got), float8 without its scales.
"""
from __future__ import annotations

import abc
import json
import logging
import os
import re
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping

import torch
from safetensors.torch import save_file

from splash_rollout.models.config import ModelConfig
from splash_rollout.models.mtp import SHARED_WITH_MAIN, checkpoint_name
from splash_rollout.models.mtp import model_name as mtp_model_name
from splash_rollout.models.safetensors_file import SafetensorsFile

log = logging.getLogger(__name__)

_PACKED_RE = re.compile(r"^(model\.(?:layers|mtp_layers)\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)$")
_IGNORED = re.compile(r"(rotary_emb\.inv_freq|\.rotary_emb\.)")
_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
DEFAULT_FP8_BLOCK = (128, 128)

Index = tuple
"""A part of a full tensor, as a tuple of slices (and ints) that index it; ``()`` is all of it."""


class CheckpointError(ValueError):
    """A checkpoint does not match the model: the message names the tensors."""


# ---- fp8 -----------------------------------------------------------------------------------------
def dequantize_fp8(weight: torch.Tensor, scale_inv: torch.Tensor,
                   block: tuple[int, int] = DEFAULT_FP8_BLOCK) -> torch.Tensor:
    """weight [out, in] float8 and scale_inv [ceil(out/bo), ceil(in/bi)] -> float32 [out, in]."""
    out_dim, in_dim = weight.shape
    bo, bi = block
    expected = (-(-out_dim // bo), -(-in_dim // bi))
    if tuple(scale_inv.shape) != expected:
        raise CheckpointError(f"fp8 scale_inv: expected shape {expected} for weight {tuple(weight.shape)}, "
                              f"got {tuple(scale_inv.shape)}")
    return _dequantize_part(weight, scale_inv, block, 0, 0)


def _dequantize_part(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int], row0: int,
                     col0: int) -> torch.Tensor:
    """The float32 values of a float8 part [rows, cols] whose first element is at (row0, col0) of the
    full weight; ``scale_inv`` is the full weight's block scales. Reads only the blocks it covers."""
    bo, bi = block
    rows, cols = weight.shape
    br, bc = row0 // bo, col0 // bi
    scales = scale_inv[br: -(-(row0 + rows) // bo), bc: -(-(col0 + cols) // bi)].float()
    scale = scales.repeat_interleave(bo, 0)[row0 - br * bo: row0 - br * bo + rows]
    scale = scale.repeat_interleave(bi, 1)[:, col0 - bc * bi: col0 - bc * bi + cols]
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


def _bounds(index: Index, shape: tuple[int, ...]) -> list[tuple[int, int]]:
    """Per dimension of a 2-D part: (first, stop) of a step-1 slice (ints are rejected)."""
    out = []
    for d, size in enumerate(shape):
        s = index[d] if d < len(index) else slice(None)
        if not isinstance(s, slice) or s.step not in (None, 1):
            raise CheckpointError(f"fp8 weights are read in contiguous 2-D slices, got index {index!r}")
        first, stop, _ = s.indices(size)
        out.append((first, stop))
    return out


# ---- sources -------------------------------------------------------------------------------------
class WeightSource(abc.ABC):
    """A full model's tensors under HF names, read a part at a time."""

    @abc.abstractmethod
    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor's full shape, by name."""

    def order(self) -> list[str]:
        """The names in the order reading them is cheapest (a file's tensors in file order)."""
        return list(self.shapes())

    @abc.abstractmethod
    def read(self, name: str, index: Index = ()) -> torch.Tensor:
        """The values of ``full[name][index]`` (any dtype; the caller casts). May be a view of the
        source: copy it before the next read."""

    def stored_name(self, name: str) -> str:
        """The name a model tensor has where this source keeps it (what its errors say)."""
        return name

    def close(self) -> None:
        """Release what the source holds open (files)."""

    def __enter__(self) -> "WeightSource":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@dataclass(frozen=True)
class _Stored:
    """Where one HF-named tensor of a checkpoint lives: a file's tensor, or a piece of a packed one."""

    file: int
    key: str
    shape: tuple[int, ...]
    pick: Index = ()
    """The part of the stored tensor that is this name's (packed experts: one expert, gate or up)."""
    scale: tuple[int, str] | None = None
    """(file, key) of a float8 tensor's ``weight_scale_inv``."""


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


class CheckpointSource(WeightSource):
    """A checkpoint folder, memory-mapped; reads copy only the part asked for (see the module doc)."""

    def __init__(self, path: str | os.PathLike, config: ModelConfig | None = None) -> None:
        self.path = os.fspath(path)
        self.config = config or ModelConfig.from_hf(self.path)
        quant = self.config.extra.get("quantization_config") or {}
        self.block = tuple(quant.get("weight_block_size", DEFAULT_FP8_BLOCK))
        self.files = [SafetensorsFile(f) for f in checkpoint_files(self.path)]
        self.skipped_layers: set[int] = set()
        """MTP layers (index >= num_hidden_layers + num_mtp_layers) present in the files and not read."""
        self._stored: dict[str, _Stored] = {}
        self._begin: dict[str, tuple[int, int]] = {}
        self._index_files()
        if self.skipped_layers:
            log.info("checkpoint %s: skipped MTP layers %s (the model reads %d MTP module(s))",
                     self.path, sorted(self.skipped_layers), self.config.num_mtp_layers)

    def _index_files(self) -> None:
        scales = {key: i for i, f in enumerate(self.files) for key in f.entries if key.endswith("_scale_inv")}
        for i, f in enumerate(self.files):
            for key, entry in f.entries.items():
                if key.endswith("weight_scale_inv") or _IGNORED.search(key):
                    continue
                name, depth = mtp_model_name(key, self.config)
                if depth is not None and depth >= self.config.num_mtp_layers:
                    self.skipped_layers.add(self.config.num_layers + depth)
                    continue
                if name is None:  # an MTP module's copy of the embedding / LM head: the main model's
                    continue
                scale = key + "_scale_inv"
                if entry.dtype in _FP8 and scale not in scales:
                    raise CheckpointError(f"{key}: float8 weight without {scale}")
                scale = (scales[scale], scale) if entry.dtype in _FP8 else None
                packed = _PACKED_RE.match(name)
                if packed:
                    if scale is not None:
                        raise CheckpointError(f"{key}: packed float8 experts are not supported; ship them per expert")
                    self._add_packed(i, key, entry.shape, *packed.groups())
                else:
                    self._stored[name] = _Stored(i, key, entry.shape, (), scale)
                    self._begin[name] = (i, entry.begin)

    def _add_packed(self, file: int, key: str, shape: tuple[int, ...], prefix: str, kind: str) -> None:
        experts, rows, cols = shape
        begin = self.files[file].entries[key].begin
        for e in range(experts):
            if kind == "gate_up_proj":  # [E, 2I, hidden]: gate rows first, then up
                half = rows // 2
                for part, rs in (("gate_proj", slice(0, half)), ("up_proj", slice(half, rows))):
                    name = f"{prefix}.{e}.{part}.weight"
                    self._stored[name] = _Stored(file, key, (half, cols), (e, rs))
                    self._begin[name] = (file, begin)
            else:  # down_proj [E, hidden, I]
                name = f"{prefix}.{e}.down_proj.weight"
                self._stored[name] = _Stored(file, key, (rows, cols), (e,))
                self._begin[name] = (file, begin)

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {name: s.shape for name, s in self._stored.items()}

    def stored_name(self, name: str) -> str:
        """An MTP module's tensors are ``model.layers.{num_layers + k}.*`` in the files."""
        return checkpoint_name(name, self.config)

    def order(self) -> list[str]:
        return sorted(self._stored, key=lambda n: self._begin[n])

    def read(self, name: str, index: Index = ()) -> torch.Tensor:
        stored = self._stored[name]
        f = self.files[stored.file]
        whole = f.view(stored.key)[stored.pick] if stored.pick else f.view(stored.key)
        if stored.scale is None:
            return whole[index] if index else whole
        (r0, r1), (c0, c1) = _bounds(index, stored.shape)
        scale_file, scale_key = stored.scale
        return _dequantize_part(whole[r0:r1, c0:c1], self.files[scale_file].view(scale_key), self.block, r0, c0)

    def close(self) -> None:
        for f in self.files:
            f.close()


class StateSource(WeightSource):
    """Full tensors in memory (a trainer's state dict): reads are views of them."""

    def __init__(self, tensors: Mapping[str, torch.Tensor]) -> None:
        self.tensors = dict(tensors)

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {name: tuple(t.shape) for name, t in self.tensors.items()}

    def read(self, name: str, index: Index = ()) -> torch.Tensor:
        t = self.tensors[name]
        return t[index] if index else t


def init_value(name: str, shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    """A preset's seeded init of one parameter, float32: norm weights 1, norm biases 0, everything
    else N(0, 0.02) drawn from ``generator`` (parameters are drawn in sorted-name order)."""
    if name.endswith("norm.weight"):
        return torch.ones(shape)
    if name.endswith("norm.bias"):
        return torch.zeros(shape)
    return torch.randn(shape, generator=generator, dtype=torch.float32) * 0.02


def _draws(name: str) -> bool:
    return not name.endswith(("norm.weight", "norm.bias"))


class PresetSource(WeightSource):
    """A preset's seeded random init (``MLAForCausalLM.from_config``), one tensor at a time: the
    parameters are drawn from one generator in sorted-name order, so a read draws (and drops) every
    earlier tensor it skipped; buffers (the router's correction bias) are zeros. Read in ``order()``."""

    def __init__(self, parameters: Mapping[str, tuple[int, ...]], buffers: Mapping[str, tuple[int, ...]],
                 seed: int) -> None:
        self.parameters, self.buffers, self.seed = dict(parameters), dict(buffers), seed
        self._sorted = sorted(self.parameters)
        self._next = 0
        self._generator = torch.Generator().manual_seed(seed)
        self._last: tuple[str, torch.Tensor] | None = None

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {**self.parameters, **self.buffers}

    def order(self) -> list[str]:
        return self._sorted + sorted(self.buffers)

    def read(self, name: str, index: Index = ()) -> torch.Tensor:
        if name in self.buffers:
            full = torch.zeros(self.buffers[name])
            return full[index] if index else full
        if self._last is None or self._last[0] != name:
            position = self._sorted.index(name)
            if position < self._next:
                raise RuntimeError(f"PresetSource: {name} read after a later tensor (read in order())")
            for skipped in self._sorted[self._next:position]:  # advance the generator past them
                if _draws(skipped):
                    torch.randn(self.parameters[skipped], generator=self._generator, dtype=torch.float32)
            self._last = (name, init_value(name, self.parameters[name], self._generator))
            self._next = position + 1
        full = self._last[1]
        return full[index] if index else full


def preset_source(model: torch.nn.Module, seed: int) -> PresetSource:
    """The seeded init of a whole model's parameters and buffers (meta or real; names as
    ``named_parameters``, so a tied LM head is the embedding)."""
    return PresetSource({n: tuple(p.shape) for n, p in model.named_parameters()},
                        {n: tuple(b.shape) for n, b in model.named_buffers()}, seed)


# ---- loading into a model --------------------------------------------------------------------------
@dataclass(frozen=True)
class Target:
    """A tensor of a model (a parameter, a buffer, a projection shard) and the part of the full
    tensor it holds."""

    tensor: torch.Tensor
    index: Index = ()


def check_source(source: WeightSource, full_shapes: Mapping[str, tuple], tied: bool = False,
                 unread: Callable[[str], bool] | None = None) -> None:
    """Raise CheckpointError listing missing / unexpected names and every shape mismatch between a
    source and the full model (``full_shapes``: name -> shape); with ``tied`` the LM head may be
    absent (it is the embedding); names for which ``unread(name)`` holds may be in the source and
    not in the model (an engine's rank leaves a checkpoint's MTP modules unread)."""
    have = {n: shape for n, shape in source.shapes().items()
            if n in full_shapes or unread is None or not unread(n)}
    shown = source.stored_name
    missing = sorted(shown(n) for n in full_shapes if n not in have and not (tied and n == "lm_head.weight"))
    unexpected = sorted(shown(n) for n in have if n not in full_shapes)
    problems: list[str] = []
    if missing:
        problems.append(f"missing tensors ({len(missing)}): {_preview(missing)}")
    if unexpected:
        problems.append(f"unexpected tensors ({len(unexpected)}): {_preview(unexpected)}")
    for name, shape in have.items():
        if name in full_shapes and tuple(full_shapes[name]) != tuple(shape):
            problems.append(f"shape mismatch for {shown(name)}: expected {tuple(full_shapes[name])}, got {tuple(shape)}")
    if problems:
        raise CheckpointError("checkpoint does not match the model: " + "; ".join(problems))


@torch.no_grad()
def load_into(source: WeightSource, targets: Mapping[str, list[Target]], full_shapes: Mapping[str, tuple],
              tied: bool = False, unread: Callable[[str], bool] | None = None) -> None:
    """Copy into every target the part of its full tensor it holds, reading the source in its
    cheapest order; names no target holds (another rank's experts) are never read. Checked first
    (``check_source``), so a mismatched source changes nothing."""
    check_source(source, full_shapes, tied, unread)
    for name in source.order():
        for target in targets.get(name, ()):
            part = source.read(name, target.index)
            if tuple(part.shape) != tuple(target.tensor.shape):
                raise CheckpointError(f"{name}{list(target.index)}: the source's part has shape "
                                      f"{tuple(part.shape)}, the model's tensor {tuple(target.tensor.shape)}")
            target.tensor.copy_(part)


def whole_model_targets(model: torch.nn.Module) -> dict[str, list[Target]]:
    """Every tensor of a whole (unsharded) model holds all of its full tensor (the tied LM head is
    the embedding's tensor and is filled through it)."""
    tied = getattr(getattr(model, "config", None), "tie_word_embeddings", False)
    return {name: [Target(t)] for name, t in model.state_dict(keep_vars=True).items()
            if not (tied and name == "lm_head.weight")}


def full_shapes_of(model: torch.nn.Module) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """name -> (shape, dtype) of every tensor of a whole model (meta or real)."""
    return {n: (tuple(t.shape), t.dtype) for n, t in model.state_dict(keep_vars=True).items()}


def _preview(names: Iterable[str], limit: int = 8) -> str:
    names = list(names)
    more = f" ... (+{len(names) - limit} more)" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def read_checkpoint(path: str | os.PathLike, config: ModelConfig | None = None) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint folder as a dict of copies (float8 dequantised to float32, packed
    experts per expert, MTP layers dropped), HF names. Holds the whole checkpoint in memory: for tools
    and tests; models load through ``load_into``."""
    with CheckpointSource(path, config) as source:
        return {name: source.read(name).clone() for name in source.order()}


def checkpoint_config(path: str | os.PathLike) -> ModelConfig:
    """The folder's ``config.json``, with the MTP modules its files actually hold: a config that
    declares some whose tensors are all absent (a ``save_pretrained`` of transformers' model drops
    them) gets ``num_mtp_layers=0`` and a note; some present and others missing is an error at load."""
    config = ModelConfig.from_hf(path)
    if config.num_mtp_layers:
        files = [SafetensorsFile(f) for f in checkpoint_files(os.fspath(path))]
        try:
            held = any(mtp_model_name(key, config)[1] is not None for f in files for key in f.entries)
        finally:
            for f in files:
                f.close()
        if not held:
            log.info("checkpoint %s: config.json declares %d MTP module(s) (num_nextn_predict_layers) but the files "
                     "hold none of their tensors; loaded without them", os.fspath(path), config.num_mtp_layers)
            config = config.replace(num_mtp_layers=0)
    return config


def load_checkpoint(path: str | os.PathLike, dtype: torch.dtype = torch.float32):
    """A whole MLAForCausalLM from a HF checkpoint folder (for a trainer): made without storage,
    given its storage, then filled tensor by tensor from the memory-mapped files."""
    from splash_rollout.models.model import MLAForCausalLM, materialize

    config = checkpoint_config(path)
    model = MLAForCausalLM.skeleton(config, dtype)
    shapes = {n: s for n, (s, _) in full_shapes_of(model).items()}
    materialize(model, "cpu")
    with CheckpointSource(path, config) as source:
        load_into(source, whole_model_targets(model), shapes, config.tie_word_embeddings)
    return model


def save_checkpoint(model, path: str | os.PathLike) -> None:
    """Write ``config.json`` + ``model.safetensors`` with HF names (readable by ``load_checkpoint``);
    MTP modules under their published names, with their copies of the embedding and LM head."""
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    config = model.config
    state = {checkpoint_name(k, config): v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    for depth in range(config.num_mtp_layers):  # the MTP modules' copies of the embedding and head, as published
        for suffix, main in SHARED_WITH_MAIN.items():
            main = "model.embed_tokens.weight" if config.tie_word_embeddings else main
            state[f"model.layers.{config.num_layers + depth}.{suffix}"] = state[main].clone()
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(model.config.to_hf_dict(), f, indent=2)
