package natstest

import (
	"context"
	"fmt"
	"os/exec"
	"strings"
	"testing"
)

// StartPartitionableCluster is StartPartitionable for a test: the test
// fails if the cluster cannot start, and the cluster is closed at its
// cleanup.
func StartPartitionableCluster(t testing.TB, n int) *Cluster {
	t.Helper()
	return mustStart(t, func() (*Cluster, error) { return StartPartitionable(context.Background(), n) })
}

// StartPartitionable starts a cluster of n servers whose last one runs in
// a network namespace of its own, joined to the host by a veth pair on a
// /30 of 10.213.0.0/16: the other servers listen on the host's end, it on
// the namespace's. Partition and Heal cut and restore its network
// silently, packets dropped rather than refused, as a real partition does.
// It needs root and iproute2 and iptables; Close removes the namespace.
func StartPartitionable(ctx context.Context, n int) (*Cluster, error) {
	for _, bin := range []string{"ip", "iptables"} {
		if _, err := exec.LookPath(bin); err != nil {
			return nil, fmt.Errorf("natstest: %s is not installed: %w", bin, err)
		}
	}
	id, b0, err := randomID()
	if err != nil {
		return nil, err
	}
	ns, hostIf, nsIf := "idemq-nats-"+id, "inh"+id, "inn"+id
	hostIP, nsIP := fmt.Sprintf("10.213.%d.1", b0), fmt.Sprintf("10.213.%d.2", b0)
	for _, args := range [][]string{
		{"ip", "netns", "add", ns},
		{"ip", "link", "add", hostIf, "type", "veth", "peer", "name", nsIf},
		{"ip", "link", "set", nsIf, "netns", ns},
		{"ip", "addr", "add", hostIP + "/30", "dev", hostIf},
		{"ip", "link", "set", hostIf, "up"},
		{"ip", "netns", "exec", ns, "ip", "addr", "add", nsIP + "/30", "dev", nsIf},
		{"ip", "netns", "exec", ns, "ip", "link", "set", nsIf, "up"},
		{"ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up"},
	} {
		if err := run(args...); err != nil {
			_ = run("ip", "netns", "del", ns)
			return nil, fmt.Errorf("natstest: set up the namespace: %w", err)
		}
	}
	hosts, netns := make([]string, n), make([]string, n)
	for i := range hosts {
		hosts[i] = hostIP
	}
	hosts[n-1], netns[n-1] = nsIP, ns
	return start(ctx, hosts, netns, ns)
}

// Partitionable reports whether nd runs in a network namespace of its own
// (StartPartitionable's last server), so that Partition can cut it off.
func (nd *Node) Partitionable() bool { return nd.netns != "" }

// Partition drops every packet to and from the node, which must run in a
// namespace of its own (StartPartitionable's last): its peers and clients
// hear nothing, and learn of it only by their timeouts.
func (nd *Node) Partition() error {
	if nd.netns == "" {
		return fmt.Errorf("natstest: %s has no namespace of its own", nd.Name)
	}
	for _, chain := range []string{"INPUT", "OUTPUT"} {
		if err := run("ip", "netns", "exec", nd.netns, "iptables", "-A", chain, "-j", "DROP"); err != nil {
			return err
		}
	}
	return nil
}

// Heal undoes Partition.
func (nd *Node) Heal() error {
	if nd.netns == "" {
		return fmt.Errorf("natstest: %s has no namespace of its own", nd.Name)
	}
	return run("ip", "netns", "exec", nd.netns, "iptables", "-F")
}

func run(args ...string) error {
	out, err := exec.Command(args[0], args[1:]...).CombinedOutput()
	if err != nil {
		return fmt.Errorf("%s: %w: %s", strings.Join(args, " "), err, strings.TrimSpace(string(out)))
	}
	return nil
}
