// Package idemqprom exports the metrics of an idemq consumer to Prometheus,
// through the runtime's hooks. It is a separate package, so the core
// (package consumer) does not depend on client_golang.
//
// Setup is one line, plus one to watch the runtime's gauges:
//
//	m, err := idemqprom.New(prometheus.DefaultRegisterer, idemqprom.Options{Consumer: "billing"})
//	rt, err := consumer.New(consumer.Config{Name: "billing", Hooks: []consumer.Hook{m}, ...})
//	err = m.RegisterRuntime(rt)
//
// # Metrics
//
// Every metric has the label "consumer"; the per-message ones also have
// "source" (the queue or topic, Message.Source), and dead letters have
// "class" (the consumer.FailureClass, or "other" for a class this version
// does not know). Message ids are never labels. The
// number of distinct source values is capped by Options.MaxSources: further
// sources are counted under the value "other", and
// idemq_source_labels_folded_total counts the messages that were folded.
//
//	idemq_messages_received_total       counter    deliveries taken from the source
//	idemq_messages_applied_total        counter    messages whose effect committed
//	idemq_messages_duplicates_total     counter    messages skipped as already applied
//	idemq_handler_retries_total         counter    failed handler attempts that were retried
//	idemq_messages_dead_lettered_total  counter    dead letters, by class
//	idemq_ack_failures_total            counter    acks that failed after a commit
//	idemq_handler_duration_seconds      histogram  handler time of applied messages
//	idemq_commit_duration_seconds       histogram  commit time of applied messages
//	idemq_db_commit_duration_seconds    histogram  each COMMIT's time, by outcome
//	idemq_end_to_end_latency_seconds    histogram  from Message.Timestamp to the commit
//	idemq_duplicate_age_seconds         histogram  from the original's processed_at to its duplicate
//	idemq_batch_size                    histogram  deliveries per batch transaction (batch mode)
//	idemq_batch_fill_ratio              gauge      last batch's size over Options.BatchSize
//	idemq_in_flight_messages            gauge      received and not yet settled (RegisterRuntime)
//	idemq_messages_requeued_total       counter    given back unsettled (RegisterRuntime)
//	idemq_source_labels_folded_total    counter    messages counted under source="other"
//
// The duplicate age tells whether the dedup retention window is long
// enough: if duplicates keep arriving close to the retention, a longer
// window (or a faster producer fix) is due, because a duplicate arriving
// after its row was purged is applied again.
//
// idemq_commit_duration_seconds observes a transaction's commit once per
// message it applied, so that it adds up with the other per-message
// histograms; in batch mode a group's commit is observed once for each of
// its new messages, and idemq_batch_size and idemq_batch_fill_ratio
// describe the groups. idemq_db_commit_duration_seconds observes each
// COMMIT the runtime sent once, whatever it held, with the label "outcome":
// "committed", or "failed" (rolled back, or unknown after a lost
// connection). Its tail is what an ack waits for: a synchronous standby
// that is slow or gone shows there first (the runtime never cancels a
// COMMIT; consumer.Config.SlowCommit logs the slow ones).
package idemqprom

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/idemq/idemq/consumer"
)

const (
	defaultNamespace  = "idemq"
	defaultMaxSources = 64
	// otherSource is the source label value of the messages whose source
	// came after MaxSources distinct ones, and the class label value of
	// unknown failure classes.
	otherSource = "other"
)

// The default histogram buckets, in seconds (or, for batch sizes,
// messages), as the Options fields document them.
var (
	defaultDurationBuckets     = []float64{.0005, .001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30}
	defaultLatencyBuckets      = []float64{.001, .005, .01, .05, .1, .5, 1, 5, 10, 30, 60, 300, 900, 3600, 4 * 3600}
	defaultDuplicateAgeBuckets = []float64{1, 10, 60, 600, 3600, 6 * 3600, 86400, 3 * 86400, 7 * 86400, 14 * 86400, 30 * 86400, 90 * 86400}
	defaultBatchSizeBuckets    = []float64{1, 2, 5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10000}
)

// Options configures the metrics. The zero value of every optional field
// selects a documented default.
type Options struct {
	// Consumer is the value of the "consumer" label: the runtime's
	// consumer.Config.Name. Required.
	Consumer string
	// Namespace prefixes every metric name. Defaults to "idemq".
	Namespace string
	// MaxSources caps the distinct values of the "source" label for this
	// consumer; messages from further sources are counted as "other".
	// Defaults to 64.
	MaxSources int
	// BatchSize is the runtime's consumer.Config.BatchSize, the
	// denominator of idemq_batch_fill_ratio. Defaults to 0: the ratio
	// gauge is not exported (batch sizes still are).
	BatchSize int
	// DurationBuckets are the buckets of the handler and commit duration
	// histograms (both of them), in seconds. Defaults to .0005, .001,
	// .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10 and 30.
	DurationBuckets []float64
	// LatencyBuckets are the buckets of the end-to-end latency histogram,
	// in seconds. Defaults to .001, .005, .01, .05, .1, .5, 1, 5, 10, 30,
	// 60, 300, 900, 3600 and 14400 (1ms to 4h).
	LatencyBuckets []float64
	// DuplicateAgeBuckets are the buckets of the duplicate age histogram,
	// in seconds; make them reach past the dedup retention. Defaults to
	// 1s, 10s, 1m, 10m, 1h, 6h, 1, 3, 7, 14, 30 and 90 days.
	DuplicateAgeBuckets []float64
	// BatchSizeBuckets are the buckets of the batch size histogram.
	// Defaults to 1, 2, 5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000
	// and 10000.
	BatchSizeBuckets []float64
	// Now returns the current time, for latencies and ages. Defaults to
	// time.Now.
	Now func() time.Time
}

func (o Options) withDefaults() Options {
	if o.Namespace == "" {
		o.Namespace = defaultNamespace
	}
	if o.MaxSources == 0 {
		o.MaxSources = defaultMaxSources
	}
	if o.DurationBuckets == nil {
		o.DurationBuckets = defaultDurationBuckets
	}
	if o.LatencyBuckets == nil {
		o.LatencyBuckets = defaultLatencyBuckets
	}
	if o.DuplicateAgeBuckets == nil {
		o.DuplicateAgeBuckets = defaultDuplicateAgeBuckets
	}
	if o.BatchSizeBuckets == nil {
		o.BatchSizeBuckets = defaultBatchSizeBuckets
	}
	if o.Now == nil {
		o.Now = time.Now
	}
	return o
}

func (o Options) validate() error {
	bad := func(field, format string, args ...any) error {
		return &consumer.ConfigError{Field: field, Reason: fmt.Sprintf(format, args...)}
	}
	switch {
	case o.Consumer == "":
		return bad("Consumer", "required: it is the consumer label")
	case o.MaxSources < 1:
		return bad("MaxSources", "%d, must be at least 1", o.MaxSources)
	case o.BatchSize < 0:
		return bad("BatchSize", "negative")
	}
	return nil
}

// Metrics records a consumer's events as Prometheus metrics. Put it in
// consumer.Config.Hooks; it implements every consumer.Hook* interface. It is
// safe for concurrent use.
type Metrics struct {
	consumer.HookDefaults
	opts Options
	reg  prometheus.Registerer
	vecs *vecs

	mu      sync.RWMutex
	sources map[string]*sourceMetrics // at most MaxSources, by source
	other   *sourceMetrics            // created on first use

	folded prometheus.Counter
	// committed and failed are idemq_db_commit_duration_seconds by
	// outcome.
	committed, failed prometheus.Observer
}

// vecs are the registered collectors; several Metrics on one registry
// share those the first of them registered.
type vecs struct {
	received, applied, duplicates, retries, ackFailures, deadLettered, folded *prometheus.CounterVec
	handler, commit, latency, dupAge, batchSize, dbCommit                     *prometheus.HistogramVec
	batchFill                                                                 *prometheus.GaugeVec
}

// sourceMetrics are the children of one (consumer, source) pair, looked up
// once so that hooks do not hash label values on every call.
type sourceMetrics struct {
	name                                                string
	received, applied, duplicates, retries, ackFailures prometheus.Counter
	handler, commit, latency, dupAge                    prometheus.Observer
}

var (
	_ consumer.HookReceived     = (*Metrics)(nil)
	_ consumer.HookApplied      = (*Metrics)(nil)
	_ consumer.HookCommit       = (*Metrics)(nil)
	_ consumer.HookDuplicate    = (*Metrics)(nil)
	_ consumer.HookRetry        = (*Metrics)(nil)
	_ consumer.HookDeadLettered = (*Metrics)(nil)
	_ consumer.HookAckFailed    = (*Metrics)(nil)
	_ consumer.HookBatch        = (*Metrics)(nil)
)

// New registers idemq's metrics on reg and returns the hooks that feed them
// for the consumer opts.Consumer. Several consumers may share one registry:
// each calls New with its own name, and the collectors registered by the
// first are reused.
func New(reg prometheus.Registerer, opts Options) (*Metrics, error) {
	if reg == nil {
		return nil, &consumer.ConfigError{Field: "reg", Reason: "required"}
	}
	opts = opts.withDefaults()
	if err := opts.validate(); err != nil {
		return nil, err
	}
	v, err := register(reg, opts)
	if err != nil {
		return nil, err
	}
	m := &Metrics{
		opts:    opts,
		reg:     reg,
		vecs:    v,
		sources: map[string]*sourceMetrics{},
		folded:  v.folded.WithLabelValues(opts.Consumer),
		// Both series exist from the start, so a rate of failed
		// commits reads 0 rather than nothing.
		committed: v.dbCommit.WithLabelValues(opts.Consumer, "committed"),
		failed:    v.dbCommit.WithLabelValues(opts.Consumer, "failed"),
	}
	return m, nil
}

// register creates the collectors and registers them, reusing those already
// registered under the same names.
func register(reg prometheus.Registerer, o Options) (*vecs, error) {
	ns := o.Namespace
	src := []string{"consumer", "source"}
	counter := func(name, help string, labels ...string) *prometheus.CounterVec {
		return prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: ns, Name: name, Help: help}, labels)
	}
	histogram := func(name, help string, buckets []float64, labels ...string) *prometheus.HistogramVec {
		return prometheus.NewHistogramVec(prometheus.HistogramOpts{Namespace: ns, Name: name, Help: help, Buckets: buckets}, labels)
	}
	v := &vecs{
		received:     counter("messages_received_total", "Deliveries taken from the source.", src...),
		applied:      counter("messages_applied_total", "Messages whose effect committed.", src...),
		duplicates:   counter("messages_duplicates_total", "Messages skipped because their id was already applied.", src...),
		retries:      counter("handler_retries_total", "Failed handler attempts that were retried.", src...),
		deadLettered: counter("messages_dead_lettered_total", "Messages whose dead-letter copy was accepted, by failure class.", "consumer", "source", "class"),
		ackFailures:  counter("ack_failures_total", "Acks that failed after a commit or dead-letter; the redelivery is skipped as a duplicate.", src...),
		folded:       counter("source_labels_folded_total", "Messages counted under source=\"other\" because the consumer had reached its cap of distinct source labels.", "consumer"),
		handler:      histogram("handler_duration_seconds", "Handler time of applied messages.", o.DurationBuckets, src...),
		commit:       histogram("commit_duration_seconds", "Commit time of applied messages' transactions.", o.DurationBuckets, src...),
		latency:      histogram("end_to_end_latency_seconds", "Time from the message's timestamp to the commit of its effect.", o.LatencyBuckets, src...),
		dupAge:       histogram("duplicate_age_seconds", "Time since the original of a duplicate was applied (its processed_at): compare with the dedup retention.", o.DuplicateAgeBuckets, src...),
		batchSize:    histogram("batch_size", "Deliveries per batch transaction.", o.BatchSizeBuckets, "consumer"),
		dbCommit: histogram("db_commit_duration_seconds", "Time of each COMMIT the runtime sent, once per transaction, by outcome (committed, or failed: rolled back or unknown).",
			o.DurationBuckets, "consumer", "outcome"),
		batchFill: prometheus.NewGaugeVec(prometheus.GaugeOpts{Namespace: ns, Name: "batch_fill_ratio",
			Help: "Size of the last batch over the configured batch size."}, []string{"consumer"}),
	}
	var err error
	for _, c := range []**prometheus.CounterVec{&v.received, &v.applied, &v.duplicates, &v.retries, &v.deadLettered, &v.ackFailures, &v.folded} {
		if err == nil {
			*c, err = registerOrReuse(reg, *c)
		}
	}
	for _, h := range []**prometheus.HistogramVec{&v.handler, &v.commit, &v.latency, &v.dupAge, &v.batchSize, &v.dbCommit} {
		if err == nil {
			*h, err = registerOrReuse(reg, *h)
		}
	}
	if err == nil && o.BatchSize > 0 {
		v.batchFill, err = registerOrReuse(reg, v.batchFill)
	}
	if err != nil {
		return nil, fmt.Errorf("idemqprom: register metrics: %w", err)
	}
	return v, nil
}

// registerOrReuse registers c, or returns the collector of the same type
// and description that is already registered.
func registerOrReuse[C prometheus.Collector](reg prometheus.Registerer, c C) (C, error) {
	err := reg.Register(c)
	var are prometheus.AlreadyRegisteredError
	if errors.As(err, &are) {
		if existing, ok := are.ExistingCollector.(C); ok {
			return existing, nil
		}
		return c, fmt.Errorf("a different collector is registered under the same name: %w", err)
	}
	return c, err
}

// source returns the metrics of source s. Once the consumer has MaxSources
// distinct sources, further ones share the metrics labelled otherSource, and
// folded is true.
func (m *Metrics) source(s string) (sm *sourceMetrics, folded bool) {
	m.mu.RLock()
	sm, ok := m.sources[s]
	m.mu.RUnlock()
	if ok {
		return sm, false
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	if sm, ok := m.sources[s]; ok {
		return sm, false
	}
	if s == otherSource || len(m.sources) >= m.opts.MaxSources {
		if m.other == nil {
			m.other = m.newSourceMetrics(otherSource)
		}
		return m.other, s != otherSource
	}
	sm = m.newSourceMetrics(s)
	m.sources[s] = sm
	return sm, false
}

func (m *Metrics) newSourceMetrics(label string) *sourceMetrics {
	c, v := m.opts.Consumer, m.vecs
	return &sourceMetrics{
		name:        label,
		received:    v.received.WithLabelValues(c, label),
		applied:     v.applied.WithLabelValues(c, label),
		duplicates:  v.duplicates.WithLabelValues(c, label),
		retries:     v.retries.WithLabelValues(c, label),
		ackFailures: v.ackFailures.WithLabelValues(c, label),
		handler:     v.handler.WithLabelValues(c, label),
		commit:      v.commit.WithLabelValues(c, label),
		latency:     v.latency.WithLabelValues(c, label),
		dupAge:      v.dupAge.WithLabelValues(c, label),
	}
}

// of returns the metrics of msg's source.
func (m *Metrics) of(msg *consumer.Message) *sourceMetrics {
	sm, _ := m.source(sourceOf(msg))
	return sm
}

func sourceOf(msg *consumer.Message) string {
	if msg == nil {
		return ""
	}
	return msg.Source
}

// OnReceived counts a delivery.
func (m *Metrics) OnReceived(_ context.Context, msg *consumer.Message) {
	sm, folded := m.source(sourceOf(msg))
	sm.received.Inc()
	if folded {
		m.folded.Inc()
	}
}

// OnApplied counts an applied message and observes its handler duration,
// commit duration and end-to-end latency (if the message has a timestamp).
func (m *Metrics) OnApplied(_ context.Context, msg *consumer.Message, handler, commit time.Duration) {
	s := m.of(msg)
	s.applied.Inc()
	s.handler.Observe(handler.Seconds())
	if commit > 0 {
		s.commit.Observe(commit.Seconds())
	}
	if msg != nil && !msg.Timestamp.IsZero() {
		s.latency.Observe(max(m.opts.Now().Sub(msg.Timestamp), 0).Seconds())
	}
}

// OnCommit observes a COMMIT's duration under its outcome.
func (m *Metrics) OnCommit(_ context.Context, _ int, dur time.Duration, err error) {
	o := m.committed
	if err != nil {
		o = m.failed
	}
	o.Observe(dur.Seconds())
}

// OnDuplicate counts a skipped duplicate and observes its age: now minus
// the original's processed_at.
func (m *Metrics) OnDuplicate(_ context.Context, msg *consumer.Message, processedAt time.Time) {
	s := m.of(msg)
	s.duplicates.Inc()
	if !processedAt.IsZero() {
		s.dupAge.Observe(max(m.opts.Now().Sub(processedAt), 0).Seconds())
	}
}

// OnRetry counts a retried handler attempt.
func (m *Metrics) OnRetry(_ context.Context, msg *consumer.Message, _ int, _ error, _ time.Duration) {
	m.of(msg).retries.Inc()
}

// knownClasses bounds the class label to the runtime's failure classes.
var knownClasses = map[consumer.FailureClass]bool{
	consumer.ClassRetryableExhausted:  true,
	consumer.ClassPermanent:           true,
	consumer.ClassPanic:               true,
	consumer.ClassMissingID:           true,
	consumer.ClassFingerprintMismatch: true,
	consumer.ClassTooLarge:            true,
	consumer.ClassTimeout:             true,
}

// OnDeadLettered counts a dead letter under its failure class (a class the
// runtime does not define counts as "other").
func (m *Metrics) OnDeadLettered(_ context.Context, msg *consumer.Message, f consumer.Failure) {
	class := string(f.Class)
	if !knownClasses[f.Class] {
		class = otherSource
	}
	m.vecs.deadLettered.WithLabelValues(m.opts.Consumer, m.of(msg).name, class).Inc()
}

// OnAckFailed counts an ack that failed after a commit.
func (m *Metrics) OnAckFailed(_ context.Context, msg *consumer.Message, _ error) {
	m.of(msg).ackFailures.Inc()
}

// OnBatch observes a batch's size and sets the fill ratio. The batch series
// appear with the first batch, so a consumer not in batch mode exports none.
func (m *Metrics) OnBatch(_ context.Context, size, _ int, _ time.Duration) {
	c := m.opts.Consumer
	m.vecs.batchSize.WithLabelValues(c).Observe(float64(size))
	if m.opts.BatchSize > 0 {
		m.vecs.batchFill.WithLabelValues(c).Set(float64(size) / float64(m.opts.BatchSize))
	}
}

// StatsSource is what RegisterRuntime reads: *consumer.Runtime implements
// it.
type StatsSource interface {
	Stats() consumer.Stats
}

// RegisterRuntime registers gauges read from rt when Prometheus scrapes:
// idemq_in_flight_messages and idemq_messages_requeued_total, labelled with
// this consumer's name. Call it once per runtime; it fails if a runtime with
// the same consumer name is already registered on the registry.
func (m *Metrics) RegisterRuntime(rt StatsSource) error {
	if rt == nil {
		return &consumer.ConfigError{Field: "rt", Reason: "required"}
	}
	labels := prometheus.Labels{"consumer": m.opts.Consumer}
	inFlight := prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Namespace: m.opts.Namespace, Name: "in_flight_messages", ConstLabels: labels,
		Help: "Deliveries received and not yet settled.",
	}, func() float64 { return float64(rt.Stats().InFlight) })
	requeued := prometheus.NewCounterFunc(prometheus.CounterOpts{
		Namespace: m.opts.Namespace, Name: "messages_requeued_total", ConstLabels: labels,
		Help: "Messages given back to the broker unsettled (at shutdown, or because dead-lettering failed).",
	}, func() float64 { return float64(rt.Stats().Requeued) })
	if err := m.reg.Register(inFlight); err != nil {
		return fmt.Errorf("idemqprom: register runtime gauges of consumer %q: %w", m.opts.Consumer, err)
	}
	if err := m.reg.Register(requeued); err != nil {
		m.reg.Unregister(inFlight)
		return fmt.Errorf("idemqprom: register runtime gauges of consumer %q: %w", m.opts.Consumer, err)
	}
	return nil
}
