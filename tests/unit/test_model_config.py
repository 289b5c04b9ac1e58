"""ModelConfig: presets carry the public dims, from_hf reads the three model types, round trip."""
import json

import pytest

from splash_rollout.models.config import PRESETS, ModelConfig, resolve_model


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_round_trip_through_hf_dict(name):
    cfg = PRESETS[name]
    again = ModelConfig.from_hf(cfg.to_hf_dict(), name=name)
    assert again == cfg


def test_public_dims():
    glm = PRESETS["glm-5"]
    assert (glm.num_layers, glm.num_heads, glm.kv_lora_rank, glm.qk_rope_head_dim) == (78, 64, 512, 64)
    assert glm.has_indexer and glm.index_head_dim == 128 and glm.index_topk == 2048
    v3 = PRESETS["deepseek-v3"]
    assert not v3.has_indexer and v3.num_heads == 128 and v3.num_layers == 61
    nano = PRESETS["glm5-nano"]
    assert nano.model_type == "glm_moe_dsa" and nano.first_k_dense_replace >= 1 and nano.n_shared_experts == 1
    for t in (1, 2, 4, 8):
        assert nano.num_heads % t == 0 and nano.n_routed_experts % t == 0


def test_from_hf_folder_and_indexer_pattern(tmp_path):
    raw = PRESETS["glm5-nano"].to_hf_dict()
    raw.pop("indexer_types")
    raw["index_topk_pattern"] = "FSFS"
    (tmp_path / "config.json").write_text(json.dumps(raw))
    cfg = resolve_model(tmp_path)
    assert cfg.indexer_types == ("full", "shared", "full", "shared")
    assert cfg.num_indexer_cache_layers == 2


def test_from_hf_rejects_other_model_types():
    with pytest.raises(ValueError, match="model_type"):
        ModelConfig.from_hf({"model_type": "llama"})


def test_resolve_unknown_model_names_the_field():
    with pytest.raises(ValueError, match="model: unknown preset"):
        resolve_model("no-such-model")
