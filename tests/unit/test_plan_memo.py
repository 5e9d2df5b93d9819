"""The memo of plans for repeated call shapes, and what may key it."""
from __future__ import annotations

import numpy as np
import pytest

from datadist import CacheDesc, DataType, Placement
from datadist._objects import Cache
from datadist._planning import shape_key
from datadist.engine.layout import PlanMemo, plan_units
from datadist.engine.transports.base import RemoteCache

pytestmark = pytest.mark.timeout(30)


def _remote(epoch: int, cache_id: int = 7) -> RemoteCache:
    return RemoteCache(cache_id=cache_id, row=0, num_tensors=2, tensor_size=4096, batch_size=4, is_blocks=True,
                       dtype="DT_UINT8", addrs=np.array([0x1000, 0x3000], np.uint64), epoch=epoch)


def _local() -> Cache:
    desc = CacheDesc(num_tensors=2, shape=[4, 1024], data_type=DataType.DT_UINT8, placement=Placement.HOST)
    return Cache.create_cpu_cache(desc, [np.zeros(4096, np.uint8).ctypes.data for _ in range(2)])


def test_the_memo_keeps_the_most_recently_used_plans() -> None:
    memo = PlanMemo(capacity=2)
    plans = [plan_units([0], [i], [0], [i], 8) for i in range(3)]
    memo.put("a", plans[0])
    memo.put("b", plans[1])
    assert memo.get("a") is plans[0]       # "a" is now the most recent
    memo.put("c", plans[2])                # so "b" goes
    assert memo.get("b") is None and memo.get("a") is plans[0] and memo.get("c") is plans[2] and len(memo) == 2


def test_a_key_names_both_caches_the_lookup_epoch_and_the_shape() -> None:
    local = _local()
    key = shape_key("push_blocks", local, _remote(1), [0, 1], [2, 3], None, None, 2)
    assert key == shape_key("push_blocks", local, _remote(1), (0, 1), (2, 3), None, None, 2)
    assert key != shape_key("push_blocks", local, _remote(2), [0, 1], [2, 3], None, None, 2)   # peer changed
    assert key != shape_key("push_blocks", local, _remote(1, cache_id=8), [0, 1], [2, 3], None, None, 2)
    assert key != shape_key("pull_blocks", local, _remote(1), [0, 1], [2, 3], None, None, 2)
    assert key != shape_key("push_blocks", local, _remote(1), [0, 1], [2, 3], range(0, 1), None, 2)
    assert key != shape_key("push_blocks", _local(), _remote(1), [0, 1], [2, 3], None, None, 2)  # another cache


@pytest.mark.parametrize("blocks", [[1.0], [True], np.array([1]), list(range(2000)), "ab"])
def test_unusual_block_lists_are_never_remembered(blocks: object) -> None:
    # They go through full validation every time: 1.0 must not find the plan of [1].
    assert shape_key("push_blocks", _local(), _remote(1), blocks, [0], None, None, 2) is None
    assert shape_key("push_blocks", _local(), _remote(1), [0], [0], None, None, [2]) is None
