package redisstream_test

import (
	"context"
	"errors"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemq/idemq/brokers/brokertest"
	"github.com/idemq/idemq/brokers/redisstream"
	"github.com/idemq/idemq/consumer"
)

// addedAt is the time an auto-generated entry id carries.
func addedAt(t *testing.T, id string) time.Time {
	t.Helper()
	ms, _, _ := strings.Cut(id, "-")
	n, err := strconv.ParseInt(ms, 10, 64)
	if err != nil {
		t.Fatalf("entry id %q: %v", id, err)
	}
	return time.UnixMilli(n)
}

// TestRedeliveryHorizon: the horizon is the time in the id of the oldest
// entry the group could still deliver: pending with any consumer (released
// by Close included) or not yet read by the group; zero when there is
// none; the first entry after StartID when the group is gone (NewSource
// and Receive create it there again).
func TestRedeliveryHorizon(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t, 60*time.Second)
	stream := newStream(t, testURL())
	cfg := redisstream.Config{Stream: stream, Group: "g", Block: 100 * time.Millisecond}
	src := newSource(t, cfg)
	pub := newPublisher(t, redisstream.PublisherConfig{})
	publish := func(prefix string, n int) []string {
		t.Helper()
		ids, err := pub.Publish(ctx, stream, brokertest.NewMessages(prefix, n, 0)...)
		if err != nil {
			t.Fatal(err)
		}
		return ids
	}
	want := func(src *redisstream.Source, what, id string) {
		t.Helper()
		h, ok, err := src.RedeliveryHorizon(ctx)
		if err != nil || !ok {
			t.Fatalf("%s: horizon %v, %v, %v", what, h, ok, err)
		}
		switch {
		case id == "" && !h.IsZero():
			t.Fatalf("%s: horizon %v, want zero (nothing redeliverable)", what, h)
		case id != "" && !h.Equal(addedAt(t, id)):
			t.Fatalf("%s: horizon %v, want %v, the time of entry %s", what, h, addedAt(t, id), id)
		}
	}
	receive := func(src *redisstream.Source) consumer.Delivery {
		t.Helper()
		d, err := src.Receive(ctx)
		if err != nil {
			t.Fatal(err)
		}
		return d
	}
	ack := func(d consumer.Delivery) {
		t.Helper()
		if err := d.Ack(ctx); err != nil {
			t.Fatal(err)
		}
	}

	want(src, "an empty stream", "")
	ids := publish("h", 3)
	want(src, "three entries not yet read", ids[0])
	ds := []consumer.Delivery{receive(src), receive(src), receive(src)}
	want(src, "three pending", ids[0])
	ack(ds[1])
	want(src, "the second acked, the first pending", ids[0])
	ack(ds[0])
	want(src, "the first two acked", ids[2])
	more := publish("m", 1)
	want(src, "one pending, one not yet read", ids[2])
	ack(ds[2])
	want(src, "one not yet read", more[0])
	_ = receive(src)
	want(src, "one pending", more[0])
	if err := src.Close(); err != nil { // releases it
		t.Fatal(err)
	}
	if _, ok, err := src.RedeliveryHorizon(ctx); !errors.Is(err, consumer.ErrSourceClosed) || ok {
		t.Fatalf("after Close: %v, %v; want ErrSourceClosed", ok, err)
	}

	src2 := newSource(t, cfg)
	want(src2, "one released by Close", more[0])
	ack(receive(src2)) // claimed
	want(src2, "everything acked", "")

	if err := client(t, testURL()).XGroupDestroy(ctx, stream, "g").Err(); err != nil {
		t.Fatal(err)
	}
	want(src2, "the group gone: created again at StartID 0", ids[0])
	if err := client(t, testURL()).Del(ctx, stream).Err(); err != nil {
		t.Fatal(err)
	}
	want(src2, "the stream gone", "")
}

// gatedSource holds Receive until gate returns true: the test's way to have
// the janitor's first purge run before any redelivery is claimed.
type gatedSource struct {
	*redisstream.Source
	gate func() bool
}

func (g gatedSource) Receive(ctx context.Context) (consumer.Delivery, error) {
	for !g.gate() {
		select {
		case <-ctx.Done():
			return nil, ctx.Err()
		case <-time.After(10 * time.Millisecond):
		}
	}
	return g.Source.Receive(ctx)
}

// plainSource hides RedeliveryHorizon: the janitor then purges by the wall
// clock alone.
type plainSource struct{ consumer.Source }

// droppedAcks forwards a source's deliveries but loses every ack, as a
// process that dies between its commits and its XACKs does. It hides
// Configure, so the Source holds at most 2×DefaultWindow entries.
type droppedAcks struct{ consumer.Source }

func (s droppedAcks) Receive(ctx context.Context) (consumer.Delivery, error) {
	d, err := s.Source.Receive(ctx)
	if err != nil {
		return nil, err
	}
	return droppedAck{d}, nil
}

type droppedAck struct{ consumer.Delivery }

func (droppedAck) Ack(context.Context) error { return nil }

// TestHorizonConsumerDownLongerThanRetention: a consumer applies entries
// but its XACKs are lost (a crash before the ack, as Redis sees it), and
// Close releases them to the group; it is down longer than the retention;
// restarted, its janitor purges before the entries are claimed again. With
// the horizon, the dedup rows of the entries still pending stay, and
// nothing is applied twice; with a plain wall-clock purge, every entry is
// applied a second time.
func TestHorizonConsumerDownLongerThanRetention(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name    string
		horizon bool
	}{{"horizon", true}, {"wall clock", false}} {
		t.Run(tc.name, func(t *testing.T) {
			// At most the 2×DefaultWindow entries the Source holds
			// unacked (droppedAcks hides Configure).
			const n = 12
			ctx := testCtx(t, 90*time.Second)
			e := newE2E(t)
			stream := newStream(t, testURL())
			if _, err := newPublisher(t, redisstream.PublisherConfig{}).Publish(ctx, stream, brokertest.NewMessages("h", n, 0)...); err != nil {
				t.Fatal(err)
			}
			cfg := redisstream.Config{Stream: stream, Group: "ledger"}
			src1 := newSource(t, cfg)
			c1 := e.config(src1, e.handler(false, nil))
			c1.Source = droppedAcks{src1}
			rt1, err := consumer.New(c1)
			if err != nil {
				t.Fatal(err)
			}
			stop1 := start(t, rt1)
			waitFor(t, 30*time.Second, "every entry applied", func() bool { return rt1.Stats().Applied == n })
			if err := stop1(); err != nil { // Close releases the entries
				t.Fatalf("first runtime: %v", err)
			}
			if rows, _ := e.counts(t); rows != n {
				t.Fatalf("first run: %d effects for %d entries (%+v)", rows, n, rt1.Stats())
			}
			rc := client(t, testURL())
			if p, err := rc.XPending(ctx, stream, "ledger").Result(); err != nil || p.Count != n {
				t.Fatalf("pending after the first run: %+v, %v; want all %d", p, err, n)
			}
			table := pgx.Identifier{e.store.Schema(), e.store.Table()}.Sanitize()
			var minAt, maxAt time.Time
			_ = e.store.Pool().QueryRow(ctx, `SELECT min(processed_at), max(processed_at) FROM `+table).Scan(&minAt, &maxAt)
			t.Logf("applied between %s and %s", minAt.UTC().Format(time.StampMicro), maxAt.UTC().Format(time.StampMicro))

			const retention = time.Second
			time.Sleep(2 * retention) // down longer than the retention

			src2 := newSource(t, cfg)
			if tc.horizon {
				h, ok, err := src2.RedeliveryHorizon(ctx)
				if err != nil || !ok || h.IsZero() || time.Since(h) < 2*retention {
					t.Fatalf("horizon %v, %v, %v: want the first entry's time", h, ok, err)
				}
			}
			// Receive waits for the janitor's first round, so the purge
			// runs before any entry is claimed again.
			retained := pgx.Identifier{e.store.Schema(), e.store.Table() + "_retention"}.Sanitize()
			reported := func() bool {
				var k int
				_ = e.store.Pool().QueryRow(context.Background(), `SELECT count(*) FROM `+retained).Scan(&k)
				return k > 0
			}
			var s consumer.Source = gatedSource{src2, reported}
			if !tc.horizon {
				s = plainSource{s}
			}
			c2 := e.config(src2, e.handler(false, nil))
			c2.Source = s
			// The margin covers the time between reading the horizon
			// and the purge's cutoff, and millisecond entry ids.
			c2.Retention, c2.JanitorInterval, c2.HorizonMargin = retention, time.Hour, 500*time.Millisecond
			rt2, err := consumer.New(c2)
			if err != nil {
				t.Fatal(err)
			}
			stop2 := start(t, rt2)
			waitFor(t, 30*time.Second, "every entry acked", func() bool {
				p, err := rc.XPending(ctx, stream, "ledger").Result()
				return err == nil && p.Count == 0 && rt2.Stats().InFlight == 0
			})
			if tc.horizon {
				// Once everything is acked, nothing is redeliverable.
				if h, ok, err := src2.RedeliveryHorizon(ctx); err != nil || !ok || !h.IsZero() {
					t.Errorf("every entry acked: horizon %v, %v, %v; want zero", h, ok, err)
				}
			}
			if err := stop2(); err != nil {
				t.Fatalf("second runtime: %v", err)
			}
			rows, distinct := e.counts(t)
			var rep string
			_ = e.store.Pool().QueryRow(ctx, `SELECT string_agg(format('%s purged=%s older=%s horizon=%s at=%s', horizon_state, purged, purged_older_than_ms, horizon, window_end), '; ') FROM `+retained).Scan(&rep)
			t.Logf("reports: %s", rep)
			if distinct != n {
				t.Fatalf("%d distinct effects, want %d", distinct, n)
			}
			switch {
			case tc.horizon && rows != n:
				t.Fatalf("%d effects for %d entries: applied twice despite the horizon", rows, n)
			case !tc.horizon && rows != 2*n:
				t.Fatalf("%d effects for %d entries with a wall-clock purge; the test expects the purge to cause %d", rows, n, 2*n)
			}
			t.Logf("%s: %d effects for %d entries (second run: %+v)", tc.name, rows, n, rt2.Stats())
		})
	}
}
