"""TLS options: all three files or none, every unusable file refused at init naming the
option and the path (never the key's contents), no TLS with a collective backend, the
environment as a fallback, and nothing of a key in a repr."""
from __future__ import annotations

from pathlib import Path
from typing import Dict

import pytest

from datadist import LLMConfig, LLMDataDist, LLMException, LLMRole
from datadist import LLMStatusCode as S
from datadist._config import parse_options
from datadist._status import ParamInvalidError
from datadist.engine.tls import TlsConfig
from tls_helpers import Pki, make_pki

pytestmark = pytest.mark.timeout(60)

CERT, KEY, CA = "datadist.TlsCertFile", "datadist.TlsKeyFile", "datadist.TlsCaFile"
ENVS = ("DATADIST_TLS_CERT_FILE", "DATADIST_TLS_KEY_FILE", "DATADIST_TLS_CA_FILE")


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(autouse=True)
def _no_tls_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ENVS:
        monkeypatch.delenv(name, raising=False)


def _options(pki: Pki, name: str = "a", **changes: str) -> Dict[str, str]:
    options = {CERT: pki.cert(name), KEY: pki.key(name), CA: pki.ca()}
    options.update({k.replace("_", "."): v for k, v in changes.items()})
    return options


def _invalid(options: Dict[str, str]) -> str:
    with pytest.raises(ParamInvalidError) as caught:
        parse_options(options)
    assert caught.value.status_code == S.LLM_PARAM_INVALID
    return str(caught.value)


def _key_lines(pki: Pki, name: str = "a") -> list[str]:
    return [line for line in Path(pki.key(name)).read_text().splitlines() if "-----" not in line]


def test_three_files_turn_tls_on(pki: Pki) -> None:
    cfg = LLMConfig()
    cfg.tls_cert_file, cfg.tls_key_file, cfg.tls_ca_file = pki.cert("a"), pki.key("a"), pki.ca()
    options = cfg.generate_options()
    assert (options[CERT], options[KEY], options[CA]) == (pki.cert("a"), pki.key("a"), pki.ca())
    parsed = parse_options(options)
    assert parsed.tls == TlsConfig(pki.cert("a"), pki.key("a"), pki.ca())
    assert parse_options({}).tls is None
    for text in (repr(cfg), repr(parsed), repr(parsed.tls)):
        assert pki.key("a") in text  # the path shows ...
        assert not any(line in text for line in _key_lines(pki))  # ... the key never does


@pytest.mark.parametrize("missing", [(KEY,), (CERT,), (CA,), (KEY, CA)])
def test_an_incomplete_set_names_what_is_missing(pki: Pki, missing: tuple) -> None:
    options = {k: v for k, v in _options(pki).items() if k not in missing}
    message = _invalid(options)
    for key in missing:
        assert key in message
    assert "all three" in message


def test_unreadable_and_malformed_files_name_the_option_and_path(pki: Pki, tmp_path: Path) -> None:
    absent = str(tmp_path / "absent.pem")
    message = _invalid(_options(pki, datadist_TlsCaFile=absent))
    assert CA in message and absent in message and "cannot be read" in message
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate\n")
    message = _invalid(_options(pki, datadist_TlsCertFile=str(junk)))
    assert CERT in message and str(junk) in message
    # a CA file that looks like PEM but holds no usable certificate
    broken = tmp_path / "broken-ca.pem"
    broken.write_text("-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n")
    message = _invalid(_options(pki, datadist_TlsCaFile=str(broken)))
    assert CA in message and str(broken) in message
    message = _invalid(_options(pki, datadist_TlsCertFile=str(tmp_path)))  # a directory
    assert CERT in message


def test_a_key_that_is_not_the_certificates_names_the_key_and_shows_none_of_it(pki: Pki, tmp_path: Path) -> None:
    message = _invalid(_options(pki, datadist_TlsKeyFile=pki.key("b")))  # b's key, a's certificate
    assert KEY in message and pki.key("b") in message and pki.cert("a") in message
    assert not any(line in message for line in _key_lines(pki, "b"))
    fake = tmp_path / "fake.key"
    marker = "TOPSECRETKEYMATERIAL"
    fake.write_text(f"-----BEGIN PRIVATE KEY-----\n{marker}\n-----END PRIVATE KEY-----\n")
    message = _invalid(_options(pki, datadist_TlsKeyFile=str(fake)))
    assert KEY in message and str(fake) in message and marker not in message
    message = _invalid(_options(pki, datadist_TlsKeyFile=pki.cert("a")))  # a certificate, no key
    assert KEY in message and "private key" in message


def test_no_tls_with_a_collective_backend(pki: Pki) -> None:
    for backend in ("gloo", "nccl"):
        message = _invalid({**_options(pki), "llm.TransferBackend": backend})
        assert "llm.TransferBackend" in message and CERT in message
    for backend in ("auto", "shm", "tcp"):
        assert parse_options({**_options(pki), "llm.TransferBackend": backend}).tls is not None


def test_the_environment_gives_tls_when_no_option_does(pki: Pki, monkeypatch: pytest.MonkeyPatch) -> None:
    for name, path in zip(ENVS, (pki.cert("a"), pki.key("a"), pki.ca())):
        monkeypatch.setenv(name, path)
    assert parse_options({}).tls == TlsConfig(pki.cert("a"), pki.key("a"), pki.ca())
    # options win, as a whole: the environment does not complete a partial set
    message = _invalid({CERT: pki.cert("b")})
    assert KEY in message and CA in message
    monkeypatch.delenv(ENVS[1])
    message = _invalid({})
    assert ENVS[1] in message


def test_init_refuses_a_partial_configuration(pki: Pki) -> None:
    engine = LLMDataDist(LLMRole.PROMPT, 1)
    with pytest.raises(LLMException) as caught:
        engine.init({CERT: pki.cert("a"), CA: pki.ca(), "llm.listenIpInfo": "127.0.0.1:0"})
    assert caught.value.status_code == S.LLM_PARAM_INVALID and KEY in str(caught.value)
