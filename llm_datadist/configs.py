"""``llm_datadist.configs``: the configuration objects of :mod:`datadist`."""
from datadist import LLMClusterInfo, LLMConfig, LlmConfig, LLMRole

__all__ = ["LLMClusterInfo", "LLMRole", "LlmConfig", "LLMConfig"]
