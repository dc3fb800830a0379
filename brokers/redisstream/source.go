package redisstream

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/dlq"
)

// Bounds of the Source's own waits.
const (
	closeTimeout    = 5 * time.Second
	retryInitial    = 100 * time.Millisecond
	retryMax        = 5 * time.Second
	pendingPage     = 1000
	keepAliveBatch  = 200
	maxReleasePages = 100
)

// Stats are a Source's counters since it was created.
type Stats struct {
	// Received counts deliveries returned by Receive.
	Received int64
	// Acked counts entries acknowledged (XACK) by Ack and AckBatch.
	Acked int64
	// Nacked counts Nack calls that settled a delivery.
	Nacked int64
	// Claimed counts entries claimed with XAUTOCLAIM after MinIdle: from
	// a consumer that died, or released by one that closed.
	Claimed int64
	// Recovered counts pending entries of this Source's own consumer that
	// it had lost track of (a reply lost with its connection, an XACK
	// that failed, a restart under a fixed Config.Consumer) and
	// re-delivered.
	Recovered int64
	// Lost counts held entries the keep-alive found owned by another
	// consumer, or no longer pending: that consumer claimed them (this
	// process stalled past MinIdle). Their effects are still applied once:
	// dedup.
	Lost int64
	// Deleted counts pending entries whose data was gone from the stream
	// (trimmed with MAXLEN or XDEL before they were acked): Redis dropped
	// them from the group when they were claimed. They were never handled.
	Deleted int64
	// Released counts entries Close handed back to the group.
	Released int64
	// GroupCreated counts consumer groups created after NewSource found
	// the group gone (a server restarted without persistence, say).
	GroupCreated int64
}

// Source consumes one Redis stream as a member of a consumer group. It
// implements consumer.Source, consumer.Source's Configure,
// consumer.Source's AckBatch and consumer.Source's RedeliveryHorizon; create it with NewSource. It is safe for concurrent
// use.
type Source struct {
	cfg  Config
	mp   mapping
	rdb  *redis.Client // acks, claims, dead letters
	read *redis.Client // blocking XREADGROUP only: Close closes it to end a wait
	dl   consumer.DeadLetterer
	log  atomic.Pointer[slog.Logger]

	aofOK     bool
	aofDetail string

	life      context.Context // done once Close starts
	stop      context.CancelFunc
	closeOnce sync.Once
	closeErr  error
	startOnce sync.Once
	wg        sync.WaitGroup // fetch and keep-alive goroutines
	ready     chan struct{}  // signalled when deliveries or room appear

	mu       sync.Mutex
	held     map[string]*delivery // read and not settled, by entry id
	buf      []*delivery          // read and not yet returned by Receive
	fetching bool
	started  bool
	window   int // the most entries one read asks for
	limit    int // the most entries held: 2×window

	// Owned by the one fetch goroutine running at a time (handed over
	// under mu with fetching).
	sweepDue    atomic.Bool
	lastClaim   time.Time
	lastSweep   time.Time
	claimCursor string
	retryWait   time.Duration

	received, acked, nacked, claimed, recovered, lost, deleted, released, groupCreated atomic.Int64
}

// NewSource validates cfg, connects, and creates the stream and the consumer
// group if they do not exist (XGROUP CREATE ... MKSTREAM at cfg.StartID). It
// fails fast if the config is invalid or the server cannot be reached, and,
// with cfg.RequireAOF, if the server does not persist every write. It reads
// nothing until the first Receive.
//
// The caller closes the Source (the runtime closes its Source when Run
// returns); Close also closes the dead-letterer.
func NewSource(ctx context.Context, cfg Config) (*Source, error) {
	cfg = cfg.withDefaults()
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	s := &Source{
		cfg:    cfg,
		mp:     mapping{bodyField: cfg.BodyField},
		ready:  make(chan struct{}, 1),
		held:   map[string]*delivery{},
		window: defaultWindow,
		limit:  2 * defaultWindow,
	}
	s.life, s.stop = context.WithCancel(context.Background())
	s.sweepDue.Store(true)
	// The runtime's logger comes with Configure; until then, and without
	// a runtime, the Source's logs are discarded.
	s.setLogger(slog.New(slog.DiscardHandler))
	dl, err := dlq.NewDeadLetterer(s.publishDeadLetter, cfg.DeadLetter.Options)
	if err != nil {
		s.stop()
		return nil, prefixField("DeadLetter.Options.", err)
	}
	s.dl = dl
	if s.rdb, err = newClient(cfg.URL, cfg.DialTimeout, 0); err != nil {
		s.stop()
		return nil, err
	}
	if s.read, err = newClient(cfg.URL, cfg.DialTimeout, 2); err != nil {
		s.stop()
		_ = s.rdb.Close()
		return nil, err
	}
	fail := func(err error) (*Source, error) {
		s.stop()
		_ = s.read.Close()
		_ = s.rdb.Close()
		return nil, err
	}
	if err := s.rdb.Ping(ctx).Err(); err != nil {
		return fail(connectErr(cfg.URL, err))
	}
	s.aofOK, s.aofDetail = checkAOF(ctx, s.rdb)
	if cfg.RequireAOF && !s.aofOK {
		return fail(fmt.Errorf("redisstream: Config.RequireAOF: the server does not persist every write (%s): run it with appendonly yes and appendfsync always", s.aofDetail))
	}
	if _, err := s.ensureGroup(ctx); err != nil {
		return fail(err)
	}
	return s, nil
}

func (s *Source) setLogger(l *slog.Logger) {
	s.log.Store(l.With(slog.String("stream", s.cfg.Stream), slog.String("group", s.cfg.Group), slog.String("consumer", s.cfg.Consumer)))
}

func (s *Source) logger() *slog.Logger { return s.log.Load() }

// ensureGroup creates the stream and the group unless the group exists.
func (s *Source) ensureGroup(ctx context.Context) (created bool, err error) {
	err = s.rdb.XGroupCreateMkStream(ctx, s.cfg.Stream, s.cfg.Group, s.cfg.StartID).Err()
	switch {
	case err == nil:
		return true, nil
	case strings.HasPrefix(err.Error(), "BUSYGROUP"):
		return false, nil
	default:
		return false, fmt.Errorf("redisstream: create group %q on stream %q: %w", s.cfg.Group, s.cfg.Stream, err)
	}
}

// Consumer returns the Source's consumer name within its group.
func (s *Source) Consumer() string { return s.cfg.Consumer }

// Configure implements consumer.Source's Configure; consumer.New calls it
// once, before the first Receive. Each XREADGROUP then asks for at most the
// runtime's window of entries (COUNT), and the Source holds at most twice
// the window read and not settled (at most 10,000), so that a message or
// batch is waiting whenever a worker frees up; it logs to the runtime's
// logger. It returns the bound on held
// entries. A Source no runtime configures uses a window of 8.
// Once the first Receive ran, Configure changes nothing.
func (s *Source) Configure(set consumer.SourceSettings) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.started {
		return s.limit
	}
	if set.Window > 0 {
		s.window = min(set.Window, maxWindow/2)
		s.limit = 2 * s.window
	}
	if set.Logger != nil {
		s.setLogger(set.Logger)
	}
	return s.limit
}

// Stats returns the Source's counters.
func (s *Source) Stats() Stats {
	return Stats{
		Received: s.received.Load(), Acked: s.acked.Load(), Nacked: s.nacked.Load(),
		Claimed: s.claimed.Load(), Recovered: s.recovered.Load(), Lost: s.lost.Load(),
		Deleted: s.deleted.Load(), Released: s.released.Load(), GroupCreated: s.groupCreated.Load(),
	}
}

func (s *Source) closedErr() error {
	return fmt.Errorf("redisstream: stream %q: %w", s.cfg.Stream, consumer.ErrSourceClosed)
}

func (s *Source) closed() bool { return s.life.Err() != nil }

func (s *Source) signal() {
	select {
	case s.ready <- struct{}{}:
	default:
	}
}

// start runs once, at the first Receive: from then on Configure changes
// nothing, and the keep-alive runs.
func (s *Source) start() {
	s.startOnce.Do(func() {
		s.mu.Lock()
		defer s.mu.Unlock()
		s.started = true
		if !s.aofOK {
			s.logger().Warn("redisstream: the server does not persist every write; a crash of the server can lose dead letters, acks and the group's pending entries: run it with appendonly yes and appendfsync always",
				slog.String("persistence", s.aofDetail))
		}
		if s.cfg.KeepAlive > 0 && !s.closed() {
			s.wg.Add(1)
			go s.keepAlive()
		}
	})
}

// Receive returns the next delivery: an entry claimed from the group
// (XAUTOCLAIM, after MinIdle), one of its own pending entries it lost track
// of, an entry it nacked, or a new entry (XREADGROUP >). It blocks until
// one is available, ctx is done or the Source is closed; server errors are
// logged and retried with backoff. After Close it returns an error wrapping
// consumer.ErrSourceClosed. A read that was under way when ctx ended keeps
// what it read for the next Receive: nothing is lost.
func (s *Source) Receive(ctx context.Context) (consumer.Delivery, error) {
	s.start()
	for {
		if s.closed() {
			return nil, s.closedErr()
		}
		if err := ctx.Err(); err != nil {
			return nil, err
		}
		s.mu.Lock()
		if len(s.buf) > 0 {
			d := s.buf[0]
			s.buf[0] = nil
			s.buf = s.buf[1:]
			s.mu.Unlock()
			s.received.Add(1)
			return d, nil
		}
		if room := s.limit - len(s.held); !s.fetching && room > 0 && !s.closed() {
			s.fetching = true
			s.wg.Add(1)
			go s.fetch(min(room, s.window))
		}
		s.mu.Unlock()
		select {
		case <-s.ready:
		case <-ctx.Done():
			return nil, ctx.Err()
		case <-s.life.Done():
			return nil, s.closedErr()
		}
	}
}

// fetch reads up to room entries and queues them for Receive. After an
// error it waits, with backoff, before it lets the next fetch start.
func (s *Source) fetch(room int) {
	defer s.wg.Done()
	ds, err := s.fetchOnce(s.life, room)
	s.mu.Lock()
	for _, d := range ds {
		if _, dup := s.held[d.id]; dup {
			continue // held already (claimed back from itself): not twice
		}
		s.held[d.id] = d
		s.buf = append(s.buf, d)
	}
	s.mu.Unlock()
	if err != nil && !s.closed() {
		s.signal()
		s.sweepDue.Store(true) // a lost reply may have left entries pending
		s.retryWait = min(max(2*s.retryWait, retryInitial), retryMax)
		s.logger().Warn("redisstream: read failed; retrying", slog.Any("error", err), slog.Duration("retry_in", s.retryWait))
		t := time.NewTimer(s.retryWait)
		select {
		case <-t.C:
		case <-s.life.Done():
			t.Stop()
		}
	} else if err == nil {
		s.retryWait = 0
	}
	s.mu.Lock()
	s.fetching = false
	s.mu.Unlock()
	s.signal()
}

// fetchOnce recovers its own lost pending entries and claims idle ones when
// they are due; if that found nothing, it waits up to Block for new entries.
func (s *Source) fetchOnce(ctx context.Context, room int) ([]*delivery, error) {
	var out []*delivery
	now := time.Now()
	if s.sweepDue.Load() || now.Sub(s.lastSweep) >= s.cfg.ClaimInterval {
		ds, err := s.recoverOwn(ctx, room)
		if err != nil {
			return ds, err
		}
		s.sweepDue.Store(false)
		s.lastSweep = now
		out = append(out, ds...)
		room -= len(ds)
	}
	if room > 0 && (s.claimCursor != "" || now.Sub(s.lastClaim) >= s.cfg.ClaimInterval) {
		ds, err := s.autoClaim(ctx, room)
		out = append(out, ds...)
		if err != nil {
			return out, err
		}
	}
	if len(out) > 0 {
		return out, nil
	}
	res, err := s.read.XReadGroup(ctx, &redis.XReadGroupArgs{
		Group: s.cfg.Group, Consumer: s.cfg.Consumer, Streams: []string{s.cfg.Stream, ">"},
		Count: int64(room), Block: s.cfg.Block,
	}).Result()
	switch {
	case errors.Is(err, redis.Nil):
		return nil, nil // Block ran out
	case isNoGroup(err):
		return nil, s.recreateGroup(ctx)
	case err != nil:
		return nil, fmt.Errorf("redisstream: XREADGROUP: %w", err)
	}
	for _, st := range res {
		for _, e := range st.Messages {
			out = append(out, s.newDelivery(e, deliveryNew))
		}
	}
	return out, nil
}

// recoverOwn re-delivers this consumer's pending entries that the Source
// does not hold: XPENDING for its own name, then XCLAIM of the rest to
// itself, which returns their data and counts the delivery.
func (s *Source) recoverOwn(ctx context.Context, room int) ([]*delivery, error) {
	s.mu.Lock()
	held := make(map[string]bool, len(s.held))
	for id := range s.held {
		held[id] = true
	}
	s.mu.Unlock()
	var ids []string
	for start := "-"; len(ids) < room; {
		p, err := s.rdb.XPendingExt(ctx, &redis.XPendingExtArgs{
			Stream: s.cfg.Stream, Group: s.cfg.Group, Start: start, End: "+", Count: pendingPage, Consumer: s.cfg.Consumer,
		}).Result()
		if isNoGroup(err) {
			return nil, s.recreateGroup(ctx)
		}
		if err != nil {
			return nil, fmt.Errorf("redisstream: XPENDING: %w", err)
		}
		for _, e := range p {
			if !held[e.ID] && len(ids) < room {
				ids = append(ids, e.ID)
			}
		}
		if len(p) < pendingPage {
			break
		}
		start = "(" + p[len(p)-1].ID
	}
	if len(ids) == 0 {
		return nil, nil
	}
	msgs, err := s.rdb.XClaim(ctx, &redis.XClaimArgs{
		Stream: s.cfg.Stream, Group: s.cfg.Group, Consumer: s.cfg.Consumer, Messages: ids,
	}).Result()
	if err != nil {
		return nil, fmt.Errorf("redisstream: XCLAIM own pending entries: %w", err)
	}
	if gone := len(ids) - len(msgs); gone > 0 {
		s.reportDeleted(gone, "recovering its own pending entries")
	}
	out := make([]*delivery, 0, len(msgs))
	for _, e := range msgs {
		out = append(out, s.newDelivery(e, deliveryPending))
	}
	s.recovered.Add(int64(len(out)))
	if len(out) > 0 {
		s.logger().Info("redisstream: re-delivering pending entries of this consumer", slog.Int("entries", len(out)))
	}
	return out, nil
}

// autoClaim takes entries of the group idle for MinIdle (XAUTOCLAIM), one
// page per call; a pass over the whole pending list restarts every
// ClaimInterval.
func (s *Source) autoClaim(ctx context.Context, room int) ([]*delivery, error) {
	start := s.claimCursor
	if start == "" {
		start = "0-0"
	}
	msgs, next, deleted, err := s.rdb.XAutoClaimWithDeleted(ctx, &redis.XAutoClaimArgs{
		Stream: s.cfg.Stream, Group: s.cfg.Group, MinIdle: s.cfg.MinIdle, Start: start, Count: int64(room), Consumer: s.cfg.Consumer,
	}).Result()
	if isNoGroup(err) {
		return nil, s.recreateGroup(ctx)
	}
	if err != nil {
		return nil, fmt.Errorf("redisstream: XAUTOCLAIM: %w", err)
	}
	if next == "0-0" || next == "" {
		s.claimCursor = ""
		s.lastClaim = time.Now()
	} else {
		s.claimCursor = next
	}
	if len(deleted) > 0 {
		s.reportDeleted(len(deleted), "claiming idle entries")
	}
	out := make([]*delivery, 0, len(msgs))
	for _, e := range msgs {
		out = append(out, s.newDelivery(e, deliveryClaimed))
	}
	s.claimed.Add(int64(len(out)))
	if len(out) > 0 {
		s.logger().Info("redisstream: claimed idle entries", slog.Int("entries", len(out)), slog.Duration("min_idle", s.cfg.MinIdle))
	}
	return out, nil
}

func (s *Source) reportDeleted(n int, when string) {
	s.deleted.Add(int64(n))
	s.logger().Error("redisstream: pending entries were deleted from the stream before they were acked (trimmed with MAXLEN, or XDEL): they were never handled",
		slog.Int("entries", n), slog.String("when", when))
}

func (s *Source) recreateGroup(ctx context.Context) error {
	created, err := s.ensureGroup(ctx)
	if err != nil {
		return err
	}
	if created {
		s.groupCreated.Add(1)
		s.logger().Error("redisstream: the consumer group was gone and has been created again at StartID; its pending entries are lost (was the server restarted without persistence?)",
			slog.String("start_id", s.cfg.StartID))
	}
	return nil
}

func isNoGroup(err error) bool { return err != nil && strings.HasPrefix(err.Error(), "NOGROUP") }

// keepAliveScript resets the idle time of the entries given in ARGV[3:]
// that consumer ARGV[2] of group ARGV[1] still owns, and returns the others:
// entries another consumer claimed, or no longer pending.
var keepAliveScript = redis.NewScript(`
local lost = {}
for i = 3, #ARGV do
  local id = ARGV[i]
  local p = redis.call('XPENDING', KEYS[1], ARGV[1], id, id, 1)
  if p[1] and p[1][2] == ARGV[2] then
    redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, id, 'JUSTID')
  else
    lost[#lost + 1] = id
  end
end
return lost
`)

// keepAlive resets the idle time of every entry the Source holds, every
// KeepAlive, so that no other consumer claims an entry still being handled.
func (s *Source) keepAlive() {
	defer s.wg.Done()
	t := time.NewTicker(s.cfg.KeepAlive)
	defer t.Stop()
	for {
		select {
		case <-s.life.Done():
			return
		case <-t.C:
		}
		s.touch(s.life)
	}
}

func (s *Source) touch(ctx context.Context) {
	s.mu.Lock()
	ds := make(map[string]*delivery, len(s.held))
	ids := make([]string, 0, len(s.held))
	for id, d := range s.held {
		ds[id] = d
		ids = append(ids, id)
	}
	s.mu.Unlock()
	for len(ids) > 0 {
		n := min(len(ids), keepAliveBatch)
		args := make([]any, 0, n+2)
		args = append(args, s.cfg.Group, s.cfg.Consumer)
		for _, id := range ids[:n] {
			args = append(args, id)
		}
		ids = ids[n:]
		lost, err := keepAliveScript.Run(ctx, s.rdb, []string{s.cfg.Stream}, args...).StringSlice()
		if err != nil {
			if !s.closed() {
				s.logger().Warn("redisstream: keep-alive failed; held entries may be claimed by another consumer after MinIdle (dedup applies them once)", slog.Any("error", err))
			}
			return
		}
		var taken int
		for _, id := range lost {
			if d := ds[id]; d != nil && !d.settled.Load() && d.lost.CompareAndSwap(false, true) {
				taken++
			}
		}
		if taken > 0 {
			s.lost.Add(int64(taken))
			s.logger().Warn("redisstream: held entries were claimed by another consumer (this process stalled past MinIdle?); dedup applies each once",
				slog.Int("entries", taken))
		}
	}
}

// releaseScript hands every pending entry of consumer ARGV[2] to consumer
// ARGV[3], idle for ARGV[4] ms so that any consumer's next XAUTOCLAIM takes
// them, and then deletes consumer ARGV[2] from group ARGV[1] if it owns
// nothing any more. It returns the number of entries released.
var releaseScript = redis.NewScript(`
local n = 0
for page = 1, tonumber(ARGV[5]) do
  local p = redis.call('XPENDING', KEYS[1], ARGV[1], '-', '+', 1000, ARGV[2])
  if #p == 0 then break end
  local args = {'XCLAIM', KEYS[1], ARGV[1], ARGV[3], 0}
  for _, e in ipairs(p) do args[#args + 1] = e[1] end
  args[#args + 1] = 'IDLE'
  args[#args + 1] = ARGV[4]
  args[#args + 1] = 'JUSTID'
  redis.call(unpack(args))
  n = n + #p
end
if #redis.call('XPENDING', KEYS[1], ARGV[1], '-', '+', 1, ARGV[2]) == 0 then
  redis.call('XGROUP', 'DELCONSUMER', KEYS[1], ARGV[1], ARGV[2])
end
return n
`)

// Close stops reading and gives every entry the Source read and did not ack
// back to the group: it hands them to the consumer releasedConsumer, marked
// idle for so long that the next XAUTOCLAIM of any consumer in the group
// takes them (Redis has no requeue), and removes its own consumer name from
// the group once it owns nothing. Acks and nacks after Close return errors
// wrapping consumer.ErrSourceClosed, and so does DeadLetter on the Source's
// dead-letterer. If the server cannot be reached, the entries stay pending
// under the Source's name and are claimed after MinIdle. Close is
// idempotent.
func (s *Source) Close() error {
	s.closeOnce.Do(func() {
		// Under mu, so that no fetch or keep-alive starts after the
		// wait below.
		s.mu.Lock()
		s.stop()
		s.mu.Unlock()
		_ = s.read.Close() // ends a blocked XREADGROUP
		s.wg.Wait()
		ctx, cancel := context.WithTimeout(context.Background(), closeTimeout)
		defer cancel()
		n, err := releaseScript.Run(ctx, s.rdb, []string{s.cfg.Stream},
			s.cfg.Group, s.cfg.Consumer, releasedConsumer, releasedIdle.Milliseconds(), maxReleasePages).Int64()
		s.released.Add(n)
		if err != nil && !isNoGroup(err) {
			s.closeErr = fmt.Errorf("redisstream: close: release pending entries (they will be claimed after MinIdle): %w", err)
		}
		if cerr := s.rdb.Close(); cerr != nil && s.closeErr == nil {
			s.closeErr = fmt.Errorf("redisstream: close: %w", cerr)
		}
		s.mu.Lock()
		s.buf = nil
		s.held = map[string]*delivery{}
		s.mu.Unlock()
	})
	return s.closeErr
}

// delivery is one entry read by a Source.
type delivery struct {
	src     *Source
	id      string
	msg     *consumer.Message
	settled atomic.Bool
	lost    atomic.Bool // the keep-alive found it owned by another consumer
}

func (s *Source) newDelivery(e redis.XMessage, how string) *delivery {
	msg := s.mp.message(s.cfg.Stream, e)
	msg.Redelivered = how != deliveryNew
	msg.Metadata[MetaGroup] = s.cfg.Group
	msg.Metadata[MetaConsumer] = s.cfg.Consumer
	msg.Metadata[MetaDelivery] = how
	return &delivery{src: s, id: e.ID, msg: msg}
}

// forget drops a settled delivery from the held set, making room.
func (s *Source) forget(d *delivery) {
	s.mu.Lock()
	if s.held[d.id] == d {
		delete(s.held, d.id)
	}
	s.mu.Unlock()
	s.signal()
}

// Message returns the delivered message.
func (d *delivery) Message() *consumer.Message { return d.msg }

func (d *delivery) stale(op string) error {
	return fmt.Errorf("redisstream: %s entry %s: already settled: %w", op, d.id, consumer.ErrDeliveryStale)
}

// Ack acknowledges the entry (XACK). The runtime calls it only after the
// message's effect, or its dead-letter copy, is durable. If XACK fails the
// entry stays pending; the Source re-delivers it later and dedup skips it.
func (d *delivery) Ack(ctx context.Context) error {
	if !d.settled.CompareAndSwap(false, true) {
		return d.stale("ack")
	}
	s := d.src
	if s.closed() {
		return fmt.Errorf("redisstream: ack entry %s: %w", d.id, s.closedErr())
	}
	err := s.rdb.XAck(ctx, s.cfg.Stream, s.cfg.Group, d.id).Err()
	s.forget(d)
	if err != nil {
		return s.ackErr("ack entry "+d.id, err)
	}
	s.acked.Add(1)
	return nil
}

// ackErr explains a failed XACK: the entry stays pending and comes again.
func (s *Source) ackErr(what string, err error) error {
	if s.closed() {
		return fmt.Errorf("redisstream: %s: %v: %w", what, err, consumer.ErrSourceClosed)
	}
	s.sweepDue.Store(true)
	return fmt.Errorf("redisstream: %s of stream %q (it stays pending and comes again): %v: %w", what, s.cfg.Stream, err, consumer.ErrDeliveryStale)
}

// Nack gives the delivery back. Redis has no negative acknowledgement:
// with requeue, the Source claims the entry back to itself (XCLAIM, which
// counts the delivery) and returns it again from Receive, flagged
// Redelivered; if another consumer took it meanwhile, it is left to that
// consumer. Without requeue the entry is acknowledged and so dropped, as a
// broker without a dead-letter rule drops it; the runtime never does that
// (it dead-letters through Source.DeadLetterer first).
func (d *delivery) Nack(ctx context.Context, requeue bool) error {
	if !d.settled.CompareAndSwap(false, true) {
		return d.stale("nack")
	}
	s := d.src
	if s.closed() {
		return fmt.Errorf("redisstream: nack entry %s: %w", d.id, s.closedErr())
	}
	if !requeue {
		err := s.rdb.XAck(ctx, s.cfg.Stream, s.cfg.Group, d.id).Err()
		s.forget(d)
		if err != nil {
			return s.ackErr("nack (drop) entry "+d.id, err)
		}
		s.nacked.Add(1)
		return nil
	}
	if d.lost.Load() {
		s.forget(d)
		s.nacked.Add(1)
		return nil
	}
	msgs, err := s.rdb.XClaim(ctx, &redis.XClaimArgs{
		Stream: s.cfg.Stream, Group: s.cfg.Group, Consumer: s.cfg.Consumer, Messages: []string{d.id},
	}).Result()
	if err != nil {
		s.forget(d)
		return s.ackErr("nack entry "+d.id, err)
	}
	s.nacked.Add(1)
	if len(msgs) == 0 {
		s.forget(d) // acked by another consumer, or deleted
		return nil
	}
	nd := s.newDelivery(msgs[0], deliveryNack)
	s.mu.Lock()
	if s.held[d.id] == d && !s.closed() {
		s.held[d.id] = nd
		s.buf = append(s.buf, nd)
	}
	s.mu.Unlock()
	s.signal()
	return nil
}

// AckBatch acknowledges deliveries of this Source with one XACK for all of
// them. It implements consumer.Source's AckBatch for the runtime's batch mode,
// which calls it after the batch's transaction committed.
func (s *Source) AckBatch(ctx context.Context, ds []consumer.Delivery) error {
	var errs []error
	mine := make([]*delivery, 0, len(ds))
	ids := make([]string, 0, len(ds))
	for _, cd := range ds {
		d, ok := cd.(*delivery)
		switch {
		case !ok || d.src != s:
			errs = append(errs, fmt.Errorf("redisstream: ack batch: %T is not a delivery of this source", cd))
		case !d.settled.CompareAndSwap(false, true):
			errs = append(errs, d.stale("ack"))
		default:
			mine = append(mine, d)
			ids = append(ids, d.id)
		}
	}
	if len(mine) == 0 {
		return errors.Join(errs...)
	}
	if s.closed() {
		return errors.Join(append(errs, fmt.Errorf("redisstream: ack %d entries: %w", len(ids), s.closedErr()))...)
	}
	err := s.rdb.XAck(ctx, s.cfg.Stream, s.cfg.Group, ids...).Err()
	for _, d := range mine {
		s.forget(d)
	}
	if err != nil {
		return errors.Join(append(errs, s.ackErr(fmt.Sprintf("ack %d entries", len(ids)), err))...)
	}
	s.acked.Add(int64(len(ids)))
	return errors.Join(errs...)
}
