"""Sampler: greedy, truncation, per-sample generators, and the logprob convention."""
import torch

from splash_rollout.engine.request import SamplingSpec
from splash_rollout.engine.sampler import _truncate, sample


def _gens(*seeds):
    return [torch.Generator().manual_seed(s) for s in seeds]


def test_greedy_is_argmax_with_untempered_logprob():
    logits = torch.randn(3, 50)
    toks, lps = sample(logits, [SamplingSpec(temperature=0.0)] * 3, _gens(0, 1, 2))
    assert torch.equal(toks, logits.argmax(-1))
    assert torch.allclose(lps, torch.log_softmax(logits, -1).gather(1, toks[:, None]).squeeze(1))


def test_logprob_is_tempered_and_before_truncation():
    logits = torch.randn(4, 30)
    specs = [SamplingSpec(temperature=0.7, top_p=0.5), SamplingSpec(temperature=1.3, top_k=3),
             SamplingSpec(temperature=1.0, min_p=0.2), SamplingSpec(temperature=2.0)]
    toks, lps = sample(logits, specs, _gens(1, 2, 3, 4))
    for i, s in enumerate(specs):
        ref = torch.log_softmax(logits[i] / s.temperature, -1)[toks[i]]
        assert abs(float(lps[i]) - float(ref)) < 1e-6


def test_truncation_rules():
    p = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05])
    assert (_truncate(p, SamplingSpec(top_k=2)) > 0).tolist() == [True, True, False, False, False]
    assert (_truncate(p, SamplingSpec(top_p=0.7)) > 0).tolist() == [True, True, False, False, False]
    assert (_truncate(p, SamplingSpec(top_p=0.71)) > 0).tolist() == [True, True, True, False, False]
    assert (_truncate(p, SamplingSpec(top_p=0.01)) > 0).tolist() == [True, False, False, False, False]
    assert (_truncate(p, SamplingSpec(min_p=0.3)) > 0).tolist() == [True, True, True, False, False]


def test_samples_stay_inside_truncated_support():
    torch.manual_seed(0)
    logits = torch.randn(1, 64)
    spec = SamplingSpec(temperature=1.0, top_k=5)
    allowed = set(torch.topk(logits[0], 5).indices.tolist())
    g = _gens(7)
    for _ in range(200):
        tok, _ = sample(logits, [spec], g)
        assert int(tok) in allowed


def test_tokens_independent_of_batch_composition():
    torch.manual_seed(0)
    logits = torch.randn(5, 40)
    spec = SamplingSpec(temperature=1.0, top_p=0.9)
    alone = [int(sample(logits[2:3], [spec], _gens(42))[0]) for _ in range(1)]
    batched, _ = sample(logits, [spec] * 5, _gens(1, 2, 42, 3, 4))
    assert int(batched[2]) == alone[0]
    # and repeated draws follow the seed's stream, not the batch
    (g1,), (g2,) = _gens(9), _gens(9)
    a = [int(sample(logits[:1], [spec], [g1])[0]) for _ in range(20)]
    b = [int(sample(logits[[0, 3]], [spec, spec], [g2, torch.Generator().manual_seed(5)])[0][0]) for _ in range(20)]
    assert a == b


def test_empirical_distribution_matches_softmax():
    logits = torch.tensor([[1.0, 0.0, -1.0, 2.0]])
    g = _gens(0)
    counts = torch.zeros(4)
    for _ in range(4000):
        counts[int(sample(logits, [SamplingSpec(temperature=1.0)], g)[0])] += 1
    assert torch.allclose(counts / 4000, torch.softmax(logits[0], -1), atol=0.03)
