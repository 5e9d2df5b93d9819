"""Nothing leaks: after finalize() and after a peer is SIGKILLed (ARCHITECTURE principle 5).

Each engine process reports a snapshot of itself (open fds with their targets, Python
threads, shared-memory files it maps, named or memfd) before its engine exists, while it
works, and at the end.  The test asserts that the working snapshot shows the engine's
resources (so the comparison can fail) and that none of them is left afterwards, and that
no /dev/shm entry of ours outlives the processes.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Sequence, Set

import numpy as np
import pytest

from datadist import LLMStatusCode as S
from harness import (DECODER_ID, PROMPT_ID, TRANSPORTS, Desc, Pair, Peer, Ref, blocks_key,
                     expect_blocks, id_key, shm_listing)
from waiting import PACED, until

pytestmark = pytest.mark.timeout(60)

BLOCKS = Desc(4, (8, 16, 64), "fp16")

Snapshot = Dict[str, Any]


def _exercise(pair: Pair) -> None:
    """Allocate and register caches on both sides and move data both ways (checked)."""
    p, d = pair.peers()
    p.alloc("src", BLOCKS, blocks=True, bkey=blocks_key(PROMPT_ID))
    p.register("user", BLOCKS, blocks=True)
    d.alloc("dst", BLOCKS, blocks=True, bkey=blocks_key(DECODER_ID))
    made = d.register("udst", BLOCKS, blocks=True)
    data = p.fill("src", BLOCKS, 1)
    dst0 = d.fill("dst", BLOCKS, 2)
    udst0 = d.fill("udst", BLOCKS, 3)
    d.cm("pull_blocks", blocks_key(PROMPT_ID), Ref("dst"), [0, 1], [2, 3])
    p.cm("push_blocks", id_key(DECODER_ID, made["cache_id"]), Ref("src"), [4], [5])
    np.testing.assert_array_equal(d.read("dst"), expect_blocks(dst0, data, [0, 1], [2, 3],
                                                               BLOCKS.row_bytes))
    np.testing.assert_array_equal(d.read("udst"), expect_blocks(udst0, data, [4], [5],
                                                                BLOCKS.row_bytes))


def _sockets(snap: Snapshot) -> Set[int]:
    return {fd for fd, target in snap["fds"].items() if target.startswith("socket:")}


def _new_fds(base: Snapshot, now: Snapshot) -> Dict[int, str]:
    return {fd: t for fd, t in now["fds"].items() if base["fds"].get(fd) != t}


def _new_threads(base: Snapshot, now: Snapshot) -> List[Any]:
    return sorted(set(map(tuple, now["threads"])) - set(map(tuple, base["threads"])))


def _released(leftovers: Callable[[], Sequence[Any]], what: str) -> None:
    """Until ``leftovers`` lists nothing (an engine lets go of a link as its agent notices
    the end); at 5 s, fail listing what is still there."""
    until(lambda: not leftovers(), 5.0, lambda: f"{what}; still there: {list(leftovers())}", every=PACED)


def _link_leftovers(peer: Peer, inited: Snapshot, peer_maps: Set[str]) -> List[str]:
    """What of a link is still held by ``peer``: mappings of the peer's memory, sockets
    and threads opened since its engine was initialized."""
    now = peer.snapshot()
    left = [f"mapping {m}" for m in sorted(set(now["maps"]) & peer_maps)]
    left += [f"fd {fd} -> {now['fds'][fd]}" for fd in sorted(_sockets(now) - _sockets(inited))]
    left += [f"thread {t}" for t in _new_threads(inited, now)]
    return left


def _assert_engine_visible(base: Snapshot, working: Snapshot, name: str) -> None:
    """The working snapshot shows the engine's resources: the leak checks can fail."""
    assert _new_fds(base, working), f"{name}: the engine opened no fd?"
    assert set(working["maps"]) - set(base["maps"]), f"{name}: no shared memory mapped?"


def _assert_released(base: Snapshot, now: Snapshot, name: str) -> None:
    assert not _new_threads(base, now), f"{name}: threads left: {_new_threads(base, now)}"
    assert not _new_fds(base, now), f"{name}: fds left: {_new_fds(base, now)}"
    left = sorted(set(now["maps"]) - set(base["maps"]))
    assert not left, f"{name}: shared memory still mapped: {left}"


def _assert_no_shm_left(before: Set[str], peers: List[Peer], seen: Set[str]) -> None:
    """No /dev/shm entry that one of our processes mapped or named after its pid is left."""
    pids = {str(p.pid) for p in peers}
    ours = {n for n in shm_listing() - before
            if f"/dev/shm/{n}" in seen or pids & set(n.replace("-", "_").split("_"))}
    assert not ours, f"/dev/shm entries left behind: {sorted(ours)}"


def _start(peer_factory: Any, transport: str) -> Dict[str, Any]:
    """A pair, snapshotted before init, after init, and after linking and transfers."""
    pair = peer_factory("pair", transport, link=False, init=False)
    p, d = pair.peers()
    snaps: Dict[str, Dict[str, Snapshot]] = {"base": {}, "inited": {}, "working": {}}
    for peer in (p, d):
        if transport == "gloo":
            peer.call("warm_collectives")
        snaps["base"][peer.name] = peer.snapshot()
        peer.call("init")
        snaps["inited"][peer.name] = peer.snapshot()
    d.link(p)
    _exercise(pair)
    for peer in (p, d):
        snaps["working"][peer.name] = peer.snapshot()
        _assert_engine_visible(snaps["base"][peer.name], snaps["working"][peer.name], peer.name)
    return {"pair": pair, "snaps": snaps}


def _seen_shm(snaps: Dict[str, Dict[str, Snapshot]]) -> Set[str]:
    return {path for by_peer in snaps.values() for snap in by_peer.values()
            for path in snap["shm"]}


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_finalize_releases_everything(peer_factory: Any, transport: str) -> None:
    """finalize() on both ends: no thread, fd or shared-memory mapping of the engine is left."""
    shm_before = shm_listing()
    started = _start(peer_factory, transport)
    pair, snaps = started["pair"], started["snaps"]
    for peer in (pair.decoder, pair.prompt):
        peer.call("finalize")
        _assert_released(snaps["base"][peer.name], peer.snapshot(), peer.name)
    _assert_no_shm_left(shm_before, list(pair.peers()), _seen_shm(snaps))
    for peer in pair.peers():
        peer.shutdown()
    _assert_no_shm_left(shm_before, list(pair.peers()), _seen_shm(snaps))


@pytest.mark.parametrize("victim", ["decoder", "prompt"])
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_sigkill_of_a_peer(peer_factory: Any, transport: str, victim: str) -> None:
    """SIGKILL one end: the survivor drops the link's sockets and its mappings of the dead
    peer's memory, its transfers to it fail, and after finalize nothing is left."""
    shm_before = shm_listing()
    started = _start(peer_factory, transport)
    pair, snaps = started["pair"], started["snaps"]
    dead, survivor = (pair.decoder, pair.prompt) if victim == "decoder" else \
        (pair.prompt, pair.decoder)
    inited = snaps["inited"][survivor.name]
    working = snaps["working"][survivor.name]
    peer_maps = set(working["maps"]) - set(inited["maps"])
    assert _sockets(working) - _sockets(inited), "the link uses no socket?"
    dead.kill()
    if victim == "decoder":
        probe = ("push_blocks", (blocks_key(DECODER_ID), Ref("src"), [0], [0]), {})
    else:
        probe = ("pull_blocks", (blocks_key(PROMPT_ID), Ref("dst"), [0], [0]), {})
    # A call racing with the death may still succeed (one-sided copies need no peer).
    failed = until(lambda: survivor.call("timed_cm", *probe)["error"], 5.0,
                   f"{survivor.name}'s transfers to the killed {victim} fail", every=PACED)
    assert failed in ("LLMException", "ParamInvalidError"), failed
    _released(lambda: _link_leftovers(survivor, inited, peer_maps),
              f"{survivor.name} releases the link to the killed {victim}")
    survivor.call("finalize")
    _assert_released(snaps["base"][survivor.name], survivor.snapshot(), survivor.name)
    survivor.shutdown()
    _assert_no_shm_left(shm_before, list(pair.peers()), _seen_shm(snaps))


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_unlink_releases_the_link(peer_factory: Any, transport: str) -> None:
    """unlink_clusters by the client frees the link's sockets and mappings on both ends."""
    started = _start(peer_factory, transport)
    pair, snaps = started["pair"], started["snaps"]
    p, d = pair.peers()
    ret, rets = d.call("unlink", [(PROMPT_ID, "127.0.0.1", p.listen_port)], 3000)
    assert (ret, rets) == (S.LLM_SUCCESS, [S.LLM_SUCCESS])
    for peer in (p, d):
        inited, working = snaps["inited"][peer.name], snaps["working"][peer.name]
        peer_maps = set(working["maps"]) - set(inited["maps"])

        _released(lambda: _link_leftovers(peer, inited, peer_maps),
                  f"{peer.name} releases the unlinked link")
