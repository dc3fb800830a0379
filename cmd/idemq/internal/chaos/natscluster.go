package chaos

import (
	"context"
	"fmt"
	"slices"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/idemq/idemq/internal/natstest"
)

// NATSClusterStallBound is the longest a NATS Cluster scenario may go
// without an apply (see Stall). It is the worst failover of the nats
// package documented in docs/clusters.md: a server cut off by a partition
// is left after a write timeout (5s) or two unanswered pings (5s apart),
// then the client reconnects to another server and, if the cut-off server
// led the stream or the durable, waits for an election; a lost durable
// leader costs the election plus at most 2s before acks are sent again.
// Measured here: 4.9 to 22s for a partition, 4 to 8s for a lost durable
// leader.
const NATSClusterStallBound = 30 * time.Second

// NATSClientFailover is how much longer than the cluster itself a NATS
// Cluster scenario may go without an apply: nats.go finds a cut-off
// server's connection stale after about 14s (pings every 5s, two
// unanswered), the pull's retry backoff is capped at 1s, acks are sent
// again at most 2s after the durable's leader is back, and 3s are a busy
// machine's. While the cluster confirms no publish (electing its metadata
// leader after a partition) no consumer can apply either. So a gap, overall
// or of one worker slot, may be as long as the larger of
// NATSClusterStallBound and the time within that gap in which no publish
// was confirmed, up to NATSElection, plus this (see stallBound): at most
// 46s. A worker stuck on a dead server while the cluster serves the others
// still fails at 30s; the publisher's time without a confirm includes its
// own failover when it was on the cut-off server.
const NATSClientFailover = 20 * time.Second

// NATSElection is the longest time without a confirmed publish that
// excuses a stall (see NATSClientFailover): the longest this machine's
// cluster took to elect after a partition, 26.2s, rounded up. A producer
// or cluster stuck for longer fails the scenario.
const NATSElection = 26 * time.Second

// stallBound is the bound of a gap, overall or of a worker slot, in s
// during which the publisher went outage without a confirmed publish (see
// outageDuring).
func stallBound(s Scenario, outage time.Duration) time.Duration {
	if s.Broker == BrokerNATS && s.Cluster {
		return max(s.StallBound, min(outage, NATSElection)+NATSClientFailover)
	}
	return s.StallBound
}

// startNATSCluster starts the harness's private NATS cluster: ClusterSize
// servers, the last in a network namespace of its own (so that it can be
// partitioned) if partitionable.
func startNATSCluster(ctx context.Context, partitionable bool) (*natstest.Cluster, error) {
	if partitionable {
		c, err := natstest.StartPartitionable(ctx, ClusterSize)
		if err != nil {
			return nil, fmt.Errorf("chaos: a partitionable NATS cluster (needs root, iproute2 and iptables): %w", err)
		}
		return c, nil
	}
	c, err := natstest.Start(ctx, ClusterSize)
	if err != nil {
		return nil, fmt.Errorf("chaos: %w", err)
	}
	return c, nil
}

// natsOps are the cluster faults' view of the harness's NATS cluster, for
// r's stream and durable consumer.
func (r *run) natsOps() clusterOps {
	c := r.h.natsCluster
	nodes := c.Nodes()
	index := func(name string) int {
		return slices.IndexFunc(nodes, func(nd *natstest.Node) bool { return nd.Name == name })
	}
	// js runs f on a fresh connection to the cluster.
	js := func(ctx context.Context, f func(context.Context, jetstream.JetStream) error) error {
		nc, err := nats.Connect(c.URLs(), nats.Timeout(2*time.Second), nats.NoReconnect())
		if err != nil {
			return err
		}
		defer nc.Close()
		j, err := jetstream.New(nc)
		if err != nil {
			return err
		}
		ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		defer cancel()
		return f(ctx, j)
	}
	ops := clusterOps{
		prefix: "nats", nodes: len(nodes), leaderName: "durable consumer", partitionable: -1,
		name:    func(i int) string { return nodes[i].Name },
		running: func(i int) bool { return nodes[i].Running() },
		leader: func(ctx context.Context) (int, error) {
			leader := -1
			err := js(ctx, func(ctx context.Context, j jetstream.JetStream) error {
				info, err := j.Consumer(ctx, r.stream, r.consumer())
				if err != nil {
					return err
				}
				ci := info.CachedInfo()
				if ci.Cluster == nil || index(ci.Cluster.Leader) < 0 {
					return fmt.Errorf("no leader: %+v", ci.Cluster)
				}
				leader = index(ci.Cluster.Leader)
				return nil
			})
			return leader, err
		},
		workers: func(ctx context.Context) (map[int]int, error) {
			n := map[int]int{}
			for i, nd := range nodes {
				if !nd.Running() {
					continue
				}
				names, err := nd.Connections(ctx)
				if err != nil {
					return nil, err
				}
				n[i] = workerConns(names)
			}
			return n, nil
		},
		kill:  func(i int) { nodes[i].Kill() },
		start: func(_ context.Context, i int) error { return c.Restart(nodes[i]) },
		back: func(ctx context.Context, i int) (bool, string, error) {
			var ok bool
			var state string
			err := js(ctx, func(ctx context.Context, j jetstream.JetStream) error {
				s, err := j.Stream(ctx, r.stream)
				if err != nil {
					return err
				}
				cons, err := j.Consumer(ctx, r.stream, r.consumer())
				if err != nil {
					return err
				}
				sc, cc := s.CachedInfo().Cluster, cons.CachedInfo().Cluster
				if sc == nil || cc == nil {
					return fmt.Errorf("no cluster information")
				}
				state = fmt.Sprintf("stream leader on %s, durable leader on %s", sc.Leader, cc.Leader)
				ok = sc.Leader != "" && cc.Leader != "" && current(sc, nodes[i].Name) && current(cc, nodes[i].Name)
				return nil
			})
			return ok, state, err
		},
		partition: func(i int) error { return nodes[i].Partition() },
		heal:      func(i int) error { return nodes[i].Heal() },
	}
	if last := len(nodes) - 1; nodes[last].Partitionable() {
		ops.partitionable = last
	}
	return ops
}

// current reports whether the group's member on server name leads it or
// is a current, online replica.
func current(ci *jetstream.ClusterInfo, name string) bool {
	if ci.Leader == name {
		return true
	}
	for _, p := range ci.Replicas {
		if p.Name == name {
			return p.Current && !p.Offline
		}
	}
	return false
}
