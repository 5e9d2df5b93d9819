"""A peer's answers are numbers plans are made from, and same-host plans are copied
one-sidedly into or out of the peer's mapped memory: a description of a cache that cannot
be right (a row outside the batch, addresses that wrap) breaks the link instead of being
planned against."""
from __future__ import annotations

import time
from typing import NoReturn, Optional

import numpy as np
import pytest

from datadist.engine import wire
from datadist.engine.errors import EngineError, Fault
from datadist.engine.lookups import PeerLookups, _unsound

pytestmark = pytest.mark.timeout(30)

SOUND = dict(cache_id=1, row=3, num_tensors=2, tensor_size=4096, batch_size=4, dtype="INT8", epoch=1,
             arrays=[np.array([0x7F0000000000, 0x7F0000001000], np.uint64)])


def _resolved(**changed) -> wire.Resolved:
    return wire.Resolved(**{**SOUND, **changed})


@pytest.mark.parametrize("changed, why", [
    (dict(row=4), "row 4 outside [0, 4)"),
    (dict(row=-435), "row -435"),
    (dict(batch_size=0), "batch_size 0"),
    (dict(batch_size=8192), "batch_size 8192"),
    (dict(num_tensors=3), "3 tensors with 2 addresses"),
    (dict(num_tensors=0, arrays=[np.zeros(0, np.uint64)]), "0 tensors"),
    (dict(arrays=[]), "no tensor addresses"),
    (dict(arrays=[np.array([(1 << 64) - 4096, 0x1000], np.uint64)]), "outside any mapping"),
    (dict(arrays=[np.array([0, 0x1000], np.uint64)]), "outside any mapping"),
])
def test_impossible_descriptions_are_named(changed: dict, why: str) -> None:
    assert why in _unsound(_resolved(**changed))


def test_a_sound_description_passes() -> None:
    assert _unsound(_resolved()) == ""


class _Peer(PeerLookups):
    """A link's lookups whose peer answers ``answer`` (the transport is not under test)."""

    peer_epoch_addr: Optional[int] = None

    def __init__(self, answer: wire.Message) -> None:
        super().__init__()
        self.answer = answer
        self.broken = ""

    def rpc(self, msg, deadline, send_plan=None) -> wire.Message:  # type: ignore[no-untyped-def]
        return self.answer

    def protocol_error(self, msg: wire.Message, why: str = "") -> NoReturn:
        self.broken = why
        raise EngineError(Fault.LINK_FAILED, why)


class _Key:
    kind = None

    def resolve_message(self) -> wire.Resolve:
        return wire.Resolve(kind="id", cluster_id=9, cache_id=1)


def test_a_lookup_answered_with_an_impossible_row_breaks_the_link() -> None:
    peer = _Peer(_resolved(row=1 << 40))
    with pytest.raises(EngineError) as caught:
        peer.lookup(_Key(), time.monotonic() + 1, cached=False)  # type: ignore[arg-type]
    assert caught.value.fault == Fault.LINK_FAILED and "row 1099511627776" in peer.broken
    remote, cached = _Peer(_resolved()).lookup(_Key(), time.monotonic() + 1, cached=False)  # type: ignore[arg-type]
    assert remote.row == 3 and not cached
