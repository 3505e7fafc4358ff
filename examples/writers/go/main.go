// Command outbox-writer is the Go (pgx v5) writer example: each transaction inserts a business row
// into example_orders and its event into the outbox table, so that the event is published if and
// only if the business change commits. Arguments and output: examples/writers/CONTRACT.md.
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"strconv"

	"github.com/jackc/pgx/v5"
)

const lang = "go-pgx"

type options struct {
	dsn, topic, key, writer string
	count                   int
	rollback                bool
}

// payload is the event body. A struct, not a map, so that the JSON keys keep this order.
type payload struct {
	Writer string `json:"writer"`
	Lang   string `json:"lang"`
	Key    string `json:"key"`
	Seq    int    `json:"seq"`
}

func main() {
	var o options
	flag.StringVar(&o.dsn, "dsn", "", "PostgreSQL URL, e.g. postgresql://user:pass@host:5432/db")
	flag.StringVar(&o.topic, "topic", "", "Kafka topic of the events")
	flag.StringVar(&o.key, "key", "", "ordering key (Kafka record key) and example_orders.order_key")
	flag.IntVar(&o.count, "count", 1, "number of transactions, one event each")
	flag.StringVar(&o.writer, "writer", "", "writer name, stored in the order, payload and headers")
	flag.BoolVar(&o.rollback, "rollback", false, "roll back every transaction instead of committing")
	flag.Parse()
	if o.dsn == "" || o.topic == "" || o.key == "" || o.writer == "" || o.count < 0 || flag.NArg() > 0 {
		fmt.Fprintln(os.Stderr, "outbox-writer: --dsn, --topic, --key and --writer are required, --count >= 0")
		flag.Usage()
		os.Exit(2)
	}

	if err := run(o); err != nil {
		fmt.Fprintln(os.Stderr, "outbox-writer:", err)
		os.Exit(1)
	}
}

func run(o options) error {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()

	// pgx accepts libpq URLs and key=value strings as they are; one connection is enough here.
	conn, err := pgx.Connect(ctx, o.dsn)
	if err != nil {
		return fmt.Errorf("connect: %w", err)
	}
	defer conn.Close(context.Background())

	for i := range o.count {
		eventID, err := writeOne(ctx, conn, o, i)
		if err != nil {
			return fmt.Errorf("seq %d: %w", i, err)
		}
		// Printed only once the transaction has ended the way it was asked to.
		if o.rollback {
			fmt.Printf("{\"event_id\": \"%s\", \"seq\": %d, \"rolled_back\": true}\n", eventID, i)
		} else {
			fmt.Printf("{\"event_id\": \"%s\", \"seq\": %d}\n", eventID, i)
		}
	}
	return nil
}

// writeOne runs one transaction: the business row, then its outbox row, then COMMIT (or ROLLBACK).
// Explicit Begin/Commit rather than pgx.BeginFunc, so that --rollback is a normal outcome rather
// than an error, and a failing ROLLBACK is reported instead of swallowed.
func writeOne(ctx context.Context, conn *pgx.Conn, o options, i int) (string, error) {
	tx, err := conn.Begin(ctx)
	if err != nil {
		return "", err
	}
	// Rolls back on any early return; after Commit or Rollback it is a no-op (ErrTxClosed).
	defer func() { _ = tx.Rollback(ctx) }()

	if _, err := tx.Exec(ctx,
		`INSERT INTO example_orders (order_key, seq, writer) VALUES ($1, $2, $3)`,
		o.key, i, o.writer); err != nil {
		return "", fmt.Errorf("insert example_orders: %w", err)
	}

	body, err := json.Marshal(payload{Writer: o.writer, Lang: lang, Key: o.key, Seq: i})
	if err != nil {
		return "", err
	}
	// Header values must all be strings (the table's CHECK rejects anything else), hence the
	// map[string]string; pgx encodes it as JSON for the jsonb parameter. []byte goes to bytea as is.
	headers := map[string]string{"writer": o.writer, "lang": lang, "seq": strconv.Itoa(i)}

	// event_id defaults to gen_random_uuid(); the ::text cast lets it scan straight into a string.
	var eventID string
	if err := tx.QueryRow(ctx,
		`INSERT INTO outbox (topic, ordering_key, payload, headers)
		 VALUES ($1, $2, $3, $4) RETURNING event_id::text`,
		o.topic, o.key, body, headers).Scan(&eventID); err != nil {
		return "", fmt.Errorf("insert outbox: %w", err)
	}

	if o.rollback {
		err = tx.Rollback(ctx)
	} else {
		err = tx.Commit(ctx)
	}
	if err != nil {
		return "", err
	}
	return eventID, nil
}
