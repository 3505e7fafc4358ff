"""Outbox writer example: Python with psycopg 3, a plain `INSERT INTO outbox ... RETURNING`.

The order row and its event commit or roll back together; see ../CONTRACT.md for the arguments.
"""

from __future__ import annotations

import argparse
import json

import psycopg
from psycopg.types.json import Jsonb

LANG = "python-psycopg"


class Rollback(Exception):  # noqa: N818 - a request, not an error
    """Leaving the transaction block with this rolls it back."""


def write(args: argparse.Namespace) -> None:
    with psycopg.connect(args.dsn) as conn:
        for seq in range(args.count):
            event_id = None
            try:
                with conn.transaction():
                    conn.execute(
                        "INSERT INTO example_orders (order_key, seq, writer) VALUES (%s, %s, %s)",
                        (args.key, seq, args.writer),
                    )
                    payload = {"writer": args.writer, "lang": LANG, "key": args.key, "seq": seq}
                    headers = {"writer": args.writer, "lang": LANG, "seq": str(seq)}
                    row = conn.execute(
                        "INSERT INTO outbox (topic, ordering_key, payload, headers) "
                        "VALUES (%s, %s, %s, %s) RETURNING event_id",
                        (args.topic, args.key, json.dumps(payload).encode(), Jsonb(headers)),
                    ).fetchone()
                    assert row is not None
                    event_id = row[0]
                    if args.rollback:
                        raise Rollback
            except Rollback:
                pass
            line = {"event_id": str(event_id), "seq": seq}
            if args.rollback:
                line["rolled_back"] = True
            print(json.dumps(line), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dsn", required=True)
    parser.add_argument("--topic", required=True)
    parser.add_argument("--key", required=True)
    parser.add_argument("--count", type=int, required=True)
    parser.add_argument("--writer", required=True)
    parser.add_argument("--rollback", action="store_true")
    write(parser.parse_args())


if __name__ == "__main__":
    main()
