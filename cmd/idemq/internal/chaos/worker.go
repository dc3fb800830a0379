package chaos

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"os"
	"os/signal"
	"runtime"
	"strconv"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	kafkago "github.com/segmentio/kafka-go"
	"github.com/twmb/franz-go/pkg/kgo"
	"go.uber.org/goleak"

	"github.com/idemq/idemq/brokers/franz"
	"github.com/idemq/idemq/brokers/kafka"
	"github.com/idemq/idemq/brokers/rabbitmq"
	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/consumer/dedup"
	"github.com/idemq/idemq/processed"
)

// WorkerEnv is the environment variable holding a worker's JSON
// WorkerConfig. A process started with it set runs RunWorker.
const WorkerEnv = "IDEMQ_CHAOS_WORKER"

// HeaderCopy carries the publish-copy id of each delivery: unique per
// Publish call of a message, so that a broker redelivery of one copy can be
// told from a producer duplicate (another copy of the same id).
const HeaderCopy = "x-chaos-copy"

// Modes of a worker's runtime.
const (
	ModeDefault = "default" // the runtime's defaults: a per-message Handler, deliveries already waiting grouped
	ModeMessage = "message" // strict: one transaction per message (BatchSize 1)
	ModeBatch   = "batch"   // batch mode with a per-message Handler, waiting to fill batches
)

// Brokers.
const (
	BrokerRabbitMQ = "rabbitmq"
	BrokerKafka    = "kafka"
)

// Kafka sources (Scenario.KafkaSource).
const (
	SourceKafkaGo = "kafka-go" // brokers/kafka
	SourceFranz   = "franz"    // brokers/franz: franz-go, read_committed
)

// WorkerConfig is what one consumer process runs with. The harness passes
// it as JSON in WorkerEnv.
type WorkerConfig struct {
	Slot, Incarnation int
	Broker            string
	AMQPURL, Queue    string
	KafkaBrokers      []string
	Topic, Group      string
	DatabaseURL       string
	Schema            string // holds processed_messages, effects and dead_letters
	Consumer          string // the runtime's Name: the dedup scope
	Mode              string
	Concurrency       int
	BatchSize         int
	Prefetch          int // RabbitMQ basic.qos, Kafka MaxInFlight per partition
	KafkaCommitEvery  time.Duration
	KafkaSource       string // SourceKafkaGo or SourceFranz
	Partitions        int    // of the Kafka topic
	StreamStart              // NATS and Redis
	LogPath           string // the delivery log this incarnation appends to
	Seed              uint64

	// AMQPFailoverURLs are the other nodes of a RabbitMQ cluster
	// (rabbitmq.Config.FailoverURLs).
	AMQPFailoverURLs []string
	// AMQPDefaultReconnect leaves the Source's Reconnect at the rabbitmq
	// package's defaults instead of the harness's faster 50ms to 1s.
	AMQPDefaultReconnect bool

	// KillAfterCommits, if positive, makes the worker SIGKILL itself in
	// the HookApplied hook of its Nth applied message: after COMMIT,
	// before the ack.
	KillAfterCommits int
	// PGResetRate is the probability that the Postgres proxy resets the
	// connection at a COMMIT (half after forwarding it: an ambiguous
	// commit; half before).
	PGResetRate float64
	// PGLatency is added to every statement sent to Postgres.
	PGLatency time.Duration
	// AMQPDropEvery, if positive, drops the AMQP connection in the
	// HookApplied hook of every Nth applied message: after COMMIT, before
	// the ack.
	AMQPDropEvery int
	// SlowEvery, if positive, makes the handler sleep SlowFor on
	// (about) one message in SlowEvery, holding its delivery unacked.
	SlowEvery int
	SlowFor   time.Duration
	// Sabotage breaks the worker on purpose, to prove the checker catches
	// it: SabotageEffectOutsideTx writes the effect outside the dedup
	// transaction.
	Sabotage string
	// Partitioned and Retention configure the dedup store and the
	// janitor (see Scenario.Partitioned).
	Partitioned bool
	Retention   time.Duration
	// ShardURLs, if set, are the databases of a sharded dedup store (see
	// Scenario.Shards), routed by a map of ShardMap shards, and during a
	// reshard PreviousShards before it.
	ShardURLs                []string
	ShardMap, PreviousShards int
}

// SabotageEffectOutsideTx makes the handler write its effect on its own
// connection, outside the dedup transaction: a rolled-back or ambiguous
// commit then leaves an effect behind, and the retry adds another.
const SabotageEffectOutsideTx = "effect-outside-tx"

// SabotageAsyncStandby, on a PGFailover scenario, makes the standby stream
// asynchronously and lag by a second when the primary crashes: commits
// answered on the primary, and acked, are missing on the promoted standby,
// so their messages are lost (the failure synchronous replication
// prevents; see docs/clusters.md).
const SabotageAsyncStandby = "async-standby"

// Delivery-log line kinds. Each line is "<kind> <unix nanos> <fields...>",
// written with one unbuffered write, so it survives a SIGKILL.
const (
	logStart    = "S" // S <t> <pid>
	logReceived = "R" // R <t> <copy> <id> <redelivered 0|1>
	logSelfKill = "K" // K <t> <reason>
	logExit     = "X" // X <t> <json exit report>
	logSlow     = "W" // W <t> <copy>: a handler starts sleeping SlowFor
	logFault    = "F" // F <t> <kind>: the worker injected a fault
)

// ExitReport is what a worker writes at a graceful exit.
type ExitReport struct {
	Stats           consumer.Stats
	GoroutinesStart int
	GoroutinesEnd   int
	Leaked          []string // goroutine stacks goleak found after everything was closed
	PGProxy         ProxyStats
	AMQPProxy       ProxyStats
	RunError        string `json:",omitempty"`
}

// WorkerMain runs a worker from the WorkerEnv environment variable, or a
// chain service from ChainServiceEnv, and returns the process exit code.
// Call it from main (or TestMain) when either is set.
func WorkerMain() int {
	if os.Getenv(ChainServiceEnv) != "" {
		return chainServiceMain()
	}
	var cfg WorkerConfig
	if err := json.Unmarshal([]byte(os.Getenv(WorkerEnv)), &cfg); err != nil {
		fmt.Fprintf(os.Stderr, "chaos worker: bad %s: %v\n", WorkerEnv, err)
		return 2
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, os.Interrupt)
	defer stop()
	if err := RunWorker(ctx, cfg, os.Stderr); err != nil {
		fmt.Fprintf(os.Stderr, "chaos worker %d.%d: %v\n", cfg.Slot, cfg.Incarnation, err)
		return 1
	}
	return 0
}

// dlog is an append-only delivery log.
type dlog struct {
	mu sync.Mutex
	f  *os.File
}

func (l *dlog) line(kind string, fields ...string) {
	b := make([]byte, 0, 96)
	b = append(b, kind...)
	b = append(b, ' ')
	b = strconv.AppendInt(b, time.Now().UnixNano(), 10)
	for _, f := range fields {
		b = append(b, ' ')
		b = append(b, f...)
	}
	b = append(b, '\n')
	l.mu.Lock()
	_, _ = l.f.Write(b)
	l.mu.Unlock()
}

// workerHooks implements the consumer hooks the worker needs.
type workerHooks struct {
	id func(*consumer.Message) (string, error)
	consumer.HookDefaults
	log       *dlog
	applied   atomic.Int64
	killAfter int64
	dropEvery int64
	amqp      []*Proxy // one per node
}

func (h *workerHooks) OnReceived(_ context.Context, msg *consumer.Message) {
	red := "0"
	if msg.Redelivered {
		red = "1"
	}
	id, _ := h.id(msg)
	h.log.line(logReceived, nonEmpty(msg.Header(HeaderCopy)), nonEmpty(id), red)
}

// OnApplied runs after the message's transaction committed and before its
// ack: the deterministic crash point.
func (h *workerHooks) OnApplied(_ context.Context, _ *consumer.Message, _, _ time.Duration) {
	n := h.applied.Add(1)
	if h.killAfter > 0 && n == h.killAfter {
		h.log.line(logSelfKill, "after-commit-"+strconv.FormatInt(n, 10))
		killSelf()
		select {} // never returns: the kill is on its way
	}
	if h.dropEvery > 0 && len(h.amqp) > 0 && n%h.dropEvery == 0 {
		h.log.line(logFault, "amqp-drop-after-commit")
		for _, p := range h.amqp {
			p.DropAll()
		}
	}
}

func nonEmpty(s string) string {
	if s == "" {
		return "-"
	}
	return s
}

// RunWorker consumes until ctx is done, then stops gracefully, checks for
// leaked goroutines and writes its exit report to the delivery log.
func RunWorker(ctx context.Context, cfg WorkerConfig, stderr io.Writer) error {
	f, err := os.OpenFile(cfg.LogPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return err
	}
	defer f.Close()
	log := &dlog{f: f}
	log.line(logStart, strconv.Itoa(os.Getpid()))

	snapshot := goleak.IgnoreCurrent()
	report := ExitReport{GoroutinesStart: runtime.NumGoroutine()}
	runErr := runWorker(ctx, cfg, log, &report)
	if runErr != nil {
		report.RunError = runErr.Error()
	}
	// goleak retries for about a second; give slow teardowns (kafka-go
	// closes its connections asynchronously) a few more.
	var leakErr error
	for try := 0; try < 5; try++ {
		if leakErr = goleak.Find(snapshot); leakErr == nil {
			break
		}
	}
	if leakErr != nil {
		report.Leaked = []string{leakErr.Error()}
	}
	report.GoroutinesEnd = runtime.NumGoroutine()
	b, _ := json.Marshal(report)
	log.line(logExit, string(b))
	return runErr
}

func runWorker(ctx context.Context, cfg WorkerConfig, log *dlog, report *ExitReport) error {
	rng := rand.New(rand.NewPCG(cfg.Seed, uint64(cfg.Slot)<<32|uint64(cfg.Incarnation)))
	var rngMu sync.Mutex
	chance := func(p float64) bool {
		rngMu.Lock()
		defer rngMu.Unlock()
		return rng.Float64() < p
	}

	// open makes a pool on dbURL: through a proxy that resets connections
	// at COMMIT and adds latency, or directly for a multi-host URL (a
	// PGFailover scenario's, which has neither fault), so that pgx can
	// pick the host that accepts writes. Its proxy's counts are added to
	// the report when the worker ends.
	var cleanups []func()
	defer func() {
		for i := len(cleanups) - 1; i >= 0; i-- {
			cleanups[i]()
		}
	}()
	open := func(dbURL string) (*pgxpool.Pool, error) {
		pcfg, err := pgxpool.ParseConfig(dbURL)
		if err != nil {
			return nil, fmt.Errorf("parse database url: %w", err)
		}
		if len(pcfg.ConnConfig.Fallbacks) == 0 {
			pgTarget, err := hostPort(dbURL)
			if err != nil {
				return nil, err
			}
			pgProxy, err := NewProxy(pgTarget, ProxyOptions{Postgres: true, OnCommit: func() CommitAction {
				if cfg.PGResetRate <= 0 || !chance(cfg.PGResetRate) {
					return CommitPass
				}
				if chance(0.5) {
					log.line(logFault, "pg-reset-after-commit")
					return CommitResetAfter
				}
				log.line(logFault, "pg-reset-before-commit")
				return CommitResetBefore
			}})
			if err != nil {
				return nil, err
			}
			cleanups = append(cleanups, func() {
				pgProxy.Close()
				st, sum := pgProxy.Stats(), &report.PGProxy
				sum.Conns, sum.Commits, sum.Dropped = sum.Conns+st.Conns, sum.Commits+st.Commits, sum.Dropped+st.Dropped
				sum.ResetsAfter, sum.ResetsBefore = sum.ResetsAfter+st.ResetsAfter, sum.ResetsBefore+st.ResetsBefore
			})
			pgProxy.SetLatency(cfg.PGLatency)
			pcfg.ConnConfig.Host, pcfg.ConnConfig.Port = "127.0.0.1", uint16(portOf(pgProxy.Addr()))
		}
		pcfg.ConnConfig.ConnectTimeout = 5 * time.Second
		pcfg.MaxConns = int32(cfg.Concurrency + 4)
		pcfg.HealthCheckPeriod = 500 * time.Millisecond
		pool, err := pgxpool.NewWithConfig(ctx, pcfg)
		if err != nil {
			return nil, fmt.Errorf("pool: %w", err)
		}
		cleanups = append(cleanups, pool.Close)
		return pool, nil
	}
	pool, err := open(cfg.DatabaseURL)
	if err != nil {
		return err
	}
	var store dedup.Store
	if len(cfg.ShardURLs) == 0 {
		if store, err = processed.New(pool, processed.Config{Schema: cfg.Schema, Partitioned: cfg.Partitioned}); err != nil {
			return err
		}
	} else {
		// The claims and the effects go to the shards; the dead letters
		// to the scenario's database.
		var shards []*processed.Store
		for _, u := range cfg.ShardURLs {
			p, err := open(u)
			if err != nil {
				return err
			}
			st, err := processed.New(p, processed.Config{Schema: cfg.Schema})
			if err != nil {
				return err
			}
			shards = append(shards, st)
		}
		sc := processed.ShardedConfig{Map: processed.ShardMap{Shards: cfg.ShardMap}}
		if cfg.PreviousShards > 0 {
			sc.Previous = &processed.ShardMap{Shards: cfg.PreviousShards}
		}
		sharded, err := processed.NewSharded(shards, sc)
		if err != nil {
			return err
		}
		store = sharded
	}

	msgID := messageID(cfg.Broker)
	hooks := &workerHooks{id: msgID, log: log, killAfter: int64(cfg.KillAfterCommits), dropEvery: int64(cfg.AMQPDropEvery)}
	var src consumer.Source
	switch cfg.Broker {
	case BrokerRabbitMQ:
		// A proxy in front of each node, to drop connections.
		var urls []string
		for _, u := range append([]string{cfg.AMQPURL}, cfg.AMQPFailoverURLs...) {
			target, err := amqpHostPort(u)
			if err != nil {
				return err
			}
			amqpProxy, err := NewProxy(target, ProxyOptions{})
			if err != nil {
				return err
			}
			defer func() {
				amqpProxy.Close()
				st, sum := amqpProxy.Stats(), &report.AMQPProxy
				sum.Conns, sum.Commits, sum.Dropped = sum.Conns+st.Conns, sum.Commits+st.Commits, sum.Dropped+st.Dropped
				sum.ResetsAfter, sum.ResetsBefore = sum.ResetsAfter+st.ResetsAfter, sum.ResetsBefore+st.ResetsBefore
			}()
			hooks.amqp = append(hooks.amqp, amqpProxy)
			urls = append(urls, "amqp://guest:guest@"+amqpProxy.Addr()+"/")
		}
		reconnect := rabbitmq.ReconnectConfig{InitialInterval: 50 * time.Millisecond, MaxInterval: time.Second}
		if cfg.AMQPDefaultReconnect {
			reconnect = rabbitmq.ReconnectConfig{}
		}
		// The first dial may meet a broker that is restarting: retry it
		// until ctx is done.
		var s *rabbitmq.Source
		for {
			s, err = rabbitmq.NewSource(ctx, rabbitmq.Config{
				URL:            urls[0],
				FailoverURLs:   urls[1:],
				Queue:          cfg.Queue,
				Prefetch:       cfg.Prefetch,
				ConnectionName: fmt.Sprintf(workerConnName, cfg.Slot, cfg.Incarnation),
				Reconnect:      reconnect,
				DialTimeout:    5 * time.Second,
			})
			if err == nil {
				break
			}
			var ce *consumer.ConfigError
			if errors.As(err, &ce) {
				return fmt.Errorf("rabbitmq source: %w", err)
			}
			if !sleepCtx(ctx, 250*time.Millisecond) {
				return nil // stopped before the broker came back
			}
		}
		src = s
	case BrokerKafka:
		if cfg.KafkaSource == SourceFranz {
			s, err := franz.NewSource(franz.Config{
				Brokers:        cfg.KafkaBrokers,
				Topic:          cfg.Topic,
				Group:          cfg.Group,
				CommitInterval: cfg.KafkaCommitEvery,
				// franz bounds the records in flight across partitions;
				// brokers/kafka bounds them per partition.
				MaxInFlight:       cfg.Prefetch * max(cfg.Partitions, 1),
				DrainTimeout:      time.Second,
				SessionTimeout:    KafkaSessionTimeout,
				HeartbeatInterval: 200 * time.Millisecond,
				RebalanceTimeout:  4 * time.Second,
				FetchMaxWait:      100 * time.Millisecond,
				Options:           []kgo.Opt{kgo.ClientID(fmt.Sprintf(kafkaClientID, cfg.Slot, cfg.Incarnation))},
			})
			if err != nil {
				return fmt.Errorf("franz source: %w", err)
			}
			src = s
			break
		}
		s, err := kafka.NewSource(kafka.Config{
			Brokers:           cfg.KafkaBrokers,
			Topic:             cfg.Topic,
			GroupID:           cfg.Group,
			CommitInterval:    cfg.KafkaCommitEvery,
			MaxInFlight:       cfg.Prefetch,
			DrainTimeout:      time.Second,
			SessionTimeout:    KafkaSessionTimeout,
			HeartbeatInterval: 200 * time.Millisecond,
			RebalanceTimeout:  4 * time.Second,
			JoinGroupBackoff:  100 * time.Millisecond,
			FetchMaxWait:      100 * time.Millisecond,
			// The client id names the incarnation, so that the harness can
			// tell a group member whose process has exited.
			Dialer: &kafkago.Dialer{Timeout: 10 * time.Second, DualStack: true,
				ClientID: fmt.Sprintf(kafkaClientID, cfg.Slot, cfg.Incarnation)},
		})
		if err != nil {
			return fmt.Errorf("kafka source: %w", err)
		}
		src = s
	case BrokerNATS, BrokerRedis:
		s, err := streamSource(ctx, cfg)
		if err != nil || s == nil {
			return err // nil: stopped before the server came back
		}
		src = s
	default:
		return fmt.Errorf("unknown broker %q", cfg.Broker)
	}

	insertEffect := fmt.Sprintf(`INSERT INTO %s.effects (msg_id, copy, slot, incarnation) VALUES ($1, $2, $3, $4)`, pgx.Identifier{cfg.Schema}.Sanitize())
	handler := func(ctx context.Context, tx pgx.Tx, msg *consumer.Message) error {
		if cfg.SlowEvery > 0 && chance(1/float64(cfg.SlowEvery)) {
			log.line(logSlow, nonEmpty(msg.Header(HeaderCopy)))
			if !sleepCtx(ctx, cfg.SlowFor) {
				return ctx.Err()
			}
		}
		id, err := msgID(msg)
		if err != nil {
			return err
		}
		if cfg.Sabotage == SabotageEffectOutsideTx {
			_, err := pool.Exec(ctx, insertEffect, id, msg.Header(HeaderCopy), cfg.Slot, cfg.Incarnation)
			return err
		}
		_, err = tx.Exec(ctx, insertEffect, id, msg.Header(HeaderCopy), cfg.Slot, cfg.Incarnation)
		return err
	}
	rcfg := consumer.Config{
		Name:            cfg.Consumer,
		Source:          src,
		Store:           store,
		Handler:         handler,
		MessageID:       msgID,
		DeadLetterer:    &tableDeadLetterer{pool: pool, schema: cfg.Schema},
		Concurrency:     cfg.Concurrency,
		ShutdownTimeout: 10 * time.Second,
		Retry:           consumer.RetryConfig{MaxAttempts: 10, InitialInterval: 20 * time.Millisecond, MaxInterval: 500 * time.Millisecond, MaxElapsed: 30 * time.Second},
		Hooks:           []consumer.Hook{hooks},
		Logger:          debugLogger(), // the Sources' logger too, through Configure
	}
	if cfg.Partitioned {
		// The janitor rotates the generations every half retention;
		// the harness's holder keeps it from retiring any (see
		// Scenario.Partitioned).
		rcfg.Retention, rcfg.JanitorInterval = cfg.Retention, max(cfg.Retention/20, 100*time.Millisecond)
	}
	switch cfg.Mode {
	case ModeMessage:
		rcfg.BatchSize = 1
	case ModeBatch:
		rcfg.BatchSize = cfg.BatchSize
		rcfg.BatchWait = 10 * time.Millisecond
	}
	rt, err := consumer.New(rcfg)
	if err != nil {
		_ = src.Close()
		return err
	}
	err = rt.Run(ctx)
	report.Stats = rt.Stats()
	if err != nil && !errors.Is(err, context.Canceled) {
		return err
	}
	return nil
}

// workerConnName is the AMQP or NATS connection name of worker
// slot.incarnation, by which the cluster faults find the workers' nodes.
const workerConnName = "idemq-chaos-%d.%d"

// kafkaClientID is the Kafka client id of worker slot.incarnation.
const kafkaClientID = "idemq-chaos-%d.%d"

// KafkaSessionTimeout is the group session timeout of Kafka workers: a
// killed member's partitions move after this long.
const KafkaSessionTimeout = 1500 * time.Millisecond

// tableDeadLetterer stores dead letters in the schema's dead_letters table.
// The workload has no poison messages, so any row there is a finding.
type tableDeadLetterer struct {
	pool   *pgxpool.Pool
	schema string
}

func (d *tableDeadLetterer) DeadLetter(ctx context.Context, msg *consumer.Message, f consumer.Failure) error {
	_, err := d.pool.Exec(ctx, fmt.Sprintf(`INSERT INTO %s.dead_letters (msg_id, class, reason) VALUES ($1, $2, $3)`,
		pgx.Identifier{d.schema}.Sanitize()), f.MessageID, string(f.Class), fmt.Sprint(f.Err))
	return err
}

// messageID is a worker's dedup id, for the runtime's Config.MessageID and
// for what the handler and hooks record: on NATS the id travels in
// HeaderID, elsewhere it is the broker's message id.
func messageID(broker string) func(*consumer.Message) (string, error) {
	if broker == BrokerNATS {
		return consumer.IDFromHeader(HeaderID)
	}
	return func(m *consumer.Message) (string, error) { return m.ID, nil }
}

// debugLogger logs at debug level to stderr (the scenario's workers.stderr)
// when CHAOS_DEBUG is set in the worker's environment, and discards
// otherwise. Every line names the worker's pid, which its delivery log's
// first line (S) gives: the workers of a scenario share workers.stderr.
func debugLogger() *slog.Logger {
	if os.Getenv("CHAOS_DEBUG") == "" {
		return slog.New(slog.DiscardHandler)
	}
	return slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelDebug})).
		With(slog.Int("pid", os.Getpid()))
}
