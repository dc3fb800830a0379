package consumer_test

import (
	"context"
	"errors"
	"fmt"
	"hash/fnv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/idemq/idemq/consumer"
)

// defaultGroupSize is consumer.Config's default BatchSize with a Handler.
const defaultGroupSize = 32

// The tests of this file run the default configuration: a per-message
// Handler, grouped (BatchSize 32 by default, BatchWait 0).

// groupSizes records the size of every transaction that committed a group.
type groupSizes struct {
	consumer.HookDefaults
	mu    sync.Mutex
	sizes []int
}

func (g *groupSizes) OnBatch(_ context.Context, size, _ int, _ time.Duration) {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.sizes = append(g.sizes, size)
}

func (g *groupSizes) list() []int {
	g.mu.Lock()
	defer g.mu.Unlock()
	return append([]int(nil), g.sizes...)
}

func TestGroupedDefaultGroupsWhatIsWaiting(t *testing.T) {
	t.Parallel()
	b := newBundle(t)
	const total = 300
	b.publish(msgs("m", total)...)
	b.publish(msgs("m", 30)...) // redelivered duplicates
	gs := &groupSizes{}
	cfg := b.config(b.insertEffect)
	cfg.Hooks = []consumer.Hook{gs}
	r := start(t, cfg)
	waitFor(t, "settled", func() bool { return b.settled() && r.rt.Stats().InFlight == 0 && r.rt.Stats().Received == total+30 })
	assertOnce(t, b, total)
	if s := r.rt.Stats(); s.Applied != total || s.Duplicates != 30 {
		t.Fatalf("stats %+v", s)
	}
	sizes, in := gs.list(), 0
	largest := 0
	for _, n := range sizes {
		in += n
		largest = max(largest, n)
		if n > defaultGroupSize {
			t.Fatalf("a group of %d, over the default BatchSize %d", n, defaultGroupSize)
		}
	}
	// 330 preloaded deliveries: most of them shared a commit.
	if largest < 2 || in < total/2 {
		t.Fatalf("group sizes %v: the preloaded backlog was not grouped", sizes)
	}
}

func TestGroupedDefaultLoneDeliveryIsAppliedAlone(t *testing.T) {
	t.Parallel()
	b := newBundle(t)
	gs := &groupSizes{}
	cfg := b.config(b.insertEffect)
	cfg.Hooks = []consumer.Hook{gs}
	cfg.BatchWait = 0
	r := start(t, cfg)
	// One at a time, each published once the one before is settled:
	// nothing is waiting, so each transaction holds one message and no
	// lane waits for company.
	for i := 0; i < 5; i++ {
		b.publish(msg(fmt.Sprintf("lone-%d", i), "x"))
		waitFor(t, "applied", func() bool { return r.rt.Stats().Applied == int64(i+1) && b.settled() })
	}
	if sizes := gs.list(); len(sizes) != 0 {
		t.Fatalf("group sizes %v: lone deliveries were grouped", sizes)
	}
	assertOnce(t, b, 5)
}

func TestGroupedPoisonSinksOnlyItselfAndAttemptsCarryOver(t *testing.T) {
	t.Parallel()
	b := newBundle(t)
	var poisonCalls atomic.Int32
	var mu sync.Mutex
	seen := map[string][]int{} // attempts each transient message's handler saw
	all := msgs("m", 40)
	all[7] = msg("poison", "bad")
	all[20] = msg("flaky", "x")
	b.publish(all...)
	cfg := b.config(func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
		if err := b.insertEffect(ctx, tx, m); err != nil {
			return err
		}
		switch m.ID {
		case "poison":
			poisonCalls.Add(1)
			return consumer.Permanent(errors.New("unknown account"))
		case "flaky":
			mu.Lock()
			seen[m.ID] = append(seen[m.ID], m.Attempt)
			n := len(seen[m.ID])
			mu.Unlock()
			if n < 3 {
				return errors.New("downstream blip")
			}
		}
		return nil
	})
	r := start(t, cfg)
	waitFor(t, "settled", func() bool { return b.settled() && r.rt.Stats().InFlight == 0 && r.rt.Stats().Received == 40 })
	s := r.rt.Stats()
	if s.Applied != 39 || s.DeadLettered != 1 || s.Retries != 2 {
		t.Fatalf("stats %+v: want 39 applied, 1 dead-lettered, 2 retries (flaky's)", s)
	}
	if n := poisonCalls.Load(); n != 1 {
		t.Fatalf("the permanent failure's handler ran %d times: its failure in the group must count, not be run again alone", n)
	}
	mu.Lock()
	defer mu.Unlock()
	if got := fmt.Sprint(seen["flaky"]); got != "[1 2 3]" {
		t.Fatalf("flaky's handler saw attempts %s, want [1 2 3]: the attempt that failed in the group counts", got)
	}
	got := b.effectCounts()
	if got["poison"] != 0 || len(got) != 39 {
		t.Fatalf("effects %v", got)
	}
	for id, n := range got {
		if n != 1 {
			t.Errorf("%s applied %d times", id, n)
		}
	}
	if dl := b.dlq.list(); len(dl) != 1 || dl[0].msg.ID != "poison" || dl[0].f.Class != consumer.ClassPermanent || dl[0].f.Attempts != 1 {
		t.Fatalf("dead letters %+v", dl)
	}
}

func TestGroupedHandlerTimeoutIsPerMessage(t *testing.T) {
	t.Parallel()
	b := newBundle(t)
	all := msgs("m", 10)
	all[4] = msg("slow", "x")
	b.publish(all...)
	cfg := b.config(func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
		if m.ID == "slow" {
			select {
			case <-ctx.Done():
				return ctx.Err()
			case <-time.After(5 * time.Second):
			}
		}
		return b.insertEffect(ctx, tx, m)
	})
	// 10 messages of which 9 are fast: the group's time is no budget.
	cfg.HandlerTimeout = 300 * time.Millisecond
	cfg.Retry.MaxAttempts = 1
	r := start(t, cfg)
	waitFor(t, "settled", func() bool { return b.settled() && r.rt.Stats().InFlight == 0 && r.rt.Stats().Received == 10 })
	if s := r.rt.Stats(); s.Applied != 9 || s.DeadLettered != 1 {
		t.Fatalf("stats %+v", s)
	}
	if dl := b.dlq.list(); dl[0].msg.ID != "slow" || dl[0].f.Class != consumer.ClassTimeout {
		t.Fatalf("dead letter %s %s", dl[0].msg.ID, dl[0].f.Class)
	}
	assertOnce(t, b, 9)
}

// laneKeys returns two keys that hash to different lanes out of n, as the
// runtime's dispatcher assigns them.
func laneKeys(n int) (string, string) {
	lane := func(k string) uint64 {
		h := fnv.New64a()
		_, _ = h.Write([]byte(k))
		return h.Sum64() % uint64(n)
	}
	for i := 1; ; i++ {
		k := fmt.Sprintf("key-%d", i)
		if lane(k) != lane("key-0") {
			return "key-0", k
		}
	}
}

func TestGroupedDeadlockIsRetriedWhole(t *testing.T) {
	t.Parallel()
	b := newBundle(t)
	ctx := context.Background()
	rows := b.effects[:len(b.effects)-len(`"effects"`)] + `"rows"`
	if _, err := b.pool.Exec(ctx, "CREATE TABLE "+rows+" (id text PRIMARY KEY, n int NOT NULL); INSERT INTO "+rows+" VALUES ('A', 0), ('B', 0)"); err != nil {
		t.Fatal(err)
	}
	k1, k2 := laneKeys(2)
	// Two groups, one per lane: the first updates A then B, the second
	// B then A, each pausing after its first update so that they cross.
	mk := func(id, key, row string) *consumer.Message {
		return &consumer.Message{ID: id, Key: key, Body: []byte(row)}
	}
	b.publish(mk("g1-a", k1, "A"), mk("g1-b", k1, "B"), mk("g2-b", k2, "B"), mk("g2-a", k2, "A"))
	var deadlocks atomic.Int32
	var mu sync.Mutex
	attempts := map[string][]int{}
	var crossed sync.WaitGroup
	crossed.Add(2)
	crossedAll := make(chan struct{})
	go func() { crossed.Wait(); close(crossedAll) }()
	gs := &groupSizes{}
	cfg := b.config(func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
		mu.Lock()
		attempts[m.ID] = append(attempts[m.ID], m.Attempt)
		first := len(attempts[m.ID]) == 1
		mu.Unlock()
		if _, err := tx.Exec(ctx, "UPDATE "+rows+" SET n = n + 1 WHERE id = $1", string(m.Body)); err != nil {
			var pgErr *pgconn.PgError
			if errors.As(err, &pgErr) && pgErr.Code == "40P01" {
				deadlocks.Add(1)
			}
			return err
		}
		if first && (m.ID == "g1-a" || m.ID == "g2-b") {
			// Each group waits, bounded, until the other holds its
			// first row, so that their second updates cross whatever
			// the machine's load.
			crossed.Done()
			select {
			case <-crossedAll:
			case <-time.After(5 * time.Second):
			}
		}
		return b.insertEffect(ctx, tx, m)
	})
	cfg.Concurrency = 2
	// Each lane waits for its second message, so that the groups are the
	// two above whatever the machine's load (grouped mode would take
	// only what had arrived when the lane woke up); the retry of a
	// conflicting group is the same engine in both modes.
	cfg.BatchSize, cfg.BatchWait = 2, 2*time.Second
	cfg.Hooks = []consumer.Hook{gs}
	r := start(t, cfg)
	waitFor(t, "settled", func() bool { return b.settled() && r.rt.Stats().InFlight == 0 && r.rt.Stats().Applied == 4 })
	if deadlocks.Load() == 0 {
		t.Fatal("no deadlock happened: the test did not exercise it")
	}
	s := r.rt.Stats()
	if s.DeadLettered != 0 || s.Applied != 4 {
		t.Fatalf("stats %+v", s)
	}
	// Retried whole: each group committed as one, and no message had an
	// attempt counted against it.
	if sizes := gs.list(); fmt.Sprint(sizes) != "[2 2]" {
		t.Fatalf("committed group sizes %v, want [2 2]: the deadlocked group was split", sizes)
	}
	mu.Lock()
	defer mu.Unlock()
	for id, as := range attempts {
		for _, a := range as {
			if a != 1 {
				t.Fatalf("%s saw attempts %v: a deadlock was blamed on a message", id, as)
			}
		}
	}
	var a, bn int
	if err := b.pool.QueryRow(ctx, "SELECT (SELECT n FROM "+rows+" WHERE id = 'A'), (SELECT n FROM "+rows+" WHERE id = 'B')").Scan(&a, &bn); err != nil {
		t.Fatal(err)
	}
	if a != 2 || bn != 2 {
		t.Fatalf("rows A=%d B=%d, want 2 and 2", a, bn)
	}
	assertOnce(t, b, 4)
}

func TestGroupedHardStopLosesNothingAcksNothingUncommitted(t *testing.T) {
	t.Parallel()
	b := newBundle(t)
	const total = 60
	b.publish(msgs("m", total)...)
	var stuck atomic.Int32
	cfg := b.config(func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
		if err := b.insertEffect(ctx, tx, m); err != nil {
			return err
		}
		if m.ID == "m-45" {
			stuck.Add(1)
			<-ctx.Done() // until the shutdown timeout cancels it
			return ctx.Err()
		}
		return nil
	})
	cfg.Concurrency = 2
	cfg.ShutdownTimeout = 100 * time.Millisecond
	r := start(t, cfg)
	waitFor(t, "a handler stuck", func() bool { return stuck.Load() > 0 })
	r.stop(t)
	s := r.rt.Stats()
	applied := len(b.effectCounts())
	if s.DeadLettered != 0 || int64(applied) != s.Applied {
		t.Fatalf("stats %+v, %d effects: every effect committed is counted, nothing dead-lettered", s, applied)
	}
	// Nothing uncommitted was acked: the rest is back in the queue.
	if b.broker.Unacked(queue) != 0 || b.broker.Ready(queue) != total-applied {
		t.Fatalf("ready %d unacked %d after a hard stop with %d applied", b.broker.Ready(queue), b.broker.Unacked(queue), applied)
	}
	second := start(t, b.config(b.insertEffect))
	waitFor(t, "rest applied", func() bool { return b.settled() && len(b.effectCounts()) == total })
	_ = second
	assertOnce(t, b, total)
}

func TestGroupedAmbiguousCommitNotAckedThenSettledByDedup(t *testing.T) {
	t.Parallel()
	b := newBundle(t)
	b.publish(msgs("m", 20)...)
	cfg := b.config(b.insertEffect)
	db := &lyingStore{Store: b.store}
	db.lies.Store(2)
	cfg.Store = db
	r := start(t, cfg)
	waitFor(t, "settled", func() bool { return b.settled() && r.rt.Stats().InFlight == 0 && r.rt.Stats().Received == 20 })
	s := r.rt.Stats()
	// Each lie is one group's commit (how many groups form depends on
	// timing): its messages were committed but not acked, and come back as
	// duplicates.
	if s.Applied+s.Duplicates != 20 || s.Duplicates == 0 || s.DBErrors < 1 || s.DBErrors > 2 || s.DeadLettered != 0 {
		t.Fatalf("stats %+v: the groups whose commit was ambiguous are re-claimed as duplicates", s)
	}
	assertOnce(t, b, 20)
}

// TestGroupedHotRowsShrinkGroups: handlers that update a few hot rows in
// delivery order make concurrent groups deadlock (each costing Postgres's
// deadlock_timeout, 1s by default). A lane whose group hit a conflict
// shrinks its groups, so the deadlocks stop instead of recurring with every
// group: the backlog is applied exactly once with a handful of them. (With
// deadlock_timeout at 10ms, 2,000 messages saw 4-8 deadlocks here, and
// 27-39 when lanes did not shrink.)
func TestGroupedHotRowsShrinkGroups(t *testing.T) {
	t.Parallel()
	b := newBundle(t)
	ctx := context.Background()
	rows := b.effects[:len(b.effects)-len(`"effects"`)] + `"hot"`
	if _, err := b.pool.Exec(ctx, "CREATE TABLE "+rows+" (id int PRIMARY KEY, n int NOT NULL); INSERT INTO "+rows+" SELECT i, 0 FROM generate_series(0, 4) i"); err != nil {
		t.Fatal(err)
	}
	const total = 2000
	all := make([]*consumer.Message, total)
	for i := range all {
		all[i] = msg(fmt.Sprintf("m-%d", i), fmt.Sprint((i*7+i/5)%5))
	}
	b.publish(all...)
	var deadlocks atomic.Int32
	cfg := b.config(func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
		// Postgres finds a deadlock after deadlock_timeout (1s by
		// default), which would bound the count by time alone: at 10ms,
		// groups that kept colliding would deadlock dozens of times.
		if _, err := tx.Exec(ctx, "SET LOCAL deadlock_timeout = '10ms'"); err != nil {
			return err
		}
		if _, err := tx.Exec(ctx, "UPDATE "+rows+" SET n = n + 1 WHERE id = $1", string(m.Body)); err != nil {
			var pgErr *pgconn.PgError
			if errors.As(err, &pgErr) && pgErr.Code == "40P01" {
				deadlocks.Add(1)
			}
			return err
		}
		return b.insertEffect(ctx, tx, m)
	})
	cfg.Concurrency = 4
	r := start(t, cfg)
	waitFor(t, "applied", func() bool { return r.rt.Stats().Applied == total && b.settled() })
	assertOnce(t, b, total)
	var sum int
	if err := b.pool.QueryRow(ctx, "SELECT sum(n) FROM "+rows).Scan(&sum); err != nil || sum != total {
		t.Fatalf("hot rows sum %d (%v), want %d", sum, err, total)
	}
	if n := deadlocks.Load(); n > 16 {
		t.Fatalf("%d deadlocks for %d messages: groups kept colliding instead of shrinking", n, total)
	}
	t.Logf("%d deadlocks; stats %+v", deadlocks.Load(), r.rt.Stats())
}
