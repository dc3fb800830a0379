package bench

import (
	"context"
	"errors"
	"math"
	"math/rand/v2"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/idemq/idemq/consumer"
)

// HeaderPublishedAt carries the publish time, in Unix nanoseconds, of each
// delivery.
const HeaderPublishedAt = "bench-published-at"

// workload is the sequence of deliveries: delivery i carries unique id
// seq[i]. A duplicate re-sends an earlier id with the same body (and key).
// Ids, bodies and keys are derived from the index, so a 1M workload costs
// 4 MB.
type workload struct {
	seq    []int32
	unique int
	// keyed gives every message a key (shardKey), for a sharded run.
	keyed bool
}

func newWorkload(n int, dupRate float64, seed uint64) *workload {
	rng := rand.New(rand.NewPCG(seed, 0x1de3))
	w := &workload{seq: make([]int32, n)}
	for i := range w.seq {
		if w.unique > 0 && rng.Float64() < dupRate {
			w.seq[i] = int32(rng.IntN(w.unique))
			continue
		}
		w.seq[i] = int32(w.unique)
		w.unique++
	}
	return w
}

func msgID(j int32) string { return "m-" + strconv.Itoa(int(j)) }

// shardKeys is the number of distinct keys of a keyed workload.
const shardKeys = 1000

// shardKey is the key of unique message j, which a sharded run routes by:
// an account, "acct-<j mod 1000>", so that ids spread over the shards and
// a duplicate goes where its original went.
func shardKey(j int32) string { return "acct-" + strconv.Itoa(int(j%shardKeys)) }

// key is the Message.Key of unique message j: shardKey if the workload is
// keyed, none otherwise.
func (w *workload) key(j int32) string {
	if !w.keyed {
		return ""
	}
	return shardKey(j)
}

// amountOf is the ledger amount of unique message j.
func amountOf(j int32) int64 { return int64(j%1000) + 1 }

// body is the payload of unique message j: "<id>:<amount>".
func body(j int32) []byte {
	return []byte(msgID(j) + ":" + strconv.FormatInt(amountOf(j), 10))
}

// parseBody returns the id and amount of a payload made by body.
func parseBody(b []byte) (string, int64, error) {
	id, amt, ok := strings.Cut(string(b), ":")
	if !ok {
		return "", 0, errors.New("malformed body")
	}
	n, err := strconv.ParseInt(amt, 10, 64)
	if err != nil {
		return "", 0, errors.New("malformed amount")
	}
	return id, n, nil
}

// publishFunc publishes one chunk of messages.
type publishFunc func(ctx context.Context, msgs []*consumer.Message) error

// publish sends the workload with DefaultPublishers concurrent publishers,
// DefaultPublishChunk messages per call, stamping each chunk with the time
// it was built. published counts the deliveries confirmed.
func (w *workload) publish(ctx context.Context, pub publishFunc, published *atomic.Int64) error {
	var next atomic.Int64
	return inParallel(ctx, DefaultPublishers, func(ctx context.Context) error {
		for {
			start := int(next.Add(DefaultPublishChunk)) - DefaultPublishChunk
			if start >= len(w.seq) || ctx.Err() != nil {
				return nil
			}
			end := min(start+DefaultPublishChunk, len(w.seq))
			now := strconv.FormatInt(time.Now().UnixNano(), 10)
			msgs := make([]*consumer.Message, 0, end-start)
			for _, j := range w.seq[start:end] {
				msgs = append(msgs, w.message(j, now))
			}
			if err := pub(ctx, msgs); err != nil {
				return err
			}
			published.Add(int64(len(msgs)))
		}
	})
}

// publishPaced sends the workload one message per publish at about rate
// messages a second, each stamped with the time it was sent: an idle
// consumer's workload, for its latency. It keeps the schedule from the
// start, and a publish does not wait for the one before it to be
// confirmed: up to pacedInFlight are in flight, so a broker that takes
// longer to confirm than the interval does not lower the rate.
func (w *workload) publishPaced(ctx context.Context, pub publishFunc, published *atomic.Int64, rate float64) error {
	interval := time.Duration(float64(time.Second) / rate)
	start := time.Now()
	var next atomic.Int64
	return inParallel(ctx, pacedInFlight, func(ctx context.Context) error {
		t := time.NewTimer(0)
		defer t.Stop()
		for {
			i := int(next.Add(1)) - 1
			if i >= len(w.seq) || ctx.Err() != nil {
				return nil
			}
			if wait := time.Until(start.Add(time.Duration(i) * interval)); wait > 0 {
				t.Reset(wait)
				select {
				case <-ctx.Done():
					return nil
				case <-t.C:
				}
			}
			m := w.message(w.seq[i], strconv.FormatInt(time.Now().UnixNano(), 10))
			if err := pub(ctx, []*consumer.Message{m}); err != nil {
				return err
			}
			published.Add(1)
		}
	})
}

// pacedInFlight bounds publishPaced's publishes in flight: at 1,000
// messages a second, 32 ms of confirm latency.
const pacedInFlight = 32

// message is the workload's j-th message, stamped as published at
// publishedAt (Unix nanoseconds).
func (w *workload) message(j int32, publishedAt string) *consumer.Message {
	return &consumer.Message{ID: msgID(j), Key: w.key(j), Body: body(j),
		Headers: map[string]string{HeaderPublishedAt: publishedAt}}
}

// inParallel runs n copies of f, and returns the first error, after
// which the others' ctx is done; or ctx's error if it ended first.
func inParallel(ctx context.Context, n int, f func(ctx context.Context) error) error {
	ctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	var wg sync.WaitGroup
	for range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := f(ctx); err != nil {
				cancel(err)
			}
		}()
	}
	wg.Wait()
	return context.Cause(ctx)
}

// tracker counts settled deliveries of one mode, records their latencies
// and signals when the mode is done: every delivery settled and every
// unique id applied.
type tracker struct {
	messages, unique int64
	settled, applied atomic.Int64
	dups, errs       atomic.Int64
	first, last      atomic.Int64 // Unix nanoseconds
	// from is when the deliveries whose latencies count were published
	// (Unix nanoseconds): 0 counts them all.
	from     atomic.Int64
	hist     histogram
	done     chan struct{}
	doneOnce sync.Once
	// failed receives the first fatal error of the mode.
	failed chan error
	// noDB: broker-only, where nothing is applied.
	noDB bool
}

func newTracker(messages, unique int, noDB bool) *tracker {
	return &tracker{messages: int64(messages), unique: int64(unique), done: make(chan struct{}),
		failed: make(chan error, 1), noDB: noDB}
}

// record notes that a delivery was settled (committed as new or as a
// duplicate, or acked by broker-only), publishedAt being its header.
func (t *tracker) record(publishedAt string, applied bool) {
	now := time.Now().UnixNano()
	t.first.CompareAndSwap(0, now)
	if p, err := strconv.ParseInt(publishedAt, 10, 64); err == nil && p > 0 && now > p && p >= t.from.Load() {
		t.hist.add(time.Duration(now - p))
	}
	if applied {
		t.applied.Add(1)
	} else {
		t.dups.Add(1)
	}
	settled := t.settled.Add(1)
	if settled >= t.messages && (t.noDB || t.applied.Load() >= t.unique) {
		t.doneOnce.Do(func() {
			t.last.Store(now)
			close(t.done)
		})
	}
}

// countFrom leaves the deliveries published before at out of the
// latencies.
func (t *tracker) countFrom(at time.Time) { t.from.Store(at.UnixNano()) }

// fail reports a fatal error; only the first is kept.
func (t *tracker) fail(err error) {
	select {
	case t.failed <- err:
	default:
	}
}

// elapsed is the time from the first settled delivery to the last.
func (t *tracker) elapsed() time.Duration {
	f, l := t.first.Load(), t.last.Load()
	if f == 0 || l <= f {
		return 0
	}
	return time.Duration(l - f)
}

// histogram is a fixed-size log-scale latency histogram: bucket i holds
// values in [base^i, base^(i+1)) microseconds, so quantiles are within 2%
// and memory does not grow with the number of samples.
type histogram struct {
	buckets [histBuckets]atomic.Int64
	max     atomic.Int64 // the largest value added, exactly
}

const (
	histBase    = 1.02
	histBuckets = 1100 // up to about 2.8e9 µs
)

func (h *histogram) add(d time.Duration) {
	us := float64(d) / float64(time.Microsecond)
	i := 0
	if us > 1 {
		i = int(math.Log(us) / math.Log(histBase))
	}
	h.buckets[min(i, histBuckets-1)].Add(1)
	for m := h.max.Load(); int64(d) > m && !h.max.CompareAndSwap(m, int64(d)); m = h.max.Load() {
	}
}

// maximum returns the largest value added, or 0 with no samples.
func (h *histogram) maximum() time.Duration { return time.Duration(h.max.Load()) }

// quantile returns the q-quantile (0 < q <= 1), or 0 with no samples.
func (h *histogram) quantile(q float64) time.Duration {
	var total int64
	for i := range h.buckets {
		total += h.buckets[i].Load()
	}
	if total == 0 {
		return 0
	}
	rank := int64(math.Ceil(q * float64(total)))
	var seen int64
	for i := range h.buckets {
		seen += h.buckets[i].Load()
		if seen >= rank {
			// The bucket's geometric middle.
			us := math.Pow(histBase, float64(i)+0.5)
			return time.Duration(us * float64(time.Microsecond))
		}
	}
	return 0
}
