"""Unit tests: the ``transfer_checksum`` option (``datadist.TransferChecksum``) from
LLMConfig to EngineOptions, off by default, refused with a collective backend."""
import pytest

from datadist._config import OPTION_TRANSFER_CHECKSUM, EngineOptions, LLMConfig, parse_options
from datadist._status import ParamInvalidError


def test_off_by_default_and_on_by_the_property():
    assert parse_options({}).transfer_checksum is False
    cfg = LLMConfig()
    assert cfg.transfer_checksum is False and OPTION_TRANSFER_CHECKSUM not in cfg.generate_options()
    cfg.transfer_checksum = True
    options = cfg.generate_options()
    assert options[OPTION_TRANSFER_CHECKSUM] == "1"
    assert parse_options(options).transfer_checksum is True


@pytest.mark.parametrize("text, expected", [("1", True), ("true", True), ("0", False), ("off", False)])
def test_hand_written_values(text, expected):
    assert parse_options({OPTION_TRANSFER_CHECKSUM: text}).transfer_checksum is expected


def test_bad_values_name_the_option():
    with pytest.raises(ParamInvalidError, match=r"datadist\.TransferChecksum.*transfer_checksum.*'maybe'"):
        parse_options({OPTION_TRANSFER_CHECKSUM: "maybe"})
    with pytest.raises(TypeError, match="transfer_checksum"):
        LLMConfig().transfer_checksum = "yes"
    with pytest.raises(TypeError, match="transfer_checksum"):
        EngineOptions(transfer_checksum=1)  # type: ignore[arg-type]


@pytest.mark.parametrize("backend", ["gloo", "nccl", "hccl"])
def test_not_with_a_collective_backend(backend):
    with pytest.raises(ParamInvalidError, match="TransferChecksum does not cover"):
        parse_options({OPTION_TRANSFER_CHECKSUM: "1", "llm.TransferBackend": backend})
    assert parse_options({OPTION_TRANSFER_CHECKSUM: "1", "llm.TransferBackend": "tcp"}).transfer_checksum
