"""End-to-end integrity of transfers (``transfer_checksum``): a byte changed between two
engine processes (by a proxy between them) fails the pull or push with ``LLM_LINK_FAILED``
and a message that says "checksum mismatch"; the link stays up and the same transfer then
arrives intact.  Over shm, a one-sided copy that read the wrong bytes or whose destination
changed before the owner summed it fails the same way.  Without the option the changed byte lands unnoticed
(the control: it is the checksum that catches it).  Over TLS, summed transfers of every
shape (larger than the staging buffer, pipelined) arrive intact."""
from __future__ import annotations

import json
from typing import Any, Iterator, Tuple

import numpy as np
import pytest

from bench_cli import run_bench
from datadist import LLMStatusCode as S
from flip_proxy import MARK, FlipProxy
from harness import (DECODER_ID, PROMPT_ID, Desc, Peer, Ref, base_config, blocks_key, expect_blocks, expect_llm,
                     free_port)
from tls_helpers import Pki, make_pki, tls_config

pytestmark = pytest.mark.timeout(180)

#: Two tensors of 8 blocks of 5000 bytes: payloads cross 4 KiB blocks and end inside one.
BLOCKS = Desc(2, (8, 5000), "uint8")
#: Rows of 100000 bytes: 40 scattered blocks move 8 MB, twice the TLS staging buffer.
BIG = Desc(2, (48, 50000), "fp16")
KEY = blocks_key(PROMPT_ID, 0)


def _marked(desc: Desc) -> np.ndarray:
    """Cache bytes the proxy recognizes (runs of MARK), one row per tensor, with a few
    other bytes so that a misplaced row shows too."""
    data = np.full((desc.num_tensors, desc.tensor_bytes), MARK, dtype=np.uint8)
    data[:, ::997] = np.arange(data[:, ::997].size, dtype=np.uint8).reshape(desc.num_tensors, -1)
    return data


@pytest.fixture
def proxied(peer_factory: Any) -> Iterator[Any]:
    """``make(checksum)``: a prompt and a decoder whose link runs through a FlipProxy, each
    with a blocks cache ``kv`` (the prompt's holds marked bytes, the decoder's random ones)."""
    proxies = []

    def make(checksum: bool) -> Tuple[Peer, Peer, FlipProxy, np.ndarray, np.ndarray]:
        port = free_port()
        prompt = peer_factory("peer", "prompt", "PROMPT", PROMPT_ID,
                              base_config("tcp", listen_port=port, transfer_checksum=checksum))
        decoder = peer_factory("peer", "decoder", "DECODER", DECODER_ID,
                               base_config("tcp", transfer_checksum=checksum))
        proxy = FlipProxy(("127.0.0.1", port))
        proxies.append(proxy)
        prompt.alloc("kv", BLOCKS, blocks=True, bkey=KEY)
        decoder.alloc("kv", BLOCKS, blocks=True, bkey=blocks_key(DECODER_ID, 0))
        data = _marked(BLOCKS)
        prompt.write("kv", data)
        base = decoder.fill("kv", BLOCKS, 3)
        decoder.link(prompt, port=proxy.address[1])
        return prompt, decoder, proxy, data, base

    yield make
    for proxy in proxies:
        proxy.close()


def _mismatch(caught: list) -> None:
    message = caught[0].message
    assert "checksum mismatch" in message and "not written" in message, message


def test_a_byte_changed_in_a_pull_fails_it(proxied: Any) -> None:
    prompt, decoder, proxy, data, base = proxied(True)
    decoder.cm("pull_blocks", KEY, Ref("kv"), [0, 1], [0, 1])  # the proxy forwards faithfully
    base = expect_blocks(base, data, [0, 1], [0, 1], BLOCKS.row_bytes)
    np.testing.assert_array_equal(decoder.read("kv"), base)
    proxy.arm("down")
    with expect_llm(S.LLM_LINK_FAILED) as caught:
        decoder.cm("pull_blocks", KEY, Ref("kv"), [2, 5, 4], [3, 6, 7])
    assert proxy.flipped == 1
    _mismatch(caught)
    decoder.cm("pull_blocks", KEY, Ref("kv"), [2, 5, 4], [3, 6, 7])  # the link is still up
    np.testing.assert_array_equal(decoder.read("kv"), expect_blocks(base, data, [2, 5, 4], [3, 6, 7],
                                                                    BLOCKS.row_bytes))


def test_a_byte_changed_in_a_push_fails_it(proxied: Any) -> None:
    prompt, decoder, proxy, data, _ = proxied(True)
    mine = _marked(BLOCKS)[:, ::-1].copy()
    decoder.write("kv", mine)
    proxy.arm("up")
    with expect_llm(S.LLM_LINK_FAILED) as caught:
        decoder.cm("push_blocks", KEY, Ref("kv"), [0, 1, 2], [5, 6, 7])
    assert proxy.flipped == 1
    _mismatch(caught)
    decoder.cm("push_blocks", KEY, Ref("kv"), [0, 1, 2], [5, 6, 7])
    np.testing.assert_array_equal(prompt.read("kv"), expect_blocks(data, mine, [0, 1, 2], [5, 6, 7],
                                                                   BLOCKS.row_bytes))


def test_prepared_transfers_are_checked_each_time(proxied: Any) -> None:
    """A prepared pull runs as a frame the prompt admitted before (served without a second
    check of the plan); a pipelined batch of pushes goes out back to back: both summed."""
    prompt, decoder, proxy, data, base = proxied(True)
    decoder.call("prepare", "pull", "prepare_pull_blocks", [KEY, Ref("kv"), [1, 7], [2, 0]], {})
    decoder.call("run", "pull")
    base = expect_blocks(base, data, [1, 7], [2, 0], BLOCKS.row_bytes)
    np.testing.assert_array_equal(decoder.read("kv"), base)
    proxy.arm("down")
    with expect_llm(S.LLM_LINK_FAILED) as caught:
        decoder.call("run", "pull")
    assert proxy.flipped == 1
    _mismatch(caught)
    decoder.call("run", "pull")
    np.testing.assert_array_equal(decoder.read("kv"), base)

    decoder.write("kv", data[:, ::-1].copy())
    decoder.call("prepare", "push", "prepare_push_blocks", [KEY, Ref("kv")], {})
    pairs = [([0], [3]), ([1], [2]), ([2, 3], [0, 1])]
    decoder.call("run_batch", "push", pairs)
    expected = data
    for src_blocks, dst_blocks in pairs:
        expected = expect_blocks(expected, data[:, ::-1], src_blocks, dst_blocks, BLOCKS.row_bytes)
    np.testing.assert_array_equal(prompt.read("kv"), expected)
    proxy.arm("up")
    with expect_llm(S.LLM_LINK_FAILED) as caught:
        decoder.call("run_batch", "push", pairs)
    assert proxy.flipped == 2
    _mismatch(caught)


def test_without_the_option_a_changed_byte_lands_unnoticed(proxied: Any) -> None:
    """The control: TCP's own checks pass what the proxy changed, and so does a link
    without ``transfer_checksum``."""
    _, decoder, proxy, data, base = proxied(False)
    proxy.arm("down")
    decoder.cm("pull_blocks", KEY, Ref("kv"), [0, 1, 2], [0, 1, 2])
    assert proxy.flipped == 1
    got = decoder.read("kv")
    want = expect_blocks(base, data, [0, 1, 2], [0, 1, 2], BLOCKS.row_bytes)
    assert int((got != want).sum()) == 1


@pytest.fixture
def shm_pair(peer_factory: Any) -> Tuple[Peer, Peer, np.ndarray, np.ndarray]:
    """A prompt and a decoder (which sums its transfers) linked over shared memory, each
    with a blocks cache ``kv`` of random bytes in host memory (also on a machine with a
    GPU: the tampering below hooks the host copy, ``native.copy_plan_stream``)."""
    port = free_port()
    prompt = peer_factory("peer", "prompt", "PROMPT", PROMPT_ID,
                          base_config("shm", listen_port=port, device_type="cpu"))
    decoder = peer_factory("peer", "decoder", "DECODER", DECODER_ID,
                           base_config("shm", transfer_checksum=True, device_type="cpu"))
    prompt.alloc("kv", BLOCKS, blocks=True, bkey=KEY)
    decoder.alloc("kv", BLOCKS, blocks=True, bkey=blocks_key(DECODER_ID, 0))
    data = prompt.fill("kv", BLOCKS, 21)
    base = decoder.fill("kv", BLOCKS, 22)
    decoder.link(prompt, port=port)
    assert decoder.call("links")[PROMPT_ID]["path"] == "shm"
    return prompt, decoder, data, base


def test_shm_copies_are_checked_against_the_owners_sum(shm_pair: Any) -> None:
    """Over shm the decoder copies one-sidedly; the prompt sums the same runs by its own
    reading of each request.  Intact copies pass; a pull that read the wrong bytes (its
    source one word off, as a wrong plan or a stale mapping would) and a push whose
    destination changed right after the copy (before the owner summed it) both fail with
    a checksum mismatch, and the link stays up; so does a repeated push whose ``SUM`` the
    owner serves in C."""
    prompt, decoder, data, base = shm_pair
    decoder.cm("pull_blocks", KEY, Ref("kv"), [0, 1], [0, 1])
    base = expect_blocks(base, data, [0, 1], [0, 1], BLOCKS.row_bytes)
    np.testing.assert_array_equal(decoder.read("kv"), base)

    decoder.call("tamper_copy", "shifted")
    with expect_llm(S.LLM_LINK_FAILED) as caught:
        decoder.cm("pull_blocks", KEY, Ref("kv"), [2, 5, 4], [3, 6, 7])
    _mismatch(caught)
    assert "owner's checksum" in caught[0].message
    decoder.cm("pull_blocks", KEY, Ref("kv"), [2, 5, 4], [3, 6, 7])
    base = expect_blocks(base, data, [2, 5, 4], [3, 6, 7], BLOCKS.row_bytes)
    np.testing.assert_array_equal(decoder.read("kv"), base)

    # Twice: the second time the push's SUM frame is one the prompt admitted, so the
    # prompt's agent sums it in its C fast path, which must catch the change as well
    for _ in range(2):
        decoder.call("tamper_copy", "after")
        with expect_llm(S.LLM_LINK_FAILED) as caught:
            decoder.cm("push_blocks", KEY, Ref("kv"), [0, 3], [6, 1])
        _mismatch(caught)
        decoder.cm("push_blocks", KEY, Ref("kv"), [0, 3], [6, 1])
        np.testing.assert_array_equal(prompt.read("kv"), expect_blocks(data, base, [0, 3], [6, 1], BLOCKS.row_bytes))


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


def test_summed_transfers_over_tls_arrive_intact(peer_factory: Any, pki: Pki) -> None:
    port = free_port()
    prompt = peer_factory("peer", "prompt", "PROMPT", PROMPT_ID,
                          base_config("tcp", listen_port=port, **tls_config(pki, "a")))
    decoder = peer_factory("peer", "decoder", "DECODER", DECODER_ID,
                           base_config("tcp", sync_kv_timeout=20000, transfer_checksum=True, **tls_config(pki, "b")))
    prompt.alloc("kv", BIG, blocks=True, bkey=KEY)
    decoder.alloc("kv", BIG, blocks=True, bkey=blocks_key(DECODER_ID, 0))
    data = prompt.fill("kv", BIG, 11)
    base = decoder.fill("kv", BIG, 12)
    decoder.link(prompt, port=port)
    rng = np.random.default_rng(5)
    src_blocks = [int(b) for b in rng.permutation(48)[:40]]
    dst_blocks = [int(b) for b in rng.permutation(48)[:40]]
    decoder.cm("pull_blocks", KEY, Ref("kv"), src_blocks, dst_blocks, timeout=60)
    base = expect_blocks(base, data, src_blocks, dst_blocks, BIG.row_bytes)
    np.testing.assert_array_equal(decoder.read("kv"), base)
    decoder.cm("push_blocks", KEY, Ref("kv"), dst_blocks[:3], [0, 1, 2], timeout=60)
    np.testing.assert_array_equal(prompt.read("kv"), expect_blocks(data, base, dst_blocks[:3], [0, 1, 2],
                                                                   BIG.row_bytes))


@pytest.mark.timeout(90)
def test_the_bench_runs_summed_transfers_and_says_so() -> None:
    proc = run_bench("--workload", "small-4k", "--transport", "tcp", "--rounds", "20", "--checksum", "--json",
                     timeout=80)
    assert proc.returncode == 0, proc.stderr
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(rows) == 1 and rows[0]["checksum"] is True and rows[0]["verified"] is True, rows
