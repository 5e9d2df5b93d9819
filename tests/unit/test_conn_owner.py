"""Which process holds the other end of a local TCP connection (datadist/engine/conn_owner.py):
what a same-host peer's claimed identity is checked against before its memory is mapped."""
from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from datadist.engine.conn_owner import holds_other_end

pytestmark = pytest.mark.timeout(30)


@pytest.mark.parametrize("host, family, dualstack", [("127.0.0.1", socket.AF_INET, False),
                                                     ("::1", socket.AF_INET6, False),
                                                     ("::", socket.AF_INET6, True)])
def test_the_process_holding_the_other_end_is_found(host: str, family: int, dualstack: bool) -> None:
    with socket.create_server((host, 0), family=family, dualstack_ipv6=dualstack) as server:
        port = server.getsockname()[1]
        child = subprocess.Popen([sys.executable, "-c", "import socket, sys; c = socket.create_connection("
                                  f"({'127.0.0.1' if dualstack else host!r}, {port})); sys.stdin.read()"],
                                 stdin=subprocess.PIPE)
        try:
            conn, _ = server.accept()
            with conn:
                assert holds_other_end(child.pid, conn)
                assert not holds_other_end(os.getpid(), conn)  # this process holds this end only
                assert not holds_other_end(1, conn)
        finally:
            child.kill()
            child.wait()


def test_both_ends_in_one_process_and_a_closed_connection() -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:
        client = socket.create_connection(server.getsockname())
        conn, _ = server.accept()
        assert holds_other_end(os.getpid(), client) and holds_other_end(os.getpid(), conn)
        conn.close()
        assert not holds_other_end(os.getpid(), client)  # nobody holds it now
        client.close()
