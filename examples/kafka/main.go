// Command kafka runs an idemq order consumer on Kafka.
//
// It creates an orders topic and a dead-letter topic, publishes orders to
// them (some of them twice with the same idempotency-key, as a producer
// retrying after a lost acknowledgement would, plus a poison order for an
// unknown customer), and consumes them as a consumer group with a
// plain-function handler that books each order in Postgres, in batch mode:
// up to -batch orders are claimed and applied in one transaction. Duplicates
// are skipped by the dedup store, and the poison order is isolated from its
// batch and goes to the dead-letter topic with its failure envelope. At the
// end it prints a summary, checks every customer's total and the group's
// committed offsets, deletes its topics and exits non-zero if any effect is
// wrong.
//
//	go run ./examples/kafka
//
// By default it starts an in-process Kafka-protocol cluster (franz-go's
// kfake) on 127.0.0.1, so it runs anywhere; set KAFKA_BROKERS
// (host:port,...) to use a real cluster instead. Postgres comes from
// DATABASE_URL (default the local server). The program works in its own
// schema, idemq_example_kafka, recreated on every run.
package main

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	mrand "math/rand/v2"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	kafkago "github.com/segmentio/kafka-go"
	"github.com/twmb/franz-go/pkg/kfake"

	"github.com/idemq/idemq/brokers/kafka"
	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/dlq"
	"github.com/idemq/idemq/processed"
)

const (
	defaultDatabaseURL = "postgres://postgres@127.0.0.1:5432/test?sslmode=disable"
	schema             = "idemq_example_kafka"
	customers          = 10
	partitions         = 3
)

// Order is the message body.
type Order struct {
	OrderID     string `json:"order_id"`
	Customer    string `json:"customer"`
	AmountCents int64  `json:"amount_cents"`
}

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, os.Args[1:], os.Stdout); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return // the usage was printed
		}
		fmt.Fprintln(os.Stderr, "kafka example:", err)
		os.Exit(1)
	}
}

type options struct {
	orders      int
	concurrency int
	batch       int
	seed        uint64
	verbose     bool
}

func run(ctx context.Context, args []string, out io.Writer) error {
	var o options
	fs := flag.NewFlagSet("kafka", flag.ContinueOnError)
	fs.SetOutput(out)
	fs.Usage = func() {
		fmt.Fprint(fs.Output(), "Usage: go run ./examples/kafka [flags]\n\nPublishes orders with producer retries and a poison order to Kafka\n($KAFKA_BROKERS, or an in-process cluster), consumes them into Postgres\n($DATABASE_URL) with idemq in batches, and checks every customer's total,\nthe committed offsets and the dead-letter topic.\n\nFlags:\n")
		fs.PrintDefaults()
	}
	fs.IntVar(&o.orders, "orders", 500, "distinct orders to publish")
	fs.IntVar(&o.concurrency, "concurrency", 4, "batches handled at once")
	fs.IntVar(&o.batch, "batch", 32, "orders claimed and applied per transaction (1: one transaction per order)")
	fs.Uint64Var(&o.seed, "seed", 7, "random seed for the workload")
	fs.BoolVar(&o.verbose, "v", false, "log the runtime's decisions to stderr")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if o.orders < 1 || o.concurrency < 1 || o.batch < 1 {
		return errors.New("-orders, -concurrency and -batch must be at least 1")
	}
	dbURL := os.Getenv("DATABASE_URL")
	if dbURL == "" {
		dbURL = defaultDatabaseURL
	}
	logger := slog.New(slog.DiscardHandler)
	if o.verbose {
		logger = slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelDebug}))
	}

	// The cluster: KAFKA_BROKERS, or an in-process one.
	var brokers []string
	where := "KAFKA_BROKERS"
	if env := os.Getenv("KAFKA_BROKERS"); env != "" {
		for _, b := range strings.Split(env, ",") {
			if b = strings.TrimSpace(b); b != "" {
				brokers = append(brokers, b)
			}
		}
	} else {
		cluster, err := kfake.NewCluster(kfake.NumBrokers(1))
		if err != nil {
			return fmt.Errorf("start an in-process Kafka cluster: %w", err)
		}
		defer cluster.Close()
		brokers = cluster.ListenAddrs()
		where = "in-process kfake"
	}

	store, err := connect(ctx, dbURL)
	if err != nil {
		return err
	}
	defer store.Close()
	if err := setupSchema(ctx, store); err != nil {
		return err
	}

	// Topics and group of this run only, so a real cluster's leftovers
	// from earlier runs never mix in.
	var b [4]byte
	_, _ = rand.Read(b[:])
	runID := hex.EncodeToString(b[:])
	topic := "idemq-example.orders." + runID
	dlqTopic := kafka.DLQName(topic)
	group := "idemq-example-orders-" + runID
	admin := &kafkago.Client{Addr: kafkago.TCP(brokers...), Transport: &kafkago.Transport{}}
	defer admin.Transport.(*kafkago.Transport).CloseIdleConnections()
	if err := createTopics(ctx, admin, topic, dlqTopic); err != nil {
		return fmt.Errorf("cannot set up Kafka at %v (%s): %w", brokers, where, err)
	}
	defer func() {
		dctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
		defer cancel()
		if _, err := admin.DeleteTopics(dctx, &kafkago.DeleteTopicsRequest{Topics: []string{topic, dlqTopic}}); err != nil {
			fmt.Fprintln(out, "cleanup:", err)
		}
	}()

	pub, err := kafka.NewPublisher(kafka.PublisherConfig{Brokers: brokers, Logger: logger})
	if err != nil {
		return err
	}
	defer pub.Close()

	w := newWorkload(o)
	if err := pub.Publish(ctx, topic, w.msgs...); err != nil {
		return fmt.Errorf("publish: %w", err)
	}
	fmt.Fprintf(out, "published %d records to %s (%s, %d partitions): %d distinct orders, %d producer retries, %d poison\n",
		len(w.msgs), topic, where, partitions, o.orders, w.duplicates, w.poison)

	src, err := kafka.NewSource(kafka.Config{
		Brokers:           brokers,
		Topic:             topic,
		GroupID:           group,
		CommitInterval:    200 * time.Millisecond,
		HeartbeatInterval: 500 * time.Millisecond,
		JoinGroupBackoff:  200 * time.Millisecond,
		FetchMaxWait:      100 * time.Millisecond,
	})
	if err != nil {
		return err
	}
	// Dead letters are written, acknowledged by every in-sync replica, to
	// the dead-letter topic (<topic>.dlq) before the original's offset
	// may be committed.
	rt, err := consumer.New(consumer.Config{
		Name:        "orders",
		Source:      src,
		Store:       store,
		Handler:     handle,
		BatchSize:   o.batch,
		Concurrency: o.concurrency,
		Retry:       consumer.RetryConfig{MaxAttempts: 3, InitialInterval: 5 * time.Millisecond, MaxInterval: 50 * time.Millisecond},
		Logger:      logger,
	})
	if err != nil {
		_ = src.Close()
		return err
	}

	runCtx, cancel := context.WithCancel(ctx)
	defer cancel()
	done := make(chan error, 1)
	started := time.Now()
	go func() { done <- rt.Run(runCtx) }()
	// Run until every published record is settled.
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
	// Run returns once the Source is closed, which commits the offsets.
	if err := <-done; err != nil {
		return err
	}

	// A browser in the consumer's group starts at its committed offsets:
	// nothing left to read means every offset was committed.
	left, err := kafka.NewBrowser(ctx, kafka.BrowserConfig{Brokers: brokers, Topic: topic, GroupID: group})
	if err != nil {
		return err
	}
	uncommitted := left.Depth()
	if err := left.Close(); err != nil {
		return err
	}
	// What is in the dead-letter topic, read without a group: nothing is
	// committed.
	browser, err := kafka.NewBrowser(ctx, kafka.BrowserConfig{Brokers: brokers, Topic: dlqTopic})
	if err != nil {
		return err
	}
	inspection, err := dlq.Inspect(ctx, browser, dlq.Filter{}, 0) // closes the browser
	if err != nil {
		return err
	}
	return report(ctx, out, store.Pool(), rt.Stats(), dlqTopic, uncommitted, inspection, w, o, elapsed)
}

func createTopics(ctx context.Context, admin *kafkago.Client, topics ...string) error {
	req := &kafkago.CreateTopicsRequest{}
	for _, t := range topics {
		req.Topics = append(req.Topics, kafkago.TopicConfig{Topic: t, NumPartitions: partitions, ReplicationFactor: 1})
	}
	cctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	resp, err := admin.CreateTopics(cctx, req)
	if err != nil {
		return err
	}
	for _, t := range topics {
		if err := resp.Errors[t]; err != nil {
			return fmt.Errorf("create topic %s: %w", t, err)
		}
	}
	return nil
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
CREATE TABLE `+s+`.customers (id text PRIMARY KEY, total_cents bigint NOT NULL DEFAULT 0, orders int NOT NULL DEFAULT 0);
CREATE TABLE `+s+`.bookings (order_id text NOT NULL, customer text NOT NULL, amount_cents bigint NOT NULL);
INSERT INTO `+s+`.customers (id) SELECT 'cust-' || i FROM generate_series(1, `+fmt.Sprint(customers)+`) i;`)
	if err != nil {
		return fmt.Errorf("create business tables: %w", err)
	}
	return nil
}

// workload is the published records and what they should add up to.
type workload struct {
	msgs       []*consumer.Message
	expected   map[string]int64 // customer -> cents
	valid      int
	duplicates int
	poison     int
}

func newWorkload(o options) *workload {
	rng := mrand.New(mrand.NewPCG(o.seed, o.seed^0x5851f42d4c957f2d))
	w := &workload{expected: map[string]int64{}}
	var originals []*consumer.Message
	for i := 1; i <= o.orders; i++ {
		ord := Order{
			OrderID:     fmt.Sprintf("ord-%05d", i),
			Customer:    fmt.Sprintf("cust-%d", 1+rng.IntN(customers)),
			AmountCents: int64(100 + rng.IntN(9_900)),
		}
		w.expected[ord.Customer] += ord.AmountCents
		w.valid++
		originals = append(originals, message(ord))
	}
	w.msgs = append(w.msgs, originals...)
	// About 20% of the orders written a second time with the same
	// idempotency-key, as a producer retrying after a lost
	// acknowledgement would: a new record at a new offset, maybe in
	// another batch.
	for i := 0; i < max(1, o.orders/5); i++ {
		w.msgs = append(w.msgs, originals[rng.IntN(o.orders)].Clone())
		w.duplicates++
	}
	rng.Shuffle(len(w.msgs), func(i, j int) { w.msgs[i], w.msgs[j] = w.msgs[j], w.msgs[i] })
	// The poison order, for a customer that does not exist, in the middle
	// of the stream.
	poison := message(Order{OrderID: "ord-poison", Customer: "cust-404", AmountCents: 1})
	w.msgs = append(w.msgs[:len(w.msgs)/2], append([]*consumer.Message{poison}, w.msgs[len(w.msgs)/2:]...)...)
	w.poison = 1
	return w
}

// message makes the record of an order: its id goes to the idempotency-key
// header, and its customer is the record key, so one customer's orders share
// a partition and keep their order.
func message(ord Order) *consumer.Message {
	body, _ := json.Marshal(ord)
	return &consumer.Message{ID: ord.OrderID, RecordKey: []byte(ord.Customer), Body: body, Timestamp: time.Now(),
		Headers: map[string]string{"content-type": "application/json"}}
}

// handle is the consumer: a plain function over the message and the
// transaction that also holds its dedup claim (in batch mode, the claims of
// the whole batch).
func handle(ctx context.Context, tx pgx.Tx, msg *consumer.Message) error {
	var ord Order
	if err := json.Unmarshal(msg.Body, &ord); err != nil {
		return consumer.Permanent(fmt.Errorf("decode order: %w", err))
	}
	tag, err := tx.Exec(ctx, `UPDATE idemq_example_kafka.customers SET total_cents = total_cents + $2, orders = orders + 1 WHERE id = $1`,
		ord.Customer, ord.AmountCents)
	if err != nil {
		return fmt.Errorf("book order: %w", err)
	}
	if tag.RowsAffected() == 0 {
		return consumer.Permanent(fmt.Errorf("unknown customer %q", ord.Customer))
	}
	_, err = tx.Exec(ctx, `INSERT INTO idemq_example_kafka.bookings (order_id, customer, amount_cents) VALUES ($1, $2, $3)`,
		ord.OrderID, ord.Customer, ord.AmountCents)
	return err
}

func report(ctx context.Context, out io.Writer, pool *pgxpool.Pool, s consumer.Stats, dlqTopic string, uncommitted int64,
	rep dlq.Report, w *workload, o options, elapsed time.Duration) error {
	totals := map[string]int64{}
	rows, err := pool.Query(ctx, `SELECT id, total_cents FROM idemq_example_kafka.customers`)
	if err != nil {
		return err
	}
	for rows.Next() {
		var id string
		var c int64
		if err := rows.Scan(&id, &c); err != nil {
			return err
		}
		totals[id] = c
	}
	if err := rows.Err(); err != nil {
		return err
	}
	var bookings, distinct int
	if err := pool.QueryRow(ctx, `SELECT count(*), count(DISTINCT order_id) FROM idemq_example_kafka.bookings`).Scan(&bookings, &distinct); err != nil {
		return err
	}
	wrong := 0
	for id, c := range totals {
		if c != w.expected[id] {
			wrong++
		}
	}

	fmt.Fprintf(out, "\nidemq on Kafka: summary (%s, batches of up to %d)\n", elapsed.Round(time.Millisecond), o.batch)
	fmt.Fprintf(out, "  received             %6d\n", s.Received)
	fmt.Fprintf(out, "  applied              %6d\n", s.Applied)
	fmt.Fprintf(out, "  duplicates skipped   %6d\n", s.Duplicates)
	fmt.Fprintf(out, "  dead-lettered        %6d\n", s.DeadLettered)
	fmt.Fprintf(out, "  uncommitted offsets  %6d\n", uncommitted)
	fmt.Fprintf(out, "  DLQ records          %6d  (%s)\n", rep.Total, dlqTopic)
	for _, g := range rep.Groups {
		fmt.Fprintf(out, "    %d x %s: %s\n", g.Count, g.Class, g.Error)
	}
	fmt.Fprintf(out, "  bookings             %6d  (%d distinct orders)\n", bookings, distinct)
	fmt.Fprintf(out, "  totals match         %6v  (%d customers, %d wrong)\n", wrong == 0, len(totals), wrong)

	var problems []string
	if wrong > 0 {
		problems = append(problems, fmt.Sprintf("%d customer totals differ from the expected totals", wrong))
	}
	if bookings != w.valid || distinct != w.valid {
		problems = append(problems, fmt.Sprintf("%d bookings (%d distinct) for %d orders", bookings, distinct, w.valid))
	}
	if s.Applied != int64(w.valid) || s.Duplicates != int64(w.duplicates) || s.DeadLettered != int64(w.poison) {
		problems = append(problems, fmt.Sprintf("applied %d, duplicates %d, dead-lettered %d; want %d, %d, %d",
			s.Applied, s.Duplicates, s.DeadLettered, w.valid, w.duplicates, w.poison))
	}
	if uncommitted != 0 {
		problems = append(problems, fmt.Sprintf("%d offsets left uncommitted", uncommitted))
	}
	if rep.Total != w.poison || rep.Malformed != 0 {
		problems = append(problems, fmt.Sprintf("the dead-letter topic holds %d records (%d malformed), want %d", rep.Total, rep.Malformed, w.poison))
	}
	if len(problems) > 0 {
		return fmt.Errorf("EFFECTS WRONG: %s", strings.Join(problems, "; "))
	}
	fmt.Fprintln(out, "\nOK: every order applied exactly once, every offset committed; the poison order is in the dead-letter topic.")
	return nil
}
