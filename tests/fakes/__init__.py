"""In-memory test doubles for logic tests without sockets: a link's control
:class:`~datadist.engine.transports.base.Channel` and a
:class:`~datadist.engine.transports.base.Transport`."""
from .channel import FakeChannel
from .transport import FakeTransport

__all__ = ["FakeChannel", "FakeTransport"]
