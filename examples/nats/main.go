// Command nats runs an idemq payment consumer on NATS JetStream.
//
// It declares the work stream PAYMENTS on the subject payments and its
// dead-letter stream PAYMENTS_DLQ on payments.dlq (deleting both first, so
// every run starts from an empty stream), publishes payments to the work
// subject (one of them twice with the same Nats-Msg-Id, which JetStream
// itself discards inside its duplicate window, plus a poison payment for an
// unknown account and one without an id), and consumes them with a handler
// that credits account balances in Postgres. The poison payments go to the
// dead-letter stream with their failure envelope, which the program reads
// back with a Browser and leaves in place for the README's `idemq dlq`
// commands. It checks every balance and exits non-zero if any effect is
// wrong.
//
// Run it twice: the second run publishes the same payments to a fresh
// stream, where JetStream's duplicate window knows nothing of them, and the
// dedup table skips every one already applied. -delete removes the streams.
//
//	go run ./examples/nats
//	go run ./examples/nats -delete
//
// The server comes from NATS_URL (default nats://127.0.0.1:4222) and
// Postgres from DATABASE_URL (default the local server). It works in its
// own schema, idemq_example_nats. Its errors never show a password.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"net/url"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	natsjs "github.com/idemq/idemq/brokers/nats"
	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/dlq"
	"github.com/idemq/idemq/processed"
)

const (
	defaultDatabaseURL = "postgres://postgres@127.0.0.1:5432/test?sslmode=disable"
	consumerName       = "ledger"
)

// Payment is the message body.
type Payment struct {
	PaymentID   string `json:"payment_id"`
	Account     string `json:"account"`
	AmountCents int64  `json:"amount_cents"`
}

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, os.Args[1:], os.Stdout); err != nil && !errors.Is(err, flag.ErrHelp) {
		fmt.Fprintln(os.Stderr, "nats:", err)
		os.Exit(1)
	}
}

func run(ctx context.Context, args []string, out io.Writer) error {
	natsURL := os.Getenv("NATS_URL")
	if natsURL == "" {
		natsURL = nats.DefaultURL
	}
	dbURL := os.Getenv("DATABASE_URL")
	if dbURL == "" {
		dbURL = defaultDatabaseURL
	}
	fs := flag.NewFlagSet("nats", flag.ContinueOnError)
	fs.SetOutput(out)
	fs.Usage = func() {
		fmt.Fprint(fs.Output(), "Usage: go run ./examples/nats [flags]\n\nPublishes payments to a JetStream stream and consumes them exactly once into\nPostgres, dead-lettering the bad ones to <stream>_DLQ ($DATABASE_URL, $NATS_URL).\n\nFlags:\n")
		fs.PrintDefaults()
	}
	schema := fs.String("schema", "idemq_example_nats", "Postgres `schema` for the accounts and the dedup table")
	stream := fs.String("stream", "PAYMENTS", "the work `stream`; its dead letters go to <stream>_DLQ")
	subject := fs.String("subject", "payments", "the work `subject`; its dead letters go to <subject>.dlq")
	del := fs.Bool("delete", false, "delete the work and dead-letter streams, and exit")
	if err := fs.Parse(args); err != nil {
		return err
	}
	dlqStream := *stream + natsjs.DLQStreamSuffix

	if err := deleteStreams(ctx, natsURL, *stream, dlqStream); err != nil {
		return err
	}
	if *del {
		fmt.Fprintf(out, "deleted streams %s and %s\n", *stream, dlqStream)
		return nil
	}

	store, err := setupDB(ctx, dbURL, *schema)
	if err != nil {
		return err
	}
	defer store.Close()
	accounts := pgx.Identifier{*schema, "accounts"}.Sanitize()

	src, err := natsjs.NewSource(ctx, natsjs.Config{
		URL:      natsURL,
		Stream:   *stream,
		Subject:  *subject,
		Durable:  consumerName,
		Topology: &natsjs.Topology{}, // <stream> on <subject>, <stream>_DLQ on <subject>.dlq
	})
	if err != nil {
		return fmt.Errorf("cannot set up JetStream (start nats-server -js, or set NATS_URL): %w", err)
	}
	defer src.Close()
	pub, err := natsjs.NewPublisher(ctx, natsjs.PublisherConfig{URL: natsURL, RejectDuplicates: true})
	if err != nil {
		return err
	}
	defer pub.Close()

	var msgs []*consumer.Message
	add := func(id string, p Payment) {
		body, _ := json.Marshal(p)
		msgs = append(msgs, &consumer.Message{ID: id, Body: body})
	}
	for i := 1; i <= 5; i++ { // good payments: applied
		id := fmt.Sprintf("pay-%05d", 70000+i)
		add(id, Payment{PaymentID: id, Account: fmt.Sprintf("acct-%02d", i), AmountCents: int64(100 * i)})
	}
	add("pay-70100", Payment{PaymentID: "pay-70100", Account: "acct-99", AmountCents: 500}) // unknown account: permanent
	add("", Payment{Account: "acct-01", AmountCents: 999})                                  // no id: missing-id
	if err := pub.Publish(ctx, *subject, msgs...); err != nil {
		return fmt.Errorf("publish: %w", err)
	}
	// An at-least-once producer retrying: the stream discards the copy.
	discarded := 0
	if err := pub.Publish(ctx, *subject, msgs[0].Clone()); errors.Is(err, natsjs.ErrDuplicate) {
		discarded++
	} else if err != nil {
		return fmt.Errorf("publish: %w", err)
	}

	rt, err := consumer.New(consumer.Config{
		Name:        consumerName,
		Store:       store,
		Source:      src,
		Concurrency: 2,
		Handler: consumer.JSON(func(ctx context.Context, tx pgx.Tx, msg *consumer.Message, p Payment) error {
			tag, err := tx.Exec(ctx, `UPDATE `+accounts+` SET balance_cents = balance_cents + $2 WHERE id = $1`, p.Account, p.AmountCents)
			if err != nil {
				return err
			}
			if tag.RowsAffected() == 0 {
				return consumer.Permanent(fmt.Errorf("unknown account %q", p.Account))
			}
			return nil
		}),
	})
	if err != nil {
		return err
	}
	runCtx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- rt.Run(runCtx) }()
	for s := rt.Stats(); s.Applied+s.Duplicates+s.DeadLettered < int64(len(msgs)) || s.InFlight > 0; s = rt.Stats() {
		select {
		case err := <-done:
			return fmt.Errorf("runtime stopped early: %v", err)
		case <-runCtx.Done():
			cancel()
			<-done
			return fmt.Errorf("not every message settled: %v", runCtx.Err())
		case <-time.After(10 * time.Millisecond):
		}
	}
	cancel()
	if err := <-done; err != nil {
		return err
	}
	s := rt.Stats()
	fmt.Fprintf(out, "published %d payments to %s (JetStream discarded %d republished copy); consumer %s applied %d, skipped %d as duplicates, dead-lettered %d\n",
		len(msgs)+discarded, *subject, discarded, consumerName, s.Applied, s.Duplicates, s.DeadLettered)

	// Read the dead letters back without consuming them.
	b, err := natsjs.NewBrowser(ctx, natsjs.BrowserConfig{URL: natsURL, Subject: natsjs.DLQSubject(*subject)})
	if err != nil {
		return err
	}
	defer b.Close()
	for {
		d, err := b.Next(ctx)
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			return err
		}
		r, err := dlq.Parse(d.Message())
		if err != nil {
			return err
		}
		fmt.Fprintf(out, "dead letter %q: %s: %s\n", r.MessageID, r.Class, r.Error)
	}
	fmt.Fprintf(out, "left in JetStream: %s with %d dead letters (go run ./examples/nats -delete removes the streams)\n", dlqStream, s.DeadLettered)

	// Every good payment credited exactly once, whatever the run.
	rows, err := store.Pool().Query(ctx, `SELECT id, balance_cents FROM `+accounts+` ORDER BY id`)
	if err != nil {
		return err
	}
	defer rows.Close()
	for i := 1; rows.Next(); i++ {
		var id string
		var bal int64
		if err := rows.Scan(&id, &bal); err != nil {
			return err
		}
		if want := int64(100 * i); bal != want {
			return fmt.Errorf("account %s has %d cents, want %d: an effect was applied twice or not at all", id, bal, want)
		}
	}
	if err := rows.Err(); err != nil {
		return err
	}
	if s.DeadLettered != 2 || s.Applied+s.Duplicates != 5 {
		return fmt.Errorf("unexpected outcome: %+v", s)
	}
	fmt.Fprintln(out, "balances check out: every payment applied exactly once")
	return nil
}

// setupDB opens the dedup store on schema, creating the schema, the dedup
// table and five accounts if they are missing.
func setupDB(ctx context.Context, dbURL, schema string) (*processed.Store, error) {
	store, err := processed.Open(ctx, dbURL, processed.Config{Schema: schema, MaxConns: 4})
	switch {
	case errors.As(err, new(*pgconn.ParseConfigError)): // its text may quote the password
		return nil, errors.New("invalid DATABASE_URL: check its syntax and parameters")
	case errors.As(err, new(*consumer.ConfigError)): // -schema
		return nil, err
	case err != nil:
		return nil, fmt.Errorf("cannot reach Postgres (start it, or set DATABASE_URL): %w", err)
	}
	s := pgx.Identifier{schema}.Sanitize()
	if _, err := store.Pool().Exec(ctx, `CREATE SCHEMA IF NOT EXISTS `+s+`;
		CREATE TABLE IF NOT EXISTS `+s+`.accounts (id text PRIMARY KEY, balance_cents bigint NOT NULL DEFAULT 0);
		INSERT INTO `+s+`.accounts SELECT 'acct-0' || i, 0 FROM generate_series(1, 5) i ON CONFLICT DO NOTHING`); err != nil {
		store.Close()
		return nil, err
	}
	if err := store.Migrate(ctx); err != nil {
		store.Close()
		return nil, err
	}
	return store, nil
}

// deleteStreams deletes the named streams, if they exist. Its errors never
// show rawURL.
func deleteStreams(ctx context.Context, rawURL string, names ...string) error {
	nc, err := nats.Connect(rawURL, nats.Timeout(5*time.Second))
	if errors.As(err, new(*url.Error)) { // its text quotes rawURL, password and all
		return errors.New("invalid NATS_URL: percent-encode reserved characters in the user names and passwords")
	}
	if err != nil {
		return fmt.Errorf("cannot reach NATS (start nats-server -js, or set NATS_URL): %w", err)
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		return err
	}
	for _, n := range names {
		if err := js.DeleteStream(ctx, n); err != nil && !errors.Is(err, jetstream.ErrStreamNotFound) {
			return fmt.Errorf("delete stream %s: %w", n, err)
		}
	}
	return nil
}
