"""Wire codec, checksum and the disk tier on its own."""
from __future__ import annotations

import struct

import numpy as np
import pytest

from datadist.engine.codec import HEADER_SIZE
from ems._errors import ProtocolError
from ems.pool import wire
from ems.pool.checksum import checksum
from ems.server.tiers import make_tier
from ems.server.tiers.disk import DiskTier, parse_size


def test_codec_round_trip_and_errors():
    msg = wire.Reserve(["a\x00b"], [10], True)
    frame = wire.encode(msg)
    assert wire.decode(frame) == msg
    head = bytearray(frame[:HEADER_SIZE])
    head[5] = 200  # an op no message has (header: magic, version, op, ...)
    with pytest.raises(ProtocolError):
        wire.decode(bytes(head) + frame[HEADER_SIZE:])
    with pytest.raises(ProtocolError):  # a body one byte longer than its layout
        wire.decode(struct.pack("<4sBBHII", wire.MAGIC, wire.PROTOCOL_VERSION, wire.Op.RESERVE, 0,
                                len(frame) - HEADER_SIZE + 1, 0) + frame[HEADER_SIZE:] + b"\0")
    with pytest.raises(ProtocolError):
        wire.decode(b"not a frame at all")
    for keys in ([], [""], ["x\x1ey", "z\x1f"], ["\x1e\x1f\x1d\x1c\n", "é\x00日"]):
        msg = wire.Exists(keys, True)  # key lists travel joined, whatever they contain
        assert wire.decode(wire.encode(msg)) == msg
    frame = wire.encode(wire.Exists(["a", "b"]))
    with pytest.raises(ProtocolError):
        wire.decode(frame[:-1])  # key text shorter than announced
    recount = bytearray(frame)
    struct.pack_into("<I", recount, HEADER_SIZE + 1, 3)  # after local_only: the key count
    with pytest.raises(ProtocolError):
        wire.decode(bytes(recount))  # another key count than the text holds
    with pytest.raises(TypeError):
        class Dup(wire.Message):  # noqa: F841 - registering an op twice is refused
            OP = wire.Op.PING


def test_checksum_detects_changes():
    data = np.random.default_rng(0).integers(0, 255, 3 * 4096 + 17, dtype=np.uint8)
    base = checksum(data)
    assert checksum(data.copy()) == base and checksum(bytes(data)) == base
    for pos in (0, 4095, 5000, len(data) - 1):
        d = data.copy()
        d[pos] ^= 1
        assert checksum(d) != base
    swapped = np.concatenate([data[4096:8192], data[:4096], data[8192:]])
    assert checksum(swapped) != base  # block order matters
    words = data[:3 * 4096].view("<u8").copy()
    for i, j in ((0, 1), (3, 500), (512, 1023)):  # words that change places inside a block
        moved = words.copy()
        moved[[i, j]] = moved[[j, i]]
        assert checksum(np.concatenate([moved.view(np.uint8), data[3 * 4096:]])) != base, (i, j)
    assert checksum(data[:-1]) != base


def test_disk_tier_store_scan_corrupt_capacity(tmp_path):
    disk = DiskTier(str(tmp_path), 3 * 4096)
    vals = {f"k{i}": np.full(4096, i, np.uint8) for i in range(4)}
    for k, v in vals.items():
        assert disk.store("t", k, memoryview(v), checksum(v))
    assert disk.exists("t", ["k0", "k1", "k2", "k3"]) == [False, True, True, True]  # LRU evicted k0
    again = DiskTier(str(tmp_path), 3 * 4096)  # a restart finds the values again
    buf = bytearray(4096)
    assert again.load("t", "k2", lambda n: memoryview(buf)) == checksum(vals["k2"])
    assert bytes(buf) == bytes(vals["k2"])
    assert again.load("other", "k2", lambda n: memoryview(buf)) is None  # tenants apart
    path = next(p for p in tmp_path.glob("*.val") if p.stat().st_size > 0)
    path.write_bytes(path.read_bytes()[:-10])  # truncated file: unreadable, dropped
    misses = [again.load("t", k, lambda n: memoryview(bytearray(n))) for k in ("k1", "k2", "k3")]
    assert misses.count(None) == 1 and len(list(tmp_path.glob("*.val"))) == 2
    assert parse_size("64M") == 64 << 20 and parse_size("1GiB") == 1 << 30
    assert isinstance(make_tier(f"disk://{tmp_path}?capacity=1M"), DiskTier)
    with pytest.raises(ValueError):
        make_tier("ftp://x")
