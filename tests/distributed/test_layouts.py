"""Every fixed layout on T ranks equals the single-rank engine, with either attention backend."""
import pytest

from tests.distributed.layout_cases import run_layout, single_rank

LAYOUTS = ["tp", "dp", "dop", "cp"]


@pytest.fixture(scope="module")
def oracle():
    return {m: single_rank(m) for m in ("glm5-nano", "tiny-v3")}


def _check(got, want):
    out, pages_left = got
    assert pages_left == [0] * len(pages_left)
    assert sorted(out) == sorted(want)
    for rid, (tokens, logprobs) in want.items():
        assert out[rid][0] == tokens, f"request {rid}"
        assert max(abs(a - b) for a, b in zip(out[rid][1], logprobs)) < 1e-4


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("model", ["glm5-nano", "tiny-v3"])
def test_layouts_on_two_ranks_equal_single_rank(group2, oracle, model, layout):
    _check(group2.run(run_layout, model, layout, timeout_s=300)[0], oracle[model])


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS)
def test_layouts_on_four_ranks_equal_single_rank(group4, oracle, layout):
    _check(group4.run(run_layout, "glm5-nano", layout, timeout_s=300)[0], oracle["glm5-nano"])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_sampled_runs_with_per_sample_seeds_match_in_every_layout(group2, layout):
    want = single_rank("glm5-nano", temperature=1.0)
    _check(group2.run(run_layout, "glm5-nano", layout, 1.0, timeout_s=300)[0], want)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_reference_backend_in_every_layout_equals_the_batched_single_rank(group2, oracle, layout):
    """The per-request oracle backend on two ranks gives the batched backend's single-rank tokens."""
    _check(group2.run(run_layout, "glm5-nano", layout, 0.0, "torch_ref", timeout_s=300)[0], oracle["glm5-nano"])
