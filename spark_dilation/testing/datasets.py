"""Datasets for transfer tests: Parquet files whose rows no compression shrinks.

A test that needs a transfer to stay under way on a throttled link needs
bytes that ``compression=auto`` cannot make small: random doubles and random
64-bit integers written as text.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq


def incompressible_parts(folder: Path, parts: int, rows: int, seed: int) -> list[pa.Table]:
    """Write ``parts`` files ``part-NNNNN.parquet`` of ``rows`` rows each into ``folder``
    (made here); ``id`` runs 0, 1, ... over all of them. Returns the tables, in order."""
    folder.mkdir(parents=True)
    rng = np.random.default_rng(seed)
    tables = []
    for part in range(parts):
        table = pa.table(
            {
                "id": np.arange(part * rows, (part + 1) * rows, dtype=np.int64),
                "x": rng.random(rows),
                "s": pa.array(rng.integers(0, 2**63, rows).astype(str)),
            }
        )
        pq.write_table(table, folder / f"part-{part:05d}.parquet")
        tables.append(table)
    return tables
