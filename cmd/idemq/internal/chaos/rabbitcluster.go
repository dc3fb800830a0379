package chaos

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
)

// ClusterSize is the number of nodes of the harness's RabbitMQ cluster: the
// smallest that keeps a quorum queue available with one node down.
const ClusterSize = 3

// ClusterStallBound is the longest a Cluster scenario may go without an
// apply: overall while a confirmed message waits for its effect, and in any
// one worker slot while messages are being published (see Stall). It is
// the failover time of the rabbitmq package on a quorum queue, with room
// for a loaded 2-core machine: a consumer or publisher whose node dies
// reconnects Reconnect.InitialInterval (100ms by default) later to the next
// of its FailoverURLs, which answers at once; a queue whose leader's node
// dies is served again once the surviving members elect a new leader, which
// Ra does in under a second here (the node's distribution connection
// closes with its process, so the others notice at once). Measured here:
// consumers resume within a second; a publisher that fails over while the
// election runs is nacked by RabbitMQ 3.10 for 7 to 8 seconds (see
// RELIABILITY.md). A consumer that waits for its own node to come back, as
// one without FailoverURLs does, stalls for the node's restart and its own
// growing backoff, 11 to 28 seconds here, or for ever if the node never
// returns.
const ClusterStallBound = 10 * time.Second

// clusterNodeDown is how long a killed node of the cluster stays down, at
// least (up to 2s more), before the harness starts it again; it then takes
// about 5s to boot and rejoin. A consumer that waits for its own node, with
// no FailoverURLs, thus stalls for longer than ClusterStallBound, whatever
// its reconnect backoff.
const clusterNodeDown = 5 * time.Second

// rabbitCtlTimeout bounds one rabbitmqctl call.
const rabbitCtlTimeout = 60 * time.Second

// RabbitCluster is a private RabbitMQ cluster the harness owns: ClusterSize
// RabbitNodes, each with its own node name (idemq-chaos-<hex>-a@localhost,
// -b, -c), AMQP and distribution ports and data directory, all under one
// temporary directory whose .erlang.cookie they share (it is their HOME and
// rabbitmqctl's), joined into one cluster with rabbitmqctl. Nodes are
// killed with SIGKILL (a crash) and restarted on their data, rejoining the
// cluster; Close kills every node and removes the directory. The shared
// broker's node is never touched: the cluster's nodes only use the host's
// epmd, as every node does.
type RabbitCluster struct {
	ctl, dir string
	Nodes    []*RabbitNode
}

// StartRabbitCluster starts ClusterSize nodes at once and joins the second
// and later ones to the first (stop_app, join_cluster, start_app). script
// defaults to DefaultRabbitMQServer; rabbitmqctl is taken from its
// directory. On an error nothing is left running.
func StartRabbitCluster(ctx context.Context, script string) (*RabbitCluster, error) {
	if script == "" {
		script = DefaultRabbitMQServer
	}
	c := &RabbitCluster{ctl: filepath.Join(filepath.Dir(script), "rabbitmqctl")}
	for _, f := range []string{script, c.ctl} {
		if _, err := os.Stat(f); err != nil {
			return nil, fmt.Errorf("chaos: rabbitmq cluster: %w", err)
		}
	}
	dir, err := os.MkdirTemp("", "idemq-chaos-rabbitcluster-")
	if err != nil {
		return nil, fmt.Errorf("chaos: %w", err)
	}
	c.dir = dir
	ok := false
	defer func() {
		if !ok {
			c.Close()
		}
	}()
	// One cookie for the nodes and rabbitmqctl; Erlang refuses a cookie
	// file others can read.
	if err := os.WriteFile(filepath.Join(dir, ".erlang.cookie"), []byte(strings.ToUpper(randomHex(10))), 0o400); err != nil {
		return nil, fmt.Errorf("chaos: %w", err)
	}
	if err := os.WriteFile(filepath.Join(dir, "rabbitmq-env.conf"), nil, 0o644); err != nil {
		return nil, fmt.Errorf("chaos: %w", err)
	}
	id := randomHex(4)
	taken := map[int]bool{}
	for i := range ClusterSize {
		letter := string(rune('a' + i))
		ndir := filepath.Join(dir, letter)
		if err := os.Mkdir(ndir, 0o755); err != nil {
			return nil, fmt.Errorf("chaos: %w", err)
		}
		n, err := newRabbitNode(script, ndir, dir, "idemq-chaos-"+id+"-"+letter+"@localhost", 0, taken)
		if err != nil {
			return nil, err
		}
		c.Nodes = append(c.Nodes, n)
	}
	errs := make([]error, len(c.Nodes))
	var wg sync.WaitGroup
	for i, n := range c.Nodes {
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs[i] = n.Start(ctx)
		}()
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		return nil, err
	}
	first := c.Nodes[0].name
	for _, n := range c.Nodes[1:] {
		for _, args := range [][]string{{"stop_app"}, {"join_cluster", first}, {"start_app"}} {
			if _, err := c.run(ctx, n, args...); err != nil {
				return nil, err
			}
		}
	}
	if _, err := c.run(ctx, c.Nodes[0], "await_online_nodes", strconv.Itoa(ClusterSize), "--timeout", "60"); err != nil {
		return nil, err
	}
	ok = true
	return c, nil
}

// URLs are the nodes' AMQP URLs, in node order.
func (c *RabbitCluster) URLs() []string {
	urls := make([]string, len(c.Nodes))
	for i, n := range c.Nodes {
		urls[i] = n.URL()
	}
	return urls
}

// Running reports whether node i's process is running (not killed).
func (c *RabbitCluster) Running(i int) bool {
	n := c.Nodes[i]
	n.mu.Lock()
	defer n.mu.Unlock()
	return n.cmd != nil
}

// Kill SIGKILLs node i and waits for its processes to exit.
func (c *RabbitCluster) Kill(i int) { c.Nodes[i].kill() }

// Start starts node i again on its data; it rejoins the cluster.
func (c *RabbitCluster) Start(ctx context.Context, i int) error { return c.Nodes[i].Start(ctx) }

// Close kills every node and removes the cluster's directory.
func (c *RabbitCluster) Close() {
	var wg sync.WaitGroup
	for _, n := range c.Nodes {
		wg.Add(1)
		go func() {
			defer wg.Done()
			n.kill()
		}()
	}
	wg.Wait()
	if c.dir != "" {
		_ = os.RemoveAll(c.dir)
	}
}

// run runs rabbitmqctl against node n, bounded by rabbitCtlTimeout, and
// returns its standard output.
func (c *RabbitCluster) run(ctx context.Context, n *RabbitNode, args ...string) ([]byte, error) {
	ctx, cancel := context.WithTimeout(ctx, rabbitCtlTimeout)
	defer cancel()
	cmd := exec.CommandContext(ctx, c.ctl, append([]string{"-q", "-n", n.name}, args...)...)
	cmd.Dir = c.dir
	cmd.Env = append(os.Environ(), "HOME="+c.dir, "RABBITMQ_CONF_ENV_FILE="+filepath.Join(c.dir, "rabbitmq-env.conf"))
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	cmd.WaitDelay = 5 * time.Second
	if err := cmd.Run(); err != nil {
		msg := strings.TrimSpace(stderr.String())
		if len(msg) > 400 {
			msg = msg[:400] + "..."
		}
		return nil, fmt.Errorf("chaos: rabbitmqctl -n %s %s: %w: %s", n.name, strings.Join(args, " "), err, msg)
	}
	return stdout.Bytes(), nil
}

// runAny runs rabbitmqctl against the first running node that answers.
func (c *RabbitCluster) runAny(ctx context.Context, args ...string) ([]byte, error) {
	var errs []error
	for i, n := range c.Nodes {
		if !c.Running(i) {
			continue
		}
		out, err := c.run(ctx, n, args...)
		if err == nil {
			return out, nil
		}
		errs = append(errs, err)
	}
	if len(errs) == 0 {
		return nil, errors.New("chaos: no node of the cluster is running")
	}
	return nil, errors.Join(errs...)
}

// nodeIndex returns the index of the node named name, or -1.
func (c *RabbitCluster) nodeIndex(name string) int {
	for i, n := range c.Nodes {
		if n.name == name {
			return i
		}
	}
	return -1
}

// QueueState is what the cluster says of a quorum queue: the node of its
// leader and of its online members.
type QueueState struct {
	Leader int   // node index, -1 if none
	Online []int // node indexes
}

// Queue returns the state of quorum queue name (in vhost /).
func (c *RabbitCluster) Queue(ctx context.Context, name string) (QueueState, error) {
	out, err := c.runAny(ctx, "list_queues", "name", "leader", "online", "--formatter", "json")
	if err != nil {
		return QueueState{}, err
	}
	var rows []struct {
		Name   string   `json:"name"`
		Leader string   `json:"leader"`
		Online []string `json:"online"`
	}
	if err := json.Unmarshal(out, &rows); err != nil {
		return QueueState{}, fmt.Errorf("chaos: list_queues: %w: %q", err, out)
	}
	for _, row := range rows {
		if row.Name != name {
			continue
		}
		st := QueueState{Leader: c.nodeIndex(row.Leader)}
		for _, o := range row.Online {
			if i := c.nodeIndex(o); i >= 0 {
				st.Online = append(st.Online, i)
			}
		}
		return st, nil
	}
	return QueueState{}, fmt.Errorf("chaos: queue %q not found", name)
}

// Connections returns, per node index, the connection names of the
// client connections to it that have one.
func (c *RabbitCluster) Connections(ctx context.Context) (map[int][]string, error) {
	out, err := c.runAny(ctx, "list_connections", "port", "client_properties", "--formatter", "json")
	if err != nil {
		return nil, err
	}
	// client_properties is a list of [name, type, value] triples.
	var rows []struct {
		Port  int                 `json:"port"`
		Props [][]json.RawMessage `json:"client_properties"`
	}
	if err := json.Unmarshal(out, &rows); err != nil {
		return nil, fmt.Errorf("chaos: list_connections: %w: %q", err, out)
	}
	names := map[int][]string{}
	for _, row := range rows {
		var name string
		for _, p := range row.Props {
			var key string
			if len(p) == 3 && json.Unmarshal(p[0], &key) == nil && key == "connection_name" {
				_ = json.Unmarshal(p[2], &name)
			}
		}
		if name == "" {
			continue
		}
		for i, n := range c.Nodes {
			if n.port == row.Port {
				names[i] = append(names[i], name)
			}
		}
	}
	return names, nil
}

// dialAny opens an AMQP connection to the first node of urls that answers.
func dialAny(urls []string) (*amqp.Connection, error) {
	var errs []error
	for _, u := range urls {
		conn, err := amqp.DialConfig(u, amqp.Config{Dial: amqp.DefaultDial(5 * time.Second)})
		if err == nil {
			return conn, nil
		}
		errs = append(errs, err)
	}
	return nil, errors.Join(errs...)
}

// names are the nodes' names, in node order.
func (c *RabbitCluster) names() []string {
	names := make([]string, len(c.Nodes))
	for i, n := range c.Nodes {
		names[i] = n.name
	}
	return names
}

// problem records a harness problem that fails the scenario.
func (r *run) problem(msg string) {
	r.mu.Lock()
	r.exitProblems = append(r.exitProblems, msg)
	r.mu.Unlock()
}

// rabbitOps are the cluster faults' view of the harness's RabbitMQ
// cluster, for r's quorum queue.
func (r *run) rabbitOps() clusterOps {
	c := r.h.cluster
	queue := func(ctx context.Context) (QueueState, error) {
		st, err := c.Queue(ctx, r.queue)
		if err == nil && st.Leader < 0 {
			err = fmt.Errorf("no leader: %+v", st)
		}
		return st, err
	}
	return clusterOps{
		prefix: "rabbit", nodes: len(c.Nodes), leaderName: "queue", partitionable: -1,
		name:    func(i int) string { return c.Nodes[i].name },
		running: c.Running,
		leader: func(ctx context.Context) (int, error) {
			st, err := queue(ctx)
			return st.Leader, err
		},
		workers: func(ctx context.Context) (map[int]int, error) {
			conns, err := c.Connections(ctx)
			if err != nil {
				return nil, err
			}
			n := map[int]int{}
			for node, names := range conns {
				n[node] = workerConns(names)
			}
			return n, nil
		},
		kill:  c.Kill,
		start: c.Start,
		back: func(ctx context.Context, i int) (bool, string, error) {
			st, err := queue(ctx)
			if err != nil {
				return false, "", err
			}
			return slices.Contains(st.Online, i), "queue leader on " + c.Nodes[st.Leader].name, nil
		},
	}
}
