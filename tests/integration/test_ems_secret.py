"""A pool secret: the daemon and its clients prove to each other that they hold it before
credentials or memory are exchanged; without it (or with another) nothing is served."""
from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest

from ems_helpers import daemon_factory, kvcache  # noqa: F401

from datadist.engine import auth, handshake
from ems import CcConfig_v1, Ems, EmsConfig, EmsErrorCode, EmsException
from ems.pool import wire

pytestmark = pytest.mark.timeout(90)

SECRET = "pool secret 0123456789"
BLOCK = 4


def _init(server: str, secret=None, **kw) -> None:
    Ems._shutdown()
    Ems.init(EmsConfig(cc_config=CcConfig_v1(rank_id=0, device_id=0, model_id="m"), server=server, secret=secret,
                       **kw))


@pytest.fixture
def guarded(daemon_factory, tmp_path):
    path = tmp_path / "secret"
    path.write_text(SECRET + "\n")
    yield daemon_factory(extra=["--secret-file", str(path)])
    Ems._shutdown()


def test_client_with_the_secret_saves_and_loads(guarded, monkeypatch) -> None:
    monkeypatch.setenv("EMS_SECRET", SECRET)  # the environment, when EmsConfig.secret is unset
    _init(guarded.dir)
    cc = Ems.get_cc()
    kv = kvcache(layers=1, kv=2, blocks=4, block_size=BLOCK, seed=3)
    cc.register_kvcache(kv)
    want = [t[0].clone() for t in kv[0]]
    assert cc.save(slot_mapping=list(range(BLOCK)), hashes=[5], offsets=[BLOCK]).success == 1
    assert cc.load(slot_mapping=list(range(2 * BLOCK, 3 * BLOCK)), hashes=[5], offsets=[BLOCK]).success == 1
    assert all(bool((t[2] == w).all()) for t, w in zip(kv[0], want))
    assert Ems.check_health()


@pytest.mark.parametrize("secret", [None, "a wrong secret"])
def test_client_without_the_secret_is_refused(guarded, secret, monkeypatch) -> None:
    monkeypatch.delenv("EMS_SECRET", raising=False)
    with pytest.raises(EmsException) as err:
        _init(guarded.dir, secret=secret)
    assert err.value.status_code() == EmsErrorCode.EMS_INVALID_ARGUMENT
    assert SECRET not in err.value.message()
    if secret:
        assert secret not in err.value.message()


def test_client_with_a_secret_refuses_a_pool_without_one(daemon_factory) -> None:
    daemon = daemon_factory()
    with pytest.raises(EmsException) as err:
        _init(daemon.dir, secret=SECRET)
    assert err.value.status_code() == EmsErrorCode.EMS_INVALID_ARGUMENT
    assert "secret" in err.value.message()
    Ems._shutdown()


def _raw(daemon) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(5)
    s.connect(str(Path(daemon.dir) / "ems.sock"))
    return s


def test_strangers_get_a_generic_refusal_and_cannot_replay(guarded) -> None:
    deadline = time.monotonic() + 10
    with _raw(guarded) as s:  # credentials without the handshake
        wire.send_msg(s, wire.Hello(access_id="x", access_key=None, pid=1), deadline)
        reply, fds = wire.recv_msg(s, deadline, want_fds=2)
        assert fds == [] and isinstance(reply, wire.Error) and reply.message == handshake.REFUSAL
    client = handshake.ClientAuth(auth.Secret(SECRET.encode()), b"ems-client:", b"ems-server")
    with _raw(guarded) as s:  # a legitimate exchange, recorded
        wire.send_msg(s, wire.Hello(nonce=client.nonce_hex), deadline)
        challenge, _ = wire.recv_msg(s, deadline)
        proof = client.answer(challenge.nonce, challenge.proof)
        assert proof is not None
    with _raw(guarded) as s:  # replayed on a new connection: the pool's nonce is new
        wire.send_msg(s, wire.Hello(nonce=client.nonce_hex), deadline)
        fresh, _ = wire.recv_msg(s, deadline)
        assert fresh.nonce != challenge.nonce
        wire.send_msg(s, wire.Hello(nonce=client.nonce_hex, proof=proof), deadline)
        reply, fds = wire.recv_msg(s, deadline, want_fds=2)
        assert fds == [] and isinstance(reply, wire.Error) and reply.message == handshake.REFUSAL
