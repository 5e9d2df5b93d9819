"""Call forms: binding, exclusivity, per-form validation, keys and token hashing."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from ems import CcConfig_v1, CcKvOption, KvBufferWrapper, PrimaryKey
from ems._errors import InvalidArgument
from ems.forms import CHUNK, HASH, TOKEN, V0, parse_exists, parse_transfer
from ems.keys import Namespace, token_chain_hashes
from ems.kvcache import KvLayout

NS = Namespace("tenant", CcConfig_v1(rank_id=0, device_id=0, model_id="m").layout())


@pytest.fixture
def layout():
    kv = [[torch.zeros(4, 4, 2, 4) for _ in range(2)] for _ in range(3)]
    return KvLayout(kv, [[0, 1], [2]], "MHA")


def parse(layout, *args, **kwargs):
    return parse_transfer("save", args, kwargs, NS, layout)


def bad(layout, name, *args, **kwargs):
    with pytest.raises(InvalidArgument) as ei:
        parse(layout, *args, **kwargs)
    assert f"'{name}'" in str(ei.value), str(ei.value)


def test_hash_form_positional_and_keyword(layout):
    req = parse(layout, list(range(8)), [1, 2], [4, 4], CcKvOption())
    assert req.form == HASH and req.total == 2
    tb = 2 * 4 * 4
    assert req.values[0].size == 6 * 4 * tb
    req = parse(layout, slot_mapping=np.arange(8), hashes=np.array([1, 2]), offsets=torch.tensor([3, 5]))
    assert [v.size for v in req.values] == [6 * 3 * tb, 6 * 5 * tb]


def test_hash_form_errors(layout):
    bad(layout, "offsets", slot_mapping=list(range(6)), hashes=[1, 2], offsets=[4, 4])
    bad(layout, "offsets", slot_mapping=list(range(8)), hashes=[1], offsets=[4, 4])
    bad(layout, "offsets", slot_mapping=list(range(8)), hashes=[1, 2], offsets=[8, 0])
    bad(layout, "slot_mapping", slot_mapping=[], hashes=[1], offsets=[1])
    bad(layout, "slot_mapping", slot_mapping=[0, 99], hashes=[1], offsets=[2])
    bad(layout, "slot_mapping", slot_mapping=[0, -1], hashes=[1], offsets=[2])
    bad(layout, "slot_mapping", slot_mapping=[0.0, 1.0], hashes=[1], offsets=[2])
    bad(layout, "hashes", slot_mapping=[0, 1], hashes=[True], offsets=[2])
    bad(layout, "hashes", slot_mapping=[0, 1], hashes="ab", offsets=[2])
    bad(layout, "offsets", slot_mapping=[0, 1], hashes=[1])
    bad(layout, "option", slot_mapping=[0, 1], hashes=[1], offsets=[2], option=5000)
    bad(layout, "args", 1, 2, 3, 4, 5)
    bad(layout, "hashes", [0, 1], [1], [2], hashes=[1])


def test_v0_form_with_option_none_names_option(layout):
    """The vendor: the V0 form's option must not be None (not read as a hash form call)."""
    t = torch.zeros(4)
    for args in ((None, ["a"], [[KvBufferWrapper(t.data_ptr, 16)]]), (None, [PrimaryKey("d", "a")], [])):
        bad(layout, "option", *args)
        bad(None, "option", *args)


def test_forms_are_exclusive(layout):
    bad(layout, "hashes", slot_mapping=[0, 1], hashes=[1], offsets=[2], token_ids=[1, 2])
    bad(layout, "slot_mapping", hashes=[1], chunk_descs=[[(0, 4)], [(0, 4)]], slot_mapping=[0])
    bad(layout, "hashes", CcKvOption(), ["a"], [[KvBufferWrapper(8, 4)]], hashes=[1])
    bad(layout, "tonken_ids", slot_mapping=[0], tonken_ids=[1])
    bad(layout, "hashes")
    bad(layout, "token_ids", slot_mapping=[0, 1], mask=[1, 1])


def test_token_form(layout):
    req = parse(layout, slot_mapping=list(range(10)), token_ids=list(range(100, 110)))
    assert req.form == TOKEN and req.total == 2  # the trailing 2 tokens are not a full chunk
    req = parse(layout, slot_mapping=list(range(10)), token_ids=list(range(100, 110)), mask=[0] * 4 + [1] * 6)
    assert req.total == 1  # chunk 0 is the cached prefix
    full = token_chain_hashes(np.arange(100, 110), 4)
    assert req.keys == NS.hash_keys(full[1:2])
    bad(layout, "mask", slot_mapping=list(range(8)), token_ids=list(range(8)), mask=[1] * 7)
    bad(layout, "mask", slot_mapping=list(range(8)), token_ids=list(range(8)), mask=[1, 0] * 4)
    bad(layout, "mask", slot_mapping=list(range(8)), token_ids=list(range(8)), mask=[2] * 8)
    bad(layout, "token_ids", slot_mapping=list(range(8)), token_ids=list(range(7)))


@pytest.mark.parametrize("mask", [
    [False] * 4 + [True] * 6, (False,) * 4 + (True,) * 6, np.array([False] * 4 + [True] * 6),
    torch.tensor([False] * 4 + [True] * 6), torch.tensor([0] * 4 + [1] * 6)])
def test_token_form_mask_of_bools(layout, mask):
    """The vendor describes mask as a False prefix and a True suffix: bools are 0 and 1."""
    req = parse(layout, slot_mapping=list(range(10)), token_ids=list(range(100, 110)), mask=mask)
    assert req.keys == NS.hash_keys(token_chain_hashes(np.arange(100, 110), 4)[1:2])


def test_token_form_mask_of_bools_still_checked(layout):
    bad(layout, "mask", slot_mapping=list(range(8)), token_ids=list(range(8)), mask=[True, False] * 4)
    bad(layout, "mask", slot_mapping=list(range(8)), token_ids=list(range(8)), mask=[True] * 7)
    bad(layout, "mask", slot_mapping=list(range(8)), token_ids=list(range(8)), mask=[[True]] * 8)


def test_a_hash_repeated_in_one_save_is_refused(layout):
    """As V0 refuses a repeated key: one key cannot take two values in one call."""
    for hashes in ([5, 5], [7, 5, 5], np.array([3, 3]), [b"\x01", 2, b"\x01"]):
        with pytest.raises(InvalidArgument) as ei:
            parse(layout, slot_mapping=list(range(4 * len(hashes))), hashes=hashes, offsets=[4] * len(hashes))
        i = len(hashes) - 1
        assert f"'hashes[{i}]'" in str(ei.value) and repr(list(np.asarray(hashes, dtype=object).tolist())[i]) in str(ei.value), str(ei.value)
    descs = [[(0, 4), (4, 4)], [(8, 2), (10, 3)]]
    with pytest.raises(InvalidArgument, match=r"'hashes\[1\]'.*duplicate hash 9"):
        parse_transfer("async_save", (), dict(hashes=[9, 9], chunk_descs=descs), NS, layout)
    assert parse(layout, slot_mapping=list(range(8)), hashes=[1, b"\x01"], offsets=[4, 4]).total == 2
    # A load may fill two places from one key.
    assert parse_transfer("load", (), dict(hashes=[9, 9], chunk_descs=descs), NS, layout).total == 2
    assert parse_transfer("async_load", (list(range(8)), [5, 5], [4, 4]), {}, NS, layout).total == 2


def test_int_and_bytes_hashes_have_distinct_keys():
    ints = [0xB01, 0xB, 0xBAB, -1, 1]
    blobs = [b"\x01", b"", b"\xab", b"-1", b"\x00\x01"]
    keys = NS.hash_keys(ints + blobs)
    assert len(set(keys)) == len(keys)
    assert NS.hash_keys(ints) == keys[:len(ints)]  # the all-int path builds the same keys


def test_token_hashes_are_chained_and_deterministic():
    a = token_chain_hashes(np.array([1, 2, 3, 4, 5, 6, 7, 8]), 4)
    b = token_chain_hashes(np.array([9, 2, 3, 4, 5, 6, 7, 8]), 4)
    assert a == token_chain_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4)
    assert a[0] != b[0] and a[1] != b[1]  # the second chunk's hash depends on the prefix
    assert len(token_chain_hashes(np.arange(7), 4)) == 1


def test_chunk_form(layout):
    req = parse(layout, hashes=[1, 2], chunk_descs=[[(0, 4), (4, 4)], [(8, 2), (10, 3)]])
    assert req.form == CHUNK
    tb = 32
    assert [v.size for v in req.values] == [4 * 4 * tb + 2 * 2 * tb, 4 * 4 * tb + 2 * 3 * tb]
    bad(layout, "chunk_descs", hashes=[1, 2], chunk_descs=[[(0, 4), (4, 4)]])
    bad(layout, "chunk_descs", hashes=[1, 2], chunk_descs=[[(0, 4)], [(0, 4)]])
    bad(layout, "chunk_descs", hashes=[1], chunk_descs=[[(0, 0)], [(0, 4)]])
    bad(layout, "chunk_descs", hashes=[1], chunk_descs=[[(14, 4)], [(0, 4)]])
    bad(layout, "chunk_descs", hashes=[1], chunk_descs=[[(0, "4")], [(0, 4)]])


def test_v0_form():
    req = parse(None, CcKvOption(), [PrimaryKey("1", "123"), "k2"],
                [[KvBufferWrapper(4096, 8), KvBufferWrapper(8192, 8)], [KvBufferWrapper(16, 4)]])
    assert req.form == V0 and [v.size for v in req.values] == [16, 4]
    bad(None, "value_list", CcKvOption(), ["a"], [])
    bad(None, "key_list[1]", CcKvOption(), ["a", "a"], [[KvBufferWrapper(8, 4)], [KvBufferWrapper(8, 4)]])
    bad(None, "key_list[0]", CcKvOption(), ["x" * 128], [[KvBufferWrapper(8, 4)]])
    bad(None, "key_list[0]", CcKvOption(), [3], [[KvBufferWrapper(8, 4)]])
    bad(None, "value_list[0][0]", CcKvOption(), ["a"], [[(8, 4)]])
    bad(None, "key_list", CcKvOption(), [], [])
    bad(None, "kvcache", slot_mapping=[0], hashes=[1], offsets=[1])  # not registered


def test_exists_parsing(layout):
    keys, opt = parse_exists(([1, 2],), {}, NS, None)
    assert keys.strings() == NS.hash_keys([1, 2]) and len(keys) == 2 and opt.timeout == 5000
    assert parse_exists(([],), {}, NS, None)[0].strings() == []
    keys, _ = parse_exists((), {"token_ids": list(range(8))}, NS, layout)
    assert keys.strings() == NS.hash_keys(token_chain_hashes(np.arange(8), 4))
    keys, _ = parse_exists(([b"\x01", 7],), {}, NS, None)
    assert keys.strings() == NS.hash_keys([b"\x01", 7])
    for args, kwargs in (((), {}), (("x",), {}), (([1],), {"bogus": 1}), (([1], 5), {})):
        with pytest.raises(InvalidArgument):
            parse_exists(args, kwargs, NS, None)


def test_register_validation():
    with pytest.raises(InvalidArgument, match="kvcache"):
        KvLayout([], None, "MHA")
    with pytest.raises(InvalidArgument, match="kvcache"):
        KvLayout([[torch.zeros(2, 4, 1, 1)]], None, "MHA")  # one tensor per layer: MLA only
    KvLayout([[torch.zeros(2, 4, 1, 1)]], None, "MLA")
    KvLayout([[torch.zeros(2, 4, 1, 1), torch.zeros(2, 4, 1, 2)]], None, "MHA")  # K, V of two widths
    with pytest.raises(InvalidArgument, match="differs"):  # but every layer repeats layer 0
        KvLayout([[torch.zeros(2, 4, 1, 1), torch.zeros(2, 4, 1, 2)]] * 2
                 + [[torch.zeros(2, 4, 1, 2), torch.zeros(2, 4, 1, 1)]], None, "MHA")
    with pytest.raises(InvalidArgument, match="contiguous"):
        KvLayout([[torch.zeros(2, 4, 1, 2)[..., :1], torch.zeros(2, 4, 1, 1)]], None, "MHA")
    with pytest.raises(InvalidArgument, match="store_layer_group_desc"):
        KvLayout([[torch.zeros(2, 4, 1, 1)] * 2], [[0], [0]], "MHA")
    six = torch.zeros(2, 2, 3, 4, 1, 1)
    assert KvLayout(six, None, "MHA").num_tensors == 4


def test_keys_namespace_tenant_model_engine_layout_type():
    def ns(access=None, **kw):
        base = dict(rank_id=0, device_id=0, model_id="m")
        return Namespace(access, CcConfig_v1(**{**base, **kw}).layout()).hash_keys([7])[0]
    variants = [ns(), ns("t2"), ns(model_id="m2"), ns(llm_engine="sglang"), ns(kvcache_type="MLA"),
                ns(tp_world_size=2), ns(tp_world_size=2, rank_in_tp_group=1), ns(pp_world_size=2)]
    assert len(set(variants)) == len(variants)
    # ranks of one layout share the distribute part (the remote tier's hash tag)
    assert ns(tp_world_size=2).split("\x00")[0] == ns(tp_world_size=2, rank_in_tp_group=1).split("\x00")[0]
