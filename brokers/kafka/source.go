package kafka

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/internal/kafkamsg"
	"github.com/idemq/idemq/internal/kafkaoffsets"
	kafkago "github.com/segmentio/kafka-go"
)

// Source consumes a Kafka topic as a member of a consumer group and
// has consumer.Source's optional Configure and AckBatch methods.
//
// It uses kafka-go's ConsumerGroup directly rather than its group Reader, so
// that it knows each generation's partition assignment: it reads each
// assigned partition with its own Reader, commits through the generation
// that owns the partition, and never commits for a partition once a
// rebalance has taken it away. Offsets are committed only up to the highest
// contiguous acked offset of each partition, every Config.CommitInterval,
// when a generation ends and on Close: never past a record that is still
// being handled.
//
// A Source is safe for concurrent use. Create one with NewSource.
type Source struct {
	cfg Config
	// log is the current logger, with topic and group attributes: from
	// Configure's SourceSettings.Logger, discarding until then. It is
	// read at each log call, so a logger given by Configure reaches the
	// goroutines NewSource started.
	log atomic.Pointer[slog.Logger]
	// explicitMaxInFlight is set if Config.MaxInFlight was: Configure
	// then leaves it alone.
	explicitMaxInFlight bool
	// maxInFlight is Config.MaxInFlight, or Configure's window if that is
	// larger; read at each fetch.
	maxInFlight atomic.Int64

	cg        *kafkago.ConsumerGroup
	transport *kafkago.Transport // for the partition fetches
	client    *kafkago.Client    // for offset look-ups, on transport

	out    chan *entry   // fetched records, from the partition readers to Receive
	redo   chan struct{} // signalled when requeued is appended to
	closed chan struct{}

	mu       sync.Mutex
	requeued []*entry    // nacked records to hand out again, oldest first
	current  *generation // the generation in progress, or nil

	dl    consumer.DeadLetterer // DeadLetterer's, made by NewSource
	dlPub *Publisher            // dl's, on transport; closed by Close

	closeOnce sync.Once
	closeErr  error
	cancel    context.CancelFunc
	wg        sync.WaitGroup
}

// entry states.
const (
	stateQueued    = kafkaoffsets.Queued    // fetched or requeued, not handed out
	stateOut       = kafkaoffsets.Out       // handed out by Receive, not yet settled
	stateAcked     = kafkaoffsets.Acked     // acked: committable once every earlier entry is
	stateAbandoned = kafkaoffsets.Abandoned // the generation ended before it was acked
)

// entry is one fetched record of a partition. Its State is guarded by the
// generation's mutex.
type entry struct {
	kafkaoffsets.Entry
	p   *partition
	msg *consumer.Message
}

// partition is one assigned partition within one generation. Its fields are
// guarded by the generation's mutex.
type partition struct {
	g     *generation
	topic string
	id    int
	start int64 // offset to start reading at
	// offs holds the partition's fetched entries that are not yet
	// committable, and the commit point.
	offs kafkaoffsets.Partition
	// held counts the entries that hold one of the partition's
	// MaxInFlight slots: from before their fetch until they are
	// committable. room is signalled when held drops, or the limit rises.
	held int
	room chan struct{}
}

// generation is one consumer group generation: this member's assignment
// until the next rebalance.
type generation struct {
	s   *Source
	gen *kafkago.Generation

	mu        sync.Mutex
	parts     []*partition
	handedOut int  // entries in stateOut
	ending    bool // the generation ended: hand nothing more out
	over      bool // the final commit is made: acks are stale
	settled   chan struct{}
}

// NewSource validates cfg, builds the dead-letterer (see DeadLetterer) and
// starts joining the consumer group in the background. It does not wait for
// the brokers: connection and group errors are logged and retried. An
// invalid cfg, cfg.DeadLetter included, fails with a *consumer.ConfigError.
func NewSource(cfg Config) (*Source, error) {
	explicitMaxInFlight := cfg.MaxInFlight != 0
	cfg = cfg.withDefaults()
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	transport := dialerTransport(cfg.Dialer)
	s := &Source{
		cfg:                 cfg,
		explicitMaxInFlight: explicitMaxInFlight,
		transport:           transport,
		client:              &kafkago.Client{Addr: kafkago.TCP(cfg.Brokers...), Transport: transport},
		out:                 make(chan *entry),
		redo:                make(chan struct{}, 1),
		closed:              make(chan struct{}),
	}
	// The runtime's logger comes with Configure; until then, and without
	// a runtime, the Source's logs are discarded.
	s.setLogger(slog.New(slog.DiscardHandler))
	s.maxInFlight.Store(int64(cfg.MaxInFlight))
	if err := s.newDeadLetterer(); err != nil {
		return nil, err
	}
	cg, err := kafkago.NewConsumerGroup(kafkago.ConsumerGroupConfig{
		ID:                cfg.GroupID,
		Brokers:           cfg.Brokers,
		Dialer:            cfg.Dialer,
		Topics:            []string{cfg.Topic},
		HeartbeatInterval: cfg.HeartbeatInterval,
		SessionTimeout:    cfg.SessionTimeout,
		RebalanceTimeout:  cfg.RebalanceTimeout,
		JoinGroupBackoff:  cfg.JoinGroupBackoff,
		StartOffset:       cfg.StartOffset,
		Logger:            kafkaLogger(s.logger, slog.LevelDebug),
		ErrorLogger:       kafkaLogger(s.logger, slog.LevelWarn),
	})
	if err != nil {
		_ = s.dlPub.Close()
		return nil, &consumer.ConfigError{Field: "kafka.Config", Reason: err.Error()}
	}
	ctx, cancel := context.WithCancel(context.Background())
	s.cg, s.cancel = cg, cancel
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		s.run(ctx)
	}()
	return s, nil
}

// Configure takes the runtime's settings; consumer.New calls it once,
// before the first Receive. The Source, kafka-go and
// the dead-letterer log to s.Logger from then on, with "topic" and "group"
// attributes. Without Config.MaxInFlight, a window larger than the default
// raises MaxInFlight to it, for the partitions already being read too; an
// explicit MaxInFlight is kept. Configure returns MaxInFlight: the records
// the Source holds unsettled, per partition, so at least that many even
// with a single partition assigned.
func (s *Source) Configure(st consumer.SourceSettings) (window int) {
	if st.Logger != nil {
		s.setLogger(st.Logger)
	}
	for w := int64(st.Window); !s.explicitMaxInFlight; {
		cur := s.maxInFlight.Load()
		if w <= cur {
			break
		}
		if s.maxInFlight.CompareAndSwap(cur, w) {
			s.wakeFetchers()
			break
		}
	}
	return int(s.maxInFlight.Load())
}

// setLogger makes l, with the Source's attributes, the Source's logger.
func (s *Source) setLogger(l *slog.Logger) {
	s.log.Store(l.With("topic", s.cfg.Topic, "group", s.cfg.GroupID))
}

// logger returns the Source's current logger.
func (s *Source) logger() *slog.Logger { return s.log.Load() }

// wakeFetchers wakes the current generation's partition readers that wait
// for room, after MaxInFlight rose.
func (s *Source) wakeFetchers() {
	s.mu.Lock()
	g := s.current
	s.mu.Unlock()
	if g == nil {
		return // a later generation reads the new limit
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	for _, p := range g.parts {
		p.signalRoom()
	}
}

// run takes the group's generations one after another until the group is
// closed.
func (s *Source) run(ctx context.Context) {
	for {
		gen, err := s.cg.Next(ctx)
		switch {
		case ctx.Err() != nil || errors.Is(err, kafkago.ErrGroupClosed):
			return
		case err != nil:
			s.logger().Warn("kafka: joining consumer group failed; retrying", "error", err)
			continue
		}
		s.startGeneration(gen)
	}
}

// startGeneration starts a reader per assigned partition and the commit
// loop, all bound to the generation: kafka-go waits for them before joining
// the next one.
func (s *Source) startGeneration(gen *kafkago.Generation) {
	g := &generation{s: s, gen: gen, settled: make(chan struct{}, 1)}
	for topic, assigned := range gen.Assignments {
		for _, a := range assigned {
			g.parts = append(g.parts, &partition{
				g:     g,
				topic: topic,
				id:    a.ID,
				start: a.Offset,
				offs:  kafkaoffsets.New(),
				room:  make(chan struct{}, 1),
			})
		}
	}
	s.mu.Lock()
	s.current = g
	s.mu.Unlock()
	if log := s.logger(); log.Enabled(context.Background(), slog.LevelDebug) {
		log.Debug("kafka: generation started", "generation", gen.ID, "member", gen.MemberID, "assignments", assignmentString(gen))
	}
	s.start(gen, g.commitLoop)
	for _, p := range g.parts {
		s.start(gen, p.fetch)
	}
}

// start runs fn bound to gen, and tracked by the Source's WaitGroup: kafka-go
// does not track functions started on a generation that already ended.
func (s *Source) start(gen *kafkago.Generation, fn func(context.Context)) {
	s.wg.Add(1)
	gen.Start(func(ctx context.Context) {
		defer s.wg.Done()
		fn(ctx)
	})
}

// fetch reads the partition from its start offset and offers each record to
// Receive, until the generation ends. It reads committed data only (see
// partReader): records of aborted transactions are never read, and
// transaction markers are never handed out, only counted as acked so that
// the commit moves past them.
func (p *partition) fetch(ctx context.Context) {
	g, s := p.g, p.g.s
	if ctx.Err() != nil {
		return
	}
	// log returns the Source's current logger, for this partition.
	log := func() *slog.Logger { return s.logger().With("partition", p.id, "generation", g.gen.ID) }
	r := &partReader{
		transport: s.transport,
		addr:      kafkago.TCP(s.cfg.Brokers...),
		topic:     p.topic,
		partition: p.id,
		maxBytes:  s.cfg.FetchMaxBytes,
		maxWait:   s.cfg.FetchMaxWait,
		offset:    p.start,
	}
	failures := 0
	// backoff waits after a failure; it returns false if ctx is done.
	backoff := func(what string, err error) bool {
		failures++
		wait := min(time.Duration(failures)*100*time.Millisecond, 5*time.Second)
		log().Warn("kafka: "+what+" failed; retrying", "error", err, "wait", wait)
		t := time.NewTimer(wait)
		defer t.Stop()
		select {
		case <-t.C:
			return true
		case <-ctx.Done():
			return false
		}
	}
	// resolve turns the reader's offset, if it is FirstOffset or
	// LastOffset, into a real one; it returns false if ctx is done.
	resolve := func() bool {
		for {
			off, err := resolveOffset(ctx, s.client, p.topic, p.id, r.offset)
			if err == nil {
				r.offset = off
				return true
			}
			if ctx.Err() != nil || !backoff("resolving the start offset", err) {
				return false
			}
		}
	}
	if !resolve() {
		return
	}
	failures = 0
	for {
		if !p.acquire(ctx) {
			return
		}
		f, err := r.next(ctx)
		if err != nil {
			g.mu.Lock()
			p.releaseLocked(1)
			g.mu.Unlock()
			if ctx.Err() != nil {
				return
			}
			if errors.Is(err, errOffsetOutOfRange) {
				log().Warn("kafka: offset out of range; restarting from the configured StartOffset", "offset", r.offset, "start_offset", s.cfg.StartOffset)
				r.offset, r.buf, r.pending, r.aborted = s.cfg.StartOffset, nil, nil, nil
				if !resolve() {
					return
				}
				continue
			}
			if !backoff("fetch", err) {
				return
			}
			continue
		}
		failures = 0
		if f.control {
			p.skipControl(f.msg.Offset)
			continue
		}
		e := &entry{Entry: kafkaoffsets.Entry{Offset: f.msg.Offset, Epoch: -1}, p: p, msg: s.message(f.msg, g.gen)}
		g.mu.Lock()
		p.offs.Add(&e.Entry)
		g.mu.Unlock()
		select {
		case s.out <- e:
		case <-ctx.Done():
			g.mu.Lock()
			e.State = stateAbandoned
			g.mu.Unlock()
			return
		}
	}
}

// skipControl accounts for a transaction marker at offset, which holds a
// slot: it is never handed out, and counts as acked, so the commit point
// moves past it once every earlier record is acked.
func (p *partition) skipControl(offset int64) {
	g := p.g
	g.mu.Lock()
	defer g.mu.Unlock()
	if !p.offs.Control(offset, -1) {
		p.releaseLocked(1) // committable already
	}
}

// acquire takes one of the partition's slots, waiting while MaxInFlight of
// them are held. It returns false if ctx is done first.
func (p *partition) acquire(ctx context.Context) bool {
	g := p.g
	for {
		g.mu.Lock()
		if int64(p.held) < g.s.maxInFlight.Load() {
			p.held++
			g.mu.Unlock()
			return true
		}
		g.mu.Unlock()
		select {
		case <-p.room:
		case <-ctx.Done():
			return false
		}
	}
}

// releaseLocked gives n slots back. The caller holds the generation's
// mutex.
func (p *partition) releaseLocked(n int) {
	p.held -= n
	p.signalRoom()
}

// signalRoom wakes acquire.
func (p *partition) signalRoom() {
	select {
	case p.room <- struct{}{}:
	default:
	}
}

// message converts a kafka-go message, noting the generation that read it.
func (s *Source) message(m kafkago.Message, gen *kafkago.Generation) *consumer.Message {
	msg := kafkamsg.Mapping{}.Message(record(m))
	msg.Metadata["kafka.group"] = gen.GroupID
	msg.Metadata["kafka.generation"] = strconv.Itoa(int(gen.ID))
	msg.Metadata["kafka.member"] = gen.MemberID
	return msg
}

// Assigned returns the partitions of Config.Topic assigned to this member
// in the current generation, in ascending order, and true; or nil and false
// while the member is joining the group or rebalancing. It is meant for
// readiness checks and tests: the assignment can change at any moment.
func (s *Source) Assigned() ([]int, bool) {
	s.mu.Lock()
	g := s.current
	s.mu.Unlock()
	if g == nil {
		return nil, false
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.ending {
		return nil, false
	}
	ids := make([]int, 0, len(g.parts))
	for _, p := range g.parts {
		ids = append(ids, p.id)
	}
	slices.Sort(ids)
	return ids, true
}

// Receive returns the next record: a requeued one if any, else the next
// fetched one. Records of partitions this member no longer owns are
// dropped, not returned: their next owner reads them. Receive returns an
// error wrapping consumer.ErrSourceClosed once the Source is closed, and
// ctx's error when ctx is done.
func (s *Source) Receive(ctx context.Context) (consumer.Delivery, error) {
	for {
		select {
		case <-s.closed:
			return nil, fmt.Errorf("kafka: receive: %w", consumer.ErrSourceClosed)
		default:
		}
		s.mu.Lock()
		if len(s.requeued) > 0 {
			e := s.requeued[0]
			s.requeued[0] = nil
			s.requeued = s.requeued[1:]
			s.mu.Unlock()
			if d := e.handOut(); d != nil {
				return d, nil
			}
			continue
		}
		s.mu.Unlock()
		select {
		case <-ctx.Done():
			return nil, ctx.Err()
		case <-s.closed:
			return nil, fmt.Errorf("kafka: receive: %w", consumer.ErrSourceClosed)
		case <-s.redo:
		case e := <-s.out:
			if d := e.handOut(); d != nil {
				return d, nil
			}
		}
	}
}

// handOut marks e handed out and returns its delivery, or abandons it and
// returns nil if its generation has ended.
func (e *entry) handOut() *delivery {
	g := e.p.g
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.ending || e.State != stateQueued {
		if e.State == stateQueued {
			e.State = stateAbandoned
		}
		return nil
	}
	e.State = stateOut
	g.handedOut++
	return &delivery{e: e, msg: e.msg}
}

// AckBatch acks every delivery in ds, which this Source delivered; it
// implements consumer.Source's AckBatch. Acks are local bookkeeping, and offsets
// are committed in batches anyway, so this is only a convenience. The
// returned error joins each delivery's Ack error.
func (s *Source) AckBatch(ctx context.Context, ds []consumer.Delivery) error {
	var errs []error
	for _, d := range ds {
		kd, ok := d.(*delivery)
		if !ok || kd.e.p.g.s != s {
			errs = append(errs, fmt.Errorf("kafka: ack batch: %T was not delivered by this source", d))
			continue
		}
		if err := kd.Ack(ctx); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// requeue puts e back in the Source's queue, as a redelivery.
func (s *Source) requeue(e *entry) {
	s.mu.Lock()
	s.requeued = append(s.requeued, e)
	s.mu.Unlock()
	select {
	case s.redo <- struct{}{}:
	default:
	}
}

// Close commits the highest contiguous acked offset of every partition this
// member owns, leaves the consumer group and stops every goroutine of the
// Source. Records handed out and not acked are not committed: the group
// reads them again. Acks after Close return an error wrapping
// consumer.ErrSourceClosed, and so does DeadLetter on the Source's
// dead-letterer (see DeadLetterer), whose Publisher Close closes after its
// writes in flight. Close is idempotent; it returns an error only if that
// Publisher's close failed.
func (s *Source) Close() error {
	s.closeOnce.Do(func() {
		close(s.closed)
		// Closing the group ends the current generation: its commit loop
		// makes the final commit, and its readers stop.
		_ = s.cg.Close()
		s.cancel()
		s.wg.Wait()
		s.closeErr = s.dlPub.Close()
		s.transport.CloseIdleConnections()
	})
	return s.closeErr
}

func (s *Source) isClosed() bool {
	select {
	case <-s.closed:
		return true
	default:
		return false
	}
}

// commitLoop commits every CommitInterval until the generation ends, then
// drains (on a rebalance), makes the final commit and marks the generation
// over.
func (g *generation) commitLoop(ctx context.Context) {
	s := g.s
	t := time.NewTicker(s.cfg.CommitInterval)
	defer t.Stop()
loop:
	for {
		select {
		case <-t.C:
			g.commit()
		case <-ctx.Done():
			break loop
		}
	}
	g.mu.Lock()
	g.ending = true
	g.mu.Unlock()
	s.mu.Lock()
	if s.current == g {
		s.current = nil
	}
	s.mu.Unlock()
	if !s.isClosed() {
		g.drain(s.cfg.DrainTimeout)
	}
	g.mu.Lock()
	g.over = true
	g.mu.Unlock()
	g.commit()
	s.logger().Debug("kafka: generation ended", "generation", g.gen.ID)
}

// drain waits up to timeout for every handed-out entry to be settled.
func (g *generation) drain(timeout time.Duration) {
	timer := time.NewTimer(timeout)
	defer timer.Stop()
	for {
		g.mu.Lock()
		n := g.handedOut
		g.mu.Unlock()
		if n == 0 {
			return
		}
		select {
		case <-g.settled:
		case <-g.s.closed:
			return
		case <-timer.C:
			g.s.logger().Info("kafka: rebalance: abandoning unsettled messages; their next owner re-reads them", "generation", g.gen.ID, "unsettled", n)
			return
		}
	}
}

// commit commits each partition's highest contiguous acked offset, if it
// moved. A failed commit is logged and retried at the next tick; the records
// it covers are re-read after a crash or rebalance, and deduplicated.
func (g *generation) commit() {
	offsets := map[string]map[int]int64{}
	g.mu.Lock()
	for _, p := range g.parts {
		if to, due := p.offs.Due(); due {
			if offsets[p.topic] == nil {
				offsets[p.topic] = map[int]int64{}
			}
			offsets[p.topic][p.id] = to.Offset
		}
	}
	g.mu.Unlock()
	if len(offsets) == 0 {
		return
	}
	if err := g.gen.CommitOffsets(offsets); err != nil {
		g.s.logger().Warn("kafka: offset commit failed; will retry", "generation", g.gen.ID, "error", err)
		return
	}
	g.mu.Lock()
	for _, p := range g.parts {
		if off, ok := offsets[p.topic][p.id]; ok {
			p.offs.Committed(off)
		}
	}
	g.mu.Unlock()
}

// signal wakes drain.
func (g *generation) signal() {
	select {
	case g.settled <- struct{}{}:
	default:
	}
}

// delivery is one hand-out of an entry.
type delivery struct {
	e       *entry
	msg     *consumer.Message
	settled bool // guarded by the generation's mutex
}

// Message returns the delivered message.
func (d *delivery) Message() *consumer.Message { return d.msg }

// Ack marks the record handled. Its offset is committed with the next
// commit once every earlier record of its partition is acked too.
//
// Ack returns an error wrapping consumer.ErrDeliveryStale if the delivery
// was already settled, or if a rebalance took the partition away and its
// offsets can no longer be committed by this member (the next owner re-reads
// the record and the runtime's dedup absorbs it), and one wrapping
// consumer.ErrSourceClosed if the Source was closed first.
func (d *delivery) Ack(ctx context.Context) error {
	e := d.e
	g := e.p.g
	g.mu.Lock()
	defer g.mu.Unlock()
	if err := d.settleLocked(); err != nil {
		return err
	}
	if n := e.p.offs.Ack(&e.Entry); n > 0 {
		e.p.releaseLocked(n)
	}
	return nil
}

// Nack gives the record back. Kafka cannot requeue a single record, so the
// Source hands it out again itself, with Message.Redelivered set, and its
// offset stays uncommitted until it is acked. Without requeue the same
// happens: dropping a record would lose it, and the runtime dead-letters
// through its DeadLetterer and then acks instead. If a rebalance already
// took the partition away, the record is left to its next owner and Nack
// returns nil.
//
// Nack returns an error wrapping consumer.ErrDeliveryStale if the delivery
// was already settled, and one wrapping consumer.ErrSourceClosed if the
// Source was closed first.
func (d *delivery) Nack(ctx context.Context, requeue bool) error {
	e := d.e
	g := e.p.g
	g.mu.Lock()
	if err := d.settleLocked(); err != nil {
		g.mu.Unlock()
		if errors.Is(err, errRevoked) {
			return nil // the next owner re-reads it
		}
		return err
	}
	if g.ending {
		e.State = stateAbandoned
		g.mu.Unlock()
		return nil
	}
	e.State = stateQueued
	e.msg = e.msg.Clone()
	e.msg.Redelivered = true
	e.msg.Attempt = 0
	g.mu.Unlock()
	g.s.requeue(e)
	return nil
}

// errRevoked is wrapped, with consumer.ErrDeliveryStale, by acks of a
// partition that a rebalance took away.
var errRevoked = errors.New("partition revoked by a rebalance; its next owner re-reads the record")

// settleLocked marks d settled, or returns why it cannot be. The caller
// holds the generation's mutex and sets the entry's new state.
func (d *delivery) settleLocked() error {
	g := d.e.p.g
	if d.settled {
		return fmt.Errorf("kafka: %w: already acked or nacked", consumer.ErrDeliveryStale)
	}
	d.settled = true
	g.handedOut--
	g.signal()
	if g.over {
		d.e.State = stateAbandoned
		if g.s.isClosed() {
			return fmt.Errorf("kafka: %w", consumer.ErrSourceClosed)
		}
		return fmt.Errorf("kafka: %w: %w", consumer.ErrDeliveryStale, errRevoked)
	}
	return nil
}

// assignmentString renders a generation's assignment for logs.
func assignmentString(gen *kafkago.Generation) string {
	var b []byte
	for topic, parts := range gen.Assignments {
		for _, p := range parts {
			if len(b) > 0 {
				b = append(b, ' ')
			}
			b = fmt.Appendf(b, "%s/%d@%d", topic, p.ID, p.Offset)
		}
	}
	return string(b)
}

// kafkaLogger adapts the logger log returns, at each call, to kafka-go's
// Logger at the given level.
func kafkaLogger(log func() *slog.Logger, level slog.Level) kafkago.Logger {
	return kafkago.LoggerFunc(func(format string, args ...any) {
		if l := log(); l.Enabled(context.Background(), level) {
			l.Log(context.Background(), level, "kafka-go: "+fmt.Sprintf(format, args...))
		}
	})
}
