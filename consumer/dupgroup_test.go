package consumer_test

import (
	"testing"
)

// x was applied with body B. Two copies of x then arrive in one group:
// A (a mismatch) and then B (a duplicate). Each is judged against the
// applied row, as in strict mode: A is dead-lettered as a mismatch, and B
// is acked as a duplicate, not dead-lettered because A was a mismatch.
func TestEdgeRepeatedIDAfterAMismatchInOneGroup(t *testing.T) {
	for _, mode := range threeModes {
		t.Run(mode.name, func(t *testing.T) {
			b := newBundle(t)
			b.publish(msg("x", "B"))
			cfg := b.config(b.insertEffect)
			cfg.Concurrency, cfg.BatchSize = 1, mode.batchSize
			r := start(t, cfg)
			waitFor(t, "x applied", func() bool { return r.rt.Stats().Applied == 1 && b.settled() })
			r.stop(t)
			b.publish(msg("x", "A"), msg("x", "B"))
			cfg = b.config(b.insertEffect) // a new subscription
			cfg.Concurrency, cfg.BatchSize = 1, mode.batchSize
			r = start(t, cfg)
			waitFor(t, "both copies settled", func() bool {
				st := r.rt.Stats()
				return b.settled() && st.InFlight == 0 && st.Received == 2
			})
			st := r.rt.Stats()
			dl := b.dlq.list()
			if st.Duplicates != 1 || st.DeadLettered != 1 || len(dl) != 1 || string(dl[0].msg.Body) != "A" {
				t.Fatalf("stats %+v, %d dead letters: want A dead-lettered as a mismatch and B a duplicate", st, len(dl))
			}
		})
	}
}
