package processed_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemq/idemq/brokers/memory"
	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/consumer/dedup"
	"github.com/idemq/idemq/dlq"
	"github.com/idemq/idemq/internal/testdb"
	"github.com/idemq/idemq/processed"
)

// shardDB is one shard of a test: a schema of the test database reached
// through a pool whose search_path is that schema, as a database of its own
// would be, with an effects table.
type shardDB struct {
	schema string
	pool   *pgxpool.Pool
	store  *processed.Store
}

func newShardDBs(t *testing.T, n int) []*shardDB {
	t.Helper()
	var out []*shardDB
	for i := 0; i < n; i++ {
		schema := testdb.Schema(t)
		conf, err := pgxpool.ParseConfig(testdb.URL())
		if err != nil {
			t.Fatal(err)
		}
		conf.ConnConfig.RuntimeParams["search_path"] = schema
		conf.MaxConns = 12
		pool, err := pgxpool.NewWithConfig(context.Background(), conf)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(pool.Close)
		st, err := processed.New(pool, processed.Config{Schema: schema})
		if err != nil {
			t.Fatal(err)
		}
		if _, err := pool.Exec(ctx(t), "CREATE TABLE effects (seq bigserial, message_id text, key text, body text)"); err != nil {
			t.Fatal(err)
		}
		out = append(out, &shardDB{schema: schema, pool: pool, store: st})
	}
	return out
}

func stores(dbs []*shardDB) []*processed.Store {
	out := make([]*processed.Store, len(dbs))
	for i, d := range dbs {
		out[i] = d.store
	}
	return out
}

// effects returns, per message id, the shards that applied it (one entry
// per effect row).
func effects(t *testing.T, dbs []*shardDB) map[string][]int {
	t.Helper()
	out := map[string][]int{}
	for i, d := range dbs {
		rows, err := d.pool.Query(ctx(t), "SELECT message_id FROM effects")
		if err != nil {
			t.Fatal(err)
		}
		ids, err := pgx.CollectRows(rows, pgx.RowTo[string])
		if err != nil {
			t.Fatal(err)
		}
		for _, id := range ids {
			out[id] = append(out[id], i)
		}
	}
	return out
}

type deadLetters struct {
	mu sync.Mutex
	f  map[string]consumer.Failure
}

func (d *deadLetters) DeadLetter(_ context.Context, msg *consumer.Message, f consumer.Failure) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.f == nil {
		d.f = map[string]consumer.Failure{}
	}
	d.f[msg.ID+"|"+string(msg.Body)] = f
	return nil
}

func (d *deadLetters) all() map[string]consumer.Failure {
	d.mu.Lock()
	defer d.mu.Unlock()
	out := map[string]consumer.Failure{}
	for k, v := range d.f {
		out[k] = v
	}
	return out
}

// migratedSharded returns a Sharded over shards with cfg, migrated.
func migratedSharded(t *testing.T, shards []*processed.Store, cfg processed.ShardedConfig) *processed.Sharded {
	t.Helper()
	s, err := processed.NewSharded(shards, cfg)
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Migrate(ctx(t)); err != nil {
		t.Fatal(err)
	}
	return s
}

// runSharded consumes what is published on broker's queue through store
// until it is drained and settled, and returns the runtime's error.
func runSharded(t *testing.T, broker *memory.Broker, queue string, store consumer.ShardedStore, dl *deadLetters, batchSize int) (consumer.Stats, error) {
	t.Helper()
	return settle(t, broker, queue, consumer.Config{
		Name:  "ledger",
		Store: store,
		Handler: func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
			return consumer.ExecLater(ctx, tx, "INSERT INTO effects (message_id, key, body) VALUES ($1, $2, $3)", m.ID, m.Key, string(m.Body))
		},
		BatchSize:       batchSize,
		Concurrency:     4,
		DeadLetterer:    dl,
		ShutdownTimeout: 5 * time.Second,
	})
}

// settle runs a runtime of cfg over a new subscription to broker's queue
// until what the queue holds is settled, and returns the runtime's error.
func settle(t *testing.T, broker *memory.Broker, queue string, cfg consumer.Config) (consumer.Stats, error) {
	t.Helper()
	sub, err := broker.Subscribe(queue, memory.SubscribeOptions{})
	if err != nil {
		t.Fatal(err)
	}
	cfg.Source = sub
	rt, err := consumer.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	rctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- rt.Run(rctx) }()
	deadline := time.Now().Add(20 * time.Second)
	for broker.Ready(queue) > 0 || broker.Unacked(queue) > 0 || rt.Stats().InFlight > 0 {
		select {
		case err := <-done:
			cancel()
			return rt.Stats(), err
		default:
		}
		if time.Now().After(deadline) {
			cancel()
			t.Fatalf("not settled in 20s: ready %d, unacked %d, stats %+v", broker.Ready(queue), broker.Unacked(queue), rt.Stats())
		}
		time.Sleep(5 * time.Millisecond)
	}
	cancel()
	return rt.Stats(), <-done
}

func keyed(id, key, body string) *consumer.Message {
	return &consumer.Message{ID: id, Key: key, Body: []byte(body)}
}

// Each message is applied once, on the shard its key maps to, with its
// claim: in grouped, batch and strict mode.
func TestShardedAppliesEachMessageOnceOnItsKeysShard(t *testing.T) {
	t.Parallel()
	for _, bs := range []int{0, 100, 1} {
		t.Run(fmt.Sprintf("BatchSize=%d", bs), func(t *testing.T) {
			t.Parallel()
			dbs := newShardDBs(t, 3)
			s := migratedSharded(t, stores(dbs), processed.ShardedConfig{Map: processed.ShardMap{Shards: 3}})
			broker := memory.NewBroker()
			var all []*consumer.Message
			for i := 0; i < 300; i++ {
				all = append(all, keyed(fmt.Sprintf("m%03d", i), fmt.Sprintf("k%02d", i%40), "x"))
			}
			all = append(all, all[:50]...) // redelivered
			if err := broker.Publish(ctx(t), "q", all...); err != nil {
				t.Fatal(err)
			}
			dl := &deadLetters{}
			st, err := runSharded(t, broker, "q", s, dl, bs)
			if err != nil {
				t.Fatal(err)
			}
			if st.Applied != 300 || st.Duplicates != 50 || st.DeadLettered != 0 {
				t.Fatalf("stats %+v", st)
			}
			eff := effects(t, dbs)
			keyShard := map[string]int{}
			used := map[int]bool{}
			for _, m := range all[:300] {
				at := eff[m.ID]
				if len(at) != 1 {
					t.Fatalf("%s applied on shards %v, want once", m.ID, at)
				}
				want, err := s.Route(m)
				if err != nil || at[0] != want.Shard {
					t.Fatalf("%s applied on shard %d, its route %+v (%v)", m.ID, at[0], want, err)
				}
				if prev, ok := keyShard[m.Key]; ok && prev != at[0] {
					t.Fatalf("key %s on shards %d and %d", m.Key, prev, at[0])
				}
				keyShard[m.Key] = at[0]
				used[at[0]] = true
				// Its claim is beside its effect.
				if _, err := dbs[at[0]].store.Lookup(ctx(t), "ledger", m.ID); err != nil {
					t.Fatalf("%s: no claim on its shard %d: %v", m.ID, at[0], err)
				}
			}
			if len(used) != 3 {
				t.Fatalf("shards used: %v, want all three", used)
			}
			// Lookup finds each id on whichever shard holds it.
			for _, m := range all[:300] {
				if r, err := s.Lookup(ctx(t), "ledger", m.ID); err != nil || r.MessageID != m.ID {
					t.Fatalf("Lookup(%s): %+v, %v", m.ID, r, err)
				}
			}
			if _, err := s.Lookup(ctx(t), "ledger", "never"); !errors.Is(err, processed.ErrNotFound) {
				t.Fatalf("Lookup(never): %v, want ErrNotFound", err)
			}
		})
	}
}

// A message the map cannot route is dead-lettered with the reason, and
// claimed nowhere; the others are applied.
func TestShardedUnroutableIsDeadLettered(t *testing.T) {
	t.Parallel()
	dbs := newShardDBs(t, 2)
	s, err := processed.NewSharded(stores(dbs), processed.ShardedConfig{Map: processed.ShardMap{
		Name: "tenant", Shards: 2,
		Key: func(m *consumer.Message) (string, error) {
			if m.Header("tenant") == "" {
				return "", errors.New("no tenant header")
			}
			return m.Header("tenant"), nil
		},
		Place: func(key string) (int, error) {
			switch key {
			case "acme":
				return 0, nil
			case "globex":
				return 1, nil
			case "chaos":
				panic("a bug in the tenant table")
			}
			return 0, fmt.Errorf("unknown tenant %q", key)
		},
	}})
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Migrate(ctx(t)); err != nil {
		t.Fatal(err)
	}
	broker := memory.NewBroker()
	msg := func(id, tenant string) *consumer.Message {
		m := keyed(id, "", "x")
		if tenant != "" {
			m.Headers = map[string]string{"tenant": tenant}
		}
		return m
	}
	if err := broker.Publish(ctx(t), "q", msg("a1", "acme"), msg("none", ""), msg("g1", "globex"), msg("who", "initech"), msg("a2", "acme"), msg("bug", "chaos")); err != nil {
		t.Fatal(err)
	}
	dl := &deadLetters{}
	st, err := runSharded(t, broker, "q", s, dl, 0)
	if err != nil {
		t.Fatal(err)
	}
	if st.Applied != 3 || st.DeadLettered != 3 {
		t.Fatalf("stats %+v", st)
	}
	eff := effects(t, dbs)
	if fmt.Sprint(eff["a1"], eff["a2"], eff["g1"]) != "[0] [0] [1]" || len(eff) != 3 {
		t.Fatalf("effects %v", eff)
	}
	got := dl.all()
	for key, want := range map[string]string{"none|x": "no tenant header", "who|x": `unknown tenant "initech"`, "bug|x": "Place panicked: a bug in the tenant table"} {
		f, ok := got[key]
		if !ok || f.Class != consumer.ClassUnroutable || !strings.Contains(f.Err.Error(), want) {
			t.Fatalf("dead letter %s: %+v, want class unroutable with %q", key, f, want)
		}
	}
	for i, d := range dbs {
		for _, id := range []string{"none", "who"} {
			if _, err := d.store.Lookup(ctx(t), "ledger", id); !errors.Is(err, processed.ErrNotFound) {
				t.Fatalf("unroutable %s has a claim on shard %d: %v", id, i, err)
			}
		}
	}
}

// A store whose map is not the one the shards record is refused, as a
// configuration error that stops the runtime: another shard count, another
// order of the databases, a shard whose record is gone, and the old map
// once a reshard has begun.
func TestShardedRefusesAnotherMap(t *testing.T) {
	t.Parallel()
	dbs := newShardDBs(t, 3)
	migratedSharded(t, stores(dbs[:2]), processed.ShardedConfig{Map: processed.ShardMap{Shards: 2}}) // records key/2
	if err := dbs[2].store.Migrate(ctx(t)); err != nil {
		t.Fatal(err)
	}
	refused := func(what string, shards []*processed.Store, cfg processed.ShardedConfig, want string) {
		t.Helper()
		s, err := processed.NewSharded(shards, cfg)
		if err != nil {
			t.Fatalf("%s: NewSharded: %v", what, err)
		}
		err = s.Migrate(ctx(t))
		if !errors.Is(err, processed.ErrShardMapChanged) || !errors.Is(err, consumer.ErrInvalidConfig) || !strings.Contains(err.Error(), want) {
			t.Fatalf("%s: Migrate: %v, want ErrShardMapChanged with %q", what, err, want)
		}
	}
	st := stores(dbs)
	refused("three shards", st, processed.ShardedConfig{Map: processed.ShardMap{Shards: 3}}, "set ShardedConfig.Previous to the recorded map")
	refused("swapped", []*processed.Store{st[1], st[0]}, processed.ShardedConfig{Map: processed.ShardMap{Shards: 2}}, "in another order")
	refused("renamed", st[:2], processed.ShardedConfig{Map: processed.ShardMap{Name: "tenant", Shards: 2, Key: func(*consumer.Message) (string, error) { return "t", nil }}}, "a reshard")
	refused("a stranger", []*processed.Store{st[0], st[2]}, processed.ShardedConfig{Map: processed.ShardMap{Shards: 2}}, "was its database replaced")

	// The runtime stops on it, with the error.
	three, err := processed.NewSharded(st, processed.ShardedConfig{Map: processed.ShardMap{Shards: 3}})
	if err != nil {
		t.Fatal(err)
	}
	broker := memory.NewBroker()
	if err := broker.Publish(ctx(t), "q", keyed("m1", "k1", "x")); err != nil {
		t.Fatal(err)
	}
	if _, err := runSharded(t, broker, "q", three, &deadLetters{}, 0); !errors.Is(err, processed.ErrShardMapChanged) {
		t.Fatalf("Run: %v, want ErrShardMapChanged", err)
	}

	// A reshard from 2 to 3 begins; from then on the old map is refused,
	// and the new one without Previous too.
	migratedSharded(t, st, processed.ShardedConfig{Map: processed.ShardMap{Shards: 3}, Previous: &processed.ShardMap{Shards: 2}}) // records the reshard
	refused("the old map", st[:2], processed.ShardedConfig{Map: processed.ShardMap{Shards: 2}}, "records shard 0 of a reshard from key/2 to key/3")
	refused("no Previous", st, processed.ShardedConfig{Map: processed.ShardMap{Shards: 3}}, "keep ShardedConfig.Previous")
}

// Across a reshard from 2 shards to 3, nothing applied before is applied
// again: the messages whose keys moved to the new shard are duplicates
// there, a changed body is a mismatch, and new messages are applied once.
func TestShardedReshardAppliesNothingTwice(t *testing.T) {
	t.Parallel()
	dbs := newShardDBs(t, 3)
	st := stores(dbs)
	before := migratedSharded(t, st[:2], processed.ShardedConfig{Map: processed.ShardMap{Shards: 2}})
	broker := memory.NewBroker()
	var first []*consumer.Message
	for i := 0; i < 200; i++ {
		first = append(first, keyed(fmt.Sprintf("m%03d", i), fmt.Sprintf("k%02d", i%60), "x"))
	}
	if err := broker.Publish(ctx(t), "q", first...); err != nil {
		t.Fatal(err)
	}
	if stats, err := runSharded(t, broker, "q", before, &deadLetters{}, 0); err != nil || stats.Applied != 200 {
		t.Fatalf("before the reshard: %+v, %v", stats, err)
	}

	during := migratedSharded(t, st, processed.ShardedConfig{Map: processed.ShardMap{Shards: 3}, Previous: &processed.ShardMap{Shards: 2}})
	moved := 0
	for _, m := range first {
		r, err := during.Route(m)
		if err != nil {
			t.Fatal(err)
		}
		if r.Shard != r.Was {
			moved++
			if r.Shard != 2 {
				t.Fatalf("%s moved from shard %d to %d: jump hashing moves keys to the new shard only", m.ID, r.Was, r.Shard)
			}
		}
	}
	if moved == 0 || moved == len(first) {
		t.Fatalf("%d of %d messages moved: the test proves little", moved, len(first))
	}
	// Everything again, twice, one with another body, and 100 new ones.
	again := append([]*consumer.Message(nil), first...)
	again = append(again, first...)
	changed := *first[0]
	for _, m := range first {
		if r, _ := during.Route(m); r.Shard != r.Was {
			changed = *m
			break
		}
	}
	changed.Body = []byte("another body")
	again = append(again, &changed)
	for i := 200; i < 300; i++ {
		again = append(again, keyed(fmt.Sprintf("m%03d", i), fmt.Sprintf("k%02d", i%60), "x"))
	}
	if err := broker.Publish(ctx(t), "q", again...); err != nil {
		t.Fatal(err)
	}
	dl := &deadLetters{}
	stats, err := runSharded(t, broker, "q", during, dl, 0)
	if err != nil {
		t.Fatal(err)
	}
	if stats.Applied != 100 || stats.Duplicates != 400 || stats.DeadLettered != 1 {
		t.Fatalf("during the reshard: %+v (%d moved)", stats, moved)
	}
	eff := effects(t, dbs)
	for i := 0; i < 300; i++ {
		id := fmt.Sprintf("m%03d", i)
		if len(eff[id]) != 1 {
			t.Fatalf("%s applied on shards %v, want once", id, eff[id])
		}
	}
	if f, ok := dl.all()[changed.ID+"|another body"]; !ok || f.Class != consumer.ClassFingerprintMismatch {
		t.Fatalf("the changed body: %+v, want a fingerprint mismatch", dl.all())
	}
	t.Logf("%d of 200 messages moved to the new shard; each was a duplicate there", moved)

	// The reshard cannot finish while rows from before it remain.
	if err := during.FinishReshard(ctx(t)); !errors.Is(err, processed.ErrReshardUnfinished) || !strings.Contains(err.Error(), "shard 0 holds") {
		t.Fatalf("FinishReshard with the first 200 rows left: %v", err)
	}
	// The rows of the keys that moved go to the new shard; an unkeyed row
	// (claimed by the shard's store alone) stays until purged.
	claim(t, dbs[0].store, dedup.Claim{Consumer: "ledger", MessageID: "unkeyed", Partition: -1, Offset: -1})
	if _, err := dbs[0].pool.Exec(ctx(t), "UPDATE processed_messages SET processed_at = processed_at - interval '2 days' WHERE message_id = 'unkeyed'"); err != nil {
		t.Fatal(err)
	}
	var movedRows int64
	for from := 0; from < 2; from++ {
		rep, err := during.MoveRows(ctx(t), from, 2, nil)
		if err != nil {
			t.Fatalf("MoveRows %d→2: %v", from, err)
		}
		t.Logf("MoveRows %d→2: %+v", from, rep)
		movedRows += rep.Moved
		if from == 0 && rep.Unkeyed != 1 {
			t.Fatalf("MoveRows %d→2: %+v, want the unkeyed row counted", from, rep)
		}
	}
	// The first 200 rows of the moved keys are now on shard 2, and nowhere
	// else; each id is on one shard.
	rowsOn := func(i int) map[string]bool {
		rows, err := dbs[i].pool.Query(ctx(t), "SELECT message_id FROM processed_messages")
		if err != nil {
			t.Fatal(err)
		}
		ids, err := pgx.CollectRows(rows, pgx.RowTo[string])
		if err != nil {
			t.Fatal(err)
		}
		out := map[string]bool{}
		for _, id := range ids {
			out[id] = true
		}
		return out
	}
	on := []map[string]bool{rowsOn(0), rowsOn(1), rowsOn(2)}
	for _, m := range first {
		r, _ := during.Route(m)
		for i := range on {
			if on[i][m.ID] != (i == r.Shard) {
				t.Fatalf("%s (shard %d, was %d): a row on shard %d is %v", m.ID, r.Shard, r.Was, i, on[i][m.ID])
			}
		}
	}
	if movedRows == 0 {
		t.Fatal("MoveRows moved nothing")
	}
	// Only the unkeyed row holds the reshard now.
	if err := during.FinishReshard(ctx(t)); !errors.Is(err, processed.ErrReshardUnfinished) || !strings.Contains(err.Error(), "0 rows from before it that the map places on another shard (MoveRows moves them) and 1 without a shard key") {
		t.Fatalf("FinishReshard with an unkeyed row left: %v", err)
	}
	if _, err := dbs[0].store.Purge(ctx(t), "ledger", 24*time.Hour); err != nil {
		t.Fatal(err)
	}
	if err := during.FinishReshard(ctx(t)); err != nil {
		t.Fatalf("FinishReshard: %v", err)
	}
	after, err := processed.NewSharded(st, processed.ShardedConfig{Map: processed.ShardMap{Shards: 3}})
	if err != nil {
		t.Fatal(err)
	}
	if err := after.Migrate(ctx(t)); err != nil {
		t.Fatalf("the new map alone, after the reshard: %v", err)
	}
	if err := during.Migrate(ctx(t)); err != nil {
		t.Fatalf("the new map with Previous, after the reshard: %v", err)
	}
	old, err := processed.NewSharded(st[:2], processed.ShardedConfig{Map: processed.ShardMap{Shards: 2}})
	if err != nil {
		t.Fatal(err)
	}
	if err := old.Migrate(ctx(t)); !errors.Is(err, processed.ErrShardMapChanged) {
		t.Fatalf("the old map after the reshard: %v, want ErrShardMapChanged", err)
	}

	// With the new map alone, everything delivered once more is a
	// duplicate: the moved rows answer for the moved keys.
	if err := broker.Publish(ctx(t), "q", first...); err != nil {
		t.Fatal(err)
	}
	if stats, err := runSharded(t, broker, "q", after, &deadLetters{}, 0); err != nil || stats.Applied != 0 || stats.Duplicates != int64(len(first)) {
		t.Fatalf("after the reshard: %+v, %v", stats, err)
	}
	for id, at := range effects(t, dbs) {
		if len(at) != 1 {
			t.Fatalf("%s applied on shards %v", id, at)
		}
	}
}

// Dead letters of a sharded consumer replay through the same path: each
// lands on its key's shard, once, and a second replay skips them all (the
// Sharded's Lookup finds each on its shard).
func TestShardedDeadLetterReplay(t *testing.T) {
	t.Parallel()
	dbs := newShardDBs(t, 2)
	s := migratedSharded(t, stores(dbs), processed.ShardedConfig{Map: processed.ShardMap{Shards: 2}})
	broker := memory.NewBroker()
	var msgs []*consumer.Message
	for i := 0; i < 40; i++ {
		msgs = append(msgs, keyed(fmt.Sprintf("m%02d", i), fmt.Sprintf("k%02d", i), "x"))
	}
	if err := broker.Publish(ctx(t), "q", msgs...); err != nil {
		t.Fatal(err)
	}
	var broken atomic.Bool
	broken.Store(true)
	cfg := func() consumer.Config {
		dsub, err := broker.Subscribe("q", memory.SubscribeOptions{DeadLetter: "q.dlq"})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = dsub.Close() })
		dl := dsub.DeadLetterer()
		return consumer.Config{Name: "ledger", Store: s, DeadLetterer: dl,
			Handler: func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
				if broken.Load() {
					return consumer.Permanent(errors.New("handler bug"))
				}
				_, err := tx.Exec(ctx, "INSERT INTO effects (message_id, key, body) VALUES ($1, $2, $3)", m.ID, m.Key, string(m.Body))
				return err
			}}
	}
	if stats, err := settle(t, broker, "q", cfg()); err != nil || stats.DeadLettered != 40 {
		t.Fatalf("the broken run: %+v, %v", stats, err)
	}
	copies := broker.Messages("q.dlq")

	replay := func() dlq.Result {
		t.Helper()
		n := broker.Ready("q.dlq")
		dsub, err := broker.Subscribe("q.dlq", memory.SubscribeOptions{Prefetch: max(n, 1)})
		if err != nil {
			t.Fatal(err)
		}
		res, err := dlq.Replay(ctx(t), dlq.ReplayConfig{Browser: dlq.SourceBrowser(dsub, n, 200*time.Millisecond), Consumer: cfg()})
		if err != nil {
			t.Fatal(err)
		}
		return res
	}
	broken.Store(false)
	if res := replay(); res.Applied != 40 || res.FailedAgain != 0 {
		t.Fatalf("replay: %+v", res)
	}
	eff := effects(t, dbs)
	for _, m := range msgs {
		r, _ := s.Route(m)
		if at := eff[m.ID]; len(at) != 1 || at[0] != r.Shard {
			t.Fatalf("%s applied on shards %v, its shard is %d", m.ID, at, r.Shard)
		}
	}
	if err := broker.Publish(ctx(t), "q.dlq", copies...); err != nil {
		t.Fatal(err)
	}
	if res := replay(); res.Applied != 0 || res.Skipped != 40 {
		t.Fatalf("second replay: %+v", res)
	}
}

// A message that costs its connection is dead-lettered after
// MaxConnLosses while its shard answers, even with another shard down: the
// runtime asks the message's shard, not every shard, whether the database
// is reachable.
func TestShardedConnectionKillerWithAnotherShardDown(t *testing.T) {
	t.Parallel()
	dbs := newShardDBs(t, 2)
	s := migratedSharded(t, stores(dbs), processed.ShardedConfig{Map: processed.ShardMap{Shards: 2}})
	dbs[1].pool.Close() // shard 1 is down from now on
	var m *consumer.Message
	for i := 0; m == nil; i++ {
		c := keyed("killer", fmt.Sprintf("k%d", i), "x")
		if r, _ := s.Route(c); r.Shard == 0 {
			m = c
		}
	}
	broker := memory.NewBroker()
	if err := broker.Publish(ctx(t), "q", m); err != nil {
		t.Fatal(err)
	}
	dl := &deadLetters{}
	// settle fails the test if the killer is still retrying after 20s.
	stats, err := settle(t, broker, "q", consumer.Config{Name: "ledger", Store: s, DeadLetterer: dl,
		Retry: consumer.RetryConfig{InitialInterval: time.Millisecond, MaxInterval: 10 * time.Millisecond, MaxConnLosses: 2},
		Handler: func(ctx context.Context, tx pgx.Tx, _ *consumer.Message) error {
			_, err := tx.Exec(ctx, "SELECT pg_terminate_backend(pg_backend_pid())")
			return err
		}})
	if err != nil || stats.DeadLettered != 1 {
		t.Fatalf("the connection killer: %+v, %v", stats, err)
	}
	if f := dl.all()["killer|x"]; f.Class != consumer.ClassRetryableExhausted || !strings.Contains(f.Err.Error(), "lost the database connection") {
		t.Fatalf("dead letter: %+v", f)
	}
}

// MoveRows runs while the consumers do: redeliveries of the moved keys'
// messages, racing the copy and the delete, each find the row on one shard
// or the other, and none is applied again.
func TestShardedMoveRowsRacingClaims(t *testing.T) {
	t.Parallel()
	dbs := newShardDBs(t, 3)
	st := stores(dbs)
	before := migratedSharded(t, st[:2], processed.ShardedConfig{Map: processed.ShardMap{Shards: 2}})
	broker := memory.NewBroker()
	var first []*consumer.Message
	for i := 0; i < 600; i++ {
		first = append(first, keyed(fmt.Sprintf("m%03d", i), fmt.Sprintf("k%03d", i), "x"))
	}
	if err := broker.Publish(ctx(t), "q", first...); err != nil {
		t.Fatal(err)
	}
	if stats, err := runSharded(t, broker, "q", before, &deadLetters{}, 0); err != nil || stats.Applied != 600 {
		t.Fatalf("before the reshard: %+v, %v", stats, err)
	}
	during := migratedSharded(t, st, processed.ShardedConfig{Map: processed.ShardMap{Shards: 3}, Previous: &processed.ShardMap{Shards: 2}})
	for range 3 {
		if err := broker.Publish(ctx(t), "q", first...); err != nil {
			t.Fatal(err)
		}
	}
	moved := make(chan error, 1)
	go func() {
		for from := 0; from < 2; from++ {
			if _, err := during.MoveRows(ctx(t), from, 2, nil); err != nil {
				moved <- err
				return
			}
		}
		moved <- nil
	}()
	stats, err := runSharded(t, broker, "q", during, &deadLetters{}, 0)
	if merr := <-moved; merr != nil {
		t.Fatalf("MoveRows: %v", merr)
	}
	if err != nil || stats.Applied != 0 || stats.Duplicates != 3*600 {
		t.Fatalf("during the move: %+v, %v", stats, err)
	}
	for id, at := range effects(t, dbs) {
		if len(at) != 1 {
			t.Fatalf("%s applied on shards %v", id, at)
		}
	}
	if err := during.FinishReshard(ctx(t)); err != nil {
		t.Fatalf("FinishReshard after the move: %v", err)
	}
}
