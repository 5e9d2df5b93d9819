"""How a serving engine's paged KV tensors become datadist blocks-cache regions: every
layout vLLM's attention backends use, read from strides, without copying."""
from __future__ import annotations

import pytest
import torch

from datadist import DataType, Placement
from datadist.integrations.paged import block_views, paged_layout

BLOCKS = 6


def _block_bytes(t: torch.Tensor, addr: int, block: int, nbytes: int) -> bytes:
    """The bytes of ``block`` of the region at ``addr`` inside ``t``'s storage."""
    storage = t.untyped_storage()
    start = addr - storage.data_ptr() + block * nbytes
    return bytes(storage[start:start + nbytes].tolist())


def _layers(shape, n=2, dtype=torch.bfloat16, permute=None):
    out = {}
    for i in range(n):
        t = torch.randn(shape).to(dtype)
        out[f"model.layers.{i}.self_attn.attn"] = t.permute(*permute) if permute else t
    return out


def test_kv_split_layout_gives_two_regions_per_layer() -> None:
    caches = _layers((2, BLOCKS, 4, 32, 16))  # (K|V, blocks, heads, block_size, head_dim)
    layout = paged_layout(caches, BLOCKS)
    assert (layout.tensors_per_layer, layout.block_bytes, len(layout.addrs)) == (2, 4 * 32 * 16 * 2, 4)
    assert layout.data_type == DataType.DT_BF16 and layout.device == "cpu"
    desc = layout.cache_desc()
    assert desc.num_tensors == 4 and desc.shape == [BLOCKS, 4 * 32 * 16] and desc.placement == Placement.HOST
    t = caches["model.layers.1.self_attn.attn"]
    v_block_3 = t[1, 3].contiguous().view(torch.uint8).flatten().tolist()
    assert list(_block_bytes(t, layout.addrs[3], 3, layout.block_bytes)) == v_block_3


def test_mla_and_block_major_layouts_give_one_region_per_layer() -> None:
    mla = paged_layout(_layers((BLOCKS, 32, 576)), BLOCKS)
    assert (mla.tensors_per_layer, mla.block_bytes) == (1, 32 * 576 * 2)
    major = paged_layout(_layers((BLOCKS, 2, 32, 4, 16)), BLOCKS)  # K and V inside each block
    assert (major.tensors_per_layer, major.block_bytes) == (1, 2 * 32 * 4 * 16 * 2)


def test_a_permuted_view_is_read_from_its_strides() -> None:
    # memory (blocks, K|V, ...) presented as (K|V, blocks, ...): K and V share each block
    caches = _layers((BLOCKS, 2, 32, 16), permute=(1, 0, 2, 3))
    layout = paged_layout(caches, BLOCKS)
    assert (layout.tensors_per_layer, layout.block_bytes) == (1, 2 * 32 * 16 * 2)
    t = next(iter(caches.values()))
    assert layout.addrs[0] == t.data_ptr()


def test_views_alias_the_engine_memory() -> None:
    caches = _layers((2, BLOCKS, 8, 32, 16), n=1)
    layout = paged_layout(caches, BLOCKS)
    views = block_views(caches, layout)
    assert [list(v.shape) for v in views[0]] == [[BLOCKS, layout.block_bytes]] * 2
    views[0][1][4].fill_(0x3C)  # 0x3C3C is 1.0 in fp16/bf16-ish bytes; only V block 4 changes
    t = caches["model.layers.0.self_attn.attn"]
    assert bool((t[1, 4].view(torch.uint8) == 0x3C).all())
    assert not bool((t[0, 4].view(torch.uint8) == 0x3C).all())


@pytest.mark.parametrize("caches, why", [
    ({}, "no KV cache"),
    ({"a": torch.zeros(2, BLOCKS + 1, 4)}, "no dim of"),
    ({"a": torch.zeros(2, BLOCKS, 4), "b": torch.zeros(2, BLOCKS, 8)}, "layers of one cache must match"),
    ({"a": torch.zeros(2, BLOCKS, 8)[:, :, :4]}, "no dim of"),  # gaps between blocks
])
def test_unusable_layouts_are_refused_with_the_reason(caches, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        paged_layout(caches, BLOCKS)
