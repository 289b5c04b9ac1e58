"""The progress bar of a single-rank generate call: drawn when EngineConfig.progress is on, silent
when off; it counts requests up to the total."""
from splash_rollout import EngineConfig, RolloutEngine, SamplingParams
from splash_rollout.rollout.progress import progress_enabled

PARAMS = SamplingParams(n=2, temperature=1.0, max_new_tokens=5, seed=1, ignore_eos=True)


def test_single_rank_bar_counts_requests_to_the_total(capsys):
    with RolloutEngine(EngineConfig(model="glm5-nano", num_pages=64, page_size=8, progress=True)) as engine:
        engine.generate([[5, 6, 7], [8, 9]], PARAMS)
    err = capsys.readouterr().err
    assert "4/4" in err and "tok/s" in err
    with RolloutEngine(EngineConfig(model="glm5-nano", num_pages=64, page_size=8, progress=False)) as engine:
        engine.generate([[5, 6, 7], [8, 9]], PARAMS)
    assert capsys.readouterr().err == ""


def test_default_follows_whether_stderr_is_a_terminal():
    assert progress_enabled(True) and not progress_enabled(False)
    assert progress_enabled(None) is False  # pytest captures stderr: not a terminal
