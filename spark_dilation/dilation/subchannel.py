"""L5 Twisted glue: subchannel transports and the listener/connector endpoints.

A subchannel looks like a TCP connection to the protocol on it
(``ITransport``, ``IConsumer``, ``IPushProducer``), except that it is
message-based: one ``write()`` arrives as one ``dataReceived()``.

Flow control, as in the reference: a protocol that calls
``pauseProducing()`` on its subchannel pauses reading of the whole L2
connection, so every subchannel of this wormhole pauses with it (per-
subchannel credit would need a negotiated extension). The other direction is
bounded: when the un-ACKed outbound queue passes its high-water mark, every
producer registered on a subchannel is paused until it drains.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from twisted.internet import defer
from twisted.internet.error import ConnectionDone
from twisted.internet.interfaces import (
    IAddress,
    IConsumer,
    IHalfCloseableProtocol,
    IPushProducer,
    IStreamClientEndpoint,
    IStreamServerEndpoint,
    ITransport,
)
from twisted.python.failure import Failure
from zope.interface import implementer

if TYPE_CHECKING:
    from .manager import DilationManager


@implementer(IAddress)
class SubchannelAddress:
    def __init__(self, subprotocol: str) -> None:
        self.subprotocol = subprotocol

    def __repr__(self) -> str:
        return f"SubchannelAddress({self.subprotocol!r})"


@implementer(IAddress)
class WormholeAddress:
    def __repr__(self) -> str:
        return "WormholeAddress()"


@implementer(ITransport, IConsumer, IPushProducer)
class SubChannel:
    """The transport of one subchannel."""

    def __init__(self, manager: DilationManager, scid: int, subprotocol: str) -> None:
        self._manager = manager
        self.scid = scid
        self.subprotocol = subprotocol
        self.protocol: Any = None
        self.producer: Any = None
        self.streaming = True
        self.disconnecting = False

    # ITransport
    def write(self, data: bytes) -> None:
        self._manager.subchannel_write(self.scid, bytes(data))

    def writeSequence(self, seq: list[bytes]) -> None:
        self.write(b"".join(seq))

    def loseConnection(self) -> None:
        self.disconnecting = True
        self._manager.subchannel_lose(self.scid)

    def loseWriteConnection(self) -> None:
        self._manager.subchannel_lose_write(self.scid)

    def getPeer(self) -> SubchannelAddress:
        return SubchannelAddress(self.subprotocol)

    def getHost(self) -> WormholeAddress:
        return WormholeAddress()

    # IConsumer
    def registerProducer(self, producer: Any, streaming: bool) -> None:
        self.producer, self.streaming = producer, streaming
        if self._manager.writers_paused:
            producer.pauseProducing()
        elif not streaming:
            producer.resumeProducing()

    def unregisterProducer(self) -> None:
        self.producer = None

    # IPushProducer (shared pause: see the module docstring)
    def pauseProducing(self) -> None:
        self._manager.pause_reading()

    def resumeProducing(self) -> None:
        self._manager.resume_reading()

    def stopProducing(self) -> None:
        self.loseConnection()

    # from the manager
    def _connection_lost(self, half: str | None = None, error: Exception | None = None) -> None:
        if error is not None:  # the whole Dilation connection was given up
            self.protocol.connectionLost(Failure(error))
        elif half == "read":
            IHalfCloseableProtocol(self.protocol).readConnectionLost()
        elif half == "write":
            IHalfCloseableProtocol(self.protocol).writeConnectionLost()
        else:
            self.protocol.connectionLost(Failure(ConnectionDone("subchannel closed")))


@implementer(IStreamServerEndpoint)
class SubchannelListenerEndpoint:
    def __init__(self, manager: DilationManager, subprotocol: str) -> None:
        self._manager, self._name = manager, subprotocol

    def listen(self, factory: Any) -> defer.Deferred:
        async def go() -> Any:
            await self._manager.when_dilated()
            self._manager.register_listener(self._name, factory)
            return _ListeningPort(self._name)

        return defer.ensureDeferred(go())


class _ListeningPort:
    def __init__(self, name: str) -> None:
        self.name = name

    def getHost(self) -> SubchannelAddress:
        return SubchannelAddress(self.name)

    def stopListening(self) -> None:
        pass


@implementer(IStreamClientEndpoint)
class SubchannelConnectorEndpoint:
    def __init__(self, manager: DilationManager, subprotocol: str) -> None:
        if not isinstance(subprotocol, str) or not subprotocol:
            raise ValueError("a subprotocol name must be a non-empty str")
        self._manager, self._name = manager, subprotocol

    def connect(self, factory: Any) -> defer.Deferred:
        async def go() -> Any:
            await self._manager.when_dilated()
            return self._manager.open_subchannel(self._name, factory)

        return defer.ensureDeferred(go())
