package chaos

import (
	"context"
	"testing"
	"time"
)

// TestQuickSharded runs workers over a dedup store sharded across three
// private Postgres clusters, resharded from two to three mid-run, under
// SIGKILLs (random, and after COMMIT before the ack), COMMIT resets and an
// immediate restart of a shard: every id is applied exactly once across
// the shards, each effect beside its claim.
func TestQuickSharded(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: a chaos run on three private Postgres clusters")
	}
	cfg := quickHarness(t)
	cfg.Scenarios = []Scenario{{Name: "quick-sharded", Broker: BrokerRabbitMQ, Shards: 3, ReshardFrom: 2, ShardRestarts: 1,
		Messages: 800, PublishOver: 10 * time.Second, Workers: 2, Kills: 3, SelfKills: 3, SelfKillEvery: 30,
		PGResetRate: 0.03, Timeout: 2 * time.Minute}}
	results := runQuick(t, cfg)
	if len(results) != 1 {
		t.Fatalf("%d results", len(results))
	}
	r := results[0]
	if r.Injected["reshard"] != 1 || r.Injected["shard-restart"] != 1 {
		t.Errorf("faults not injected: %v", r.Injected)
	}
	if len(r.ShardEffects) != 3 || r.ShardEffects[2] == 0 || r.ShardEffects[0] == 0 || r.ShardEffects[1] == 0 {
		t.Errorf("effects per shard %v: every shard should hold some, the new one since the reshard", r.ShardEffects)
	}
	t.Logf("effects per shard %v", r.ShardEffects)
}

// TestQuickBlindReshardIsCaught is the sharded scenario's negative
// control: a reshard that skips the old shards' check applies the moved
// messages delivered again a second time, and the checker must say so.
func TestQuickBlindReshardIsCaught(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: a chaos run on three private Postgres clusters")
	}
	cfg := quickHarness(t)
	cfg.Scenarios = []Scenario{{Name: "quick-blind-reshard", Broker: BrokerRabbitMQ, Shards: 3, ReshardFrom: 2,
		Messages: 800, PublishOver: 8 * time.Second, Workers: 2, DupRate: 0.5, Sabotage: SabotageBlindReshard, Timeout: 2 * time.Minute}}
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	results, err := Run(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	r := results[0]
	t.Logf("blind reshard: %d duplicate effects, injected %v, effects per shard %v, failures %v", len(r.Verdict.Duplicates), r.Injected, r.ShardEffects, r.Failures)
	if r.Passed() || len(r.Verdict.Duplicates) == 0 {
		t.Fatalf("a blind reshard passed the checker: %+v", r.Verdict)
	}
}
