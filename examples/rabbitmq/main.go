// Command rabbitmq runs an idemq payment consumer on RabbitMQ.
//
// It declares a work queue with a dead-letter exchange and queue, publishes
// payments to it (some of them twice with the same MessageId, as an
// at-least-once producer would, plus a poison payment for an unknown
// account), and consumes them with a plain-function handler that credits
// account balances in Postgres. Duplicates are skipped by the dedup store and
// the poison payment goes to the dead-letter queue with its failure envelope.
// At the end it prints a summary, checks every balance against the expected
// totals, deletes its queues and exits non-zero if any effect is wrong.
//
//	go run ./examples/rabbitmq
//
// The broker comes from AMQP_URL (default amqp://guest:guest@127.0.0.1:5672/)
// and Postgres from DATABASE_URL (default the local server). The program
// works in its own schema, idemq_example_rabbitmq, recreated on every run.
// Its errors never show the database or broker password.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"net/url"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemq/idemq/brokers/rabbitmq"
	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/dlq"
	"github.com/idemq/idemq/processed"
)

const (
	defaultDatabaseURL = "postgres://postgres@127.0.0.1:5432/test?sslmode=disable"
	schema             = "idemq_example_rabbitmq"
	queue              = "idemq-example.payments"
	accounts           = 10
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
	err := run(ctx, os.Args[1:], os.Stdout)
	switch {
	case errors.Is(err, flag.ErrHelp): // -h: the usage is printed
	case errors.As(err, new(usageError)):
		fmt.Fprintln(os.Stderr, "rabbitmq example:", err)
		os.Exit(2)
	case err != nil:
		fmt.Fprintln(os.Stderr, "rabbitmq example:", err)
		os.Exit(1)
	}
}

// usageError is a mistake on the command line.
type usageError struct{ err error }

func (e usageError) Error() string { return e.err.Error() + " (run with -h for the flags)" }
func (e usageError) Unwrap() error { return e.err }

type options struct {
	payments    int
	concurrency int
	seed        uint64
	verbose     bool
}

// run runs the example, printing to out. On -h or --help it prints the
// usage to out and returns flag.ErrHelp. No error it returns contains the
// database or broker password.
func run(ctx context.Context, args []string, out io.Writer) error {
	amqpURL := os.Getenv("AMQP_URL")
	if amqpURL == "" {
		amqpURL = rabbitmq.DefaultURL
	}
	dbURL := os.Getenv("DATABASE_URL")
	if dbURL == "" {
		dbURL = defaultDatabaseURL
	}
	var o options
	fs := flag.NewFlagSet("rabbitmq", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	fs.Usage = func() {
		fmt.Fprint(fs.Output(), "Usage: go run ./examples/rabbitmq [flags]\n\nPublishes payments with duplicates and a poison payment to RabbitMQ\n($AMQP_URL), consumes them into Postgres ($DATABASE_URL) with idemq, and\nchecks every balance and the dead-letter queue.\n\nFlags:\n")
		fs.PrintDefaults()
	}
	fs.IntVar(&o.payments, "payments", 500, "distinct payments to publish")
	fs.IntVar(&o.concurrency, "concurrency", 8, "messages handled at once")
	fs.Uint64Var(&o.seed, "seed", 7, "random seed for the workload")
	fs.BoolVar(&o.verbose, "v", false, "log the runtime's decisions to stderr")
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			fs.SetOutput(out)
			fs.Usage()
			return err
		}
		return usageError{err}
	}
	if fs.NArg() > 0 {
		return usageError{fmt.Errorf("unexpected argument %q", fs.Arg(0))}
	}
	if o.payments < 1 || o.concurrency < 1 {
		return usageError{errors.New("-payments and -concurrency must be at least 1")}
	}
	logger := slog.New(slog.DiscardHandler)
	if o.verbose {
		logger = slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelDebug}))
	}

	// Queues left by an earlier run are deleted first; this also checks
	// that RabbitMQ answers before the database is touched.
	if err := deleteTopology(amqpURL); err != nil {
		return err
	}
	store, err := connect(ctx, dbURL)
	if err != nil {
		return err
	}
	defer store.Close()
	if err := setupSchema(ctx, store); err != nil {
		return err
	}

	// The Source declares the topology (the work queue dead-letters to
	// queue.dlx, bound to queue.dlq) but consumes nothing before the
	// runtime's first Receive, so the payments are published to it next.
	// Dead letters are published, confirmed, to the topology's DLQ before
	// the original is acked, on the Source's connection.
	src, err := rabbitmq.NewSource(ctx, rabbitmq.Config{URL: amqpURL, Queue: queue, Topology: &rabbitmq.Topology{}})
	if err != nil {
		return fmt.Errorf("cannot set up RabbitMQ (start it, or set AMQP_URL): %w", err)
	}
	defer func() {
		if err := deleteTopology(amqpURL); err != nil {
			fmt.Fprintln(out, "cleanup:", err)
		}
	}()
	defer func() { _ = src.Close() }() // the runtime closes it too; Close is idempotent
	dlqName := rabbitmq.DLQName(queue)

	pub, err := rabbitmq.NewPublisher(ctx, rabbitmq.PublisherConfig{URL: amqpURL, Logger: logger})
	if err != nil {
		return err
	}
	defer pub.Close()

	w := newWorkload(o)
	if err := pub.Publish(ctx, "", queue, w.msgs...); err != nil {
		return fmt.Errorf("publish: %w", err)
	}
	fmt.Fprintf(out, "published %d messages to %s: %d distinct payments, %d duplicates, %d poison\n",
		len(w.msgs), queue, o.payments, w.duplicates, w.poison)

	rt, err := consumer.New(consumer.Config{
		Name:        "ledger",
		Source:      src,
		Store:       store,
		Handler:     handle,
		Concurrency: o.concurrency,
		Retry:       consumer.RetryConfig{InitialInterval: 5 * time.Millisecond, MaxInterval: 50 * time.Millisecond},
		Logger:      logger,
	})
	if err != nil {
		return err
	}

	runCtx, cancel := context.WithCancel(ctx)
	defer cancel()
	done := make(chan error, 1)
	started := time.Now()
	go func() { done <- rt.Run(runCtx) }()
	// Run until every published message is settled.
	for s := rt.Stats(); s.Applied+s.Duplicates+s.DeadLettered < int64(len(w.msgs)) || s.InFlight > 0; s = rt.Stats() {
		select {
		case err := <-done:
			return fmt.Errorf("runtime stopped early: %v", err)
		case <-ctx.Done():
			cancel()
			<-done
			return ctx.Err()
		case <-time.After(10 * time.Millisecond):
		}
	}
	elapsed := time.Since(started)
	cancel()
	if err := <-done; err != nil {
		return err
	}

	// What is in the DLQ, read without consuming it.
	browser, err := rabbitmq.NewBrowser(ctx, rabbitmq.BrowserConfig{URL: amqpURL, Queue: dlqName})
	if err != nil {
		return err
	}
	dlqDepth := browser.Depth()
	inspection, err := dlq.Inspect(ctx, browser, dlq.Filter{}, 0) // closes the browser
	if err != nil {
		return err
	}
	return report(ctx, out, store.Pool(), rt.Stats(), dlqDepth, inspection, w, elapsed)
}

// connect opens the store on url, in the example's schema, and checks that
// the database answers. Its errors never show url: processed.Open names the
// server without credentials, and a parse error, whose text may quote the
// password, is not shown.
func connect(ctx context.Context, url string) (*processed.Store, error) {
	cctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	store, err := processed.Open(cctx, url, processed.Config{Schema: schema})
	switch {
	case err == nil:
		return store, nil
	case errors.As(err, new(*pgconn.ParseConfigError)):
		return nil, errors.New("invalid DATABASE_URL: check its syntax and parameters")
	}
	return nil, fmt.Errorf("cannot reach Postgres (start it, or set DATABASE_URL): %w", err)
}

// setupSchema recreates the example's schema: the dedup table (migrated by
// the processed store) and the business tables.
func setupSchema(ctx context.Context, store *processed.Store) error {
	pool := store.Pool()
	s := pgx.Identifier{schema}.Sanitize()
	if _, err := pool.Exec(ctx, "DROP SCHEMA IF EXISTS "+s+" CASCADE"); err != nil {
		return fmt.Errorf("reset schema: %w", err)
	}
	if err := store.Migrate(ctx); err != nil {
		return err
	}
	_, err := pool.Exec(ctx, `
CREATE TABLE `+s+`.accounts (id text PRIMARY KEY, balance_cents bigint NOT NULL DEFAULT 0);
CREATE TABLE `+s+`.ledger (payment_id text NOT NULL, account text NOT NULL, amount_cents bigint NOT NULL);
INSERT INTO `+s+`.accounts (id) SELECT 'acct-' || i FROM generate_series(1, `+fmt.Sprint(accounts)+`) i;`)
	if err != nil {
		return fmt.Errorf("create business tables: %w", err)
	}
	return nil
}

// deleteTopology deletes the example's queues and exchange, if they exist.
// Its errors show rawURL without its password.
func deleteTopology(rawURL string) error {
	u, err := url.Parse(rawURL)
	if err != nil { // its text quotes rawURL, password and all
		return errors.New("invalid AMQP_URL: percent-encode reserved characters in the user name and password")
	}
	conn, err := amqp.Dial(rawURL)
	if err != nil {
		return fmt.Errorf("cannot reach RabbitMQ at %s (start it, or set AMQP_URL): %w", u.Redacted(), err)
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		return err
	}
	for _, q := range []string{queue, rabbitmq.DLQName(queue)} {
		if _, err := ch.QueueDelete(q, false, false, false); err != nil {
			return fmt.Errorf("delete queue %s: %w", q, err)
		}
	}
	if err := ch.ExchangeDelete(queue+".dlx", false, false); err != nil {
		return fmt.Errorf("delete exchange %s.dlx: %w", queue, err)
	}
	return nil
}

// workload is the published messages and what they should add up to.
type workload struct {
	msgs       []*consumer.Message
	expected   map[string]int64 // account -> cents
	valid      int
	duplicates int
	poison     int
}

func newWorkload(o options) *workload {
	rng := rand.New(rand.NewPCG(o.seed, o.seed^0x5851f42d4c957f2d))
	w := &workload{expected: map[string]int64{}}
	var originals []*consumer.Message
	for i := 1; i <= o.payments; i++ {
		p := Payment{
			PaymentID:   fmt.Sprintf("pay-%05d", i),
			Account:     fmt.Sprintf("acct-%d", 1+rng.IntN(accounts)),
			AmountCents: int64(100 + rng.IntN(9_900)),
		}
		w.expected[p.Account] += p.AmountCents
		w.valid++
		originals = append(originals, message(p))
	}
	// The poison payment: an account that does not exist.
	originals = append(originals, message(Payment{PaymentID: "pay-poison", Account: "acct-404", AmountCents: 1}))
	w.poison = 1
	w.msgs = append(w.msgs, originals[:o.payments]...)
	// About 20% of the payments sent a second time with the same
	// MessageId, as a producer retrying after a lost confirm would.
	for i := 0; i < max(1, o.payments/5); i++ {
		w.msgs = append(w.msgs, originals[rng.IntN(o.payments)].Clone())
		w.duplicates++
	}
	rng.Shuffle(len(w.msgs), func(i, j int) { w.msgs[i], w.msgs[j] = w.msgs[j], w.msgs[i] })
	w.msgs = append(w.msgs, originals[o.payments])
	return w
}

func message(p Payment) *consumer.Message {
	body, _ := json.Marshal(p)
	return &consumer.Message{ID: p.PaymentID, Body: body, Timestamp: time.Now(),
		Headers: map[string]string{"content-type": "application/json"}}
}

// handle is the consumer: a plain function over the message and the
// transaction that also holds its dedup claim.
func handle(ctx context.Context, tx pgx.Tx, msg *consumer.Message) error {
	var p Payment
	if err := json.Unmarshal(msg.Body, &p); err != nil {
		return consumer.Permanent(fmt.Errorf("decode payment: %w", err))
	}
	tag, err := tx.Exec(ctx, `UPDATE idemq_example_rabbitmq.accounts SET balance_cents = balance_cents + $2 WHERE id = $1`, p.Account, p.AmountCents)
	if err != nil {
		return fmt.Errorf("credit account: %w", err)
	}
	if tag.RowsAffected() == 0 {
		return consumer.Permanent(fmt.Errorf("unknown account %q", p.Account))
	}
	_, err = tx.Exec(ctx, `INSERT INTO idemq_example_rabbitmq.ledger (payment_id, account, amount_cents) VALUES ($1, $2, $3)`,
		p.PaymentID, p.Account, p.AmountCents)
	return err
}

func report(ctx context.Context, out io.Writer, pool *pgxpool.Pool, s consumer.Stats, dlqDepth int, rep dlq.Report,
	w *workload, elapsed time.Duration) error {
	balances := map[string]int64{}
	rows, err := pool.Query(ctx, `SELECT id, balance_cents FROM idemq_example_rabbitmq.accounts`)
	if err != nil {
		return err
	}
	for rows.Next() {
		var id string
		var b int64
		if err := rows.Scan(&id, &b); err != nil {
			return err
		}
		balances[id] = b
	}
	if err := rows.Err(); err != nil {
		return err
	}
	var ledgerRows, distinct int
	if err := pool.QueryRow(ctx, `SELECT count(*), count(DISTINCT payment_id) FROM idemq_example_rabbitmq.ledger`).Scan(&ledgerRows, &distinct); err != nil {
		return err
	}
	wrong := 0
	for id, b := range balances {
		if b != w.expected[id] {
			wrong++
		}
	}

	fmt.Fprintf(out, "\nidemq on RabbitMQ: summary (%s)\n", elapsed.Round(time.Millisecond))
	fmt.Fprintf(out, "  received             %6d\n", s.Received)
	fmt.Fprintf(out, "  applied              %6d\n", s.Applied)
	fmt.Fprintf(out, "  duplicates skipped   %6d\n", s.Duplicates)
	fmt.Fprintf(out, "  dead-lettered        %6d\n", s.DeadLettered)
	fmt.Fprintf(out, "  DLQ depth            %6d  (%s)\n", dlqDepth, rabbitmq.DLQName(queue))
	for _, g := range rep.Groups {
		fmt.Fprintf(out, "    %d x %s: %s\n", g.Count, g.Class, g.Error)
	}
	fmt.Fprintf(out, "  ledger rows          %6d  (%d distinct payments)\n", ledgerRows, distinct)
	fmt.Fprintf(out, "  balances match       %6v  (%d accounts, %d wrong)\n", wrong == 0, len(balances), wrong)

	var problems []string
	if wrong > 0 {
		problems = append(problems, fmt.Sprintf("%d account balances differ from the expected totals", wrong))
	}
	if ledgerRows != w.valid || distinct != w.valid {
		problems = append(problems, fmt.Sprintf("%d ledger rows (%d distinct) for %d payments", ledgerRows, distinct, w.valid))
	}
	if s.Applied != int64(w.valid) || s.Duplicates != int64(w.duplicates) || s.DeadLettered != int64(w.poison) {
		problems = append(problems, fmt.Sprintf("applied %d, duplicates %d, dead-lettered %d; want %d, %d, %d",
			s.Applied, s.Duplicates, s.DeadLettered, w.valid, w.duplicates, w.poison))
	}
	if dlqDepth != w.poison || rep.Total != w.poison {
		problems = append(problems, fmt.Sprintf("the DLQ holds %d messages, want %d", dlqDepth, w.poison))
	}
	if len(problems) > 0 {
		return fmt.Errorf("EFFECTS WRONG: %s", strings.Join(problems, "; "))
	}
	fmt.Fprintln(out, "\nOK: every payment applied exactly once; the poison payment is in the DLQ.")
	return nil
}
