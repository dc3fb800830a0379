// Command redis is a small payment consumer on Redis Streams: it applies
// payments to account balances in Postgres exactly once, and leaves the ones
// it cannot apply, with their reasons, in the stream's dead-letter stream.
//
// It creates its tables in its own schema (idemq_redis, -schema), deletes
// the stream payments (-stream) and its dead-letter stream payments.dlq, so
// every run starts from empty streams, and publishes a few payments: five
// good ones, one of them sent twice (the same idempotency-key: applied
// once), two for an account that does not exist (dead-lettered as
// permanent) and one without an id (dead-lettered as missing-id). It
// consumes them with idemq as the consumer ledger, then lists what
// payments.dlq holds and leaves it in place for the README's `idemq dlq`
// commands. -delete removes both streams and exits.
//
//	go run ./examples/redis
//
// Redis comes from REDIS_URL (default redis://127.0.0.1:6379/0) and
// Postgres from DATABASE_URL (default the local server). For the promise to
// hold across a crash of Redis, run it with appendonly yes and appendfsync
// always; the consumer logs a warning otherwise. Its errors never show a
// password.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/signal"
	"sort"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/redis/go-redis/v9"

	"github.com/idemq/idemq/brokers/redisstream"
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
		fmt.Fprintln(os.Stderr, "redis:", err)
		os.Exit(1)
	}
}

func run(ctx context.Context, args []string, out io.Writer) error {
	redisURL := os.Getenv("REDIS_URL")
	if redisURL == "" {
		redisURL = redisstream.DefaultURL
	}
	dbURL := os.Getenv("DATABASE_URL")
	if dbURL == "" {
		dbURL = defaultDatabaseURL
	}
	fs := flag.NewFlagSet("redis", flag.ContinueOnError)
	fs.SetOutput(out)
	fs.Usage = func() {
		fmt.Fprint(fs.Output(), "Usage: go run ./examples/redis [flags]\n\nPublishes 9 payments to a Redis stream and applies them to Postgres exactly\nonce as the consumer ledger, leaving the bad ones in <stream>.dlq\n($REDIS_URL, $DATABASE_URL).\n\nFlags:\n")
		fs.PrintDefaults()
	}
	schema := fs.String("schema", "idemq_redis", "Postgres `schema` for the dedup and accounts tables")
	stream := fs.String("stream", "payments", "the `stream` to consume; dead letters go to <stream>.dlq")
	del := fs.Bool("delete", false, "delete the stream and its dead-letter stream, and exit")
	verbose := fs.Bool("v", false, "log the consumer's warnings to stderr")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if fs.NArg() > 0 {
		return fmt.Errorf("unexpected arguments: %v", fs.Args())
	}
	// Every run starts from empty streams: the dead-letter stream then
	// holds this run's dead letters only.
	if err := deleteStreams(ctx, redisURL, *stream); err != nil {
		return err
	}
	if *del {
		fmt.Fprintf(out, "deleted %s and %s\n", *stream, redisstream.DLQName(*stream))
		return nil
	}
	logger := slog.New(slog.DiscardHandler)
	if *verbose {
		logger = slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
	}

	pub, err := redisstream.NewPublisher(ctx, redisstream.PublisherConfig{URL: redisURL})
	if err != nil {
		return fmt.Errorf("cannot reach Redis (start it, or set REDIS_URL): %w", err)
	}
	defer pub.Close()
	store, err := processed.Open(ctx, dbURL, processed.Config{Schema: *schema, MaxConns: 4})
	switch {
	case errors.As(err, new(*pgconn.ParseConfigError)): // its text may quote the password
		return errors.New("invalid DATABASE_URL: check its syntax and parameters")
	case errors.As(err, new(*consumer.ConfigError)): // -schema
		return err
	case err != nil:
		return fmt.Errorf("cannot reach Postgres (start it, or set DATABASE_URL): %w", err)
	}
	defer store.Close()
	if err := store.Migrate(ctx); err != nil {
		return err
	}
	accounts := pgx.Identifier{*schema, "accounts"}.Sanitize()
	if _, err := store.Pool().Exec(ctx, `CREATE TABLE IF NOT EXISTS `+accounts+` (id text PRIMARY KEY, balance_cents bigint NOT NULL DEFAULT 0);
		INSERT INTO `+accounts+` SELECT 'acct-0' || i, 0 FROM generate_series(1, 5) i ON CONFLICT DO NOTHING`); err != nil {
		return fmt.Errorf("create %s: %w", accounts, err)
	}

	var msgs []*consumer.Message
	add := func(id string, p Payment) {
		body, _ := json.Marshal(p)
		msgs = append(msgs, &consumer.Message{ID: id, Body: body})
	}
	for i := 1; i <= 5; i++ { // good payments: applied
		id := fmt.Sprintf("pay-%05d", 70000+i)
		add(id, Payment{PaymentID: id, Account: fmt.Sprintf("acct-%02d", i), AmountCents: 1000})
	}
	add("pay-70001", Payment{PaymentID: "pay-70001", Account: "acct-01", AmountCents: 1000}) // a producer retry: skipped
	for i := 1; i <= 2; i++ {                                                                // an unknown account: permanent
		id := fmt.Sprintf("pay-%05d", 70100+i)
		add(id, Payment{PaymentID: id, Account: "acct-99", AmountCents: 500})
	}
	add("", Payment{Account: "acct-01", AmountCents: 999}) // no idempotency-key: missing-id
	if _, err := pub.Publish(ctx, *stream, msgs...); err != nil {
		return fmt.Errorf("publish: %w", err)
	}

	src, err := redisstream.NewSource(ctx, redisstream.Config{
		URL: redisURL, Stream: *stream, Group: consumerName,
	})
	if err != nil {
		return err
	}
	rt, err := consumer.New(consumer.Config{
		Name:   consumerName,
		Store:  store,
		Source: src,
		// An entry without an idempotency-key is dead-lettered, rather
		// than deduplicated by its entry id only.
		MessageID:   consumer.IDFromHeader("idempotency-key"),
		Concurrency: 2,
		Logger:      logger,
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
		_ = src.Close()
		return err
	}
	runCtx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- rt.Run(runCtx) }()
	for s := rt.Stats(); s.Applied+s.Duplicates+s.DeadLettered < int64(len(msgs)) || s.InFlight > 0; s = rt.Stats() {
		select {
		case err := <-done:
			return fmt.Errorf("runtime stopped early: %w", err)
		case <-runCtx.Done():
			cancel()
			<-done
			return fmt.Errorf("not every message settled: %w", runCtx.Err())
		case <-time.After(10 * time.Millisecond):
		}
	}
	cancel()
	if err := <-done; err != nil {
		return err
	}
	s := rt.Stats()
	fmt.Fprintf(out, "published %d payments to %s; consumer %s applied %d, skipped %d duplicates, dead-lettered %d\n",
		len(msgs), *stream, consumerName, s.Applied, s.Duplicates, s.DeadLettered)

	b, err := redisstream.NewBrowser(ctx, redisstream.BrowserConfig{URL: redisURL, Stream: redisstream.DLQName(*stream)})
	if err != nil {
		return err
	}
	rep, err := dlq.Inspect(ctx, b, dlq.Filter{Consumer: consumerName}, 0)
	if err != nil {
		return err
	}
	fmt.Fprintf(out, "%s holds %d dead letters of %s:\n", redisstream.DLQName(*stream), rep.Total, consumerName)
	sort.Slice(rep.Groups, func(i, j int) bool { return rep.Groups[i].Class < rep.Groups[j].Class })
	for _, g := range rep.Groups {
		fmt.Fprintf(out, "  %d × %s: %s\n", g.Count, g.Class, g.Error)
	}
	fmt.Fprintf(out, "(go run ./examples/redis -delete removes the streams)\n")
	return nil
}

// deleteStreams deletes stream and its dead-letter stream. Its errors
// never show redisURL.
func deleteStreams(ctx context.Context, redisURL, stream string) error {
	opt, err := redis.ParseURL(redisURL)
	if err != nil { // its text may quote redisURL, password and all
		return errors.New("invalid REDIS_URL: want redis://[user:password@]host:port/db, reserved characters percent-encoded")
	}
	c := redis.NewClient(opt)
	defer c.Close()
	if err := c.Del(ctx, stream, redisstream.DLQName(stream)).Err(); err != nil {
		return fmt.Errorf("delete %s and %s at %s (start Redis, or set REDIS_URL): %w", stream, redisstream.DLQName(stream), opt.Addr, err)
	}
	return nil
}
