package chaos

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"sync"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/redis/go-redis/v9"

	natsjs "github.com/idemq/idemq/brokers/nats"
	"github.com/idemq/idemq/brokers/redisstream"
	"github.com/idemq/idemq/consumer"
)

// The NATS JetStream and Redis Streams parts of the harness and the worker.

// Brokers served by a private server the harness starts (see NATSServer
// and RedisServer).
const (
	BrokerNATS  = "nats"
	BrokerRedis = "redis"
)

// Default server binaries.
const (
	DefaultNATSServer  = "/usr/sbin/nats-server"
	DefaultRedisServer = "/usr/bin/redis-server"
)

// HeaderID carries the message id on NATS instead of Nats-Msg-Id: the
// stream would discard a producer duplicate published within its
// duplicate window (2 minutes), so the consumers' dedup would never see
// one. The Publisher sets no Nats-Msg-Id for a Message without ID; the
// workers read the id with the runtime's Config.MessageID (see messageID).
const HeaderID = "x-chaos-id"

// Timings of the NATS and Redis workers: a killed worker's messages come
// back after NATSAckWait (NATS) or RedisMinIdle (Redis), each kept off live
// holders by the Source's keep-alive (every third of it).
const (
	NATSAckWait        = 2 * time.Second
	RedisMinIdle       = 2 * time.Second
	redisClaimInterval = 500 * time.Millisecond
	redisBlock         = 500 * time.Millisecond
)

// StreamStart is what a worker needs to consume NATS or Redis; WorkerConfig
// embeds it.
type StreamStart struct {
	NATSURL, RedisURL string
	Stream, Subject   string
}

// server is a private nats-server or redis-server process the harness owns:
// Restart SIGKILLs it (a crash) and starts it again on the same port and
// data directory.
type server struct {
	kind, bin, dir string
	port           int
	args           func() []string
	ready          func(ctx context.Context) error
	mu             sync.Mutex
	cmd            *exec.Cmd
	done           chan struct{}
}

// NATSServer is a private nats-server with JetStream on file storage in a
// temporary directory: a SIGKILL restart keeps the streams and the
// consumers' ack state (written to the OS at once).
type NATSServer struct{ server }

// RedisServer is a private redis-server with appendonly yes and
// appendfsync always in a temporary directory, and no RDB snapshots: a
// SIGKILL restart keeps every acknowledged write (streams, groups, pending
// entries), which the exactly-once invariant needs.
type RedisServer struct{ server }

// StartNATSServer starts a private nats-server; bin defaults to
// DefaultNATSServer.
func StartNATSServer(ctx context.Context, bin string) (*NATSServer, error) {
	if bin == "" {
		bin = DefaultNATSServer
	}
	s := &NATSServer{server{kind: "nats-server", bin: bin}}
	s.args = func() []string {
		return []string{"-a", "127.0.0.1", "-p", strconv.Itoa(s.port), "-js", "-sd", filepath.Join(s.dir, "js")}
	}
	s.ready = func(ctx context.Context) error {
		nc, err := nats.Connect(s.URL(), nats.Timeout(2*time.Second), nats.NoReconnect())
		if err != nil {
			return err
		}
		defer nc.Close()
		js, err := jetstream.New(nc)
		if err != nil {
			return err
		}
		actx, cancel := context.WithTimeout(ctx, 2*time.Second)
		defer cancel()
		_, err = js.AccountInfo(actx)
		return err
	}
	if err := s.init(ctx); err != nil {
		return nil, err
	}
	return s, nil
}

// URL is the server's URL.
func (s *NATSServer) URL() string { return "nats://" + s.Addr() }

// StartRedisServer starts a private redis-server; bin defaults to
// DefaultRedisServer.
func StartRedisServer(ctx context.Context, bin string) (*RedisServer, error) {
	if bin == "" {
		bin = DefaultRedisServer
	}
	s := &RedisServer{server{kind: "redis-server", bin: bin}}
	s.args = func() []string {
		return []string{"--bind", "127.0.0.1", "--port", strconv.Itoa(s.port), "--dir", s.dir,
			"--appendonly", "yes", "--appendfsync", "always", "--save", "", "--daemonize", "no", "--protected-mode", "no"}
	}
	s.ready = func(ctx context.Context) error {
		rdb := redis.NewClient(&redis.Options{Addr: s.Addr(), DialTimeout: 2 * time.Second, MaxRetries: -1})
		defer rdb.Close()
		pctx, cancel := context.WithTimeout(ctx, 2*time.Second)
		defer cancel()
		return rdb.Ping(pctx).Err() // LOADING while it replays the AOF
	}
	if err := s.init(ctx); err != nil {
		return nil, err
	}
	return s, nil
}

// URL is the server's URL.
func (s *RedisServer) URL() string { return "redis://" + s.Addr() + "/0" }

func (s *server) init(ctx context.Context) error {
	if _, err := os.Stat(s.bin); err != nil {
		return fmt.Errorf("chaos: %s: %w", s.kind, err)
	}
	dir, err := os.MkdirTemp("", "idemq-chaos-"+s.kind+"-")
	if err != nil {
		return fmt.Errorf("chaos: %w", err)
	}
	s.dir = dir
	if s.port, err = freePort(); err != nil {
		_ = os.RemoveAll(dir)
		return err
	}
	if err := s.Start(ctx); err != nil {
		s.Close()
		return err
	}
	return nil
}

// Addr is the server's host:port.
func (s *server) Addr() string { return net.JoinHostPort("127.0.0.1", strconv.Itoa(s.port)) }

// Start starts the server and waits until it serves.
func (s *server) Start(ctx context.Context) error {
	s.mu.Lock()
	if s.cmd != nil {
		s.mu.Unlock()
		return fmt.Errorf("chaos: %s already running", s.kind)
	}
	cmd := exec.Command(s.bin, s.args()...)
	cmd.Dir = s.dir
	out, err := os.OpenFile(filepath.Join(s.dir, "server.out"), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		s.mu.Unlock()
		return fmt.Errorf("chaos: %w", err)
	}
	cmd.Stdout, cmd.Stderr = out, out
	cmd.SysProcAttr = childAttr(true)
	if err := cmd.Start(); err != nil {
		_ = out.Close()
		s.mu.Unlock()
		return fmt.Errorf("chaos: start %s: %w", s.kind, err)
	}
	done := make(chan struct{})
	go func() {
		_ = cmd.Wait()
		_ = out.Close()
		close(done)
	}()
	s.cmd, s.done = cmd, done
	s.mu.Unlock()

	deadline := time.Now().Add(60 * time.Second)
	for {
		select {
		case <-done:
			return fmt.Errorf("chaos: %s exited during start; see %s", s.kind, filepath.Join(s.dir, "server.out"))
		default:
		}
		err := s.ready(ctx)
		if err == nil {
			return nil
		}
		if time.Now().After(deadline) {
			s.kill()
			return fmt.Errorf("chaos: %s did not come up in 60s: %w", s.kind, err)
		}
		if !sleepCtx(ctx, 100*time.Millisecond) {
			s.kill()
			return ctx.Err()
		}
	}
}

func (s *server) kill() {
	s.mu.Lock()
	cmd, done := s.cmd, s.done
	s.cmd, s.done = nil, nil
	s.mu.Unlock()
	if cmd == nil {
		return
	}
	killGroup(cmd.Process.Pid)
	select {
	case <-done:
	case <-time.After(30 * time.Second):
	}
}

// Restart kills the server with SIGKILL and starts it again after down.
func (s *server) Restart(ctx context.Context, down time.Duration) error {
	s.kill()
	sleepCtx(ctx, down)
	return s.Start(ctx)
}

// Close kills the server and removes its directory.
func (s *server) Close() {
	s.kill()
	if s.dir != "" {
		_ = os.RemoveAll(s.dir)
	}
}

// --- harness side ---

// setupStream creates the scenario's stream: on NATS the work stream and
// its dead-letter stream (file storage), on Redis only a name (the Sources
// create the stream and the group).
func (r *run) setupStream(ctx context.Context) error {
	r.stream = "idemq-chaos-" + r.s.Name + "-" + randomHex(4)
	if r.s.Broker != BrokerNATS {
		return nil
	}
	r.subject = "idemq.chaos." + r.stream
	return r.h.withRetry(ctx, func() error {
		nc, err := nats.Connect(r.natsURL(), nats.Timeout(5*time.Second))
		if err != nil {
			return err
		}
		defer nc.Close()
		js, err := jetstream.New(nc)
		if err != nil {
			return err
		}
		replicas := 1
		if r.s.Cluster {
			replicas = ClusterSize
		}
		for _, sc := range []jetstream.StreamConfig{
			{Name: r.stream, Subjects: []string{r.subject}, Replicas: replicas},
			{Name: r.stream + natsjs.DLQStreamSuffix, Subjects: []string{natsjs.DLQSubject(r.subject)}, Replicas: replicas},
		} {
			if _, err := js.CreateStream(ctx, sc); err != nil && !errors.Is(err, jetstream.ErrStreamNameAlreadyInUse) {
				return err
			}
		}
		return nil
	})
}

// streamPublisher returns the publish function of a NATS or Redis scenario
// and its close.
func (r *run) streamPublisher(ctx context.Context) (func(context.Context, []*consumer.Message) error, func(), error) {
	switch r.s.Broker {
	case BrokerNATS:
		var p *natsjs.Publisher
		err := r.h.withRetry(ctx, func() error {
			var err error
			p, err = natsjs.NewPublisher(ctx, natsjs.PublisherConfig{URL: r.natsURL()})
			return err
		})
		if err != nil {
			return nil, nil, err
		}
		return func(ctx context.Context, msgs []*consumer.Message) error {
			out := make([]*consumer.Message, len(msgs))
			for i, m := range msgs {
				h := map[string]string{HeaderID: m.ID}
				for k, v := range m.Headers {
					h[k] = v
				}
				out[i] = &consumer.Message{Key: m.Key, Body: m.Body, Headers: h}
			}
			return p.Publish(ctx, r.subject, out...)
		}, func() { _ = p.Close() }, nil
	default:
		var p *redisstream.Publisher
		err := r.h.withRetry(ctx, func() error {
			var err error
			p, err = redisstream.NewPublisher(ctx, redisstream.PublisherConfig{URL: r.h.redisSrv.URL(), DialTimeout: 2 * time.Second})
			return err
		})
		if err != nil {
			return nil, nil, err
		}
		return func(ctx context.Context, msgs []*consumer.Message) error {
			_, err := p.Publish(ctx, r.stream, msgs...)
			return err
		}, func() { _ = p.Close() }, nil
	}
}

// natsURL is the URL of the scenario's NATS server, or of every server of
// its cluster, comma-separated.
func (r *run) natsURL() string {
	if r.s.Cluster {
		return r.h.natsCluster.URLs()
	}
	return r.h.natsSrv.URL()
}

// streamStart is what the scenario's workers connect to.
func (r *run) streamStart() StreamStart {
	st := StreamStart{Stream: r.stream, Subject: r.subject}
	if r.s.Broker == BrokerNATS {
		st.NATSURL = r.natsURL()
	}
	if r.h.redisSrv != nil {
		st.RedisURL = r.h.redisSrv.URL()
	}
	return st
}

// --- worker side ---

// streamSource opens a worker's NATS or Redis Source, retrying while the
// server restarts; it returns nil, nil if ctx ends first.
func streamSource(ctx context.Context, cfg WorkerConfig) (consumer.Source, error) {
	open := func() (consumer.Source, error) {
		if cfg.Broker == BrokerNATS {
			return natsjs.NewSource(ctx, natsjs.Config{
				URL:     cfg.NATSURL,
				Options: []nats.Option{nats.Name(fmt.Sprintf(workerConnName, cfg.Slot, cfg.Incarnation)), nats.ReconnectWait(100 * time.Millisecond)},
				Stream:  cfg.Stream,
				Subject: cfg.Subject,
				Durable: cfg.Group,
				AckWait: NATSAckWait,
				// Fixed, so that it is the bound on what one
				// process holds (the durable's, shared by all).
				MaxAckPending: cfg.Prefetch,
			})
		}
		return redisstream.NewSource(ctx, redisstream.Config{
			URL:    cfg.RedisURL,
			Stream: cfg.Stream,
			Group:  cfg.Group,
			// A name per slot: a restarted incarnation takes back
			// its predecessor's pending entries at once.
			Consumer:      fmt.Sprintf("slot-%d", cfg.Slot),
			MinIdle:       RedisMinIdle,
			ClaimInterval: redisClaimInterval,
			Block:         redisBlock,
			RequireAOF:    true,
			DialTimeout:   2 * time.Second,
		})
	}
	for {
		src, err := open()
		if err == nil {
			return src, nil
		}
		var ce *consumer.ConfigError
		if errors.As(err, &ce) {
			return nil, fmt.Errorf("%s source: %w", cfg.Broker, err)
		}
		if !sleepCtx(ctx, 250*time.Millisecond) {
			return nil, nil
		}
	}
}
