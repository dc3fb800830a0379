package idemqprom_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	dto "github.com/prometheus/client_model/go"

	"github.com/idemq/idemq/brokers/memory"
	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/internal/testdb"
	idemqprom "github.com/idemq/idemq/observability/prometheus"
	"github.com/idemq/idemq/processed"
)

const queue = "payments"

// env is a migrated dedup store and a memory broker.
type env struct {
	t      *testing.T
	broker *memory.Broker
	store  *processed.Store
	schema string
}

func newEnv(t *testing.T) *env {
	t.Helper()
	schema := testdb.Schema(t)
	store, err := processed.New(testdb.Pool(t), processed.Config{Schema: schema})
	if err != nil {
		t.Fatal(err)
	}
	if err := store.Migrate(context.Background()); err != nil {
		t.Fatal(err)
	}
	return &env{t: t, broker: memory.NewBroker(), store: store, schema: schema}
}

func (e *env) config(name string, hooks ...consumer.Hook) consumer.Config {
	e.t.Helper()
	sub, err := e.broker.Subscribe(queue, memory.SubscribeOptions{})
	if err != nil {
		e.t.Fatal(err)
	}
	return consumer.Config{
		Name:            name,
		Source:          sub,
		Store:           e.store,
		Retry:           consumer.RetryConfig{InitialInterval: time.Millisecond, MaxInterval: 5 * time.Millisecond},
		ShutdownTimeout: 5 * time.Second,
		Hooks:           hooks,
	}
}

func (e *env) publish(msgs ...*consumer.Message) {
	e.t.Helper()
	if err := e.broker.Publish(context.Background(), queue, msgs...); err != nil {
		e.t.Fatal(err)
	}
}

// settle waits until the runtime received n deliveries in all and the queue
// holds nothing.
func (e *env) settle(rt *consumer.Runtime, n int64) {
	e.t.Helper()
	waitFor(e.t, fmt.Sprintf("%d deliveries settled", n), func() bool {
		return rt.Stats().Received >= n && memory.Drained(e.broker.Stats(queue))
	})
}

// run starts rt and returns a function that stops it and waits for Run.
func run(t *testing.T, rt *consumer.Runtime) (stop func()) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- rt.Run(ctx) }()
	var once sync.Once
	stop = func() {
		once.Do(func() {
			cancel()
			select {
			case err := <-done:
				if err != nil {
					t.Errorf("Run: %v", err)
				}
			case <-time.After(30 * time.Second):
				t.Fatal("Run did not return within 30s")
			}
		})
	}
	t.Cleanup(stop)
	return stop
}

func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// find returns the metric name{labels} gathered from reg, or nil.
func find(t *testing.T, reg prometheus.Gatherer, name string, labels map[string]string) *dto.Metric {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
	metrics:
		for _, m := range mf.GetMetric() {
			got := map[string]string{}
			for _, lp := range m.GetLabel() {
				got[lp.GetName()] = lp.GetValue()
			}
			for k, v := range labels {
				if got[k] != v {
					continue metrics
				}
			}
			return m
		}
	}
	return nil
}

// histogram returns the sample count and sum of a histogram series.
func histogram(t *testing.T, reg prometheus.Gatherer, name string, labels map[string]string) (uint64, float64) {
	t.Helper()
	m := find(t, reg, name, labels)
	if m == nil || m.GetHistogram() == nil {
		return 0, 0
	}
	return m.GetHistogram().GetSampleCount(), m.GetHistogram().GetSampleSum()
}

func gauge(t *testing.T, reg prometheus.Gatherer, name string, labels map[string]string) float64 {
	t.Helper()
	m := find(t, reg, name, labels)
	switch {
	case m == nil:
		t.Fatalf("no series %s%v", name, labels)
	case m.GetGauge() != nil:
		return m.GetGauge().GetValue()
	case m.GetCounter() != nil:
		return m.GetCounter().GetValue()
	}
	t.Fatalf("%s%v is neither a gauge nor a counter", name, labels)
	return 0
}

// TestWorkloadMetrics runs a known workload through a real runtime (memory
// broker, Postgres) and checks every counter and histogram it moves.
func TestWorkloadMetrics(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	reg := prometheus.NewRegistry()
	m, err := idemqprom.New(reg, idemqprom.Options{Consumer: "ledger"})
	if err != nil {
		t.Fatal(err)
	}
	var flaked atomic.Bool
	cfg := e.config("ledger", m)
	cfg.Handler = func(ctx context.Context, tx pgx.Tx, msg *consumer.Message) error {
		switch msg.ID {
		case "flaky":
			if !flaked.Swap(true) {
				return errors.New("transient")
			}
		case "poison":
			return consumer.Permanent(errors.New("unknown account"))
		}
		_, err := tx.Exec(ctx, "SELECT 1")
		return err
	}
	cfg.BatchSize = 1 // per-message mode: exact counts, no batch metrics
	rt, err := consumer.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	if err := m.RegisterRuntime(rt); err != nil {
		t.Fatal(err)
	}
	stop := run(t, rt)

	// Phase 1: ten payments produced a minute ago, one flaky, one poison,
	// one without an id.
	produced := time.Now().Add(-time.Minute)
	var phase1 []*consumer.Message
	for i := range 10 {
		phase1 = append(phase1, &consumer.Message{ID: fmt.Sprintf("ok-%d", i), Body: []byte(fmt.Sprint(i)), Timestamp: produced})
	}
	phase1 = append(phase1,
		&consumer.Message{ID: "flaky", Body: []byte("f")},
		&consumer.Message{ID: "poison", Body: []byte("p")},
		&consumer.Message{Body: []byte("no id")})
	e.publish(phase1...)
	e.settle(rt, int64(len(phase1)))

	// Phase 2: three of them come back after their originals were applied
	// two hours ago.
	tbl := pgx.Identifier{e.schema, "processed_messages"}.Sanitize()
	if _, err := testdb.Pool(t).Exec(context.Background(),
		"UPDATE "+tbl+" SET processed_at = now() - interval '2 hours' WHERE message_id IN ('ok-0', 'ok-1', 'ok-2')"); err != nil {
		t.Fatal(err)
	}
	e.publish(phase1[0].Clone(), phase1[1].Clone(), phase1[2].Clone())
	e.settle(rt, int64(len(phase1))+3)
	stop()

	want := `
# HELP idemq_ack_failures_total Acks that failed after a commit or dead-letter; the redelivery is skipped as a duplicate.
# TYPE idemq_ack_failures_total counter
idemq_ack_failures_total{consumer="ledger",source="payments"} 0
# HELP idemq_handler_retries_total Failed handler attempts that were retried.
# TYPE idemq_handler_retries_total counter
idemq_handler_retries_total{consumer="ledger",source="payments"} 1
# HELP idemq_in_flight_messages Deliveries received and not yet settled.
# TYPE idemq_in_flight_messages gauge
idemq_in_flight_messages{consumer="ledger"} 0
# HELP idemq_messages_applied_total Messages whose effect committed.
# TYPE idemq_messages_applied_total counter
idemq_messages_applied_total{consumer="ledger",source="payments"} 11
# HELP idemq_messages_dead_lettered_total Messages whose dead-letter copy was accepted, by failure class.
# TYPE idemq_messages_dead_lettered_total counter
idemq_messages_dead_lettered_total{class="missing-id",consumer="ledger",source="payments"} 1
idemq_messages_dead_lettered_total{class="permanent",consumer="ledger",source="payments"} 1
# HELP idemq_messages_duplicates_total Messages skipped because their id was already applied.
# TYPE idemq_messages_duplicates_total counter
idemq_messages_duplicates_total{consumer="ledger",source="payments"} 3
# HELP idemq_messages_received_total Deliveries taken from the source.
# TYPE idemq_messages_received_total counter
idemq_messages_received_total{consumer="ledger",source="payments"} 16
# HELP idemq_messages_requeued_total Messages given back to the broker unsettled (at shutdown, or because dead-lettering failed).
# TYPE idemq_messages_requeued_total counter
idemq_messages_requeued_total{consumer="ledger"} 0
`
	if err := testutil.GatherAndCompare(reg, strings.NewReader(want),
		"idemq_ack_failures_total", "idemq_handler_retries_total", "idemq_in_flight_messages",
		"idemq_messages_applied_total", "idemq_messages_dead_lettered_total", "idemq_messages_duplicates_total",
		"idemq_messages_received_total", "idemq_messages_requeued_total"); err != nil {
		t.Error(err)
	}
	// The counters agree with the runtime's own.
	if s := rt.Stats(); s.Received != 16 || s.Applied != 11 || s.Duplicates != 3 || s.Retries != 1 || s.DeadLettered != 2 {
		t.Errorf("runtime stats %+v disagree with the workload", s)
	}

	labels := map[string]string{"consumer": "ledger", "source": "payments"}
	for _, name := range []string{"idemq_handler_duration_seconds", "idemq_commit_duration_seconds"} {
		if n, sum := histogram(t, reg, name, labels); n != 11 || sum <= 0 || sum > 11*5 {
			t.Errorf("%s: %d samples summing to %gs, want 11 small positive ones", name, n, sum)
		}
	}
	// One COMMIT per applied message (BatchSize 1), none that failed:
	// the failed handlers and the duplicates sent none.
	committed := map[string]string{"consumer": "ledger", "outcome": "committed"}
	if n, sum := histogram(t, reg, "idemq_db_commit_duration_seconds", committed); n != 11 || sum <= 0 || sum > 11*5 {
		t.Errorf("idemq_db_commit_duration_seconds: %d committed samples summing to %gs, want 11 small positive ones", n, sum)
	}
	failed := map[string]string{"consumer": "ledger", "outcome": "failed"}
	if m := find(t, reg, "idemq_db_commit_duration_seconds", failed); m == nil || m.GetHistogram().GetSampleCount() != 0 {
		t.Errorf("idemq_db_commit_duration_seconds{outcome=failed}: %v, want a series with no samples", m)
	}
	// Ten payments were produced a minute before they were applied, and
	// the flaky one just now.
	if n, sum := histogram(t, reg, "idemq_end_to_end_latency_seconds", labels); n != 11 || sum < 10*60 || sum > 10*60+11*30 {
		t.Errorf("end-to-end latency: %d samples summing to %gs, want 11 summing to about 600s", n, sum)
	}
	// Each duplicate's original was applied two hours before.
	if n, sum := histogram(t, reg, "idemq_duplicate_age_seconds", labels); n != 3 || sum < 3*7200 || sum > 3*7200+3*60 {
		t.Errorf("duplicate age: %d samples summing to %gs, want 3 of about 7200s", n, sum)
	}
	dup := find(t, reg, "idemq_duplicate_age_seconds", labels).GetHistogram()
	for _, b := range dup.GetBucket() {
		want := uint64(0)
		if b.GetUpperBound() >= 6*3600 {
			want = 3
		}
		if b.GetCumulativeCount() != want {
			t.Errorf("duplicate age bucket le=%g holds %d, want %d", b.GetUpperBound(), b.GetCumulativeCount(), want)
		}
	}
	// Nothing was batched or folded.
	if n, _ := histogram(t, reg, "idemq_batch_size", map[string]string{"consumer": "ledger"}); n != 0 {
		t.Errorf("%d batches observed outside batch mode", n)
	}
	if got := gauge(t, reg, "idemq_source_labels_folded_total", map[string]string{"consumer": "ledger"}); got != 0 {
		t.Errorf("folded %g, want 0", got)
	}
}

// TestInFlightGauge watches the gauge read from Runtime.Stats while
// handlers are blocked.
func TestInFlightGauge(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	reg := prometheus.NewRegistry()
	m, err := idemqprom.New(reg, idemqprom.Options{Consumer: "slow"})
	if err != nil {
		t.Fatal(err)
	}
	release := make(chan struct{})
	cfg := e.config("slow", m)
	cfg.Concurrency = 3
	cfg.Handler = func(ctx context.Context, tx pgx.Tx, msg *consumer.Message) error {
		select {
		case <-release:
			return nil
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	rt, err := consumer.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	if err := m.RegisterRuntime(rt); err != nil {
		t.Fatal(err)
	}
	// A second runtime of the same name cannot register its gauges.
	if err := m.RegisterRuntime(rt); err == nil {
		t.Error("RegisterRuntime twice for one consumer succeeded")
	}
	run(t, rt)
	inFlight := func() float64 {
		return gauge(t, reg, "idemq_in_flight_messages", map[string]string{"consumer": "slow"})
	}
	if got := inFlight(); got != 0 {
		t.Fatalf("in flight %g before any message", got)
	}
	e.publish(&consumer.Message{ID: "a", Body: []byte("a")}, &consumer.Message{ID: "b", Body: []byte("b")})
	waitFor(t, "2 messages in flight", func() bool { return inFlight() == 2 })
	close(release)
	e.settle(rt, 2)
	waitFor(t, "0 messages in flight", func() bool { return inFlight() == 0 })
	if got := gauge(t, reg, "idemq_messages_applied_total", map[string]string{"consumer": "slow"}); got != 2 {
		t.Errorf("applied %g, want 2", got)
	}
}

// TestBatchMetrics checks the batch size histogram and fill ratio in batch
// mode.
func TestBatchMetrics(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	reg := prometheus.NewRegistry()
	m, err := idemqprom.New(reg, idemqprom.Options{Consumer: "bulk", BatchSize: 8})
	if err != nil {
		t.Fatal(err)
	}
	var batches atomic.Int32
	cfg := e.config("bulk", m)
	cfg.Concurrency = 1
	cfg.BatchSize = 8
	cfg.BatchWait = 10 * time.Second // the batch closes full, not on time
	cfg.BatchHandler = func(ctx context.Context, tx pgx.Tx, msgs []*consumer.Message) error {
		batches.Add(1)
		return nil
	}
	var msgs []*consumer.Message
	for i := range 8 {
		msgs = append(msgs, &consumer.Message{ID: fmt.Sprint(i), Body: []byte{byte(i)}})
	}
	e.publish(msgs...)
	rt, err := consumer.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	stop := run(t, rt)
	e.settle(rt, 8)
	stop()
	if batches.Load() != 1 {
		t.Fatalf("%d batches, want 1 of 8", batches.Load())
	}
	if n, sum := histogram(t, reg, "idemq_batch_size", map[string]string{"consumer": "bulk"}); n != 1 || sum != 8 {
		t.Errorf("batch size: %d samples summing to %g, want one of 8", n, sum)
	}
	if got := gauge(t, reg, "idemq_batch_fill_ratio", map[string]string{"consumer": "bulk"}); got != 1 {
		t.Errorf("fill ratio %g, want 1", got)
	}
	// The group's one COMMIT: once per COMMIT, once per message it applied.
	if n, _ := histogram(t, reg, "idemq_db_commit_duration_seconds", map[string]string{"consumer": "bulk", "outcome": "committed"}); n != 1 {
		t.Errorf("idemq_db_commit_duration_seconds: %d samples, want 1 for the batch's COMMIT", n)
	}
	if n, _ := histogram(t, reg, "idemq_commit_duration_seconds", map[string]string{"consumer": "bulk", "source": queue}); n != 8 {
		t.Errorf("idemq_commit_duration_seconds: %d samples, want 8, one per applied message", n)
	}
	if got := gauge(t, reg, "idemq_messages_applied_total", map[string]string{"consumer": "bulk", "source": queue}); got != 8 {
		t.Errorf("applied %g, want 8", got)
	}
}

// TestCardinalityGuard feeds more distinct sources than the cap and checks
// that the label values stop growing.
func TestCardinalityGuard(t *testing.T) {
	t.Parallel()
	// The documented default of Options.MaxSources.
	const defaultMaxSources = 64
	reg := prometheus.NewRegistry()
	m, err := idemqprom.New(reg, idemqprom.Options{Consumer: "c"})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	for i := range 100 {
		msg := &consumer.Message{ID: fmt.Sprintf("id-%d", i), Source: fmt.Sprintf("q-%03d", i)}
		m.OnReceived(ctx, msg)
		m.OnApplied(ctx, msg, time.Millisecond, time.Millisecond)
		m.OnDeadLettered(ctx, msg, consumer.Failure{Class: "made-up"})
	}
	// A source seen before the cap keeps its own label afterwards.
	m.OnReceived(ctx, &consumer.Message{Source: "q-000"})

	for _, name := range []string{"idemq_messages_received_total", "idemq_messages_applied_total", "idemq_handler_duration_seconds"} {
		if n, err := testutil.GatherAndCount(reg, name); err != nil || n != defaultMaxSources+1 {
			t.Errorf("%s: %d series (%v), want %d sources plus \"other\"", name, n, err, defaultMaxSources)
		}
	}
	if got := gauge(t, reg, "idemq_messages_received_total", map[string]string{"source": "q-000"}); got != 2 {
		t.Errorf("q-000 received %g, want 2", got)
	}
	if got := gauge(t, reg, "idemq_messages_received_total", map[string]string{"source": "q-063"}); got != 1 {
		t.Errorf("q-063 (the 64th source) received %g, want 1", got)
	}
	if find(t, reg, "idemq_messages_received_total", map[string]string{"source": "q-064"}) != nil {
		t.Error("the 65th source got its own label")
	}
	if got := gauge(t, reg, "idemq_messages_received_total", map[string]string{"source": "other"}); got != 36 {
		t.Errorf("other received %g, want 36", got)
	}
	if got := gauge(t, reg, "idemq_source_labels_folded_total", map[string]string{"consumer": "c"}); got != 36 {
		t.Errorf("folded %g, want 36", got)
	}
	// Unknown failure classes are bounded too.
	if n, _ := testutil.GatherAndCount(reg, "idemq_messages_dead_lettered_total"); n != defaultMaxSources+1 {
		t.Errorf("%d dead-letter series, want %d", n, defaultMaxSources+1)
	}
	if got := gauge(t, reg, "idemq_messages_dead_lettered_total", map[string]string{"source": "q-001", "class": "other"}); got != 1 {
		t.Errorf("dead letters of an unknown class under class=other: %g, want 1", got)
	}
	// No label ever carries a message id.
	mfs, _ := reg.Gather()
	for _, mf := range mfs {
		for _, mt := range mf.GetMetric() {
			for _, lp := range mt.GetLabel() {
				if strings.HasPrefix(lp.GetValue(), "id-") {
					t.Fatalf("%s has a message id label %s=%q", mf.GetName(), lp.GetName(), lp.GetValue())
				}
			}
		}
	}

	// A smaller cap.
	reg2 := prometheus.NewRegistry()
	m2, err := idemqprom.New(reg2, idemqprom.Options{Consumer: "c", MaxSources: 2})
	if err != nil {
		t.Fatal(err)
	}
	for _, s := range []string{"a", "b", "c", "d", "a"} {
		m2.OnReceived(ctx, &consumer.Message{Source: s})
	}
	if n, _ := testutil.GatherAndCount(reg2, "idemq_messages_received_total"); n != 3 {
		t.Errorf("MaxSources 2: %d series, want 3", n)
	}
}

// TestSharedRegistry runs the metrics of two consumers on one registry.
func TestSharedRegistry(t *testing.T) {
	t.Parallel()
	reg := prometheus.NewRegistry()
	a, err := idemqprom.New(reg, idemqprom.Options{Consumer: "a"})
	if err != nil {
		t.Fatal(err)
	}
	b, err := idemqprom.New(reg, idemqprom.Options{Consumer: "b"})
	if err != nil {
		t.Fatalf("second consumer on one registry: %v", err)
	}
	ctx := context.Background()
	a.OnReceived(ctx, &consumer.Message{Source: "q"})
	b.OnReceived(ctx, &consumer.Message{Source: "q"})
	b.OnReceived(ctx, &consumer.Message{Source: "q"})
	if got := gauge(t, reg, "idemq_messages_received_total", map[string]string{"consumer": "b"}); got != 2 {
		t.Errorf("b received %g, want 2", got)
	}
	if got := gauge(t, reg, "idemq_messages_received_total", map[string]string{"consumer": "a"}); got != 1 {
		t.Errorf("a received %g, want 1", got)
	}
}

func TestOptionsValidation(t *testing.T) {
	t.Parallel()
	reg := prometheus.NewRegistry()
	for _, o := range []idemqprom.Options{{}, {Consumer: "x", MaxSources: -1}, {Consumer: "x", BatchSize: -1}} {
		if _, err := idemqprom.New(reg, o); !errors.Is(err, consumer.ErrInvalidConfig) {
			t.Errorf("New(%+v): %v, want ErrInvalidConfig", o, err)
		}
	}
	if _, err := idemqprom.New(nil, idemqprom.Options{Consumer: "x"}); !errors.Is(err, consumer.ErrInvalidConfig) {
		t.Errorf("nil registerer: %v", err)
	}
	// A foreign collector under one of idemq's names is reported.
	clash := prometheus.NewGauge(prometheus.GaugeOpts{Name: "idemq_messages_received_total", Help: "not ours"})
	reg.MustRegister(clash)
	if _, err := idemqprom.New(reg, idemqprom.Options{Consumer: "x"}); err == nil {
		t.Error("New over a clashing collector succeeded")
	}
}
