package chaos

import (
	"os"
	"testing"
	"time"
)

// TestQuickStreams runs small NATS and Redis scenarios on the harness's
// private nats-server and redis-server: SIGKILLs at random and right after
// COMMIT, one server restart each, the redelivery bound checked. It is
// opt-in (CHAOS_STREAMS=1), so that the CI run keeps its length; the long
// suite has the full scenarios (long-nats-kills, long-redis-kills).
func TestQuickStreams(t *testing.T) {
	if os.Getenv("CHAOS_STREAMS") == "" {
		t.Skip("set CHAOS_STREAMS=1 to run the NATS and Redis chaos scenarios")
	}
	cfg := quickHarness(t)
	cfg.Scenarios = []Scenario{
		{Name: "quick-nats", Broker: BrokerNATS, Messages: 600, PublishOver: 8 * time.Second, Workers: 2,
			Kills: 4, SelfKills: 3, SelfKillEvery: 20, NATSRestarts: 1, CheckRedeliveryBound: true, Timeout: 2 * time.Minute},
		{Name: "quick-redis", Broker: BrokerRedis, Messages: 600, PublishOver: 8 * time.Second, Workers: 2,
			Kills: 4, SelfKills: 3, SelfKillEvery: 20, RedisRestarts: 1, CheckRedeliveryBound: true, Timeout: 2 * time.Minute},
	}
	for _, r := range runQuick(t, cfg) {
		if r.Verdict.Confirmed != r.Messages || r.KillsAfterCommit == 0 || r.ProducerDuplicates == 0 {
			t.Errorf("%s: %d of %d ids confirmed, %d kills after commit, %d producer duplicates",
				r.Scenario, r.Verdict.Confirmed, r.Messages, r.KillsAfterCommit, r.ProducerDuplicates)
		}
		if r.Injected["nats-restart"]+r.Injected["redis-restart"] != 1 {
			t.Errorf("%s: server not restarted: %v", r.Scenario, r.Injected)
		}
	}
}
