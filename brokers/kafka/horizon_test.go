package kafka_test

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemq/idemq/brokers/kafka"
	"github.com/idemq/idemq/consumer"
)

// gatedSource holds Receive until gate returns true: the test's way to have
// the janitor's first purge run before any redelivery is claimed.
type gatedSource struct {
	*kafka.Source
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

// TestHorizonConsumerDownLongerThanRetention: a consumer applies records
// but its offset commits fail (a crash before the commit, as the broker
// sees it); it is down longer than the retention; restarted, its janitor
// purges before the redeliveries are handled. With the horizon, the dedup
// rows of the records the group will read again stay, and nothing is
// applied twice; with a plain wall-clock purge, every record is applied a
// second time.
func TestHorizonConsumerDownLongerThanRetention(t *testing.T) {
	for _, tc := range []struct {
		name    string
		horizon bool
	}{{"horizon", true}, {"wall clock", false}} {
		t.Run(tc.name, func(t *testing.T) {
			const n = 20
			e := newEnv(t, 2)
			d := newDB(t)
			commits := e.observeCommits(t)
			commits.fail.Store(true)
			e.publish(t, "h", n, 4)

			r := d.start(t, e.source(t), d.apply)
			waitFor(t, 30*time.Second, "every record applied", func() bool { return r.rt.Stats().Applied == n })
			r.stop(t)
			if rows, _ := d.counts(t); rows != n {
				t.Fatalf("first run: %d effects for %d records (%+v)", rows, n, r.rt.Stats())
			}
			if c := e.committed(t); c[0] > 0 || c[1] > 0 {
				t.Fatalf("committed %v despite the failing commits", c)
			}
			commits.fail.Store(false)
			var minAt, maxAt time.Time
			_ = d.pool.QueryRow(context.Background(), `SELECT min(processed_at), max(processed_at) FROM `+pgx.Identifier{d.store.Schema(), d.store.Table()}.Sanitize()).Scan(&minAt, &maxAt)
			t.Logf("applied between %s and %s", minAt.UTC().Format(time.StampMicro), maxAt.UTC().Format(time.StampMicro))

			const retention = time.Second
			time.Sleep(2 * retention) // down longer than the retention

			src := e.source(t)
			if tc.horizon {
				h, ok, err := src.RedeliveryHorizon(testCtx(t, 10*time.Second))
				if err != nil || !ok || h.IsZero() || time.Since(h) < 2*retention {
					t.Fatalf("horizon %v, %v, %v: want the first record's timestamp", h, ok, err)
				}
			}
			// Receive waits for the janitor's first round, so the purge
			// runs before any redelivery is claimed.
			reported := func() bool {
				var k int
				_ = d.pool.QueryRow(context.Background(), `SELECT count(*) FROM `+pgx.Identifier{d.store.Schema(), d.store.Table() + "_retention"}.Sanitize()).Scan(&k)
				return k > 0
			}
			var s consumer.Source = gatedSource{src, reported}
			if !tc.horizon {
				s = plainSource{s}
			}
			r2 := d.start(t, s, d.apply, func(c *consumer.Config) {
				// The margin covers the time between reading the horizon
				// and the purge's cutoff, and millisecond timestamps.
				c.Retention, c.JanitorInterval, c.HorizonMargin = retention, time.Hour, 500*time.Millisecond
			})
			waitFor(t, 30*time.Second, "every redelivery settled", func() bool { return r2.settled() == n })
			if tc.horizon {
				// Once committed to the end, nothing is redeliverable.
				waitFor(t, 10*time.Second, "a zero horizon", func() bool {
					h, ok, err := src.RedeliveryHorizon(testCtx(t, 10*time.Second))
					return err == nil && ok && h.IsZero()
				})
			}
			r2.stop(t)
			rows, distinct := d.counts(t)
			var rep string
			_ = d.pool.QueryRow(context.Background(), `SELECT string_agg(format('%s purged=%s older=%s horizon=%s at=%s', horizon_state, purged, purged_older_than_ms, horizon, window_end), '; ') FROM `+pgx.Identifier{d.store.Schema(), d.store.Table() + "_retention"}.Sanitize()).Scan(&rep)
			t.Logf("reports: %s", rep)
			if distinct != n {
				t.Fatalf("%d distinct effects, want %d", distinct, n)
			}
			switch {
			case tc.horizon && rows != n:
				t.Fatalf("%d effects for %d records: applied twice despite the horizon", rows, n)
			case !tc.horizon && rows != 2*n:
				t.Fatalf("%d effects for %d records with a wall-clock purge; the test expects the purge to cause %d", rows, n, 2*n)
			}
			t.Logf("%s: %d effects for %d records (second run: %+v)", tc.name, rows, n, r2.rt.Stats())
		})
	}
}
