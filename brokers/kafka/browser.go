package kafka

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"slices"
	"strconv"
	"sync"
	"time"

	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/internal/kafkamsg"
	kafkago "github.com/segmentio/kafka-go"
)

// defaultBrowseCommitTimeout is BrowserConfig.CommitTimeout's default.
const defaultBrowseCommitTimeout = 10 * time.Second

// BrowserConfig configures a Browser. The zero value of every optional field
// selects the documented default. A browsed record looks like a consumed
// one, except that a record without the id header has no Message.ID: the
// Browser gives no fallback id, since a dead letter's position is not the
// original's identity (a replay takes the dedup id from the failure
// envelope anyway).
type BrowserConfig struct {
	// Brokers are the bootstrap brokers' host:port addresses. Required.
	Brokers []string
	// Topic is the topic to browse, typically a dead-letter topic.
	// Required. It must exist.
	Topic string
	// GroupID, if set, is a consumer group that remembers the browse's
	// progress: reading starts at the group's committed offset of each
	// partition (the earliest offset where it has none), and Close
	// commits, per partition, the highest offset below which every record
	// read was acked. Use a group of its own, such as "<topic>.replay":
	// the commits are those of a simple consumer, which Kafka refuses for
	// a group with live members. Defaults to none: every pass reads the
	// topic from its earliest offset and commits nothing.
	GroupID string

	// FetchMaxWait is how long a fetch waits on the broker for new
	// records. Defaults to 500ms.
	FetchMaxWait time.Duration
	// FetchMaxBytes bounds one fetch response. Defaults to 10 MiB.
	FetchMaxBytes int
	// CommitTimeout bounds the offset commit made by Close. Defaults to
	// 10s.
	CommitTimeout time.Duration

	// Dialer opens broker connections, for TLS or SASL. Its ClientID,
	// DialFunc, Timeout, TLS and SASLMechanism also configure the
	// requests that read offsets and commit. Defaults to kafka-go's
	// DefaultDialer.
	Dialer *kafkago.Dialer
	// Logger receives the Browser's logs and, at debug level, kafka-go's.
	// Defaults to a logger that discards everything.
	Logger *slog.Logger
}

func (c BrowserConfig) withDefaults() BrowserConfig {
	if c.FetchMaxWait == 0 {
		c.FetchMaxWait = defaultFetchMaxWait
	}
	if c.FetchMaxBytes == 0 {
		c.FetchMaxBytes = defaultFetchMaxBytes
	}
	if c.CommitTimeout == 0 {
		c.CommitTimeout = defaultBrowseCommitTimeout
	}
	if c.Dialer == nil {
		c.Dialer = kafkago.DefaultDialer
	}
	if c.Logger == nil {
		c.Logger = slog.New(slog.DiscardHandler)
	}
	return c
}

func (c BrowserConfig) validate() error {
	if err := validBrokers(c.Brokers); err != nil {
		return err
	}
	if err := validTopic(c.Topic); err != nil {
		return bad("Topic", "%v", err)
	}
	switch {
	case c.FetchMaxWait < 0:
		return bad("FetchMaxWait", "negative")
	case c.FetchMaxBytes < 0:
		return bad("FetchMaxBytes", "negative")
	case c.CommitTimeout < 0:
		return bad("CommitTimeout", "negative")
	}
	return nil
}

// Browser reads a topic as it was when the Browser was opened, without
// consuming it. It implements the dlq.Browser interface, for inspecting,
// classifying and replaying a dead-letter topic. Create it with NewBrowser.
//
// NewBrowser notes, for every partition, where to start (the group's
// committed offset if BrowserConfig.GroupID is set, else the earliest
// offset) and the high watermark. Next then reads the partitions one after
// the other, each with a plain partition reader (no consumer group), up to
// that high watermark, and returns an error wrapping io.EOF after that.
// Records written later, such as those dead-lettered again during a
// replay, are therefore not read in the same pass.
//
// A Kafka log cannot delete a record, so acking a delivery only marks it
// done. With a GroupID, Close commits for that group, per partition, the
// offset just past the highest record below which every record read was
// acked: never past a record that was not acked (nacked, skipped by a
// filter, or still in flight), so the next pass starts at the first record
// not known to be done. Without a GroupID nothing is committed and every
// pass reads the whole topic again. That is safe for a replay, which goes
// through the dedup store: what was applied is skipped. It only costs the
// reading.
//
// A Browser is safe for concurrent use, though concurrent Next calls are
// served one at a time.
type Browser struct {
	cfg       BrowserConfig
	log       *slog.Logger
	mp        kafkamsg.Mapping
	client    *kafkago.Client
	transport *kafkago.Transport
	parts     []*browsePart // in partition order

	ctx    context.Context // done at Close: interrupts Next
	cancel context.CancelFunc

	nextMu   sync.Mutex  // serialises Next; guards cur and r
	cur      int         // index in parts of the partition being read
	r        *partReader // reader of parts[cur], or nil
	failures int         // consecutive failed fetches

	mu     sync.Mutex // guards closed and the parts' records
	closed bool

	closeOnce sync.Once
	closeErr  error
}

// browsePart is one partition of the browsed topic.
type browsePart struct {
	id    int
	start int64 // first offset to read
	high  int64 // high watermark at open: read offsets below it
	// recs are the records handed out by Next, in offset order. Guarded
	// by the Browser's mu.
	recs []*browsedRecord
}

// browsedRecord is the settlement state of a record handed out by Next.
type browsedRecord struct {
	offset  int64
	settled bool
	acked   bool
}

// NewBrowser validates cfg, then reads the partitions of cfg.Topic, their
// earliest offsets and high watermarks and, with a GroupID, the group's
// committed offsets. It fails if the brokers cannot be reached or the topic
// does not exist.
func NewBrowser(ctx context.Context, cfg BrowserConfig) (*Browser, error) {
	cfg = cfg.withDefaults()
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	transport := dialerTransport(cfg.Dialer)
	b := &Browser{
		cfg:       cfg,
		log:       cfg.Logger.With("topic", cfg.Topic),
		mp:        kafkamsg.Mapping{NoFallbackID: true},
		client:    &kafkago.Client{Addr: kafkago.TCP(cfg.Brokers...), Transport: transport},
		transport: transport,
	}
	if cfg.GroupID != "" {
		b.log = b.log.With("group", cfg.GroupID)
	}
	if err := b.open(ctx); err != nil {
		transport.CloseIdleConnections()
		return nil, fmt.Errorf("kafka: browse topic %q: %w", cfg.Topic, err)
	}
	b.ctx, b.cancel = context.WithCancel(context.Background())
	if b.log.Enabled(ctx, slog.LevelDebug) {
		for _, p := range b.parts {
			b.log.Debug("kafka: browsing partition", "partition", p.id, "start", p.start, "high_watermark", p.high)
		}
	}
	return b, nil
}

// open reads the topic's partitions and where to read each.
func (b *Browser) open(ctx context.Context) error {
	topic := b.cfg.Topic
	md, err := b.client.Metadata(ctx, &kafkago.MetadataRequest{Topics: []string{topic}})
	if err != nil {
		return fmt.Errorf("read metadata: %w", err)
	}
	var ids []int
	for _, t := range md.Topics {
		if t.Name != topic {
			continue
		}
		if t.Error != nil {
			return fmt.Errorf("read metadata: %w", t.Error)
		}
		for _, p := range t.Partitions {
			ids = append(ids, p.ID)
		}
	}
	if len(ids) == 0 {
		return errors.New("read metadata: the topic has no partitions (does it exist?)")
	}
	slices.Sort(ids)

	reqs := make([]kafkago.OffsetRequest, 0, 2*len(ids))
	for _, id := range ids {
		reqs = append(reqs, kafkago.FirstOffsetOf(id), kafkago.LastOffsetOf(id))
	}
	lo, err := b.client.ListOffsets(ctx, &kafkago.ListOffsetsRequest{Topics: map[string][]kafkago.OffsetRequest{topic: reqs}})
	if err != nil {
		return fmt.Errorf("list offsets: %w", err)
	}
	byID := map[int]*browsePart{}
	for _, po := range lo.Topics[topic] {
		if po.Error != nil {
			return fmt.Errorf("list offsets of partition %d: %w", po.Partition, po.Error)
		}
		byID[po.Partition] = &browsePart{id: po.Partition, start: po.FirstOffset, high: po.LastOffset}
	}
	for _, id := range ids {
		p := byID[id]
		if p == nil {
			return fmt.Errorf("list offsets: no answer for partition %d", id)
		}
		b.parts = append(b.parts, p)
	}

	if b.cfg.GroupID == "" {
		return nil
	}
	of, err := b.client.OffsetFetch(ctx, &kafkago.OffsetFetchRequest{GroupID: b.cfg.GroupID, Topics: map[string][]int{topic: ids}})
	if err != nil {
		return fmt.Errorf("fetch committed offsets of group %q: %w", b.cfg.GroupID, err)
	}
	if errors.Is(of.Error, kafkago.GroupIdNotFound) {
		// Some brokers answer so for a group that never committed.
		return nil
	}
	if of.Error != nil {
		return fmt.Errorf("fetch committed offsets of group %q: %w", b.cfg.GroupID, of.Error)
	}
	for _, c := range of.Topics[topic] {
		if c.Error != nil {
			return fmt.Errorf("fetch committed offset of group %q, partition %d: %w", b.cfg.GroupID, c.Partition, c.Error)
		}
		if p := byID[c.Partition]; p != nil && c.CommittedOffset > p.start {
			p.start = min(c.CommittedOffset, p.high)
		}
	}
	return nil
}

// Depth returns the number of offsets the Browser reads: the sum, over the
// partitions, of the high watermark minus the start offset at open. It is
// the number of records Next returns unless some offsets hold no record
// (compacted away, or transaction markers).
func (b *Browser) Depth() int64 {
	var n int64
	for _, p := range b.parts {
		n += max(0, p.high-p.start)
	}
	return n
}

// Next returns the next record of the topic, as it was at open. Partitions
// are read in ascending order, each in offset order. Next returns an error
// wrapping io.EOF once every partition has been read up to its high
// watermark at open, and one wrapping consumer.ErrSourceClosed after Close.
// Fetch errors are retried until ctx is done.
//
// Records are read as a read_committed consumer reads them (see Source):
// records of aborted transactions and transaction markers are skipped. The
// end of a partition is its last offset below the high watermark. If that
// offset is still in an open transaction (idemq's Publisher writes none),
// Next waits for the transaction to end, or for ctx.
func (b *Browser) Next(ctx context.Context) (consumer.Delivery, error) {
	b.nextMu.Lock()
	defer b.nextMu.Unlock()
	if b.isClosed() {
		return nil, b.closedErr()
	}
	// Close interrupts a fetch in progress.
	fctx, cancel := context.WithCancel(ctx)
	defer cancel()
	stop := context.AfterFunc(b.ctx, cancel)
	defer stop()

	for b.cur < len(b.parts) {
		p := b.parts[b.cur]
		if p.start >= p.high {
			b.cur++
			continue
		}
		if b.r == nil {
			b.r = b.reader(p)
		}
		f, err := b.r.next(fctx)
		if err != nil {
			switch {
			case b.isClosed():
				return nil, b.closedErr()
			case ctx.Err() != nil:
				return nil, ctx.Err()
			}
			if err := b.recover(fctx, p, err); err != nil {
				if b.isClosed() {
					return nil, b.closedErr()
				}
				return nil, err
			}
			continue
		}
		b.failures = 0
		m := f.msg
		if m.Offset >= p.high {
			// Written after open: this pass is done with the partition.
			b.nextPartition()
			continue
		}
		if f.control {
			// A transaction marker: never handed out.
			if m.Offset >= p.high-1 {
				b.nextPartition()
			}
			continue
		}
		rec := &browsedRecord{offset: m.Offset}
		b.mu.Lock()
		if b.closed {
			b.mu.Unlock()
			return nil, b.closedErr()
		}
		p.recs = append(p.recs, rec)
		b.mu.Unlock()
		if m.Offset >= p.high-1 {
			b.nextPartition()
		}
		msg := b.mp.Message(record(m))
		if b.cfg.GroupID != "" {
			msg.Metadata["kafka.group"] = b.cfg.GroupID
		}
		return &browsedDelivery{b: b, rec: rec, msg: msg}, nil
	}
	return nil, fmt.Errorf("kafka: browse topic %q: every partition read up to its high watermark: %w", b.cfg.Topic, io.EOF)
}

// recover handles a failed fetch of p: after an offset out of range (the
// records were deleted by retention) it moves to the partition's earliest
// offset; after another error it waits a moment and lets Next retry. It
// returns ctx's error if ctx ends first.
func (b *Browser) recover(ctx context.Context, p *browsePart, err error) error {
	b.failures++
	if errors.Is(err, errOffsetOutOfRange) {
		off, rerr := resolveOffset(ctx, b.client, b.cfg.Topic, p.id, kafkago.FirstOffset)
		if rerr == nil {
			b.log.Warn("kafka: browse: offset out of range; moving to the earliest offset", "partition", p.id, "offset", b.r.offset, "earliest", off)
			b.r = &partReader{transport: b.transport, addr: b.r.addr, topic: b.r.topic, partition: p.id,
				maxBytes: b.r.maxBytes, maxWait: b.r.maxWait, offset: max(off, b.r.offset)}
			return nil
		}
		err = rerr
	}
	wait := min(time.Duration(b.failures)*100*time.Millisecond, 2*time.Second)
	b.log.Warn("kafka: browse: fetch failed; retrying", "partition", p.id, "error", err, "wait", wait)
	t := time.NewTimer(wait)
	defer t.Stop()
	select {
	case <-t.C:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// reader opens a read_committed partition reader (see partReader) at p's
// start offset.
func (b *Browser) reader(p *browsePart) *partReader {
	return &partReader{
		transport: b.transport,
		addr:      kafkago.TCP(b.cfg.Brokers...),
		topic:     b.cfg.Topic,
		partition: p.id,
		maxBytes:  b.cfg.FetchMaxBytes,
		maxWait:   b.cfg.FetchMaxWait,
		offset:    p.start,
	}
}

// dialerTransport returns a Transport that connects the way d dials: its
// dial function, client id, TLS, SASL and dial timeout.
func dialerTransport(d *kafkago.Dialer) *kafkago.Transport {
	t := &kafkago.Transport{
		Dial:     d.DialFunc,
		ClientID: d.ClientID,
		TLS:      d.TLS,
		SASL:     d.SASLMechanism,
	}
	if d.Timeout > 0 {
		t.DialTimeout = d.Timeout
	}
	return t
}

// nextPartition drops the current reader and moves to the next partition.
// The caller holds nextMu.
func (b *Browser) nextPartition() {
	b.r = nil
	b.cur++
}

// Close stops a Next in progress, releases the reader and, with a GroupID,
// commits for that group the offset past the highest contiguous acked
// record of each partition. Acks and nacks after Close return errors
// wrapping consumer.ErrSourceClosed. Close is idempotent; it returns the
// commit's error, if any (nothing is lost then: the next pass reads those
// records again).
func (b *Browser) Close() error {
	b.closeOnce.Do(func() {
		b.mu.Lock()
		b.closed = true
		b.mu.Unlock()
		b.cancel()
		b.nextMu.Lock()
		b.r = nil
		b.nextMu.Unlock()
		if b.cfg.GroupID != "" {
			b.closeErr = b.commit()
		}
		b.transport.CloseIdleConnections()
	})
	return b.closeErr
}

// commit commits each partition's highest contiguous acked offset, where it
// moved.
func (b *Browser) commit() error {
	var commits []kafkago.OffsetCommit
	b.mu.Lock()
	for _, p := range b.parts {
		to := int64(-1)
		for _, r := range p.recs {
			if !r.acked {
				break
			}
			to = r.offset + 1
		}
		if to > p.start {
			commits = append(commits, kafkago.OffsetCommit{Partition: p.id, Offset: to})
		}
	}
	b.mu.Unlock()
	if len(commits) == 0 {
		return nil
	}
	ctx, cancel := context.WithTimeout(context.Background(), b.cfg.CommitTimeout)
	defer cancel()
	resp, err := b.client.OffsetCommit(ctx, &kafkago.OffsetCommitRequest{
		GroupID:      b.cfg.GroupID,
		GenerationID: -1, // a simple consumer's commit, outside any generation
		Topics:       map[string][]kafkago.OffsetCommit{b.cfg.Topic: commits},
	})
	if err != nil {
		return fmt.Errorf("kafka: browse topic %q: commit offsets of group %q: %s", b.cfg.Topic, b.cfg.GroupID, err)
	}
	var errs []error
	for _, p := range resp.Topics[b.cfg.Topic] {
		if p.Error != nil {
			errs = append(errs, fmt.Errorf("partition %d: %s", p.Partition, p.Error))
		}
	}
	if len(errs) > 0 {
		return fmt.Errorf("kafka: browse topic %q: commit offsets of group %q (is the group in use by live consumers?): %w", b.cfg.Topic, b.cfg.GroupID, errors.Join(errs...))
	}
	if b.log.Enabled(context.Background(), slog.LevelDebug) {
		for _, c := range commits {
			b.log.Debug("kafka: browse committed", "partition", c.Partition, "offset", c.Offset)
		}
	}
	return nil
}

func (b *Browser) isClosed() bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.closed
}

func (b *Browser) closedErr() error {
	return fmt.Errorf("kafka: browse topic %q: %w", b.cfg.Topic, consumer.ErrSourceClosed)
}

// browsedDelivery implements consumer.Delivery for a record read by a
// Browser.
type browsedDelivery struct {
	b   *Browser
	rec *browsedRecord
	msg *consumer.Message
}

// Message returns the browsed message.
func (d *browsedDelivery) Message() *consumer.Message { return d.msg }

// Ack marks the record done: with a GroupID, Close commits past it once
// every earlier record read from its partition is acked too. It returns an
// error wrapping consumer.ErrDeliveryStale if the delivery was already
// settled, and one wrapping consumer.ErrSourceClosed after Close.
func (d *browsedDelivery) Ack(ctx context.Context) error {
	return d.settle("ack", true)
}

// Nack leaves the record where it is, with or without requeue: a Kafka log
// cannot drop a single record, and nothing is committed at or past it, so
// the next pass reads it again. It returns the same errors as Ack.
func (d *browsedDelivery) Nack(ctx context.Context, requeue bool) error {
	return d.settle("nack", false)
}

func (d *browsedDelivery) settle(op string, ack bool) error {
	b := d.b
	b.mu.Lock()
	defer b.mu.Unlock()
	where := b.cfg.Topic + "/" + strconv.Itoa(int(d.msg.Partition)) + "@" + strconv.FormatInt(d.rec.offset, 10)
	if d.rec.settled {
		return fmt.Errorf("kafka: %s browsed record %s: already acked or nacked: %w", op, where, consumer.ErrDeliveryStale)
	}
	if b.closed {
		return fmt.Errorf("kafka: %s browsed record %s: browser closed: %w", op, where, consumer.ErrSourceClosed)
	}
	d.rec.settled = true
	d.rec.acked = ack
	return nil
}
