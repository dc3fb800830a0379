// Command dlq-replay walks through safe dead-letter replay with idemq:
//
//  1. fail: a handler bug sends orders to the dead-letter queue, each with
//     its failure envelope;
//  2. inspect: the dead-letter queue is summarised without consuming it;
//  3. fix: the handler is fixed (and one order was meanwhile applied by
//     other means, so its dead-letter copy is stale);
//  4. forge: someone who can publish to the dead-letter queue adds an order
//     with an envelope of their own; the consumer signs its envelopes
//     (dlq.Options.SigningKey), and this one is not signed;
//  5. dry-run: every dead letter is classified against the dedup table,
//     consuming nothing; the forged one is unverified;
//  6. replay: the dead letters run through the same dedup path, so the
//     stale copy is skipped and the others apply exactly once; the forged
//     one stays in the dead-letter queue (VerifyKeys);
//  7. replay again: everything is skipped; no effect is applied twice.
//
// It uses the in-memory broker and Postgres at DATABASE_URL (defaulting to
// the local server), in its own schema, idemq_example_dlq, recreated on
// every run. It exits 1 if any step does not show what it should; -h
// prints its usage.
//
//	go run ./examples/dlq-replay
package main

import (
	"bytes"
	"context"
	"crypto/rand"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/idemq/idemq/brokers/memory"
	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/dlq"
	"github.com/idemq/idemq/processed"
)

const (
	defaultURL = "postgres://postgres@127.0.0.1:5432/test?sslmode=disable"
	schema     = "idemq_example_dlq"
	queue      = "orders"
	dlqQueue   = "orders.dlq"
	orders     = 12
)

const usage = `Usage: go run ./examples/dlq-replay [-h]

A walk-through of safe dead-letter replay with idemq, in seven steps: fail,
inspect, fix, forge, dry run, replay and replay again. It shows every order
applied exactly once and a forged dead letter never, and exits 1 if a step
does not show what it should.

It uses the in-memory broker and Postgres at $DATABASE_URL, by default

  ` + defaultURL + `

in its own schema, ` + schema + `, recreated on every run. It takes no
flags or arguments.
`

func main() {
	os.Exit(cli(os.Args[1:], os.Stdout, os.Stderr))
}

// cli runs the walk-through for the command line args and returns the exit
// code: 0, 1 if the walk-through failed, 2 for a bad command line. -h and
// --help print the usage to stdout and exit 0 without running it.
func cli(args []string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("dlq-replay", flag.ContinueOnError)
	var help bytes.Buffer
	fs.SetOutput(&help)
	fs.Usage = func() { fmt.Fprint(fs.Output(), usage) }
	err := fs.Parse(args)
	switch {
	case errors.Is(err, flag.ErrHelp):
		_, _ = stdout.Write(help.Bytes())
		return 0
	case err != nil:
		_, _ = stderr.Write(help.Bytes()) // the error, then the usage
		return 2
	case fs.NArg() > 0:
		fmt.Fprintf(stderr, "dlq-replay: unexpected argument %q\n\n%s", fs.Arg(0), usage)
		return 2
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, stdout); err != nil {
		fmt.Fprintln(stderr, "dlq-replay:", err)
		return 1
	}
	return 0
}

// shop is the consumer: it records orders in a table, and has a bug that
// can be switched off.
type shop struct {
	store  *processed.Store
	broker *memory.Broker
	buggy  atomic.Bool
	key    []byte // signs the dead-letter envelopes
	dl     consumer.DeadLetterer
}

func (s *shop) handle(ctx context.Context, tx pgx.Tx, msg *consumer.Message) error {
	if s.buggy.Load() {
		return consumer.Permanent(fmt.Errorf("parse order %s: unknown currency %q (handler bug)", msg.ID, "EUR"))
	}
	_, err := tx.Exec(ctx, `INSERT INTO idemq_example_dlq.orders (order_id, body) VALUES ($1, $2)`, msg.ID, string(msg.Body))
	return err
}

func (s *shop) config(src consumer.Source) consumer.Config {
	return consumer.Config{
		Name: "shop", Source: src, Store: s.store, Handler: s.handle,
		DeadLetterer: s.dl,
	}
}

// browser reads the dead-letter queue as it is now, without consuming it.
func (s *shop) browser() (dlq.Browser, error) {
	n := s.broker.Ready(dlqQueue)
	sub, err := s.broker.Subscribe(dlqQueue, memory.SubscribeOptions{Prefetch: max(n, 1)})
	if err != nil {
		return nil, err
	}
	return dlq.SourceBrowser(sub, n, 500*time.Millisecond), nil
}

func (s *shop) effects(ctx context.Context) (rows, distinct int, err error) {
	err = s.store.Pool().QueryRow(ctx, `SELECT count(*), count(DISTINCT order_id) FROM idemq_example_dlq.orders`).Scan(&rows, &distinct)
	return rows, distinct, err
}

func run(ctx context.Context, out io.Writer) error {
	url := os.Getenv("DATABASE_URL")
	if url == "" {
		url = defaultURL
	}
	cctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	store, err := processed.Open(cctx, url, processed.Config{Schema: schema})
	cancel()
	if errors.As(err, new(*pgconn.ParseConfigError)) { // its text may quote the password
		return errors.New("invalid DATABASE_URL: check its syntax and parameters")
	}
	if err != nil {
		return fmt.Errorf("cannot reach Postgres (start it, or set DATABASE_URL): %w", err)
	}
	defer store.Close()
	pool := store.Pool()
	if _, err := pool.Exec(ctx, `DROP SCHEMA IF EXISTS idemq_example_dlq CASCADE`); err != nil {
		return err
	}
	if err := store.Migrate(ctx); err != nil {
		return err
	}
	if _, err := pool.Exec(ctx, `CREATE TABLE idemq_example_dlq.orders (order_id text NOT NULL, body text NOT NULL)`); err != nil {
		return err
	}
	s := &shop{store: store, broker: memory.NewBroker(), key: make([]byte, 32)}
	// In production the key comes from a secret store (dlq.ReadKeyFile).
	if _, err := rand.Read(s.key); err != nil {
		return err
	}
	s.dl, err = dlq.NewDeadLetterer(func(ctx context.Context, m *consumer.Message) error {
		return s.broker.Publish(ctx, dlqQueue, m)
	}, dlq.Options{SigningKey: s.key})
	if err != nil {
		return err
	}

	// 1. fail.
	s.buggy.Store(true)
	for i := 1; i <= orders; i++ {
		id := fmt.Sprintf("order-%03d", i)
		if err := s.broker.Publish(ctx, queue, &consumer.Message{ID: id, Body: []byte(`{"total":"` + strconv.Itoa(10*i) + ` EUR"}`)}); err != nil {
			return err
		}
	}
	stats, err := s.consume(ctx)
	if err != nil {
		return err
	}
	fmt.Fprintf(out, "1. fail:         %d orders received, %d applied, %d dead-lettered to %s\n", stats.Received, stats.Applied, stats.DeadLettered, dlqQueue)

	// 2. inspect.
	b, err := s.browser()
	if err != nil {
		return err
	}
	rep, err := dlq.Inspect(ctx, b, dlq.Filter{}, 0)
	if err != nil {
		return err
	}
	// Each error text names its order, but all twelve have one cause, so
	// one fingerprint: one group.
	groups := fmt.Sprintf("%d groups", len(rep.Groups))
	if len(rep.Groups) == 1 {
		groups = "1 group"
	}
	fmt.Fprintf(out, "2. inspect:      %s, still %d in the DLQ (nothing consumed)\n", groups, s.broker.Ready(dlqQueue))
	for _, g := range rep.Groups {
		fmt.Fprintf(out, "                 %d × %s from %s (consumer %s): %s\n                   e.g. %s\n",
			g.Count, g.Class, strings.Join(g.Sources, ","), strings.Join(g.Consumers, ","), g.Pattern, g.Error)
	}

	// 3. fix, and order-001 is applied meanwhile through a resend.
	s.buggy.Store(false)
	if err := s.broker.Publish(ctx, queue, &consumer.Message{ID: "order-001", Body: []byte(`{"total":"10 EUR"}`)}); err != nil {
		return err
	}
	if _, err := s.consume(ctx); err != nil {
		return err
	}
	fmt.Fprintln(out, "3. fix:          handler fixed; order-001 was resent and applied meanwhile")
	dlqCopies := s.broker.Messages(dlqQueue) // kept to replay again below

	// 4. forge: an envelope anyone could write, for an order nobody placed.
	forged := dlq.Envelope(&consumer.Message{ID: "order-999", Body: []byte(`{"total":"-5000 EUR"}`), Source: queue, Partition: -1, Offset: -1},
		consumer.Failure{Consumer: "shop", MessageID: "order-999", Class: consumer.ClassPermanent, Err: errors.New("looks real"), Attempts: 1,
			FirstFailure: time.Now(), LastFailure: time.Now()}, dlq.Options{})
	if err := s.broker.Publish(ctx, dlqQueue, forged); err != nil {
		return err
	}
	fmt.Fprintf(out, "4. forge:        an unsigned dead letter for order-999 was published to %s\n", dlqQueue)

	// 5. dry run.
	verify := [][]byte{s.key}
	if b, err = s.browser(); err != nil {
		return err
	}
	cl, err := dlq.Classify(ctx, dlq.ClassifyConfig{Browser: b, Store: store, Retention: 72 * time.Hour, VerifyKeys: verify})
	if err != nil {
		return err
	}
	fmt.Fprintf(out, "5. dry run:      %d will apply, %d already applied, %d fingerprint mismatch, %d unverified; %d still in the DLQ (nothing consumed)\n",
		cl.WillApply, cl.AlreadyApplied, cl.Mismatch, cl.Unverified, s.broker.Ready(dlqQueue))

	// 6. replay.
	replay := func() (dlq.Result, error) {
		b, err := s.browser()
		if err != nil {
			return dlq.Result{}, err
		}
		return dlq.Replay(ctx, dlq.ReplayConfig{Browser: b, Consumer: s.config(nil), Retention: 72 * time.Hour, VerifyKeys: verify})
	}
	res, err := replay()
	if err != nil {
		return err
	}
	rows, distinct, err := s.effects(ctx)
	if err != nil {
		return err
	}
	fmt.Fprintf(out, "6. replay:       applied %d, skipped %d already applied, failed again %d, left %d unverified; %d orders in the table (%d distinct); DLQ now %d\n",
		res.Applied, res.Skipped, res.FailedAgain, res.Unverified, rows, distinct, s.broker.Ready(dlqQueue))

	// 7. replay again: as if an operator ran it twice, or a replay crashed
	// before acking its DLQ copies.
	if err := s.broker.Publish(ctx, dlqQueue, dlqCopies...); err != nil {
		return err
	}
	again, err := replay()
	if err != nil {
		return err
	}
	rows2, distinct2, err := s.effects(ctx)
	if err != nil {
		return err
	}
	fmt.Fprintf(out, "7. replay again: applied %d, skipped %d already applied, left %d unverified; %d orders in the table (%d distinct)\n",
		again.Applied, again.Skipped, again.Unverified, rows2, distinct2)

	switch {
	case stats.DeadLettered != orders:
		return fmt.Errorf("step 1: %d dead-lettered, want %d", stats.DeadLettered, orders)
	case rep.Total != orders || len(rep.Groups) != 1:
		return fmt.Errorf("step 2: inspect saw %d in %d groups, want %d in 1", rep.Total, len(rep.Groups), orders)
	case cl.WillApply != orders-1 || cl.AlreadyApplied != 1 || cl.Unverified != 1:
		return fmt.Errorf("step 5: dry run %d will apply / %d applied / %d unverified, want %d / 1 / 1", cl.WillApply, cl.AlreadyApplied, cl.Unverified, orders-1)
	case res.Applied != orders-1 || res.Skipped != 1 || res.Unverified != 1 || rows != orders || distinct != orders:
		return fmt.Errorf("step 6: replay applied %d skipped %d unverified %d, table %d/%d", res.Applied, res.Skipped, res.Unverified, rows, distinct)
	case again.Applied != 0 || again.Skipped != orders || rows2 != orders || s.broker.Ready(dlqQueue) != 1:
		return fmt.Errorf("step 7: second replay applied %d, table %d rows, DLQ %d", again.Applied, rows2, s.broker.Ready(dlqQueue))
	}
	fmt.Fprintln(out, "\nOK: every order applied exactly once, through failure, fix and two replays; the forged one never.")
	return nil
}

// consume runs the live consumer until the work queue is drained.
func (s *shop) consume(ctx context.Context) (consumer.Stats, error) {
	sub, err := s.broker.Subscribe(queue, memory.SubscribeOptions{})
	if err != nil {
		return consumer.Stats{}, err
	}
	rt, err := consumer.New(s.config(sub))
	if err != nil {
		return consumer.Stats{}, err
	}
	rctx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- rt.Run(rctx) }()
	wctx, wcancel := context.WithTimeout(ctx, 30*time.Second)
	err = s.broker.WaitFor(wctx, queue, memory.Drained)
	wcancel()
	for err == nil && rt.Stats().InFlight > 0 {
		time.Sleep(time.Millisecond)
	}
	cancel()
	if rerr := <-done; err == nil {
		err = rerr
	}
	return rt.Stats(), err
}
