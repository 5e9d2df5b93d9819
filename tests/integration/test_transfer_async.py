"""``transfer_cache_async`` between engine processes (SPEC section 5, "Async."), byte for byte.

A prompt engine (server) and two decoders linked to it run for the module, once per
transport.  The prompt's synchronizer is a gate the test opens layer by layer (see
``_Gate`` in harness_child.py): a layer the test has not opened is not computed yet, so the
test decides exactly which layers may have been sent.  Destinations are checked against the
numpy model of harness_oracle.py: sent layers carry the source bytes, everything else keeps
its bytes.  A frozen and a killed decoder use processes of their own.
"""
from __future__ import annotations

import time
from typing import Any, Dict, Iterator, List, Optional

import numpy as np
import pytest

from datadist import LLMStatusCode as S
from harness import (DECODER_ID, Desc, Key, Pair, Peer, Ref, base_config, blocks_key, close_peers,
                     expect_blocks, expect_exc, expect_llm, expect_row_to_blocks, expect_rows, id_key,
                     key_config, start_pair, transfer_config)
from waiting import PACED, until

pytestmark = pytest.mark.timeout(120)

TRANSPORTS = ("shm", "tcp")
DECODER2_ID = 3
#: sync_kv_timeout of these engines (a task waits for its synchronizer without a timeout).
TIMEOUT_MS = 3000
#: How long the test waits for what a task does in the background.
WAIT_S = 20
WAIT_MS = WAIT_S * 1000

#: 8 tensors (4 layers of K,V) of 8 blocks x 16 tokens x 64 elements.
BLOCKS = Desc(8, (8, 16, 64), "fp16")
#: 8 tensors of 4 rows x 64 tokens x 64 elements: one row is 4 blocks of BLOCKS.
ROWS = Desc(8, (4, 64, 64), "fp16")
ALL = range(0, 4)
SRC_BLOCKS, DST_BLOCKS = [0, 1, 2, 3, 5], [7, 6, 5, 4, 0]


class Trio:
    """A prompt (server) with two decoders linked to it."""

    def __init__(self, pair: Pair, decoder2: Peer) -> None:
        self.prompt, self.decoder, self.decoder2 = pair.prompt, pair.decoder, decoder2

    def peers(self) -> List[Peer]:
        return [self.prompt, self.decoder, self.decoder2]


def _start_trio(transport: str, spawned: List[Peer], timeout_ms: int = TIMEOUT_MS) -> Trio:
    """Spawn a linked pair and a second decoder; every peer is appended to ``spawned``."""
    decoder2 = Peer("decoder2", "DECODER", DECODER2_ID, base_config(transport, sync_kv_timeout=timeout_ms))
    spawned.append(decoder2)
    pair = start_pair(transport, sync_kv_timeout=timeout_ms, spawned=spawned)
    decoder2.wait_ready()
    decoder2.link(pair.prompt)
    return Trio(pair, decoder2)


@pytest.fixture(scope="module", params=TRANSPORTS)
def trio_holder(request: pytest.FixtureRequest) -> Iterator[Trio]:
    """The module's engines, once per transport."""
    spawned: List[Peer] = []
    try:
        yield _start_trio(request.param, spawned)
    finally:
        close_peers(spawned)


@pytest.fixture
def trio(trio_holder: Trio) -> Iterator[Trio]:
    """The module's engines of the current transport; caches are freed afterwards."""
    yield trio_holder
    for peer in trio_holder.peers():
        peer.call("free_all")


@pytest.fixture
def own_trio() -> Iterator[Any]:
    """``make(transport, timeout_ms)``: engines of this test alone (it freezes or kills one)."""
    spawned: List[Peer] = []
    try:
        yield lambda transport, timeout_ms=TIMEOUT_MS: _start_trio(transport, spawned, timeout_ms)
    finally:
        close_peers(spawned)


# ------------------------------------------------------------------------ helpers


def _start(peer: Peer, configs: List[Key], name: str = "task", src: str = "src", **kwargs: Any) -> None:
    peer.call("transfer_async", name, src, configs, **kwargs)


def _open(peer: Peer, layers: List[int], answer: bool = True, name: str = "task") -> None:
    peer.call("open_layers", name, layers, answer)


def _synchronize(peer: Peer, timeout_ms: Optional[int], name: str = "task") -> int:
    return peer.call("task", name, "synchronize", timeout_ms)["result"]


def _results(peer: Peer, timeout_ms: Optional[int], name: str = "task") -> List[int]:
    return peer.call("task", name, "get_results", timeout_ms)["result"]


def _blocks_caches(t: Trio, seed: int, dst_peer: Optional[Peer] = None, *, register: bool = False
                   ) -> Dict[str, Any]:
    """Filled blocks caches: "src" on the prompt, "dst" on ``dst_peer`` (allocated with
    BlocksCacheKey(its cluster, 1), or registered user memory)."""
    dst_peer = dst_peer or t.decoder
    t.prompt.alloc("src", BLOCKS, blocks=True)
    made = (dst_peer.register("dst", BLOCKS, blocks=True) if register else
            dst_peer.alloc("dst", BLOCKS, blocks=True, bkey=blocks_key(dst_peer.cluster_id, 1)))
    return {"src": t.prompt.fill("src", BLOCKS, seed), "dst0": dst_peer.fill("dst", BLOCKS, seed + 1),
            "addrs": made["addrs"], "cache_id": made["cache_id"]}


def _sent_blocks(c: Dict[str, Any], layers: range) -> np.ndarray:
    """The decoder cache after SRC_BLOCKS -> DST_BLOCKS of ``layers`` arrived."""
    return expect_blocks(c["dst0"], c["src"], SRC_BLOCKS, DST_BLOCKS, BLOCKS.row_bytes,
                         src_layers=layers, dst_layers=layers)


def _with_layers(before: np.ndarray, after: np.ndarray, layers: List[int]) -> np.ndarray:
    """``before`` with the tensors of ``layers`` taken from ``after``."""
    out = before.copy()
    for layer in layers:
        out[2 * layer:2 * layer + 2] = after[2 * layer:2 * layer + 2]
    return out


def _holds(peer: Peer, name: str, want: np.ndarray) -> bool:
    return bool(np.array_equal(peer.read(name), want))


# ------------------------------------------------------------------------ layer by layer


def test_layers_are_sent_as_they_are_released(trio: Trio) -> None:
    """Nothing is sent while layers are held back and the task reports LLM_TIMEOUT; each
    released layer arrives; after the last one the task succeeds and every byte is there."""
    c = _blocks_caches(trio, 10)
    _start(trio.prompt, [key_config(blocks_key(DECODER_ID, 1), ALL, ALL)],
           src_block_indices=SRC_BLOCKS, dst_block_indices=DST_BLOCKS)
    assert _synchronize(trio.prompt, 50) == S.LLM_TIMEOUT
    assert _results(trio.prompt, 0) == [S.LLM_TIMEOUT]
    np.testing.assert_array_equal(trio.decoder.read("dst"), c["dst0"])
    for layer in ALL:
        _open(trio.prompt, [layer])
        want = _sent_blocks(c, range(0, layer + 1))
        until(lambda: _holds(trio.decoder, "dst", want), WAIT_S, f"layers 0..{layer} arrived", every=PACED)
        if layer < ALL.stop - 1:
            assert _synchronize(trio.prompt, 20) == S.LLM_TIMEOUT
    assert _synchronize(trio.prompt, None) == S.LLM_SUCCESS
    assert _results(trio.prompt, None) == [S.LLM_SUCCESS]
    np.testing.assert_array_equal(trio.decoder.read("dst"), _sent_blocks(c, ALL))


def test_refused_layer_fails_only_the_configs_that_send_it(trio: Trio) -> None:
    """synchronize_layer returns False for layer 1: the config holding layer 1 fails with
    LLM_PARAM_INVALID (layer 1 is never sent); the other config succeeds."""
    c = _blocks_caches(trio, 20)
    key = blocks_key(DECODER_ID, 1)
    _start(trio.prompt, [key_config(key, range(0, 2), range(0, 2)), key_config(key, range(2, 4), range(2, 4))],
           src_block_indices=SRC_BLOCKS, dst_block_indices=DST_BLOCKS)
    _open(trio.prompt, [0, 2, 3])
    _open(trio.prompt, [1], answer=False)
    assert _results(trio.prompt, WAIT_MS) == [S.LLM_PARAM_INVALID, S.LLM_SUCCESS]
    assert _synchronize(trio.prompt, 0) == S.LLM_PARAM_INVALID
    want = _with_layers(c["dst0"], _sent_blocks(c, ALL), [0, 2, 3])
    np.testing.assert_array_equal(trio.decoder.read("dst"), want)


def test_synchronizer_is_waited_for_without_a_timeout(trio: Trio) -> None:
    """As in CANN, synchronize_layer gets timeout_in_millis=None and the task waits as long
    as it takes: layer 3 unanswered for longer than sync_kv_timeout leaves the config that
    sends it running (LLM_TIMEOUT from get_results/synchronize with a timeout, as for any
    config still running) while the other succeeds; once layer 3 is answered, it is sent
    and the config succeeds."""
    c = _blocks_caches(trio, 30)
    key = blocks_key(DECODER_ID, 1)
    _start(trio.prompt, [key_config(key, range(0, 2), range(0, 2)), key_config(key, range(1, 4), range(1, 4))],
           src_block_indices=SRC_BLOCKS, dst_block_indices=DST_BLOCKS)
    _open(trio.prompt, [0, 1, 2])
    until(lambda: _results(trio.prompt, 0)[0] == S.LLM_SUCCESS, WAIT_S, "the first config finished", every=PACED)
    out = trio.prompt.call("task", "task", "get_results", TIMEOUT_MS + 500)  # longer than sync_kv_timeout
    assert out["result"] == [S.LLM_SUCCESS, S.LLM_TIMEOUT], out
    assert out["elapsed"] >= TIMEOUT_MS / 1000, out
    assert _synchronize(trio.prompt, 0) == S.LLM_TIMEOUT
    np.testing.assert_array_equal(trio.decoder.read("dst"), _sent_blocks(c, range(0, 3)))
    _open(trio.prompt, [3])
    assert _results(trio.prompt, WAIT_MS) == [S.LLM_SUCCESS, S.LLM_SUCCESS]
    assert _synchronize(trio.prompt, 0) == S.LLM_SUCCESS
    np.testing.assert_array_equal(trio.decoder.read("dst"), _sent_blocks(c, ALL))
    calls = [tuple(call) for call in trio.prompt.call("gate_calls", "task")]
    assert calls == [(layer, None) for layer in ALL], calls


def test_unanswered_synchronizer_holds_neither_finalize_nor_exit(own_trio: Any) -> None:
    """A synchronizer that does not answer keeps its task running, but finalize returns at
    once and the process exits cleanly (the gate would hold the layer for GATE_HOLD_S,
    longer than the teardown's exit timeout).  The task stays incomplete (LLM_TIMEOUT with
    a timeout); a layer answered after finalize fails its config with LLM_ENGINE_FINALIZED."""
    t = own_trio("shm")
    _blocks_caches(t, 35)
    config = [key_config(blocks_key(DECODER_ID, 1), ALL, ALL)]
    _start(t.prompt, config, name="late", src_block_indices=SRC_BLOCKS, dst_block_indices=DST_BLOCKS)
    _start(t.prompt, config, name="never", src_block_indices=SRC_BLOCKS, dst_block_indices=DST_BLOCKS)
    t0 = time.monotonic()
    t.prompt.call("finalize", timeout=WAIT_S)
    assert time.monotonic() - t0 < WAIT_S / 4
    assert _synchronize(t.prompt, 0, name="never") == S.LLM_TIMEOUT
    assert _results(t.prompt, 0, name="late") == [S.LLM_TIMEOUT]
    _open(t.prompt, list(ALL), name="late")
    assert _results(t.prompt, WAIT_MS, name="late") == [S.LLM_ENGINE_FINALIZED]
    assert _results(t.prompt, 0, name="never") == [S.LLM_TIMEOUT]


def test_task_timeout_argument_is_checked(trio: Trio) -> None:
    """A negative or non-int timeout of synchronize/get_results is refused."""
    _blocks_caches(trio, 40)
    _start(trio.prompt, [key_config(blocks_key(DECODER_ID, 1), ALL, ALL)],
           src_block_indices=[0], dst_block_indices=[0])
    with expect_llm(S.LLM_PARAM_INVALID):
        _synchronize(trio.prompt, -1)
    with expect_exc("TypeError"):
        _results(trio.prompt, 1.5)
    _open(trio.prompt, list(ALL))
    assert _synchronize(trio.prompt, None) == S.LLM_SUCCESS


# ------------------------------------------------------------------------ destinations


def test_two_decoders_from_one_source(trio: Trio) -> None:
    """One task feeds both decoders: a blocks key on one, raw addresses on the other."""
    c1 = _blocks_caches(trio, 50)
    made2 = trio.decoder2.alloc("dst", BLOCKS, blocks=True)
    dst2 = trio.decoder2.fill("dst", BLOCKS, 52)
    _start(trio.prompt, [key_config(blocks_key(DECODER_ID, 1), ALL, ALL),
                         transfer_config(DECODER2_ID, made2["addrs"][2:8], range(1, 4))],
           src_block_indices=SRC_BLOCKS, dst_block_indices=DST_BLOCKS)
    _open(trio.prompt, list(ALL))
    assert _results(trio.prompt, WAIT_MS) == [S.LLM_SUCCESS, S.LLM_SUCCESS]
    np.testing.assert_array_equal(trio.decoder.read("dst"), _sent_blocks(c1, ALL))
    want2 = expect_blocks(dst2, c1["src"], SRC_BLOCKS, DST_BLOCKS, BLOCKS.row_bytes,
                          src_layers=range(1, 4), dst_layers=range(1, 4))
    np.testing.assert_array_equal(trio.decoder2.read("dst"), want2)


RAW_CASES = ["rows_registered", "rows_allocated", "blocks_allocated", "blocks_registered", "row_to_blocks"]


@pytest.mark.parametrize("case", RAW_CASES)
def test_raw_destination_addresses(trio: Trio, case: str) -> None:
    """TransferConfig pushes to the peer addresses it is given: a row (addresses offset to
    the destination row, as in CANN), blocks, or a row cut into destination blocks; into
    pool memory and into registered user memory."""
    p, d = trio.prompt, trio.decoder2
    register = case.endswith("registered") or case == "row_to_blocks"
    if case.startswith("rows"):
        p.alloc("src", ROWS)
        src = p.fill("src", ROWS, 60)
        made = d.register("dst", ROWS) if register else d.alloc("dst", ROWS)
        dst0 = d.fill("dst", ROWS, 61)
        addrs = [a + 1 * ROWS.row_bytes for a in made["addrs"][2:6]]  # destination row 1, layers 1..2
        _start(p, [transfer_config(DECODER2_ID, addrs, range(1, 3), src_batch_index=2)])
        want = expect_rows(dst0, src, 2, 1, ROWS.row_bytes, src_layers=range(1, 3), dst_layers=range(1, 3))
    elif case.startswith("blocks"):
        c = _blocks_caches(trio, 62, d, register=register)
        _start(p, [transfer_config(DECODER2_ID, c["addrs"])], src_block_indices=SRC_BLOCKS,
               dst_block_indices=DST_BLOCKS)
        want = _sent_blocks(c, ALL)
    else:
        p.alloc("src", ROWS)
        src = p.fill("src", ROWS, 64)
        made = d.register("dst", BLOCKS, blocks=True)
        dst0 = d.fill("dst", BLOCKS, 65)
        _start(p, [transfer_config(DECODER2_ID, made["addrs"], src_batch_index=3)],
               dst_block_indices=[5, 1, 6, 2], dst_block_memory_size=BLOCKS.row_bytes)
        want = expect_row_to_blocks(dst0, src, 3, ROWS.row_bytes, [5, 1, 6, 2], BLOCKS.row_bytes)
    _open(p, list(ALL))
    assert _synchronize(p, WAIT_MS) == S.LLM_SUCCESS
    np.testing.assert_array_equal(d.read("dst"), want)


def test_raw_addresses_outside_every_cache_are_refused(trio: Trio) -> None:
    """A row that would run past the end of the peer's tensor: the peer refuses it
    (LLM_PARAM_INVALID) and its memory is untouched; the other config still succeeds."""
    p, d = trio.prompt, trio.decoder2
    p.alloc("src", ROWS)
    src = p.fill("src", ROWS, 70)
    made = d.register("dst", ROWS)
    dst0 = d.fill("dst", ROWS, 71)
    past_end = [a + ROWS.tensor_bytes - ROWS.row_bytes // 2 for a in made["addrs"][0:2]]
    inside = [a + 3 * ROWS.row_bytes for a in made["addrs"][2:4]]
    _start(p, [transfer_config(DECODER2_ID, past_end, range(0, 1)),
               transfer_config(DECODER2_ID, inside, range(1, 2))])
    _open(p, list(ALL))
    assert _results(p, WAIT_MS) == [S.LLM_PARAM_INVALID, S.LLM_SUCCESS]
    want = expect_rows(dst0, src, 0, 3, ROWS.row_bytes, src_layers=range(1, 2), dst_layers=range(1, 2))
    np.testing.assert_array_equal(d.read("dst"), want)


KEY_CASES = ["rows_by_id", "blocks_by_key", "row_to_blocks_by_id"]


@pytest.mark.parametrize("case", KEY_CASES)
def test_cache_key_destinations_with_layer_ranges(trio: Trio, case: str) -> None:
    """TransferWithCacheKeyConfig pushes the layers of its range into the cache its key
    names: a row by CacheKeyByIdAndIndex, blocks by BlocksCacheKey, a row cut in blocks by
    CacheKeyByIdAndIndex (a BlocksCacheKey admits only source row 0, as in CANN)."""
    p, d = trio.prompt, trio.decoder
    layers = range(1, 3)
    if case == "rows_by_id":
        p.alloc("src", ROWS)
        src = p.fill("src", ROWS, 80)
        made = d.alloc("dst", ROWS)
        dst0 = d.fill("dst", ROWS, 81)
        _start(p, [key_config(id_key(DECODER_ID, made["cache_id"], 1), layers, layers, src_batch_index=2)])
        want = expect_rows(dst0, src, 2, 1, ROWS.row_bytes, src_layers=layers, dst_layers=layers)
    elif case == "blocks_by_key":
        c = _blocks_caches(trio, 82)
        layers = range(2, 4)
        _start(p, [key_config(blocks_key(DECODER_ID, 1), layers, layers)],
               src_block_indices=SRC_BLOCKS, dst_block_indices=DST_BLOCKS)
        want = _sent_blocks(c, layers)
    else:
        p.alloc("src", ROWS)
        src = p.fill("src", ROWS, 84)
        made = d.alloc("dst", BLOCKS, blocks=True)
        dst0 = d.fill("dst", BLOCKS, 85)
        _start(p, [key_config(id_key(DECODER_ID, made["cache_id"]), layers, layers, src_batch_index=1)],
               dst_block_indices=[4, 5, 6, 7])
        want = expect_row_to_blocks(dst0, src, 1, ROWS.row_bytes, [4, 5, 6, 7], BLOCKS.row_bytes,
                                    src_layers=layers, dst_layers=layers)
    _open(p, list(ALL))
    assert _synchronize(p, WAIT_MS) == S.LLM_SUCCESS
    np.testing.assert_array_equal(d.read("dst"), want)


def test_destination_that_does_not_fit_fails_its_config(trio: Trio) -> None:
    """Checks that need the peer's cache happen per layer: a blocks source into a
    contiguous cache fails that config with LLM_PARAM_INVALID and writes nothing."""
    c = _blocks_caches(trio, 90)
    made = trio.decoder.alloc("rows", ROWS)
    rows0 = trio.decoder.fill("rows", ROWS, 91)
    _start(trio.prompt, [key_config(id_key(DECODER_ID, made["cache_id"]), ALL, ALL),
                         key_config(blocks_key(DECODER_ID, 1), ALL, ALL)],
           src_block_indices=SRC_BLOCKS, dst_block_indices=DST_BLOCKS)
    _open(trio.prompt, list(ALL))
    assert _results(trio.prompt, WAIT_MS) == [S.LLM_PARAM_INVALID, S.LLM_SUCCESS]
    np.testing.assert_array_equal(trio.decoder.read("rows"), rows0)
    np.testing.assert_array_equal(trio.decoder.read("dst"), _sent_blocks(c, ALL))


# ------------------------------------------------------------------------ validation


BAD_CALLS = [
    # (id, configs, call kwargs, expected exception class, expected status)
    ("not_a_synchronizer", [key_config(blocks_key(DECODER_ID, 1), ALL, ALL)],
     dict(gate=False, src_block_indices=[0], dst_block_indices=[0]), "TypeError", None),
    ("configs_not_a_list", key_config(blocks_key(DECODER_ID, 1), ALL, ALL),
     dict(src_block_indices=[0], dst_block_indices=[0]), "TypeError", None),
    ("no_configs", [], dict(src_block_indices=[0], dst_block_indices=[0]), "LLMException", S.LLM_PARAM_INVALID),
    ("config_of_wrong_type", [blocks_key(DECODER_ID, 1)], dict(src_block_indices=[0], dst_block_indices=[0]),
     "TypeError", None),
    ("range_past_last_layer", [key_config(blocks_key(DECODER_ID, 1), range(3, 5), range(3, 5))],
     dict(src_block_indices=[0], dst_block_indices=[0]), "LLMException", S.LLM_PARAM_INVALID),
    ("key_ranges_differ", [key_config(blocks_key(DECODER_ID, 1), range(0, 2), range(2, 4))],
     dict(src_block_indices=[0], dst_block_indices=[0]), "LLMException", S.LLM_PARAM_INVALID),
    ("row_with_blocks_key", [key_config(blocks_key(DECODER_ID, 1), ALL, ALL, src_batch_index=1)],
     dict(src_block_indices=[0], dst_block_indices=[0]), "LLMException", S.LLM_PARAM_INVALID),
    ("range_with_step", [transfer_config(DECODER_ID, [4096] * 4, range(0, 4, 2))],
     dict(src_block_indices=[0], dst_block_indices=[0]), "LLMException", S.LLM_PARAM_INVALID),
    ("too_few_addresses", [transfer_config(DECODER_ID, [4096] * 3, range(0, 2))],
     dict(src_block_indices=[0], dst_block_indices=[0]), "LLMException", S.LLM_PARAM_INVALID),
    ("blocks_source_with_only_dst_indices", [key_config(blocks_key(DECODER_ID, 1), ALL, ALL)],
     dict(dst_block_indices=[0]), "LLMException", S.LLM_PARAM_INVALID),
    ("source_block_out_of_range", [key_config(blocks_key(DECODER_ID, 1), ALL, ALL)],
     dict(src_block_indices=[8], dst_block_indices=[0]), "LLMException", S.LLM_PARAM_INVALID),
    ("block_lists_differ", [key_config(blocks_key(DECODER_ID, 1), ALL, ALL)],
     dict(src_block_indices=[0, 1], dst_block_indices=[0]), "LLMException", S.LLM_PARAM_INVALID),
    ("block_size_differs", [key_config(blocks_key(DECODER_ID, 1), ALL, ALL)],
     dict(src_block_indices=[0], dst_block_indices=[0], dst_block_memory_size=1024), "LLMException",
     S.LLM_PARAM_INVALID),
    ("negative_block_size", [key_config(blocks_key(DECODER_ID, 1), ALL, ALL)],
     dict(src_block_indices=[0], dst_block_indices=[0], dst_block_memory_size=-1), "LLMException",
     S.LLM_PARAM_INVALID),
    ("row_of_a_blocks_source", [transfer_config(DECODER_ID, [4096] * 8, None, 1)],
     dict(src_block_indices=[0], dst_block_indices=[0]), "LLMException", S.LLM_PARAM_INVALID),
    ("cluster_not_linked", [key_config(blocks_key(99, 1), ALL, ALL)],
     dict(src_block_indices=[0], dst_block_indices=[0]), "LLMException", S.LLM_NOT_YET_LINK),
]


@pytest.mark.parametrize("configs,kwargs,exc_type,status", [case[1:] for case in BAD_CALLS],
                         ids=[case[0] for case in BAD_CALLS])
def test_invalid_arguments_raise_at_call_time(trio: Trio, configs: Any, kwargs: Dict[str, Any], exc_type: str,
                                              status: Optional[int]) -> None:
    """Invalid arguments raise from the call itself; nothing is sent and no thread starts."""
    c = _blocks_caches(trio, 100)
    before = _task_threads(trio.prompt)
    with expect_exc(exc_type, codes=[status] if status is not None else []):
        _start(trio.prompt, configs, **kwargs)
    assert _task_threads(trio.prompt) <= before
    np.testing.assert_array_equal(trio.decoder.read("dst"), c["dst0"])


def test_invalid_source_arguments(trio: Trio) -> None:
    """Arguments that depend on a contiguous source: its row range, no source blocks, and
    the block size needed to cut a row into raw destination blocks."""
    p = trio.prompt
    p.alloc("src", ROWS)
    cases = [
        ([transfer_config(DECODER_ID, [4096] * 8, None, 4)], {}),
        ([transfer_config(DECODER_ID, [4096] * 8)], dict(src_block_indices=[0], dst_block_indices=[0])),
        ([transfer_config(DECODER_ID, [4096] * 8)], dict(dst_block_indices=[0])),
        ([transfer_config(DECODER_ID, [4096] * 8)], dict(dst_block_indices=[0, 1, 2, 3, 4],
                                                         dst_block_memory_size=BLOCKS.row_bytes)),
    ]
    for configs, kwargs in cases:
        with expect_llm(S.LLM_PARAM_INVALID):
            _start(p, configs, **kwargs)


def _task_threads(peer: Peer) -> set:
    return {t for t in peer.snapshot()["threads"] if t[1].startswith("datadist-async")}


# ------------------------------------------------------------------------ stalled and dead peers


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_frozen_decoder_does_not_hold_back_the_other(own_trio: Any, transport: str) -> None:
    """Decoder 2 is frozen (SIGSTOP): the first decoder still gets every layer at once,
    long before decoder 2's sends time out (links are served concurrently); decoder 2's
    config then fails with LLM_TIMEOUT.  Raw addresses in registered memory go through
    decoder 2's agent on both transports, so freezing it stalls them."""
    slow_ms = 6000
    t = own_trio(transport, slow_ms)
    c = _blocks_caches(t, 110)
    made2 = t.decoder2.register("dst", BLOCKS, blocks=True)
    _start(t.prompt, [key_config(blocks_key(DECODER_ID, 1), ALL, ALL), transfer_config(DECODER2_ID, made2["addrs"])],
           src_block_indices=SRC_BLOCKS, dst_block_indices=DST_BLOCKS)
    t.decoder2.stop()
    _open(t.prompt, list(ALL))
    until(lambda: _results(t.prompt, 0)[0] == S.LLM_SUCCESS, slow_ms / 1000 / 2,
          "the first decoder's config finished while decoder 2 is frozen", every=PACED)
    out = t.prompt.call("task", "task", "get_results", slow_ms + WAIT_MS, timeout=slow_ms / 1000 + WAIT_S + 5)
    assert out["result"] == [S.LLM_SUCCESS, S.LLM_TIMEOUT], out
    t.decoder2.cont()
    np.testing.assert_array_equal(t.decoder.read("dst"), _sent_blocks(c, ALL))


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_killed_decoder_ends_its_config_in_error(own_trio: Any, transport: str) -> None:
    """Decoder 2 is killed after layers 0-1 arrived: once the prompt has noticed, the rest
    of its config fails with LLM_LINK_FAILED at once (no hang); the other decoder gets
    everything."""
    t = own_trio(transport)
    c = _blocks_caches(t, 120)
    t.decoder2.alloc("dst", BLOCKS, blocks=True, bkey=blocks_key(DECODER2_ID, 1))
    dst2 = t.decoder2.fill("dst", BLOCKS, 122)
    _start(t.prompt, [key_config(blocks_key(DECODER_ID, 1), ALL, ALL),
                      key_config(blocks_key(DECODER2_ID, 1), ALL, ALL)],
           src_block_indices=SRC_BLOCKS, dst_block_indices=DST_BLOCKS)
    _open(t.prompt, [0, 1])
    first = expect_blocks(dst2, c["src"], SRC_BLOCKS, DST_BLOCKS, BLOCKS.row_bytes,
                          src_layers=range(0, 2), dst_layers=range(0, 2))
    until(lambda: _holds(t.decoder2, "dst", first), WAIT_S, "layers 0-1 reached decoder 2", every=PACED)
    t.decoder2.kill()
    # The prompt learns of the death from its link (end of stream); a push loop ends when it has.
    noticed = t.prompt.call("loop", "push_blocks", (blocks_key(DECODER2_ID, 1), Ref("src"), [0], [0]), {},
                            WAIT_S, timeout=WAIT_S + 10)
    assert noticed["error"] is not None, noticed
    _open(t.prompt, [2, 3])
    out = t.prompt.call("task", "task", "get_results", WAIT_MS)
    assert out["result"] == [S.LLM_SUCCESS, S.LLM_LINK_FAILED], out
    assert out["elapsed"] < WAIT_S / 2, out
    assert _synchronize(t.prompt, 0) == S.LLM_LINK_FAILED
    np.testing.assert_array_equal(t.decoder.read("dst"), _sent_blocks(c, ALL))
