package chaos

import (
	"context"
	"errors"
	"fmt"
	"time"
)

// The cluster faults of a Cluster scenario, for either broker's cluster:
// RabbitCluster (rabbitcluster.go) or a NATS cluster (natscluster.go).

// nodeFault is one cluster fault of a scenario's plan.
type nodeFault int

const (
	faultOwnNode   nodeFault = iota // a worker's node, not the leader's; restarted
	faultLeader                     // the leader's node (queue or durable consumer); restarted
	faultPartition                  // the partitionable node cut off, then healed
	faultLost                       // a worker's node, not the leader's; never restarted
)

// kind is the fault's name in reports, prefixed by the broker's ("rabbit",
// "nats").
func (f nodeFault) kind(prefix string) string {
	return prefix + [...]string{"-own-node-kill", "-leader-kill", "-partition", "-node-lost"}[f]
}

// clusterPlan is the order of s's cluster faults: own node kills, leader
// kills and partitions in turn, own node first, then the lost node.
func (s Scenario) clusterPlan() []nodeFault {
	var plan []nodeFault
	for i := 0; i < max(s.OwnNodeKills, s.LeaderKills, s.NetPartitions); i++ {
		if i < s.OwnNodeKills {
			plan = append(plan, faultOwnNode)
		}
		if i < s.LeaderKills {
			plan = append(plan, faultLeader)
		}
		if i < s.NetPartitions {
			plan = append(plan, faultPartition)
		}
	}
	if s.NodeLost {
		plan = append(plan, faultLost)
	}
	return plan
}

// clusterOps is what the cluster faults need of a broker's cluster; nodes
// are indexes from 0.
type clusterOps struct {
	prefix string // of the fault kinds
	nodes  int
	// leaderName says what leader is of (the queue, the durable).
	leaderName string
	name       func(i int) string
	running    func(i int) bool
	// leader returns the node leading the scenario's queue or durable
	// consumer, or an error if none does.
	leader func(ctx context.Context) (int, error)
	// workers returns the number of worker connections per node.
	workers func(ctx context.Context) (map[int]int, error)
	kill    func(i int)
	start   func(ctx context.Context, i int) error
	// back reports whether node i serves the scenario again (its queue or
	// stream and consumer members online and current), and who leads.
	back func(ctx context.Context, i int) (bool, string, error)
	// partitionable is the node Partition can cut off, -1 if none.
	partitionable   int
	partition, heal func(i int) error
}

// partitionFor is how long a faultPartition keeps its node cut off, at
// least (up to 2s more): long enough for its clients to leave it (a write
// timeout or two unanswered pings, 10s) and its peers to elect new leaders.
const partitionFor = 12 * time.Second

// clusterFaults injects the scenario's cluster faults one after another,
// the i-th of n (from 0) at (2i+1)/(2n+1) of the publishing window, or as
// soon as the one before is over: its node back and serving again.
func (r *run) clusterFaults(ctx context.Context, c clusterOps) {
	plan := r.s.clusterPlan()
	for i, f := range plan {
		at := r.s.PublishOver * time.Duration(2*i+1) / time.Duration(2*len(plan)+1)
		if !sleepCtx(ctx, time.Until(r.start.Add(at))) {
			return
		}
		kind := f.kind(c.prefix)
		victim, why, err := r.pickNode(ctx, c, f)
		if err != nil {
			r.problem(kind + ": " + err.Error())
			return
		}
		what := "SIGKILLed"
		if f == faultPartition {
			what = "cut off"
			err = c.partition(victim)
		} else {
			c.kill(victim)
		}
		hit := time.Now()
		if err != nil {
			r.problem(kind + ": " + err.Error())
			return
		}
		r.inject(kind, 1)
		r.h.event("scenario %s: %s: %s node %s (%s) at +%s", r.s.Name, kind, what, c.name(victim), why,
			hit.Sub(r.start).Round(100*time.Millisecond))
		if f == faultLost {
			continue
		}
		down := clusterNodeDown
		if f == faultPartition {
			down = partitionFor
		}
		if !sleepCtx(ctx, down+time.Duration(r.intn(2000))*time.Millisecond) {
			if f == faultPartition {
				_ = c.heal(victim)
			}
			return
		}
		if f == faultPartition {
			err = c.heal(victim)
		} else {
			err = c.start(ctx, victim)
		}
		if err != nil {
			r.problem(kind + ": restore: " + err.Error())
			return
		}
		// The next fault waits for the node to serve again, so that a
		// quorum is always up.
		deadline := time.Now().Add(time.Minute)
		for {
			ok, state, err := c.back(ctx, victim)
			if ok || ctx.Err() != nil {
				r.h.event("scenario %s: node %s back after %s; %s", r.s.Name, c.name(victim),
					time.Since(hit).Round(100*time.Millisecond), state)
				break
			}
			if time.Now().After(deadline) {
				r.problem(fmt.Sprintf("%s: node %s not serving a minute after it came back: %s, %v",
					kind, c.name(victim), state, err))
				return
			}
			sleepCtx(ctx, 500*time.Millisecond)
		}
	}
}

// pickNode chooses the node fault f hits, and says why.
func (r *run) pickNode(ctx context.Context, c clusterOps, f nodeFault) (int, string, error) {
	if f == faultPartition {
		if c.partitionable < 0 {
			return 0, "", errors.New("no node of the cluster can be partitioned")
		}
		return c.partitionable, "the node in a network namespace of its own", nil
	}
	var leader int
	var err error
	for try := 0; ; try++ {
		if leader, err = c.leader(ctx); err == nil {
			break
		}
		if try == 10 || !sleepCtx(ctx, 500*time.Millisecond) {
			return 0, "", fmt.Errorf("find the %s's leader: %w", c.leaderName, err)
		}
	}
	workers, err := c.workers(ctx)
	if err != nil {
		return 0, "", err
	}
	describe := func(node int) string {
		return fmt.Sprintf("%d worker connections, %s leader on %s", workers[node], c.leaderName, c.name(leader))
	}
	if f == faultLeader {
		return leader, describe(leader), nil
	}
	var withWorkers, others []int
	for i := range c.nodes {
		switch {
		case i == leader || !c.running(i):
		case workers[i] > 0:
			withWorkers = append(withWorkers, i)
		default:
			others = append(others, i)
		}
	}
	switch {
	case len(withWorkers) > 0:
		v := withWorkers[r.intn(len(withWorkers))]
		return v, describe(v), nil
	case workers[leader] > 0:
		// Every worker is on the leader's node: that is their node.
		return leader, describe(leader) + ", every worker there", nil
	case len(others) > 0:
		v := others[r.intn(len(others))]
		return v, describe(v) + ", no worker connected anywhere", nil
	}
	return 0, "", errors.New("no running node but the leader's")
}

// workerConns counts, in names, the connections of chaos workers.
func workerConns(names []string) int {
	n := 0
	for _, name := range names {
		var slot, inc int
		if _, err := fmt.Sscanf(name, workerConnName, &slot, &inc); err == nil {
			n++
		}
	}
	return n
}
