"""``llm_datadist.data_type``: :class:`datadist.DataType`."""
from datadist import DataType

__all__ = ["DataType"]
