"""``python -m ems``: the version, and whether a pool answers at the default address
(``EMS_SERVER``, else the node's ``/dev/shm/ems``) or at ``--server``.

This ``ems`` is the EMS SDK's client API over this project's ``ems-server``; another
public package also uses the import name ``ems`` (docs/migration.md tells them apart).
Exit code 0 when a pool answers, 1 when none does.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import List, Optional

from . import __version__
from ._errors import EmsError
from .client.conn import probe
from .config import ENV_SERVER
from .server.daemon import DEFAULT_DIR


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ems", description=__doc__.split("\n")[0])
    ap.add_argument("--version", action="version", version=f"ems {__version__}")
    ap.add_argument("--server", default=None, help="pool address: DIR, unix://PATH or tcp://HOST:PORT")
    args = ap.parse_args(argv)
    server = args.server or os.environ.get(ENV_SERVER) or DEFAULT_DIR
    print(f"ems {__version__} (this project's EMS-compatible client; package at {os.path.dirname(__file__)})")
    try:
        instance = probe(server, "ping", 3.0)
    except EmsError as exc:
        print(f"pool at {server}: not answering ({exc})")
        return 1
    print(f"pool at {server}: answering (daemon instance {instance})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
