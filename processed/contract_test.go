package processed_test

import (
	"context"
	"errors"
	"fmt"
	"net/url"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/consumer/dedup"
	"github.com/idemq/idemq/internal/testdb"
	"github.com/idemq/idemq/processed"
)

// The Store contract suite: what every layout of the dedup table must do,
// run against each of them.

// layouts are the table's layouts, by the Config that asks for each.
var layouts = []struct {
	name string
	cfg  processed.Config
}{
	{"plain", processed.Config{}},
	{"partitioned", processed.Config{Partitioned: true}},
}

// keyedLayout has the shard key in the primary key: the contract suite
// runs it only as a shard (a claim needs a shard key, which a Sharded
// gives it).
var keyedLayout = struct {
	name string
	cfg  processed.Config
}{"keyed", processed.Config{ShardKeyInPrimaryKey: true}}

// contract is one case of the suite, given a migrated store of a layout.
type contract struct {
	name string
	run  func(t *testing.T, s contractStore, pool *pgxpool.Pool, cfg processed.Config)
}

// contractStore is the store a case runs against: a *processed.Store, or a
// shard of a processed.Sharded whose claims go through the Sharded
// (shardUnderTest).
type contractStore interface {
	dedup.Store
	Lookup(ctx context.Context, consumerName, id string) (processed.Row, error)
	Stats(ctx context.Context, consumerName string) (processed.Stats, error)
	Generations(ctx context.Context) ([]processed.Generation, error)
	Maintain(ctx context.Context) error
	Migrate(ctx context.Context) error
	Version(ctx context.Context) (int, error)
	Schema() string
	Table() string
	String() string
	Pool() *pgxpool.Pool
	Close()
}

// shardUnderTest is shard 1 of a two-shard processed.Sharded: every claim
// goes through the Sharded's BeginClaim to it, with route (during a
// reshard, from shard 0, whose dedup table is empty, so that each claim
// also looks its id up there); the rest is the shard's own Store.
type shardUnderTest struct {
	*processed.Store
	sharded *processed.Sharded
	route   dedup.Route
}

func (s shardUnderTest) BeginClaim(ctx context.Context, cs []dedup.Claim) (pgx.Tx, []dedup.ClaimResult, error) {
	routed := append([]dedup.Claim(nil), cs...)
	for i := range routed {
		routed[i].Route = s.route
	}
	return s.sharded.BeginClaim(ctx, routed)
}

// contractKey is the shard key of every claim of the suite: the shard
// under test's route's, and what a case's own store of the keyed layout
// claims with (withKey).
const contractKey = "acct-1"

// keyedStore is a store whose claims carry key, as a Sharded's would.
type keyedStore struct {
	*processed.Store
	key string
}

func (s keyedStore) BeginClaim(ctx context.Context, cs []dedup.Claim) (pgx.Tx, []dedup.ClaimResult, error) {
	keyed := append([]dedup.Claim(nil), cs...)
	for i := range keyed {
		keyed[i].Route.Key = s.key
	}
	return s.Store.BeginClaim(ctx, keyed)
}

// withKey is a case's own store of cfg: with the shard key in the primary
// key, its claims carry contractKey.
func withKey(s *processed.Store, cfg processed.Config) keyedStore {
	if cfg.ShardKeyInPrimaryKey {
		return keyedStore{s, contractKey}
	}
	return keyedStore{s, ""}
}

// shardedSetup makes the store a sharded case runs against: shard 1 of
// cfg's layout, behind a Sharded whose shard 0 is another schema's store;
// resharding configures a reshard from a map of the same two shards.
func shardedSetup(t *testing.T, cfg processed.Config, resharding bool) (contractStore, *pgxpool.Pool) {
	t.Helper()
	other, _ := setup(t, processed.Config{Partitioned: cfg.Partitioned, ShardKeyInPrimaryKey: cfg.ShardKeyInPrimaryKey})
	s, pool := setup(t, cfg)
	sc := processed.ShardedConfig{Map: processed.ShardMap{Shards: 2}}
	route := dedup.Route{Shard: 1, Was: 1, Key: contractKey}
	if resharding {
		sc.Previous = &processed.ShardMap{Name: "before", Shards: 2}
		route.Was = 0
	}
	sh, err := processed.NewSharded([]*processed.Store{other, s}, sc)
	if err != nil {
		t.Fatal(err)
	}
	if err := sh.Migrate(ctx(t)); err != nil {
		t.Fatal(err)
	}
	return shardUnderTest{Store: s, sharded: sh, route: route}, pool
}

func TestStoreContract(t *testing.T) {
	t.Parallel()
	cases := []contract{
		{"NewDuplicateMismatch", contractNewDuplicateMismatch},
		{"RejectsBadClaims", contractRejectsBadClaims},
		{"RolledBackLeavesNoRow", contractRolledBack},
		{"ConcurrentClaimsOfOneID", contractConcurrentClaims},
		{"WaitsForAnUncommittedClaim", contractWaitsForUncommitted},
		{"EveryQueryExecMode", contractExecModes},
		{"RowVanishesBetweenStatements", contractRowVanishes},
		{"ClaimsAcrossBoundaries", contractAcrossBoundaries},
		{"PurgeRacingClaims", contractPurgeRacingClaims},
		{"TwoJanitorsAfterAnOutage", contractTwoJanitors},
		{"RowsDatedAheadOrBehind", contractDatedRows},
		{"TwoConsumersDifferentRetentions", contractTwoConsumers},
		{"OnlyTheRuntimeCommits", contractOnlyRuntimeCommits},
		{"NotMigrated", contractNotMigrated},
	}
	// Each layout alone, and as a shard of a processed.Sharded: claims
	// through its BeginClaim, and during a reshard, when each also looks
	// its id up on the shard it was on before.
	for _, layout := range append(layouts, keyedLayout) {
		for _, sharded := range []string{"", "/shard", "/shard-resharding"} {
			if sharded == "" && layout.cfg.ShardKeyInPrimaryKey {
				continue
			}
			t.Run(layout.name+sharded, func(t *testing.T) {
				t.Parallel()
				for _, c := range cases {
					t.Run(c.name, func(t *testing.T) {
						t.Parallel()
						var (
							s    contractStore
							pool *pgxpool.Pool
						)
						if sharded == "" {
							s, pool = setup(t, layout.cfg)
						} else {
							s, pool = shardedSetup(t, layout.cfg, sharded == "/shard-resharding")
						}
						c.run(t, s, pool, layout.cfg)
					})
				}
			})
		}
	}
}

// gen is the quoted generation table i of a partitioned store.
func gen(s contractStore, i int) string {
	return pgx.Identifier{s.Schema(), fmt.Sprintf("%s_g%d", s.Table(), i)}.Sanitize()
}

// into is where claims insert: the plain table or the current generation.
func into(s contractStore, cfg processed.Config) string {
	if cfg.Partitioned {
		return gen(s, 0)
	}
	return table(s)
}

func contractNewDuplicateMismatch(t *testing.T, s contractStore, _ *pgxpool.Pool, _ processed.Config) {
	c := claimOf("billing", "m-1", "pay 10")
	c.Partition, c.Offset = 3, 42
	if got := claim(t, s, c)[0]; got.Outcome != dedup.ClaimNew || !got.ProcessedAt.IsZero() {
		t.Fatalf("first claim: %+v, want new with zero ProcessedAt", got)
	}
	rec, err := s.Lookup(ctx(t), "billing", "m-1")
	if err != nil {
		t.Fatal(err)
	}
	if dup := claim(t, s, c)[0]; dup.Outcome != dedup.ClaimDuplicate || !dup.ProcessedAt.Equal(rec.ProcessedAt) {
		t.Fatalf("second claim: %+v, want duplicate at %v", dup, rec.ProcessedAt)
	}
	if mis := claim(t, s, claimOf("billing", "m-1", "pay 1000"))[0]; mis.Outcome != dedup.ClaimMismatch || !mis.ProcessedAt.Equal(rec.ProcessedAt) {
		t.Fatalf("different payload: %+v, want mismatch at %v", mis, rec.ProcessedAt)
	}
	if rec2, err := s.Lookup(ctx(t), "billing", "m-1"); err != nil || string(rec2.Fingerprint) != string(c.Fingerprint[:]) {
		t.Fatalf("row after mismatch: %+v, %v; want it unchanged", rec2, err)
	}
	// The consumer is the dedup scope.
	if got := claim(t, s, claimOf("shipping", "m-1", "pay 10"))[0]; got.Outcome != dedup.ClaimNew {
		t.Fatalf("other consumer, same id: %v, want new", got.Outcome)
	}
	// A batch answers each claim.
	res := claim(t, s, claimOf("billing", "m-1", "pay 10"), claimOf("billing", "m-2", "x"), claimOf("billing", "m-3", "x"))
	if res[0].Outcome != dedup.ClaimDuplicate || res[1].Outcome != dedup.ClaimNew || res[2].Outcome != dedup.ClaimNew {
		t.Fatalf("batch: %+v", res)
	}
	res = claim(t, s, claimOf("billing", "m-2", "y"), claimOf("billing", "m-3", "x"), claimOf("billing", "m-4", "x"))
	if res[0].Outcome != dedup.ClaimMismatch || res[1].Outcome != dedup.ClaimDuplicate || res[2].Outcome != dedup.ClaimNew {
		t.Fatalf("batch of a mismatch, a duplicate and a new id: %+v", res)
	}
	// A batch larger than the ones the store scans keeps an index of its
	// ids: each answer is still at its claim's position.
	var big []dedup.Claim
	for i := range 12 {
		big = append(big, claimOf("billing", fmt.Sprintf("big-%d", i), "x"))
	}
	big[5] = claimOf("billing", "m-4", "x")  // applied above
	big[9] = claimOf("billing", "m-3", "zz") // applied with another payload
	res = claim(t, s, big...)
	for i, r := range res {
		want := dedup.ClaimNew
		switch i {
		case 5:
			want = dedup.ClaimDuplicate
		case 9:
			want = dedup.ClaimMismatch
		}
		if r.Outcome != want {
			t.Errorf("batch of 12, claim %d (%s): %v, want %v", i, big[i].MessageID, r.Outcome, want)
		}
	}
}

func contractRejectsBadClaims(t *testing.T, s contractStore, _ *pgxpool.Pool, _ processed.Config) {
	for name, cs := range map[string][]dedup.Claim{
		"none":           nil,
		"no consumer":    {claimOf("", "m", "x")},
		"no id":          {claimOf("c", "", "x")},
		"two consumers":  {claimOf("c", "a", "x"), claimOf("d", "b", "x")},
		"an id repeated": {claimOf("c", "a", "x"), claimOf("c", "a", "x")},
		"an id repeated in a large batch": {claimOf("c", "a", "x"), claimOf("c", "b", "x"), claimOf("c", "c", "x"),
			claimOf("c", "d", "x"), claimOf("c", "e", "x"), claimOf("c", "f", "x"), claimOf("c", "g", "x"),
			claimOf("c", "h", "x"), claimOf("c", "i", "x"), claimOf("c", "b", "x")},
	} {
		tx, _, err := s.BeginClaim(ctx(t), cs)
		if err == nil || tx != nil {
			t.Errorf("%s: BeginClaim = %v, %v; want an error and no transaction", name, tx, err)
		}
		if strings.HasPrefix(name, "an id repeated") && err != nil && !strings.Contains(err.Error(), "appears twice") {
			t.Errorf("%s: BeginClaim: %v, want the repeated id named", name, err)
		}
	}
}

func contractRolledBack(t *testing.T, s contractStore, _ *pgxpool.Pool, _ processed.Config) {
	c := claimOf("billing", "m-rb", "x")
	tx, res, err := s.BeginClaim(ctx(t), []dedup.Claim{c})
	if err != nil || res[0].Outcome != dedup.ClaimNew {
		t.Fatalf("BeginClaim: %+v, %v", res, err)
	}
	if err := tx.Rollback(ctx(t)); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Lookup(ctx(t), "billing", "m-rb"); !errors.Is(err, processed.ErrNotFound) {
		t.Fatalf("Lookup after rollback: %v, want ErrNotFound", err)
	}
	if got := claim(t, s, c)[0]; got.Outcome != dedup.ClaimNew {
		t.Fatalf("claim after rollback: %v, want new", got.Outcome)
	}
}

// contractConcurrentClaims: many transactions claim one id at once, alone
// and in batches; exactly one commits it as new.
func contractConcurrentClaims(t *testing.T, s contractStore, _ *pgxpool.Pool, _ processed.Config) {
	const workers = 12
	for round := range 5 {
		id := fmt.Sprintf("race-%d", round)
		var (
			wg    sync.WaitGroup
			news  atomic.Int32
			start = make(chan struct{})
		)
		for w := range workers {
			wg.Add(1)
			go func() {
				defer wg.Done()
				cs := []dedup.Claim{claimOf("c", id, "x")}
				if w%2 == 1 { // in a batch, with an id of its own
					cs = append(cs, claimOf("c", fmt.Sprintf("%s-%d", id, w), "x"))
				}
				<-start
				tx, res, err := s.BeginClaim(ctx(t), cs)
				if tx != nil {
					defer func() { _ = tx.Rollback(context.Background()) }()
				}
				if err != nil {
					t.Errorf("worker %d: %v", w, err)
					return
				}
				time.Sleep(time.Millisecond)
				if err := tx.Commit(ctx(t)); err != nil {
					t.Errorf("worker %d: commit: %v", w, err)
					return
				}
				if res[0].Outcome == dedup.ClaimNew {
					news.Add(1)
				} else if res[0].Outcome != dedup.ClaimDuplicate {
					t.Errorf("worker %d: %v", w, res[0].Outcome)
				}
			}()
		}
		close(start)
		wg.Wait()
		if n := news.Load(); n != 1 {
			t.Fatalf("round %d: %d transactions committed %s as new, want 1", round, n, id)
		}
	}
}

type claimAnswer struct {
	res dedup.ClaimResult
	err error
}

// waitUntilBlocked polls until the backend pid waits on a lock.
func waitUntilBlocked(t *testing.T, pool *pgxpool.Pool, pid uint32) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		var waiting bool
		err := pool.QueryRow(ctx(t),
			`SELECT coalesce(wait_event_type = 'Lock', false) FROM pg_stat_activity WHERE pid = $1`, int32(pid)).Scan(&waiting)
		if err != nil {
			t.Fatalf("pg_stat_activity: %v", err)
		}
		if waiting {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("backend %d never blocked on a lock", pid)
		}
		time.Sleep(5 * time.Millisecond) // polling interval, not synchronisation
	}
}

// contractWaitsForUncommitted: a claim of an id another transaction has
// claimed but not committed waits for it, then answers duplicate (it
// committed) or new (it rolled back).
func contractWaitsForUncommitted(t *testing.T, s contractStore, pool *pgxpool.Pool, cfg processed.Config) {
	for _, firstCommits := range []bool{true, false} {
		c := claimOf("billing", fmt.Sprintf("m-race-%v", firstCommits), "x")
		txA, res, err := s.BeginClaim(ctx(t), []dedup.Claim{c})
		if err != nil || res[0].Outcome != dedup.ClaimNew {
			t.Fatalf("A: %+v, %v", res, err)
		}
		conn, err := pool.Acquire(ctx(t))
		if err != nil {
			t.Fatal(err)
		}
		cfg.Schema = s.Schema()
		onStore, err := processed.New(conn.Conn(), cfg)
		if err != nil {
			t.Fatal(err)
		}
		onConn := withKey(onStore, cfg)
		answer := make(chan claimAnswer, 1)
		go func() {
			defer conn.Release()
			tx, res, err := onConn.BeginClaim(ctx(t), []dedup.Claim{c})
			if tx != nil {
				defer func() { _ = tx.Rollback(context.Background()) }()
			}
			if err == nil {
				err = tx.Commit(ctx(t))
			}
			if err != nil {
				answer <- claimAnswer{err: err}
				return
			}
			answer <- claimAnswer{res: res[0]}
		}()
		waitUntilBlocked(t, pool, conn.Conn().PgConn().PID())
		if firstCommits {
			err = txA.Commit(ctx(t))
		} else {
			err = txA.Rollback(ctx(t))
		}
		if err != nil {
			t.Fatal(err)
		}
		var a claimAnswer
		select {
		case a = <-answer:
		case <-time.After(10 * time.Second):
			t.Fatal("B still blocked after A finished")
		}
		want := dedup.ClaimDuplicate
		if !firstCommits {
			want = dedup.ClaimNew
		}
		if a.err != nil || a.res.Outcome != want {
			t.Fatalf("first commits %v: B answered %+v, %v; want %v", firstCommits, a.res, a.err, want)
		}
	}
}

// contractExecModes: the claims answer the same whatever the pool's query
// exec mode (the simple protocol is what PgBouncer users run).
func contractExecModes(t *testing.T, s contractStore, _ *pgxpool.Pool, cfg processed.Config) {
	for name, mode := range map[string]pgx.QueryExecMode{
		"cache_statement": pgx.QueryExecModeCacheStatement,
		"cache_describe":  pgx.QueryExecModeCacheDescribe,
		"describe_exec":   pgx.QueryExecModeDescribeExec,
		"exec":            pgx.QueryExecModeExec,
		"simple_protocol": pgx.QueryExecModeSimpleProtocol,
	} {
		pcfg, err := pgxpool.ParseConfig(testdb.URL())
		if err != nil {
			t.Fatal(err)
		}
		pcfg.MaxConns = 2
		pcfg.ConnConfig.DefaultQueryExecMode = mode
		pool, err := pgxpool.NewWithConfig(ctx(t), pcfg)
		if err != nil {
			t.Fatal(err)
		}
		defer pool.Close()
		cfg.Schema = s.Schema()
		st, err := processed.New(pool, cfg)
		if err != nil {
			t.Fatal(err)
		}
		on := withKey(st, cfg)
		for i := range 2 { // twice: cached statements the second time
			c := claimOf("billing", fmt.Sprintf("%s-%d", name, i), "pay 10")
			c.Partition, c.Offset = 2, 7
			if got := claim(t, on, c)[0]; got.Outcome != dedup.ClaimNew {
				t.Fatalf("%s: first claim: %+v", name, got)
			}
			rec, err := on.Lookup(ctx(t), "billing", c.MessageID)
			if err != nil || rec.Partition == nil || *rec.Partition != 2 || rec.Offset == nil || *rec.Offset != 7 || rec.Source != "orders" {
				t.Fatalf("%s: row %+v, %v", name, rec, err)
			}
			res := claim(t, on, c, claimOf("billing", c.MessageID+"-b", "x"))
			if res[0].Outcome != dedup.ClaimDuplicate || !res[0].ProcessedAt.Equal(rec.ProcessedAt) || res[1].Outcome != dedup.ClaimNew {
				t.Fatalf("%s: batch %+v", name, res)
			}
			if got := claim(t, on, claimOf("billing", c.MessageID, "pay 1000"))[0]; got.Outcome != dedup.ClaimMismatch {
				t.Fatalf("%s: other payload: %+v", name, got)
			}
		}
	}
}

// afterBatchDB runs after, once, when the batch that begins a claim's
// transaction has run: between the claim's INSERT and its read of the rows
// the INSERT conflicted with.
type afterBatchDB struct {
	*pgxpool.Pool
	after func()
}

func (d *afterBatchDB) SendBatch(ctx context.Context, b *pgx.Batch) pgx.BatchResults {
	return afterResults{d.Pool.SendBatch(ctx, b), d}
}

type afterResults struct {
	pgx.BatchResults
	d *afterBatchDB
}

func (r afterResults) Close() error {
	err := r.BatchResults.Close()
	if f := r.d.after; f != nil {
		r.d.after = nil
		f()
	}
	return err
}

// contractRowVanishes: the committed row an id's INSERT conflicted with is
// purged before the claim reads it: the claim claims the id afresh.
func contractRowVanishes(t *testing.T, s contractStore, pool *pgxpool.Pool, cfg processed.Config) {
	c := claimOf("billing", "m-v", "x")
	claim(t, s, c)
	db := &afterBatchDB{Pool: pool}
	db.after = func() {
		if _, err := pool.Exec(ctx(t), `DELETE FROM `+into(s, cfg)+` WHERE message_id = 'm-v'`); err != nil {
			t.Error(err)
		}
	}
	cfg.Schema = s.Schema()
	st, err := processed.New(db, cfg)
	if err != nil {
		t.Fatal(err)
	}
	on := withKey(st, cfg)
	if got := claim(t, on, c, claimOf("billing", "m-w", "x")); got[0].Outcome != dedup.ClaimNew || got[1].Outcome != dedup.ClaimNew {
		t.Fatalf("claim of a row purged in between: %+v, want new", got)
	}
	if db.after != nil {
		t.Fatal("the purge did not run")
	}
	if _, err := s.Lookup(ctx(t), "billing", "m-v"); err != nil {
		t.Fatal(err)
	}
}

// contractAcrossBoundaries: claims race the upkeep that moves the table's
// boundaries (on the partitioned layout, the retirement of the oldest
// generation and a rotation; on a plain table, a purge of other rows),
// round after round: every id is new exactly once. Round r's claims are
// of consumer c<r>, and the upkeep purges c<r-2>.
func contractAcrossBoundaries(t *testing.T, s contractStore, _ *pgxpool.Pool, cfg processed.Config) {
	const (
		rounds  = 8
		ids     = 40
		workers = 8
	)
	rotations := 0
	for r := range rounds {
		name := fmt.Sprintf("c%d", r)
		var (
			wg      sync.WaitGroup
			news    [ids]atomic.Int32
			started = make(chan struct{})
		)
		for w := range workers {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for pass := range 3 {
					for i := range ids {
						j := (i + w*5 + pass) % ids
						if w == 0 && pass == 0 && i == ids/4 {
							close(started)
						}
						cs := []dedup.Claim{claimOf(name, fmt.Sprintf("id-%02d", j), "x")}
						if (i+w)%3 == 0 && j+1 < ids {
							cs = append(cs, claimOf(name, fmt.Sprintf("id-%02d", j+1), "x"))
						}
						tx, res, err := s.BeginClaim(ctx(t), cs)
						if tx != nil {
							defer func() { _ = tx.Rollback(context.Background()) }()
						}
						if err == nil {
							err = tx.Commit(ctx(t))
						}
						if err != nil {
							t.Errorf("round %d: %v", r, err)
							return
						}
						for k, c := range cs {
							if res[k].Outcome == dedup.ClaimNew {
								var n int
								fmt.Sscanf(c.MessageID, "id-%d", &n)
								news[n].Add(1)
							}
						}
					}
				}
			}()
		}
		<-started
		before, err := s.Generations(ctx(t))
		if err != nil {
			t.Fatal(err)
		}
		if r >= 2 {
			if _, err := s.Purge(ctx(t), fmt.Sprintf("c%d", r-2), time.Millisecond); err != nil {
				t.Errorf("round %d: purge: %v", r, err)
			}
		} else if _, err := s.Purge(ctx(t), "nobody", time.Millisecond); err != nil {
			t.Errorf("round %d: purge: %v", r, err)
		}
		after, err := s.Generations(ctx(t))
		if err != nil {
			t.Fatal(err)
		}
		if len(before) > 0 && !before[0].BeganAt.Equal(after[0].BeganAt) {
			rotations++
		}
		wg.Wait()
		for i := range ids {
			if n := news[i].Load(); n != 1 {
				t.Fatalf("round %d: id-%02d claimed as new %d times, want 1", r, i, n)
			}
		}
	}
	if cfg.Partitioned && rotations < rounds-1 {
		t.Fatalf("%d rotations in %d rounds: the claims did not race the upkeep", rotations, rounds)
	}
}

// contractPurgeRacingClaims: a consumer's purge (and the upkeep) run in a
// loop while its claims go on: no claim fails.
func contractPurgeRacingClaims(t *testing.T, s contractStore, _ *pgxpool.Pool, _ processed.Config) {
	c, cancel := context.WithTimeout(ctx(t), 1500*time.Millisecond)
	defer cancel()
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		for c.Err() == nil {
			if _, err := s.Purge(c, "p", time.Millisecond); err != nil && c.Err() == nil && !errors.Is(err, processed.ErrPostponed) {
				t.Errorf("purge: %v", err)
			}
			if err := s.Maintain(c); err != nil && c.Err() == nil && !errors.Is(err, processed.ErrPostponed) {
				t.Errorf("maintain: %v", err)
			}
		}
	}()
	var claims atomic.Int64
	for w := range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; c.Err() == nil; i++ {
				id := fmt.Sprintf("id-%d", (i+w)%50)
				tx, _, err := s.BeginClaim(c, []dedup.Claim{claimOf("p", id, "x"), claimOf("p", id+"-b", "x")})
				if err == nil {
					err = tx.Commit(c)
				}
				if tx != nil {
					_ = tx.Rollback(context.Background())
				}
				if err != nil && c.Err() == nil {
					t.Errorf("claim: %v", err)
					return
				}
				claims.Add(1)
			}
		}()
	}
	wg.Wait()
	t.Logf("%d claims beside the purges", claims.Load())
}

// contractDatedRows: a committed row is found whatever its processed_at: a
// clock stepped back (an NTP step, a failover to a standby whose clock is
// behind) leaves rows dated ahead of the present, and one stepped forward
// rows dated behind; so it is after the boundaries moved.
func contractDatedRows(t *testing.T, s contractStore, pool *pgxpool.Pool, cfg processed.Config) {
	dated := map[string]string{"ahead-90m": "90 minutes", "ahead-3d": "3 days", "behind-30d": "-30 days"}
	for id, by := range dated {
		c := claimOf("c", id, "x")
		var key any // NULL, or the key of the claims of a keyed layout
		if cfg.ShardKeyInPrimaryKey {
			key = contractKey
		}
		if _, err := pool.Exec(ctx(t), `INSERT INTO `+into(s, cfg)+` (consumer, message_id, fingerprint, processed_at, shard_key)
VALUES ($1, $2, $3, now() + $4::interval, $5)`, c.Consumer, c.MessageID, c.Fingerprint[:], by, key); err != nil {
			t.Fatal(err)
		}
	}
	check := func(when string) {
		t.Helper()
		for id := range dated {
			for _, batch := range [][]dedup.Claim{{claimOf("c", id, "x")}, {claimOf("c", id, "x"), claimOf("c", id+"-new-"+when, "x")}} {
				tx, res, err := s.BeginClaim(ctx(t), batch)
				if err != nil {
					t.Fatal(err)
				}
				_ = tx.Rollback(ctx(t))
				if res[0].Outcome != dedup.ClaimDuplicate {
					t.Errorf("%s: claim of the row dated %s (batch of %d): %v, want duplicate", when, dated[id], len(batch), res[0].Outcome)
				}
			}
		}
	}
	check("first")
	before, err := s.Generations(ctx(t))
	if err != nil {
		t.Fatal(err)
	}
	// Another consumer's purges move the boundaries; c records no
	// horizon, so it keeps its rows wherever they go.
	for range 3 {
		if _, err := s.Purge(ctx(t), "other", time.Millisecond); err != nil {
			t.Fatal(err)
		}
	}
	after, err := s.Generations(ctx(t))
	if err != nil {
		t.Fatal(err)
	}
	if cfg.Partitioned && after[0].BeganAt.Equal(before[0].BeganAt) {
		t.Fatalf("no rotation: %+v", after)
	}
	check("after the upkeep")
}

// contractTwoConsumers: two consumers share the table, one purging with a
// short retention, one with none: the first's purges never take the
// second's rows. On the partitioned layout the first's rows stay too, held
// by the second, until it purges as well.
func contractTwoConsumers(t *testing.T, s contractStore, _ *pgxpool.Pool, cfg processed.Config) {
	for i := range 5 {
		claim(t, s, claimOf("short", fmt.Sprintf("s-%d", i), "x"), claimOf("short", fmt.Sprintf("s-%d-b", i), "x"))
		claim(t, s, claimOf("keeper", fmt.Sprintf("k-%d", i), "x"))
	}
	rows := func(name string) int64 {
		st, err := s.Stats(ctx(t), name)
		if err != nil {
			t.Fatal(err)
		}
		return st.Rows
	}
	for range 6 {
		time.Sleep(5 * time.Millisecond)
		if _, err := s.Purge(ctx(t), "short", time.Millisecond); err != nil {
			t.Fatal(err)
		}
		if err := s.Maintain(ctx(t)); err != nil {
			t.Fatal(err)
		}
	}
	if n := rows("keeper"); n != 5 {
		t.Fatalf("the keeper has %d rows after the other consumer's purges, want 5", n)
	}
	for i := range 5 {
		if r := claim(t, s, claimOf("keeper", fmt.Sprintf("k-%d", i), "x"))[0]; r.Outcome != dedup.ClaimDuplicate {
			t.Fatalf("keeper's k-%d: %v, want duplicate", i, r.Outcome)
		}
	}
	want := int64(0)
	if cfg.Partitioned {
		want = 10 // held by the keeper, whose rows share their generation
		gens, err := s.Generations(ctx(t))
		if err != nil {
			t.Fatal(err)
		}
		if held := gens[len(gens)-1].HeldBy; len(held) != 1 || held[0] != "keeper" {
			t.Fatalf("the oldest generation is held by %v, want [keeper]: %+v", held, gens)
		}
	}
	if n := rows("short"); n != want {
		t.Fatalf("short has %d rows after its purges, want %d", n, want)
	}
	// The keeper purges too: now both go.
	for range 4 {
		time.Sleep(5 * time.Millisecond)
		if _, err := s.Purge(ctx(t), "keeper", time.Millisecond); err != nil {
			t.Fatal(err)
		}
		if _, err := s.Purge(ctx(t), "short", time.Millisecond); err != nil {
			t.Fatal(err)
		}
	}
	if a, b := rows("short"), rows("keeper"); a != 0 || b != 0 {
		t.Fatalf("after both purged: short %d, keeper %d rows, want none", a, b)
	}
}

// contractOnlyRuntimeCommits: only the commit of the transaction BeginClaim
// began commits its claims: a COMMIT run as SQL in it fails and rolls it
// back, and a transaction begun anew after the claim's ended does not
// commit.
func contractOnlyRuntimeCommits(t *testing.T, s contractStore, pool *pgxpool.Pool, _ processed.Config) {
	if _, err := pool.Exec(ctx(t), `CREATE TABLE `+pgx.Identifier{s.Schema(), "effects"}.Sanitize()+` (id text)`); err != nil {
		t.Fatal(err)
	}
	effect := `INSERT INTO ` + pgx.Identifier{s.Schema(), "effects"}.Sanitize() + ` VALUES ('e')`
	for _, end := range []string{"COMMIT", "END"} {
		tx, _, err := s.BeginClaim(ctx(t), []dedup.Claim{claimOf("c", "sql-"+end, "x")})
		if err != nil {
			t.Fatal(err)
		}
		if _, err := tx.Exec(ctx(t), effect); err != nil {
			t.Fatal(err)
		}
		if _, err := tx.Exec(ctx(t), end); err == nil {
			t.Errorf("%s run as SQL in the claim's transaction succeeded", end)
		}
		_ = tx.Rollback(ctx(t))
		if _, err := s.Lookup(ctx(t), "c", "sql-"+end); !errors.Is(err, processed.ErrNotFound) {
			t.Errorf("after %s: the claim was committed (%v)", end, err)
		}
	}
	tx, _, err := s.BeginClaim(ctx(t), []dedup.Claim{claimOf("c", "restart", "x")})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := tx.Exec(ctx(t), "ROLLBACK; BEGIN; "+effect); err != nil {
		t.Fatal(err)
	}
	var pgErr *pgconn.PgError
	if err := tx.Commit(ctx(t)); !errors.As(err, &pgErr) || !strings.HasPrefix(pgErr.Code, "25") {
		t.Errorf("commit of a transaction begun anew: %v, want an error of class 25", err)
	}
	var n int
	if err := pool.QueryRow(ctx(t), `SELECT count(*) FROM `+pgx.Identifier{s.Schema(), "effects"}.Sanitize()).Scan(&n); err != nil || n != 0 {
		t.Errorf("%d effects committed (%v), want none", n, err)
	}
	// Rows written outside BeginClaim's transactions are not its concern.
	if _, err := pool.Exec(ctx(t), `INSERT INTO `+into(s, processed.Config{Partitioned: strings.Contains(t.Name(), "partitioned")})+
		` (consumer, message_id, fingerprint) VALUES ('c', 'by hand', sha256(''))`); err != nil {
		t.Errorf("a row inserted by hand: %v", err)
	}
}

func contractNotMigrated(t *testing.T, _ contractStore, pool *pgxpool.Pool, cfg processed.Config) {
	cfg.Schema = testdb.Schema(t)
	s, err := processed.New(pool, cfg)
	if err != nil {
		t.Fatal(err)
	}
	for name, f := range map[string]func() error{
		"BeginClaim": func() error { _, _, err := s.BeginClaim(ctx(t), []dedup.Claim{claimOf("a", "1", "x")}); return err },
		"Lookup":     func() error { _, err := s.Lookup(ctx(t), "a", "1"); return err },
		"Purge":      func() error { _, err := s.Purge(ctx(t), "a", time.Hour); return err },
		"Maintain":   func() error { return s.Maintain(ctx(t)) },
	} {
		if err := f(); !errors.Is(err, consumer.ErrNotMigrated) {
			t.Errorf("%s: %v, want ErrNotMigrated", name, err)
		}
	}
	if v, err := s.Version(ctx(t)); err != nil || v != 0 {
		t.Errorf("Version: %d, %v; want 0", v, err)
	}
}

// TestDateStyleAndTimeZone: the store works the same whatever DateStyle and
// TimeZone the session has, set through the connection string as a user
// would: among them zones whose abbreviations read back wrong (CST in
// Asia/Shanghai is US Central's) or not at all (WIB).
func TestDateStyleAndTimeZone(t *testing.T) {
	t.Parallel()
	settings := []struct{ style, zone string }{
		{"SQL, DMY", "Asia/Shanghai"}, {"Postgres, MDY", "Asia/Jakarta"}, {"SQL", "Europe/Dublin"},
		{"German", "America/St_Johns"}, {"ISO", "Pacific/Kiritimati"},
	}
	for _, layout := range layouts {
		for _, set := range settings {
			t.Run(layout.name+"/"+set.style+"/"+set.zone, func(t *testing.T) {
				t.Parallel()
				u, err := url.Parse(testdb.URL())
				if err != nil {
					t.Fatal(err)
				}
				q := u.Query()
				q.Set("options", "-c DateStyle="+strings.ReplaceAll(set.style, " ", `\ `)+" -c TimeZone="+set.zone)
				u.RawQuery = strings.ReplaceAll(q.Encode(), "+", "%20")
				cfg := layout.cfg
				cfg.Schema = testdb.Schema(t)
				s, err := processed.Open(ctx(t), u.String(), cfg)
				if err != nil {
					t.Fatal(err)
				}
				defer s.Close()
				var got string
				if err := s.Pool().QueryRow(ctx(t), "SELECT current_setting('DateStyle') || ' ' || current_setting('TimeZone')").Scan(&got); err != nil ||
					!strings.Contains(got, set.zone) {
					t.Fatalf("session settings %q, %v", got, err)
				}
				if err := s.Migrate(ctx(t)); err != nil {
					t.Fatal(err)
				}
				for round := range 4 {
					id := fmt.Sprintf("id-%d", round)
					claim(t, s, claimOf("c", id, "x"))
					// Another consumer's purges move the boundaries; c,
					// which records no horizon, keeps every row it has.
					if _, err := s.Purge(ctx(t), "other", time.Millisecond); err != nil {
						t.Fatal(err)
					}
					if err := s.Maintain(ctx(t)); err != nil {
						t.Fatal(err)
					}
					for i := 0; i <= round; i++ {
						if r := claim(t, s, claimOf("c", fmt.Sprintf("id-%d", i), "x"))[0]; r.Outcome != dedup.ClaimDuplicate {
							t.Fatalf("round %d: id-%d is %v, want duplicate", round, i, r.Outcome)
						}
					}
				}
				gens, err := s.Generations(ctx(t))
				if err != nil {
					t.Fatal(err)
				}
				for _, g := range gens {
					if !g.BeganAt.IsZero() && time.Since(g.BeganAt).Abs() > time.Minute {
						t.Errorf("generation %s began at %v", g.Table, g.BeganAt)
					}
				}
				rec, err := s.Lookup(ctx(t), "c", "id-0")
				if err != nil || time.Since(rec.ProcessedAt).Abs() > time.Minute {
					t.Fatalf("Lookup: %+v, %v", rec, err)
				}
			})
		}
	}
}

// contractTwoJanitors: after an outage longer than the retention, two
// janitors (two runtimes sharing one table, or one Store) run their upkeep
// and purges at once, beside claims: neither fails, no claim fails, every
// id claimed beside them is new once, and the table is whole after them
// (on the partitioned layout: three generations, no table left halfway
// through a rotation).
func contractTwoJanitors(t *testing.T, s contractStore, pool *pgxpool.Pool, cfg processed.Config) {
	for i := range 20 {
		claim(t, s, claimOf("old", fmt.Sprintf("o-%d", i), "x"))
	}
	// The old rows leave the current generation before the new ones
	// come, so that no other consumer holds theirs.
	if _, err := s.Purge(ctx(t), "old", time.Millisecond); err != nil {
		t.Fatal(err)
	}
	cfg.Schema = s.Schema()
	s2, err := processed.New(pool, cfg)
	if err != nil {
		t.Fatal(err)
	}
	c, cancel := context.WithTimeout(ctx(t), time.Second)
	defer cancel()
	var (
		wg   sync.WaitGroup
		news [60]atomic.Int32
	)
	for _, st := range []contractStore{s, s2} {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for c.Err() == nil {
				if _, err := st.Purge(c, "old", time.Millisecond); err != nil && c.Err() == nil && !errors.Is(err, processed.ErrPostponed) {
					t.Errorf("purge: %v", err)
				}
				if err := st.Maintain(c); err != nil && c.Err() == nil && !errors.Is(err, processed.ErrPostponed) {
					t.Errorf("maintain: %v", err)
				}
			}
		}()
	}
	for w := range 3 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; c.Err() == nil; i++ {
				j := (i*7 + w) % len(news)
				tx, res, err := s.BeginClaim(c, []dedup.Claim{claimOf("new", fmt.Sprintf("n-%d", j), "x")})
				if err == nil {
					err = tx.Commit(c)
				}
				if tx != nil {
					_ = tx.Rollback(context.Background())
				}
				if err != nil {
					if c.Err() == nil {
						t.Errorf("claim: %v", err)
					}
					return
				}
				if res[0].Outcome == dedup.ClaimNew {
					news[j].Add(1)
				}
			}
		}()
	}
	wg.Wait()
	for j := range news {
		if n := news[j].Load(); n > 1 {
			t.Errorf("n-%d claimed as new %d times", j, n)
		}
	}
	if cfg.Partitioned {
		gens, err := s.Generations(ctx(t))
		if err != nil || len(gens) != 3 {
			t.Fatalf("generations after the janitors: %+v, %v", gens, err)
		}
		var spare, retiredEmpty bool
		if err := pool.QueryRow(ctx(t), `SELECT to_regclass($1) IS NOT NULL, NOT EXISTS (SELECT 1 FROM `+gen(s, 3)+`)`,
			pgx.Identifier{s.Schema(), s.Table() + "_gx"}.Sanitize()).Scan(&spare, &retiredEmpty); err != nil || spare || !retiredEmpty {
			t.Fatalf("a table left halfway through a rotation: %v, the retired generation emptied: %v (%v)", spare, retiredEmpty, err)
		}
	}
	if st, err := s.Stats(ctx(t), "old"); err != nil || st.Rows != 0 {
		t.Fatalf("the old consumer's rows after its purges: %+v, %v; want none", st, err)
	}
}
