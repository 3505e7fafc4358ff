// Outbox writer example (CONTRACT.md): each order row and its outbox event commit in one transaction.
import { parseArgs } from "node:util";
import pg from "pg";

const LANG = "node-pg";

interface Options {
  dsn: string;
  topic: string;
  key: string;
  count: number;
  writer: string;
  rollback: boolean;
}

function parseOptions(): Options {
  const { values } = parseArgs({
    options: {
      dsn: { type: "string" },
      topic: { type: "string" },
      key: { type: "string" },
      count: { type: "string" },
      writer: { type: "string" },
      rollback: { type: "boolean", default: false },
    },
  });
  const { dsn, topic, key, count, writer } = values;
  if (!dsn || !topic || !key || count === undefined || !writer) {
    throw new Error("usage: writer --dsn DSN --topic TOPIC --key KEY --count N --writer NAME [--rollback]");
  }
  if (!/^\d+$/.test(count)) {
    throw new Error(`--count must be a non-negative integer, got ${JSON.stringify(count)}`);
  }
  return { dsn, topic, key, count: Number(count), writer, rollback: values.rollback ?? false };
}

// One transaction: the business row, then the outbox row, then COMMIT (or ROLLBACK on request).
async function writeOne(client: pg.Client, opts: Options, seq: number): Promise<string> {
  await client.query("BEGIN");
  try {
    await client.query("INSERT INTO example_orders (order_key, seq, writer) VALUES ($1, $2, $3)", [
      opts.key,
      seq,
      opts.writer,
    ]);
    // pg sends parameters as text, so the JSON goes over as a string and the casts make it jsonb.
    // The function stores the payload's jsonb text as UTF-8 bytes and adds a content-type header.
    const payload = { writer: opts.writer, lang: LANG, key: opts.key, seq };
    const headers = { writer: opts.writer, lang: LANG, seq: String(seq) }; // header values must be strings
    const { rows } = await client.query<{ event_id: string }>(
      "SELECT outbox_enqueue_json($1, $2, $3::jsonb, $4::jsonb) AS event_id",
      [opts.topic, opts.key, JSON.stringify(payload), JSON.stringify(headers)],
    );
    await client.query(opts.rollback ? "ROLLBACK" : "COMMIT");
    return rows[0].event_id;
  } catch (err) {
    // Leave the connection usable and keep the original error, not a failure of the ROLLBACK itself.
    await client.query("ROLLBACK").catch(() => undefined);
    throw err;
  }
}

async function main(): Promise<void> {
  const opts = parseOptions();
  const client = new pg.Client({ connectionString: opts.dsn });
  await client.connect();
  try {
    // In order: the next transaction starts only after the previous one has committed.
    for (let seq = 0; seq < opts.count; seq++) {
      const eventId = await writeOne(client, opts, seq);
      // Same spacing as the contract's example line.
      const extra = opts.rollback ? ', "rolled_back": true' : "";
      process.stdout.write(`{"event_id": ${JSON.stringify(eventId)}, "seq": ${seq}${extra}}\n`);
    }
  } finally {
    await client.end();
  }
}

try {
  await main();
} catch (err) {
  console.error(`writer (${LANG}): ${err instanceof Error ? err.message : String(err)}`);
  process.exitCode = 1;
}
