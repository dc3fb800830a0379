package chaos

import (
	"context"
	"slices"
	"strings"
	"testing"
	"time"
)

// TestQuickChain runs the chain (an HTTP API with idempotency keys, two
// outbox relays and two consumers, as five processes) under SIGKILLs at
// random and at each service's crash point, Postgres resets at COMMIT and
// cuts of every connection: every key answered 201 is charged, entered and
// notified once, every outbox row is published, and nothing is
// dead-lettered.
func TestQuickChain(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: a chaos run")
	}
	cfg := quickHarness(t)
	cfg.Scenarios = []Scenario{{Name: "quick-chain", Broker: BrokerChain, Messages: 240, PublishOver: 8 * time.Second,
		Kills: 5, SelfKills: 5, SelfKillEvery: 8, PGResetRate: 0.02, ConnCuts: 3, Timeout: 2 * time.Minute}}
	results := runQuick(t, cfg)
	if len(results) != 1 {
		t.Fatalf("%d results", len(results))
	}
	r := results[0]
	if r.Verdict.Confirmed != r.Messages {
		t.Errorf("%d of %d keys accepted", r.Verdict.Confirmed, r.Messages)
	}
	if r.KillsRandom == 0 || r.KillsAfterCommit == 0 {
		t.Errorf("kills random %d, at a crash point %d", r.KillsRandom, r.KillsAfterCommit)
	}
	for _, kind := range []string{"pg-cut", "amqp-cut", "nats-cut", "client-timeouts", "client-changed-bodies"} {
		if r.Injected[kind] == 0 {
			t.Errorf("%s not injected: %v", kind, r.Injected)
		}
	}
}

// TestQuickChainSabotageIsCaught is the chain's negative control: a ledger
// that drops its dedup insert applies every redelivery again, and the
// checker must report the duplicates.
func TestQuickChainSabotageIsCaught(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: a chaos run")
	}
	cfg := quickHarness(t)
	cfg.Scenarios = []Scenario{{Name: "quick-chain-sabotage", Broker: BrokerChain, Messages: 150, PublishOver: 4 * time.Second,
		Kills: 2, SelfKills: 10, SelfKillEvery: 8, PGResetRate: 0.05, Sabotage: SabotageNoDedup, Timeout: 90 * time.Second}}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	results, err := Run(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	r := results[0]
	t.Logf("sabotaged chain: %d lost, %d duplicated, %d orphaned, injected %v, failures %v",
		len(r.Verdict.Lost), len(r.Verdict.Duplicates), len(r.Verdict.Orphaned), r.Injected, r.Failures)
	if r.Passed() || len(r.Verdict.Duplicates) == 0 {
		t.Fatalf("a ledger without its dedup insert passed the checker: %+v", r.Verdict)
	}
	// Its dedup rows never commit: reconcile sees every charge published
	// and never applied.
	if !slices.ContainsFunc(r.Failures, func(f string) bool { return strings.Contains(f, "never applied") }) {
		t.Errorf("idemq reconcile did not report the ledger's missing dedup rows: %v", r.Failures)
	}
}
