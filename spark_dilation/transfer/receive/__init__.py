"""The reader's side of a transfer; this package is the Spark source's one door.

On the driver, ``receive_session`` agrees on the transfer over the code (or
receives a file), ``start_registry_host`` starts the lane registry for the
application's lifetime and ``start_lanes`` lets lanes stage while Spark
plans. In a read task, ``read_lane`` emits one lane's rows. Under them: the
lane (:mod:`.lane`), its staging (:mod:`.staging`), the read task's side
(:mod:`.laneread`), the lane host (:mod:`.lanehost`), the registry host
(:mod:`.registryhost`), a lane host's link to it (:mod:`.registrylink`) and
copies between machines (:mod:`.laneshare`).
Names load on first use: a read task imports no more than it runs.
"""

from __future__ import annotations

from ...lazy import exports

_EXPORTS = {
    "ReceivedFileResult": "..meet.session",
    "StreamReceiver": ".streamreceiver",
    "load_record": "..meet.record",
    "receive_session": "..meet.session",
    "read_lane": ".laneread",
    "start_lanes": ".laneread",
    "start_registry_host": ".registryhost",
}

__all__ = sorted(_EXPORTS)
__getattr__ = exports(__name__, _EXPORTS)
