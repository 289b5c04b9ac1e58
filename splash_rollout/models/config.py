"""ModelConfig: the dimensions of one MLA model (DeepSeek-V3, DeepSeek-V3.2, GLM-5 / glm_moe_dsa).

This is the one model file the pure layers (layout/, scheduling/, sim/) may import, so it holds
numbers only: no torch. It reads a Hugging Face ``config.json`` (``from_hf``) and carries presets
with the public dimensions of the large models plus ``glm5-nano``, the GLM-5 architecture scaled
down so a whole GRPO run fits on two CPU cores.
"""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any, Mapping

SUPPORTED_MODEL_TYPES = ("deepseek_v3", "deepseek_v32", "glm_moe_dsa")


@dataclass(frozen=True)
class ModelConfig:
    """Global (never rank-local) dimensions of an MLA decoder."""

    name: str
    """Preset name or checkpoint folder the config came from."""
    model_type: str
    """HF model type: ``deepseek_v3``, ``deepseek_v32`` or ``glm_moe_dsa``."""
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    """Attention (query) heads H; MLA has no KV heads."""
    q_lora_rank: int | None
    """Rank of the query down-projection q_a; None means a plain q_proj (no LoRA)."""
    kv_lora_rank: int
    """Width of the cached latent ``c_kv``."""
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    """Width of the decoupled RoPE key ``k_pe`` (shared by all heads, cached)."""
    v_head_dim: int
    intermediate_size: int
    """Dense MLP width (the first ``first_k_dense_replace`` layers)."""
    moe_intermediate_size: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = True
    first_k_dense_replace: int = 0
    index_n_heads: int = 0
    """DSA lightning-indexer heads; 0 means no indexer (DeepSeek-V3)."""
    index_head_dim: int = 0
    """Width of the cached indexer key per token."""
    index_topk: int = 0
    """Tokens each query attends to under DSA."""
    indexer_types: tuple[str, ...] = ()
    """Per layer ``full`` (runs its indexer) or ``shared`` (reuses the previous full layer's top-k)."""
    num_mtp_layers: int = 0
    """Multi-token-prediction modules after the decoder (HF ``num_nextn_predict_layers``; DeepSeek-V3
    and GLM-5 ship one): module k predicts the token k + 1 ahead (models/mtp.py)."""
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: Mapping[str, Any] | None = None
    """YaRN parameters (``type``/``rope_type``, ``factor``, ``original_max_position_embeddings``,
    ``beta_fast``, ``beta_slow``, ``mscale``, ``mscale_all_dim``) or None for plain RoPE."""
    rope_interleave: bool = True
    """DeepSeek checkpoints store the rope dims interleaved (pairs 2i, 2i+1)."""
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    bos_token_id: int | None = 0
    eos_token_ids: tuple[int, ...] = (1,)
    extra: Mapping[str, Any] = field(default_factory=dict, compare=False)
    """HF keys we do not model, kept so ``to_hf_dict`` round-trips."""

    def __post_init__(self) -> None:
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model_type: expected one of {SUPPORTED_MODEL_TYPES}, got {self.model_type!r}")
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "kv_lora_rank",
                     "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: expected a positive integer, got {getattr(self, name)}")
        if self.index_n_heads and not self.indexer_types:
            object.__setattr__(self, "indexer_types", ("full",) * self.num_layers)
        if self.indexer_types and len(self.indexer_types) != self.num_layers:
            raise ValueError(f"indexer_types: expected {self.num_layers} entries, got {len(self.indexer_types)}")
        if not isinstance(self.num_mtp_layers, int) or self.num_mtp_layers < 0:
            raise ValueError(f"num_mtp_layers: expected an integer >= 0, got {self.num_mtp_layers!r}")

    # ---- derived numbers -------------------------------------------------------------------
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def has_indexer(self) -> bool:
        return self.index_n_heads > 0

    @property
    def kv_cache_dim(self) -> int:
        """Cached values per token per layer for attention: latent + rope key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def moe_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_layers) if self.is_moe_layer(i))

    def is_moe_layer(self, layer: int) -> bool:
        return self.n_routed_experts > 0 and layer >= self.first_k_dense_replace

    def indexer_type(self, layer: int) -> str:
        """``full`` or ``shared`` for a decoder layer; an MTP module's layer (``layer >= num_layers``)
        always runs its own indexer."""
        return self.indexer_types[layer] if layer < self.num_layers else "full"

    def layer_has_indexer_cache(self, layer: int) -> bool:
        """Whether this layer caches indexer keys (``shared`` layers reuse another layer's top-k)."""
        return self.has_indexer and self.indexer_type(layer) == "full"

    @property
    def num_indexer_cache_layers(self) -> int:
        return sum(self.layer_has_indexer_cache(i) for i in range(self.num_layers))

    # ---- conversion --------------------------------------------------------------------------
    @classmethod
    def from_hf(cls, source: str | os.PathLike | Mapping[str, Any], name: str | None = None) -> "ModelConfig":
        """Read a HF ``config.json`` (a checkpoint folder, the file itself, or its dict)."""
        if isinstance(source, Mapping):
            raw, label = dict(source), name or str(source.get("_name_or_path", "hf-config"))
        else:
            path = os.fspath(source)
            file = os.path.join(path, "config.json") if os.path.isdir(path) else path
            if not os.path.isfile(file):
                raise FileNotFoundError(f"model: no config.json at {path!r}")
            with open(file) as f:
                raw = json.load(f)
            label = name or path
        model_type = raw.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model_type: expected one of {SUPPORTED_MODEL_TYPES}, got {model_type!r}")
        num_layers = int(raw["num_hidden_layers"])
        rope = raw.get("rope_parameters") or {}
        scaling = raw.get("rope_scaling")
        if scaling is None and rope.get("rope_type", "default") not in ("default", None):
            scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
        theta = rope.get("rope_theta", raw.get("rope_theta", 10000.0))
        eos = raw.get("eos_token_id", 1)
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (int(eos),))
        has_index = model_type in ("deepseek_v32", "glm_moe_dsa")
        indexer_types: tuple[str, ...] = ()
        if has_index:
            types = raw.get("indexer_types")
            if types is None:
                freq = max(int(raw.get("index_topk_freq", 1)), 1)
                offset = int(raw.get("index_skip_topk_offset", 2))
                pattern = raw.get("index_topk_pattern")
                if pattern is not None:
                    types = [{"F": "full", "S": "shared"}[c] for c in pattern] if isinstance(pattern, str) else pattern
                else:
                    types = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(num_layers)]
            indexer_types = tuple(types)
        known = {
            "model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
            "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
            "intermediate_size", "moe_intermediate_size", "n_routed_experts", "n_shared_experts",
            "num_experts_per_tok", "n_group", "topk_group", "routed_scaling_factor", "norm_topk_prob",
            "first_k_dense_replace", "index_n_heads", "index_head_dim", "index_topk", "indexer_types",
            "rms_norm_eps", "rope_theta", "rope_scaling", "rope_parameters", "rope_interleave",
            "max_position_embeddings", "tie_word_embeddings", "bos_token_id", "eos_token_id",
            "num_nextn_predict_layers",
        }
        return cls(
            name=label,
            model_type=model_type,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=int(raw["hidden_size"]),
            num_layers=num_layers,
            num_heads=int(raw["num_attention_heads"]),
            q_lora_rank=raw.get("q_lora_rank"),
            kv_lora_rank=int(raw["kv_lora_rank"]),
            qk_nope_head_dim=int(raw["qk_nope_head_dim"]),
            qk_rope_head_dim=int(raw["qk_rope_head_dim"]),
            v_head_dim=int(raw["v_head_dim"]),
            intermediate_size=int(raw["intermediate_size"]),
            moe_intermediate_size=int(raw.get("moe_intermediate_size") or 0),
            n_routed_experts=int(raw.get("n_routed_experts") or 0),
            n_shared_experts=int(raw.get("n_shared_experts") or 0),
            num_experts_per_tok=int(raw.get("num_experts_per_tok") or 0),
            n_group=int(raw.get("n_group") or 1),
            topk_group=int(raw.get("topk_group") or 1),
            routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.0)),
            norm_topk_prob=bool(raw.get("norm_topk_prob", True)),
            first_k_dense_replace=int(raw.get("first_k_dense_replace") or 0),
            index_n_heads=int(raw.get("index_n_heads", 0)) if has_index else 0,
            index_head_dim=int(raw.get("index_head_dim", 0)) if has_index else 0,
            index_topk=int(raw.get("index_topk", 0)) if has_index else 0,
            indexer_types=indexer_types,
            num_mtp_layers=int(raw.get("num_nextn_predict_layers") or 0),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=float(theta),
            rope_scaling=dict(scaling) if scaling else None,
            rope_interleave=bool(raw.get("rope_interleave", True)),
            max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=eos_ids,
            extra={k: v for k, v in raw.items() if k not in known},
        )

    def to_hf_dict(self) -> dict[str, Any]:
        """The HF ``config.json`` dict for this config (used to write tiny checkpoints)."""
        rope: dict[str, Any] = {"rope_theta": self.rope_theta, "rope_type": "default"}
        if self.rope_scaling:
            rope = {"rope_theta": self.rope_theta, **dict(self.rope_scaling)}
            rope.setdefault("rope_type", rope.get("type", "yarn"))
        d: dict[str, Any] = {
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_heads,
            "q_lora_rank": self.q_lora_rank,
            "kv_lora_rank": self.kv_lora_rank,
            "qk_nope_head_dim": self.qk_nope_head_dim,
            "qk_rope_head_dim": self.qk_rope_head_dim,
            "v_head_dim": self.v_head_dim,
            "intermediate_size": self.intermediate_size,
            "moe_intermediate_size": self.moe_intermediate_size,
            "n_routed_experts": self.n_routed_experts,
            "n_shared_experts": self.n_shared_experts,
            "num_experts_per_tok": self.num_experts_per_tok,
            "n_group": self.n_group,
            "topk_group": self.topk_group,
            "routed_scaling_factor": self.routed_scaling_factor,
            "norm_topk_prob": self.norm_topk_prob,
            "first_k_dense_replace": self.first_k_dense_replace,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_parameters": rope,
            "rope_interleave": self.rope_interleave,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_ids) if len(self.eos_token_ids) != 1 else self.eos_token_ids[0],
            "hidden_act": "silu",
            "attention_bias": False,
            "num_nextn_predict_layers": self.num_mtp_layers,
        }
        if self.has_indexer:
            d.update(index_n_heads=self.index_n_heads, index_head_dim=self.index_head_dim,
                     index_topk=self.index_topk, indexer_types=list(self.indexer_types))
        d.update(self.extra)
        return d

    def replace(self, **changes: Any) -> "ModelConfig":
        return dataclasses.replace(self, **changes)


_DEEPSEEK_YARN = {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
                  "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}

PRESETS: dict[str, ModelConfig] = {
    # DeepSeek-V3 / R1 (671B): public config.json dims.
    "deepseek-v3": ModelConfig(
        name="deepseek-v3", model_type="deepseek_v3", vocab_size=129280, hidden_size=7168,
        num_layers=61, num_heads=128, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
        qk_rope_head_dim=64, v_head_dim=128, intermediate_size=18432, moe_intermediate_size=2048,
        n_routed_experts=256, n_shared_experts=1, num_experts_per_tok=8, n_group=8, topk_group=4,
        routed_scaling_factor=2.5, first_k_dense_replace=3, rope_theta=10000.0,
        rope_scaling=_DEEPSEEK_YARN, max_position_embeddings=163840, eos_token_ids=(1,), num_mtp_layers=1),
    # DeepSeek-V3.2: V3 plus the DSA lightning indexer (64 heads x 128, top-2048).
    "deepseek-v3.2": ModelConfig(
        name="deepseek-v3.2", model_type="deepseek_v32", vocab_size=129280, hidden_size=7168,
        num_layers=61, num_heads=128, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
        qk_rope_head_dim=64, v_head_dim=128, intermediate_size=18432, moe_intermediate_size=2048,
        n_routed_experts=256, n_shared_experts=1, num_experts_per_tok=8, n_group=8, topk_group=4,
        routed_scaling_factor=2.5, first_k_dense_replace=3, index_n_heads=64, index_head_dim=128,
        index_topk=2048, rope_theta=10000.0, rope_scaling=_DEEPSEEK_YARN,
        max_position_embeddings=163840, eos_token_ids=(1,), num_mtp_layers=1),
    # GLM-5 (glm_moe_dsa, 78 layers): MLA + DSA indexer (32 x 128, top-2048) + MoE.
    "glm-5": ModelConfig(
        name="glm-5", model_type="glm_moe_dsa", vocab_size=154880, hidden_size=6144, num_layers=78,
        num_heads=64, q_lora_rank=2048, kv_lora_rank=512, qk_nope_head_dim=192, qk_rope_head_dim=64,
        v_head_dim=256, intermediate_size=12288, moe_intermediate_size=2048, n_routed_experts=256,
        n_shared_experts=1, num_experts_per_tok=8, n_group=1, topk_group=1, routed_scaling_factor=2.5,
        first_k_dense_replace=3, index_n_heads=32, index_head_dim=128, index_topk=2048,
        rms_norm_eps=1e-5, rope_theta=1000000.0, max_position_embeddings=202752, eos_token_ids=(1,),
        num_mtp_layers=1),
    # Kimi K2 (DeepSeek-V3 architecture, 64 heads, 384 experts).
    "kimi-k2": ModelConfig(
        name="kimi-k2", model_type="deepseek_v3", vocab_size=163840, hidden_size=7168, num_layers=61,
        num_heads=64, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
        v_head_dim=128, intermediate_size=18432, moe_intermediate_size=2048, n_routed_experts=384,
        n_shared_experts=1, num_experts_per_tok=8, n_group=1, topk_group=1,
        routed_scaling_factor=2.827, first_k_dense_replace=1, rope_theta=50000.0,
        rope_scaling={"rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096,
                      "beta_fast": 1.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
        max_position_embeddings=131072, eos_token_ids=(163586,)),
    # GLM-5 scaled to two CPU cores: same structure (MLA + DSA + MoE with a shared expert and a
    # first dense layer). Heads and experts divide by 1, 2, 4 and 8; index_topk is small so the
    # indexer really selects on prompts of a few hundred tokens. Vocab matches the shipped tokenizer.
    # One MTP module, as GLM-5 ships.
    "glm5-nano": ModelConfig(
        name="glm5-nano", model_type="glm_moe_dsa", vocab_size=512, hidden_size=128, num_layers=4,
        num_heads=8, q_lora_rank=64, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16,
        v_head_dim=32, intermediate_size=384, moe_intermediate_size=96, n_routed_experts=8,
        n_shared_experts=1, num_experts_per_tok=2, n_group=1, topk_group=1, routed_scaling_factor=2.5,
        first_k_dense_replace=1, index_n_heads=4, index_head_dim=32, index_topk=64, rms_norm_eps=1e-5,
        rope_theta=10000.0, max_position_embeddings=4096, bos_token_id=0, eos_token_ids=(1,), num_mtp_layers=1),
}


def resolve_model(model: str | os.PathLike | ModelConfig) -> ModelConfig:
    """A preset name, a checkpoint folder / config.json path, or a ModelConfig → ModelConfig."""
    if isinstance(model, ModelConfig):
        return model
    key = os.fspath(model)
    if key in PRESETS:
        return PRESETS[key]
    if os.path.exists(key):
        return ModelConfig.from_hf(key)
    raise ValueError(f"model: unknown preset or path {key!r}; presets are {sorted(PRESETS)}")
