"""The packed float32 path for products of more than a few rows: same products as torch's, never stale.

A packed copy is keyed by the weight tensor and must follow every way a weight changes in the
engine: an in-place update (a weight sync ``copy_``s into it), new storage (sleep and wake), and the
weight going away. Where the path does not apply (few rows, bfloat16, autograd, a view) it steps
aside and the caller takes torch's path.
"""
from __future__ import annotations

import gc

import pytest
import torch
import torch.nn.functional as F

from splash_rollout.models.numerics import Linear
from splash_rollout.models.packed_linear import MIN_ROWS, PACKED, packed_linear, set_packed_weights

pytestmark = pytest.mark.skipif(not PACKED.enabled, reason="this torch build has no oneDNN linear")


def _layer(seed: int = 0) -> Linear:
    torch.manual_seed(seed)
    return Linear(64, 48, bias=True)


@torch.no_grad()
def test_a_prefill_sized_product_equals_torchs_and_is_packed_once():
    layer = _layer()
    x = torch.randn(MIN_ROWS, 64)
    before = len(PACKED)
    y = layer(x)
    assert len(PACKED) == before + 1  # the product took the packed path
    assert torch.allclose(y, F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
    packed = PACKED.get(layer.weight)
    assert PACKED.get(layer.weight) is packed  # the same copy while the weight is unchanged
    three_d = torch.randn(2, MIN_ROWS, 64)
    assert torch.allclose(layer(three_d), F.linear(three_d, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_an_in_place_update_and_new_storage_are_followed():
    layer = _layer()
    x = torch.randn(MIN_ROWS, 64)
    layer(x)
    layer.weight.copy_(torch.randn(48, 64))  # a weight sync
    assert torch.allclose(layer(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
    layer.weight.data = torch.randn(48, 64)  # wake: the same parameter over new storage
    assert torch.allclose(layer(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)


def test_a_collected_weight_takes_its_packed_copy_with_it():
    layer = _layer()
    with torch.no_grad():
        layer(torch.randn(MIN_ROWS, 64))
    before = len(PACKED)
    del layer
    gc.collect()
    assert len(PACKED) == before - 1


def test_it_steps_aside_where_it_does_not_apply():
    layer = _layer()
    x = torch.randn(MIN_ROWS, 64)
    with torch.no_grad():
        assert packed_linear(x[: MIN_ROWS - 1], layer.weight) is None  # rows the few-rows kernel takes
        assert packed_linear(x.bfloat16(), layer.weight.bfloat16()) is None
        assert packed_linear(x, layer.weight[:32]) is None  # a view made per call
    assert packed_linear(x, layer.weight) is None  # autograd needs torch's op
    y = layer(x)
    assert y.requires_grad and torch.allclose(y, F.linear(x, layer.weight, layer.bias))


@torch.no_grad()
def test_turning_it_off_drops_every_copy():
    layer = _layer()
    x = torch.randn(MIN_ROWS, 64)
    layer(x)
    try:
        set_packed_weights(False)
        assert len(PACKED) == 0 and packed_linear(x, layer.weight) is None
        assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))
    finally:
        set_packed_weights(True)
    assert packed_linear(x, layer.weight) is not None


def test_sleep_drops_the_packed_copies_and_wake_packs_again():
    from splash_rollout.engine.kv_pool import KVPool, KVPoolSpec
    from splash_rollout.engine.sleep import release_memory, restore_memory

    layer = _layer()
    x = torch.randn(MIN_ROWS, 64)
    with torch.no_grad():
        expected = layer(x)
        pool = KVPool(KVPoolSpec(kv_lora_rank=8, qk_rope_head_dim=4, index_head_dims=(0,)), num_pages=2, page_size=4)
        offload = release_memory(pool, layer, [])
        assert len(PACKED) == 0
        restore_memory(offload, pool)
        assert torch.equal(layer(x), expected) and len(PACKED) == 1


def test_a_switch_built_inference_weight_is_packed_and_a_weight_update_drops_the_copy():
    from splash_rollout.engine.weight_update import apply_update
    from splash_rollout.models.weights import Target

    with torch.inference_mode():  # how a live switch builds a shard inside a serving step
        weight = torch.randn(48, 64)
        x = torch.randn(MIN_ROWS, 64)
        assert torch.allclose(packed_linear(x, weight), F.linear(x, weight), rtol=1e-5, atol=1e-5)
        assert PACKED.get(weight) is PACKED.get(weight)
        weight.copy_(torch.randn(48, 64))  # no version to see; the update path says so instead
    apply_update({"w": [Target(torch.zeros(2))]}, {"w": torch.ones(2)})
    with torch.inference_mode():
        assert torch.allclose(packed_linear(x, weight), F.linear(x, weight), rtol=1e-5, atol=1e-5)
