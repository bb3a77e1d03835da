"""The notebook API driven from a Spark Connect session, as its own process.

Tests start it with ``subprocess`` (a Connect client and its local server
need their own process)::

    python -m spark_dilation.testing.connect_notebook send    --mailbox URL --rows N
    python -m spark_dilation.testing.connect_notebook receive --mailbox URL --code C --out DIR

``send`` prints ``{"code": ...}`` as soon as :func:`spark_dilation.send`
returns, then ``{"report": ...}`` when the transfer is done. ``receive``
loads with :func:`spark_dilation.receive`, runs ``show()`` then ``count()``
and writes the rows to ``--out`` as Parquet (from the Connect server).
Rows are :data:`COLUMNS` of ``spark.range(N)``, so a test can rebuild them.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

COLUMNS = ("id", "id * 2 AS twice", "concat('row ', CAST(id AS STRING)) AS name")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("side", choices=["send", "receive"])
    p.add_argument("--mailbox", required=True)
    p.add_argument("--relay")
    p.add_argument("--code")
    p.add_argument("--rows", type=int, default=10_000)
    p.add_argument("--out")
    p.add_argument("--staging-dir")
    p.add_argument("--remote", default="local[2]", help="local[2] (a server of its own) or sc://")
    args = p.parse_args(argv)

    import spark_dilation
    from spark_dilation.testing.spark_peer import session

    spark = session("local[2]", f"connect-notebook-{args.side}", remote=args.remote)
    options: dict[str, Any] = {"mailbox": args.mailbox}
    if args.relay:
        options["relay"] = args.relay
    result: dict[str, Any] = {"session": type(spark).__module__}
    try:
        if args.side == "send":
            df = spark.range(0, args.rows, numPartitions=4).selectExpr(*COLUMNS)
            started = time.monotonic()
            handle = spark_dilation.send(df, code=args.code, **options)
            print(
                json.dumps({"code": handle.code, "returned_in": time.monotonic() - started}),
                flush=True,
            )
            handle.wait(600)
            result["done"] = True
        else:
            if args.staging_dir:
                options["staging_dir"] = args.staging_dir
            df = spark_dilation.receive(spark, args.code, **options)
            result["schema"] = df.schema.simpleString()
            df.show(3)
            result["count"] = df.count()
            df.write.mode("overwrite").parquet(args.out)
    except Exception as e:
        result["error"] = f"{type(e).__name__}: {e}"[:3000]
        print(json.dumps(result), flush=True)
        return 1
    print(json.dumps(result), flush=True)
    spark.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
