"""Two prompt hosts and two decoder hosts (network namespaces, datadist/bench/netns.py): every engine
listens on its host's address, every link runs over tcp with the link secret and TLS, and
every byte that arrives is compared with what was sent.

The module's engines serve all tests; the faults come in an order that leaves the cluster
usable for the next test (a partition heals, a stopped decoder resumes, loss is switched
off), and the prompt host that dies comes last.  The assertion messages say what a user of
the engine sees when a test fails.
"""
from __future__ import annotations

import time
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import pytest

from datadist import LLMStatusCode as S
from harness import Desc, Peer, Ref, base_config, blocks_key, close_peers, expect_blocks, key_config
from waiting import PACED, until
from datadist.bench.netns import Cluster, Host
from tls_helpers import make_pki, tls_config

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(180)]

PORT = 26000
SECRET = "one secret for the whole cluster"
#: sync_kv_timeout of every engine: the deadline of each push, pull and layer send.
TIMEOUT_MS = 3000
#: Slack on top of sync_kv_timeout for a failure to reach the caller on a loaded machine.
SLACK_S = 2.0
#: How long the four engines may take to start together.
START_S = 120.0
PROMPT_IDS = (1, 2)
DECODER_IDS = (11, 12)
#: 4 layers (8 tensors) of 64 blocks x 16 tokens x 64 fp16 elements: 2 KiB per block and
#: tensor, 1 MiB per cache.
BLOCKS = Desc(8, (64, 16, 64), "fp16")
ALL = range(0, 4)
#: 16 MiB in two tensors of 64 blocks: a pull that lasts long enough to be cut.
BIG = Desc(2, (64, 64, 1024), "fp16")


class XPyD:
    """The module's cluster and engines: ``prompts[i]`` on host i, ``decoders[j]`` on host 2 + j."""

    def __init__(self, cluster: Cluster, prompts: List[Peer], decoders: List[Peer]) -> None:
        self.cluster = cluster
        self.prompts = prompts
        self.decoders = decoders

    def host(self, peer: Peer) -> Host:
        return self.cluster[(self.prompts + self.decoders).index(peer)]


def _engine(host: Host, name: str, role: str, cluster_id: int, tls: Dict[str, str],
            listen: bool) -> Peer:
    config = base_config("tcp", sync_kv_timeout=TIMEOUT_MS, link_secret=SECRET, **tls,
                         listen_ip_info=f"{host.address}:{PORT}" if listen else None)
    return Peer(name, role, cluster_id, config, netns=host.netns, address=host.address)


@pytest.fixture(scope="module")
def xpyd(cluster_factory: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[XPyD]:
    pki = make_pki(tmp_path_factory.mktemp("pki"))
    cluster = cluster_factory(4)
    spawned: List[Peer] = []
    try:
        for i, cid in enumerate(PROMPT_IDS):
            spawned.append(_engine(cluster[i], f"prompt{i}", "PROMPT", cid, tls_config(pki, "a"), True))
        for j, cid in enumerate(DECODER_IDS):
            spawned.append(_engine(cluster[2 + j], f"decoder{j}", "DECODER", cid, tls_config(pki, "b"), False))
        for peer in spawned:  # four engines import torch at once on a small machine
            peer.wait_ready(START_S)
        prompts, decoders = spawned[:2], spawned[2:]
        for dec in decoders:
            for prompt in prompts:
                dec.link(prompt)
        yield XPyD(cluster, prompts, decoders)
    finally:
        close_peers(spawned)


@pytest.fixture
def engines(xpyd: XPyD) -> Iterator[XPyD]:
    """The module's engines; every cache is freed and the links healed afterwards."""
    yield xpyd
    xpyd.cluster.heal()
    for peer in xpyd.prompts + xpyd.decoders:
        if peer.alive:
            peer.cont()
            peer.call("free_all")


def _caches(t: XPyD, desc: Desc = BLOCKS, seed: int = 0) -> Dict[str, np.ndarray]:
    """A blocks cache ``kv`` on every engine (key ``BlocksCacheKey(its id, 1)``), filled."""
    data = {}
    for n, peer in enumerate(t.prompts + t.decoders):
        if peer.alive:
            peer.alloc("kv", desc, blocks=True, bkey=blocks_key(peer.cluster_id, 1))
            data[peer.name] = peer.fill("kv", desc, seed + n)
    return data


def _pull(dec: Peer, prompt: Peer, src: Sequence[int], dst: Sequence[int]) -> Tuple[Optional[int], float]:
    """``pull_blocks`` from ``prompt``'s cache; (status code or None for success, seconds)."""
    t0 = time.monotonic()
    try:
        dec.cm("pull_blocks", blocks_key(prompt.cluster_id, 1), Ref("kv"), list(src), list(dst),
               timeout=TIMEOUT_MS / 1000 + 20)
        code = None
    except Exception as exc:
        code = getattr(exc, "status_code", None)
        if code is None:
            raise
    return code, time.monotonic() - t0


def _relink(dec: Peer, prompt: Peer) -> None:
    ret, rets = dec.link(prompt, expect_ok=False)
    assert rets == [S.LLM_SUCCESS], (
        f"after the network healed, link_clusters from {dec.name} to {prompt.name} returned {rets}: "
        "a user could not reconnect the decoder")


# ------------------------------------------------------------------------ every byte


def test_layerwise_pushes_and_pulls_across_hosts_deliver_every_byte(engines: XPyD) -> None:
    """8 requests, each layer-wise ``transfer_cache_async`` of 8 blocks from a prompt host
    into a decoder host (both prompts into both decoders), layers released one at a time on
    all of them; then each decoder pulls 32 scattered blocks from each prompt."""
    t = engines
    data = _caches(t, seed=100)
    want = {dec.name: data[dec.name] for dec in t.decoders}
    tasks: List[Tuple[Peer, str]] = []
    for r in range(8):
        prompt, dec = t.prompts[r % 2], t.decoders[(r // 2) % 2]
        blocks = list(range(8 * r, 8 * r + 8))
        dst = blocks[::-1]
        prompt.call("transfer_async", f"req{r}", "kv", [key_config(blocks_key(dec.cluster_id, 1), ALL, ALL)],
                    src_block_indices=blocks, dst_block_indices=dst)
        tasks.append((prompt, f"req{r}"))
        want[dec.name] = expect_blocks(want[dec.name], data[prompt.name], blocks, dst, BLOCKS.row_bytes)
    for layer in ALL:  # a model computes layer by layer; every request's layer goes out
        for prompt, name in tasks:
            prompt.call("open_layers", name, [layer])
    for prompt, name in tasks:
        out = prompt.call("task", name, "get_results", TIMEOUT_MS * 2)["result"]
        assert out == [S.LLM_SUCCESS], (
            f"{name} from {prompt.name}: transfer_cache_async results {out}: the decoder would not get its KV cache")
    for dec in t.decoders:
        got = dec.read("kv")
        assert np.array_equal(got, want[dec.name]), f"{dec.name} holds wrong bytes after the layer-wise pushes"
    rng = np.random.default_rng(7)
    for dec in t.decoders:
        have = dec.read("kv")
        for k, prompt in enumerate(t.prompts):
            src = sorted(rng.choice(64, 32, replace=False).tolist())
            dst = list(range(32 * k, 32 * k + 32))
            code, _ = _pull(dec, prompt, src, dst)
            assert code is None, f"{dec.name} pulling from {prompt.name} across hosts failed with status {code}"
            have = expect_blocks(have, data[prompt.name], src, dst, BLOCKS.row_bytes)
        assert np.array_equal(dec.read("kv"), have), f"{dec.name} holds wrong bytes after pull_blocks"


# ------------------------------------------------------------------------ faults


def test_partition_fails_within_the_timeout_and_relinks_after_it_heals(engines: XPyD) -> None:
    """decoder0's host is cut off from prompt0's: its pull fails within sync_kv_timeout and
    leaves its cache as it was, while it goes on pulling from prompt1; once the partition
    heals, link_clusters again and the same pull delivers the right bytes."""
    t = engines
    data = _caches(t, seed=200)
    dec, cut, other = t.decoders[0], t.prompts[0], t.prompts[1]
    t.host(dec).cut_from([t.host(cut)])
    code, took = _pull(dec, cut, range(0, 16), range(0, 16))
    assert code in (S.LLM_TIMEOUT, S.LLM_LINK_FAILED), (
        f"a pull across a partition returned {code}, not LLM_TIMEOUT or LLM_LINK_FAILED")
    assert took < TIMEOUT_MS / 1000 + SLACK_S, f"a pull across a partition took {took:.1f} s, past sync_kv_timeout"
    assert np.array_equal(dec.read("kv"), data[dec.name]), "a failed pull wrote into the decoder's cache"
    code, _ = _pull(dec, other, range(16, 32), range(16, 32))
    assert code is None, f"while partitioned from prompt0, pulling from prompt1 failed with {code}"
    want = expect_blocks(data[dec.name], data[other.name], range(16, 32), range(16, 32), BLOCKS.row_bytes)
    t.cluster.heal()
    _relink(dec, cut)
    code, _ = _pull(dec, cut, range(0, 16), range(0, 16))
    assert code is None, f"after the partition healed and the link was made again, the pull failed with {code}"
    want = expect_blocks(want, data[cut.name], range(0, 16), range(0, 16), BLOCKS.row_bytes)
    assert np.array_equal(dec.read("kv"), want), "wrong bytes after the partition healed"


def test_one_percent_loss_completes_with_every_byte(engines: XPyD) -> None:
    """1 % of the packets to and from prompt1's host (a 1 Gbit/s link) dropped at random:
    pulls of 16 MiB still complete with every byte right; the time (median of 3), against
    the same pull without loss, is printed as the figure for the docs."""
    t = engines
    dec, prompt = t.decoders[1], t.prompts[1]
    data = _caches(t, BIG, seed=300)
    t.host(prompt).shape("1gbit")
    blocks = list(range(64))
    times = {}
    assert _pull(dec, prompt, blocks, blocks)[0] is None  # the first pull maps the pages: not timed
    for loss in (0.0, 0.01):
        t.host(prompt).lose(loss)
        dec.write("kv", data[dec.name])
        runs = []
        for _ in range(3):
            code, took = _pull(dec, prompt, blocks, blocks)
            assert code is None, f"a 16 MiB pull with {loss:.0%} packet loss failed with status {code}"
            runs.append(took)
        times[loss] = sorted(runs)[1]
        assert np.array_equal(dec.read("kv"), data[prompt.name]), f"wrong bytes arrived with {loss:.0%} loss"
    t.host(prompt).lose(0.0)
    t.host(prompt).unshape()
    print(f"\n16 MiB pull_blocks over TLS through 1 Gbit/s (median of 3): {times[0.0]:.3f} s without loss, "
          f"{times[0.01]:.3f} s with 1 % loss")


def test_stopped_decoder_times_out_the_push_and_the_prompt_serves_on(engines: XPyD) -> None:
    """decoder1 is frozen (SIGSTOP) while prompt0 pushes layer-wise into it: the task ends
    with LLM_TIMEOUT within sync_kv_timeout, prompt0 serves decoder0 meanwhile, and once
    decoder1 resumes and links again a push into it delivers every byte."""
    t = engines
    data = _caches(t, seed=400)
    prompt, frozen, dec = t.prompts[0], t.decoders[1], t.decoders[0]
    blocks = list(range(0, 8))
    frozen.stop()
    prompt.call("transfer_async", "stuck", "kv", [key_config(blocks_key(frozen.cluster_id, 1), ALL, ALL)],
                src_block_indices=blocks, dst_block_indices=blocks)
    prompt.call("open_layers", "stuck", list(ALL))
    code, _ = _pull(dec, prompt, range(8, 16), range(8, 16))
    assert code is None, f"while decoder1 was frozen, decoder0's pull from prompt0 failed with {code}"
    assert np.array_equal(dec.read("kv"), expect_blocks(data[dec.name], data[prompt.name], range(8, 16),
                                                        range(8, 16), BLOCKS.row_bytes))
    out = prompt.call("task", "stuck", "get_results", TIMEOUT_MS * 3)
    assert out["result"] in ([S.LLM_TIMEOUT], [S.LLM_LINK_FAILED]), (
        f"a push into a frozen decoder returned {out['result']}, not LLM_TIMEOUT")
    assert out["elapsed"] < TIMEOUT_MS / 1000 + SLACK_S, f"the push into a frozen decoder took {out['elapsed']:.1f} s"
    frozen.cont()
    code, _ = _pull(frozen, prompt, blocks, blocks)
    assert code == S.LLM_LINK_FAILED, (
        f"the resumed decoder's first call on the link that timed out returned {code}, not LLM_LINK_FAILED")
    _relink(frozen, prompt)
    frozen.write("kv", data[frozen.name])
    prompt.call("transfer_async", "again", "kv", [key_config(blocks_key(frozen.cluster_id, 1), ALL, ALL)],
                src_block_indices=blocks, dst_block_indices=blocks)
    prompt.call("open_layers", "again", list(ALL))
    out = prompt.call("task", "again", "get_results", TIMEOUT_MS * 2)
    assert out["result"] == [S.LLM_SUCCESS], f"after the decoder resumed and relinked, the push returned {out}"
    assert np.array_equal(frozen.read("kv"), expect_blocks(data[frozen.name], data[prompt.name], blocks, blocks,
                                                           BLOCKS.row_bytes)), "wrong bytes after the decoder resumed"


def test_prompt_host_dies_mid_transfer(engines: XPyD) -> None:
    """prompt1's host dies (silent link, processes killed) while decoder0 pulls 16 MiB from
    it through a 100 Mbit/s link: the pull fails with LLM_TIMEOUT or LLM_LINK_FAILED within
    sync_kv_timeout, and both decoders go on pulling from prompt0 with the right bytes."""
    t = engines
    data = _caches(t, BIG, seed=500)
    dead, alive, dec = t.prompts[1], t.prompts[0], t.decoders[0]
    host = t.host(dead)
    host.shape("100mbit")
    rx0 = t.host(dec).counters()["rx"]
    blocks = list(range(64))
    pending = dec.start_call("cm", "pull_blocks", (blocks_key(dead.cluster_id, 1), Ref("kv"), blocks, blocks), {})
    t0 = time.monotonic()
    until(lambda: t.host(dec).counters()["rx"] - rx0 > 2 << 20, TIMEOUT_MS / 1000,
          "2 MiB of the pull arrived at decoder0", every=PACED)
    t_dead = host.die()
    with pytest.raises(Exception) as info:
        pending.result(TIMEOUT_MS / 1000 + 20)
    took = time.monotonic() - t0
    code = getattr(info.value, "status_code", None)
    assert code in (S.LLM_TIMEOUT, S.LLM_LINK_FAILED), (
        f"a pull from a host that died returned {info.value!r}, not LLM_TIMEOUT or LLM_LINK_FAILED")
    assert took < TIMEOUT_MS / 1000 + SLACK_S, (
        f"a pull from a dead host failed only after {took:.1f} s ({time.monotonic() - t_dead:.1f} s after it died)")
    until(lambda: not dead.alive, 10, "the dead host's engine is gone", every=PACED)
    for d in t.decoders:
        d.write("kv", data[d.name])
        code, _ = _pull(d, alive, blocks, blocks)
        assert code is None, f"after prompt1's host died, {d.name}'s pull from prompt0 failed with {code}"
        assert np.array_equal(d.read("kv"), data[alive.name]), f"{d.name} got wrong bytes from prompt0"
