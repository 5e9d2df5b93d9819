"""The daemon says where in the tenant's arena a value goes (RESERVE) or lies (GET); the
client maps that arena and copies there.  An offset whose value would reach outside the
mapping is refused before a byte moves, so a broken or hostile daemon cannot make a
client write or read its own memory beyond the arena."""
from __future__ import annotations

import fcntl
import os

import numpy as np
import pytest

from datadist.engine.layout import coalesce
from ems._errors import ProtocolError
from ems.client.conn import MappedArena
from ems.client.mover import ArenaMover
from ems.kvcache import HostCopier, ValuePlan

pytestmark = pytest.mark.timeout(30)

ARENA = 1 << 16


@pytest.fixture
def mover():
    fd = os.memfd_create("arena", os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, ARENA)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)  # as the daemon's arenas are
    arena = MappedArena(fd, ARENA, "x")
    yield ArenaMover(HostCopier(), arena, verify=True), arena
    arena.close()


@pytest.mark.parametrize("off", [-64, -1, ARENA - 63, ARENA, 1 << 40, (1 << 63) - 1])
def test_offsets_reaching_outside_the_arena_are_refused(mover, off: int) -> None:
    am, arena = mover
    value = np.full(64, 0xCD, np.uint8)
    vp = ValuePlan(64, [coalesce([value.ctypes.data], [0], [64])])
    with pytest.raises(ProtocolError, match=f"offset {off}, outside its arena of {ARENA} bytes"):
        am.save(vp, off, None)
    with pytest.raises(ProtocolError, match="outside its arena"):
        am.load(vp, off, 0, None)
    assert not arena.array.any()  # nothing was written in the arena either


def test_the_last_offset_that_fits_moves_the_value(mover) -> None:
    am, arena = mover
    value = np.full(64, 0xCD, np.uint8)
    vp = ValuePlan(64, [coalesce([value.ctypes.data], [0], [64])])
    crc = am.save(vp, ARENA - 64, None)
    assert (arena.array[ARENA - 64:] == 0xCD).all()
    value[:] = 0
    assert am.load(vp, ARENA - 64, crc, None) and (value == 0xCD).all()
