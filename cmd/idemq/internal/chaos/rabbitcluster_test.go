package chaos

import (
	"os"
	"slices"
	"strings"
	"testing"
	"time"
)

// TestClusterScenarioChecks: the cluster faults need Cluster, a cluster is
// RabbitMQ's, the lone node's restarts do not apply to it, and a Cluster
// scenario is held to ClusterStallBound unless it says otherwise.
func TestClusterScenarioChecks(t *testing.T) {
	for _, tc := range []struct {
		s    Scenario
		want string
	}{
		{Scenario{Name: "x", Broker: BrokerRabbitMQ, LeaderKills: 1}, "need Cluster"},
		{Scenario{Name: "x", Broker: BrokerRabbitMQ, NodeLost: true}, "need Cluster"},
		{Scenario{Name: "x", Broker: BrokerNATS, NetPartitions: 1}, "need Cluster"},
		{Scenario{Name: "x", Broker: BrokerKafka, Cluster: true}, "RabbitMQ's or NATS's"},
		{Scenario{Name: "x", Broker: BrokerRabbitMQ, Cluster: true, RabbitRestarts: 1}, "RabbitRestarts"},
		{Scenario{Name: "x", Broker: BrokerNATS, Cluster: true, NATSRestarts: 1}, "NATSRestarts"},
		{Scenario{Name: "x", Broker: BrokerRabbitMQ, Cluster: true, NetPartitions: 1}, "NATS server"},
		{Scenario{Name: "x", Broker: BrokerRabbitMQ, Cluster: true, OwnNodeKills: -1}, "negative"},
		{Scenario{Name: "x", Broker: BrokerRabbitMQ, PGFailover: true, PGRestarts: 1}, "PGFailover excludes"},
		{Scenario{Name: "x", Broker: BrokerRabbitMQ, PGFailover: true, PGResetRate: 0.1}, "PGFailover excludes"},
	} {
		err := tc.s.withDefaults().validate()
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%+v: error %v, want one saying %q", tc.s, err, tc.want)
		}
	}
	s := Scenario{Name: "x", Broker: BrokerRabbitMQ, Cluster: true, OwnNodeKills: 2, LeaderKills: 3, NodeLost: true}.withDefaults()
	if err := s.validate(); err != nil {
		t.Fatal(err)
	}
	if s.StallBound != ClusterStallBound {
		t.Errorf("StallBound %s, want ClusterStallBound", s.StallBound)
	}
	want := []nodeFault{faultOwnNode, faultLeader, faultOwnNode, faultLeader, faultLeader, faultLost}
	if plan := s.clusterPlan(); !slices.Equal(plan, want) {
		t.Errorf("plan %v, want %v", plan, want)
	}
	n := Scenario{Name: "x", Broker: BrokerNATS, Cluster: true, OwnNodeKills: 1, LeaderKills: 1, NetPartitions: 2}.withDefaults()
	if err := n.validate(); err != nil {
		t.Fatal(err)
	}
	if n.StallBound != NATSClusterStallBound {
		t.Errorf("NATS StallBound %s, want NATSClusterStallBound", n.StallBound)
	}
	want = []nodeFault{faultOwnNode, faultLeader, faultPartition, faultPartition}
	if plan := n.clusterPlan(); !slices.Equal(plan, want) {
		t.Errorf("NATS plan %v, want %v", plan, want)
	}
	if f := (Scenario{Name: "x", Broker: BrokerRabbitMQ, PGFailover: true}).withDefaults(); f.StallBound != PGFailoverStallBound {
		t.Errorf("PGFailover StallBound %s, want PGFailoverStallBound", f.StallBound)
	}
	if s := (Scenario{Name: "x", Broker: BrokerRabbitMQ}).withDefaults(); s.StallBound != 0 {
		t.Errorf("a lone node's scenario checks a stall bound of %s", s.StallBound)
	}
	for _, s := range append(LongSuite(), ShortClusterSuite()...) {
		if err := s.withDefaults().validate(); err != nil {
			t.Error(err)
		}
	}
}

// TestQuickCluster runs a small scenario on the harness's own 3-node
// RabbitMQ cluster: a worker's node and the queue leader's are SIGKILLed and
// restarted, the workers fail over, and no apply gap exceeds
// ClusterStallBound. Starting the cluster takes 20 to 30 seconds, so it runs
// only with IDEMQ_CHAOS_CLUSTER set; `idemq chaos --short --cluster` runs
// the short suite's form.
func TestQuickCluster(t *testing.T) {
	if os.Getenv("IDEMQ_CHAOS_CLUSTER") == "" {
		t.Skip("starts a 3-node RabbitMQ cluster: set IDEMQ_CHAOS_CLUSTER to run it")
	}
	cfg := quickHarness(t)
	cfg.Scenarios = []Scenario{{Name: "quick-cluster", Broker: BrokerRabbitMQ, Cluster: true, Messages: 400,
		PublishOver: 20 * time.Second, Workers: 3, OwnNodeKills: 1, LeaderKills: 1, Kills: 2, Timeout: 2 * time.Minute}}
	results := runQuick(t, cfg)
	if len(results) != 1 {
		t.Fatalf("%d results", len(results))
	}
	r := results[0]
	if r.Injected["rabbit-own-node-kill"] != 1 || r.Injected["rabbit-leader-kill"] != 1 {
		t.Errorf("node kills not injected: %v", r.Injected)
	}
	if r.StallBound != ClusterStallBound || r.Stall.SlotMax == 0 {
		t.Errorf("stall not measured: %+v, bound %s", r.Stall, r.StallBound)
	}
	t.Logf("stall %s overall, %s in slot %d", r.Stall.Max, r.Stall.SlotMax, r.Stall.Slot)
}
