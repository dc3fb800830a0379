package chaos

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
)

// DefaultRabbitMQServer is the rabbitmq-server start script that runs the
// node in the foreground as the calling user (the /usr/sbin wrapper would
// switch to the rabbitmq user).
const DefaultRabbitMQServer = "/usr/lib/rabbitmq/bin/rabbitmq-server"

// RabbitNode is a private RabbitMQ node the harness owns, so that it can be
// restarted without disturbing the shared broker: its own node name, AMQP
// and distribution ports on 127.0.0.1, data and log directories in a
// temporary directory, no plugins, and a short consumer_timeout checked
// every second. Restart kills it with SIGKILL (a crash) and starts it again
// on the same data, so durable queues and persistent messages survive.
type RabbitNode struct {
	script, dir, name string
	// home is the node's HOME, where its Erlang cookie is: dir for a
	// lone node, the cluster's directory for a node of a RabbitCluster.
	home              string
	port, distPort    int
	consumerTimeoutMS int
	mu                sync.Mutex
	cmd               *exec.Cmd
	done              chan struct{}
}

// StartRabbitNode starts a node with the given consumer_timeout (0: the
// broker's default of 30 minutes). script defaults to
// DefaultRabbitMQServer.
func StartRabbitNode(ctx context.Context, script string, consumerTimeout time.Duration) (*RabbitNode, error) {
	if script == "" {
		script = DefaultRabbitMQServer
	}
	if _, err := os.Stat(script); err != nil {
		return nil, fmt.Errorf("chaos: rabbitmq-server: %w", err)
	}
	dir, err := os.MkdirTemp("", "idemq-chaos-rabbit-")
	if err != nil {
		return nil, fmt.Errorf("chaos: %w", err)
	}
	var b [4]byte
	_, _ = rand.Read(b[:])
	n, err := newRabbitNode(script, dir, dir, "idemq-chaos-"+hex.EncodeToString(b[:])+"@localhost", consumerTimeout, nil)
	if err != nil {
		_ = os.RemoveAll(dir)
		return nil, err
	}
	if err := n.Start(ctx); err != nil {
		n.Close()
		return nil, err
	}
	return n, nil
}

// newRabbitNode prepares a node in dir (which must exist) with two free
// ports not in taken, and writes its configuration; it does not start it.
func newRabbitNode(script, dir, home, name string, consumerTimeout time.Duration, taken map[int]bool) (*RabbitNode, error) {
	n := &RabbitNode{script: script, dir: dir, home: home, name: name,
		consumerTimeoutMS: int(consumerTimeout / time.Millisecond)}
	if taken == nil {
		taken = map[int]bool{}
	}
	for _, p := range []*int{&n.port, &n.distPort} {
		for *p == 0 || taken[*p] {
			port, err := freePort()
			if err != nil {
				return nil, err
			}
			*p = port
		}
		taken[*p] = true
	}
	conf := fmt.Sprintf("listeners.tcp.1 = 127.0.0.1:%d\nloopback_users = none\n", n.port)
	if n.consumerTimeoutMS > 0 {
		conf += fmt.Sprintf("consumer_timeout = %d\n", n.consumerTimeoutMS)
	}
	files := map[string]string{
		"rabbitmq.conf":     conf,
		"advanced.config":   "[{rabbit, [{channel_tick_interval, 1000}]}].\n",
		"enabled_plugins":   "[].\n",
		"rabbitmq-env.conf": "",
	}
	for name, body := range files {
		if err := os.WriteFile(filepath.Join(dir, name), []byte(body), 0o644); err != nil {
			return nil, fmt.Errorf("chaos: %w", err)
		}
	}
	return n, nil
}

// URL is the node's AMQP URL.
func (n *RabbitNode) URL() string { return fmt.Sprintf("amqp://guest:guest@127.0.0.1:%d/", n.port) }

// Addr is the node's AMQP host:port.
func (n *RabbitNode) Addr() string { return net.JoinHostPort("127.0.0.1", strconv.Itoa(n.port)) }

// Start starts the node and waits until it accepts AMQP connections.
func (n *RabbitNode) Start(ctx context.Context) error {
	n.mu.Lock()
	if n.cmd != nil {
		n.mu.Unlock()
		return errors.New("chaos: rabbitmq node already running")
	}
	cmd := exec.Command(n.script)
	cmd.Dir = n.dir
	cmd.Env = append(os.Environ(),
		"HOME="+n.home,
		"RABBITMQ_CONF_ENV_FILE="+filepath.Join(n.dir, "rabbitmq-env.conf"),
		"RABBITMQ_NODENAME="+n.name,
		"RABBITMQ_NODE_IP_ADDRESS=127.0.0.1",
		"RABBITMQ_NODE_PORT="+strconv.Itoa(n.port),
		"RABBITMQ_DIST_PORT="+strconv.Itoa(n.distPort),
		"ERL_EPMD_ADDRESS=127.0.0.1",
		"RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS=-kernel inet_dist_use_interface {127,0,0,1}",
		"RABBITMQ_MNESIA_BASE="+filepath.Join(n.dir, "mnesia"),
		"RABBITMQ_LOG_BASE="+filepath.Join(n.dir, "log"),
		"RABBITMQ_ENABLED_PLUGINS_FILE="+filepath.Join(n.dir, "enabled_plugins"),
		"RABBITMQ_CONFIG_FILE="+filepath.Join(n.dir, "rabbitmq.conf"),
		"RABBITMQ_ADVANCED_CONFIG_FILE="+filepath.Join(n.dir, "advanced.config"),
		"RABBITMQ_PID_FILE="+filepath.Join(n.dir, "pid"),
		// The script then execs the VM instead of running it as its
		// child: the VM itself is our child and gets the parent-death
		// signal, so that no node outlives a harness killed outright
		// (a test binary's timeout, say).
		"RUNNING_UNDER_SYSTEMD=true",
	)
	out, err := os.OpenFile(filepath.Join(n.dir, "server.out"), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		n.mu.Unlock()
		return fmt.Errorf("chaos: %w", err)
	}
	cmd.Stdout, cmd.Stderr = out, out
	cmd.SysProcAttr = childAttr(true)
	if err := cmd.Start(); err != nil {
		_ = out.Close()
		n.mu.Unlock()
		return fmt.Errorf("chaos: start rabbitmq-server: %w", err)
	}
	done := make(chan struct{})
	go func() {
		_ = cmd.Wait()
		_ = out.Close()
		close(done)
	}()
	n.cmd, n.done = cmd, done
	n.mu.Unlock()

	deadline := time.Now().Add(90 * time.Second)
	for {
		select {
		case <-done:
			return fmt.Errorf("chaos: rabbitmq-server exited during start; see %s", filepath.Join(n.dir, "server.out"))
		default:
		}
		conn, err := amqp.DialConfig(n.URL(), amqp.Config{Dial: amqp.DefaultDial(2 * time.Second)})
		if err == nil {
			_ = conn.Close()
			return nil
		}
		if time.Now().After(deadline) {
			n.kill()
			return fmt.Errorf("chaos: rabbitmq node did not come up in 90s: %w", err)
		}
		if !sleepCtx(ctx, 250*time.Millisecond) {
			n.kill()
			return ctx.Err()
		}
	}
}

// kill SIGKILLs the node's process group and waits for it to exit.
func (n *RabbitNode) kill() {
	n.mu.Lock()
	cmd, done := n.cmd, n.done
	n.cmd, n.done = nil, nil
	n.mu.Unlock()
	if cmd == nil {
		return
	}
	killGroup(cmd.Process.Pid)
	select {
	case <-done:
	case <-time.After(30 * time.Second):
	}
}

// Restart kills the node with SIGKILL and starts it again after down.
func (n *RabbitNode) Restart(ctx context.Context, down time.Duration) error {
	n.kill()
	sleepCtx(ctx, down)
	return n.Start(ctx)
}

// Close kills the node and removes its directory.
func (n *RabbitNode) Close() {
	n.kill()
	_ = os.RemoveAll(n.dir)
}

// ConsumerTimeouts counts the consumer_timeout expiries in the node's log
// so far.
func (n *RabbitNode) ConsumerTimeouts() int {
	b, err := os.ReadFile(filepath.Join(n.dir, "log", strings.TrimSuffix(n.name, "@localhost")+"@localhost.log"))
	if err != nil {
		return 0
	}
	count := 0
	for _, line := range strings.Split(string(b), "\n") {
		if strings.Contains(line, "has timed out waiting for delivery acknowledgement") {
			count++
		}
	}
	return count
}
