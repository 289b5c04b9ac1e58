"""MLAForCausalLM: DeepSeek-V3 / V3.2 / GLM-5 (glm_moe_dsa) on one device, HF parameter names.

``forward`` is the training forward over whole right-padded sequences and the parity oracle for the
engine; it is built from the same pieces the engine calls (``MLAAttention.project_q`` / ``project_kv``
/ W_UK absorption / ``attention_math.absorbed_attention`` / W_UV / o_proj), so both share numerics.
Router weights/bias and the indexer's weights_proj stay float32 in any model dtype (as transformers
keeps them); use ``cast_model`` rather than ``.to(dtype)`` to change dtype.
"""
from __future__ import annotations

import contextlib
import os
from typing import Iterator

import torch
from torch import nn

from splash_rollout.models.config import ModelConfig
from splash_rollout.models.mla import MLAAttention
from splash_rollout.models.moe import DenseMLP, MoE, routing_apart
from splash_rollout.models.norm import RMSNorm
from splash_rollout.models.numerics import Linear
from splash_rollout.models.rope import RotaryEmbedding

FP32_SUFFIXES = ("mlp.gate.weight", "mlp.gate.e_score_correction_bias", "indexer.weights_proj.weight")
"""Tensors kept in float32 whatever the model dtype."""


def keeps_fp32(name: str) -> bool:
    return name.endswith(FP32_SUFFIXES)


def cast_model(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """Cast floating parameters and buffers to ``dtype`` except the float32-kept ones (in place)."""
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if t.is_floating_point():
            t.data = t.data.to(torch.float32 if keeps_fp32(name) else dtype)
    return model


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = MLAAttention(config, layer_idx, rotary)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp: DenseMLP | MoE = (MoE(config) if config.is_moe_layer(layer_idx)
                                    else DenseMLP(config.hidden_size, config.intermediate_size))

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor, allowed: torch.Tensor,
                prev_selected: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """hidden [B, S, hidden] -> (hidden [B, S, hidden], DSA selection [B, S, S] or None)."""
        attn, selected = self.self_attn(self.input_layernorm(hidden), positions, allowed, prev_selected)
        hidden = hidden + attn
        b, s, d = hidden.shape
        hidden = hidden + self.mlp(self.post_attention_layernorm(hidden).reshape(b * s, d)).view(b, s, d)
        return hidden, selected


class MLAModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.rotary_emb = RotaryEmbedding(config)  # no parameters; shared by every layer
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i, self.rotary_emb) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        from splash_rollout.models.mtp import MTPLayer  # it builds on DecoderLayer (above)

        self.mtp_layers = nn.ModuleList(MTPLayer(config, k, self.rotary_emb) for k in range(config.num_mtp_layers))
        """The MTP modules (models/mtp.py), after the decoder; the decoder's layer loop never runs them."""


class MLAForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        if config.has_indexer and config.indexer_types and config.indexer_types[0] != "full":
            raise ValueError(f"indexer_types: layer 0 must be 'full', got {config.indexer_types[0]!r}")
        self.config = config
        self.model = MLAModel(config)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, mtp: str | None = None):
        """input_ids [B, S] (right padded), attention_mask [B, S] bool (True = real token) ->
        logits [B, S, vocab]. Causal; padded keys are never attended.

        ``mtp="attached"`` / ``"detached"``: also, per MTP module k = 1 .. num_mtp_layers, its logits
        [B, S - k, vocab] -- row i predicts token i + k + 1 from the depth before's state at i (for
        k = 1 the decoder's final-normed state) and the embedding of token i + k (models/mtp.py); a row
        whose inputs reach a padded token is meaningless. Returns (logits, [mtp logits]). Detached:
        the modules read the decoder's states, the embedding and the LM head without gradient, so a
        loss on their logits trains the MTP modules alone."""
        hidden, allowed = self._decoder(input_ids, attention_mask)
        b, s = input_ids.shape
        logits = self.compute_logits(hidden.reshape(b * s, -1)).view(b, s, -1)
        if mtp is None:
            return logits
        if mtp not in ("attached", "detached"):
            raise ValueError(f"mtp: expected None, 'attached' or 'detached', got {mtp!r}")
        return logits, self._mtp_logits(input_ids, hidden, allowed, detached=mtp == "detached")

    def _mtp_logits(self, input_ids: torch.Tensor, hidden: torch.Tensor, allowed: torch.Tensor,
                    detached: bool) -> list[torch.Tensor]:
        """Each MTP module's logits in turn, from the decoder's last hidden states [B, S, hidden]."""
        b, s = input_ids.shape
        cut = (lambda t: t.detach()) if detached else (lambda t: t)
        state, positions, out = cut(self.model.norm(hidden)), torch.arange(s, device=input_ids.device), []
        head = cut(self.lm_head.weight)
        with routing_apart():  # its router is not one of the decoder's (routing capture / replay)
            for k, layer in enumerate(self.model.mtp_layers, start=1):
                if s - k <= 0:
                    out.append(state.new_zeros(b, 0, head.shape[0]))
                    continue
                state, logits = layer.predict(cut(self.model.embed_tokens(input_ids[:, k:])), state[:, :s - k],
                                              positions[:s - k], allowed[:, :s - k, :s - k], head)
                out.append(logits)
        return out

    def _decoder(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """The decoder's last hidden states [B, S, hidden] (before the final norm) and the attention
        rule it used [B, S, S] (causal, padded keys never attended)."""
        b, s = input_ids.shape
        device = input_ids.device
        causal = torch.ones(s, s, dtype=torch.bool, device=device).tril()
        valid = (torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None
                 else attention_mask.to(torch.bool))
        allowed = causal[None] & valid[:, None, :]  # [B, S, S]
        positions = torch.arange(s, device=device)
        hidden = self.model.embed_tokens(input_ids)
        selected = None
        for layer in self.model.layers:
            hidden, selected = layer(hidden, positions, allowed, selected)
        return hidden, allowed

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] (last layer output, before the final norm) -> logits [N, vocab]."""
        return self.lm_head(self.model.norm(hidden))

    def set_indexer_tie_break(self, tie_break: str) -> None:
        """``"position"`` (default, layout-independent) or ``"torch"`` (transformers' exact choice)."""
        for layer in self.model.layers:
            if layer.self_attn.indexer is not None:
                layer.self_attn.indexer.tie_break = tie_break

    # ---- construction -------------------------------------------------------------------------
    @classmethod
    def skeleton(cls, config: ModelConfig, dtype: torch.dtype = torch.float32) -> "MLAForCausalLM":
        """The model without storage (every parameter and buffer on the meta device) in ``dtype``
        (the float32-kept ones stay float32): shapes and names only, for a loader to place and fill
        (``materialize``, ``weights.load_into``)."""
        with torch.device("meta"), _initialisers_skipped():
            model = cls(config)
        return cast_model(model, dtype).eval()

    @classmethod
    def from_config(cls, config: ModelConfig, seed: int, dtype: torch.dtype = torch.float32) -> "MLAForCausalLM":
        """Seeded random init (same seed => identical state_dict): linears and embeddings N(0, 0.02),
        norm weights 1, LayerNorm biases 0, e_score_correction_bias 0. Independent of global RNG."""
        from splash_rollout.models.weights import full_shapes_of, load_into, preset_source, whole_model_targets

        model = cls.skeleton(config, dtype).train()
        shapes = {n: s for n, (s, _) in full_shapes_of(model).items()}
        source = preset_source(model, seed)
        materialize(model, "cpu")
        load_into(source, whole_model_targets(model), shapes, config.tie_word_embeddings)
        return model

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, dtype: torch.dtype = torch.float32) -> "MLAForCausalLM":
        """Load a HF checkpoint folder (config.json + safetensors); see ``weights.load_checkpoint``."""
        from splash_rollout.models.weights import load_checkpoint

        return load_checkpoint(path, dtype=dtype)


@contextlib.contextmanager
def _initialisers_skipped() -> Iterator[None]:
    """``torch.nn.init``'s initialisers do nothing inside (process-wide, while a skeleton is built):
    a skeleton's values are never read, and on the meta device ``normal_`` alone pulls in torch's
    Python decompositions (~900 modules, 75 MB of every rank's memory)."""
    names = ("normal_", "uniform_", "kaiming_uniform_", "trunc_normal_", "zeros_", "ones_", "constant_")
    saved = {name: getattr(nn.init, name) for name in names}
    for name in names:
        setattr(nn.init, name, lambda tensor, *args, **kwargs: tensor)
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(nn.init, name, fn)


def materialize(module: nn.Module, device: str | torch.device) -> None:
    """Give every meta parameter and buffer of ``module`` uninitialised storage on ``device`` (same
    shape, dtype and ``requires_grad``); tied parameters stay one tensor. In place; a loader fills
    the values next."""
    made: dict[int, torch.Tensor] = {}
    for m in module.modules():
        for table, wrap in ((m._parameters, True), (m._buffers, False)):
            for name, t in list(table.items()):
                if t is None or not t.is_meta:
                    continue
                if id(t) not in made:
                    new = torch.empty(t.shape, dtype=t.dtype, device=device)
                    made[id(t)] = nn.Parameter(new, requires_grad=t.requires_grad) if wrap else new
                table[name] = made[id(t)]
