package bench

import (
	"context"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemq/idemq/consumer"
)

// The paced publisher keeps its schedule while a publish waits longer than
// the interval (a broker slow to confirm): the next message is sent on
// time, not after the first one's confirm.
func TestPublishPacedDoesNotWaitForConfirms(t *testing.T) {
	w := newWorkload(50, 0, 1)
	release := make(chan struct{})
	second := make(chan struct{})
	var calls atomic.Int64
	var once sync.Once
	pub := func(ctx context.Context, msgs []*consumer.Message) error {
		switch calls.Add(1) {
		case 1:
			select { // the first confirm is held until the second is sent
			case <-release:
			case <-ctx.Done():
				return ctx.Err()
			}
		case 2:
			once.Do(func() { close(second) })
		}
		return nil
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	var published atomic.Int64
	done := make(chan error, 1)
	go func() { done <- w.publishPaced(ctx, pub, &published, 1000) }()
	select {
	case <-second:
	case <-time.After(10 * time.Second):
		t.Fatal("the second message waited for the first one's confirm")
	}
	close(release)
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if got := published.Load(); got != int64(len(w.seq)) {
		t.Fatalf("published %d of %d", got, len(w.seq))
	}
}

// The deliveries published before the tracker's warm-up ends are settled
// and counted, but left out of the latencies.
func TestTrackerLeavesTheWarmupOut(t *testing.T) {
	tr := newTracker(3, 3, false)
	now := time.Now()
	tr.countFrom(now)
	at := func(d time.Duration) string { return strconv.FormatInt(now.Add(d).UnixNano(), 10) }
	tr.record(at(-time.Hour), true) // an hour's latency, in the warm-up
	tr.record(at(0), true)
	tr.record(at(time.Millisecond), true)
	if tr.settled.Load() != 3 || tr.applied.Load() != 3 {
		t.Fatalf("settled %d, applied %d, want 3 and 3", tr.settled.Load(), tr.applied.Load())
	}
	if m := tr.hist.maximum(); m > time.Minute {
		t.Fatalf("the maximum latency is %s: the warm-up's delivery was counted", m)
	}
	if tr.hist.quantile(0.5) <= 0 {
		t.Fatal("the deliveries after the warm-up were not counted")
	}
}
