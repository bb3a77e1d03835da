"""The lane host: one lane's receiver in a process of its own.

``read_lane`` starts it (``python -m spark_dilation.transfer.lanehost SPEC
LANE``) so that receiving does not depend on the Spark Python worker that
asked for the lane: Spark ends a worker when ``show()`` has its rows and
kills idle ones. The host holds the lane's lock, stages what arrives, and
exits when the lane is done (``manifest.json``), failed (``error.json``) or
heard nothing for ``idle_timeout`` seconds.
"""

from __future__ import annotations

import logging
import os
import pickle
import sys

from .lane import LaneStaging, lane_receiver, write_host_error


def main(argv: list[str] | None = None) -> int:
    spec_path, lane_text = argv if argv is not None else sys.argv[1:]
    lane = int(lane_text)
    with open(spec_path, "rb") as f:
        spec = pickle.load(f)
    os.unlink(spec_path)  # it holds the transfer secret
    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s lane-{lane} %(name)s %(levelname)s %(message)s"
    )
    logging.getLogger("twisted").setLevel(logging.WARNING)
    staging = LaneStaging(spec.options.staging_root, spec.transfer_id, lane)
    receiver = lane_receiver(spec, lane)
    if receiver is None:
        return 0  # another host holds the lane
    (staging.dir / "host.pid").write_text(str(os.getpid()))
    error = receiver.wait_finished()
    if error is not None:
        write_host_error(staging, error)
    receiver.stop(linger=2.0)
    logging.info("lane %d host done: %s", lane, receiver.error or "complete")
    return 0


if __name__ == "__main__":
    sys.exit(main())
