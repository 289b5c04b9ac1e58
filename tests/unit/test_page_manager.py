"""PageManager: allocate / share / free bookkeeping never leaks or double-hands a page."""
import pytest
from hypothesis import given, settings, strategies as st

from splash_rollout.engine.page_manager import PageManager, num_pages_for


def test_num_pages_for():
    assert [num_pages_for(n, 16) for n in (0, 1, 16, 17, 32, 33)] == [0, 1, 1, 2, 2, 3]


def test_allocate_free_roundtrip():
    pm = PageManager(8, 16)
    assert pm.can_allocate(8) and not pm.can_allocate(9)
    a = pm.allocate(3)
    b = pm.allocate(5)
    assert sorted(a + b) == list(range(8))
    assert pm.num_free == 0 and not pm.can_allocate(1)
    with pytest.raises(RuntimeError):
        pm.allocate(1)
    pm.free(a)
    assert pm.num_free == 3
    with pytest.raises(RuntimeError, match="not allocated"):
        pm.free(a)
    pm.free(b)
    assert pm.num_free == 8 and pm.num_used == 0


def test_shared_pages_return_when_the_last_reference_drops():
    pm = PageManager(4, 4)
    prompt = pm.allocate(2)
    pm.share(prompt)
    pm.share(prompt[:1])
    assert pm.num_used == 2 and pm.num_references == 5 and pm.num_free == 2
    pm.free(prompt)
    assert pm.num_used == 2 and pm.refs(prompt[0]) == 2 and pm.refs(prompt[1]) == 1
    pm.free(prompt)
    assert pm.num_used == 1 and pm.num_free == 3
    pm.free(prompt[:1])
    assert pm.num_used == 0 and pm.num_free == 4
    with pytest.raises(RuntimeError, match="not allocated"):
        pm.share(prompt[:1])


def test_bad_sizes():
    with pytest.raises(ValueError, match="num_pages"):
        PageManager(0, 16)
    with pytest.raises(ValueError, match="page_size"):
        PageManager(4, 0)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=6), min_size=1, max_size=30))
def test_random_sequence_conserves_pages(sizes):
    pm = PageManager(12, 2)
    held: list[list[int]] = []
    for i, n in enumerate(sizes):
        if pm.can_allocate(n):
            held.append(pm.allocate(n))
        elif held:
            pm.free(held.pop(i % len(held)))
        flat = [p for h in held for p in h]
        assert len(flat) == len(set(flat)) == pm.num_used
        assert pm.num_used + pm.num_free == 12
    for h in held:
        pm.free(h)
    assert pm.num_free == 12
