"""vLLM integration: ``EmsConnector``, a prefix cache on the ems pool.

Select it with ``KVTransferConfig(kv_connector="EmsConnector",
kv_connector_module_path="ems.integrations.vllm", kv_role="kv_both")``.  See docs/vllm.md.
"""
from .connector import EmsConnector, EmsConnectorMetadata

__all__ = ["EmsConnector", "EmsConnectorMetadata"]
