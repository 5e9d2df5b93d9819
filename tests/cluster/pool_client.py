"""A pool client process for the cluster tests, driven line by line over stdin/stdout.

``python pool_client.py SERVER`` connects to the pool ``SERVER`` (a daemon's directory) and
answers each JSON command line with one JSON line:

- ``["save", keys]``: saves each key's value (its own bytes, derived from the key) as one
  V0 key; answers ``{key: true|false}``.
- ``["load", keys]``: loads each key into a zeroed buffer; answers ``{key: "hit" | "miss" |
  "wrong" | "timeout"}`` (``wrong``: the load succeeded with bytes that are not the key's
  value; ``timeout``: the call raised ``EMS_IO_TIMEOUT``).
- ``["health"]``: ``Ems.check_health()``.

Every key is loaded on its own, so one answer is per key.  Errors are answered as
``{"error": "..."}`` and the client goes on.
"""
from __future__ import annotations

import json
import sys
import zlib

import torch

from ems import CcKvOption, Ems, EmsErrorCode, EmsException, KvBufferWrapper, PrimaryKey
from ems_helpers import init_cc

#: Bytes of every value: 4 KiB.
ELEMENTS = 1024


def value(key: str) -> torch.Tensor:
    """The value saved under ``key``: seeded from the key, so any process can check it."""
    return torch.randn(ELEMENTS, generator=torch.Generator().manual_seed(zlib.crc32(key.encode())))


def _buffer(t: torch.Tensor) -> KvBufferWrapper:
    return KvBufferWrapper(t.data_ptr, t.numel() * t.element_size())


def main() -> None:
    cc = init_cc(sys.argv[1], model_id="m-cluster")
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        try:
            if cmd[0] == "save":
                out = {k: cc.save(CcKvOption(), [PrimaryKey(k, k)], [[_buffer(value(k))]]).success == 1
                       for k in cmd[1]}
            elif cmd[0] == "load":
                out = {}
                for k in cmd[1]:
                    got = torch.zeros(ELEMENTS)
                    try:
                        hit = cc.load(CcKvOption(), [PrimaryKey(k, k)], [[_buffer(got)]]).success == 1
                    except EmsException as exc:
                        if exc.status_code() != EmsErrorCode.EMS_IO_TIMEOUT:
                            raise
                        out[k] = "timeout"
                        continue
                    out[k] = ("hit" if torch.equal(got, value(k)) else "wrong") if hit else "miss"
            else:
                out = {"health": Ems.check_health()}
        except Exception as exc:  # answered, so the test shows what the client saw
            out = {"error": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(out), flush=True)
    Ems._shutdown()


if __name__ == "__main__":
    main()
