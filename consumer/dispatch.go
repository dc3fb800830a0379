package consumer

import (
	"context"
	"hash/fnv"
	"sync"
	"sync/atomic"
	"time"
)

// dispatcher runs deliveries concurrently, one at a time per key. Each
// delivery holds a slot from receipt to settlement, which bounds the number
// in memory to Concurrency. A key's next delivery starts only once the one
// before it is settled (acked, dead-lettered, or requeued at shutdown), so
// retries and dead-lettering never reorder a key.
type dispatcher struct {
	r     *Runtime
	ctx   context.Context
	slots chan struct{}
	wg    sync.WaitGroup
	mu    sync.Mutex
	keys  map[string][]Delivery // busy keys and the deliveries waiting on them
}

func (d *dispatcher) dispatch(del Delivery) {
	key := del.Message().Key
	if key != "" {
		d.mu.Lock()
		if waiting, busy := d.keys[key]; busy {
			d.keys[key] = append(waiting, del)
			d.mu.Unlock()
			return
		}
		d.keys[key] = nil
		d.mu.Unlock()
	}
	d.wg.Add(1)
	go func() {
		defer d.wg.Done()
		for del != nil {
			d.r.process(d.ctx, del)
			<-d.slots
			del = d.next(key)
		}
	}()
}

// next pops the next delivery waiting on key, or marks key idle.
func (d *dispatcher) next(key string) Delivery {
	if key == "" {
		return nil
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	waiting := d.keys[key]
	if len(waiting) == 0 {
		delete(d.keys, key)
		return nil
	}
	d.keys[key] = waiting[1:]
	return waiting[0]
}

// batchDispatcher runs batch mode: deliveries are spread over Concurrency
// lanes by key, so that messages with the same key stay in one lane, in
// order; each lane collects up to BatchSize deliveries, or waits at most
// BatchWait, and applies them in one transaction.
type batchDispatcher struct {
	r     *Runtime
	ctx   context.Context
	slots chan struct{}
	lanes []chan Delivery
	rr    atomic.Uint64
	wg    sync.WaitGroup
}

func newBatchDispatcher(r *Runtime, ctx context.Context) *batchDispatcher {
	// Room for two batches per lane: one filling while one commits.
	n := 2 * r.cfg.Concurrency * r.batchSize
	d := &batchDispatcher{r: r, ctx: ctx, slots: make(chan struct{}, n)}
	for i := 0; i < r.cfg.Concurrency; i++ {
		lane := make(chan Delivery, n)
		d.lanes = append(d.lanes, lane)
		d.wg.Add(1)
		go func() {
			defer d.wg.Done()
			d.runLane(lane)
		}()
	}
	return d
}

func (d *batchDispatcher) dispatch(del Delivery) {
	var i uint64
	if key := del.Message().Key; key != "" {
		h := fnv.New64a()
		_, _ = h.Write([]byte(key))
		i = h.Sum64()
	} else {
		// Runs of BatchSize go to one lane, so a batch holds
		// consecutive deliveries, which a broker can ack in one call.
		i = d.rr.Add(1) / uint64(d.r.batchSize)
	}
	d.lanes[i%uint64(len(d.lanes))] <- del
}

// close ends the lanes once they have handled what they hold.
func (d *batchDispatcher) close() {
	for _, l := range d.lanes {
		close(l)
	}
}

func (d *batchDispatcher) runLane(lane chan Delivery) {
	size, wait := d.r.batchSize, d.r.cfg.BatchWait
	timer := time.NewTimer(wait)
	defer timer.Stop()
	batch := make([]Delivery, 0, size)
	for first := range lane {
		batch = append(batch[:0], first)
		timer.Reset(wait)
	collect:
		for len(batch) < size {
			select {
			case del, ok := <-lane:
				if !ok {
					break collect
				}
				batch = append(batch, del)
			case <-timer.C:
				break collect
			}
		}
		if !timer.Stop() {
			select {
			case <-timer.C:
			default:
			}
		}
		d.r.processBatch(d.ctx, batch)
		for range batch {
			<-d.slots
		}
	}
}

// process settles one delivery: applied and acked, skipped and acked,
// dead-lettered and acked, or requeued.
func (r *Runtime) process(ctx context.Context, del Delivery) {
	defer r.stats.inFlight.Add(-1)
	if it, ok := r.precheck(ctx, del); ok {
		r.apply(ctx, []item{it})
	}
}

// processBatch settles a batch of deliveries.
func (r *Runtime) processBatch(ctx context.Context, dels []Delivery) {
	defer r.stats.inFlight.Add(-int64(len(dels)))
	items := make([]item, 0, len(dels))
	for _, del := range dels {
		if it, ok := r.precheck(ctx, del); ok {
			items = append(items, it)
		}
	}
	r.apply(ctx, items)
}
