"""A rank's weights read from the file equal the same rank's share cut from the whole model, for every
layout and feed-forward placement; only the parts a rank holds are read; fp8 slices dequantise like
the whole tensor; pushes cut per rank land where the whole push lands."""
from __future__ import annotations

import pytest
import torch

from splash_rollout.engine.rank_weights import RankShare, adopt, held_parts, load, rank_targets
from splash_rollout.engine.weight_update import apply_parts, apply_update, cut_push
from splash_rollout.layout.rank_view import RankView
from splash_rollout.layout import Layout
from splash_rollout.models.config import PRESETS
from splash_rollout.models.model import MLAForCausalLM
from splash_rollout.models.weights import (CheckpointSource, PresetSource, dequantize_fp8, preset_source,
                                           quantize_fp8, save_checkpoint)
from splash_rollout.models.safetensors_file import SafetensorsFile

CFG = PRESETS["glm5-nano"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt")
    save_checkpoint(MLAForCausalLM.from_config(CFG, seed=4), path)
    return path


def _share(layout: str, rank: int, world: int, ff: str) -> RankShare:
    return RankShare(rank, world, RankView(Layout.parse(layout), rank, world, CFG.num_heads).head_slice, ff)


def _tensors(weights) -> dict[str, list[torch.Tensor]]:
    return {name: [t.tensor for t in ts] for name, ts in rank_targets(weights.model, weights.shards).items()}


@pytest.mark.parametrize("layout,ff", [("tp", "sharded"), ("dp", "sharded"), ("dop", "replicated"), ("cp", "sharded")])
@pytest.mark.parametrize("world", [1, 2])
def test_a_rank_loaded_from_the_file_equals_its_share_of_the_whole_model(checkpoint, layout, ff, world):
    for rank in range(world):
        share = _share(layout, rank, world, ff)
        with CheckpointSource(checkpoint) as source:
            loaded = load(CFG, source, share, torch.float32, torch.device("cpu"), comm=None)
        whole = adopt(MLAForCausalLM.from_pretrained(checkpoint), share, torch.device("cpu"), comm=None)
        got, want = _tensors(loaded), _tensors(whole)
        assert got.keys() == want.keys()
        for name in want:
            assert all(torch.equal(a, b) for a, b in zip(got[name], want[name])), name
        assert loaded.full_shapes == whole.full_shapes


def test_a_rank_holds_only_its_experts_and_head_slices(checkpoint):
    share = _share("tp", 1, 2, "sharded")
    with CheckpointSource(checkpoint) as source:
        weights = load(CFG, source, share, torch.float32, torch.device("cpu"), comm=None)
    held = held_parts(rank_targets(weights.model, weights.shards))
    experts = {int(n.split(".")[5]) for n in held if ".mlp.experts." in n}
    assert experts == set(range(CFG.n_routed_experts // 2, CFG.n_routed_experts))
    q_b = held["model.layers.0.self_attn.q_b_proj.weight"]
    per_head = CFG.qk_nope_head_dim + CFG.qk_rope_head_dim
    assert q_b == [(slice(CFG.num_heads // 2 * per_head, CFG.num_heads * per_head),)]
    total = sum(p.numel() * p.element_size() for p in weights.model.parameters()) + sum(
        s.nbytes for s in weights.shards)
    whole = sum(p.numel() * p.element_size() for p in MLAForCausalLM.from_pretrained(checkpoint).parameters())
    assert total < 0.75 * whole


def test_a_preset_rank_equals_the_seeded_whole_model():
    skeleton = MLAForCausalLM.skeleton(CFG)
    share = _share("dop", 0, 2, "sharded")
    loaded = load(CFG, preset_source(skeleton, 7), share, torch.bfloat16, torch.device("cpu"), comm=None)
    whole = adopt(MLAForCausalLM.from_config(CFG, seed=7, dtype=torch.bfloat16), share, torch.device("cpu"), None)
    got, want = _tensors(loaded), _tensors(whole)
    assert all(torch.equal(a, b) and a.dtype == b.dtype for n in want for a, b in zip(got[n], want[n]))


def test_preset_source_refuses_reads_out_of_order():
    source = PresetSource({"a.weight": (2,), "b.weight": (2,)}, {}, seed=0)
    source.read("b.weight")
    with pytest.raises(RuntimeError, match="read after a later tensor"):
        source.read("a.weight")


def test_fp8_slices_dequantise_like_the_whole_tensor(tmp_path):
    from safetensors.torch import save_file

    w = torch.randn(300, 200, generator=torch.Generator().manual_seed(1))
    q, s = quantize_fp8(w, (64, 64))
    save_file({"x.weight": q, "x.weight_scale_inv": s}, str(tmp_path / "model.safetensors"))
    cfg = CFG.replace(extra={"quantization_config": {"weight_block_size": [64, 64]}})
    whole = dequantize_fp8(q, s, (64, 64))
    with CheckpointSource(tmp_path, cfg) as source:
        assert torch.equal(source.read("x.weight"), whole)
        for index in [(slice(70, 150),), (slice(None), slice(33, 190)), (slice(5, 299), slice(64, 128))]:
            assert torch.equal(source.read("x.weight", index), whole[index]), index


def test_file_views_are_zero_copy(checkpoint):
    f = SafetensorsFile(checkpoint / "model.safetensors")
    name = "model.embed_tokens.weight"
    view = f.view(name)
    assert view.shape == (CFG.vocab_size, CFG.hidden_size) and view.untyped_storage().nbytes() == view.nbytes


@pytest.mark.parametrize("layout", ["tp", "dp"])
def test_a_push_cut_per_rank_lands_where_the_whole_push_lands(checkpoint, layout):
    push = MLAForCausalLM.from_config(CFG, seed=9).state_dict()
    ranks = []
    for rank in range(2):
        with CheckpointSource(checkpoint) as source:
            ranks.append([load(CFG, source, _share(layout, rank, 2, "sharded"), torch.float32,
                               torch.device("cpu"), comm=None) for _ in range(2)])
    held = [held_parts(rank_targets(w.model, w.shards)) for w, _ in ranks]
    buckets = list(cut_push(push, held, bucket_bytes=64 << 10))
    assert len(buckets) > 1  # bounded buckets
    for rank, (by_parts, by_whole) in enumerate(ranks):
        apply_update(rank_targets(by_whole.model, by_whole.shards), push)
        sent = [part for round_ in buckets for part in round_[rank]]
        assert sum(p.numel() * p.element_size() for _, _, p in sent) < 0.75 * sum(
            t.numel() * t.element_size() for t in push.values())
        for round_ in buckets:
            apply_parts(rank_targets(by_parts.model, by_parts.shards), round_[rank])
        a, b = _tensors(by_parts), _tensors(by_whole)
        assert all(torch.equal(x, y) for n in b for x, y in zip(a[n], b[n]))
