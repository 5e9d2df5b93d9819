"""Plain stand-ins for the pieces of vLLM that the connectors' modules import, for tests
that drive the connectors' halves without vLLM installed (in child interpreters whose
``PYTHONPATH`` holds the folder :func:`write_vllm_standins` filled)."""
from __future__ import annotations

from pathlib import Path

__all__ = ["write_vllm_standins"]

#: The pieces of vLLM the connector's modules import, as plain stand-ins (what the worker
#: half asks of vLLM at run time is its tensor-parallel rank).
_VLLM = {
    "vllm/__init__.py": "",
    "vllm/distributed/__init__.py": "",
    "vllm/distributed/parallel_state.py": "def get_tensor_model_parallel_rank():\n    return 0\n\n\n"
                                          "def get_tensor_model_parallel_world_size():\n    return 1\n",
    "vllm/distributed/kv_transfer/__init__.py": "",
    "vllm/distributed/kv_transfer/kv_connector/__init__.py": "",
    "vllm/distributed/kv_transfer/kv_connector/v1/__init__.py": "",
    "vllm/distributed/kv_transfer/kv_connector/v1/base.py": (
        "import enum\n\n\nclass KVConnectorRole(enum.Enum):\n    SCHEDULER = 0\n    WORKER = 1\n\n\n"
        "class KVConnectorBase_V1:\n    pass\n\n\nclass KVConnectorTransferResults:\n    pass\n\n\n"
        "class KVConnectorHandshakeMetadata:\n    pass\n\n\nclass KVConnectorMetadata:\n    pass\n"),
    "vllm/distributed/kv_events.py": (
        "MEDIUM_CPU = 'CPU'\n\n\nclass BlockStored:\n    def __init__(self, **kw):\n        self.__dict__.update(kw)\n\n\n"
        "class BlockRemoved(BlockStored):\n    pass\n"),
    # vLLM's stats base is a dataclass holding ``data``; the worker records into it.
    "vllm/distributed/kv_transfer/kv_connector/v1/metrics.py": (
        "import dataclasses\n\n\n@dataclasses.dataclass\nclass KVConnectorStats:\n"
        "    data: dict = dataclasses.field(default_factory=dict)\n\n\nclass KVConnectorPromMetrics:\n    pass\n"),
}


def write_vllm_standins(folder: Path) -> None:
    """Write the stand-in ``vllm`` package into ``folder``."""
    for name, text in _VLLM.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(text)
