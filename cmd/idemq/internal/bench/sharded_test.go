package bench

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemq/idemq/internal/testdb"
)

// existingDatabases returns which of names exist on the test server.
func existingDatabases(t *testing.T, names []string) []string {
	t.Helper()
	var out []string
	err := testdb.Pool(t).QueryRow(context.Background(),
		`SELECT coalesce(array_agg(datname ORDER BY datname), '{}') FROM pg_database WHERE datname = ANY($1)`, names).Scan(&out)
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// TestShardedMemory runs two runtime modes over two shard databases: each
// verifies (every id once over both ledgers), both shards got ledger rows,
// and the databases are gone after the run.
func TestShardedMemory(t *testing.T) {
	cfg := smallConfig(BrokerMemory)
	cfg.Messages = 2000
	cfg.Shards = 2
	cfg.Modes = []Mode{ModeDefault, ModeBatchSet}
	var dbs []string
	cfg.shardsReady = func(names []string) {
		dbs = names
		if got := existingDatabases(t, names); len(got) != 2 {
			t.Errorf("shard databases %v, of which %v exist", names, got)
		}
	}
	rs, err := run(t, cfg)
	if err != nil {
		t.Fatalf("Run: %v", err)
	}
	if len(dbs) != 2 || !strings.HasPrefix(dbs[0], "idemq_bench_") || !strings.HasSuffix(dbs[1], "_1") {
		t.Fatalf("shard databases %v", dbs)
	}
	if left := existingDatabases(t, dbs); len(left) != 0 {
		t.Fatalf("shard databases left after the run: %v", left)
	}
	w := newWorkload(cfg.Messages, DefaultDupRate, 1)
	if len(rs) != len(cfg.Modes) {
		t.Fatalf("got %d results, want %d", len(rs), len(cfg.Modes))
	}
	for i, r := range rs {
		if r.Mode != cfg.Modes[i] || !r.Verified || r.Error != "" || r.Shards != 2 {
			t.Fatalf("result %d: %+v", i, r)
		}
		if r.Effects != int64(w.unique) || r.DistinctEffects != int64(w.unique) {
			t.Errorf("%s: %d effects (%d distinct), want %d", r.Mode, r.Effects, r.DistinctEffects, w.unique)
		}
		if len(r.ShardEffects) != 2 || r.ShardEffects[0] == 0 || r.ShardEffects[1] == 0 || r.ShardEffects[0]+r.ShardEffects[1] != int64(w.unique) {
			t.Errorf("%s: ledger rows by shard %v, want rows on both, %d in all", r.Mode, r.ShardEffects, w.unique)
		}
		if r.DuplicatesSkipped < int64(cfg.Messages-w.unique) {
			t.Errorf("%s: %d duplicates skipped, want at least %d", r.Mode, r.DuplicatesSkipped, cfg.Messages-w.unique)
		}
		if r.MsgsPerSec <= 0 || r.P50Ms <= 0 {
			t.Errorf("%s: implausible measurements %+v", r.Mode, r)
		}
	}
}

// TestShardedVerificationSpansShards writes one id's ledger row on both
// shards and drops another's: each shard's ledger alone looks clean (no id
// twice, and the rows add up to the unique ids), so only counting the ids
// over all the shards together catches it.
func TestShardedVerificationSpansShards(t *testing.T) {
	cfg := smallConfig(BrokerMemory)
	cfg.Shards = 2
	cfg.Modes = []Mode{ModeIdemq}
	pools := map[string]*pgxpool.Pool{}
	t.Cleanup(func() {
		for _, p := range pools {
			p.Close()
		}
	})
	cfg.shardsReady = func(names []string) {
		for _, name := range names {
			pcfg, err := pgxpool.ParseConfig(testdb.URL())
			if err != nil {
				t.Error(err)
				return
			}
			pcfg.ConnConfig.Database = name
			pcfg.MaxConns = 1
			p, err := pgxpool.NewWithConfig(context.Background(), pcfg)
			if err != nil {
				t.Error(err)
				return
			}
			pools[name] = p
		}
	}
	cfg.effect = func(ctx context.Context, tx pgx.Tx, ledger, id string, amount int64) error {
		if id == "m-3" {
			return nil // missing
		}
		if _, err := tx.Exec(ctx, "INSERT INTO "+ledger+" (id, amount) VALUES ($1, $2)", id, amount); err != nil {
			return err
		}
		if id != "m-7" {
			return nil
		}
		// Also on the other shard, outside the message's transaction.
		var here string
		if err := tx.QueryRow(ctx, "SELECT current_database()").Scan(&here); err != nil {
			return err
		}
		for name, p := range pools {
			if name != here {
				if _, err := p.Exec(ctx, "INSERT INTO "+ledger+" (id, amount) VALUES ($1, $2)", id, amount); err != nil {
					return err
				}
			}
		}
		return nil
	}
	start := time.Now()
	rs, err := run(t, cfg)
	if !errors.Is(err, ErrVerify) || len(rs) != 1 {
		t.Fatalf("Run: %v, %+v; want ErrVerify", err, rs)
	}
	if len(pools) != 2 {
		t.Fatalf("%d shard databases", len(pools))
	}
	r := rs[0]
	u := int64(r.Unique)
	if r.Verified || r.Effects != u || r.DistinctEffects != u-1 || !strings.Contains(r.Error, "1 ids on two shards") {
		t.Fatalf("the id on two shards was not caught: %+v", r)
	}
	if time.Since(start) > cfg.ModeTimeout {
		t.Fatal("the mode ran into its timeout")
	}
}

// TestShardedPartitionedPrefillPurge: with Partitioned, every shard's dedup
// table is partitioned; the prefill is split over the shards, and the purge
// loop purges all of them.
func TestShardedPartitionedPrefillPurge(t *testing.T) {
	cfg := smallConfig(BrokerMemory)
	cfg.Shards = 2
	cfg.Modes = []Mode{ModeIdemq}
	cfg.Partitioned = true
	cfg.Prefill, cfg.PurgeDuring, cfg.Compare = 501, true, true
	rs, err := run(t, cfg)
	if err != nil {
		t.Fatalf("Run: %v", err)
	}
	var got []string
	for _, r := range rs {
		got = append(got, r.label())
		if !r.Verified || r.Shards != 2 || len(r.ShardEffects) != 2 || r.Phase == phasePurge && r.PurgedRows != int64(cfg.Prefill) {
			t.Errorf("%s: %+v", r.label(), r)
		}
	}
	if want := "idemq@base idemq@prefill idemq@purge"; strings.Join(got, " ") != want {
		t.Fatalf("runs %q, want %q", got, want)
	}
}

// TestShardedCancelledDropsDatabases: a run cancelled once its shard
// databases exist (an interrupt) still drops them.
func TestShardedCancelledDropsDatabases(t *testing.T) {
	cfg := smallConfig(BrokerMemory)
	cfg.Shards = 3
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var dbs []string
	cfg.shardsReady = func(names []string) {
		dbs = names
		cancel()
	}
	rs, err := Run(ctx, cfg)
	if !errors.Is(err, context.Canceled) {
		t.Fatalf("Run: %v, %+v; want context.Canceled", err, rs)
	}
	if len(dbs) != 3 {
		t.Fatalf("shard databases %v", dbs)
	}
	if left := existingDatabases(t, dbs); len(left) != 0 {
		t.Fatalf("shard databases left after the cancelled run: %v", left)
	}
}

// TestShardedBrokers: every broker carries the messages' keys to the
// runtime (RabbitMQ, NATS and Redis in the x-idemq-key header or field,
// Kafka as the record key, ordered within the partition), so that a
// sharded run spreads them over both shards.
func TestShardedBrokers(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: runs a sharded mode on every broker")
	}
	for _, broker := range []string{BrokerRabbitMQ, BrokerKafka, BrokerNATS, BrokerRedis} {
		t.Run(broker, func(t *testing.T) {
			cfg := smallConfig(broker)
			cfg.Shards = 2
			cfg.Concurrency = 4
			cfg.Modes = []Mode{ModeDefault}
			rs, err := run(t, cfg)
			if err != nil {
				t.Fatalf("Run: %v", err)
			}
			r := rs[0]
			if !r.Verified || len(r.ShardEffects) != 2 || r.ShardEffects[0] == 0 || r.ShardEffects[1] == 0 || r.Effects != int64(r.Unique) {
				t.Fatalf("%+v", r)
			}
		})
	}
}
