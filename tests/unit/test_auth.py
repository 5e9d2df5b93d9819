"""The shared-secret primitives and where secrets must never show."""
from __future__ import annotations

import pickle

import pytest

from datadist import LLMConfig
from datadist._config import parse_options
from datadist._status import ParamInvalidError
from datadist.engine import auth, handshake

SECRET = auth.Secret(b"s3cret-value")


def test_proofs_bind_direction_nonces_and_identities() -> None:
    a, b = auth.new_nonce(), auth.new_nonce()
    base = auth.mac(SECRET, auth.SERVER, a, b, b"1", b"2")
    assert auth.verify(base, auth.mac(SECRET, auth.SERVER, a, b, b"1", b"2"))
    for other in (auth.mac(SECRET, auth.CLIENT, a, b, b"1", b"2"), auth.mac(SECRET, auth.SERVER, b, a, b"1", b"2"),
                  auth.mac(SECRET, auth.SERVER, a, b, b"12", b""), auth.mac(auth.Secret(b"x"), auth.SERVER, a, b,
                                                                             b"1", b"2")):
        assert not auth.verify(base, other)


def test_handshake_round_trip_and_tampering() -> None:
    client = handshake.ClientAuth(SECRET, b"3", b"4")
    server = handshake.ServerAuth.start(SECRET, client.nonce_hex, b"3", b"4")
    nonce, proof = server.challenge()
    answer = client.answer(nonce, proof)
    assert answer is not None and server.check(client.nonce_hex, answer)
    assert not server.check(auth.new_nonce().hex(), answer)                  # another opening's nonce
    assert handshake.ClientAuth(SECRET, b"3", b"4").answer(nonce, "00" * auth.MAC_BYTES) is None  # forged
    impostor = handshake.ServerAuth.start(auth.Secret(b"other"), client.nonce_hex, b"3", b"4")
    assert client.answer(*impostor.challenge()) is None
    assert handshake.ServerAuth.start(SECRET, "zz", b"3", b"4") is None    # malformed nonce


def test_load_secret_order_and_errors(tmp_path, monkeypatch) -> None:
    f = tmp_path / "secret"
    f.write_text("from-file\n")
    monkeypatch.setenv("DATADIST_LINK_SECRET", "from-env")
    assert auth.load_secret("inline", str(f), "DATADIST_LINK_SECRET").key() == b"inline"
    assert auth.load_secret(None, str(f), "DATADIST_LINK_SECRET").key() == b"from-file"
    assert auth.load_secret(None, None, "DATADIST_LINK_SECRET").key() == b"from-env"
    monkeypatch.delenv("DATADIST_LINK_SECRET")
    assert auth.load_secret(None, None, "DATADIST_LINK_SECRET") is None
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ValueError, match="empty"):
        auth.load_secret(None, str(tmp_path / "empty"))


def test_secrets_never_show(tmp_path) -> None:
    assert "s3cret" not in repr(SECRET) and "s3cret" not in str(SECRET)
    with pytest.raises(TypeError):
        pickle.dumps(SECRET)
    cfg = LLMConfig()
    cfg.link_secret = "s3cret-value"
    assert "s3cret" not in repr(cfg)
    options = parse_options(cfg.generate_options())
    assert "s3cret" not in repr(options)
    with pytest.raises(ParamInvalidError) as caught:
        parse_options({"datadist.LinkSecret": 12345})
    assert "12345" not in str(caught.value)
    bad = tmp_path / "secret-file"
    bad.write_text("")
    with pytest.raises(ParamInvalidError) as caught:
        parse_options({"datadist.LinkSecretFile": str(bad)})
    assert "datadist.LinkSecretFile" in str(caught.value)
