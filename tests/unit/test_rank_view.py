"""RankView: local heads and storage per layout."""
import pytest

from splash_rollout.layout import Layout
from splash_rollout.layout.rank_view import RankView


def test_heads_follow_placement():
    assert RankView(Layout.TP, 1, 4, 8).head_slice == slice(2, 4)
    assert RankView(Layout.DOP, 3, 4, 8).local_heads == 2
    assert RankView(Layout.DP, 1, 4, 8).head_slice == slice(0, 8)
    assert RankView(Layout.CP, 0, 4, 8).local_heads == 8
    assert RankView(Layout.DP, 1, 4, 8).head_slice_of(2) == slice(4, 6)


def test_storage_follows_ownership():
    assert RankView(Layout.TP, 1, 2, 8).stores_page(5, owner=0)
    dop = RankView(Layout.DOP, 1, 2, 8)
    assert dop.stores_request(1) and not dop.stores_request(0) and dop.page_rank(7, owner=0) == 0
    cp = RankView(Layout.CP, 1, 4, 8)
    assert [cp.page_rank(p, owner=0) for p in range(6)] == [0, 1, 2, 3, 0, 1]
    assert cp.stores_page(5, owner=0) and not cp.stores_page(4, owner=1)


def test_bad_views():
    with pytest.raises(ValueError, match="must be divisible"):
        RankView(Layout.TP, 0, 3, 8)
    with pytest.raises(ValueError, match="rank"):
        RankView(Layout.TP, 2, 2, 8)
