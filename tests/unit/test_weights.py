"""Checkpoint loading: HF names, sharding, packed experts, fp8 block dequantisation, and errors
that name the tensor (MTP modules: test_mtp.py)."""
from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from splash_rollout.models.config import ModelConfig
from splash_rollout.models.model import MLAForCausalLM
from splash_rollout.models.weights import (CheckpointError, dequantize_fp8, load_checkpoint, quantize_fp8,
                                           read_checkpoint, save_checkpoint)
from tests.hf_tiny import save_hf_checkpoint

CFG = ModelConfig(name="tiny", model_type="glm_moe_dsa", vocab_size=97, hidden_size=64, num_layers=2, num_heads=4,
                  q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                  intermediate_size=96, moe_intermediate_size=32, n_routed_experts=4, n_shared_experts=1,
                  num_experts_per_tok=2, first_k_dense_replace=1, index_n_heads=4, index_head_dim=16,
                  index_topk=8)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf")
    save_hf_checkpoint(CFG, path, seed=2)
    return path


def _rewrite(src, dst, edit, config_edit=None):
    """Copy a single-file checkpoint with its tensors passed through ``edit(dict) -> dict``."""
    os.makedirs(dst, exist_ok=True)
    tensors = edit(load_file(os.path.join(src, "model.safetensors")))
    save_file(tensors, os.path.join(dst, "model.safetensors"))
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    if config_edit:
        config_edit(config)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f)
    return dst


def _same_weights(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_transformers_save_pretrained_layout_loads(hf_dir):
    names = load_file(os.path.join(hf_dir, "model.safetensors")).keys()
    assert "model.layers.1.mlp.experts.0.gate_proj.weight" in names  # what transformers 5 writes
    model = load_checkpoint(hf_dir)
    ours = set(model.state_dict())
    assert ours == set(names)


def test_sharded_checkpoint(hf_dir, tmp_path):
    from tests.hf_tiny import build_hf_model

    build_hf_model(CFG, seed=2).save_pretrained(tmp_path, max_shard_size="100KB")
    assert os.path.isfile(tmp_path / "model.safetensors.index.json")
    assert len([n for n in os.listdir(tmp_path) if n.endswith(".safetensors")]) > 1
    assert _same_weights(load_checkpoint(tmp_path), load_checkpoint(hf_dir))


def test_packed_experts(hf_dir, tmp_path):
    def pack(t):
        out = {}
        for layer in (1,):
            p = f"model.layers.{layer}.mlp.experts"
            gate = [t.pop(f"{p}.{e}.gate_proj.weight") for e in range(CFG.n_routed_experts)]
            up = [t.pop(f"{p}.{e}.up_proj.weight") for e in range(CFG.n_routed_experts)]
            down = [t.pop(f"{p}.{e}.down_proj.weight") for e in range(CFG.n_routed_experts)]
            out[f"{p}.gate_up_proj"] = torch.stack([torch.cat([g, u]) for g, u in zip(gate, up)])
            out[f"{p}.down_proj"] = torch.stack(down)
        return {**t, **out}

    assert _same_weights(load_checkpoint(_rewrite(hf_dir, tmp_path, pack)), load_checkpoint(hf_dir))


def test_fp8_round_trip_unit():
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(300, 200, generator=gen)  # partial blocks on both axes
    w[:128, :128] *= 50  # blocks keep their own scale
    q, scale_inv = quantize_fp8(w)
    assert q.dtype == torch.float8_e4m3fn and scale_inv.shape == (3, 2)
    back = dequantize_fp8(q, scale_inv)
    step = scale_inv.repeat_interleave(128, 0)[:300].repeat_interleave(128, 1)[:, :200]
    # e4m3 keeps 3 mantissa bits (relative error <= 1/16); subnormals are spaced 2^-9 (in block units)
    assert ((back - w).abs() <= w.abs() / 16 + step * 2 ** -9).all()
    assert (back - w).abs().max() < 0.07 * w.abs().max()
    with pytest.raises(CheckpointError, match="scale_inv"):
        dequantize_fp8(q, scale_inv[:2])


@pytest.mark.parametrize("block", [None, [16, 16]])
def test_fp8_checkpoint_dequantised_on_load(hf_dir, tmp_path, block):
    quantised = {}

    def quantise(t):
        for name in list(t):
            if name.endswith("proj.weight") and "indexer" not in name and t[name].dim() == 2:
                q, s = quantize_fp8(t[name], tuple(block) if block else (128, 128))
                quantised[name] = dequantize_fp8(q, s, tuple(block) if block else (128, 128))
                t[name], t[name + "_scale_inv"] = q, s
        return t

    def config_edit(c):
        if block:
            c["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": block}

    path = _rewrite(hf_dir, tmp_path, quantise, config_edit)
    assert "model.layers.0.self_attn.q_b_proj.weight_scale_inv" in load_file(os.path.join(path, "model.safetensors"))
    model = load_checkpoint(path)
    state = model.state_dict()
    assert quantised and all(torch.equal(state[k], v) for k, v in quantised.items())
    ref = load_checkpoint(hf_dir).state_dict()
    k = "model.layers.0.self_attn.kv_b_proj.weight"
    assert 0 < (state[k] - ref[k]).abs().max() < 0.07 * ref[k].abs().max()
    bf16 = load_checkpoint(path, dtype=torch.bfloat16)
    assert bf16.state_dict()[k].dtype == torch.bfloat16


def test_missing_tensor_is_named(hf_dir, tmp_path):
    def drop(t):
        del t["model.layers.1.self_attn.kv_b_proj.weight"]
        return t

    with pytest.raises(CheckpointError, match=r"missing tensors \(1\): model\.layers\.1\.self_attn\.kv_b_proj\.weight"):
        load_checkpoint(_rewrite(hf_dir, tmp_path, drop))


def test_shape_mismatch_is_named(hf_dir, tmp_path):
    def shrink(t):
        t["model.layers.0.self_attn.o_proj.weight"] = torch.zeros(64, 32)
        return t

    with pytest.raises(CheckpointError, match=r"shape mismatch for model\.layers\.0\.self_attn\.o_proj\.weight: "
                                              r"expected \(64, 64\), got \(64, 32\)"):
        load_checkpoint(_rewrite(hf_dir, tmp_path, shrink))


def test_unexpected_tensor_is_named(hf_dir, tmp_path):
    def extra(t):
        t["model.layers.0.self_attn.surprise.weight"] = torch.zeros(2)
        return t

    with pytest.raises(CheckpointError, match=r"unexpected tensors \(1\): model\.layers\.0\.self_attn\.surprise"):
        load_checkpoint(_rewrite(hf_dir, tmp_path, extra))


def test_fp8_without_scale_is_an_error(hf_dir, tmp_path):
    def bad(t):
        t["model.layers.0.self_attn.o_proj.weight"] = t["model.layers.0.self_attn.o_proj.weight"].to(torch.float8_e4m3fn)
        return t

    with pytest.raises(CheckpointError, match="o_proj.weight: float8 weight without"):
        read_checkpoint(_rewrite(hf_dir, tmp_path, bad))


def test_save_checkpoint_round_trip(tmp_path):
    model = MLAForCausalLM.from_config(CFG, seed=5)
    save_checkpoint(model, tmp_path)
    again = MLAForCausalLM.from_pretrained(tmp_path)
    assert again.config.replace(name=CFG.name) == CFG
    assert _same_weights(model, again)
