package natstest

import (
	"context"
	"crypto/rand"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// Cluster is a private JetStream cluster of nats-server processes on
// loopback ports of their own, for tests and the chaos suite that lose a
// server. It never touches the shared test server.
type Cluster struct {
	bin, dir string
	netns    string // the namespace to remove at Close, if any
	nodes    []*Node
}

// Node is one server of a Cluster.
type Node struct {
	Name string
	// URL is the node's client URL.
	URL string
	// monitor is the node's HTTP monitoring address (host:port).
	monitor string
	conf    string
	log     string
	// netns, if set, is the network namespace the node runs in (see
	// StartPartitionable).
	netns string
	mu    sync.Mutex
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
	return mustStart(t, func() (*Cluster, error) { return Start(context.Background(), n) })
}

// mustStart starts a cluster with start for test t: t fails if it cannot,
// and the cluster is closed at its cleanup.
func mustStart(t testing.TB, start func() (*Cluster, error)) *Cluster {
	t.Helper()
	c, err := start()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(c.Close)
	return c
}

// Start starts n servers (named n1, n2, ...) on 127.0.0.1, clustered with
// each other, each with JetStream on a store directory of its own under one
// temporary directory, and waits up to a minute, or until ctx ends, for the
// cluster to have a JetStream meta leader. Close kills the servers and
// removes the directory; on an error nothing is left running.
func Start(ctx context.Context, n int) (*Cluster, error) {
	hosts := make([]string, n)
	for i := range hosts {
		hosts[i] = "127.0.0.1"
	}
	return start(ctx, hosts, nil, "")
}

// start starts a cluster of len(hosts) servers, the i-th listening on
// hosts[i] and, if netns[i] is set, running in that network namespace; ns,
// if set, is removed at Close.
func start(ctx context.Context, hosts, netns []string, ns string) (_ *Cluster, err error) {
	n := len(hosts)
	c := &Cluster{netns: ns}
	defer func() {
		if err != nil {
			c.Close()
		}
	}()
	if c.bin, err = exec.LookPath("nats-server"); err != nil {
		return nil, fmt.Errorf("natstest: nats-server is not installed: %w", err)
	}
	if c.dir, err = os.MkdirTemp("", "idemq-natstest-"); err != nil {
		return nil, fmt.Errorf("natstest: %w", err)
	}
	ports, err := freePorts(3 * n)
	if err != nil {
		return nil, err
	}
	clientPorts, routePorts, monitorPorts := ports[:n], ports[n:2*n], ports[2*n:]
	routes := make([]string, n)
	for i := range n {
		routes[i] = fmt.Sprintf("nats-route://%s:%d", hosts[i], routePorts[i])
	}
	for i := range n {
		name := fmt.Sprintf("n%d", i+1)
		store := filepath.Join(c.dir, name)
		conf := filepath.Join(c.dir, name+".conf")
		body := fmt.Sprintf("server_name: %s\nlisten: %s:%d\nhttp: %s:%d\njetstream { store_dir: %q }\n"+
			"cluster { name: idemq-test, listen: %s:%d, routes: [%s] }\n",
			name, hosts[i], clientPorts[i], hosts[i], monitorPorts[i], store, hosts[i], routePorts[i], strings.Join(routes, ", "))
		if err := os.WriteFile(conf, []byte(body), 0o600); err != nil {
			return nil, fmt.Errorf("natstest: %w", err)
		}
		nd := &Node{Name: name, URL: fmt.Sprintf("nats://%s:%d", hosts[i], clientPorts[i]),
			monitor: fmt.Sprintf("%s:%d", hosts[i], monitorPorts[i]), conf: conf, log: filepath.Join(c.dir, name+".log")}
		if i < len(netns) {
			nd.netns = netns[i]
		}
		c.nodes = append(c.nodes, nd)
	}
	for _, nd := range c.nodes {
		if err := c.Restart(nd); err != nil {
			return nil, err
		}
	}
	rctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	if err := c.waitReady(rctx); err != nil {
		return nil, fmt.Errorf("natstest: the cluster did not form: %w", err)
	}
	return c, nil
}

// Close kills every server, removes the cluster's directory and, for a
// partitionable cluster, its network namespace.
func (c *Cluster) Close() {
	for _, nd := range c.nodes {
		nd.kill()
	}
	if c.dir != "" {
		_ = os.RemoveAll(c.dir)
	}
	if c.netns != "" {
		_ = run("ip", "netns", "del", c.netns) // takes the veth pair with it
	}
}

// Nodes returns the cluster's servers, in order (n1, n2, ...).
func (c *Cluster) Nodes() []*Node { return c.nodes }

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

// Running reports whether the node's process runs.
func (nd *Node) Running() bool {
	nd.mu.Lock()
	defer nd.mu.Unlock()
	return nd.cmd != nil
}

func (nd *Node) kill() {
	nd.mu.Lock()
	cmd, done := nd.cmd, nd.done
	nd.cmd = nil
	nd.mu.Unlock()
	if cmd == nil || cmd.Process == nil {
		return
	}
	_ = cmd.Process.Signal(syscall.SIGKILL)
	<-done
}

// Restart starts nd, which must not be running, on its store directory
// and waits up to a minute for it to answer clients; it rejoins the
// cluster by itself.
func (c *Cluster) Restart(nd *Node) error {
	nd.mu.Lock()
	defer nd.mu.Unlock()
	if nd.cmd != nil {
		return fmt.Errorf("natstest: %s is running", nd.Name)
	}
	log, err := os.OpenFile(nd.log, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		return fmt.Errorf("natstest: %w", err)
	}
	cmd := exec.Command(c.bin, "-c", nd.conf)
	if nd.netns != "" {
		// ip netns exec runs the server itself in the namespace: the
		// process to kill is the server.
		cmd = exec.Command("ip", "netns", "exec", nd.netns, c.bin, "-c", nd.conf)
	}
	cmd.Stdout, cmd.Stderr = log, log
	if err := cmd.Start(); err != nil {
		_ = log.Close()
		return fmt.Errorf("natstest: start %s: %w", nd.Name, err)
	}
	done := make(chan struct{})
	nd.cmd, nd.done = cmd, done
	go func() {
		_ = cmd.Wait()
		_ = log.Close()
		close(done)
	}()
	deadline := time.Now().Add(time.Minute)
	for {
		nc, err := nats.Connect(nd.URL, nats.Timeout(time.Second), nats.NoReconnect())
		if err == nil {
			nc.Close()
			return nil
		}
		select {
		case <-done:
			return fmt.Errorf("natstest: %s exited during start; see %s", nd.Name, nd.log)
		case <-time.After(100 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("natstest: %s did not answer within a minute: %w", nd.Name, err)
		}
	}
}

// MetaLeader returns the name of the server that leads the cluster's
// JetStream meta layer, as nd sees it (from /jsz); "" if none.
func (nd *Node) MetaLeader(ctx context.Context) (string, error) {
	var body struct {
		Meta *struct {
			Leader string `json:"leader"`
		} `json:"meta_cluster"`
	}
	if err := nd.monitorGet(ctx, "/jsz", &body); err != nil {
		return "", err
	}
	if body.Meta == nil {
		return "", nil
	}
	return body.Meta.Leader, nil
}

// monitorGet decodes the JSON of nd's monitoring endpoint path.
func (nd *Node) monitorGet(ctx context.Context, path string, v any) error {
	ctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+nd.monitor+path, nil)
	if err != nil {
		return err
	}
	req.Close = true // no idle connection left behind (tests check for leaks)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return fmt.Errorf("natstest: %s %s: %w", nd.Name, path, err)
	}
	defer resp.Body.Close()
	if err := json.NewDecoder(resp.Body).Decode(v); err != nil {
		return fmt.Errorf("natstest: %s %s: %w", nd.Name, path, err)
	}
	return nil
}

// Connections returns the names of the client connections nd serves, read
// from its monitoring endpoint (/connz).
func (nd *Node) Connections(ctx context.Context) ([]string, error) {
	var body struct {
		Connections []struct {
			Name string `json:"name"`
		} `json:"connections"`
	}
	if err := nd.monitorGet(ctx, "/connz?limit=4096", &body); err != nil {
		return nil, err
	}
	names := make([]string, len(body.Connections))
	for i, cn := range body.Connections {
		names[i] = cn.Name
	}
	return names, nil
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
func freePorts(n int) ([]int, error) {
	ports := make([]int, n)
	lns := make([]net.Listener, 0, n)
	defer func() {
		for _, ln := range lns {
			_ = ln.Close()
		}
	}()
	for i := range n {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return nil, fmt.Errorf("natstest: %w", err)
		}
		lns = append(lns, ln)
		ports[i] = ln.Addr().(*net.TCPAddr).Port
	}
	return ports, nil
}

// randomID returns 4 hex digits and the first random byte.
func randomID() (string, byte, error) {
	var b [2]byte
	if _, err := rand.Read(b[:]); err != nil {
		return "", 0, errors.New("natstest: no randomness")
	}
	return fmt.Sprintf("%02x%02x", b[0], b[1]), b[0], nil
}
