"""vLLM integration: ``DatadistConnector``, a prefill/decode KV connector on datadist.

Select it with ``KVTransferConfig(kv_connector="DatadistConnector",
kv_connector_module_path="datadist.integrations.vllm", kv_role="kv_producer" | "kv_consumer")``.
It speaks NixlConnector's request protocol (``kv_transfer_params``), so a proxy written for
NixlConnector drives it unchanged.  See docs/vllm.md.
"""
from .connector import DatadistConnector, DatadistConnectorMetadata

__all__ = ["DatadistConnector", "DatadistConnectorMetadata"]
