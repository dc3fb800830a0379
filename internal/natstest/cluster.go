package natstest

import (
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// Cluster is a private JetStream cluster of nats-server processes on
// loopback ports of their own, for tests that lose a server. It never
// touches the shared test server.
type Cluster struct {
	t     testing.TB
	dir   string
	nodes []*Node
}

// Node is one server of a Cluster.
type Node struct {
	Name string
	// URL is the node's client URL.
	URL  string
	conf string
	// netns, if set, is the network namespace the node runs in (see
	// StartPartitionableCluster).
	netns string
	cmd   *exec.Cmd
	done  chan struct{}
}

// StartCluster starts n servers (named n1, n2, ...) clustered with each
// other, each with JetStream on a store directory of its own, and waits
// until the cluster has a JetStream meta leader. The servers are killed
// and their directories removed at the test's cleanup; the test fails if
// nats-server is missing or the cluster does not form within a minute.
func StartCluster(t testing.TB, n int) *Cluster {
	t.Helper()
	hosts := make([]string, n)
	for i := range hosts {
		hosts[i] = "127.0.0.1"
	}
	return startCluster(t, hosts, nil)
}

// startCluster starts a cluster of len(hosts) servers, the i-th listening
// on hosts[i] and, if netns[i] is set, running in that network namespace.
func startCluster(t testing.TB, hosts, netns []string) *Cluster {
	t.Helper()
	n := len(hosts)
	bin, err := exec.LookPath("nats-server")
	if err != nil {
		t.Fatalf("natstest: nats-server is not installed: %v", err)
	}
	c := &Cluster{t: t, dir: t.TempDir()}
	clientPorts, routePorts := freePorts(t, n), freePorts(t, n)
	routes := make([]string, n)
	for i := range n {
		routes[i] = fmt.Sprintf("nats-route://%s:%d", hosts[i], routePorts[i])
	}
	for i := range n {
		name := fmt.Sprintf("n%d", i+1)
		store := filepath.Join(c.dir, name)
		conf := filepath.Join(c.dir, name+".conf")
		body := fmt.Sprintf("server_name: %s\nlisten: %s:%d\njetstream { store_dir: %q }\n"+
			"cluster { name: idemq-test, listen: %s:%d, routes: [%s] }\n",
			name, hosts[i], clientPorts[i], store, hosts[i], routePorts[i], strings.Join(routes, ", "))
		if err := os.WriteFile(conf, []byte(body), 0o600); err != nil {
			t.Fatal(err)
		}
		nd := &Node{Name: name, URL: fmt.Sprintf("nats://%s:%d", hosts[i], clientPorts[i]), conf: conf}
		if i < len(netns) {
			nd.netns = netns[i]
		}
		c.nodes = append(c.nodes, nd)
	}
	t.Cleanup(func() {
		for _, nd := range c.nodes {
			nd.kill()
		}
	})
	for _, nd := range c.nodes {
		if err := nd.start(bin, filepath.Join(c.dir, nd.Name+".log")); err != nil {
			t.Fatal(err)
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if err := c.waitReady(ctx); err != nil {
		t.Fatalf("natstest: the cluster did not form: %v", err)
	}
	return c
}

// URLs is every node's client URL, comma-separated, as nats.Connect takes
// them.
func (c *Cluster) URLs() string {
	urls := make([]string, len(c.nodes))
	for i, nd := range c.nodes {
		urls[i] = nd.URL
	}
	return strings.Join(urls, ",")
}

// Node returns the node named name (n1, n2, ...), or nil.
func (c *Cluster) Node(name string) *Node {
	for _, nd := range c.nodes {
		if nd.Name == name {
			return nd
		}
	}
	return nil
}

// Kill kills the node with SIGKILL, as a lost machine would stop, and
// waits for it to exit.
func (nd *Node) Kill() { nd.kill() }

func (nd *Node) kill() {
	if nd.cmd == nil || nd.cmd.Process == nil {
		return
	}
	_ = nd.cmd.Process.Signal(syscall.SIGKILL)
	<-nd.done
	nd.cmd = nil
}

func (nd *Node) start(bin, logFile string) error {
	log, err := os.OpenFile(logFile, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		return err
	}
	cmd := exec.Command(bin, "-c", nd.conf)
	if nd.netns != "" {
		// ip netns exec runs the server itself in the namespace: the
		// process to kill is the server.
		cmd = exec.Command("ip", "netns", "exec", nd.netns, bin, "-c", nd.conf)
	}
	cmd.Stdout, cmd.Stderr = log, log
	if err := cmd.Start(); err != nil {
		_ = log.Close()
		return fmt.Errorf("natstest: start %s: %w", nd.Name, err)
	}
	nd.cmd, nd.done = cmd, make(chan struct{})
	go func() {
		_ = cmd.Wait()
		_ = log.Close()
		close(nd.done)
	}()
	return nil
}

// waitReady waits until every node answers and a stream replicated on
// every node can be created: the meta leader is elected and knows them all.
func (c *Cluster) waitReady(ctx context.Context) error {
	for {
		err := c.ready(ctx)
		if err == nil {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("%w (last: %v)", ctx.Err(), err)
		case <-time.After(200 * time.Millisecond):
		}
	}
}

func (c *Cluster) ready(ctx context.Context) error {
	for _, nd := range c.nodes {
		nc, err := nats.Connect(nd.URL, nats.Timeout(time.Second))
		if err != nil {
			return err
		}
		nc.Close()
	}
	nc, err := nats.Connect(c.URLs(), nats.Timeout(time.Second))
	if err != nil {
		return err
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		return err
	}
	// Every server is a peer of the meta group once a stream replicated
	// on all of them can be placed.
	actx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	probe := jetstream.StreamConfig{Name: "NATSTEST_READY", Subjects: []string{"natstest.ready"}, Replicas: len(c.nodes)}
	if _, err := js.CreateStream(actx, probe); err != nil {
		return fmt.Errorf("a stream on every server: %w", err)
	}
	return js.DeleteStream(actx, probe.Name)
}

// freePorts returns n loopback ports that were free a moment ago.
func freePorts(t testing.TB, n int) []int {
	t.Helper()
	ports := make([]int, n)
	lns := make([]net.Listener, n)
	for i := range n {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		lns[i], ports[i] = ln, ln.Addr().(*net.TCPAddr).Port
	}
	for _, ln := range lns {
		_ = ln.Close()
	}
	return ports
}
