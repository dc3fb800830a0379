// Command sharded runs one consumer over a dedup store sharded across
// databases, and reshards it from two databases to three while the same
// messages are delivered again:
//
//  1. two shards: payments keyed by account go to the shard their account
//     maps to, where each payment's claim and its ledger row commit
//     together;
//  2. unroutable: a payment without an account is dead-lettered with the
//     reason, and claimed nowhere;
//  3. reshard to three: every payment is delivered again with new ones;
//     the accounts that moved to the new shard find their old payments on
//     their old shard, so nothing is applied twice;
//  4. move: the dedup rows of the accounts that moved go to the new shard
//     (Sharded.MoveRows), each checked there before its delete;
//  5. finish: the reshard ends (FinishReshard), and a consumer of the new
//     map alone finds every payment, delivered once more, already applied.
//
// It uses the in-memory broker and the Postgres server of DATABASE_URL
// (defaulting to the local one), where it recreates three databases,
// idemq_example_shard_0 to _2, on every run (the role needs CREATEDB). It
// exits 1 if any payment is missing or applied twice; -h prints its usage.
//
//	go run ./examples/sharded
package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/url"
	"os"
	"os/signal"
	"sort"
	"strings"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemq/idemq/brokers/memory"
	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/processed"
)

const (
	defaultURL = "postgres://postgres@127.0.0.1:5432/test?sslmode=disable"
	dbPrefix   = "idemq_example_shard_"
	queue      = "payments"
	accounts   = 40
	first      = 800 // payments before the reshard
	second     = 400 // new payments after it
)

const usage = `Usage: go run ./examples/sharded [-h]

One consumer over a dedup store sharded across databases, resharded from two
databases to three while every payment is delivered again, the moved
accounts' dedup rows moved, and the reshard finished. It shows each payment
applied exactly once, on its account's shard, and exits 1 if not.

It uses the in-memory broker and the Postgres server of $DATABASE_URL, by
default

  ` + defaultURL + `

where it recreates the databases ` + dbPrefix + `0 to 2 on every run (the
role needs CREATEDB). It takes no flags or arguments.
`

func main() {
	switch {
	case len(os.Args) == 2 && (os.Args[1] == "-h" || os.Args[1] == "--help"):
		fmt.Print(usage)
		return
	case len(os.Args) > 1:
		fmt.Fprint(os.Stderr, usage)
		os.Exit(2)
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, os.Stdout); err != nil {
		fmt.Fprintln(os.Stderr, "sharded:", err)
		os.Exit(1)
	}
}

// payment is one delivery: its id, the account it is keyed by, its amount.
func payment(i int) *consumer.Message {
	account := fmt.Sprintf("acct-%02d", i%accounts)
	return &consumer.Message{ID: fmt.Sprintf("pay-%04d", i), Key: account, Body: []byte(fmt.Sprintf("%s %d", account, 100+i%7))}
}

// handle records the payment in the ledger of the shard it was routed to:
// tx is that shard's transaction, holding the payment's claim.
func handle(ctx context.Context, tx pgx.Tx, msg *consumer.Message) error {
	var account string
	var cents int64
	if _, err := fmt.Sscanf(string(msg.Body), "%s %d", &account, &cents); err != nil {
		return consumer.Permanent(fmt.Errorf("parse payment: %w", err))
	}
	return consumer.ExecLater(ctx, tx, "INSERT INTO ledger (payment_id, account, cents) VALUES ($1, $2, $3)", msg.ID, account, cents)
}

func run(ctx context.Context, out io.Writer) error {
	base := os.Getenv("DATABASE_URL")
	if base == "" {
		base = defaultURL
	}
	urls, err := createDatabases(ctx, base, 3)
	if err != nil {
		return err
	}
	cfg := processed.Config{}
	broker := memory.NewBroker()

	// 1. Two shards.
	two, err := processed.OpenSharded(ctx, urls[:2], cfg, processed.ShardedConfig{Map: processed.ShardMap{Shards: 2}})
	if err != nil {
		return err
	}
	defer two.Close()
	if err := two.Migrate(ctx); err != nil {
		return err
	}
	for i := range 3 {
		if err := exec(ctx, urls[i], "CREATE TABLE ledger (payment_id text NOT NULL, account text NOT NULL, cents bigint NOT NULL)"); err != nil {
			return err
		}
	}
	var batch []*consumer.Message
	for i := 0; i < first; i++ {
		batch = append(batch, payment(i))
		if i%5 == 0 {
			batch = append(batch, payment(i)) // redelivered
		}
	}
	batch = append(batch, &consumer.Message{ID: "pay-none", Body: []byte("? 1")})
	if err := broker.Publish(ctx, queue, batch...); err != nil {
		return err
	}
	dl := &deadLetters{}
	st, err := consume(ctx, broker, two, dl)
	if err != nil {
		return err
	}
	counts, err := ledgerCounts(ctx, urls)
	if err != nil {
		return err
	}
	fmt.Fprintf(out, "1. two shards:    %d payments received, %d applied, %d duplicates skipped; ledger rows per shard %v\n",
		st.Received, st.Applied, st.Duplicates, counts[:2])
	fmt.Fprintf(out, "2. unroutable:    %d dead-lettered: %s\n", st.DeadLettered, dl.reason("pay-none"))

	// 3. Three shards, resharding from two.
	three, err := processed.OpenSharded(ctx, urls, cfg, processed.ShardedConfig{
		Map: processed.ShardMap{Shards: 3}, Previous: &processed.ShardMap{Shards: 2}})
	if err != nil {
		return err
	}
	defer three.Close()
	if err := three.Migrate(ctx); err != nil {
		return err
	}
	moved := map[string]bool{}
	batch = batch[:0]
	for i := 0; i < first+second; i++ {
		m := payment(i)
		r, err := three.Route(m)
		if err != nil {
			return err
		}
		if r.Shard != r.Was {
			moved[m.Key] = true
		}
		batch = append(batch, m)
	}
	if err := broker.Publish(ctx, queue, batch...); err != nil {
		return err
	}
	st, err = consume(ctx, broker, three, dl)
	if err != nil {
		return err
	}
	if counts, err = ledgerCounts(ctx, urls); err != nil {
		return err
	}
	fmt.Fprintf(out, "3. three shards:  %d accounts of %d moved to shard 2; %d payments received, %d applied, %d duplicates skipped; ledger rows per shard %v\n",
		len(moved), accounts, st.Received, st.Applied, st.Duplicates, counts)

	// 4. The rows of the moved accounts go to their new shard.
	if err := three.FinishReshard(ctx); !errors.Is(err, processed.ErrReshardUnfinished) {
		return fmt.Errorf("FinishReshard with the moved accounts' rows on their old shards: %v, want ErrReshardUnfinished", err)
	}
	var moves []string
	for from := 0; from < 2; from++ {
		rep, err := three.MoveRows(ctx, from, 2, nil)
		if err != nil {
			return err
		}
		moves = append(moves, fmt.Sprintf("%d from shard %d", rep.Moved, from))
	}
	fmt.Fprintf(out, "4. move:          the moved accounts' dedup rows to shard 2: %s, each checked there before its delete\n", strings.Join(moves, ", "))

	// 5. The reshard ends; a consumer of the new map alone.
	if err := three.FinishReshard(ctx); err != nil {
		return err
	}
	after, err := processed.OpenSharded(ctx, urls, cfg, processed.ShardedConfig{Map: processed.ShardMap{Shards: 3}})
	if err != nil {
		return err
	}
	defer after.Close()
	if err := broker.Publish(ctx, queue, batch...); err != nil {
		return err
	}
	if st, err = consume(ctx, broker, after, dl); err != nil {
		return err
	}
	fmt.Fprintf(out, "5. finish:        the reshard ended; the new map alone: %d payments delivered again, %d applied, %d duplicates skipped\n",
		st.Received, st.Applied, st.Duplicates)
	if st.Applied != 0 {
		return fmt.Errorf("%d payments applied again after the reshard", st.Applied)
	}

	// Every payment once, in all the shards together.
	seen, err := paymentShards(ctx, urls)
	if err != nil {
		return err
	}
	var bad []string
	for i := 0; i < first+second; i++ {
		if at := seen[fmt.Sprintf("pay-%04d", i)]; len(at) != 1 {
			bad = append(bad, fmt.Sprintf("pay-%04d on shards %v", i, at))
		}
	}
	if len(bad) > 0 || len(seen) != first+second {
		return fmt.Errorf("%d payments in the ledgers, want %d, each once: %s", len(seen), first+second, strings.Join(bad, "; "))
	}
	fmt.Fprintf(out, "\nOK: %d payments, each applied exactly once across the shards, through a reshard from 2 to 3.\n", first+second)
	return nil
}

// consume runs a consumer over store until what the broker holds is
// settled.
func consume(ctx context.Context, broker *memory.Broker, store *processed.Sharded, dl consumer.DeadLetterer) (consumer.Stats, error) {
	sub, err := broker.Subscribe(queue, memory.SubscribeOptions{})
	if err != nil {
		return consumer.Stats{}, err
	}
	rt, err := consumer.New(consumer.Config{Name: "ledger", Source: sub, Store: store, Handler: handle, DeadLetterer: dl, Concurrency: 4})
	if err != nil {
		return consumer.Stats{}, err
	}
	rctx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- rt.Run(rctx) }()
	deadline := time.Now().Add(time.Minute)
	for broker.Ready(queue) > 0 || broker.Unacked(queue) > 0 || rt.Stats().InFlight > 0 {
		select {
		case err := <-done:
			cancel()
			return rt.Stats(), fmt.Errorf("the consumer stopped: %w", err)
		case <-time.After(5 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			cancel()
			<-done
			return rt.Stats(), errors.New("the consumer did not settle the payments within a minute")
		}
	}
	cancel()
	return rt.Stats(), <-done
}

// deadLetters keeps each dead letter's reason.
type deadLetters struct{ reasons map[string]string }

func (d *deadLetters) DeadLetter(_ context.Context, msg *consumer.Message, f consumer.Failure) error {
	if d.reasons == nil {
		d.reasons = map[string]string{}
	}
	d.reasons[msg.ID] = fmt.Sprintf("%s (%s)", msg.ID, f.Class)
	if f.Err != nil {
		d.reasons[msg.ID] += ": " + f.Err.Error()
	}
	return nil
}

func (d *deadLetters) reason(id string) string { return d.reasons[id] }

// createDatabases recreates n databases on base's server and returns their
// URLs.
func createDatabases(ctx context.Context, base string, n int) ([]string, error) {
	u, err := url.Parse(base)
	if err != nil {
		return nil, fmt.Errorf("DATABASE_URL: %w", err)
	}
	conn, err := pgx.Connect(ctx, base)
	if err != nil {
		return nil, fmt.Errorf("connect to %s: %w", u.Redacted(), err)
	}
	defer conn.Close(ctx)
	var urls []string
	for i := range n {
		name := fmt.Sprintf("%s%d", dbPrefix, i)
		for _, q := range []string{"DROP DATABASE IF EXISTS " + name + " WITH (FORCE)", "CREATE DATABASE " + name} {
			if _, err := conn.Exec(ctx, q); err != nil {
				return nil, fmt.Errorf("%s: %w", q, err)
			}
		}
		d := *u
		d.Path = "/" + name
		urls = append(urls, d.String())
	}
	return urls, nil
}

func exec(ctx context.Context, dbURL, sql string) error {
	conn, err := pgx.Connect(ctx, dbURL)
	if err != nil {
		return err
	}
	defer conn.Close(ctx)
	_, err = conn.Exec(ctx, sql)
	return err
}

// ledgerCounts returns each shard's ledger rows.
func ledgerCounts(ctx context.Context, urls []string) ([]int64, error) {
	out := make([]int64, len(urls))
	for i, u := range urls {
		conn, err := pgx.Connect(ctx, u)
		if err != nil {
			return nil, err
		}
		err = conn.QueryRow(ctx, "SELECT count(*) FROM ledger").Scan(&out[i])
		_ = conn.Close(ctx)
		if err != nil {
			return nil, err
		}
	}
	return out, nil
}

// paymentShards returns, per payment, the shards whose ledger holds it.
func paymentShards(ctx context.Context, urls []string) (map[string][]int, error) {
	out := map[string][]int{}
	for i, u := range urls {
		conn, err := pgx.Connect(ctx, u)
		if err != nil {
			return nil, err
		}
		rows, err := conn.Query(ctx, "SELECT payment_id FROM ledger")
		if err != nil {
			_ = conn.Close(ctx)
			return nil, err
		}
		ids, err := pgx.CollectRows(rows, pgx.RowTo[string])
		_ = conn.Close(ctx)
		if err != nil {
			return nil, err
		}
		for _, id := range ids {
			out[id] = append(out[id], i)
		}
	}
	for _, at := range out {
		sort.Ints(at)
	}
	return out, nil
}
