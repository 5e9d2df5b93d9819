"""``llm_datadist.status``: the status codes and exceptions of :mod:`datadist`."""
from datadist import LLMException, LLMStatusCode, Status

__all__ = ["LLMStatusCode", "LLMException", "Status"]
