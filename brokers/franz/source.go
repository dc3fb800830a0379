package franz

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

	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/internal/kafkamsg"
	"github.com/idemq/idemq/internal/kafkaoffsets"
)

// maxPoll bounds the records taken by one poll.
const maxPoll = 256

// Source consumes a Kafka topic as a member of a consumer group, with
// franz-go, and implements consumer.Source's Configure and
// consumer.Source's AckBatch.
//
// It reads with the read_committed isolation level: records of aborted
// transactions, records past the last stable offset and transaction
// markers never reach Receive. Offsets are committed manually, per
// partition, only up to the highest contiguous acked offset, every
// Config.CommitInterval, when a rebalance revokes the partition and on
// Close; never for a partition this member has lost.
//
// A Source is safe for concurrent use. Create one with NewSource.
type Source struct {
	cfg Config
	// log is the current logger, with topic and group attributes: from
	// Configure's SourceSettings.Logger, discarding until then. It is
	// read at each log call, so a logger given by Configure reaches the
	// goroutines NewSource started, franz-go's included.
	log atomic.Pointer[slog.Logger]
	// explicitMaxInFlight is set if Config.MaxInFlight was: Configure
	// then leaves it alone.
	explicitMaxInFlight bool
	mp                  kafkamsg.Mapping
	cl                  *kgo.Client
	dl                  consumer.DeadLetterer // DeadLetterer's, on cl

	out    chan *entry   // polled records, from the poll loop to Receive
	redo   chan struct{} // signalled when requeued is appended to
	room   chan struct{} // signalled when inFlight drops
	closed chan struct{}

	// commitMu serialises commits with the partition callbacks: no commit
	// can be under way for a partition once its revoke or loss is noted.
	commitMu sync.Mutex

	mu          sync.Mutex
	parts       map[topicPartition]*partition // the current assignment
	requeued    []*entry                      // nacked records to hand out again
	inFlight    int                           // entries in some partition's pending list
	maxInFlight int                           // Config.MaxInFlight, or Configure's larger window
	joined      bool                          // an assignment was received

	closeOnce sync.Once
	cancel    context.CancelFunc
	wg        sync.WaitGroup
}

type topicPartition struct {
	topic     string
	partition int32
}

// entry states.
const (
	stateQueued    = kafkaoffsets.Queued    // polled or requeued, not handed out
	stateOut       = kafkaoffsets.Out       // handed out by Receive, not yet settled
	stateAcked     = kafkaoffsets.Acked     // acked: committable once every earlier entry is
	stateAbandoned = kafkaoffsets.Abandoned // its partition was revoked or lost first
)

// entry is one polled record, with its leader epoch for the commit. Its
// State and msg are guarded by the Source's mutex.
type entry struct {
	kafkaoffsets.Entry
	p   *partition
	msg *consumer.Message
}

// partition is one assigned partition, from its assignment to its
// revocation or loss. Its fields are guarded by the Source's mutex.
type partition struct {
	s  *Source
	tp topicPartition
	// offs holds the partition's polled entries that are not yet
	// committable, and the commit point.
	offs      kafkaoffsets.Partition
	handedOut int           // entries in stateOut
	ending    bool          // revoked or lost: hand nothing more out
	over      bool          // its final commit is made: acks are stale
	settled   chan struct{} // signalled when handedOut drops
}

// NewSource validates cfg, builds the dead-letterer (see DeadLetterer),
// creates the franz-go client and starts joining the consumer group in the
// background. It does not wait for the brokers: connection and group errors
// are logged and retried. An invalid cfg, cfg.DeadLetter included, fails
// with a *consumer.ConfigError.
func NewSource(cfg Config) (*Source, error) {
	explicitMaxInFlight := cfg.MaxInFlight != 0
	cfg = cfg.withDefaults()
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	s := &Source{
		cfg:                 cfg,
		explicitMaxInFlight: explicitMaxInFlight,
		mp:                  kafkamsg.Mapping{},
		out:                 make(chan *entry),
		redo:                make(chan struct{}, 1),
		room:                make(chan struct{}, 1),
		closed:              make(chan struct{}),
		parts:               map[topicPartition]*partition{},
		maxInFlight:         cfg.MaxInFlight,
	}
	// The runtime's logger comes with Configure; until then, and without
	// a runtime, the Source's logs are discarded.
	s.setLogger(slog.New(slog.DiscardHandler))
	if err := s.newDeadLetterer(); err != nil {
		return nil, err
	}
	reset := kgo.NewOffset().AtStart()
	if cfg.ResetToLatest {
		reset = kgo.NewOffset().AtEnd()
	}
	opts := []kgo.Opt{
		kgo.SeedBrokers(cfg.Brokers...),
		kgo.ConsumerGroup(cfg.Group),
		kgo.ConsumeTopics(cfg.Topic),
		kgo.FetchIsolationLevel(kgo.ReadCommitted()),
		kgo.KeepControlRecords(), // to commit past them; never handed out
		kgo.ConsumeResetOffset(reset),
		kgo.DisableAutoCommit(),
		kgo.BlockRebalanceOnPoll(),
		kgo.OnPartitionsAssigned(s.assigned),
		kgo.OnPartitionsRevoked(s.revoked),
		kgo.OnPartitionsLost(s.lost),
		kgo.SessionTimeout(cfg.SessionTimeout),
		kgo.HeartbeatInterval(cfg.HeartbeatInterval),
		kgo.RebalanceTimeout(cfg.RebalanceTimeout),
		kgo.FetchMaxWait(cfg.FetchMaxWait),
		kgo.WithLogger(logger{s.logger}),
	}
	cl, err := kgo.NewClient(append(opts, cfg.Options...)...)
	if err != nil {
		return nil, &consumer.ConfigError{Field: "franz.Config", Reason: err.Error()}
	}
	s.cl = cl
	ctx, cancel := context.WithCancel(context.Background())
	s.cancel = cancel
	s.wg.Add(2)
	go func() {
		defer s.wg.Done()
		s.poll(ctx)
	}()
	go func() {
		defer s.wg.Done()
		s.commitLoop(ctx)
	}()
	return s, nil
}

// Configure takes the runtime's settings; consumer.New calls it once,
// before the first Receive. The Source and franz-go
// log to s.Logger from then on, with "topic" and "group" attributes.
// Without Config.MaxInFlight, a window larger than the default raises
// MaxInFlight to it; an explicit MaxInFlight is kept. Configure returns
// MaxInFlight: the records the Source holds at once.
func (s *Source) Configure(st consumer.SourceSettings) (window int) {
	if st.Logger != nil {
		s.setLogger(st.Logger)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if !s.explicitMaxInFlight && st.Window > s.maxInFlight {
		s.maxInFlight = st.Window
		s.signalRoom()
	}
	return s.maxInFlight
}

// setLogger makes l, with the Source's attributes, the Source's logger.
func (s *Source) setLogger(l *slog.Logger) {
	s.log.Store(l.With("topic", s.cfg.Topic, "group", s.cfg.Group))
}

// logger returns the Source's current logger.
func (s *Source) logger() *slog.Logger { return s.log.Load() }

// poll polls records, registers them with their partitions, lets
// rebalances proceed, and offers the records to Receive, until ctx is done.
// Registering happens while rebalances are blocked (BlockRebalanceOnPoll),
// so a polled record always belongs to the assignment it was fetched for.
func (s *Source) poll(ctx context.Context) {
	for {
		room := s.waitRoom(ctx)
		if room == 0 {
			return
		}
		fetches := s.cl.PollRecords(ctx, min(room, maxPoll))
		if fetches.IsClientClosed() || ctx.Err() != nil {
			s.cl.AllowRebalance()
			return
		}
		fetches.EachError(func(topic string, p int32, err error) {
			if !errors.Is(err, context.Canceled) {
				s.logger().Warn("franz: fetch failed; retrying", "partition", p, "error", err)
			}
		})
		var batch []*entry
		s.mu.Lock()
		fetches.EachRecord(func(r *kgo.Record) {
			p := s.parts[topicPartition{r.Topic, r.Partition}]
			if p == nil || p.ending {
				return // not ours any more: the next owner reads it
			}
			if r.Attrs.IsControl() {
				p.skipControlLocked(r)
				return
			}
			e := &entry{Entry: kafkaoffsets.Entry{Offset: r.Offset, Epoch: r.LeaderEpoch}, p: p, msg: s.message(r)}
			p.offs.Add(&e.Entry)
			s.inFlight++
			batch = append(batch, e)
		})
		s.mu.Unlock()
		s.cl.AllowRebalance()
		for _, e := range batch {
			select {
			case s.out <- e:
			case <-ctx.Done():
				return
			}
		}
	}
}

// skipControlLocked accounts for a transaction marker, which is never handed
// out: it counts as acked, so the commit point moves past it once every
// earlier record is acked, and the group's lag can reach zero. The caller
// holds the Source's mutex.
func (p *partition) skipControlLocked(r *kgo.Record) {
	if p.offs.Control(r.Offset, r.LeaderEpoch) {
		p.s.inFlight++ // pending behind an unacked record
	}
}

// waitRoom waits until fewer than MaxInFlight records are in flight, and
// returns how many more may be. It returns 0 once ctx is done.
func (s *Source) waitRoom(ctx context.Context) int {
	for {
		s.mu.Lock()
		room := s.maxInFlight - s.inFlight
		s.mu.Unlock()
		if room > 0 {
			return room
		}
		select {
		case <-s.room:
		case <-ctx.Done():
			return 0
		}
	}
}

// message converts a franz-go record the way brokers/kafka converts a
// kafka-go one (both through kafkamsg), so that ids, keys and metadata
// agree.
func (s *Source) message(r *kgo.Record) *consumer.Message {
	m := kafkamsg.Record{
		Topic:     r.Topic,
		Partition: int(r.Partition),
		Offset:    r.Offset,
		Key:       r.Key,
		Value:     r.Value,
		Time:      r.Timestamp,
	}
	if len(r.Headers) > 0 {
		m.Headers = make([]kafkamsg.Header, len(r.Headers))
		for i, h := range r.Headers {
			m.Headers[i] = kafkamsg.Header{Key: h.Key, Value: h.Value}
		}
	}
	msg := s.mp.Message(m)
	msg.Metadata["kafka.group"] = s.cfg.Group
	msg.Metadata["kafka.leader_epoch"] = strconv.Itoa(int(r.LeaderEpoch))
	return msg
}

// assigned starts tracking newly assigned partitions.
func (s *Source) assigned(_ context.Context, _ *kgo.Client, assigned map[string][]int32) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.joined = true
	for topic, ps := range assigned {
		for _, id := range ps {
			tp := topicPartition{topic, id}
			if s.parts[tp] == nil {
				s.parts[tp] = &partition{s: s, tp: tp, offs: kafkaoffsets.New(), settled: make(chan struct{}, 1)}
			}
		}
	}
	s.logger().Debug("franz: partitions assigned", "assigned", fmt.Sprint(assigned))
}

// revoked runs when a rebalance takes partitions away (and when the client
// leaves the group): it stops handing their records out, waits up to
// DrainTimeout for the handed-out ones, commits what they allow and lets
// the partitions go. The rebalance waits for it.
func (s *Source) revoked(ctx context.Context, _ *kgo.Client, revoked map[string][]int32) {
	s.commitMu.Lock()
	defer s.commitMu.Unlock()
	ps := s.ending(revoked)
	if !s.isClosed() {
		s.drain(ps)
	}
	s.commitLocked(ctx, ps)
	s.release(ps)
	s.logger().Debug("franz: partitions revoked", "revoked", fmt.Sprint(revoked))
}

// lost runs when the member lost its partitions without a clean revoke
// (its session expired, or a fatal group error): another member may own
// them already, so nothing is committed for them.
func (s *Source) lost(_ context.Context, _ *kgo.Client, lost map[string][]int32) {
	s.commitMu.Lock()
	defer s.commitMu.Unlock()
	ps := s.ending(lost)
	s.release(ps)
	if len(ps) > 0 {
		s.logger().Info("franz: partitions lost; their next owner re-reads the unacked records", "lost", fmt.Sprint(lost))
	}
}

// ending marks the named partitions ending and returns them.
func (s *Source) ending(which map[string][]int32) []*partition {
	s.mu.Lock()
	defer s.mu.Unlock()
	var ps []*partition
	for topic, ids := range which {
		for _, id := range ids {
			if p := s.parts[topicPartition{topic, id}]; p != nil {
				p.ending = true
				ps = append(ps, p)
			}
		}
	}
	return ps
}

// drain waits up to DrainTimeout for the handed-out entries of ps to be
// settled.
func (s *Source) drain(ps []*partition) {
	timer := time.NewTimer(s.cfg.DrainTimeout)
	defer timer.Stop()
	for _, p := range ps {
		for {
			s.mu.Lock()
			n := p.handedOut
			s.mu.Unlock()
			if n == 0 {
				break
			}
			select {
			case <-p.settled:
			case <-s.closed:
				return
			case <-timer.C:
				s.logger().Info("franz: rebalance: abandoning unsettled messages; their next owner re-reads them", "partition", p.tp.partition, "unsettled", n)
				return
			}
		}
	}
}

// release marks ps over and forgets them: their later acks are stale.
func (s *Source) release(ps []*partition) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, p := range ps {
		p.over = true
		s.inFlight -= p.offs.Release()
		if s.parts[p.tp] == p {
			delete(s.parts, p.tp)
		}
	}
	s.signalRoom()
}

// commitLoop commits every CommitInterval until ctx is done.
func (s *Source) commitLoop(ctx context.Context) {
	t := time.NewTicker(s.cfg.CommitInterval)
	defer t.Stop()
	for {
		select {
		case <-t.C:
			s.commit(ctx)
		case <-ctx.Done():
			return
		}
	}
}

// commit commits the highest contiguous acked offset of every partition
// this member owns, where it moved.
func (s *Source) commit(ctx context.Context) {
	s.commitMu.Lock()
	defer s.commitMu.Unlock()
	s.mu.Lock()
	ps := make([]*partition, 0, len(s.parts))
	for _, p := range s.parts {
		ps = append(ps, p)
	}
	s.mu.Unlock()
	s.commitLocked(ctx, ps)
}

// commitLocked commits the highest contiguous acked offset of each of ps
// that is not over, where it moved, and waits for the answer. The caller
// holds commitMu. A failed commit is logged and retried at the next tick;
// the records it covers are re-read after a crash or rebalance, and
// deduplicated.
func (s *Source) commitLocked(ctx context.Context, ps []*partition) {
	offsets := map[string]map[int32]kgo.EpochOffset{}
	s.mu.Lock()
	for _, p := range ps {
		to, due := p.offs.Due()
		if p.over || !due {
			continue
		}
		if offsets[p.tp.topic] == nil {
			offsets[p.tp.topic] = map[int32]kgo.EpochOffset{}
		}
		offsets[p.tp.topic][p.tp.partition] = kgo.EpochOffset{Epoch: to.Epoch, Offset: to.Offset}
	}
	s.mu.Unlock()
	if len(offsets) == 0 {
		return
	}
	cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), s.cfg.CommitTimeout)
	defer cancel()
	var errs []error
	s.cl.CommitOffsetsSync(cctx, offsets, func(_ *kgo.Client, _ *kmsg.OffsetCommitRequest, resp *kmsg.OffsetCommitResponse, err error) {
		if err != nil {
			errs = append(errs, err)
			clear(offsets) // nothing is known to be committed
			return
		}
		for _, t := range resp.Topics {
			for _, p := range t.Partitions {
				if err := kerr.ErrorForCode(p.ErrorCode); err != nil {
					errs = append(errs, fmt.Errorf("partition %d: %w", p.Partition, err))
					delete(offsets[t.Topic], p.Partition)
				}
			}
		}
	})
	if len(errs) > 0 {
		s.logger().Warn("franz: offset commit failed; will retry", "error", errors.Join(errs...))
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, p := range ps {
		if eo, ok := offsets[p.tp.topic][p.tp.partition]; ok {
			p.offs.Committed(eo.Offset)
		}
	}
}

// Assigned returns the partitions of Config.Topic assigned to this member,
// in ascending order, and true; or nil and false before the member has
// joined the group. It is meant for readiness checks and tests: the
// assignment can change at any moment.
func (s *Source) Assigned() ([]int, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if !s.joined {
		return nil, false
	}
	var ids []int
	for tp, p := range s.parts {
		if tp.topic == s.cfg.Topic && !p.ending {
			ids = append(ids, int(tp.partition))
		}
	}
	slices.Sort(ids)
	return ids, true
}

// Receive returns the next record: a requeued one if any, else the next
// polled one. Records of partitions this member no longer owns are dropped,
// not returned: their next owner reads them. Receive returns an error
// wrapping consumer.ErrSourceClosed once the Source is closed, and ctx's
// error when ctx is done.
func (s *Source) Receive(ctx context.Context) (consumer.Delivery, error) {
	for {
		if s.isClosed() {
			return nil, fmt.Errorf("franz: receive: %w", consumer.ErrSourceClosed)
		}
		s.mu.Lock()
		if len(s.requeued) > 0 {
			e := s.requeued[0]
			s.requeued[0] = nil
			s.requeued = s.requeued[1:]
			d := s.handOutLocked(e)
			s.mu.Unlock()
			if d != nil {
				return d, nil
			}
			continue
		}
		s.mu.Unlock()
		select {
		case <-ctx.Done():
			return nil, ctx.Err()
		case <-s.closed:
			return nil, fmt.Errorf("franz: receive: %w", consumer.ErrSourceClosed)
		case <-s.redo:
		case e := <-s.out:
			s.mu.Lock()
			d := s.handOutLocked(e)
			s.mu.Unlock()
			if d != nil {
				return d, nil
			}
		}
	}
}

// handOutLocked marks e handed out and returns its delivery, or abandons it
// and returns nil if its partition is ending.
func (s *Source) handOutLocked(e *entry) *delivery {
	if e.p.ending || e.State != stateQueued {
		if e.State == stateQueued {
			e.State = stateAbandoned
		}
		return nil
	}
	e.State = stateOut
	e.p.handedOut++
	return &delivery{e: e, msg: e.msg}
}

// AckBatch acks every delivery in ds, which this Source delivered; it
// implements consumer.Source's AckBatch. Acks are local bookkeeping, and offsets
// are committed in batches anyway, so this is only a convenience. The
// returned error joins each delivery's Ack error.
func (s *Source) AckBatch(ctx context.Context, ds []consumer.Delivery) error {
	var errs []error
	for _, d := range ds {
		fd, ok := d.(*delivery)
		if !ok || fd.e.p.s != s {
			errs = append(errs, fmt.Errorf("franz: ack batch: %T was not delivered by this source", d))
			continue
		}
		if err := fd.Ack(ctx); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

var (
	_ consumer.Source = (*Source)(nil)
)

// Close commits the highest contiguous acked offset of every partition this
// member owns, leaves the consumer group and stops every goroutine of the
// Source. Records handed out and not acked are not committed: the group
// reads them again. Acks after Close return an error wrapping
// consumer.ErrSourceClosed, and so does DeadLetter on the Source's
// dead-letterer (see DeadLetterer), which produces on the client Close
// closes. Close is idempotent and returns nil.
func (s *Source) Close() error {
	s.closeOnce.Do(func() {
		close(s.closed)
		s.cancel()
		s.wg.Wait()
		// Leaving the group revokes every partition: revoked makes the
		// final commit, without draining.
		s.cl.CloseAllowingRebalance()
		s.mu.Lock()
		ps := make([]*partition, 0, len(s.parts))
		for _, p := range s.parts {
			ps = append(ps, p)
		}
		s.mu.Unlock()
		s.release(ps)
	})
	return nil
}

func (s *Source) isClosed() bool {
	select {
	case <-s.closed:
		return true
	default:
		return false
	}
}

func (s *Source) signalRoom() {
	select {
	case s.room <- struct{}{}:
	default:
	}
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

// delivery is one hand-out of an entry.
type delivery struct {
	e       *entry
	msg     *consumer.Message
	settled bool // guarded by the Source's mutex
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
func (d *delivery) Ack(context.Context) error {
	s := d.e.p.s
	s.mu.Lock()
	defer s.mu.Unlock()
	if err := d.settleLocked(); err != nil {
		return err
	}
	if n := d.e.p.offs.Ack(&d.e.Entry); n > 0 {
		s.inFlight -= n
		s.signalRoom()
	}
	return nil
}

// Nack gives the record back. Kafka cannot requeue a single record, so the
// Source hands it out again itself, with Message.Redelivered set, and its
// offset stays uncommitted until it is acked; with or without requeue, as
// in brokers/kafka. If a rebalance already took the partition away, the
// record is left to its next owner and Nack returns nil.
//
// Nack returns an error wrapping consumer.ErrDeliveryStale if the delivery
// was already settled, and one wrapping consumer.ErrSourceClosed if the
// Source was closed first.
func (d *delivery) Nack(_ context.Context, _ bool) error {
	s := d.e.p.s
	s.mu.Lock()
	if err := d.settleLocked(); err != nil {
		s.mu.Unlock()
		if errors.Is(err, errRevoked) {
			return nil // the next owner re-reads it
		}
		return err
	}
	e := d.e
	if e.p.ending {
		e.State = stateAbandoned
		s.mu.Unlock()
		return nil
	}
	e.State = stateQueued
	e.msg = e.msg.Clone()
	e.msg.Redelivered = true
	e.msg.Attempt = 0
	s.mu.Unlock()
	s.requeue(e)
	return nil
}

// errRevoked is wrapped, with consumer.ErrDeliveryStale, by acks of a
// partition that a rebalance took away.
var errRevoked = errors.New("partition revoked by a rebalance; its next owner re-reads the record")

// settleLocked marks d settled, or returns why it cannot be. The caller
// holds the Source's mutex and sets the entry's new state.
func (d *delivery) settleLocked() error {
	p := d.e.p
	if d.settled {
		return fmt.Errorf("franz: %w: already acked or nacked", consumer.ErrDeliveryStale)
	}
	d.settled = true
	p.handedOut--
	select {
	case p.settled <- struct{}{}:
	default:
	}
	if p.over {
		d.e.State = stateAbandoned
		if p.s.isClosed() {
			return fmt.Errorf("franz: %w", consumer.ErrSourceClosed)
		}
		return fmt.Errorf("franz: %w: %w", consumer.ErrDeliveryStale, errRevoked)
	}
	return nil
}

// logger adapts the slog.Logger l returns, at each call, to kgo.Logger:
// franz-go's own logs go out at debug level, its warnings and errors at
// warn level.
type logger struct{ l func() *slog.Logger }

func (l logger) Level() kgo.LogLevel {
	sl := l.l()
	if sl.Enabled(context.Background(), slog.LevelDebug) {
		return kgo.LogLevelDebug
	}
	if sl.Enabled(context.Background(), slog.LevelWarn) {
		return kgo.LogLevelWarn
	}
	return kgo.LogLevelNone
}

func (l logger) Log(level kgo.LogLevel, msg string, keyvals ...any) {
	lv := slog.LevelDebug
	if level <= kgo.LogLevelWarn {
		lv = slog.LevelWarn
	}
	l.l().Log(context.Background(), lv, "franz-go: "+msg, keyvals...)
}
