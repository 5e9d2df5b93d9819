"""How the engine names a peer's cache: :class:`CacheRef`, built by the API layer from its
key objects (``CacheKeyByIdAndIndex``, ``CacheKey``, ``BlocksCacheKey``), so the engine
never looks at their types."""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from . import wire

__all__ = ["RefKind", "CacheRef"]


class RefKind(str, Enum):
    """What a reference names; the values are the link protocol's ``Resolve.kind``."""

    ID = "id"          # a cache by id, and one of its rows
    KEY = "key"        # a row by (req_id, model_id, prefix_id)
    BLOCKS = "blocks"  # a blocks cache by model_id


@dataclass(eq=True, unsafe_hash=True)
class CacheRef:
    """A cache (and row) on cluster ``cluster_id``; only the fields of ``kind`` matter.
    ``origin`` is what errors show for it (the user's key object), not part of its
    identity; it is formatted only when a message needs it.  Treat it as immutable (it is
    the key of a link's lookup cache); it is not frozen because a frozen dataclass costs a
    microsecond more to build, on the path of every transfer."""

    kind: RefKind
    cluster_id: int
    cache_id: int = 0
    batch_index: int = 0
    req_id: int = 0
    model_id: int = 0
    prefix_id: int = 0
    origin: object = field(default=None, compare=False)

    def __str__(self) -> str:
        return repr(self) if self.origin is None else str(self.origin)

    def resolve_message(self) -> wire.Resolve:
        """The request that asks the owner what this names."""
        return wire.Resolve(kind=self.kind.value, cluster_id=self.cluster_id, cache_id=self.cache_id,
                            batch_index=self.batch_index, req_id=self.req_id, model_id=self.model_id,
                            prefix_id=self.prefix_id)

    def release_message(self) -> wire.ReleaseKey:
        """The notice that a pull consumed the row a ``KEY`` reference names."""
        return wire.ReleaseKey(cluster_id=self.cluster_id, req_id=self.req_id, model_id=self.model_id,
                               prefix_id=self.prefix_id)
