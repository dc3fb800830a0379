package consumer

import (
	"context"
	"hash/fnv"
	"sync"
	"time"
)

// dispatcher runs strict per-message mode: Concurrency workers, long-lived
// so that their stacks, grown deep by the database driver, are grown once,
// take deliveries one at a time, one at a time per key. Each delivery holds
// a slot from receipt to settlement, which bounds the number in memory to
// twice Concurrency: one being applied and one staged per worker, so that a
// worker that settles a delivery takes the next one at once instead of
// waiting for the receive loop to fetch it (a hand-off between goroutines
// on every message's path). A key's next delivery starts only once the one
// before it is settled (acked, dead-lettered, or requeued at shutdown), so
// retries and dead-lettering never reorder a key.
type dispatcher struct {
	r     *Runtime
	ctx   context.Context
	slots chan struct{}
	ready chan Delivery // deliveries whose key is free
	wg    sync.WaitGroup
	mu    sync.Mutex
	keys  map[string][]Delivery // busy keys and the deliveries waiting on them
}

// stagedPerWorker is how many deliveries strict mode holds per worker:
// the one being applied and the next.
const stagedPerWorker = 2

func newDispatcher(r *Runtime, ctx context.Context) *dispatcher {
	n := r.cfg.Concurrency * r.shards
	d := &dispatcher{r: r, ctx: ctx, slots: make(chan struct{}, stagedPerWorker*n), ready: make(chan Delivery, stagedPerWorker*n), keys: map[string][]Delivery{}}
	for range n {
		d.wg.Add(1)
		go func() {
			defer d.wg.Done()
			d.work()
		}()
	}
	return d
}

func (d *dispatcher) dispatch(_ context.Context, del Delivery) bool {
	if key := del.Message().Key; key != "" {
		d.mu.Lock()
		if waiting, busy := d.keys[key]; busy {
			d.keys[key] = append(waiting, del)
			d.mu.Unlock()
			return true
		}
		d.keys[key] = nil
		d.mu.Unlock()
	}
	// Never blocks: each delivery holds one of the slots, and ready holds
	// as many.
	d.ready <- del
	return true
}

// work settles ready deliveries, and after each the ones waiting on its key.
func (d *dispatcher) work() {
	for del := range d.ready {
		key := del.Message().Key
		for del != nil {
			d.r.process(d.ctx, del)
			<-d.slots
			del = d.next(key)
		}
	}
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

// close ends the workers once every delivery dispatched is settled.
func (d *dispatcher) close() {
	close(d.ready)
	d.wg.Wait()
}

// batchDispatcher runs grouped and batch mode over Concurrency lanes. A
// delivery with a Key always goes to the lane its key hashes to, so that a
// key's messages stay in one lane, in order. Each lane takes a first
// delivery, then collects more, up to the batch size, and applies them in
// one transaction.
//
// Deliveries without a key go to a queue the lanes share. In grouped mode
// (BatchWait 0) a lane collects only the deliveries already waiting, so a
// group forms only when deliveries arrive faster than the lanes commit
// them, and a lone delivery never waits; every idle lane takes from the
// shared queue, so one picks a delivery up at once. In batch mode a lane
// collects for up to BatchWait, and one lane at a time takes from the
// shared queue (it holds the collector token while it collects), so that a
// batch holds consecutive deliveries, which a broker can ack in one call;
// when the batch closes, full or at BatchWait, the lane passes the token on
// and the next idle lane collects the deliveries that follow, while the
// first commits. A partly filled batch never holds the next deliveries
// behind its transaction.
type batchDispatcher struct {
	r         *Runtime
	ctx       context.Context
	slots     chan struct{}
	shared    chan Delivery // the deliveries without a key
	collector chan struct{} // batch mode: held by the lane taking from shared
	lanes     []chan Delivery
	wg        sync.WaitGroup
}

// batchSlots is how many deliveries a batchDispatcher holds: room for two
// batches per lane, one filling while one commits.
func batchSlots(r *Runtime) int { return 2 * r.cfg.Concurrency * r.batchSize }

// newBatchDispatcher starts Concurrency lanes. Each delivery dispatched to
// them holds one of slots, which the receive loop fills, until it is
// settled. With a sharded store every shard has a dispatcher of its own,
// and they share slots: a shard whose lanes are held (a slow key, its
// database down) can fill its own channels, and dispatch then waits (see
// dispatch).
func newBatchDispatcher(r *Runtime, ctx context.Context, slots chan struct{}) *batchDispatcher {
	n := batchSlots(r)
	d := &batchDispatcher{r: r, ctx: ctx, slots: slots, shared: make(chan Delivery, n), collector: make(chan struct{}, 1)}
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

// dispatch hands del to its lane, or to the shared queue when it has no
// key. It waits while that channel is full, which only a sharded store's
// busy shard makes happen, until ctx (the receive loop's) is done, and
// then reports false: del was not handed over.
func (d *batchDispatcher) dispatch(ctx context.Context, del Delivery) bool {
	ch := d.shared
	if key := del.Message().Key; key != "" {
		h := fnv.New64a()
		_, _ = h.Write([]byte(key))
		ch = d.lanes[h.Sum64()%uint64(len(d.lanes))]
	}
	select {
	case ch <- del:
		return true
	default:
	}
	select {
	case ch <- del:
		return true
	case <-ctx.Done():
		return false
	}
}

// close ends the lanes once they have handled what they hold.
func (d *batchDispatcher) close() {
	close(d.shared)
	for _, l := range d.lanes {
		close(l)
	}
}

// A lane whose transactions conflicted doubles its group bound after
// minGrowAfter groups without a conflict, twice as many after each
// conflict, up to maxGrowAfter (see runLane).
const (
	minGrowAfter = 32
	maxGrowAfter = 1 << 14
)

// runLane applies the deliveries of its own channel and of the shared one
// until both are closed and drained.
func (d *batchDispatcher) runLane(own chan Delivery) {
	size, wait := d.r.batchSize, d.r.cfg.BatchWait
	shared := d.shared
	var timer *time.Timer
	if wait > 0 {
		timer = time.NewTimer(wait)
		defer timer.Stop()
	}
	batch := make([]Delivery, 0, size)
	// take receives from own, or from shared too if withShared; block
	// says whether to wait for one. A closed channel is set to nil, so
	// that it is no longer selected.
	take := func(block, withShared bool, timeout <-chan time.Time) (Delivery, bool) {
		for own != nil || withShared && shared != nil {
			var (
				del Delivery
				ok  bool
				sh  chan Delivery
			)
			if withShared {
				sh = shared
			}
			if block {
				select {
				case del, ok = <-own:
					if !ok {
						own = nil
						continue
					}
				case del, ok = <-sh:
					if !ok {
						shared = nil
						continue
					}
				case <-timeout:
					return nil, false
				}
			} else {
				select {
				case del, ok = <-own:
					if !ok {
						own = nil
						continue
					}
				case del, ok = <-sh:
					if !ok {
						shared = nil
						continue
					}
				default:
					return nil, false
				}
			}
			return del, true
		}
		return nil, false
	}
	// first waits for a batch's first delivery. In batch mode the lane
	// takes from shared only once it holds the collector token, which it
	// keeps until the batch closes (collecting reports whether it does).
	first := func() (del Delivery, ok, collecting bool) {
		for wait > 0 && shared != nil {
			select {
			case del, ok := <-own:
				if !ok {
					own = nil
					continue
				}
				return del, true, false
			case d.collector <- struct{}{}:
				del, ok := take(true, true, nil)
				if !ok {
					<-d.collector
				}
				return del, ok, ok
			}
		}
		del, ok = take(true, wait <= 0, nil)
		return del, ok, false
	}
	// limit is this lane's group bound. Handlers that update the same rows
	// in different orders make concurrent groups deadlock, and each
	// deadlock costs Postgres's deadlock_timeout (1s by default): so when
	// a transaction of the runtime ends in a deadlock or serialization
	// failure, the lane drops to one message per transaction, and doubles
	// its bound again, up to size, after grow groups without one. Each
	// conflict doubles grow, so under lasting contention the lanes stay
	// near one message per transaction, and without contention they group
	// fully.
	limit, clean, grow := size, 0, minGrowAfter
	for {
		del, ok, collecting := first()
		if !ok {
			return
		}
		batch = append(batch[:0], del)
		var timeout <-chan time.Time
		if timer != nil {
			timer.Reset(wait)
			timeout = timer.C
		}
		for len(batch) < limit {
			del, ok := take(timer != nil, collecting || wait <= 0, timeout)
			if !ok {
				break
			}
			batch = append(batch, del)
		}
		if collecting {
			<-d.collector // the next idle lane collects what follows
		}
		if timer != nil && !timer.Stop() {
			select {
			case <-timer.C:
			default:
			}
		}
		before := d.r.conflicts.Load()
		d.r.processBatch(d.ctx, batch)
		for range batch {
			<-d.slots
		}
		switch {
		case d.r.conflicts.Load() != before:
			limit, clean, grow = 1, 0, min(2*grow, maxGrowAfter)
		case limit < size:
			if clean++; clean >= grow {
				limit, clean = min(2*limit, size), 0
			}
		}
	}
}

// process settles one delivery: applied and acked, skipped and acked,
// dead-lettered and acked, or requeued.
func (r *Runtime) process(ctx context.Context, del Delivery) {
	defer r.stats.inFlight.Add(-1)
	it, fail := r.precheck(ctx, del)
	if fail != nil {
		fail()
		return
	}
	r.apply(ctx, []item{it})
}

// processBatch settles a batch of deliveries. One that fails its input
// checks is settled after the ones before it, which are applied first (in
// a group of their own), so that a key's messages are settled in order.
func (r *Runtime) processBatch(ctx context.Context, dels []Delivery) {
	defer r.stats.inFlight.Add(-int64(len(dels)))
	items := make([]item, 0, len(dels))
	for _, del := range dels {
		it, fail := r.precheck(ctx, del)
		if fail == nil {
			items = append(items, it)
			continue
		}
		r.apply(ctx, items)
		items = make([]item, 0, len(dels))
		if r.stopping(ctx) {
			// The ones before it were requeued if they were not settled:
			// so is it, that the key keeps its order.
			r.requeue(del, r.log)
			continue
		}
		fail()
	}
	r.apply(ctx, items)
}
