"""``llm_datadist.v2.llm_datadist``: :class:`datadist.LLMDataDist`."""
from datadist import LLMDataDist

__all__ = ["LLMDataDist"]
