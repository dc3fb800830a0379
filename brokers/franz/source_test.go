package franz_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/idemq/idemq/brokers/franz"
	"github.com/idemq/idemq/consumer"
)

// publish publishes n messages with ids and bodies "<prefix>-<i>" and
// record keys "k<i mod keys>".
func (e *env) publish(t *testing.T, prefix string, n, keys int) {
	t.Helper()
	msgs := make([]*consumer.Message, n)
	for i := range msgs {
		msgs[i] = &consumer.Message{ID: fmt.Sprintf("%s-%04d", prefix, i), RecordKey: fmt.Appendf(nil, "k%d", i%keys), Body: fmt.Appendf(nil, "%s-%04d", prefix, i)}
	}
	if err := e.pub.Publish(testCtx(t, 20*time.Second), e.topic, msgs...); err != nil {
		t.Fatal(err)
	}
}

// TestMessageFieldsMatchKafkaSource: a record reads the same through this
// Source as through brokers/kafka's: id (header or fallback), ordering key,
// record key (nil for a null key), body, headers, coordinates, metadata.
func TestMessageFieldsMatchKafkaSource(t *testing.T) {
	ctx := testCtx(t, 40*time.Second)
	e := newEnv(t, 1)
	if err := e.pub.Publish(ctx, e.topic,
		&consumer.Message{ID: "order-1", Key: "ignored/ordering-key", RecordKey: []byte("customer-7"), Body: []byte("a"), Headers: map[string]string{"h": "1"}},
		&consumer.Message{Body: []byte("no id, no key")},
	); err != nil {
		t.Fatal(err)
	}
	fs := e.source(t)
	other := *e
	other.group += "-kafka-go" // its own group: both read every record
	ks := txnSources[1].open(t, &other)
	for i := range 2 {
		fd, kd := receiveOne(ctx, t, fs), receiveOne(ctx, t, ks)
		f, k := fd.Message(), kd.Message()
		if f.ID != k.ID || f.Key != k.Key || !bytes.Equal(f.RecordKey, k.RecordKey) || (f.RecordKey == nil) != (k.RecordKey == nil) ||
			!bytes.Equal(f.Body, k.Body) || !maps.Equal(f.Headers, k.Headers) || f.Source != k.Source || f.Partition != k.Partition ||
			f.Offset != k.Offset || !f.Timestamp.Equal(k.Timestamp) {
			t.Errorf("record %d:\nfranz %+v\nkafka %+v", i, f, k)
		}
		for _, name := range []string{"kafka.topic", "kafka.partition", "kafka.offset", "kafka.key"} {
			if f.Metadata[name] != k.Metadata[name] {
				t.Errorf("record %d: metadata %s: franz %q, kafka %q", i, name, f.Metadata[name], k.Metadata[name])
			}
		}
		if i == 1 && f.ID != e.topic+"/0/1" {
			t.Errorf("record without the id header: id %q, want %q", f.ID, e.topic+"/0/1")
		}
		if i == 1 && f.RecordKey != nil {
			t.Errorf("record with a null key: RecordKey %q, want nil", f.RecordKey)
		}
		if want := e.topic + "/0"; f.Key != want {
			t.Errorf("record %d: Key %q, want the ordering key %q", i, f.Key, want)
		}
		_ = fd.Ack(ctx)
		_ = kd.Ack(ctx)
	}
}

func receiveOne(ctx context.Context, t *testing.T, s consumer.Source) consumer.Delivery {
	t.Helper()
	d, err := s.Receive(ctx)
	if err != nil {
		t.Fatalf("receive: %v", err)
	}
	return d
}

// TestContiguousCommit: with offsets acked out of order, the committed
// offset never passes an unacked one; Close commits what was acked, and a
// new member resumes right after it.
func TestContiguousCommit(t *testing.T) {
	ctx := testCtx(t, 40*time.Second)
	e := newEnv(t, 1)
	log := observeCommits(t, e)
	e.publish(t, "c", 6, 1)
	s := e.source(t)
	ds := make([]consumer.Delivery, 5)
	for i := range ds {
		ds[i] = receiveOne(ctx, t, s)
		if ds[i].Message().Offset != int64(i) {
			t.Fatalf("delivery %d has offset %d", i, ds[i].Message().Offset)
		}
	}
	committed := func() int64 { return txnCommitted(ctx, t, e)[0] }
	ack := func(i int) {
		t.Helper()
		if err := ds[i].Ack(ctx); err != nil {
			t.Fatalf("ack %d: %v", i, err)
		}
	}
	ack(2)
	ack(3)
	ack(0)
	waitFor(t, 10*time.Second, "commit of offset 1", func() bool { return committed() == 1 })
	time.Sleep(10 * e.config().CommitInterval)
	if got := committed(); got != 1 {
		t.Fatalf("committed %d while offset 1 is unacked", got)
	}
	ack(1)
	waitFor(t, 10*time.Second, "commit of offset 4", func() bool { return committed() == 4 })
	if err := ds[1].Ack(ctx); !errors.Is(err, consumer.ErrDeliveryStale) {
		t.Errorf("second ack: %v, want ErrDeliveryStale", err)
	}
	if ids, ok := s.Assigned(); !ok || !slices.Equal(ids, []int{0}) {
		t.Errorf("Assigned() = %v, %v; want [0], true", ids, ok)
	}
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	if err := ds[4].Ack(ctx); !errors.Is(err, consumer.ErrSourceClosed) {
		t.Errorf("ack after Close: %v, want ErrSourceClosed", err)
	}
	if _, err := s.Receive(ctx); !errors.Is(err, consumer.ErrSourceClosed) {
		t.Errorf("receive after Close: %v, want ErrSourceClosed", err)
	}
	if got := committed(); got != 4 {
		t.Fatalf("committed %d after Close, want 4", got)
	}
	s2 := e.source(t)
	for want := int64(4); want < 6; want++ {
		d := receiveOne(ctx, t, s2)
		if d.Message().Offset != want {
			t.Fatalf("resumed at offset %d, want %d", d.Message().Offset, want)
		}
		_ = d.Ack(ctx)
	}
	log.check(t)
}

// TestRebalance: under a steady flow, a second member joins and the first
// leaves. Every message arrives, every offset is committed in the end, and
// no member ever commits for a partition it does not own.
func TestRebalance(t *testing.T) {
	ctx := testCtx(t, 90*time.Second)
	e := newEnv(t, 6)
	log := observeCommits(t, e)
	const n = 600
	var (
		mu    sync.Mutex
		seen  = map[string]int{}
		per   [2]int
		stale atomic.Int64
	)
	consume := func(i int, s *franz.Source) func() {
		return func() {
			for {
				d, err := s.Receive(ctx)
				if err != nil {
					if !errors.Is(err, consumer.ErrSourceClosed) {
						t.Errorf("member %d: receive: %v", i, err)
					}
					return
				}
				time.Sleep(time.Millisecond) // keep messages in flight
				if err := d.Ack(ctx); err != nil {
					if !errors.Is(err, consumer.ErrDeliveryStale) && !errors.Is(err, consumer.ErrSourceClosed) {
						t.Errorf("member %d: ack: %v", i, err)
					}
					stale.Add(1)
				}
				mu.Lock()
				seen[string(d.Message().Body)]++
				per[i]++
				mu.Unlock()
			}
		}
	}
	received := func() (distinct, a, b int) {
		mu.Lock()
		defer mu.Unlock()
		return len(seen), per[0], per[1]
	}
	var wg sync.WaitGroup
	wg.Go(func() {
		for i := 0; i < n; i += 10 {
			msgs := make([]*consumer.Message, 10)
			for j := range msgs {
				msgs[j] = &consumer.Message{ID: fmt.Sprint(i + j), RecordKey: fmt.Append(nil, i+j), Body: fmt.Appendf(nil, "r-%04d", i+j)}
			}
			if err := e.pub.Publish(ctx, e.topic, msgs...); err != nil {
				t.Errorf("publish: %v", err)
				return
			}
			time.Sleep(5 * time.Millisecond) // a steady flow
		}
	})
	a := e.source(t)
	wg.Go(consume(0, a))
	waitFor(t, 20*time.Second, "member A to consume", func() bool { _, x, _ := received(); return x >= 100 })
	b := e.source(t)
	wg.Go(consume(1, b))
	waitFor(t, 20*time.Second, "member B to consume", func() bool { _, _, y := received(); return y >= 1 })
	_ = a.Close()
	waitFor(t, 30*time.Second, "every message", func() bool { d, _, _ := received(); return d == n })
	waitFor(t, 10*time.Second, "B to commit everything", func() bool {
		var sum int64
		for _, off := range txnCommitted(ctx, t, e) {
			sum += max(off, 0)
		}
		return sum == n
	})
	_ = b.Close()
	wg.Wait()
	_, x, y := received()
	var dups int
	for _, c := range seen {
		dups += c - 1
	}
	t.Logf("A received %d, B %d; %d redelivered; %d stale acks; %d generations", x, y, dups, stale.Load(), log.generations())
	if log.generations() < 2 {
		t.Errorf("saw %d generations, want at least 2", log.generations())
	}
	log.check(t)
}

// TestSourceConfig: invalid configs are rejected with ConfigErrors.
func TestSourceConfig(t *testing.T) {
	ok := franz.Config{Brokers: []string{"127.0.0.1:1"}, Topic: "t", Group: "g"}
	cases := map[string]func(*franz.Config){
		"no brokers":      func(c *franz.Config) { c.Brokers = nil },
		"empty broker":    func(c *franz.Config) { c.Brokers = []string{""} },
		"no topic":        func(c *franz.Config) { c.Topic = "" },
		"no group":        func(c *franz.Config) { c.Group = "" },
		"max in flight":   func(c *franz.Config) { c.MaxInFlight = -1 },
		"heartbeat":       func(c *franz.Config) { c.HeartbeatInterval = time.Minute },
		"drain":           func(c *franz.Config) { c.DrainTimeout = time.Hour },
		"commit interval": func(c *franz.Config) { c.CommitInterval = -time.Second },
	}
	for name, mod := range cases {
		cfg := ok
		mod(&cfg)
		if _, err := franz.NewSource(cfg); !errors.Is(err, consumer.ErrInvalidConfig) {
			t.Errorf("%s: got %v, want ErrInvalidConfig", name, err)
		}
	}
	cfg := ok
	cfg.ResetToLatest = true
	s, err := franz.NewSource(cfg)
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	if err := s.Close(); err != nil {
		t.Errorf("second Close: %v", err)
	}
}

// commitLog records, from the broker's side, every OffsetCommit request of
// e's group and every generation's assignment (from the leader's SyncGroup).
type commitLog struct {
	mu       sync.Mutex
	assigned map[int32]map[string][]int32 // generation -> member -> partitions
	commits  []commitReq
}

type commitReq struct {
	gen     int32
	member  string
	offsets map[int32]int64
}

func observeCommits(t *testing.T, e *env) *commitLog {
	t.Helper()
	l := &commitLog{assigned: map[int32]map[string][]int32{}}
	e.c.ControlKey(int16(kmsg.SyncGroup), func(r kmsg.Request) (kmsg.Response, error, bool) {
		e.c.KeepControl()
		req := r.(*kmsg.SyncGroupRequest)
		if req.Group != e.group || len(req.GroupAssignment) == 0 {
			return nil, nil, false
		}
		byMember := map[string][]int32{}
		for _, a := range req.GroupAssignment {
			var ma kmsg.ConsumerMemberAssignment
			if err := ma.ReadFrom(a.MemberAssignment); err != nil {
				t.Errorf("parse assignment: %v", err)
				continue
			}
			byMember[a.MemberID] = nil
			for _, tp := range ma.Topics {
				if tp.Topic == e.topic {
					byMember[a.MemberID] = append(byMember[a.MemberID], tp.Partitions...)
				}
			}
		}
		l.mu.Lock()
		l.assigned[req.Generation] = byMember
		l.mu.Unlock()
		return nil, nil, false
	})
	e.c.ControlKey(int16(kmsg.OffsetCommit), func(r kmsg.Request) (kmsg.Response, error, bool) {
		e.c.KeepControl()
		req := r.(*kmsg.OffsetCommitRequest)
		if req.Group != e.group {
			return nil, nil, false
		}
		offs := map[int32]int64{}
		for _, tp := range req.Topics {
			for _, p := range tp.Partitions {
				offs[p.Partition] = p.Offset
			}
		}
		l.mu.Lock()
		l.commits = append(l.commits, commitReq{gen: req.Generation, member: req.MemberID, offsets: offs})
		l.mu.Unlock()
		return nil, nil, false
	})
	return l
}

// check asserts that every commit was made by a member for a partition it
// owned: assigned to it in that generation or, with the cooperative
// protocol's revoke-after-sync, assigned to it in the generation before and
// to no member in that one. No partition's committed offset may go back.
func (l *commitLog) check(t *testing.T) {
	t.Helper()
	l.mu.Lock()
	defer l.mu.Unlock()
	last := map[int32]int64{}
	for _, c := range l.commits {
		for p, off := range c.offsets {
			if !l.ownedLocked(c.gen, c.member, p) {
				t.Errorf("member %s committed partition %d (offset %d) in generation %d, where it owned %v", c.member, p, off, c.gen, l.assigned[c.gen][c.member])
			}
			if off < last[p] {
				t.Errorf("partition %d: committed offset went back from %d to %d", p, last[p], off)
			}
			last[p] = max(last[p], off)
		}
	}
}

func (l *commitLog) ownedLocked(gen int32, member string, p int32) bool {
	if slices.Contains(l.assigned[gen][member], p) {
		return true
	}
	for _, ps := range l.assigned[gen] {
		if slices.Contains(ps, p) {
			return false // another member owns it
		}
	}
	prev := int32(-1)
	for g := range l.assigned {
		if g < gen && g > prev {
			prev = g
		}
	}
	return prev >= 0 && slices.Contains(l.assigned[prev][member], p)
}

func (l *commitLog) generations() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return len(l.assigned)
}

// TestLostPartitionsNeverCommitted: when the member loses its session (the
// coordinator answers a heartbeat with UNKNOWN_MEMBER_ID), the records it
// handed out are left to the next owner: their acks are stale, nothing is
// committed for them, and they are read again.
func TestLostPartitionsNeverCommitted(t *testing.T) {
	ctx := testCtx(t, 60*time.Second)
	e := newEnv(t, 1)
	log := observeCommits(t, e)
	e.publish(t, "l", 2, 1)
	s := e.source(t)
	ds := []consumer.Delivery{receiveOne(ctx, t, s), receiveOne(ctx, t, s)}
	var lost atomic.Bool
	e.c.ControlKey(int16(kmsg.Heartbeat), func(r kmsg.Request) (kmsg.Response, error, bool) {
		req := r.(*kmsg.HeartbeatRequest)
		if req.Group != e.group {
			e.c.KeepControl()
			return nil, nil, false
		}
		resp := req.ResponseKind().(*kmsg.HeartbeatResponse)
		resp.ErrorCode = kerr.UnknownMemberID.Code
		lost.Store(true)
		return resp, nil, true
	})
	// kgo runs OnPartitionsLost before it rejoins: a new generation means
	// the loss is noted.
	waitFor(t, 20*time.Second, "the session to be lost and the group rejoined", func() bool {
		return lost.Load() && log.generations() >= 2
	})
	for i, d := range ds {
		if err := d.Ack(ctx); !errors.Is(err, consumer.ErrDeliveryStale) {
			t.Errorf("ack %d after the loss: %v, want ErrDeliveryStale", i, err)
		}
	}
	time.Sleep(5 * e.config().CommitInterval)
	if c := txnCommitted(ctx, t, e)[0]; c > 0 {
		t.Fatalf("committed offset %d for records acked after their partition was lost", c)
	}
	for want := int64(0); want < 2; want++ {
		d := receiveOne(ctx, t, s)
		if d.Message().Offset != want {
			t.Fatalf("after the loss, read offset %d, want %d again", d.Message().Offset, want)
		}
		if err := d.Ack(ctx); err != nil {
			t.Fatal(err)
		}
	}
	waitFor(t, 10*time.Second, "commit of offset 2", func() bool { return txnCommitted(ctx, t, e)[0] == 2 })
	log.check(t)
}

// TestCloseCommits: Close commits what was acked, though no commit interval
// passed, and nothing past an unacked record.
func TestCloseCommits(t *testing.T) {
	ctx := testCtx(t, 30*time.Second)
	e := newEnv(t, 1)
	e.publish(t, "k", 4, 1)
	s := e.source(t, func(c *franz.Config) { c.CommitInterval = time.Hour })
	for i := range 3 {
		d := receiveOne(ctx, t, s)
		if i < 2 {
			if err := d.Ack(ctx); err != nil {
				t.Fatal(err)
			}
		}
	}
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	if got := txnCommitted(ctx, t, e)[0]; got != 2 {
		t.Fatalf("committed %d after Close, want 2", got)
	}
}
