"""Arrival notices as the public API shows them (``CacheManager.wait_arrival`` and arrival
callbacks): the engine's :class:`~datadist.engine.arrivals.Notice` with a status code."""
from __future__ import annotations

from dataclasses import dataclass

from ._status import LLMStatusCode, status_code_of_fault
from .engine.arrivals import Notice

__all__ = ["Arrival", "arrival_of"]


@dataclass(frozen=True)
class Arrival:
    """One push into a local cache, as its initiator reported it.

    ``tensors`` is the range of destination tensor indices the push wrote (layer i with N
    tensors per layer is tensors ``[i*N, (i+1)*N)``); ``status`` is ``LLM_SUCCESS`` or
    why the push failed (the tensors' contents are then undefined)."""

    cluster_id: int
    cache_id: int
    tensors: range
    nbytes: int
    status: LLMStatusCode
    message: str = ""

    def layers(self, tensor_num_per_layer: int = 2) -> range:
        """The layers this push covered, for ``tensor_num_per_layer`` tensors per layer."""
        n = tensor_num_per_layer
        return range(self.tensors.start // n, -(-self.tensors.stop // n))


def arrival_of(notice: Notice) -> Arrival:
    """The public record of an engine notice."""
    return Arrival(cluster_id=notice.cluster_id, cache_id=notice.cache_id, tensors=notice.tensors,
                   nbytes=notice.nbytes, status=status_code_of_fault(notice.status), message=notice.message)
