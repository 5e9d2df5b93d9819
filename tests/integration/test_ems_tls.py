"""TLS on the pool's TCP port, with real certificates (made by ``openssl``): a client with
a certificate of the daemon's CA saves and loads; one of another CA, or without TLS, is
refused, and so is a daemon of another CA by a client."""
from __future__ import annotations

import pytest
import torch

from ems_helpers import EmsDaemon, daemon_factory, init_cc  # noqa: F401
from tls_helpers import make_pki
from waiting import PACED, until

from ems import CcConfig_v1, CcKvOption, Ems, EmsConfig, EmsException, KvBufferWrapper
from ems.client.conn import probe

pytestmark = pytest.mark.timeout(120)

SIZE = (256 << 10) + 123


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"))


def _tls_flags(pki, name: str = "a", ca: str = "ca"):
    return ["--tls-cert-file", pki.cert(name), "--tls-key-file", pki.key(name), "--tls-ca-file", pki.ca(ca)]


def _init(server: str, **tls):
    Ems._shutdown()
    Ems.init(EmsConfig(cc_config=CcConfig_v1(rank_id=0, device_id=0, model_id="m-tls"), server=server, **tls))
    return Ems.get_cc()


def _client_tls(pki, name: str = "b", ca: str = "ca"):
    return {"tls_cert_file": pki.cert(name), "tls_key_file": pki.key(name), "tls_ca_file": pki.ca(ca)}


@pytest.fixture
def tls_daemon(daemon_factory, pki):  # noqa: F811
    d = daemon_factory(tcp=True, extra=_tls_flags(pki))
    yield d
    Ems._shutdown()


def test_save_and_load_over_tls(tls_daemon, pki):
    cc = _init(tls_daemon.tcp, **_client_tls(pki))
    value = torch.randint(0, 256, (SIZE,), dtype=torch.uint8)
    assert cc.save(CcKvOption(), ["k"], [[KvBufferWrapper(value.data_ptr(), SIZE)]]).success == 1
    out = torch.zeros(SIZE, dtype=torch.uint8)
    assert cc.load(CcKvOption(), ["k"], [[KvBufferWrapper(out.data_ptr(), SIZE)]]).success == 1
    assert torch.equal(out, value)
    # A pooled connection is reused: a second call on the same connections works too.
    assert cc.load(CcKvOption(), ["k"], [[KvBufferWrapper(out.data_ptr(), SIZE)]]).success == 1
    # The unix socket stays as it was (local, guarded by its permissions).
    local = _init(tls_daemon.dir)
    assert local.exists(key_list=["k"]).success == 1


def test_the_environment_gives_the_files(tls_daemon, pki, monkeypatch):
    for role, path in (("CERT", pki.cert("b")), ("KEY", pki.key("b")), ("CA", pki.ca())):
        monkeypatch.setenv(f"EMS_TLS_{role}_FILE", path)
    cc = _init(tls_daemon.tcp)
    assert cc.exists(key_list=["absent"]).success == 0
    assert probe(tls_daemon.tcp, "ping", tls=EmsConfig().pool_tls())


@pytest.mark.parametrize("client", ["plaintext", "other CA"])
def test_clients_the_daemon_does_not_trust_are_refused(tls_daemon, pki, client):
    tls = {} if client == "plaintext" else _client_tls(pki, "x", "ca")  # trusts the daemon, not trusted
    with pytest.raises(EmsException):
        _init(tls_daemon.tcp, **tls)
    until(lambda: "refused a TLS connection" in tls_daemon.log.read_text(), every=PACED)


def test_a_daemon_of_another_ca_is_refused(daemon_factory, pki):  # noqa: F811
    d = daemon_factory(tcp=True, extra=_tls_flags(pki, "x", "other"))
    try:
        with pytest.raises(EmsException, match="TLS handshake"):
            _init(d.tcp, **_client_tls(pki))
    finally:
        Ems._shutdown()


def test_incomplete_or_unusable_tls_settings_are_refused(tmp_path, pki):
    with pytest.raises(EmsException, match="tls_cert_file.*not set"):
        _init("tcp://127.0.0.1:1", tls_key_file=pki.key("b"), tls_ca_file=pki.ca())
    d = EmsDaemon(tmp_path / "d", tcp=True, extra=["--tls-cert-file", pki.cert("a"), "--tls-key-file", pki.key("b"),
                                                  "--tls-ca-file", pki.ca()])
    with pytest.raises(AssertionError, match="--tls-key-file"):
        d.start()
