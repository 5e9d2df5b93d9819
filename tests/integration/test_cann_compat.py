"""Where CANN's llm_datadist and our first reading of it differed, the real package wins:
each test here pins one such behaviour, against real engine processes.

- transfers from any role (a DECODER pushes, a PROMPT pulls);
- ``tensor_num_per_layer`` matters only with layer ranges;
- empty block lists are refused; ``push_blocks`` needs a blocks-registered destination;
- ``switch_role`` listens where the new role needs and frees the old address at once, and
  twenty switches leave no socket, descriptor or thread behind;
- ``init`` on a running engine does nothing, a finalized engine can be initialized again;
- ``remap_registered_memory`` checks its entries against registered memory.
"""
from __future__ import annotations

import socket
from typing import Any

import numpy as np
import pytest

from datadist import LLMStatusCode as S
from harness import (DECODER_ID, PROMPT_ID, Desc, Key, Pair, PairHolder, Ref, base_config, blocks_key,
                     expect_blocks, expect_llm, free_port, id_key)

pytestmark = pytest.mark.timeout(90)

BLOCKS = Desc(4, (6, 8, 32), "fp16")   # 2 layers of K,V; 6 blocks of 512 bytes
ONE = Desc(1, (6, 8, 32), "fp16")      # a one-tensor blocks cache, as CANN's pull samples use
ROWS = Desc(4, (2, 256), "fp16")


@pytest.fixture(scope="module", params=("shm", "tcp"))
def pair_holder(request: pytest.FixtureRequest) -> Any:
    """This module's linked pair, over the same-host and the socket transport."""
    holder = PairHolder(request.param)
    yield holder
    holder.close()


def test_decoder_pushes_and_prompt_pulls(pair: Pair) -> None:
    p, d = pair.peers()
    p.alloc("pblocks", BLOCKS, blocks=True, bkey=blocks_key(PROMPT_ID, 3))
    d.alloc("dblocks", BLOCKS, blocks=True, bkey=blocks_key(DECODER_ID, 3))
    pdata = p.fill("pblocks", BLOCKS, 11)
    ddata = d.fill("dblocks", BLOCKS, 12)
    d.cm("push_blocks", blocks_key(PROMPT_ID, 3), Ref("dblocks"), [0, 1], [4, 5])
    pdata = expect_blocks(pdata, ddata, [0, 1], [4, 5], BLOCKS.row_bytes)
    np.testing.assert_array_equal(p.read("pblocks"), pdata)
    p.cm("pull_blocks", blocks_key(DECODER_ID, 3), Ref("pblocks"), [2, 3], [0, 1])
    np.testing.assert_array_equal(p.read("pblocks"), expect_blocks(pdata, ddata, [2, 3], [0, 1], BLOCKS.row_bytes))


def test_one_tensor_cache_with_default_tensor_num_per_layer(pair: Pair) -> None:
    p, d = pair.peers()
    p.alloc("one", ONE, blocks=True, bkey=blocks_key(PROMPT_ID, 4))
    d.alloc("one", ONE, blocks=True, bkey=blocks_key(DECODER_ID, 4))
    src = p.fill("one", ONE, 21)
    dst = d.fill("one", ONE, 22)
    d.cm("pull_blocks", blocks_key(PROMPT_ID, 4), Ref("one"), [0, 1], [0, 2])  # N = 2 by default
    dst = expect_blocks(dst, src, [0, 1], [0, 2], ONE.row_bytes)
    np.testing.assert_array_equal(d.read("one"), dst)
    d.cm("push_blocks", blocks_key(PROMPT_ID, 4), Ref("one"), [5], [5], tensor_num_per_layer=7)
    np.testing.assert_array_equal(p.read("one"), expect_blocks(src, dst, [5], [5], ONE.row_bytes))
    with expect_llm(S.LLM_PARAM_INVALID):  # with layer ranges N must still fit the cache
        d.cm("pull_blocks", blocks_key(PROMPT_ID, 4), Ref("one"), [0], [0], src_layer_range=range(0, 1),
             dst_layer_range=range(0, 1))


def test_empty_block_lists_and_contiguous_push_destination_are_refused(pair: Pair) -> None:
    p, d = pair.peers()
    p.alloc("src", BLOCKS, blocks=True, bkey=blocks_key(PROMPT_ID, 5))
    d.alloc("dst", BLOCKS, blocks=True, bkey=blocks_key(DECODER_ID, 5))
    rows = d.alloc("rows", ROWS)
    before = d.fill("dst", BLOCKS, 31)
    rows_before = d.fill("rows", ROWS, 32)
    with expect_llm(S.LLM_PARAM_INVALID):
        d.cm("pull_blocks", blocks_key(PROMPT_ID, 5), Ref("dst"), [0], [])
    with expect_llm(S.LLM_PARAM_INVALID):
        d.cm("pull_blocks", blocks_key(PROMPT_ID, 5), Ref("dst"), [], [0])
    with expect_llm(S.LLM_PARAM_INVALID):
        p.cm("push_blocks", blocks_key(DECODER_ID, 5), Ref("src"), [], [])
    with expect_llm(S.LLM_PARAM_INVALID) as seen:  # a contiguous cache is push_cache's
        p.cm("push_blocks", id_key(DECODER_ID, rows["cache_id"]), Ref("src"), [0], [0])
    assert "not a blocks cache" in seen[0].message
    np.testing.assert_array_equal(d.read("dst"), before)
    np.testing.assert_array_equal(d.read("rows"), rows_before)


def _port_is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def test_switch_role_hands_its_address_over_and_leaks_nothing(peer_factory: Any) -> None:
    port = free_port()
    peer = peer_factory("peer", "p", "PROMPT", PROMPT_ID, base_config("shm", listen_port=port))
    listen = {"llm.listenIpInfo": f"127.0.0.1:{port}"}
    peer.call("engine", "switch_role", Key("LLMRole", (2,)))  # warm: first switch may import
    peer.call("engine", "switch_role", Key("LLMRole", (1,)), listen)
    before = peer.snapshot()
    for _ in range(20):
        peer.call("engine", "switch_role", Key("LLMRole", (2,)))
        assert _port_is_free(port), "a DECODER must not keep the PROMPT's listening address"
        peer.call("engine", "switch_role", Key("LLMRole", (1,)), listen)
        assert not _port_is_free(port)
    after = peer.snapshot()
    assert len(after["fds"]) == len(before["fds"]), (before["fds"], after["fds"])
    assert after["threads"] == before["threads"]
    # still serving there: a decoder links and pulls
    dec = peer_factory("peer", "d", "DECODER", DECODER_ID, base_config("shm"))
    peer.alloc("src", BLOCKS, blocks=True, bkey=blocks_key(PROMPT_ID, 6))
    dec.alloc("dst", BLOCKS, blocks=True)
    data = peer.fill("src", BLOCKS, 41)
    base = dec.fill("dst", BLOCKS, 42)
    dec.link(peer, port=port)
    dec.cm("pull_blocks", blocks_key(PROMPT_ID, 6), Ref("dst"), [1], [1])
    np.testing.assert_array_equal(dec.read("dst"), expect_blocks(base, data, [1], [1], BLOCKS.row_bytes))


def test_init_twice_is_a_no_op_and_finalized_engines_init_again(peer_factory: Any) -> None:
    port = free_port()
    peer = peer_factory("peer", "p", "PROMPT", PROMPT_ID, base_config("shm", listen_port=port))
    options = {"llm.listenIpInfo": f"127.0.0.1:{port}", "llm.MemPoolConfig": '{"memory_size": 1048576}'}
    peer.call("engine", "init", options)  # running: nothing changes, no error
    peer.call("finalize")
    with expect_llm(S.LLM_ENGINE_FINALIZED):
        peer.alloc("a", BLOCKS, blocks=True)
    peer.call("engine", "init", options)  # as serving adapters do after a finalize
    peer.alloc("src", BLOCKS, blocks=True, bkey=blocks_key(PROMPT_ID, 7))
    data = peer.fill("src", BLOCKS, 51)
    dec = peer_factory("peer", "d", "DECODER", DECODER_ID, base_config("shm"))
    dec.alloc("dst", BLOCKS, blocks=True)
    base = dec.fill("dst", BLOCKS, 52)
    dec.link(peer, port=port)
    dec.cm("pull_blocks", blocks_key(PROMPT_ID, 7), Ref("dst"), [0, 3], [3, 0])
    np.testing.assert_array_equal(dec.read("dst"), expect_blocks(base, data, [0, 3], [3, 0], BLOCKS.row_bytes))


def test_remap_registered_memory_checks_its_entries(peer_factory: Any) -> None:
    peer = peer_factory("peer", "p", "PROMPT", PROMPT_ID, base_config("shm"))
    made = peer.register("user", BLOCKS, blocks=True)
    pooled = peer.alloc("pooled", BLOCKS, blocks=True)
    addr = made["addrs"][1]
    device = Key("Memtype", (0,))

    def remap(*infos: Key) -> Any:
        return peer.cm("remap_registered_memory", list(infos))

    remap(Key("MemInfo", (device, addr, BLOCKS.tensor_bytes)))
    peer.cm("remap_registered_memory", Key("MemInfo", (device, addr + 64, 128)))  # one, not in a list
    for bad in (Key("MemInfo", (Key("Memtype", (1,)), addr, 64)),               # host memory
                Key("MemInfo", (device, addr, BLOCKS.tensor_bytes + 1)),      # past the tensor
                Key("MemInfo", (device, pooled["addrs"][0], 64)),             # pool memory, not registered
                Key("MemInfo", (device, 0, 64))):
        with expect_llm(S.LLM_PARAM_INVALID):
            remap(bad)
