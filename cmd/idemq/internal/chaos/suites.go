package chaos

import (
	"fmt"
	"io"
	"sort"
	"strings"
	"time"
)

// ShortSuite is the CI run: four scenarios, RabbitMQ, Kafka and the whole
// chain, every fault kind, 79 planned SIGKILLs, a few minutes in all. The cluster scenarios'
// short forms, ShortClusterSuite, are apart: they cost about three minutes
// more.
func ShortSuite() []Scenario {
	return []Scenario{
		{Name: "rabbit-kills", Broker: BrokerRabbitMQ, Messages: 1500, PublishOver: 20 * time.Second,
			Kills: 20, SelfKills: 10, SelfKillEvery: 30, CheckRedeliveryBound: true},
		{Name: "rabbit-batch-infra", Broker: BrokerRabbitMQ, Mode: ModeBatch, Messages: 1500, PublishOver: 25 * time.Second,
			Kills: 5, SelfKills: 5, SelfKillEvery: 60, PGResetRate: 0.03, PGLatency: 2 * time.Millisecond, AMQPDropEvery: 100,
			PGRestarts: 1, RabbitRestarts: 1, SlowEvery: 500, SlowFor: 7 * time.Second},
		{Name: "kafka-kills-rebalance", Broker: BrokerKafka, Mode: ModeBatch, Messages: 1500, PublishOver: 25 * time.Second,
			Kills: 10, SelfKills: 5, SelfKillEvery: 40, Rebalances: 2, OffsetCommitErrorRate: 0.2, PGRestarts: 1,
			CheckRedeliveryBound: true},
		// The chain of examples/chain as five processes: HTTP API,
		// payments relay, ledger, ledger relay, notify.
		{Name: "chain", Broker: BrokerChain, Messages: 800, PublishOver: 25 * time.Second,
			Kills: 12, SelfKills: 12, SelfKillEvery: 25, PGRestarts: 1, PGResetRate: 0.01, ConnCuts: 3},
	}
}

// LongSuite is the long run: fifteen scenarios, 565 planned SIGKILLs
// across RabbitMQ (plain, partitioned dedup store, a dedup store sharded
// across three Postgres clusters, and a 3-node cluster),
// Kafka (both sources), NATS JetStream (one server, and a 3-server cluster)
// and Redis Streams, a Postgres failover, and the whole chain, about 35
// minutes.
func LongSuite() []Scenario {
	return []Scenario{
		{Name: "long-rabbit-kills", Broker: BrokerRabbitMQ, Messages: 5000, PublishOver: 60 * time.Second, Workers: 4,
			Kills: 50, SelfKills: 25, SelfKillEvery: 40, CheckRedeliveryBound: true},
		{Name: "long-rabbit-batch-kills", Broker: BrokerRabbitMQ, Mode: ModeBatch, BatchSize: 32, Messages: 5000,
			PublishOver: 60 * time.Second, Workers: 4, Kills: 30, SelfKills: 20, SelfKillEvery: 60, CheckRedeliveryBound: true},
		{Name: "long-rabbit-infra", Broker: BrokerRabbitMQ, Mode: ModeMessage, Messages: 4000, PublishOver: 60 * time.Second,
			Kills: 10, SelfKills: 5, PGResetRate: 0.03, PGLatency: 3 * time.Millisecond, AMQPDropEvery: 150,
			PGRestarts: 2, RabbitRestarts: 2},
		{Name: "long-rabbit-timeout", Broker: BrokerRabbitMQ, Mode: ModeMessage, Messages: 2000, PublishOver: 40 * time.Second,
			Kills: 5, SelfKills: 5, SlowEvery: 300, SlowFor: 7 * time.Second},
		// The bound counts what a process holds unacked; a SIGKILL also
		// loses the offsets acked since the last commit, so this scenario
		// commits every 5ms to keep that within the bound (see
		// CheckRedeliveryBound).
		{Name: "long-kafka-kills", Broker: BrokerKafka, Messages: 4000, PublishOver: 90 * time.Second,
			Kills: 30, SelfKills: 15, SelfKillEvery: 40, Rebalances: 4, CheckRedeliveryBound: true,
			KafkaCommitEvery: 5 * time.Millisecond},
		{Name: "long-kafka-batch-infra", Broker: BrokerKafka, Mode: ModeBatch, Messages: 5000, PublishOver: 90 * time.Second,
			Kills: 20, SelfKills: 10, SelfKillEvery: 60, Rebalances: 4, OffsetCommitErrorRate: 0.3,
			PGResetRate: 0.02, PGLatency: 2 * time.Millisecond, PGRestarts: 2},
		// A transactional producer, a quarter of its transactions
		// aborted, consumed read_committed through brokers/franz: exactly
		// the committed records are applied, none of the aborted ones.
		// The partitioned dedup store, 2s partitions: claims, duplicates
		// and redeliveries straddle boundaries all run long.
		{Name: "long-rabbit-partitioned", Broker: BrokerRabbitMQ, Messages: 3000, PublishOver: 40 * time.Second, Partitioned: true, Kills: 15, SelfKills: 10, SelfKillEvery: 40, PGResetRate: 0.02},
		{Name: "long-kafka-txn", Broker: BrokerKafka, KafkaSource: SourceFranz, AbortRate: 0.25, Mode: ModeBatch,
			Messages: 3000, PublishOver: 60 * time.Second, Kills: 15, SelfKills: 5, SelfKillEvery: 40, Rebalances: 2,
			OffsetCommitErrorRate: 0.1},
		// NATS JetStream and Redis Streams on private servers the harness
		// SIGKILLs and restarts once mid-run (JetStream on file storage;
		// Redis with appendfsync always). The bound is MaxAckPending,
		// which the workers fix at Prefetch (NATS), and the 2 × window
		// the Source holds unsettled (Redis).
		{Name: "long-nats-kills", Broker: BrokerNATS, Messages: 4000, PublishOver: 60 * time.Second,
			Kills: 30, SelfKills: 15, SelfKillEvery: 40, NATSRestarts: 1, CheckRedeliveryBound: true},
		{Name: "long-redis-kills", Broker: BrokerRedis, Messages: 4000, PublishOver: 60 * time.Second,
			Kills: 30, SelfKills: 15, SelfKillEvery: 40, RedisRestarts: 1, CheckRedeliveryBound: true},
		// A 3-node RabbitMQ cluster and a quorum queue: the nodes that
		// workers consume on and the queue leader's are SIGKILLed and
		// restarted in turn, and a last worker's node never comes back.
		// The workers and the publisher fail over to their FailoverURLs:
		// no apply gap, in all or in any one worker, may exceed
		// ClusterStallBound.
		{Name: "long-rabbit-cluster", Broker: BrokerRabbitMQ, Cluster: true, Messages: 4000, PublishOver: 90 * time.Second,
			Workers: 4, OwnNodeKills: 2, LeaderKills: 2, NodeLost: true, Kills: 10, SelfKills: 5, SelfKillEvery: 40},
		// A 3-server NATS cluster and R3 streams: a worker's server and
		// the durable consumer leader's are SIGKILLed and restarted, one
		// server is cut off by a network partition twice, and a last
		// worker's server never comes back. No apply gap may exceed
		// NATSClusterStallBound.
		{Name: "long-nats-cluster", Broker: BrokerNATS, Cluster: true, Messages: 3000, PublishOver: 120 * time.Second,
			Workers: 4, OwnNodeKills: 2, LeaderKills: 2, NetPartitions: 2, NodeLost: true, Kills: 10, SelfKills: 5, SelfKillEvery: 40},
		// A Postgres primary with a synchronous standby: the primary
		// crashes mid-stream and the standby is promoted. Nothing acked
		// is lost with it, and no apply gap exceeds PGFailoverStallBound.
		{Name: "long-pg-failover", Broker: BrokerRabbitMQ, PGFailover: true, Mode: ModeBatch, Messages: 4000,
			PublishOver: 40 * time.Second, Workers: 4, Kills: 10, SelfKills: 5, SelfKillEvery: 40},
		// The chain of examples/chain as five processes, each SIGKILLed
		// at random and at its crash point (the API between its commit
		// and its response, each relay between the broker's confirm and
		// marking the rows sent, each consumer between COMMIT and ack),
		// with Postgres restarted twice, resets at COMMIT, and every
		// Postgres, AMQP and NATS connection cut in turn.
		{Name: "long-chain", Broker: BrokerChain, Messages: 4000, PublishOver: 120 * time.Second,
			Kills: 60, SelfKills: 60, SelfKillEvery: 30, PGRestarts: 2, PGResetRate: 0.01, ConnCuts: 9},
		// The dedup store sharded across three private Postgres
		// clusters: resharded from two of them to three half-way through
		// (every worker killed, the next started with both maps), each
		// shard restarted immediately, resets at COMMIT. Every id is
		// applied once across the shards, each effect beside its claim.
		{Name: "long-pg-shards", Broker: BrokerRabbitMQ, Shards: 3, ReshardFrom: 2, ShardRestarts: 3, Messages: 5000,
			PublishOver: 60 * time.Second, Workers: 3, Kills: 30, SelfKills: 15, SelfKillEvery: 40, PGResetRate: 0.02},
	}
}

// ShortClusterSuite is the short form of the cluster scenarios, which start
// their own nodes: rabbit-cluster (a worker's node and then the queue
// leader's SIGKILLed and restarted), nats-cluster (a worker's server, the
// durable leader's, and a partition of one server), pg-failover (the
// primary crashed and its synchronous standby promoted) and pg-shards (a
// dedup store over three Postgres clusters, resharded from two to three
// mid-run, one shard restarted), each with a few worker SIGKILLs. nats-cluster needs root, iproute2 and iptables.
func ShortClusterSuite() []Scenario {
	return []Scenario{
		{Name: "rabbit-cluster", Broker: BrokerRabbitMQ, Cluster: true, Messages: 1000, PublishOver: 30 * time.Second,
			OwnNodeKills: 1, LeaderKills: 1, Kills: 4, SelfKills: 2, SelfKillEvery: 30},
		{Name: "nats-cluster", Broker: BrokerNATS, Cluster: true, Messages: 1000, PublishOver: 45 * time.Second,
			OwnNodeKills: 1, LeaderKills: 1, NetPartitions: 1, Kills: 4, SelfKills: 2, SelfKillEvery: 30},
		{Name: "pg-failover", Broker: BrokerRabbitMQ, PGFailover: true, Messages: 1000, PublishOver: 20 * time.Second,
			Kills: 4, SelfKills: 2, SelfKillEvery: 30},
		{Name: "pg-shards", Broker: BrokerRabbitMQ, Shards: 3, ReshardFrom: 2, ShardRestarts: 1, Messages: 1500,
			PublishOver: 20 * time.Second, Kills: 6, SelfKills: 4, SelfKillEvery: 30, PGResetRate: 0.02},
	}
}

// WriteSummary writes a plain-text table of results and one line per
// failure.
func WriteSummary(w io.Writer, results []Result) {
	fmt.Fprintf(w, "%-24s %-8s %-7s %6s %6s %6s %5s %5s %5s %5s %5s %9s %6s %9s %5s %8s\n",
		"scenario", "broker", "mode", "ids", "pub", "dups", "kills", "after", "lost", "dup", "unexp", "redel/k", "bound", "stall/wkr", "leaks", "result")
	total := Totals(results)
	for _, r := range results {
		status := "PASS"
		if !r.Passed() {
			status = "FAIL"
		}
		fmt.Fprintf(w, "%-24s %-8s %-7s %6d %6d %6d %5d %5d %5d %5d %5d %4d/%4.1f %6d %4.1f/%4.1f %5d %8s\n",
			r.Scenario, r.Broker, r.Mode, r.Messages, r.Publishes, r.ProducerDuplicates, r.Kills, r.KillsAfterCommit,
			len(r.Verdict.Lost), len(r.Verdict.Duplicates), len(r.Verdict.Unexpected),
			r.Redeliveries.Max, r.Redeliveries.Mean, r.RedeliveryBound,
			r.Stall.Max.Seconds(), r.Stall.SlotMax.Seconds(), r.LeakyExits, status)
	}
	fmt.Fprintf(w, "total: %d scenarios, %d ids, %d SIGKILLs (%d right after COMMIT), %d lost, %d duplicate effects, %d unexpected\n",
		len(results), total.Messages, total.Kills, total.KillsAfterCommit, total.Lost, total.Duplicates, total.Unexpected)
	for _, r := range results {
		fmt.Fprintf(w, "%s: faults: %s; injected: %s\n", r.Scenario, r.Faults, injectedString(r.Injected))
		if r.Broker == BrokerChain {
			fmt.Fprintf(w, "%s: %d keys answered 201 of %d requests; %d orphaned outbox rows, %d dead letters; %s in all\n", r.Scenario,
				r.Verdict.Confirmed, r.Publishes, len(r.Verdict.Orphaned), len(r.Verdict.DeadLettered), r.Duration.Round(100*time.Millisecond))
		} else {
			fmt.Fprintf(w, "%s: %s\n", r.Scenario, stallString(r))
		}
		if len(r.ShardEffects) > 0 {
			fmt.Fprintf(w, "%s: effects per shard %v, each beside its claim\n", r.Scenario, r.ShardEffects)
		}
		for _, f := range r.Failures {
			fmt.Fprintf(w, "  FAIL %s: %s\n", r.Scenario, f)
		}
		if r.Dir != "" && !r.Passed() {
			fmt.Fprintf(w, "  logs: %s\n", r.Dir)
		}
	}
}

// Total sums a run's results.
type Total struct {
	Messages, Kills, KillsAfterCommit, Lost, Duplicates, Unexpected int
}

// Totals sums results.
func Totals(results []Result) Total {
	var t Total
	for _, r := range results {
		t.Messages += r.Messages
		t.Kills += r.Kills
		t.KillsAfterCommit += r.KillsAfterCommit
		t.Lost += len(r.Verdict.Lost)
		t.Duplicates += len(r.Verdict.Duplicates)
		t.Unexpected += len(r.Verdict.Unexpected)
	}
	return t
}

func injectedString(m map[string]int64) string {
	if len(m) == 0 {
		return "-"
	}
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	parts := make([]string, len(keys))
	for i, k := range keys {
		parts[i] = fmt.Sprintf("%s=%d", k, m[k])
	}
	return strings.Join(parts, " ")
}

// stallString describes r's stalls, each longest gap with the bound it
// was held to.
func stallString(r Result) string {
	bound := func(b time.Duration) string {
		switch {
		case r.StallBound <= 0:
			return "not checked"
		case b > r.StallBound:
			// Only a NATS cluster scenario raises its bound (stallBound).
			return fmt.Sprintf("bound %s: the time in the gap without a confirmed publish, up to %s, plus %s",
				b.Round(100*time.Millisecond), NATSElection, NATSClientFailover)
		}
		return "bound " + r.StallBound.String()
	}
	return fmt.Sprintf("longest without an apply: %s overall while messages waited (%s), %s in worker slot %d while messages were published (%s); longest between confirmed publishes %s; %s in all",
		r.Stall.Max.Round(time.Millisecond), bound(r.MaxStallBound), r.Stall.SlotMax.Round(time.Millisecond), r.Stall.Slot, bound(r.SlotStallBound),
		r.PublishStall.Round(time.Millisecond), r.Duration.Round(100*time.Millisecond))
}

// WriteMarkdown writes results as the Markdown table RELIABILITY.md keeps.
func WriteMarkdown(w io.Writer, results []Result) {
	fmt.Fprintln(w, "| scenario | broker / mode | faults injected | ids (publishes, producer dups) | SIGKILLs (after COMMIT) | lost | duplicate effects | unexpected | redeliveries per kill max / mean (bound) | longest stall overall / per worker (bound) | leaked goroutines | result |")
	fmt.Fprintln(w, "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
	for _, r := range results {
		status := "pass"
		if !r.Passed() {
			status = "**FAIL**: " + strings.Join(r.Failures, "; ")
		}
		bound := fmt.Sprintf("%d", r.RedeliveryBound)
		if r.BoundChecked {
			bound += ", checked"
		}
		stall := "-"
		if r.StallBound > 0 {
			stall = r.StallBound.String()
			if max(r.MaxStallBound, r.SlotStallBound) > r.StallBound {
				stall = max(r.MaxStallBound, r.StallBound).Round(100*time.Millisecond).String() + " / " +
					max(r.SlotStallBound, r.StallBound).Round(100*time.Millisecond).String()
			}
		}
		stalls := fmt.Sprintf("%.1fs / %.1fs (%s)", r.Stall.Max.Seconds(), r.Stall.SlotMax.Seconds(), stall)
		if r.Broker == BrokerChain {
			stalls = fmt.Sprintf("- (%d orphaned outbox rows)", len(r.Verdict.Orphaned))
		}
		fmt.Fprintf(w, "| %s | %s / %s | %s | %d (%d, %d) | %d (%d) | %d | %d | %d | %d / %.1f (%s) | %s | %d of %d exits | %s |\n",
			r.Scenario, r.Broker, r.Mode, injectedString(r.Injected), r.Messages, r.Publishes, r.ProducerDuplicates,
			r.Kills, r.KillsAfterCommit, len(r.Verdict.Lost), len(r.Verdict.Duplicates), len(r.Verdict.Unexpected),
			r.Redeliveries.Max, r.Redeliveries.Mean, bound, stalls, r.LeakyExits, r.GracefulExits, status)
	}
}
