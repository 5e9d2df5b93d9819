"""Integrity of the pool's values over TCP: a byte changed between a client and the daemon
(by a proxy between them) is caught on save (the daemon compares the client's checksum
with what it received, and stores nothing) and on load (the client compares what it
received with the stored checksum: a miss, never wrong data)."""
from __future__ import annotations

import logging

import pytest
import torch

from ems_helpers import daemon_factory, init_cc  # noqa: F401
from flip_proxy import MARK, FlipProxy

from ems import CcConfig_v1, CcKvOption, Ems, EmsConfig, KvBufferWrapper

pytestmark = pytest.mark.timeout(120)

#: Bytes of the test value: several 4 KiB blocks and a partial one.
SIZE = (64 << 10) + 1000


def _value() -> torch.Tensor:
    return torch.full((SIZE,), MARK, dtype=torch.uint8)


def _save(cc, key: str, t: torch.Tensor) -> int:
    return cc.save(CcKvOption(), [key], [[KvBufferWrapper(t.data_ptr(), SIZE)]]).success


def _load(cc, key: str, t: torch.Tensor) -> int:
    return cc.load(CcKvOption(), [key], [[KvBufferWrapper(t.data_ptr(), SIZE)]]).success


@pytest.fixture
def proxied(daemon_factory):  # noqa: F811
    d = daemon_factory(tcp=True)
    host, _, port = d.tcp[len("tcp://"):].rpartition(":")
    proxy = FlipProxy((host, int(port)))
    yield d, proxy, "tcp://%s:%d" % proxy.address
    Ems._shutdown()
    proxy.close()


def test_a_byte_changed_on_the_way_to_the_daemon_is_not_stored(proxied):
    d, proxy, via_proxy = proxied
    cc = init_cc(via_proxy)
    value = _value()
    value[SIZE - 10] = 7  # the partial last block counts too
    assert _save(cc, "clean", value) == 1  # the proxy itself forwards faithfully
    proxy.arm("up")
    assert _save(cc, "flipped", value) == 0
    assert proxy.flipped == 1
    assert cc.exists(key_list=["flipped"]).success == 0  # nothing was published
    out = torch.zeros(SIZE, dtype=torch.uint8)
    assert _load(cc, "clean", out) == 1 and torch.equal(out, value)
    assert "arrived corrupted" in d.log.read_text()
    assert _save(cc, "flipped", value) == 1  # saving again (nothing flipped) stores it
    assert _load(cc, "flipped", out) == 1 and torch.equal(out, value)


def test_a_byte_changed_on_the_way_to_the_client_is_a_miss(proxied, caplog):
    d, proxy, via_proxy = proxied
    value = _value()
    cc = init_cc(d.tcp)  # saved directly
    assert _save(cc, "k", value) == 1
    cc = init_cc(via_proxy)
    out = torch.zeros(SIZE, dtype=torch.uint8)
    assert _load(cc, "k", out) == 1 and torch.equal(out, value)  # faithful first
    proxy.arm("down")
    out.zero_()
    with caplog.at_level(logging.ERROR, logger="ems"):
        assert _load(cc, "k", out) == 0
    assert proxy.flipped == 1
    assert any("failed its checksum" in r.getMessage() for r in caplog.records)


def test_unverified_loads_skip_the_check(proxied):
    """``verify_reads=False`` trusts the transport: the control that the check is what
    turns the changed byte into a miss."""
    d, proxy, via_proxy = proxied
    value = _value()
    assert _save(init_cc(d.tcp), "k", value) == 1
    Ems._shutdown()
    Ems.init(EmsConfig(cc_config=CcConfig_v1(rank_id=0, device_id=0, model_id="m-test"), server=via_proxy,
                       verify_reads=False))
    cc = Ems.get_cc()
    proxy.arm("down")
    out = torch.zeros(SIZE, dtype=torch.uint8)
    assert _load(cc, "k", out) == 1
    assert proxy.flipped == 1 and int((out != value).sum()) == 1
