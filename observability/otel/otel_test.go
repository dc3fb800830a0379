package idemqotel_test

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"
	"go.uber.org/goleak"

	"github.com/idemq/idemq/brokers/memory"
	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/internal/testdb"
	idemqotel "github.com/idemq/idemq/observability/otel"
	"github.com/idemq/idemq/processed"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m, testdb.LeakOptions()...)
}

// tracing is an SDK tracer provider recording spans in memory.
type tracing struct {
	rec *tracetest.SpanRecorder
	tp  *sdktrace.TracerProvider
}

func newTracing(t *testing.T) *tracing {
	rec := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
	t.Cleanup(func() { _ = tp.Shutdown(context.Background()) })
	return &tracing{rec: rec, tp: tp}
}

// produce returns msg with the context of a new producer span injected into
// its headers, and that span's context.
func (tr *tracing) produce(msg *consumer.Message) (*consumer.Message, trace.SpanContext) {
	ctx, span := tr.tp.Tracer("producer").Start(context.Background(), "send", trace.WithSpanKind(trace.SpanKindProducer))
	defer span.End()
	idemqotel.InjectMessage(ctx, msg)
	return msg, span.SpanContext()
}

// spans returns the ended spans of the trace of sc whose name is name.
func (tr *tracing) spans(sc trace.SpanContext, name string) []sdktrace.ReadOnlySpan {
	var out []sdktrace.ReadOnlySpan
	for _, s := range tr.rec.Ended() {
		if s.SpanContext().TraceID() == sc.TraceID() && s.Name() == name {
			out = append(out, s)
		}
	}
	return out
}

func attr(s sdktrace.ReadOnlySpan, key string) (attribute.Value, bool) {
	for _, kv := range s.Attributes() {
		if string(kv.Key) == key {
			return kv.Value, true
		}
	}
	return attribute.Value{}, false
}

// wantAttrs checks string, int and bool attributes of s.
func wantAttrs(t *testing.T, s sdktrace.ReadOnlySpan, want map[string]any) {
	t.Helper()
	for k, w := range want {
		v, ok := attr(s, k)
		if !ok {
			t.Errorf("span %q lacks attribute %s", s.Name(), k)
			continue
		}
		if got := v.AsInterface(); fmt.Sprint(got) != fmt.Sprint(w) {
			t.Errorf("span %q: %s = %v, want %v", s.Name(), k, got, w)
		}
	}
}

// oneChildOf checks that exactly n spans named name exist in the producer's
// trace, each a child of the producer span, and returns them.
func (tr *tracing) childrenOf(t *testing.T, producer trace.SpanContext, name string, n int) []sdktrace.ReadOnlySpan {
	t.Helper()
	got := tr.spans(producer, name)
	if len(got) != n {
		t.Fatalf("%d %q spans in the producer's trace, want %d (all ended spans: %v)", len(got), name, n, names(tr.rec.Ended()))
	}
	for _, s := range got {
		if s.Parent().SpanID() != producer.SpanID() || !s.Parent().IsRemote() {
			t.Errorf("span %q has parent %v, want the remote producer span %v", s.Name(), s.Parent().SpanID(), producer.SpanID())
		}
	}
	return got
}

func names(spans []sdktrace.ReadOnlySpan) []string {
	var out []string
	for _, s := range spans {
		out = append(out, s.Name())
	}
	return out
}

func event(t *testing.T, s sdktrace.ReadOnlySpan, name string) sdktrace.Event {
	t.Helper()
	for _, e := range s.Events() {
		if e.Name == name {
			return e
		}
	}
	t.Fatalf("span %q has no %q event (events %v)", s.Name(), name, s.Events())
	return sdktrace.Event{}
}

func eventAttr(e sdktrace.Event, key string) (attribute.Value, bool) {
	for _, kv := range e.Attributes {
		if string(kv.Key) == key {
			return kv.Value, true
		}
	}
	return attribute.Value{}, false
}

// seen records the span context each handler attempt ran with.
type seen struct {
	mu  sync.Mutex
	ctx map[string][]trace.SpanContext // by message id, one per attempt
}

func (s *seen) add(id string, ctx context.Context) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.ctx == nil {
		s.ctx = map[string][]trace.SpanContext{}
	}
	s.ctx[id] = append(s.ctx[id], trace.SpanContextFromContext(ctx))
}

func (s *seen) get(id string) []trace.SpanContext {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]trace.SpanContext(nil), s.ctx[id]...)
}

// handler applies ok messages, fails "flaky" once and "bad" for good, and
// records the context of every attempt.
func handler(s *seen) consumer.Handler {
	var flaked atomic.Bool
	return func(ctx context.Context, tx pgx.Tx, msg *consumer.Message) error {
		s.add(msg.ID, ctx)
		switch msg.ID {
		case "flaky":
			if !flaked.Swap(true) {
				return errors.New("lock timeout")
			}
		case "bad":
			return consumer.Permanent(errors.New("unknown account"))
		}
		_, err := tx.Exec(ctx, "SELECT 1")
		return err
	}
}

func migratedStore(t *testing.T) *processed.Store {
	t.Helper()
	store, err := processed.New(testdb.Pool(t), processed.Config{Schema: testdb.Schema(t)})
	if err != nil {
		t.Fatal(err)
	}
	if err := store.Migrate(context.Background()); err != nil {
		t.Fatal(err)
	}
	return store
}

// start runs rt and returns a function that stops it and waits for Run.
func start(t *testing.T, rt *consumer.Runtime) (stop func()) {
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
	deadline := time.Now().Add(30 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func randomName(prefix string) string {
	var b [6]byte
	_, _ = rand.Read(b[:])
	return prefix + "-" + hex.EncodeToString(b[:])
}

func TestInjectExtract(t *testing.T) {
	t.Parallel()
	tr := newTracing(t)
	ctx, span := tr.tp.Tracer("t").Start(context.Background(), "parent")
	defer span.End()

	h := map[string]string{"content-type": "application/json"}
	idemqotel.InjectHeaders(ctx, h)
	if len(h["traceparent"]) != 55 || h["content-type"] != "application/json" {
		t.Fatalf("headers after inject: %v", h)
	}
	got := trace.SpanContextFromContext(idemqotel.Extract(context.Background(), &consumer.Message{Headers: h}))
	if got.TraceID() != span.SpanContext().TraceID() || got.SpanID() != span.SpanContext().SpanID() || !got.IsRemote() {
		t.Errorf("extracted %v, want the remote %v", got, span.SpanContext())
	}

	// No span: nothing written, nothing read.
	h2 := map[string]string{}
	idemqotel.InjectHeaders(context.Background(), h2)
	if len(h2) != 0 {
		t.Errorf("inject without a span wrote %v", h2)
	}
	if sc := trace.SpanContextFromContext(idemqotel.Extract(context.Background(), &consumer.Message{})); sc.IsValid() {
		t.Errorf("extract from no headers gave %v", sc)
	}
	// A nil map is left alone; InjectMessage makes one.
	idemqotel.InjectHeaders(ctx, nil)
	m := &consumer.Message{}
	idemqotel.InjectMessage(ctx, m)
	if m.Headers["traceparent"] != h["traceparent"] {
		t.Errorf("InjectMessage: %v", m.Headers)
	}
	m2 := &consumer.Message{}
	idemqotel.InjectMessage(context.Background(), m2)
	if m2.Headers != nil {
		t.Errorf("InjectMessage without a span made headers %v", m2.Headers)
	}
	// The dead-letter envelope keeps the headers, so the trace survives.
	if got := idemqotel.Extract(context.Background(), m.Clone()); trace.SpanContextFromContext(got).TraceID() != span.SpanContext().TraceID() {
		t.Error("a cloned message lost its trace")
	}
}

// TestMemoryOutcomes runs every outcome through a real runtime on the
// memory broker and checks the spans and events of each message's trace.
func TestMemoryOutcomes(t *testing.T) {
	t.Parallel()
	tr := newTracing(t)
	broker := memory.NewBroker()
	sub, err := broker.Subscribe("payments", memory.SubscribeOptions{})
	if err != nil {
		t.Fatal(err)
	}
	tracing := idemqotel.New(idemqotel.Options{Consumer: "ledger", TracerProvider: tr.tp})
	var s seen
	rt, err := consumer.New(consumer.Config{
		Name: "ledger", Source: sub, Store: migratedStore(t), BatchSize: 1, // one process span per handler call, none repeated by a group's rollback
		Handler: handler(&s), Middleware: []consumer.Middleware{tracing.Middleware()}, Hooks: []consumer.Hook{tracing},
		Retry:           consumer.RetryConfig{InitialInterval: time.Millisecond, MaxInterval: 5 * time.Millisecond},
		ShutdownTimeout: 5 * time.Second,
	})
	if err != nil {
		t.Fatal(err)
	}
	stop := start(t, rt)
	ok, okSC := tr.produce(&consumer.Message{ID: "ok", Body: []byte("10")})
	flaky, flakySC := tr.produce(&consumer.Message{ID: "flaky", Body: []byte("20")})
	bad, badSC := tr.produce(&consumer.Message{ID: "bad", Body: []byte("30")})
	plain := &consumer.Message{ID: "plain", Body: []byte("40")} // no trace context
	if err := broker.Publish(context.Background(), "payments", ok, flaky, bad, plain); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "3 applied, 1 dead-lettered", func() bool { s := rt.Stats(); return s.Applied == 3 && s.DeadLettered == 1 })
	if err := broker.Publish(context.Background(), "payments", ok); err != nil { // a duplicate
		t.Fatal(err)
	}
	waitFor(t, "a duplicate", func() bool { return rt.Stats().Duplicates == 1 })
	stop()

	common := map[string]any{
		"messaging.system": "idemq", "messaging.destination.name": "payments",
		"messaging.consumer.group.name": "ledger", "messaging.operation.name": "process",
		"messaging.operation.type": "process",
	}
	// ok: one process span, child of the producer, whose context the
	// handler ran with; then a duplicate span with its event.
	p := tr.childrenOf(t, okSC, "process payments", 1)[0]
	wantAttrs(t, p, common)
	wantAttrs(t, p, map[string]any{"messaging.message.id": "ok", "idemq.attempt": 1, "messaging.message.body.size": 2})
	if p.SpanKind() != trace.SpanKindConsumer || p.Status().Code == codes.Error {
		t.Errorf("process span: kind %v, status %v", p.SpanKind(), p.Status())
	}
	if got := s.get("ok"); len(got) != 1 || got[0].SpanID() != p.SpanContext().SpanID() {
		t.Errorf("the handler ran with %v, want the process span %v", got, p.SpanContext().SpanID())
	}
	d := tr.childrenOf(t, okSC, "duplicate payments", 1)[0]
	wantAttrs(t, d, map[string]any{"messaging.operation.type": "settle", "messaging.message.id": "ok"})
	e := event(t, d, "idemq.duplicate")
	if age, ok := eventAttr(e, "idemq.duplicate.age_seconds"); !ok || age.AsFloat64() < 0 || age.AsFloat64() > 60 {
		t.Errorf("duplicate age %v", age)
	}
	if _, ok := eventAttr(e, "idemq.processed_at"); !ok {
		t.Error("duplicate event lacks processed_at")
	}

	// flaky: two attempts, the first failed, with a retry span between.
	ps := tr.childrenOf(t, flakySC, "process payments", 2)
	var failed, succeeded int
	for _, p := range ps {
		v, _ := attr(p, "idemq.attempt")
		switch {
		case v.AsInt64() == 1 && p.Status().Code == codes.Error && len(p.Events()) == 1 && p.Events()[0].Name == "exception":
			failed++
		case v.AsInt64() == 2 && p.Status().Code != codes.Error:
			succeeded++
		}
	}
	if failed != 1 || succeeded != 1 {
		t.Errorf("flaky's process spans: %d failed first attempts, %d successful second ones; want 1 and 1", failed, succeeded)
	}
	r := tr.childrenOf(t, flakySC, "retry payments", 1)[0]
	re := event(t, r, "idemq.retry")
	if v, _ := eventAttr(re, "idemq.attempt"); v.AsInt64() != 1 {
		t.Errorf("retry event attempt %v, want 1", v)
	}
	if v, _ := eventAttr(re, "exception.message"); v.AsString() != "lock timeout" {
		t.Errorf("retry event error %q", v.AsString())
	}

	// bad: a failed process span marked permanent, then a dead_letter span.
	bp := tr.childrenOf(t, badSC, "process payments", 1)[0]
	if bp.Status().Code != codes.Error {
		t.Errorf("bad's process span status %v", bp.Status())
	}
	wantAttrs(t, bp, map[string]any{"idemq.error.permanent": true})
	dl := tr.childrenOf(t, badSC, "dead_letter payments", 1)[0]
	if dl.Status().Code != codes.Error {
		t.Errorf("dead_letter span status %v", dl.Status())
	}
	de := event(t, dl, "idemq.dead_lettered")
	if v, _ := eventAttr(de, "idemq.error.class"); v.AsString() != string(consumer.ClassPermanent) {
		t.Errorf("dead-letter class %q", v.AsString())
	}
	// The dead-letter copy keeps the producer's trace context.
	dlqMsgs := broker.Messages("payments.dlq")
	if len(dlqMsgs) != 1 {
		t.Fatalf("%d messages in the DLQ", len(dlqMsgs))
	}
	if sc := trace.SpanContextFromContext(idemqotel.Extract(context.Background(), dlqMsgs[0])); sc.TraceID() != badSC.TraceID() || sc.SpanID() != badSC.SpanID() {
		t.Errorf("DLQ copy carries %v, want the producer's %v", sc, badSC)
	}

	// plain: no context in the headers, so a root span of its own.
	pc := s.get("plain")
	if len(pc) != 1 || !pc[0].IsValid() {
		t.Fatalf("plain ran with %v", pc)
	}
	for _, sp := range tr.rec.Ended() {
		if sp.SpanContext().SpanID() == pc[0].SpanID() && sp.Parent().IsValid() {
			t.Errorf("plain's span has parent %v", sp.Parent())
		}
	}
}

// TestBatchLinks checks the batch span and its links to the producers.
func TestBatchLinks(t *testing.T) {
	t.Parallel()
	tr := newTracing(t)
	broker := memory.NewBroker()
	sub, err := broker.Subscribe("orders", memory.SubscribeOptions{})
	if err != nil {
		t.Fatal(err)
	}
	tracing := idemqotel.New(idemqotel.Options{TracerProvider: tr.tp, System: "custom"})
	var batchSpans sync.Map
	rt, err := consumer.New(consumer.Config{
		Name: "bulk", Source: sub, Store: migratedStore(t),
		BatchHandler: tracing.WrapBatch(func(ctx context.Context, tx pgx.Tx, msgs []*consumer.Message) error {
			batchSpans.Store(trace.SpanContextFromContext(ctx).SpanID(), len(msgs))
			return nil
		}),
		Concurrency: 1, BatchSize: 4, BatchWait: 10 * time.Second,
		ShutdownTimeout: 5 * time.Second,
	})
	if err != nil {
		t.Fatal(err)
	}
	var produced []trace.SpanContext
	var msgs []*consumer.Message
	for i := range 4 {
		m, sc := tr.produce(&consumer.Message{ID: fmt.Sprint(i), Body: []byte{byte(i)}})
		msgs, produced = append(msgs, m), append(produced, sc)
	}
	if err := broker.Publish(context.Background(), "orders", msgs...); err != nil {
		t.Fatal(err)
	}
	stop := start(t, rt)
	waitFor(t, "4 applied", func() bool { return rt.Stats().Applied == 4 })
	stop()

	var batch []sdktrace.ReadOnlySpan
	for _, s := range tr.rec.Ended() {
		if s.Name() == "process orders" {
			batch = append(batch, s)
		}
	}
	if len(batch) != 1 {
		t.Fatalf("%d batch spans, want 1", len(batch))
	}
	b := batch[0]
	if n, ok := batchSpans.Load(b.SpanContext().SpanID()); !ok || n != 4 {
		t.Errorf("the batch handler did not run with the batch span over 4 messages")
	}
	wantAttrs(t, b, map[string]any{"messaging.batch.message_count": 4, "messaging.system": "custom", "messaging.destination.name": "orders"})
	if len(b.Links()) != 4 {
		t.Fatalf("%d links, want 4", len(b.Links()))
	}
	for i, l := range b.Links() {
		if l.SpanContext.SpanID() != produced[i].SpanID() {
			t.Errorf("link %d to %v, want producer span %v", i, l.SpanContext.SpanID(), produced[i].SpanID())
		}
	}
}
