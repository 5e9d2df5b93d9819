"""EMS-compatible context caching: the Huawei EMS Python SDK's client API over our pool.

    from ems import Ems, EmsConfig, CcConfig_v1, CcKvOption
    Ems.init(EmsConfig(cc_config=CcConfig_v1(rank_id=0, device_id=0, model_id="llama2-13b")))
    cc = Ems.get_cc()
    cc.register_kvcache(kvcache)
    cc.save(slot_mapping=..., hashes=..., offsets=..., option=CcKvOption(timeout=5000))

The pool is ``ems-server`` (``python -m ems.server``); the default ``auto`` address uses
the node's daemon in ``/dev/shm/ems`` or starts one.  See ``ems/README.md`` for the files.
"""
from datadist.engine.version import __version__ as __version__

from .common.exception import EmsErrorCode, EmsException
from .config import CcConfig, CcConfig_v1, EmsConfig, KVCacheType
from .context_caching import ContextCaching
from .context_caching import ContextCaching as ContextCache_v1
from .ems import Ems
from .future import CcFuture
from .types import CcKvOption, CcResult, KvBufferWrapper, PrimaryKey

__all__ = [
    "Ems", "EmsConfig", "CcConfig", "CcConfig_v1", "CcKvOption", "CcResult", "CcFuture",
    "KvBufferWrapper", "PrimaryKey", "ContextCaching", "ContextCache_v1", "KVCacheType", "EmsException",
    "EmsErrorCode",
]
