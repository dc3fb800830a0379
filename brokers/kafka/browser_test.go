package kafka_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"slices"
	"testing"
	"time"

	"github.com/idemq/idemq/brokers/kafka"
	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/dlq"
	kafkago "github.com/segmentio/kafka-go"
	"github.com/twmb/franz-go/pkg/kmsg"
)

var _ dlq.Browser = (*kafka.Browser)(nil)

// browser opens a Browser on e's topic, closed when the test ends.
func (e *env) browser(t *testing.T, mod ...func(*kafka.BrowserConfig)) *kafka.Browser {
	t.Helper()
	cfg := kafka.BrowserConfig{Brokers: e.c.Addrs(), Topic: e.topic, FetchMaxWait: 100 * time.Millisecond, Logger: testLogger()}
	for _, f := range mod {
		f(&cfg)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	b, err := kafka.NewBrowser(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = b.Close() })
	return b
}

func withGroup(g string) func(*kafka.BrowserConfig) {
	return func(c *kafka.BrowserConfig) { c.GroupID = g }
}

// browseAll reads b to its end.
func browseAll(ctx context.Context, t *testing.T, b *kafka.Browser) []consumer.Delivery {
	t.Helper()
	var out []consumer.Delivery
	for {
		d, err := b.Next(ctx)
		if errors.Is(err, io.EOF) {
			return out
		}
		if err != nil {
			t.Fatalf("next after %d records: %v", len(out), err)
		}
		out = append(out, d)
	}
}

type coord struct {
	p   int32
	off int64
}

func coords(ds []consumer.Delivery) []coord {
	out := make([]coord, len(ds))
	for i, d := range ds {
		out[i] = coord{d.Message().Partition, d.Message().Offset}
	}
	return out
}

// TestBrowserSnapshot: a browser reads every partition, in partition and
// offset order, up to the high watermarks at open (records published later
// are not read), maps records exactly like the Source, returns io.EOF at
// the end, again and again, and without a group commits nothing.
func TestBrowserSnapshot(t *testing.T) {
	ctx := testCtx(t, 30*time.Second)
	e := newEnv(t, 3)
	msgs := e.publish(t, "dead", 30, 7)
	ts := time.Now().Add(-time.Hour).Truncate(time.Millisecond)
	extra := &consumer.Message{ID: "hdr-1", RecordKey: []byte("k0"), Body: []byte("x"), Headers: map[string]string{"a": "1"}, Timestamp: ts}
	if err := e.pub.Publish(ctx, e.topic, extra); err != nil {
		t.Fatal(err)
	}
	b := e.browser(t)
	if got := b.Depth(); got != 31 {
		t.Fatalf("depth %d, want 31", got)
	}
	e.publish(t, "later", 9, 3) // after open: not part of this pass

	ds := browseAll(ctx, t, b)
	if len(ds) != 31 {
		t.Fatalf("read %d records, want 31", len(ds))
	}
	cs := coords(ds)
	if !slices.IsSortedFunc(cs, func(a, b coord) int {
		if a.p != b.p {
			return int(a.p - b.p)
		}
		return int(a.off - b.off)
	}) {
		t.Errorf("not in partition, offset order: %v", cs)
	}
	var ids []string
	for _, d := range ds {
		m := d.Message()
		ids = append(ids, m.ID)
		if m.Source != e.topic || m.Key != fmt.Sprintf("%s/%d", e.topic, m.Partition) || m.Redelivered {
			t.Errorf("record %s: source %q key %q redelivered %v", m.ID, m.Source, m.Key, m.Redelivered)
		}
		if m.Metadata["kafka.offset"] != fmt.Sprint(m.Offset) || m.Metadata["kafka.partition"] != fmt.Sprint(m.Partition) || m.Metadata["kafka.topic"] != e.topic {
			t.Errorf("record %s: metadata %v", m.ID, m.Metadata)
		}
		if m.ID == extra.ID {
			if string(m.Body) != "x" || m.Header("a") != "1" || m.Header("idempotency-key") != "hdr-1" || !m.Timestamp.Equal(ts) || m.Metadata["kafka.key"] != "k0" {
				t.Errorf("mapped record: %+v", m)
			}
		}
	}
	want := append(idsOf(msgs), extra.ID)
	slices.Sort(ids)
	slices.Sort(want)
	if !slices.Equal(ids, want) {
		t.Fatalf("read %v, want %v", ids, want)
	}
	for range 2 {
		if _, err := b.Next(ctx); !errors.Is(err, io.EOF) {
			t.Fatalf("next at the end: %v, want io.EOF", err)
		}
	}
	for _, d := range ds {
		if err := d.Ack(ctx); err != nil {
			t.Fatal(err)
		}
	}
	if err := b.Close(); err != nil {
		t.Fatal(err)
	}
	if e.groupExists(t) {
		t.Errorf("a browse without a group committed: %v", e.committed(t))
	}
	// Without a group the next pass reads everything again, the later
	// records included.
	if n := len(browseAll(ctx, t, e.browser(t))); n != 40 {
		t.Fatalf("second pass read %d records, want 40", n)
	}
}

func idsOf(msgs []*consumer.Message) []string {
	out := make([]string, len(msgs))
	for i, m := range msgs {
		out[i] = m.ID
	}
	return out
}

// TestBrowserGroupCommit: with a GroupID, Close commits per partition only
// up to the highest contiguous acked record (never past a nacked or
// unsettled one), and the next pass with the same group starts there.
func TestBrowserGroupCommit(t *testing.T) {
	ctx := testCtx(t, 30*time.Second)
	e := newEnv(t, 2)
	// Partition 0 gets p0-*, partition 1 gets p1-*, by their keys.
	var p0, p1 []*consumer.Message
	for i := range 6 {
		p0 = append(p0, &consumer.Message{ID: fmt.Sprintf("p0-%d", i), Body: []byte("a")})
		p1 = append(p1, &consumer.Message{ID: fmt.Sprintf("p1-%d", i), Body: []byte("b")})
	}
	publishTo := func(part int, msgs []*consumer.Message) {
		for _, m := range msgs {
			m.RecordKey = []byte(keyFor(t, part, 2))
		}
		if err := e.pub.Publish(ctx, e.topic, msgs...); err != nil {
			t.Fatal(err)
		}
	}
	publishTo(0, p0)
	publishTo(1, p1)

	b := e.browser(t, withGroup(e.group))
	ds := browseAll(ctx, t, b)
	if len(ds) != 12 {
		t.Fatalf("read %d, want 12", len(ds))
	}
	for _, d := range ds {
		m := d.Message()
		if m.Metadata["kafka.group"] != e.group {
			t.Errorf("metadata %v", m.Metadata)
		}
		switch {
		case m.Partition == 0 && m.Offset == 3:
			if err := d.Nack(ctx, true); err != nil {
				t.Fatal(err)
			}
		case m.Partition == 1 && m.Offset == 5:
			// left unsettled
		default:
			if err := d.Ack(ctx); err != nil {
				t.Fatal(err)
			}
		}
	}
	if err := ds[0].Ack(ctx); !errors.Is(err, consumer.ErrDeliveryStale) {
		t.Errorf("second ack: %v, want ErrDeliveryStale", err)
	}
	if err := b.Close(); err != nil {
		t.Fatal(err)
	}
	if err := b.Close(); err != nil {
		t.Fatalf("second close: %v", err)
	}
	if got := e.committed(t); got[0] != 3 || got[1] != 5 {
		t.Fatalf("committed %v, want partition 0 at 3 (the nacked record) and 1 at 5 (the unsettled one)", got)
	}
	if _, err := b.Next(ctx); !errors.Is(err, consumer.ErrSourceClosed) {
		t.Errorf("next after close: %v", err)
	}
	if err := ds[11].Ack(ctx); !errors.Is(err, consumer.ErrSourceClosed) {
		t.Errorf("ack after close: %v, want ErrSourceClosed", err)
	}

	// The next pass starts at the committed offsets.
	b = e.browser(t, withGroup(e.group))
	if b.Depth() != 4 {
		t.Errorf("depth %d, want 4", b.Depth())
	}
	ds = browseAll(ctx, t, b)
	if got, want := coords(ds), []coord{{0, 3}, {0, 4}, {0, 5}, {1, 5}}; !slices.Equal(got, want) {
		t.Fatalf("second pass read %v, want %v", got, want)
	}
	for _, d := range ds {
		_ = d.Ack(ctx)
	}
	if err := b.Close(); err != nil {
		t.Fatal(err)
	}
	if got := e.committed(t); got[0] != 6 || got[1] != 6 {
		t.Fatalf("committed %v, want 6 and 6", got)
	}
	// A third pass reads nothing; a browse without the group reads all.
	if n := len(browseAll(ctx, t, e.browser(t, withGroup(e.group)))); n != 0 {
		t.Fatalf("third pass read %d", n)
	}
	if n := len(browseAll(ctx, t, e.browser(t))); n != 12 {
		t.Fatalf("browse without group read %d", n)
	}
}

// keyFor finds a record key that the publisher's murmur2 balancer sends to
// partition part of n.
func keyFor(t *testing.T, part, n int) string {
	t.Helper()
	parts := make([]int, n)
	for i := range parts {
		parts[i] = i
	}
	for i := range 1000 {
		k := fmt.Sprintf("key-%d", i)
		if (&kafkago.Murmur2Balancer{}).Balance(kafkago.Message{Key: []byte(k)}, parts...) == part {
			return k
		}
	}
	t.Fatal("no key found")
	return ""
}

// TestBrowserIDs: the Browser reads the id header as the Source does, but
// gives no fallback id (a dead letter's position is not the original's
// identity).
func TestBrowserIDs(t *testing.T) {
	ctx := testCtx(t, 30*time.Second)
	e := newEnv(t, 1)
	if err := e.pub.Publish(ctx, e.topic,
		&consumer.Message{Body: []byte("no id")},
		&consumer.Message{Body: []byte("custom"), Headers: map[string]string{"x-id": "custom-1"}},
		&consumer.Message{ID: "std-1", Body: []byte("std")},
	); err != nil {
		t.Fatal(err)
	}
	cases := []struct {
		name string
		mod  func(*kafka.BrowserConfig)
		want []string
	}{
		{"default", func(*kafka.BrowserConfig) {}, []string{"", "", "std-1"}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			var got []string
			for _, d := range browseAll(ctx, t, e.browser(t, tc.mod)) {
				got = append(got, d.Message().ID)
				if want := e.topic + "/0"; d.Message().Key != want {
					t.Errorf("key %q, want %q", d.Message().Key, want)
				}
			}
			if !slices.Equal(got, tc.want) {
				t.Fatalf("ids %q, want %q", got, tc.want)
			}
		})
	}
}

// TestBrowserEmptyAndMissing: an empty topic ends at once; a missing topic
// and bad configs fail NewBrowser.
func TestBrowserEmptyAndMissing(t *testing.T) {
	ctx := testCtx(t, 30*time.Second)
	e := newEnv(t, 2)
	b := e.browser(t, withGroup(e.group))
	if _, err := b.Next(ctx); !errors.Is(err, io.EOF) {
		t.Fatalf("next on an empty topic: %v", err)
	}
	if err := b.Close(); err != nil {
		t.Fatal(err)
	}
	if _, err := kafka.NewBrowser(ctx, kafka.BrowserConfig{Brokers: e.c.Addrs(), Topic: e.topic + "-missing"}); err == nil {
		t.Fatal("NewBrowser on a missing topic succeeded")
	}
	var cerr *consumer.ConfigError
	for _, cfg := range []kafka.BrowserConfig{
		{Topic: "x"},
		{Brokers: e.c.Addrs()},
		{Brokers: e.c.Addrs(), Topic: "x", CommitTimeout: -1},
	} {
		if _, err := kafka.NewBrowser(ctx, cfg); !errors.As(err, &cerr) {
			t.Errorf("NewBrowser(%+v): %v, want a ConfigError", cfg, err)
		}
	}
}

// TestBrowserCloseInterruptsNext: a Next blocked on a broker that fails
// every fetch returns ctx's error when ctx ends, and ErrSourceClosed when
// the Browser is closed meanwhile; no goroutine is left behind.
func TestBrowserCloseInterruptsNext(t *testing.T) {
	ctx := testCtx(t, 30*time.Second)
	e := newEnv(t, 1)
	e.publish(t, "x", 3, 1)
	e.c.ControlKey(int16(kmsg.Fetch), func(kmsg.Request) (kmsg.Response, error, bool) {
		e.c.KeepControl()
		return nil, errors.New("injected fetch failure"), true
	})
	b := e.browser(t)
	short, cancel := context.WithTimeout(ctx, 300*time.Millisecond)
	defer cancel()
	if _, err := b.Next(short); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("next with a short deadline: %v", err)
	}
	errc := make(chan error, 1)
	go func() {
		_, err := b.Next(ctx)
		errc <- err
	}()
	select {
	case err := <-errc:
		t.Fatalf("next returned early: %v", err)
	case <-time.After(200 * time.Millisecond): // let Next block in the fetch
	}
	if err := b.Close(); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-errc:
		if !errors.Is(err, consumer.ErrSourceClosed) {
			t.Fatalf("next interrupted by close: %v", err)
		}
	case <-ctx.Done():
		t.Fatal("close did not interrupt next")
	}
}

// groupExists reports whether the broker knows e.group (kfake forgets a
// group that never committed).
func (e *env) groupExists(t testing.TB) bool {
	t.Helper()
	transport := &kafkago.Transport{}
	defer transport.CloseIdleConnections()
	client := &kafkago.Client{Addr: kafkago.TCP(e.c.Addrs()...), Transport: transport}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	resp, err := client.ListGroups(ctx, &kafkago.ListGroupsRequest{})
	if err != nil {
		t.Fatal(err)
	}
	for _, g := range resp.Groups {
		if g.GroupID == e.group {
			return true
		}
	}
	return false
}
