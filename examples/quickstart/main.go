// Command quickstart shows idemq turning an at-least-once payment stream into
// exactly-once balance updates.
//
// It publishes a realistic workload to the in-memory broker: payments to 50
// accounts, about 20% of them redelivered as duplicates, a few poison
// messages (an unknown account, a missing id, an oversized body), a few
// transient failures, and a buggy producer that re-sends two payment ids with
// different amounts. The runtime applies them to Postgres with concurrency,
// then the program checks every account balance against the expected totals
// and exits non-zero if any differ.
//
//	go run ./examples/quickstart
//
// With -metrics 127.0.0.1:9464 it also serves the runtime's Prometheus
// metrics at http://127.0.0.1:9464/metrics, and keeps serving them after the
// summary until interrupted.
//
// Postgres comes from DATABASE_URL, defaulting to the local server. The
// program works in its own schema, idemq_quickstart (-schema), which it
// recreates on every run. Its errors never show the database password.
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
	"net"
	"net/http"
	"os"
	"os/signal"
	"sort"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/idemq/idemq/brokers/memory"
	"github.com/idemq/idemq/consumer"
	idemqprom "github.com/idemq/idemq/observability/prometheus"
	"github.com/idemq/idemq/processed"
)

const (
	defaultURL    = "postgres://postgres@127.0.0.1:5432/test?sslmode=disable"
	defaultSchema = "idemq_quickstart"
	queue         = "payments"
	dlqQueue      = "payments.dlq"
)

// Payment is the message body.
type Payment struct {
	PaymentID   string `json:"payment_id"`
	Account     string `json:"account"`
	AmountCents int64  `json:"amount_cents"`
	Memo        string `json:"memo,omitempty"`
}

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	err := run(ctx, os.Args[1:], os.Stdout)
	switch {
	case errors.Is(err, flag.ErrHelp): // -h: the usage is printed
	case errors.As(err, new(usageError)):
		fmt.Fprintln(os.Stderr, "quickstart:", err)
		os.Exit(2)
	case err != nil:
		fmt.Fprintln(os.Stderr, "quickstart:", err)
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
	metrics     string
	schema      string
}

// run runs the quickstart, printing to out. On -h or --help it prints the
// usage to out and returns flag.ErrHelp. No error it returns contains the
// database password.
func run(ctx context.Context, args []string, out io.Writer) error {
	dbURL := os.Getenv("DATABASE_URL")
	if dbURL == "" {
		dbURL = defaultURL
	}
	var o options
	fs := flag.NewFlagSet("quickstart", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	fs.Usage = func() {
		fmt.Fprint(fs.Output(), "Usage: go run ./examples/quickstart [flags]\n\nPublishes a payment workload with duplicates and poison messages to the\nmemory broker, applies it to Postgres ($DATABASE_URL) with idemq, and checks\nevery balance.\n\nFlags:\n")
		fs.PrintDefaults()
	}
	fs.IntVar(&o.payments, "payments", 2000, "distinct payments to publish")
	fs.IntVar(&o.concurrency, "concurrency", 8, "messages handled at once")
	fs.Uint64Var(&o.seed, "seed", 42, "random seed for the workload")
	fs.BoolVar(&o.verbose, "v", false, "log the runtime's decisions to stderr")
	fs.StringVar(&o.metrics, "metrics", "", "serve Prometheus metrics on `ADDR` (such as 127.0.0.1:9464) at /metrics while the quickstart runs, until interrupted")
	fs.StringVar(&o.schema, "schema", defaultSchema, "Postgres `schema` for the quickstart's tables, dropped and recreated on every run")
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
	if o.payments < 10 {
		return usageError{errors.New("-payments must be at least 10")}
	}
	if o.concurrency < 1 {
		return usageError{errors.New("-concurrency must be at least 1")}
	}

	store, err := connect(ctx, dbURL, o.schema)
	if err != nil {
		return err
	}
	defer store.Close()
	if err := setupSchema(ctx, store); err != nil {
		return err
	}

	broker := memory.NewBroker()
	w := newWorkload(o)
	if err := broker.Publish(ctx, queue, w.phase1...); err != nil {
		return fmt.Errorf("publish: %w", err)
	}
	fmt.Fprintf(out, "published %d messages: %d distinct payments, %d redelivered duplicates, %d poison deliveries\n",
		len(w.phase1)+len(w.phase2), o.payments, w.duplicates, w.poison)

	logger := slog.New(slog.DiscardHandler)
	if o.verbose {
		logger = slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelDebug}))
	}
	sub, err := broker.Subscribe(queue, memory.SubscribeOptions{})
	if err != nil {
		return err
	}
	classes := &classCounter{m: map[consumer.FailureClass]int{}}
	hooks := []consumer.Hook{classes}
	var metrics *metricsServer
	if o.metrics != "" {
		if metrics, err = newMetricsServer(o.metrics, "ledger"); err != nil {
			return err
		}
		defer metrics.close()
		hooks = append(hooks, metrics.hooks)
		fmt.Fprintf(out, "serving metrics at http://%s/metrics\n", metrics.addr)
	}
	rt, err := consumer.New(consumer.Config{
		Name:         "ledger",
		Source:       sub,
		Store:        store,
		Handler:      w.handle,
		Concurrency:  o.concurrency,
		MaxBodyBytes: 4 << 10,
		Retry:        consumer.RetryConfig{InitialInterval: 5 * time.Millisecond, MaxInterval: 50 * time.Millisecond},
		Logger:       logger,
		Hooks:        hooks,
	})
	if err != nil {
		return err
	}
	if metrics != nil {
		if err := metrics.hooks.RegisterRuntime(rt); err != nil {
			return err
		}
	}

	runCtx, cancel := context.WithCancel(ctx)
	defer cancel()
	done := make(chan error, 1)
	started := time.Now()
	go func() { done <- rt.Run(runCtx) }()

	settle := func(received int64) error {
		for rt.Stats().Received < received || !memory.Drained(broker.Stats(queue)) {
			select {
			case err := <-done:
				return fmt.Errorf("runtime stopped early: %v", err)
			case <-ctx.Done():
				return ctx.Err()
			case <-time.After(10 * time.Millisecond):
			}
		}
		return nil
	}
	if err := settle(int64(len(w.phase1))); err != nil {
		return err
	}
	// Later, a buggy producer re-sends two payment ids with new amounts,
	// and the broker redelivers a few old messages.
	if err := broker.Publish(ctx, queue, w.phase2...); err != nil {
		return fmt.Errorf("publish: %w", err)
	}
	if err := settle(int64(len(w.phase1) + len(w.phase2))); err != nil {
		return err
	}
	elapsed := time.Since(started)
	cancel()
	if err := <-done; err != nil {
		return err
	}
	if err := report(ctx, out, store.Pool(), rt.Stats(), classes, broker.Ready(dlqQueue), w, elapsed); err != nil {
		return err
	}
	if metrics != nil {
		fmt.Fprintf(out, "\nstill serving metrics at http://%s/metrics; press Ctrl-C to stop\n", metrics.addr)
		<-ctx.Done()
	}
	return nil
}

// metricsServer serves the runtime's Prometheus metrics (-metrics).
type metricsServer struct {
	hooks *idemqprom.Metrics
	addr  string
	srv   *http.Server
}

func newMetricsServer(addr, consumerName string) (*metricsServer, error) {
	reg := prometheus.NewRegistry()
	hooks, err := idemqprom.New(reg, idemqprom.Options{Consumer: consumerName})
	if err != nil {
		return nil, err
	}
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("-metrics: %w", err)
	}
	mux := http.NewServeMux()
	mux.Handle("/metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
	m := &metricsServer{hooks: hooks, addr: ln.Addr().String(), srv: &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}}
	go func() { _ = m.srv.Serve(ln) }()
	return m, nil
}

func (m *metricsServer) close() {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	_ = m.srv.Shutdown(ctx)
}

// connect opens the store on url, in schema, and checks that the database
// answers. Its errors never show url: processed.Open names the server
// without credentials, and a parse error, whose text may quote the
// password, is not shown.
func connect(ctx context.Context, url, schema string) (*processed.Store, error) {
	cctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	store, err := processed.Open(cctx, url, processed.Config{Schema: schema})
	switch {
	case err == nil:
		return store, nil
	case errors.As(err, new(*pgconn.ParseConfigError)):
		return nil, errors.New("invalid DATABASE_URL: check its syntax and parameters")
	case errors.As(err, new(*consumer.ConfigError)): // -schema
		return nil, err
	}
	return nil, fmt.Errorf("cannot reach Postgres (start it, or set DATABASE_URL): %w", err)
}

// setupSchema recreates the quickstart's schema: the dedup table and the
// business tables.
func setupSchema(ctx context.Context, store *processed.Store) error {
	pool := store.Pool()
	s := pgx.Identifier{store.Schema()}.Sanitize()
	if _, err := pool.Exec(ctx, "DROP SCHEMA IF EXISTS "+s+" CASCADE"); err != nil {
		return fmt.Errorf("reset schema: %w", err)
	}
	if err := store.Migrate(ctx); err != nil {
		return err
	}
	return createBusinessTables(ctx, pool, store.Schema())
}

// createBusinessTables creates the accounts and the ledger in schema.
func createBusinessTables(ctx context.Context, pool *pgxpool.Pool, schema string) error {
	s := pgx.Identifier{schema}.Sanitize()
	_, err := pool.Exec(ctx, `
CREATE TABLE `+s+`.accounts (id text PRIMARY KEY, balance_cents bigint NOT NULL DEFAULT 0);
CREATE TABLE `+s+`.ledger (payment_id text NOT NULL, account text NOT NULL, amount_cents bigint NOT NULL, applied_at timestamptz NOT NULL DEFAULT now());
INSERT INTO `+s+`.accounts (id) SELECT 'acct-' || lpad(i::text, 2, '0') FROM generate_series(1, 50) i;`)
	if err != nil {
		return fmt.Errorf("create business tables: %w", err)
	}
	return nil
}

// workload is the published messages and what they should add up to.
type workload struct {
	// accounts and ledger are the business tables, quoted.
	accounts, ledger string
	phase1, phase2   []*consumer.Message
	expected         map[string]int64 // account -> cents
	validPayments    int
	duplicates       int
	poison           int
	failOnce         sync.Map // payment ids whose first attempt fails
}

func newWorkload(o options) *workload {
	rng := rand.New(rand.NewPCG(o.seed, o.seed^0x9e3779b97f4a7c15))
	w := &workload{
		accounts: pgx.Identifier{o.schema, "accounts"}.Sanitize(),
		ledger:   pgx.Identifier{o.schema, "ledger"}.Sanitize(),
		expected: map[string]int64{},
	}
	var originals []*consumer.Message
	poison := map[int]bool{} // indexes into originals of messages that must be dead-lettered
	for i := 1; i <= o.payments; i++ {
		p := Payment{
			PaymentID:   fmt.Sprintf("pay-%05d", i),
			Account:     fmt.Sprintf("acct-%02d", 1+rng.IntN(50)),
			AmountCents: int64(100 + rng.IntN(99_900)),
		}
		switch {
		case i%400 == 0: // an account that does not exist: permanent failure
			p.Account = "acct-99"
			poison[i-1] = true
		case i%333 == 0: // an oversized memo: rejected before the handler
			p.Memo = strings.Repeat("x", 5000)
			poison[i-1] = true
		default:
			w.expected[p.Account] += p.AmountCents
			w.validPayments++
			if rng.IntN(100) < 3 {
				w.failOnce.Store(p.PaymentID, true)
			}
		}
		body, _ := json.Marshal(p)
		originals = append(originals, &consumer.Message{ID: p.PaymentID, Key: p.Account, Body: body,
			Headers: map[string]string{"content-type": "application/json"}})
	}
	// A producer that forgot to set an id.
	for i := 0; i < 3; i++ {
		body, _ := json.Marshal(Payment{Account: "acct-01", AmountCents: 999})
		poison[len(originals)] = true
		originals = append(originals, &consumer.Message{Key: "acct-01", Body: body})
	}
	w.poison = len(poison)
	// A redelivered poison message has no dedup row (its transaction rolled
	// back), so it is dead-lettered again: nothing is silently dropped.
	redeliver := func(i int) *consumer.Message {
		if poison[i] {
			w.poison++
		}
		w.duplicates++
		return originals[i].Clone()
	}
	w.phase1 = append(w.phase1, originals...)
	// About 20% redelivered duplicates, interleaved at random.
	for i := 0; i < o.payments/5; i++ {
		w.phase1 = append(w.phase1, redeliver(rng.IntN(o.payments)))
	}
	rng.Shuffle(len(w.phase1), func(i, j int) { w.phase1[i], w.phase1[j] = w.phase1[j], w.phase1[i] })

	// Phase 2: late redeliveries, and two ids re-sent with a different
	// amount (a producer bug that must be dead-lettered, not applied).
	for i := 0; i < 20; i++ {
		w.phase2 = append(w.phase2, redeliver(rng.IntN(o.payments)))
	}
	for _, i := range []int{7, 8} {
		var p Payment
		_ = json.Unmarshal(originals[i].Body, &p)
		p.AmountCents += 1_000_000
		body, _ := json.Marshal(p)
		w.phase2 = append(w.phase2, &consumer.Message{ID: p.PaymentID, Key: p.Account, Body: body})
		w.poison++
	}
	return w
}

// handle is the consumer: a plain function over the message and the
// transaction that also holds its dedup claim.
func (w *workload) handle(ctx context.Context, tx pgx.Tx, msg *consumer.Message) error {
	var p Payment
	if err := json.Unmarshal(msg.Body, &p); err != nil {
		return consumer.Permanent(fmt.Errorf("decode payment: %w", err))
	}
	if _, ok := w.failOnce.LoadAndDelete(p.PaymentID); ok {
		return errors.New("simulated transient failure (lock timeout)")
	}
	tag, err := tx.Exec(ctx, `UPDATE `+w.accounts+` SET balance_cents = balance_cents + $2 WHERE id = $1`, p.Account, p.AmountCents)
	if err != nil {
		return fmt.Errorf("credit account: %w", err)
	}
	if tag.RowsAffected() == 0 {
		return consumer.Permanent(fmt.Errorf("unknown account %q", p.Account))
	}
	_, err = tx.Exec(ctx, `INSERT INTO `+w.ledger+` (payment_id, account, amount_cents) VALUES ($1, $2, $3)`,
		p.PaymentID, p.Account, p.AmountCents)
	return err
}

// classCounter is a hook counting dead letters by class.
type classCounter struct {
	consumer.HookDefaults
	mu sync.Mutex
	m  map[consumer.FailureClass]int
}

func (c *classCounter) OnDeadLettered(_ context.Context, _ *consumer.Message, f consumer.Failure) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.m[f.Class]++
}

func (c *classCounter) String() string {
	c.mu.Lock()
	defer c.mu.Unlock()
	var parts []string
	for k, v := range c.m {
		parts = append(parts, fmt.Sprintf("%s=%d", k, v))
	}
	sort.Strings(parts)
	return strings.Join(parts, " ")
}

func report(ctx context.Context, out io.Writer, pool *pgxpool.Pool, s consumer.Stats, classes *classCounter,
	dlqDepth int, w *workload, elapsed time.Duration) error {
	rows, err := pool.Query(ctx, `SELECT id, balance_cents FROM `+w.accounts)
	if err != nil {
		return err
	}
	balances, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (struct {
		id string
		b  int64
	}, error) {
		var v struct {
			id string
			b  int64
		}
		err := r.Scan(&v.id, &v.b)
		return v, err
	})
	if err != nil {
		return err
	}
	var ledgerRows, distinct int64
	if err := pool.QueryRow(ctx, `SELECT count(*), count(DISTINCT payment_id) FROM `+w.ledger).Scan(&ledgerRows, &distinct); err != nil {
		return err
	}
	wrong := 0
	for _, b := range balances {
		if b.b != w.expected[b.id] {
			wrong++
		}
	}

	fmt.Fprintf(out, "\nidemq quickstart summary (%s, %.0f msgs/s)\n", elapsed.Round(time.Millisecond), float64(s.Received)/elapsed.Seconds())
	fmt.Fprintf(out, "  received             %6d\n", s.Received)
	fmt.Fprintf(out, "  applied              %6d\n", s.Applied)
	fmt.Fprintf(out, "  duplicates skipped   %6d\n", s.Duplicates)
	fmt.Fprintf(out, "  retried attempts     %6d\n", s.Retries)
	fmt.Fprintf(out, "  dead-lettered        %6d  (%s; %d in %s)\n", s.DeadLettered, classes, dlqDepth, dlqQueue)
	fmt.Fprintf(out, "  ledger rows          %6d  (%d distinct payments)\n", ledgerRows, distinct)
	fmt.Fprintf(out, "  account balances     %6d  accounts, %d wrong\n", len(balances), wrong)

	var problems []string
	if wrong > 0 {
		problems = append(problems, fmt.Sprintf("%d account balances differ from the expected totals", wrong))
	}
	if ledgerRows != int64(w.validPayments) || distinct != ledgerRows {
		problems = append(problems, fmt.Sprintf("%d ledger rows for %d valid payments", ledgerRows, w.validPayments))
	}
	if s.Applied != int64(w.validPayments) || s.DeadLettered != int64(w.poison) {
		problems = append(problems, fmt.Sprintf("applied %d (want %d), dead-lettered %d (want %d)", s.Applied, w.validPayments, s.DeadLettered, w.poison))
	}
	if s.Received != s.Applied+s.Duplicates+s.DeadLettered {
		problems = append(problems, "received != applied + duplicates + dead-lettered")
	}
	if len(problems) > 0 {
		return fmt.Errorf("EFFECTS WRONG: %s", strings.Join(problems, "; "))
	}
	fmt.Fprintln(out, "\nOK: every payment applied exactly once; every balance matches.")
	return nil
}
