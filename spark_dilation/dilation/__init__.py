"""Magic Wormhole Dilation: durable, encrypted, multiplexed connections.

Pure layers (no I/O): ``l1``/``l1machine`` (mailbox records, roles,
generations), ``framing`` + ``noise`` + ``connection`` (L2), ``records``
(L3), ``keepalive``, ``redial`` (when to retry, when to give up),
``outbound``/``inbound`` (L4), ``subchannels`` (L5).
Twisted glue: ``connector`` (one generation's attempts), ``manager``,
``subchannel`` (transports and endpoints), ``api`` (``dilate()``).
"""

from .api import DilatedWormhole, dilate
from .manager import DilationFailed, DilationNoPath, DilationReconnectFailed, DilationStatus

__all__ = [
    "DilatedWormhole",
    "DilationFailed",
    "DilationNoPath",
    "DilationReconnectFailed",
    "DilationStatus",
    "dilate",
]
