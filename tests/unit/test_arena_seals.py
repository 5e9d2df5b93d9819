"""Shared memory that another process can shrink is never mapped: every arena's size is
sealed when it is made, and a mapping of a descriptor from elsewhere (a same-host peer's
arena, a pool daemon's arena or key set) is refused without that seal.  A process that
shrank a file under another's mapping would make that one's next copy fault (SIGBUS)."""
from __future__ import annotations

import errno
import fcntl
import os

import pytest

from datadist.engine.memory import Arena, PeerArena, SharedMapping, check_fixed_size
from ems.pool.keyset import KeySetView

pytestmark = pytest.mark.timeout(30)

SIZE = 1 << 16


def _memfd(seals: int = 0) -> int:
    fd = os.memfd_create("t", os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, SIZE)
    if seals:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    return fd


@pytest.mark.parametrize("others_read_only", [False, True])
def test_no_holder_of_an_arena_can_shrink_or_grow_it(others_read_only: bool) -> None:
    arena = Arena("sealed", SIZE, others_read_only=others_read_only)
    try:
        # what a peer does that opened it through /proc, or a client it was passed to
        other = os.open(f"/proc/self/fd/{arena.fd}", os.O_RDWR)
        try:
            for size in (0, SIZE // 2, SIZE * 2):
                with pytest.raises(OSError) as exc:
                    os.ftruncate(other, size)
                assert exc.value.errno == errno.EPERM
            assert os.fstat(other).st_size == SIZE
            with pytest.raises(PermissionError):  # nor seal it further (a later mapping would fail)
                fcntl.fcntl(other, fcntl.F_ADD_SEALS, 0x0010)  # F_SEAL_FUTURE_WRITE
        finally:
            os.close(other)
    finally:
        arena.close()


def test_an_unsealed_descriptor_is_not_mapped_and_a_sealed_one_is() -> None:
    open_fd, sealed = _memfd(), _memfd(fcntl.F_SEAL_SHRINK)
    try:
        with pytest.raises(OSError, match="may shrink"):
            SharedMapping(open_fd, SIZE)
        with pytest.raises(OSError, match="may shrink"):
            PeerArena.open(os.getpid(), open_fd, SIZE, 0x1000)
        with pytest.raises(OSError, match="may shrink"):
            KeySetView(open_fd, SIZE)
        with pytest.raises(OSError, match="smaller than announced"):
            PeerArena.open(os.getpid(), sealed, SIZE + 4096, 0x1000)
        mapped = PeerArena.open(os.getpid(), sealed, SIZE, 0x1000)
        assert mapped.translate(0x1000 + SIZE - 8, 8) is not None
        mapped.close()
    finally:
        os.close(open_fd)
        os.close(sealed)


def test_a_file_that_cannot_be_sealed_is_refused(tmp_path) -> None:
    path = tmp_path / "plain"
    path.write_bytes(b"\0" * SIZE)
    fd = os.open(path, os.O_RDWR)
    try:
        with pytest.raises(OSError, match="cannot be sealed"):
            check_fixed_size(fd, SIZE)
    finally:
        os.close(fd)


@pytest.mark.parametrize("fd", ["../../self/fd/0", -1, 3.0, True])
def test_a_peer_descriptor_that_is_not_a_number_is_refused(fd: object) -> None:
    with pytest.raises(OSError, match="not a descriptor number"):
        PeerArena.open(os.getpid(), fd, SIZE, 0x1000)  # type: ignore[arg-type]
