package chaos

import (
	"errors"
	"fmt"
	"regexp"
	"time"
)

// Scenario is one workload run against one broker under a set of faults.
// The zero value of every optional field selects a documented default or
// disables the fault.
type Scenario struct {
	// Name identifies the scenario in reports. Required: lower-case
	// letters, digits and dashes.
	Name string
	// Broker is BrokerRabbitMQ, BrokerKafka (a kfake cluster started
	// for the scenario), BrokerNATS or BrokerRedis (a private server the
	// harness starts), or BrokerChain: the whole chain of examples/chain,
	// HTTP API to outbox to RabbitMQ to consumer to outbox to NATS to
	// consumer, as five processes (see BrokerChain for the fields that
	// apply).
	Broker string
	// Mode is ModeDefault, ModeMessage or ModeBatch. Defaults to
	// ModeDefault.
	Mode string

	// Messages is the number of distinct message ids. Defaults to 1000.
	Messages int
	// DupRate is the fraction of ids the producer publishes more than
	// once, each time as a separate, separately confirmed Publish: a
	// producer-side duplicate. Defaults to 0.2; negative disables.
	DupRate float64
	// PublishOver spreads the publishing over this long, so that faults
	// hit a steady stream. Defaults to 20s.
	PublishOver time.Duration

	// Workers is the number of consumer processes. Defaults to 3.
	Workers int
	// Concurrency is each runtime's Concurrency. Defaults to 4.
	Concurrency int
	// BatchSize is the runtime's BatchSize in ModeBatch. Defaults to 16;
	// the runtime's default (32) in ModeDefault, 1 in ModeMessage.
	BatchSize int
	// Prefetch is the RabbitMQ prefetch, or the Kafka source's
	// MaxInFlight per partition. Defaults to 2*Concurrency per message,
	// Concurrency*BatchSize in batch mode, and in ModeDefault to what the
	// runtime gives the Source itself, 2*Concurrency*DefaultGroupSize.
	Prefetch int
	// Partitions is the Kafka topic's partition count. Defaults to 4.
	Partitions int
	// KafkaCommitEvery is the Kafka source's CommitInterval. Defaults to
	// 100ms.
	KafkaCommitEvery time.Duration
	// KafkaSource picks the Kafka consumer: SourceKafkaGo (brokers/kafka,
	// the default) or SourceFranz (brokers/franz, on franz-go, reading
	// committed transactional data only).
	KafkaSource string
	// AbortRate, if positive, makes the Kafka producer transactional
	// (franz-go with a TransactionalID): every Publish call is one
	// transaction, and about AbortRate of them are aborted. The ids of an
	// aborted transaction are never published again, and an effect for
	// one fails the scenario. Needs SourceFranz.
	AbortRate float64

	// Kills is the number of SIGKILLs the nemesis sends to random
	// consumer processes at random moments during the publishing window.
	Kills int
	// SelfKills is the number of worker incarnations armed to SIGKILL
	// themselves right after a COMMIT and before its ack (in the
	// HookApplied hook), after a random number of commits around
	// SelfKillEvery (default 40).
	SelfKills     int
	SelfKillEvery int
	// PGResetRate is the probability that a COMMIT's connection is reset
	// by the worker's Postgres proxy (half after forwarding it: the
	// outcome is ambiguous to the runtime; half before).
	PGResetRate float64
	// PGLatency is added by the proxy to every statement.
	PGLatency time.Duration
	// AMQPDropEvery drops a worker's AMQP connection after every Nth
	// commit, before the ack (RabbitMQ only).
	AMQPDropEvery int
	// PGRestarts is the number of `pg_ctl -m immediate` restarts of the
	// harness's private Postgres cluster.
	PGRestarts int
	// RabbitRestarts is the number of SIGKILL restarts of the harness's
	// private RabbitMQ node.
	RabbitRestarts int
	// NATSRestarts and RedisRestarts are the numbers of SIGKILL restarts
	// of the harness's private nats-server or redis-server.
	NATSRestarts, RedisRestarts int
	// ConnCuts (BrokerChain) is the number of times every connection to
	// Postgres, RabbitMQ or NATS, in turn, is cut at once by the proxy
	// the services reach it through, spread over the publishing window.
	ConnCuts int
	// Rebalances is the number of times an extra Kafka consumer process
	// joins the group and leaves it again (gracefully) a little later.
	Rebalances int
	// OffsetCommitErrorRate is the probability that kfake answers an
	// OffsetCommit request with an error (Kafka only).
	OffsetCommitErrorRate float64
	// SlowEvery makes the handler sleep SlowFor on about one message in
	// SlowEvery. With SlowFor above the private node's consumer_timeout,
	// RabbitMQ closes the channel under the handler.
	SlowEvery int
	SlowFor   time.Duration

	// Cluster runs the scenario on a private cluster of ClusterSize
	// nodes. On RabbitMQ (RabbitCluster) the queue is a quorum queue
	// (Topology.Quorum): worker slot i starts on node i mod ClusterSize,
	// with the other nodes as its FailoverURLs, and the publisher has
	// every node; RabbitRestarts does not apply. On NATS the streams have
	// three replicas and every client is given every server's URL; the
	// last server runs in a network namespace of its own if NetPartitions is
	// set (which needs root, iproute2 and iptables); NATSRestarts does
	// not apply. The cluster faults below need it.
	Cluster bool
	// OwnNodeKills is the number of SIGKILLs of a node that some worker
	// is connected to and that does not lead the queue or the durable
	// consumer (the leader's, if every worker is there); LeaderKills of
	// the node that leads it. Each node is started again after 5 to 7s
	// (clusterNodeDown) and the next fault waits for it to serve again,
	// so that one node at most is down. They alternate with NetPartitions,
	// own node first, spread over the publishing window.
	OwnNodeKills, LeaderKills int
	// NetPartitions (NATS) is the number of times the namespaced server is
	// cut off, every packet to and from it dropped, for 12 to 14s
	// (partitionFor), then healed.
	NetPartitions int
	// NodeLost, after those, SIGKILLs one more worker's node, chosen as
	// for OwnNodeKills, for good: the run ends on the other two.
	NodeLost bool
	// PGFailover runs the scenario on a private Postgres primary with a
	// synchronous standby (PGPair), which the workers and the checker
	// reach through one multi-host URL with
	// target_session_attrs=read-write. Half-way through the publishing
	// window the primary is stopped immediately (a crash) and the standby
	// promoted; the run ends on it. The faults of a single Postgres
	// server (PGRestarts, PGResetRate, PGLatency) do not apply.
	PGFailover bool
	// StallBound fails the scenario if no message was applied for
	// longer while a confirmed message waited for its effect, or by one
	// worker slot while messages were being published (see Stall).
	// Defaults to ClusterStallBound for a RabbitMQ Cluster scenario,
	// NATSClusterStallBound for a NATS one and PGFailoverStallBound for a
	// PGFailover one; 0 elsewhere, where the stall is only reported
	// (Postgres restarts, slow handlers and Kafka rebalances stall by
	// design).
	StallBound time.Duration

	// Sabotage, for the harness's own tests, breaks the workers or the
	// setup on purpose (SabotageEffectOutsideTx, SabotageAsyncStandby,
	// SabotageNoDedup): the scenario must fail.
	Sabotage string

	// Partitioned runs the workers on the partitioned layout of the dedup
	// store (processed.Config.Partitioned), whose generations each
	// worker's janitor rotates every half Retention (defaults to half of
	// PublishOver): claims, duplicates and redeliveries straddle the two
	// rotations mid-run. A row of another consumer, claimed before the
	// workers start and never purged, holds the oldest generation after
	// them, so no row of the run is retired and every id must be applied
	// once.
	Partitioned bool
	Retention   time.Duration

	// Shards runs the workers over a dedup store sharded across Shards
	// private Postgres clusters (processed.Sharded, routed by the message
	// key), which the scenario starts on their own ports and removes: each
	// message's claim and effect commit on its shard. RabbitMQ only; 0 is
	// one database, as elsewhere.
	Shards int
	// ReshardFrom, if positive, starts the map at ReshardFrom shards and,
	// half-way through the publishing window, reshards to Shards as
	// docs/sharding.md says: every worker is SIGKILLed, and the next
	// incarnations start with both maps (ShardedConfig.Previous), while
	// the publisher goes on.
	ReshardFrom int
	// ShardRestarts is the number of `pg_ctl -m immediate` restarts of a
	// random shard's cluster.
	ShardRestarts int

	// CheckRedeliveryBound makes the scenario fail if a kill caused more
	// redeliveries than the prefetch (RabbitMQ) or partitions*MaxInFlight
	// (Kafka). Enable it where kills are the only source of redelivery.
	// For Kafka a SIGKILL also loses the offsets acked since the last
	// commit, up to one KafkaCommitEvery of throughput (about 150 records
	// at the default 100ms, when a young process re-reads a deduplicated
	// backlog): a Kafka scenario that checks the bound must commit often
	// enough, a few milliseconds, for that to stay within it.
	CheckRedeliveryBound bool
	// Timeout bounds the whole scenario. Defaults to 3*PublishOver + 2m.
	Timeout time.Duration
}

var scenarioName = regexp.MustCompile(`^[a-z][a-z0-9-]{0,40}$`)

func (s Scenario) withDefaults() Scenario {
	if s.Mode == "" {
		s.Mode = ModeDefault
	}
	if s.Partitioned && s.Retention == 0 {
		s.Retention = max(s.PublishOver/2, 2*time.Second)
	}
	if s.Messages == 0 {
		s.Messages = 1000
	}
	if s.DupRate == 0 {
		s.DupRate = 0.2
	}
	if s.DupRate < 0 {
		s.DupRate = 0
	}
	if s.PublishOver == 0 {
		s.PublishOver = 20 * time.Second
	}
	if s.Workers == 0 {
		s.Workers = 3
	}
	if s.Broker == BrokerChain {
		s.Workers = len(chainRoles)
	}
	if s.Concurrency == 0 {
		s.Concurrency = 4
	}
	switch s.Mode {
	case ModeBatch:
		if s.BatchSize == 0 {
			s.BatchSize = 16
		}
	case ModeDefault:
		s.BatchSize = 32 // the runtime's default with a Handler
	default:
		s.BatchSize = 1
	}
	if s.Prefetch == 0 {
		switch s.Mode {
		case ModeBatch:
			s.Prefetch = s.Concurrency * s.BatchSize
		default:
			s.Prefetch = 2 * s.Concurrency * s.BatchSize
		}
	}
	if s.Partitions == 0 {
		s.Partitions = 4
	}
	if s.KafkaCommitEvery == 0 {
		s.KafkaCommitEvery = 100 * time.Millisecond
	}
	if s.SelfKillEvery == 0 {
		s.SelfKillEvery = 40
	}
	if s.StallBound == 0 {
		switch {
		case s.Cluster && s.Broker == BrokerNATS:
			s.StallBound = NATSClusterStallBound
		case s.Cluster:
			s.StallBound = ClusterStallBound
		case s.PGFailover:
			s.StallBound = PGFailoverStallBound
		}
	}
	if s.Timeout == 0 {
		s.Timeout = 3*s.PublishOver + 2*time.Minute
	}
	return s
}

func (s Scenario) validate() error {
	bad := func(format string, args ...any) error {
		return fmt.Errorf("chaos: scenario %q: %s", s.Name, fmt.Sprintf(format, args...))
	}
	switch {
	case !scenarioName.MatchString(s.Name):
		return bad("name must match %s", scenarioName)
	case s.Retention != 0 && !s.Partitioned:
		return bad("Retention without Partitioned")
	case s.Broker != BrokerRabbitMQ && s.Broker != BrokerKafka && s.Broker != BrokerNATS && s.Broker != BrokerRedis && s.Broker != BrokerChain:
		return bad("broker %q, want %q, %q, %q, %q or %q", s.Broker, BrokerRabbitMQ, BrokerKafka, BrokerNATS, BrokerRedis, BrokerChain)
	case s.Broker == BrokerChain && (s.Mode != ModeDefault || s.Cluster || s.PGFailover || s.Partitioned || s.RabbitRestarts > 0 ||
		s.NATSRestarts > 0 || s.RedisRestarts > 0 || s.AMQPDropEvery > 0 || s.SlowEvery > 0 || s.PGLatency > 0 || s.Rebalances > 0 ||
		s.OffsetCommitErrorRate > 0 || s.KafkaSource != "" || s.AbortRate > 0 || s.CheckRedeliveryBound || s.StallBound > 0):
		return bad("a chain scenario takes Messages, DupRate, PublishOver, Kills, SelfKills, SelfKillEvery, PGRestarts, PGResetRate, ConnCuts, Sabotage and Timeout only")
	case s.ConnCuts < 0:
		return bad("fault counts must not be negative")
	case s.ConnCuts > 0 && s.Broker != BrokerChain:
		return bad("ConnCuts is a chain scenario's")
	case s.Sabotage == SabotageEffectOutsideTx && s.Shards > 0:
		return bad("%s writes to the scenario's database, which a sharded scenario's checker does not read for effects", SabotageEffectOutsideTx)
	case s.Sabotage == SabotageBlindReshard && s.ReshardFrom == 0:
		return bad("%s needs ReshardFrom", SabotageBlindReshard)
	case s.Sabotage == SabotageNoDedup && s.Broker != BrokerChain:
		return bad("%s is a chain scenario's", SabotageNoDedup)
	case s.Mode != ModeDefault && s.Mode != ModeMessage && s.Mode != ModeBatch:
		return bad("mode %q, want %q, %q or %q", s.Mode, ModeDefault, ModeMessage, ModeBatch)
	case s.Messages < 1 || s.Messages > 10_000_000:
		return bad("messages %d out of range", s.Messages)
	case s.DupRate >= 1:
		return bad("dup rate %g, must be below 1", s.DupRate)
	case s.Workers < 1 || s.Workers > 32:
		return bad("workers %d, must be 1..32", s.Workers)
	case s.Concurrency < 1 || s.BatchSize < 1 || s.Prefetch < 1 || s.Prefetch > 65535:
		return bad("concurrency, batch size and prefetch must be positive (prefetch at most 65535)")
	case s.Kills < 0 || s.SelfKills < 0 || s.PGRestarts < 0 || s.RabbitRestarts < 0 || s.Rebalances < 0:
		return bad("fault counts must not be negative")
	case s.PGResetRate < 0 || s.PGResetRate > 0.5 || s.OffsetCommitErrorRate < 0 || s.OffsetCommitErrorRate > 0.9:
		return bad("PGResetRate must be in [0, 0.5], OffsetCommitErrorRate in [0, 0.9]")
	case s.NATSRestarts < 0 || s.RedisRestarts < 0:
		return bad("fault counts must not be negative")
	case s.NATSRestarts > 0 && s.Broker != BrokerNATS, s.RedisRestarts > 0 && s.Broker != BrokerRedis:
		return bad("NATS or Redis restarts on a %s scenario", s.Broker)
	case (s.Broker == BrokerNATS || s.Broker == BrokerRedis) && (s.RabbitRestarts > 0 || s.AMQPDropEvery > 0 || s.Rebalances > 0 || s.OffsetCommitErrorRate > 0):
		return bad("RabbitMQ or Kafka faults on a %s scenario", s.Broker)
	case s.Broker == BrokerKafka && (s.RabbitRestarts > 0 || s.AMQPDropEvery > 0):
		return bad("RabbitMQ faults on a Kafka scenario")
	case s.Broker == BrokerRabbitMQ && (s.Rebalances > 0 || s.OffsetCommitErrorRate > 0):
		return bad("Kafka faults on a RabbitMQ scenario")
	case s.KafkaSource != "" && s.KafkaSource != SourceKafkaGo && s.KafkaSource != SourceFranz:
		return bad("Kafka source %q, want %q or %q", s.KafkaSource, SourceKafkaGo, SourceFranz)
	case s.KafkaSource != "" && s.Broker != BrokerKafka:
		return bad("a Kafka source on a %s scenario", s.Broker)
	case s.AbortRate < 0 || s.AbortRate > 0.9:
		return bad("AbortRate %g, must be in [0, 0.9]", s.AbortRate)
	case s.AbortRate > 0 && s.KafkaSource != SourceFranz:
		return bad("aborted transactions need the read_committed source %q", SourceFranz)
	case s.Cluster && s.Broker != BrokerRabbitMQ && s.Broker != BrokerNATS:
		return bad("a cluster is RabbitMQ's or NATS's")
	case s.Cluster && (s.RabbitRestarts > 0 || s.NATSRestarts > 0):
		return bad("RabbitRestarts and NATSRestarts restart the lone server; a Cluster scenario has OwnNodeKills and LeaderKills")
	case !s.Cluster && (s.OwnNodeKills != 0 || s.LeaderKills != 0 || s.NetPartitions != 0 || s.NodeLost):
		return bad("node kills and partitions need Cluster")
	case s.NetPartitions != 0 && s.Broker != BrokerNATS:
		return bad("NetPartitions cut off a NATS server")
	case s.OwnNodeKills < 0 || s.LeaderKills < 0 || s.NetPartitions < 0:
		return bad("fault counts must not be negative")
	case s.Sabotage == SabotageAsyncStandby && !s.PGFailover:
		return bad("%s needs PGFailover", SabotageAsyncStandby)
	case s.Shards < 0 || s.ReshardFrom < 0 || s.ShardRestarts < 0 || s.Shards == 1:
		return bad("Shards must be 0 or at least 2, ReshardFrom and ShardRestarts not negative")
	case s.Shards > 0 && (s.Broker != BrokerRabbitMQ || s.Cluster || s.PGFailover || s.Partitioned || s.PGRestarts > 0):
		return bad("a sharded scenario runs on one RabbitMQ node, with neither PGFailover, Partitioned nor PGRestarts (ShardRestarts restart the shards)")
	case s.Shards == 0 && (s.ReshardFrom > 0 || s.ShardRestarts > 0):
		return bad("ReshardFrom and ShardRestarts need Shards")
	case s.ReshardFrom >= s.Shards && s.ReshardFrom > 0:
		return bad("ReshardFrom %d must be below Shards %d", s.ReshardFrom, s.Shards)
	case s.PGFailover && (s.PGRestarts > 0 || s.PGResetRate > 0 || s.PGLatency > 0):
		return bad("PGFailover excludes PGRestarts, PGResetRate and PGLatency")
	case s.SlowEvery < 0 || s.SlowFor < 0 || s.PGLatency < 0 || s.PublishOver < 0 || s.Timeout < 0 || s.StallBound < 0:
		return bad("negative duration or rate")
	}
	return nil
}

// redeliveryBound is the most redeliveries one kill may cause: the
// deliveries a process may hold unacked.
func (s Scenario) redeliveryBound() int {
	switch s.Broker {
	case BrokerKafka:
		return s.Prefetch * s.Partitions
	case BrokerRedis:
		// The Source holds at most twice the runtime's window
		// (Concurrency × BatchSize) unsettled.
		return 2 * s.Concurrency * s.BatchSize
	}
	// NATS: the worker fixes MaxAckPending, the durable's (shared by
	// every worker), at Prefetch.
	return s.Prefetch
}

// Faults describes s's faults in one line.
func (s Scenario) Faults() string {
	var out []string
	add := func(cond bool, format string, args ...any) {
		if cond {
			out = append(out, fmt.Sprintf(format, args...))
		}
	}
	chain := s.Broker == BrokerChain
	add(chain, "API, 2 relays, 2 consumers as processes")
	add(s.Kills > 0, "%d random SIGKILLs", s.Kills)
	add(s.SelfKills > 0 && !chain, "%d SIGKILLs after COMMIT before ack", s.SelfKills)
	add(s.SelfKills > 0 && chain, "%d SIGKILLs at the services' crash points (after commit before response, publish before mark, commit before ack)", s.SelfKills)
	add(s.ConnCuts > 0, "%d cuts of every Postgres, AMQP or NATS connection", s.ConnCuts)
	add(s.PGResetRate > 0, "PG reset at %.0f%% of COMMITs", 100*s.PGResetRate)
	add(s.PGLatency > 0, "PG latency %s", s.PGLatency)
	add(s.AMQPDropEvery > 0, "AMQP drop after every %dth commit", s.AMQPDropEvery)
	add(s.PGRestarts > 0, "%d PG immediate restarts", s.PGRestarts)
	add(s.RabbitRestarts > 0, "%d RabbitMQ restarts", s.RabbitRestarts)
	add(s.Cluster && s.Broker == BrokerRabbitMQ, "%d-node RabbitMQ cluster, quorum queue", ClusterSize)
	add(s.Cluster && s.Broker == BrokerNATS, "%d-server NATS cluster, R%d streams", ClusterSize, ClusterSize)
	add(s.OwnNodeKills > 0, "%d SIGKILL restarts of a worker's node", s.OwnNodeKills)
	add(s.LeaderKills > 0 && s.Broker == BrokerNATS, "%d SIGKILL restarts of the durable consumer leader's server", s.LeaderKills)
	add(s.LeaderKills > 0 && s.Broker != BrokerNATS, "%d SIGKILL restarts of the queue leader's node", s.LeaderKills)
	add(s.NetPartitions > 0, "%d network partitions of a server (ip netns)", s.NetPartitions)
	add(s.PGFailover, "PG primary crashed, synchronous standby promoted")
	add(s.NodeLost, "a worker's node killed for good")
	add(s.NATSRestarts > 0, "%d nats-server restarts", s.NATSRestarts)
	add(s.RedisRestarts > 0, "%d redis-server restarts", s.RedisRestarts)
	add(s.Rebalances > 0, "%d join/leave rebalances", s.Rebalances)
	add(s.OffsetCommitErrorRate > 0, "%.0f%% OffsetCommit errors", 100*s.OffsetCommitErrorRate)
	add(s.SlowEvery > 0, "1/%d handlers sleep %s", s.SlowEvery, s.SlowFor)
	add(s.AbortRate > 0, "transactional producer, %.0f%% of transactions aborted", 100*s.AbortRate)
	add(s.KafkaSource == SourceFranz, "franz-go read_committed consumer")
	add(s.Partitioned, "partitioned dedup store, generations rotated every %s", s.withDefaults().Retention/2)
	add(s.Shards > 0 && s.ReshardFrom == 0, "dedup store sharded across %d Postgres clusters", s.Shards)
	add(s.ReshardFrom > 0, "dedup store sharded across Postgres clusters, resharded from %d to %d mid-run", s.ReshardFrom, s.Shards)
	add(s.ShardRestarts > 0, "%d immediate restarts of a shard", s.ShardRestarts)
	if len(out) == 0 {
		return "none"
	}
	return joinComma(out)
}

func joinComma(ss []string) string {
	var b []byte
	for i, s := range ss {
		if i > 0 {
			b = append(b, ", "...)
		}
		b = append(b, s...)
	}
	return string(b)
}

// errNeedsPrivate is returned for a scenario that restarts a service the
// harness does not own.
var errNeedsPrivate = errors.New("chaos: restarts need the harness's own cluster or node")
