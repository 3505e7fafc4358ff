"""Outbox writer example: Python with asyncpg, the `outbox_enqueue(...)` function.

The order row and its event commit or roll back together; see ../CONTRACT.md for the arguments.
"""

from __future__ import annotations

import argparse
import asyncio
import json

import asyncpg

LANG = "python-asyncpg"


async def write(args: argparse.Namespace) -> None:
    conn = await asyncpg.connect(args.dsn)
    try:
        for seq in range(args.count):
            tx = conn.transaction()
            await tx.start()
            try:
                await conn.execute(
                    "INSERT INTO example_orders (order_key, seq, writer) VALUES ($1, $2, $3)",
                    args.key,
                    seq,
                    args.writer,
                )
                payload = {"writer": args.writer, "lang": LANG, "key": args.key, "seq": seq}
                headers = {"writer": args.writer, "lang": LANG, "seq": str(seq)}
                event_id = await conn.fetchval(
                    "SELECT outbox_enqueue($1, $2, $3, $4::jsonb)",
                    args.topic,
                    args.key,
                    json.dumps(payload).encode(),
                    json.dumps(headers),
                )
            except BaseException:
                await tx.rollback()
                raise
            if args.rollback:
                await tx.rollback()  # the event disappears with the order: nothing is published
            else:
                await tx.commit()
            line = {"event_id": str(event_id), "seq": seq}
            if args.rollback:
                line["rolled_back"] = True
            print(json.dumps(line), flush=True)
    finally:
        await conn.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dsn", required=True)
    parser.add_argument("--topic", required=True)
    parser.add_argument("--key", required=True)
    parser.add_argument("--count", type=int, required=True)
    parser.add_argument("--writer", required=True)
    parser.add_argument("--rollback", action="store_true")
    asyncio.run(write(parser.parse_args()))


if __name__ == "__main__":
    main()
