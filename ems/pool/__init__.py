"""What the client and the daemon share: the wire protocol and the value checksum."""
from .checksum import checksum
from .wire import PROTOCOL_VERSION, Op

__all__ = ["checksum", "PROTOCOL_VERSION", "Op"]
