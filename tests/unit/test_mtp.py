"""The MTP module: its logits against the published equations, loading from a DeepSeek-V3-format
checkpoint (float8 included), the checkpoints that must be refused (naming the tensor), and an
engine that serves without it."""
from __future__ import annotations

import json
import logging
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from splash_rollout.models.config import PRESETS, ModelConfig
from splash_rollout.models.model import DecoderLayer, MLAForCausalLM
from splash_rollout.models.weights import CheckpointError, load_checkpoint, quantize_fp8, save_checkpoint

CFG = ModelConfig(name="tiny-mtp", model_type="deepseek_v3", vocab_size=97, hidden_size=64, num_layers=2,
                  num_heads=4, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
                  v_head_dim=16, intermediate_size=96, moe_intermediate_size=32, n_routed_experts=4,
                  n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1, num_mtp_layers=1)
MTP = f"model.layers.{CFG.num_layers}"
"""The MTP module's tensors in a checkpoint."""


def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def reference_mtp_logits(model: MLAForCausalLM, ids: torch.Tensor) -> torch.Tensor:
    """DeepSeek-V3's MTP module (k = 1), written from its equations over the model's tensors:
    h'_i = W_eh [RMSNorm_e(Emb(t_{i+1})); RMSNorm_h(h_i)], h^1 = TRM(h'_{0..S-2}) (causal, position i),
    logits_i = Head(RMSNorm_s(h^1_i)), with h_i the main model's final-normed state and Emb / Head the
    main model's. TRM is a decoder layer of the model's kind holding the module's block weights."""
    cfg, sd = model.config, model.state_dict()
    eps = cfg.rms_norm_eps
    with torch.no_grad():
        hidden, _ = model._decoder(ids, None)
        h = _rms(hidden, sd["model.norm.weight"], eps)[:, :-1]
        e = torch.nn.functional.embedding(ids[:, 1:], sd["model.embed_tokens.weight"])
        prefix = "model.mtp_layers.0."
        x = torch.cat([_rms(e, sd[prefix + "enorm.weight"], eps), _rms(h, sd[prefix + "hnorm.weight"], eps)], -1)
        x = x @ sd[prefix + "eh_proj.weight"].T
        block = DecoderLayer(cfg, cfg.num_layers, model.model.rotary_emb)
        block.load_state_dict({k[len(prefix):]: v for k, v in sd.items()
                               if k.startswith(prefix) and not k[len(prefix):].startswith(("enorm", "hnorm", "eh_proj",
                                                                                          "shared_head"))})
        s = ids.shape[1] - 1
        allowed = torch.ones(s, s, dtype=torch.bool).tril()[None].expand(ids.shape[0], s, s)
        out, _ = block(x, torch.arange(s), allowed, None)
        return _rms(out, sd[prefix + "shared_head.norm.weight"], eps) @ sd["lm_head.weight"].T


@pytest.fixture(scope="module")
def model():
    m = MLAForCausalLM.from_config(CFG, seed=3)
    with torch.no_grad():  # non-trivial norms, so a swapped or missing norm shows
        for name, p in m.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))))
    return m.eval()


@pytest.fixture(scope="module")
def published(model, tmp_path_factory):
    """The model saved as DeepSeek-V3 ships it: the MTP module as layer ``num_layers``, with its copies
    of the embedding and LM head."""
    path = tmp_path_factory.mktemp("v3mtp")
    save_checkpoint(model, path)
    return path


def test_mtp_logits_follow_the_published_equations(model):
    ids = torch.randint(0, CFG.vocab_size, (2, 11), generator=torch.Generator().manual_seed(0))
    logits, (mtp,) = model(ids, mtp="attached")
    assert torch.equal(logits, model(ids)) and mtp.shape == (2, 10, CFG.vocab_size)
    torch.testing.assert_close(mtp, reference_mtp_logits(model, ids), atol=1e-5, rtol=1e-5)
    _, (detached,) = model(ids, mtp="detached")
    assert torch.equal(detached, mtp) and detached.requires_grad
    detached.sum().backward()  # trains the module alone: nothing reaches the decoder, embedding or head
    assert model.model.embed_tokens.weight.grad is None and model.lm_head.weight.grad is None
    assert model.model.mtp_layers[0].eh_proj.weight.grad is not None
    model.zero_grad(set_to_none=True)


def test_a_mtp_row_sees_only_its_past(model):
    ids = torch.randint(0, CFG.vocab_size, (1, 9), generator=torch.Generator().manual_seed(1))
    changed = ids.clone()
    changed[0, 7:] = (ids[0, 7:] + 1) % CFG.vocab_size  # tokens 7, 8: row i reads tokens <= i + 1
    _, (a,) = model(ids, mtp="attached")
    _, (b,) = model(changed, mtp="attached")
    torch.testing.assert_close(a[:, :6], b[:, :6], atol=1e-6, rtol=1e-5)  # batched MoE sums in another order
    assert not torch.allclose(a[:, 6], b[:, 6])


def test_a_deepseek_v3_checkpoint_with_its_mtp_module_loads(model, published, caplog):
    names = load_file(os.path.join(published, "model.safetensors")).keys()
    assert {f"{MTP}.eh_proj.weight", f"{MTP}.enorm.weight", f"{MTP}.hnorm.weight", f"{MTP}.shared_head.norm.weight",
            f"{MTP}.shared_head.head.weight", f"{MTP}.embed_tokens.weight",
            f"{MTP}.mlp.experts.3.down_proj.weight"} <= set(names)
    assert not any("mtp_layers" in n for n in names)
    with caplog.at_level(logging.INFO, logger="splash_rollout.models.weights"):
        loaded = load_checkpoint(published)
    assert "skipped" not in caplog.text
    want = model.state_dict()
    assert loaded.state_dict().keys() == want.keys()
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in want.items())


def test_float8_mtp_weights_are_dequantised(model, published, tmp_path):
    tensors = load_file(os.path.join(published, "model.safetensors"))
    name = f"{MTP}.eh_proj.weight"
    tensors[name], tensors[name + "_scale_inv"] = quantize_fp8(tensors[name], block=(16, 16))
    save_file(tensors, os.path.join(tmp_path, "model.safetensors"))
    config = json.load(open(os.path.join(published, "config.json")))
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [16, 16]}
    json.dump(config, open(os.path.join(tmp_path, "config.json"), "w"))
    got = load_checkpoint(tmp_path).model.mtp_layers[0].eh_proj.weight
    want = model.model.mtp_layers[0].eh_proj.weight
    assert (got - want).abs().max() <= want.abs().max() / 8 and not torch.equal(got, want)


def _rewrite(src, dst, edit):
    tensors = edit(load_file(os.path.join(src, "model.safetensors")))
    os.makedirs(dst, exist_ok=True)
    save_file(tensors, os.path.join(dst, "model.safetensors"))
    with open(os.path.join(src, "config.json")) as f, open(os.path.join(dst, "config.json"), "w") as g:
        g.write(f.read())
    return dst


def test_missing_or_misshaped_mtp_tensors_are_refused_by_name(published, tmp_path):
    def drop(t):
        del t[f"{MTP}.hnorm.weight"]
        return t

    with pytest.raises(CheckpointError, match=rf"missing tensors \(1\): {MTP}\.hnorm\.weight"):
        load_checkpoint(_rewrite(published, tmp_path / "missing", drop))

    def transpose(t):
        t[f"{MTP}.eh_proj.weight"] = t[f"{MTP}.eh_proj.weight"].T.contiguous()
        return t

    with pytest.raises(CheckpointError, match=rf"shape mismatch for {MTP}\.eh_proj\.weight: expected \(64, 128\), "
                                              r"got \(128, 64\)"):
        load_checkpoint(_rewrite(published, tmp_path / "shape", transpose))


def test_a_config_that_declares_mtp_the_files_lack_loads_without_it(published, tmp_path, caplog):
    no_mtp = _rewrite(published, tmp_path, lambda t: {k: v for k, v in t.items() if not k.startswith(MTP + ".")})
    with caplog.at_level(logging.INFO, logger="splash_rollout.models.weights"):
        model = load_checkpoint(no_mtp)
    assert model.config.num_mtp_layers == 0 and len(model.model.mtp_layers) == 0
    assert "declares 1 MTP module(s)" in caplog.text


def test_glm5_nano_has_one_mtp_module_and_the_same_decoder_weights():
    nano = PRESETS["glm5-nano"]
    assert nano.num_mtp_layers == 1
    with_mtp = MLAForCausalLM.from_config(nano, seed=0).state_dict()
    without = MLAForCausalLM.from_config(nano.replace(num_mtp_layers=0), seed=0).state_dict()
    assert {k for k in with_mtp if k not in without} == {k for k in with_mtp if k.startswith("model.mtp_layers.0.")}
    assert all(torch.equal(with_mtp[k], v) for k, v in without.items())  # the MTP draws come last


def test_an_engine_that_drafts_with_the_module_loads_it_and_a_push_carries_it(published, caplog):
    from splash_rollout import EngineConfig, RolloutEngine, SamplingParams

    with caplog.at_level(logging.INFO, logger="splash_rollout.models.weights"):
        engine = RolloutEngine(EngineConfig(model=os.fspath(published), speculation="always", draft="mtp",
                                            memory={"num_pages": 64, "page_size": 16}))
    with engine:
        assert engine.model_config.num_mtp_layers == 1 and "skipped MTP" not in caplog.text
        module = engine.local_engine.mtp.module
        assert len(engine.model.model.mtp_layers) == 0  # the served model never holds it: rank 0's drafter does
        want = MLAForCausalLM.from_pretrained(os.fspath(published)).model.mtp_layers[0].state_dict()
        assert all(torch.equal(module.state_dict()[k], v) for k, v in want.items())
        trained = MLAForCausalLM.from_config(CFG, seed=9).state_dict()
        engine.update_weights(trained, version=1)
        assert torch.equal(module.eh_proj.weight, trained["model.mtp_layers.0.eh_proj.weight"])
        batch = engine.generate([[3, 4, 5]], SamplingParams(max_new_tokens=12, seed=1, ignore_eos=True))
        assert batch.metrics["spec/verified/mtp"] > 0
        with pytest.raises(ValueError, match="shape"):
            engine.update_weights({"model.mtp_layers.0.eh_proj.weight": torch.zeros(3, 3)})


def test_an_engine_serves_without_the_mtp_module_and_takes_a_push_that_carries_it(published, caplog):
    from splash_rollout import EngineConfig, RolloutEngine, SamplingParams

    with caplog.at_level(logging.INFO, logger="splash_rollout.models.weights"):
        engine = RolloutEngine(EngineConfig(model=os.fspath(published), draft="ngram",
                                            memory={"num_pages": 64, "page_size": 16}))
    with engine:
        assert engine.model_config.num_mtp_layers == 0 and len(engine.model.model.mtp_layers) == 0
        assert f"skipped MTP layers [{CFG.num_layers}]" in caplog.text
        trained = MLAForCausalLM.from_config(CFG, seed=9).state_dict()
        engine.update_weights(trained, version=1)  # the trainer's whole state dict, MTP module included
        assert torch.equal(engine.model.lm_head.weight, trained["lm_head.weight"])
        assert engine.generate([[3, 4, 5]], SamplingParams(max_new_tokens=4, seed=1)).groups[0].samples[0].weight_version == 1
        with pytest.raises(ValueError, match="unknown parameter names"):
            engine.update_weights({"model.not_a_layer.weight": torch.zeros(1)})


def test_the_modules_router_is_not_one_of_the_rollouts(model):
    """Routing capture and replay (R3) cover the decoder's MoE layers; the module routes on its own."""
    from splash_rollout.models.moe import routing_context

    ids = torch.randint(0, CFG.vocab_size, (1, 6), generator=torch.Generator().manual_seed(2))
    with routing_context(capture=True) as captured:
        model(ids, mtp="detached")
    assert captured.calls == len(CFG.moe_layers) == 1
    replay = [(e, torch.ones(e.shape[0], dtype=torch.bool)) for e in captured.captured]
    with routing_context(replay=replay):
        model(ids, mtp="detached")  # exactly the decoder's routers replayed
