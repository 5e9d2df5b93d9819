"""vLLM integration: ``DatadistConnector``, a prefill/decode KV connector on datadist.

Select it with ``KVTransferConfig(kv_connector="DatadistConnector",
kv_connector_module_path="datadist.integrations.vllm", kv_role="kv_producer" | "kv_consumer")``.
It speaks NixlConnector's request protocol (``kv_transfer_params``), so a proxy written for
NixlConnector drives it unchanged.  See docs/vllm.md.

The connector loads on first use of its name: ``ems.integrations.vllm`` builds on this
package's routing base (:mod:`.base`) and stats (:mod:`.stats`), and importing those must
not load datadist's API layer into every EMS connector.
"""
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .connector import DatadistConnector, DatadistConnectorMetadata

__all__ = ["DatadistConnector", "DatadistConnectorMetadata"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from . import connector

        return getattr(connector, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
