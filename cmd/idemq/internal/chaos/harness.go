package chaos

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	mrand "math/rand/v2"
	"net"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/idemq/idemq/brokers/kafka"
	"github.com/idemq/idemq/brokers/rabbitmq"
	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/consumer/dedup"
	"github.com/idemq/idemq/internal/kafkatest"
	"github.com/idemq/idemq/internal/natstest"
	"github.com/idemq/idemq/processed"
)

// Config configures a harness Run. The zero value of every optional field
// selects a documented default.
type Config struct {
	// Scenarios run one after another. Required.
	Scenarios []Scenario
	// WorkerCommand is the command line that starts a consumer process;
	// the process must call WorkerMain when WorkerEnv is set (it is set
	// in its environment). Required.
	WorkerCommand []string
	// DatabaseURL is the Postgres the workers write to, each scenario in
	// a fresh schema. Defaults to a private cluster the harness starts
	// (initdb into a temporary directory) and removes at the end; that is
	// required for PGRestarts.
	DatabaseURL string
	// AMQPURL is the RabbitMQ broker. Defaults to a private node the
	// harness starts and removes at the end, with ConsumerTimeout; that
	// is required for RabbitRestarts and for a meaningful SlowFor. Cluster
	// scenarios always run on a private cluster the harness starts
	// (StartRabbitCluster).
	AMQPURL string
	// ConsumerTimeout is the private RabbitMQ node's consumer_timeout.
	// Defaults to 5s.
	ConsumerTimeout time.Duration
	// PGBin is the directory of initdb and pg_ctl. Defaults to
	// DefaultPGBin.
	PGBin string
	// RabbitMQServer is the rabbitmq-server script. Defaults to
	// DefaultRabbitMQServer.
	RabbitMQServer string
	// NATSServer and RedisServer are the binaries of the private NATS
	// and Redis servers the harness starts for NATS and Redis scenarios
	// (there is no shared one: they are restarted). Default to
	// DefaultNATSServer and DefaultRedisServer.
	NATSServer, RedisServer string
	// Seed makes the fault schedule and the workload reproducible.
	// Defaults to a random seed.
	Seed uint64
	// Dir holds the scenarios' delivery logs and worker output. Defaults
	// to a temporary directory, removed at the end unless a scenario
	// failed or KeepDir is set.
	Dir     string
	KeepDir bool
	// Progress, if set, is called about twice a second.
	Progress func(Progress)
	// Events, if set, receives one line per injected fault and phase.
	Events io.Writer
}

// Progress is a snapshot of the running scenario.
type Progress struct {
	Scenario            string
	Index, Of           int
	Published, Messages int // ids confirmed, ids in the workload
	Processed           int // ids in processed_messages
	Kills               int // SIGKILLs so far (nemesis and self)
	Faults              int // other faults injected so far
	Elapsed             time.Duration
	Phase               string
}

// Result is one scenario's outcome.
type Result struct {
	Scenario           string
	Broker             string
	Mode               string
	Faults             string
	Messages           int // distinct ids in the workload
	Publishes          int // Publish calls made for the workload, retries included
	ProducerDuplicates int // extra copies of ids, each a separate publish
	Verdict            Verdict
	// ShardEffects counts, in a sharded scenario, the effects on each
	// shard.
	ShardEffects []int `json:",omitempty"`
	// Kills are the SIGKILLs that hit a consumer process: from the
	// nemesis (KillsRandom) and self-inflicted after COMMIT, before the
	// ack (KillsAfterCommit).
	Kills, KillsRandom, KillsAfterCommit int
	// Injected counts the other faults actually injected, by kind.
	Injected map[string]int64
	// Redeliveries and their bound (prefetch or partitions*MaxInFlight).
	Redeliveries    Redeliveries
	RedeliveryBound int
	BoundChecked    bool
	// Incarnations is the number of consumer processes started.
	Incarnations int
	// GracefulExits is the number of processes that exited on SIGTERM and
	// reported; LeakyExits of those found leaked goroutines.
	GracefulExits, LeakyExits int
	Leaks                     []string `json:",omitempty"`
	// Stall is the longest time without an apply: overall while a
	// confirmed message waited for its effect, and per worker slot while
	// messages were being published. StallBound is the bound checked (0:
	// not checked).
	Stall      Stall
	StallBound time.Duration
	// MaxStallBound and SlotStallBound are the bounds the longest gap
	// overall and the longest of one worker slot were held to:
	// StallBound, or more in a NATS cluster scenario whose cluster
	// confirmed no publish for part of that gap (stallBound).
	MaxStallBound, SlotStallBound time.Duration
	// PublishStall is the longest time between two confirmed publishes.
	PublishStall time.Duration
	// LeftInQueue is the RabbitMQ queue depth at the end (already-applied
	// redeliveries requeued at shutdown).
	LeftInQueue int
	Duration    time.Duration
	// Failures explains why the scenario failed; empty if it passed.
	Failures []string `json:",omitempty"`
	Dir      string   `json:",omitempty"`
}

// Passed reports whether the scenario passed.
func (r Result) Passed() bool { return len(r.Failures) == 0 }

// Run runs every scenario and returns their results. It returns an error
// only if the harness itself could not run (a service would not start); a
// scenario that breaks the promise is a Result with Failures.
func Run(ctx context.Context, cfg Config) ([]Result, error) {
	if len(cfg.Scenarios) == 0 {
		return nil, errors.New("chaos: no scenarios")
	}
	if len(cfg.WorkerCommand) == 0 {
		return nil, errors.New("chaos: WorkerCommand is required")
	}
	needPG, needRabbit := false, false
	needNATS, needRedis := false, false
	for i := range cfg.Scenarios {
		s := cfg.Scenarios[i].withDefaults()
		if err := s.validate(); err != nil {
			return nil, err
		}
		if s.PGRestarts > 0 && cfg.DatabaseURL != "" {
			return nil, fmt.Errorf("%w: scenario %q restarts Postgres but DatabaseURL is set", errNeedsPrivate, s.Name)
		}
		if (s.RabbitRestarts > 0) && cfg.AMQPURL != "" {
			return nil, fmt.Errorf("%w: scenario %q restarts RabbitMQ but AMQPURL is set", errNeedsPrivate, s.Name)
		}
		needRabbit = needRabbit || s.Broker == BrokerRabbitMQ && !s.Cluster || s.Broker == BrokerChain
		needNATS = needNATS || s.Broker == BrokerNATS && !s.Cluster || s.Broker == BrokerChain
		needRedis = needRedis || s.Broker == BrokerRedis
		needPG = true
		cfg.Scenarios[i] = s
	}
	if cfg.Seed == 0 {
		cfg.Seed = mrand.Uint64()
	}
	if cfg.ConsumerTimeout == 0 {
		cfg.ConsumerTimeout = 5 * time.Second
	}
	if cfg.Events == nil {
		cfg.Events = io.Discard
	}
	h := &harness{cfg: cfg}
	if cfg.Dir == "" {
		dir, err := os.MkdirTemp("", "idemq-chaos-")
		if err != nil {
			return nil, fmt.Errorf("chaos: %w", err)
		}
		h.dir = dir
	} else {
		h.dir = cfg.Dir
		if err := os.MkdirAll(h.dir, 0o755); err != nil {
			return nil, fmt.Errorf("chaos: %w", err)
		}
	}
	// Workers run as us; if we are root and the private cluster runs as
	// postgres, nothing else needs the directory.
	defer h.closeServices()

	if needPG && cfg.DatabaseURL == "" {
		h.event("starting a private Postgres cluster")
		c, err := StartPGCluster(ctx, cfg.PGBin)
		if err != nil {
			return nil, err
		}
		h.pg = c
		h.dbURL = c.URL()
	} else {
		h.dbURL = cfg.DatabaseURL
	}
	if needRabbit && cfg.AMQPURL == "" {
		h.event("starting a private RabbitMQ node (consumer_timeout %s)", cfg.ConsumerTimeout)
		n, err := StartRabbitNode(ctx, cfg.RabbitMQServer, cfg.ConsumerTimeout)
		if err != nil {
			return nil, err
		}
		h.rabbit = n
		h.amqpURL = n.URL()
	} else {
		h.amqpURL = cfg.AMQPURL
	}
	if needNATS {
		h.event("starting a private nats-server (JetStream, file storage)")
		s, err := StartNATSServer(ctx, cfg.NATSServer)
		if err != nil {
			return nil, err
		}
		h.natsSrv = s
	}
	if needRedis {
		h.event("starting a private redis-server (appendonly yes, appendfsync always)")
		s, err := StartRedisServer(ctx, cfg.RedisServer)
		if err != nil {
			return nil, err
		}
		h.redisSrv = s
	}
	pool, err := pgxpool.New(ctx, h.dbURL)
	if err != nil {
		return nil, fmt.Errorf("chaos: connect to postgres: %w", err)
	}
	h.pool = pool

	var results []Result
	keep := cfg.KeepDir
	for i, s := range cfg.Scenarios {
		if ctx.Err() != nil {
			break
		}
		// The clusters are started for the first scenario that needs
		// them, and closed after the last, not to weigh on the others.
		rest := cfg.Scenarios[i+1:]
		if s.Cluster && s.Broker == BrokerRabbitMQ && h.cluster == nil {
			h.event("starting a private %d-node RabbitMQ cluster", ClusterSize)
			t0 := time.Now()
			c, err := StartRabbitCluster(ctx, cfg.RabbitMQServer)
			if err != nil {
				return results, err
			}
			h.cluster = c
			h.event("RabbitMQ cluster %s up in %s", strings.Join(c.names(), ", "), time.Since(t0).Round(100*time.Millisecond))
		}
		if s.Cluster && s.Broker == BrokerNATS && h.natsCluster == nil {
			partitionable := slices.ContainsFunc(cfg.Scenarios[i:], func(s Scenario) bool { return s.NetPartitions > 0 })
			h.event("starting a private %d-server NATS cluster (partitionable: %t)", ClusterSize, partitionable)
			t0 := time.Now()
			c, err := startNATSCluster(ctx, partitionable)
			if err != nil {
				return results, err
			}
			h.natsCluster = c
			h.event("NATS cluster %s up in %s", c.URLs(), time.Since(t0).Round(100*time.Millisecond))
		}
		db := scenarioDB{url: h.dbURL, pool: h.pool}
		if s.PGFailover {
			async := s.Sabotage == SabotageAsyncStandby
			h.event("starting a private Postgres primary with a standby (asynchronous: %t)", async)
			pair, err := StartPGPair(ctx, cfg.PGBin, async)
			if err != nil {
				return results, err
			}
			pool, err := pgxpool.New(ctx, pair.URL())
			if err != nil {
				pair.Close()
				return results, fmt.Errorf("chaos: connect to postgres: %w", err)
			}
			db = scenarioDB{url: pair.URL(), pool: pool, pair: pair}
		}
		var res Result
		if s.Broker == BrokerChain {
			res, err = h.runChain(ctx, i, s)
		} else {
			res, err = h.runScenario(ctx, i, s, db)
		}
		if db.pair != nil {
			db.pool.Close()
			db.pair.Close()
		}
		if err != nil {
			return results, err
		}
		if h.cluster != nil && !slices.ContainsFunc(rest, func(s Scenario) bool { return s.Cluster && s.Broker == BrokerRabbitMQ }) {
			h.cluster.Close()
			h.cluster = nil
		}
		if h.natsCluster != nil && !slices.ContainsFunc(rest, func(s Scenario) bool { return s.Cluster && s.Broker == BrokerNATS }) {
			h.natsCluster.Close()
			h.natsCluster = nil
		}
		if !res.Passed() {
			keep = true
		}
		results = append(results, res)
	}
	if !keep && cfg.Dir == "" {
		_ = os.RemoveAll(h.dir)
	} else {
		for i := range results {
			results[i].Dir = filepath.Join(h.dir, results[i].Scenario)
		}
	}
	return results, ctx.Err()
}

type harness struct {
	cfg            Config
	dir            string
	dbURL, amqpURL string
	pg             *PGCluster
	rabbit         *RabbitNode
	cluster        *RabbitCluster
	natsCluster    *natstest.Cluster
	natsSrv        *NATSServer
	redisSrv       *RedisServer
	pool           *pgxpool.Pool
	eventMu        sync.Mutex
}

func (h *harness) closeServices() {
	if h.pool != nil {
		h.pool.Close()
	}
	if h.rabbit != nil {
		h.rabbit.Close()
	}
	if h.cluster != nil {
		h.cluster.Close()
	}
	if h.natsCluster != nil {
		h.natsCluster.Close()
	}
	if h.natsSrv != nil {
		h.natsSrv.Close()
	}
	if h.redisSrv != nil {
		h.redisSrv.Close()
	}
	if h.pg != nil {
		h.pg.Close()
	}
}

func (h *harness) event(format string, args ...any) {
	h.eventMu.Lock()
	defer h.eventMu.Unlock()
	fmt.Fprintf(h.cfg.Events, "%s chaos: %s\n", time.Now().Format("15:04:05.000"), fmt.Sprintf(format, args...))
}

// scenarioDB is the database a scenario runs on: the harness's, or a
// PGFailover scenario's own pair.
type scenarioDB struct {
	url  string
	pool *pgxpool.Pool
	pair *PGPair // nil but for PGFailover
}

// run is one scenario's state.
type run struct {
	h      *harness
	db     scenarioDB
	s      Scenario
	idx    int
	dir    string
	schema string
	rng    *mrand.Rand
	rngMu  sync.Mutex
	start  time.Time

	// broker
	queue        string
	amqpURLs     []string // the node, or the cluster's nodes
	kcluster     *kafkatest.Cluster
	kafkaBrokers []string
	topic        string
	// NATS and Redis
	stream, subject string

	// workload
	messages           int
	confirmed          sync.Map // id -> true
	attempted          sync.Map
	abortedCopy        sync.Map // id -> true: a copy was in a transaction definitely aborted
	uncertain          sync.Map // id -> true: a transactional publish of it had an unknown outcome
	confirmedN         atomic.Int64
	due                sync.Map // id -> unix nanos its first publish was due, on the schedule
	confirmTimes       []int64  // of every confirmed publish; the publisher's only
	publishes          atomic.Int64
	producerDuplicates int

	// processes
	mu           sync.Mutex
	procs        map[incKey]*proc
	logPaths     map[incKey]string
	kills        map[incKey]int64 // incarnation -> kill time (ns)
	nemesisSent  map[incKey]int64
	nextInc      map[int]int
	armed        map[incKey]bool // live incarnations armed to kill themselves after a commit
	incarnations int
	stopping     atomic.Bool
	slotsWG      sync.WaitGroup

	killsRandom, killsSelf atomic.Int64
	faults                 atomic.Int64
	injected               sync.Map // kind -> *atomic.Int64
	processedN             atomic.Int64
	phase                  atomic.Value
	exitProblems           []string

	// chain is a BrokerChain scenario's wiring; nil for the others.
	chain *chainState
	// shards are a sharded scenario's databases; nil for the others.
	shards *shardSet
}

type proc struct {
	cmd  *exec.Cmd
	done chan struct{}
	ws   syscall.WaitStatus
}

func (r *run) float() float64 {
	r.rngMu.Lock()
	defer r.rngMu.Unlock()
	return r.rng.Float64()
}

func (r *run) intn(n int) int {
	r.rngMu.Lock()
	defer r.rngMu.Unlock()
	return r.rng.IntN(n)
}

func (r *run) inject(kind string, n int64) {
	v, _ := r.injected.LoadOrStore(kind, new(atomic.Int64))
	v.(*atomic.Int64).Add(n)
	r.faults.Add(n)
}

func randomHex(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

func (h *harness) runScenario(ctx context.Context, idx int, s Scenario, db scenarioDB) (Result, error) {
	ctx, cancel := context.WithTimeout(ctx, s.Timeout)
	defer cancel()
	r := &run{h: h, db: db, s: s, idx: idx, dir: filepath.Join(h.dir, s.Name),
		schema: "chaos_" + randomHex(4), rng: mrand.New(mrand.NewPCG(h.cfg.Seed, uint64(idx))),
		procs: map[incKey]*proc{}, logPaths: map[incKey]string{}, kills: map[incKey]int64{},
		nemesisSent: map[incKey]int64{}, armed: map[incKey]bool{}, nextInc: map[int]int{}, start: time.Now()}
	r.phase.Store("setup")
	res := Result{Scenario: s.Name, Broker: s.Broker, Mode: s.Mode, Faults: s.Faults(), Messages: s.Messages,
		RedeliveryBound: s.redeliveryBound(), BoundChecked: s.CheckRedeliveryBound, StallBound: s.StallBound}
	if err := os.MkdirAll(r.dir, 0o755); err != nil {
		return res, fmt.Errorf("chaos: %w", err)
	}
	h.event("scenario %s: %s, %s mode, %d ids, faults: %s", s.Name, s.Broker, s.Mode, s.Messages, res.Faults)
	if err := r.setupDB(ctx); err != nil {
		return res, err
	}
	defer r.dropSchema()
	if s.Shards > 0 {
		defer r.closeShards()
		if err := r.startShards(ctx); err != nil {
			return res, err
		}
		// The faults' schedule, the reshard's at its middle, is over
		// the publishing window: it starts now that the clusters are up.
		r.start = time.Now()
	}
	if err := r.setupBroker(ctx); err != nil {
		return res, err
	}
	defer r.teardownBroker()

	timeouts0 := 0
	if h.rabbit != nil {
		timeouts0 = h.rabbit.ConsumerTimeouts()
	}
	progressDone := make(chan struct{})
	var progressWG sync.WaitGroup
	if h.cfg.Progress != nil {
		progressWG.Add(1)
		go func() {
			defer progressWG.Done()
			r.progressLoop(ctx, progressDone)
		}()
	}

	// Consumers first, so that publishing meets a running group.
	for slot := range s.Workers {
		r.startSlot(ctx, slot)
	}
	pubErr := make(chan error, 1)
	go func() { pubErr <- r.publish(ctx) }()
	nemesisDone := make(chan struct{})
	go func() {
		defer close(nemesisDone)
		r.nemesis(ctx)
	}()

	var failures []string
	if err := <-pubErr; err != nil {
		failures = append(failures, "publisher: "+err.Error())
	}
	<-nemesisDone
	r.phase.Store("draining")
	h.event("scenario %s: publishing and faults done; waiting for every confirmed id", s.Name)
	if err := r.waitProcessed(ctx); err != nil {
		failures = append(failures, err.Error())
	}
	r.quiesce(ctx)
	r.phase.Store("stopping")
	r.stopAll()
	close(progressDone)
	progressWG.Wait()

	res.LeftInQueue = r.queueDepth()
	res.Duration = time.Since(r.start)
	v, applies, err := r.check(context.WithoutCancel(ctx))
	if err != nil {
		return res, err
	}
	waiting := map[string]int64{} // the confirmed ids, from when they were due
	r.due.Range(func(k, v any) bool {
		if _, ok := r.confirmed.Load(k); ok {
			waiting[k.(string)] = v.(int64)
		}
		return true
	})
	var from, to int64 // the publishing window
	if v, ok := r.due.Load(r.msgID(0)); ok {
		from = v.(int64)
	}
	if n := len(r.confirmTimes); n > 0 {
		to = r.confirmTimes[n-1]
	}
	res.Stall = computeStall(waiting, applies, s.Workers, from, to, time.Now().UnixNano())
	res.PublishStall = longestGap(r.confirmTimes)
	res.Verdict = v
	res.Publishes = int(r.publishes.Load())
	res.ProducerDuplicates = r.producerDuplicates
	res.KillsRandom, res.KillsAfterCommit = int(r.killsRandom.Load()), int(r.killsSelf.Load())
	res.Kills = res.KillsRandom + res.KillsAfterCommit
	res.Injected = map[string]int64{}
	if h.rabbit != nil && s.Broker == BrokerRabbitMQ && !s.Cluster {
		res.Injected["consumer-timeout"] = int64(h.rabbit.ConsumerTimeouts() - timeouts0)
	}
	r.injected.Range(func(k, v any) bool {
		res.Injected[k.(string)] = v.(*atomic.Int64).Load()
		return true
	})

	dl, err := readLogs(r.logPaths)
	if err != nil {
		return res, err
	}
	res.Incarnations = r.incarnations
	res.Injected["slow-handler"] = int64(dl.slow)
	for kind, n := range dl.faults {
		res.Injected[kind] += n
	}
	res.Redeliveries = redeliveriesPerKill(dl, r.kills)
	for k, ex := range dl.exits {
		res.GracefulExits++
		if len(ex.Leaked) > 0 {
			res.LeakyExits++
			res.Leaks = append(res.Leaks, fmt.Sprintf("worker %d.%d: %s", k.slot, k.inc, ex.Leaked[0]))
		}
	}
	if s.Partitioned {
		// Each rotation numbered a generation past the migration's three.
		var gens int64
		if err := r.db.pool.QueryRow(context.WithoutCancel(ctx), `SELECT max(generation) - 2 FROM `+
			pgx.Identifier{r.schema, "processed_messages_generations"}.Sanitize()).Scan(&gens); err != nil {
			return res, fmt.Errorf("chaos: read the generations: %w", err)
		}
		res.Injected["rotation"] = gens
	}
	for k, v := range res.Injected {
		if v == 0 {
			delete(res.Injected, k)
		}
	}

	if !v.Pass() {
		failures = append(failures, fmt.Sprintf("exactly-once broken: %d lost, %d duplicate effects, %d unexpected, %d inconsistent, %d dead-lettered, %d of aborted transactions applied",
			len(v.Lost), len(v.Duplicates), len(v.Unexpected), len(v.Inconsistent), len(v.DeadLettered), len(v.AbortedApplied)))
	}
	if s.CheckRedeliveryBound && res.Redeliveries.Max > res.RedeliveryBound {
		failures = append(failures, fmt.Sprintf("a kill caused %d redeliveries, more than the bound %d", res.Redeliveries.Max, res.RedeliveryBound))
	}
	found, perShard, err := r.shardFindings(context.WithoutCancel(ctx))
	if err != nil {
		return res, err
	}
	failures = append(failures, found...)
	res.ShardEffects = perShard
	if s.ReshardFrom > 0 && res.Injected["reshard"] == 0 {
		failures = append(failures, "the reshard did not happen")
	}
	if s.Partitioned && res.Injected["rotation"] == 0 {
		failures = append(failures, "the dedup store's generations never rotated: no claim straddled a boundary")
	}
	if s.StallBound > 0 {
		var found []string
		res.MaxStallBound, res.SlotStallBound, found = holdStalls(s, res.Stall, r.confirmTimes, r.start.UnixNano())
		failures = append(failures, found...)
	}
	if res.LeakyExits > 0 {
		failures = append(failures, fmt.Sprintf("%d workers leaked goroutines", res.LeakyExits))
	}
	if res.GracefulExits == 0 {
		failures = append(failures, "no worker exited gracefully: the leak check did not run")
	}
	r.finish(&res, failures)
	return res, nil
}

// finish adds the failures every scenario shares (planned kills that did
// not happen, processes that died or stopped badly) to failures, sets
// them on res and reports the outcome.
func (r *run) finish(res *Result, failures []string) {
	if want := r.s.Kills + r.s.SelfKills; res.Kills < want*9/10 {
		failures = append(failures, fmt.Sprintf("only %d of %d planned kills happened", res.Kills, want))
	}
	res.Failures = append(failures, r.exitProblems...)
	status := "PASS"
	if !res.Passed() {
		status = "FAIL"
	}
	r.h.event("scenario %s: %s in %s", r.s.Name, status, res.Duration.Round(100*time.Millisecond))
}

func (r *run) progressLoop(ctx context.Context, done chan struct{}) {
	t := time.NewTicker(500 * time.Millisecond)
	defer t.Stop()
	for {
		select {
		case <-done:
			return
		case <-ctx.Done():
			return
		case <-t.C:
		}
		if r.chain != nil {
			// Keys accepted by the API, and notified.
			r.confirmedN.Store(int64(r.chain.load.acceptedN()))
			qctx, cancel := context.WithTimeout(ctx, time.Second)
			var n int64
			if err := r.db.pool.QueryRow(qctx, `SELECT count(*) FROM `+r.chain.notifications()).Scan(&n); err == nil {
				r.processedN.Store(n)
			}
			cancel()
		} else {
			qctx, cancel := context.WithTimeout(ctx, time.Second)
			if n, err := r.processedCount(qctx); err == nil {
				r.processedN.Store(n)
			}
			cancel()
		}
		r.h.cfg.Progress(Progress{Scenario: r.s.Name, Index: r.idx + 1, Of: len(r.h.cfg.Scenarios),
			Published: int(r.confirmedN.Load()), Messages: r.s.Messages, Processed: int(r.processedN.Load()),
			Kills: int(r.killsRandom.Load() + r.killsSelf.Load()), Faults: int(r.faults.Load()),
			Elapsed: time.Since(r.start), Phase: r.phase.Load().(string)})
	}
}

// --- database ---

func (r *run) setupDB(ctx context.Context) error {
	q := pgx.Identifier{r.schema}.Sanitize()
	if _, err := r.db.pool.Exec(ctx, `CREATE SCHEMA `+q); err != nil {
		return fmt.Errorf("chaos: create schema: %w", err)
	}
	store, err := processed.New(r.db.pool, processed.Config{Schema: r.schema, Partitioned: r.s.Partitioned})
	if err != nil {
		return err
	}
	if err := store.Migrate(ctx); err != nil {
		return fmt.Errorf("chaos: migrate: %w", err)
	}
	if r.s.Partitioned {
		// The holder: a row of a consumer that never purges, in the
		// generation the workers start in (see Scenario.Partitioned).
		tx, _, err := store.BeginClaim(ctx, []dedup.Claim{{Consumer: "chaos-holder", MessageID: "holder", Partition: -1, Offset: -1}})
		if err == nil {
			err = tx.Commit(ctx)
		}
		if err != nil {
			return fmt.Errorf("chaos: the holder's claim: %w", err)
		}
	}
	// No unique constraint on effects: a duplicate effect shows as a
	// second row.
	_, err = r.db.pool.Exec(ctx, `
		CREATE TABLE `+q+`.effects (msg_id text NOT NULL, copy text NOT NULL, slot int NOT NULL, incarnation int NOT NULL, at timestamptz NOT NULL DEFAULT clock_timestamp());
		CREATE TABLE `+q+`.dead_letters (msg_id text NOT NULL, class text NOT NULL, reason text NOT NULL, at timestamptz NOT NULL DEFAULT now());`)
	if err != nil {
		return fmt.Errorf("chaos: create tables: %w", err)
	}
	return nil
}

func (r *run) dropSchema() {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	_, _ = r.db.pool.Exec(ctx, `DROP SCHEMA IF EXISTS `+pgx.Identifier{r.schema}.Sanitize()+` CASCADE`)
}

// check loads the sets from the database and compares them.
func (r *run) check(ctx context.Context) (Verdict, []apply, error) {
	in := CheckInput{Confirmed: map[string]bool{}, Attempted: map[string]bool{}, Processed: map[string]bool{},
		Effects: map[string]int{}, DeadLetters: map[string]int{}}
	r.confirmed.Range(func(k, _ any) bool { in.Confirmed[k.(string)] = true; return true })
	r.attempted.Range(func(k, _ any) bool { in.Attempted[k.(string)] = true; return true })
	in.Aborted = map[string]bool{}
	r.abortedCopy.Range(func(k, _ any) bool {
		id := k.(string)
		if _, unsure := r.uncertain.Load(id); !unsure && !in.Confirmed[id] {
			in.Aborted[id] = true
		}
		return true
	})
	q := pgx.Identifier{r.schema}.Sanitize()
	loadFrom := func(pool *pgxpool.Pool, sql string, fn func(id string, n int)) error {
		var err error
		for try := 0; try < 30; try++ { // the cluster may still be recovering
			rows, qerr := pool.Query(ctx, sql)
			if qerr == nil {
				for rows.Next() {
					var id string
					var n int
					if err := rows.Scan(&id, &n); err != nil {
						rows.Close()
						return err
					}
					fn(id, n)
				}
				rows.Close()
				if err = rows.Err(); err == nil {
					return nil
				}
			} else {
				err = qerr
			}
			sleepCtx(ctx, time.Second)
		}
		return fmt.Errorf("chaos: checker query: %w", err)
	}
	// The claims and the effects are on the shards, in a sharded
	// scenario: an id's effects are counted over all of them.
	for _, pool := range r.dataPools() {
		if err := loadFrom(pool, `SELECT message_id, 1 FROM `+q+`.processed_messages WHERE consumer = '`+r.consumer()+`'`,
			func(id string, _ int) { in.Processed[id] = true }); err != nil {
			return Verdict{}, nil, err
		}
		if err := loadFrom(pool, `SELECT msg_id, count(*)::int FROM `+q+`.effects GROUP BY msg_id`,
			func(id string, n int) { in.Effects[id] += n }); err != nil {
			return Verdict{}, nil, err
		}
	}
	if err := loadFrom(r.db.pool, `SELECT msg_id, count(*)::int FROM `+q+`.dead_letters GROUP BY msg_id`,
		func(id string, n int) { in.DeadLetters[id] = n }); err != nil {
		return Verdict{}, nil, err
	}
	var applies []apply
	for _, pool := range r.dataPools() {
		rows, err := pool.Query(ctx, `SELECT msg_id, slot, (extract(epoch FROM at) * 1000000)::bigint FROM `+q+`.effects`)
		if err != nil {
			return Verdict{}, nil, fmt.Errorf("chaos: checker query: %w", err)
		}
		for rows.Next() {
			var a apply
			if err := rows.Scan(&a.id, &a.slot, &a.t); err != nil {
				rows.Close()
				return Verdict{}, nil, err
			}
			a.t *= 1000
			applies = append(applies, a)
		}
		rows.Close()
		if err := rows.Err(); err != nil {
			return Verdict{}, nil, fmt.Errorf("chaos: checker query: %w", err)
		}
	}
	return Check(in), applies, nil
}

// processedCount counts the ids with a dedup row: over every shard, each
// id once (during a reshard a duplicate's claim copies its row to the new
// shard).
func (r *run) processedCount(ctx context.Context) (int64, error) {
	q := fmt.Sprintf(`SELECT count(*) FROM %s.processed_messages WHERE consumer = $1`, pgx.Identifier{r.schema}.Sanitize())
	if r.shards == nil {
		var n int64
		err := r.db.pool.QueryRow(ctx, q, r.consumer()).Scan(&n)
		return n, err
	}
	ids := map[string]bool{}
	for _, pool := range r.shards.pools {
		rows, err := pool.Query(ctx, fmt.Sprintf(`SELECT message_id FROM %s.processed_messages WHERE consumer = $1`, pgx.Identifier{r.schema}.Sanitize()), r.consumer())
		if err != nil {
			return 0, err
		}
		got, err := pgx.CollectRows(rows, pgx.RowTo[string])
		if err != nil {
			return 0, err
		}
		for _, id := range got {
			ids[id] = true
		}
	}
	return int64(len(ids)), nil
}

func (r *run) consumer() string { return "chaos-" + r.s.Name }

// kafkaStallAfter is how long a Kafka scenario may go without a newly
// processed id, ids still outstanding, before the harness logs the group as
// the broker sees it. It only reports: a stall fails the scenario.
const kafkaStallAfter = 10 * time.Second

// waitProcessed waits until every confirmed id has a dedup row.
func (r *run) waitProcessed(ctx context.Context) error {
	want := r.confirmedN.Load()
	var n int64
	last, lastProgress := int64(-1), time.Now()
	for {
		qctx, cancel := context.WithTimeout(ctx, 2*time.Second)
		c, err := r.processedCount(qctx)
		cancel()
		if err == nil {
			n = c
		}
		if err == nil {
			r.processedN.Store(n)
			if n >= want {
				return nil
			}
			if n != last {
				last, lastProgress = n, time.Now()
			}
		}
		if r.kcluster != nil && time.Since(lastProgress) > kafkaStallAfter {
			lastProgress = time.Now()
			r.h.event("scenario %s: no id processed for %s; the group: %s", r.s.Name, kafkaStallAfter, r.groupSummary())
		}
		if !sleepCtx(ctx, 200*time.Millisecond) {
			return fmt.Errorf("timed out with %d of %d confirmed ids processed", n, want)
		}
	}
}

// groupSummary describes the scenario's consumer group as the broker sees
// it: state, generation, and each member's worker (live or exited) and
// partitions.
func (r *run) groupSummary() string {
	gi := r.kcluster.GroupInfo(r.consumer())
	if gi == nil {
		return "no such group"
	}
	var b strings.Builder
	fmt.Fprintf(&b, "%s, generation %d, %d members", gi.State, gi.Epoch, len(gi.Members))
	for _, m := range gi.Members {
		var parts []int
		for _, ps := range m.Assignment {
			for _, p := range ps {
				parts = append(parts, int(p))
			}
		}
		slices.Sort(parts)
		fmt.Fprintf(&b, "; %s holding partitions %v", r.describeClient(m.ClientID), parts)
	}
	return b.String()
}

// describeClient names the worker behind a Kafka client id, and whether its
// process is still running.
func (r *run) describeClient(clientID string) string {
	var k incKey
	if _, err := fmt.Sscanf(clientID, kafkaClientID, &k.slot, &k.inc); err != nil {
		return fmt.Sprintf("client %q", clientID)
	}
	r.mu.Lock()
	_, alive := r.procs[k]
	r.mu.Unlock()
	state := "live"
	if !alive {
		state = "exited"
	}
	return fmt.Sprintf("worker %d.%d (%s)", k.slot, k.inc, state)
}

// onEviction records a member the broker's session-timeout enforcement
// removed (see kafkatest.SessionEnforcer): one that kfake would have kept
// past its session timeout, typically a worker SIGKILLed while its
// JoinGroup was parked.
func (r *run) onEviction(ev kafkatest.Eviction) {
	if ev.Err != nil {
		r.h.event("scenario %s: removing expired member %s: %v", r.s.Name, r.describeClient(ev.ClientID), ev.Err)
		return
	}
	r.inject("session-evict", 1)
	var parts []int
	for _, ps := range ev.Partitions {
		for _, p := range ps {
			parts = append(parts, int(p))
		}
	}
	slices.Sort(parts)
	r.h.event("scenario %s: session timeout: removed %s from the group (%s, silent %s, holding partitions %v)",
		r.s.Name, r.describeClient(ev.ClientID), ev.State, ev.Silent.Round(time.Millisecond), parts)
}

// quiesce lets redeliveries in flight settle: RabbitMQ until the queue is
// empty, Kafka for a few commit intervals.
func (r *run) quiesce(ctx context.Context) {
	deadline := time.Now().Add(30 * time.Second)
	if r.s.SlowEvery > 0 {
		deadline = deadline.Add(r.s.SlowFor)
	}
	switch r.s.Broker {
	case BrokerRabbitMQ:
		for time.Now().Before(deadline) && r.queueDepth() > 0 {
			sleepCtx(ctx, 200*time.Millisecond)
		}
	case BrokerKafka:
		sleepCtx(ctx, max(10*r.s.KafkaCommitEvery, 2*time.Second))
	case BrokerNATS:
		sleepCtx(ctx, 2*NATSAckWait)
	case BrokerRedis:
		sleepCtx(ctx, 2*RedisMinIdle)
	}
	sleepCtx(ctx, 500*time.Millisecond)
}

// --- brokers ---

func (r *run) setupBroker(ctx context.Context) error {
	switch r.s.Broker {
	case BrokerNATS, BrokerRedis:
		return r.setupStream(ctx)
	case BrokerRabbitMQ:
		r.queue = "idemq-chaos-" + r.s.Name + "-" + randomHex(4)
		r.amqpURLs = []string{r.h.amqpURL}
		if r.s.Cluster {
			r.amqpURLs = r.h.cluster.URLs()
		}
		i := 0
		return r.h.withRetry(ctx, func() error {
			i++ // a node at a time
			return rabbitmq.DeclareTopology(ctx, r.amqpURLs[i%len(r.amqpURLs)], rabbitmq.Topology{Queue: r.queue, Quorum: r.s.Cluster})
		})
	case BrokerKafka:
		listen := func(network, _ string) (net.Listener, error) { return net.Listen(network, "127.0.0.1:0") }
		kc, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.ListenFn(listen),
			kfake.GroupMinSessionTimeout(kafkatest.MinSessionTimeout))
		if err != nil {
			return fmt.Errorf("chaos: start kfake: %w", err)
		}
		// Session timeouts as Apache Kafka enforces them, which kfake
		// alone does not for a member killed in the join barrier. The
		// enforcer observes first, before the offset-commit fault below.
		c := &kafkatest.Cluster{Cluster: kc, Sessions: kafkatest.EnforceSessionTimeouts(kc, 0, r.onEviction)}
		r.kcluster, r.kafkaBrokers = c, c.ListenAddrs()
		r.topic = "idemq-chaos-" + r.s.Name
		if err := kafkatest.CreateTopic(ctx, r.kafkaBrokers[0], r.topic, r.s.Partitions); err != nil {
			return fmt.Errorf("chaos: %w", err)
		}
		if rate := r.s.OffsetCommitErrorRate; rate > 0 {
			c.ControlKey(int16(kmsg.OffsetCommit), func(req kmsg.Request) (kmsg.Response, error, bool) {
				c.KeepControl()
				if r.float() >= rate {
					return nil, nil, false
				}
				r.inject("offset-commit-error", 1)
				return kafkatest.OffsetCommitError(req.(*kmsg.OffsetCommitRequest), kerr.CoordinatorNotAvailable.Code), nil, true
			})
		}
	}
	return nil
}

func (r *run) teardownBroker() {
	if r.kcluster != nil {
		r.kcluster.Close()
	}
	if r.queue != "" {
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		defer cancel()
		_ = r.h.withRetry(ctx, func() error {
			conn, err := dialAny(r.amqpURLs)
			if err != nil {
				return err
			}
			defer conn.Close()
			ch, err := conn.Channel()
			if err != nil {
				return err
			}
			for _, q := range []string{r.queue, r.queue + ".dlq"} {
				if _, err := ch.QueueDelete(q, false, false, false); err != nil {
					return err
				}
			}
			return ch.ExchangeDelete(r.queue+".dlx", false, false)
		})
	}
}

// queueDepth is the RabbitMQ queue's ready-message count (0 for Kafka or on
// error).
func (r *run) queueDepth() int {
	if r.queue == "" {
		return 0
	}
	conn, err := dialAny(r.amqpURLs)
	if err != nil {
		return 0
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		return 0
	}
	q, err := ch.QueueDeclarePassive(r.queue, true, false, false, false, nil)
	if err != nil {
		return 0
	}
	return q.Messages
}

// withRetry retries fn for up to a minute, riding out service restarts.
func (h *harness) withRetry(ctx context.Context, fn func() error) error {
	deadline := time.Now().Add(time.Minute)
	for {
		err := fn()
		if err == nil || time.Now().After(deadline) {
			return err
		}
		if !sleepCtx(ctx, 250*time.Millisecond) {
			return err
		}
	}
}

// --- workload ---

// publish publishes the workload over PublishOver: every id once, in
// chunks, plus the producer duplicates, each as its own Publish call at a
// later point. Every Publish is retried until the broker confirms it.
func (r *run) publish(ctx context.Context) error {
	type unit struct{ ids []int }
	var units []unit
	const chunk = 20
	var dups []int
	for i := 0; i < r.s.Messages; i += chunk {
		u := unit{}
		for j := i; j < min(i+chunk, r.s.Messages); j++ {
			u.ids = append(u.ids, j)
			if r.float() < r.s.DupRate {
				dups = append(dups, j)
				if r.float() < 0.1 {
					dups = append(dups, j)
				}
			}
		}
		units = append(units, u)
	}
	r.producerDuplicates = len(dups)
	// Each duplicate goes somewhere after its original's chunk.
	for _, id := range dups {
		after := id/chunk + 1
		pos := after + r.intn(len(units)-after+1)
		units = append(units[:pos], append([]unit{{ids: []int{id}}}, units[pos:]...)...)
	}

	var pubRabbit *rabbitmq.Publisher
	var pubKafka *kafka.Publisher
	var pubTxn *txnProducer
	var pubStream func(context.Context, []*consumer.Message) error
	var err error
	switch r.s.Broker {
	case BrokerNATS, BrokerRedis:
		var closePub func()
		if pubStream, closePub, err = r.streamPublisher(ctx); err != nil {
			return err
		}
		defer closePub()
	case BrokerRabbitMQ:
		err = r.h.withRetry(ctx, func() error {
			pubRabbit, err = rabbitmq.NewPublisher(ctx, rabbitmq.PublisherConfig{URL: r.amqpURLs[0], FailoverURLs: r.amqpURLs[1:],
				Channels: 1, DialTimeout: 5 * time.Second, ConnectionName: "idemq-chaos-publisher"})
			return err
		})
		if err != nil {
			return err
		}
		defer pubRabbit.Close()
	case BrokerKafka:
		if r.s.AbortRate > 0 {
			pubTxn = &txnProducer{brokers: r.kafkaBrokers, topic: r.topic, txnID: "idemq-chaos-" + r.s.Name + "-" + randomHex(4)}
			defer pubTxn.close()
			break
		}
		if pubKafka, err = kafka.NewPublisher(kafka.PublisherConfig{Brokers: r.kafkaBrokers}); err != nil {
			return err
		}
		defer pubKafka.Close()
	}

	interval := r.s.PublishOver / time.Duration(len(units))
	next := time.Now()
	var copySeq int
	for _, u := range units {
		due := next.UnixNano()
		if !sleepCtx(ctx, time.Until(next)) {
			return ctx.Err()
		}
		next = next.Add(interval)
		deadline := time.Now().Add(2 * time.Minute)
		// A transactional unit is committed or aborted as decided here;
		// an aborted one is not published again.
		abort := pubTxn != nil && r.float() < r.s.AbortRate
		for attempt := 1; ; attempt++ {
			copySeq++
			msgs := make([]*consumer.Message, len(u.ids))
			for i, j := range u.ids {
				id := r.msgID(j)
				r.attempted.Store(id, true)
				r.due.LoadOrStore(id, due)
				msgs[i] = &consumer.Message{ID: id, Key: id, Body: []byte(id + ":" + strconv.Itoa(j%997)),
					Headers: map[string]string{HeaderCopy: fmt.Sprintf("%d.%d", copySeq, i)}}
			}
			r.publishes.Add(1)
			pctx, cancel := context.WithTimeout(ctx, 20*time.Second)
			aborted := false
			switch {
			case pubRabbit != nil:
				err = pubRabbit.Publish(pctx, "", r.queue, msgs...)
			case pubStream != nil:
				err = pubStream(pctx, msgs)
			case pubTxn != nil:
				var outcome txnOutcome
				outcome, err = pubTxn.publish(pctx, msgs, abort)
				switch {
				case outcome == txnAborted && abort:
					aborted, err = true, nil
				case outcome == txnUnknown:
					for _, m := range msgs {
						r.uncertain.Store(m.ID, true)
					}
				}
			default:
				err = pubKafka.Publish(pctx, r.topic, msgs...)
			}
			cancel()
			if aborted {
				r.inject("txn-abort", 1)
				for _, m := range msgs {
					r.abortedCopy.Store(m.ID, true)
				}
				break
			}
			if err != nil && abort {
				break // meant to be aborted; its ids stay uncertain
			}
			if err == nil {
				now := time.Now().UnixNano()
				r.confirmTimes = append(r.confirmTimes, now)
				if attempt > 1 && r.s.Cluster {
					r.h.event("scenario %s: publish confirmed at attempt %d, %s after it was due", r.s.Name, attempt,
						time.Duration(now-due).Round(100*time.Millisecond))
				}
				for _, m := range msgs {
					if _, dup := r.confirmed.LoadOrStore(m.ID, true); !dup {
						r.confirmedN.Add(1)
					}
				}
				break
			}
			if ctx.Err() != nil {
				return ctx.Err()
			}
			if time.Now().After(deadline) {
				return fmt.Errorf("publish not confirmed in 2m: %w", err)
			}
			if attempt == 1 && r.s.Cluster {
				r.h.event("scenario %s: publish failed at +%s, retrying: %v", r.s.Name,
					time.Since(r.start).Round(100*time.Millisecond), err)
			}
			sleepCtx(ctx, 200*time.Millisecond)
		}
	}
	return nil
}

func (r *run) msgID(j int) string { return fmt.Sprintf("%s-%06d", r.s.Name, j) }

// --- processes ---

// startSlot keeps a consumer process running in slot until the run stops:
// a killed process is replaced by a new incarnation.
func (r *run) startSlot(ctx context.Context, slot int) {
	r.slotsWG.Add(1)
	go func() {
		defer r.slotsWG.Done()
		for !r.stopping.Load() && ctx.Err() == nil {
			k, p, err := r.spawn(slot)
			if err != nil {
				r.mu.Lock()
				r.exitProblems = append(r.exitProblems, err.Error())
				r.mu.Unlock()
				return
			}
			<-p.done
			if !r.noteExit(k, p) {
				return
			}
			sleepCtx(ctx, time.Duration(20+r.intn(100))*time.Millisecond)
		}
	}()
}

// spawn starts a new incarnation of slot.
func (r *run) spawn(slot int) (incKey, *proc, error) {
	if r.shards != nil {
		// No worker starts while the map changes (see reshard).
		r.shards.gate.RLock()
		defer r.shards.gate.RUnlock()
	}
	r.mu.Lock()
	inc := r.nextInc[slot]
	r.nextInc[slot] = inc + 1
	k := incKey{slot, inc}
	killAfter := 0
	if int(r.killsSelf.Load())+len(r.armed) < r.s.SelfKills {
		r.armed[k] = true
		killAfter = r.s.SelfKillEvery/2 + r.intn(r.s.SelfKillEvery+1)
	}
	r.incarnations++
	r.mu.Unlock()

	if r.chain != nil {
		cmd, err := r.chainCommand(slot, inc, killAfter)
		if err != nil {
			return k, nil, err
		}
		return r.startProc(k, cmd)
	}
	wc := WorkerConfig{
		Slot: slot, Incarnation: inc, Broker: r.s.Broker, Queue: r.queue,
		KafkaBrokers: r.kafkaBrokers, Topic: r.topic, Group: r.consumer(),
		DatabaseURL: r.db.url, Schema: r.schema, Consumer: r.consumer(), Mode: r.s.Mode,
		Concurrency: r.s.Concurrency, BatchSize: r.s.BatchSize, Prefetch: r.s.Prefetch,
		KafkaCommitEvery: r.s.KafkaCommitEvery, KafkaSource: r.s.KafkaSource, Partitions: r.s.Partitions,
		LogPath:          filepath.Join(r.dir, fmt.Sprintf("worker-%02d-%03d.log", slot, inc)),
		Seed:             r.h.cfg.Seed + uint64(r.idx)<<40,
		KillAfterCommits: killAfter, PGResetRate: r.s.PGResetRate, PGLatency: r.s.PGLatency,
		AMQPDropEvery: r.s.AMQPDropEvery, SlowEvery: r.s.SlowEvery, SlowFor: r.s.SlowFor,
		Sabotage: r.s.Sabotage, Partitioned: r.s.Partitioned, Retention: r.s.Retention,
	}
	wc.StreamStart = r.streamStart()
	if r.shards != nil {
		r.shardConfig(&wc)
	}
	if n := len(r.amqpURLs); n > 0 {
		// Slot i starts on node i mod n, the others after it in turn.
		for j := range n {
			u := r.amqpURLs[(slot+j)%n]
			if j == 0 {
				wc.AMQPURL = u
			} else {
				wc.AMQPFailoverURLs = append(wc.AMQPFailoverURLs, u)
			}
		}
		wc.AMQPDefaultReconnect = r.s.Cluster
	}
	b, err := json.Marshal(wc)
	if err != nil {
		return k, nil, err
	}
	cmd := exec.Command(r.h.cfg.WorkerCommand[0], r.h.cfg.WorkerCommand[1:]...)
	cmd.Env = append(os.Environ(), WorkerEnv+"="+string(b))
	r.mu.Lock()
	r.logPaths[k] = wc.LogPath
	r.mu.Unlock()
	return r.startProc(k, cmd)
}

// startProc starts cmd as incarnation k, its output appended to
// workers.stderr.
func (r *run) startProc(k incKey, cmd *exec.Cmd) (incKey, *proc, error) {
	errf, err := os.OpenFile(filepath.Join(r.dir, "workers.stderr"), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return k, nil, err
	}
	cmd.Stdout, cmd.Stderr = errf, errf
	cmd.SysProcAttr = childAttr(false)
	if err := cmd.Start(); err != nil {
		errf.Close()
		return k, nil, fmt.Errorf("chaos: start worker: %w", err)
	}
	p := &proc{cmd: cmd, done: make(chan struct{})}
	r.mu.Lock()
	r.procs[k] = p
	r.mu.Unlock()
	go func() {
		_ = cmd.Wait()
		errf.Close()
		if ws, ok := cmd.ProcessState.Sys().(syscall.WaitStatus); ok {
			p.ws = ws
		}
		close(p.done)
	}()
	return k, p, nil
}

// noteExit records how incarnation k ended and reports whether its slot
// should start another.
func (r *run) noteExit(k incKey, p *proc) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	delete(r.procs, k)
	delete(r.armed, k)
	switch {
	case p.ws.Signaled() && p.ws.Signal() == syscall.SIGKILL:
		if t, ok := r.nemesisSent[k]; ok {
			r.kills[k] = t
			r.killsRandom.Add(1)
		} else {
			// Self-inflicted: the time comes from its K line later;
			// until then, now is an upper bound.
			r.kills[k] = r.selfKillTime(k)
			r.killsSelf.Add(1)
		}
		return true
	case r.stopping.Load():
		if !p.ws.Exited() || p.ws.ExitStatus() != 0 {
			r.exitProblems = append(r.exitProblems, fmt.Sprintf("worker %d.%d exited with %v at shutdown", k.slot, k.inc, p.cmd.ProcessState))
		}
		return false
	default:
		if p.ws.Exited() && p.ws.ExitStatus() == 0 {
			return false // a graceful leave (rebalance)
		}
		r.exitProblems = append(r.exitProblems, fmt.Sprintf("worker %d.%d died unexpectedly: %v (see %s)", k.slot, k.inc, p.cmd.ProcessState, filepath.Join(r.dir, "workers.stderr")))
		return !r.stopping.Load()
	}
}

// selfKillTime reads the K line of k's log.
func (r *run) selfKillTime(k incKey) int64 {
	dl, err := readLogs(map[incKey]string{k: r.logPaths[k]})
	if err == nil {
		if t, ok := dl.selfKills[k]; ok {
			return t
		}
	}
	return time.Now().UnixNano()
}

// stopAll stops every worker with SIGTERM (they drain and report) and
// waits; a worker still running after 40s is killed and reported.
func (r *run) stopAll() {
	r.stopping.Store(true)
	r.mu.Lock()
	procs := make(map[incKey]*proc, len(r.procs))
	for k, p := range r.procs {
		procs[k] = p
	}
	r.mu.Unlock()
	for _, p := range procs {
		_ = p.cmd.Process.Signal(syscall.SIGTERM)
	}
	timeout := time.After(40 * time.Second)
	for k, p := range procs {
		select {
		case <-p.done:
		case <-timeout:
			_ = p.cmd.Process.Kill()
			<-p.done
			r.mu.Lock()
			r.exitProblems = append(r.exitProblems, fmt.Sprintf("worker %d.%d did not stop within 40s of SIGTERM", k.slot, k.inc))
			r.mu.Unlock()
		}
	}
	r.slotsWG.Wait()
}

// killRandom SIGKILLs a random running worker; it reports whether it did.
func (r *run) killRandom() bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	var live []incKey
	for k := range r.procs {
		if _, sent := r.nemesisSent[k]; !sent {
			live = append(live, k)
		}
	}
	if len(live) == 0 {
		return false
	}
	// Map order is random enough, but use our rng for reproducibility
	// of the choice given the same set.
	sortKeys(live)
	k := live[r.intnLocked(len(live))]
	r.nemesisSent[k] = time.Now().UnixNano()
	_ = r.procs[k].cmd.Process.Signal(syscall.SIGKILL)
	return true
}

func (r *run) intnLocked(n int) int { return r.intn(n) }

func sortKeys(ks []incKey) {
	for i := 1; i < len(ks); i++ {
		for j := i; j > 0 && (ks[j].slot < ks[j-1].slot || ks[j].slot == ks[j-1].slot && ks[j].inc < ks[j-1].inc); j-- {
			ks[j], ks[j-1] = ks[j-1], ks[j]
		}
	}
}

// hostPort returns the host:port of a postgres URL.
func hostPort(dbURL string) (string, error) {
	u, err := url.Parse(dbURL)
	if err != nil || u.Host == "" {
		return "", fmt.Errorf("chaos: database URL must be postgres://host:port/...: %v", err)
	}
	if u.Port() == "" {
		return net.JoinHostPort(u.Hostname(), "5432"), nil
	}
	return u.Host, nil
}

func amqpHostPort(amqpURL string) (string, error) {
	u, err := amqp.ParseURI(amqpURL)
	if err != nil {
		return "", fmt.Errorf("chaos: amqp URL: %w", err)
	}
	return net.JoinHostPort(u.Host, strconv.Itoa(u.Port)), nil
}

func portOf(addr string) int {
	_, p, _ := net.SplitHostPort(addr)
	n, _ := strconv.Atoi(p)
	return n
}
