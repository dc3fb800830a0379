// Package bench is the engine of `idemq bench`: it publishes a workload with
// duplicates to a broker, consumes it into a business table in several modes
// (the idemq runtime per message and in batches, the naive hand-written
// recipe, and the broker alone), one mode after another, and verifies after
// each that every distinct message id had exactly one effect.
//
// All modes of one Run see the same workload on the same broker and database,
// so their ratios are comparable; absolute figures depend on the machine.
package bench

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"

	"github.com/idemq/idemq/brokers/redisstream"
	"github.com/idemq/idemq/consumer"
)

// Mode is one way of consuming the workload.
type Mode string

// The modes, in the order Run measures them by default.
const (
	// ModeBrokerOnly consumes and acks with the raw broker client and no
	// database: the ceiling.
	ModeBrokerOnly Mode = "broker-only"
	// ModeNaive is the plain recipe written by hand with pgx and the raw
	// broker client: per message BEGIN; INSERT into the dedup table ON
	// CONFLICT DO NOTHING; if inserted, the ledger INSERT; COMMIT; ack.
	ModeNaive Mode = "naive"
	// ModeNaive1 is ModeNaive with a single consumer, the recipe as it is
	// usually first written.
	ModeNaive1 Mode = "naive-1"
	// ModeIdemq is the idemq runtime in strict per-message mode
	// (BatchSize 1): one transaction per message, like naive.
	ModeIdemq Mode = "idemq"
	// ModeDefault is the idemq runtime with its default configuration and
	// the per-message Handler: deliveries already waiting when a lane
	// begins a transaction are grouped into it (up to
	// 32, the runtime's default), with no added wait.
	ModeDefault Mode = "idemq-default"
	// ModeDefaultLater is ModeDefault with a handler that writes its ledger
	// row with consumer.ExecLater: a group's rows go to Postgres in one
	// round trip, before the commit.
	ModeDefaultLater Mode = "idemq-default-later"
	// ModeBatch is the idemq runtime in batch mode with the same
	// per-message Handler as ModeIdemq (one ledger INSERT per message,
	// BatchSize messages per transaction), waiting BatchWait (5ms unless
	// set) to fill a batch.
	ModeBatch Mode = "idemq-batch"
	// ModeBatchSet is the idemq runtime in batch mode with a BatchHandler
	// that writes the whole batch's ledger rows with one INSERT.
	ModeBatchSet Mode = "idemq-batch-set"
)

// AllModes lists every mode in the order Run measures them.
var AllModes = []Mode{ModeBrokerOnly, ModeNaive1, ModeNaive, ModeIdemq, ModeDefault, ModeDefaultLater, ModeBatch, ModeBatchSet}

// RuntimeModes lists the modes that run the idemq runtime, in the order Run
// measures them: the modes a sharded Run (Config.Shards) measures, and by
// default.
var RuntimeModes = []Mode{ModeIdemq, ModeDefault, ModeDefaultLater, ModeBatch, ModeBatchSet}

// MaxShards is the most databases Config.Shards may shard a Run over.
const MaxShards = 8

// Brokers Run supports.
const (
	BrokerMemory   = "memory"
	BrokerRabbitMQ = "rabbitmq"
	BrokerKafka    = "kafka"
	BrokerNATS     = "nats"
	BrokerRedis    = "redis"
)

// Defaults for Config.
const (
	DefaultMessages     = 20_000
	DefaultDupRate      = 0.2
	DefaultConcurrency  = 8   // the runtime's default
	DefaultBatchSize    = 100 // the runtime's default with a BatchHandler
	DefaultAMQPURL      = "amqp://guest:guest@127.0.0.1:5672/"
	DefaultDatabaseURL  = "postgres://postgres@127.0.0.1:5432/test?sslmode=disable"
	DefaultModeTimeout  = 10 * time.Minute
	DefaultPublishers   = 4
	DefaultPublishChunk = 250
)

// ErrVerify is wrapped by the error of a mode whose effects do not match the
// workload's unique ids, or that dead-lettered or lost messages.
//
// Errors of this package do not start with "bench: ": its one caller, idemq
// bench, names the layer.
var ErrVerify = errors.New("verification failed")

// Config configures a Run. The zero value of every optional field selects a
// documented default.
type Config struct {
	// Broker is "memory", "rabbitmq", "kafka", "nats" or "redis".
	// Defaults to "memory".
	Broker string
	// Modes are measured in this order. Defaults to AllModes.
	Modes []Mode
	// Messages is the number of deliveries published, duplicates
	// included. Defaults to 20,000.
	Messages int
	// DupRate is the fraction of deliveries that re-send an earlier id
	// with the same body. Defaults to 0.2; set NoDups for none.
	DupRate float64
	// NoDups publishes no duplicates (DupRate 0 would select the default).
	NoDups bool
	// Seed seeds the workload's choice of duplicates. Defaults to 1.
	Seed uint64
	// Concurrency is the runtime's Concurrency and the number of naive and
	// broker-only workers. Defaults to 8.
	Concurrency int
	// BatchSize is the batch modes' BatchSize. Defaults to 100.
	BatchSize int
	// BatchWait is the batch modes' BatchWait. Defaults to 5ms,
	// the runtime's default with a BatchHandler.
	BatchWait time.Duration
	// Preload publishes the whole workload before consuming starts,
	// instead of concurrently. Latencies then include the wait in the
	// queue.
	Preload bool
	// Rate, if positive, paces the publisher to about this many messages
	// a second, one message per publish, concurrently with the consumer:
	// the workload of an idle consumer, for its latency. It cannot be
	// combined with Preload. Defaults to 0: publish as fast as the broker
	// confirms, in chunks.
	Rate float64
	// Warmup, with Rate, leaves the deliveries published in each mode's
	// first Warmup out of its latencies: they are consumed and verified
	// as the others, while the mode's connections, query plans and queue
	// warm up. Defaults to 0: every delivery is counted.
	Warmup time.Duration
	// Prefill inserts this many rows for another consumer into the dedup
	// table before the run (and tops them up before each mode), so the
	// modes run against a large table. After inserting, Run vacuums and
	// analyzes the table and asks for a CHECKPOINT (where the role may),
	// so the modes measure a large table rather than the aftermath of a
	// bulk load. Defaults to 0.
	Prefill int
	// PurgeDuring runs Store.Purge in a loop on the dedup table during
	// each mode. The prefilled rows are 30 days old and are what it
	// deletes; the run's own rows are too young to be purged.
	PurgeDuring bool
	// PurgePause is the purge loop's processed.Config.PurgePause: the
	// pause between two batches of 1000 deleted rows. Defaults to the
	// store's, 10ms; -1 for none, a purge flat out.
	PurgePause time.Duration
	// PurgeDutyCycle is the purge loop's processed.Config.PurgeDutyCycle.
	// Defaults to the store's, 0.25; 1 turns it off.
	PurgeDutyCycle float64
	// Compare measures the cost of Prefill and PurgeDuring side by side:
	// every database mode runs first in the base phase (no prefilled
	// rows, no purge), then with Prefill rows (phase "prefill", if
	// Prefill > 0), then with Prefill rows and the purge loop (phase
	// "purge", if PurgeDuring). Each Result's RatioPrevPhase is its rate
	// over the same mode's rate in the phase before, which differs by one
	// thing only. broker-only runs in the base phase only.
	Compare bool

	// DatabaseURL is the Postgres to use. Defaults to
	// DefaultDatabaseURL. Run creates a uniquely named schema and drops
	// it at the end, unless Schema is set.
	DatabaseURL string
	// Schema, if set, is an existing schema to run in instead: its dedup
	// table (migrated if it needs to be) and the rows already in it stay,
	// so that a run can measure a large prefilled table, plain or
	// partitioned, whichever it is (a table that the retention benchmark
	// kept, for example). The run's consumers and ledger tables get names
	// of their own, and the ledgers are dropped at the end. The naive
	// modes need a plain table.
	Schema string
	// Partitioned gives the fresh schema's dedup table the partitioned
	// layout (processed.Config.Partitioned: three generations). With
	// Schema, the table is what it is, and Partitioned must be false.
	// With Shards, every shard's dedup table is partitioned.
	Partitioned bool
	// Shards, from 1 to MaxShards, runs the idemq modes over a
	// processed.Sharded of this many databases, which Run creates on the
	// server of DatabaseURL (idemq_bench_<random>_<i>; the role needs
	// CREATEDB) and drops at the end, also when the run fails or is
	// cancelled. Each database gets the run's schema with the dedup
	// table (the Sharded's Migrate) and each mode's ledger, which the
	// handler writes through the transaction it is given, on the
	// message's shard. Every message is keyed by its id (shardKey: 1000
	// keys, a duplicate keyed like its original) so that the default map
	// spreads them over the shards; on Kafka the runtime's ordering key
	// becomes the record key within the partition. The checks count the
	// ledgers of all the shards together. Concurrency is per shard, as in
	// the runtime; Prefill is split over the shards and PurgeDuring
	// purges them all. Only the RuntimeModes run sharded (the default
	// Modes are then RuntimeModes), and Schema cannot be combined with
	// it. 0, the default, runs in one schema of DatabaseURL, unsharded;
	// 1 runs through a Sharded of one database, so that 1, 2 and 3
	// shards compare like with like.
	Shards int
	// AMQPURL is RabbitMQ's URL. Defaults to DefaultAMQPURL.
	AMQPURL string
	// KafkaBrokers are Kafka's bootstrap addresses. Defaults to an
	// in-process kfake cluster started for the run.
	KafkaBrokers []string
	// KafkaPartitions is the number of partitions of each topic.
	// Defaults to Concurrency.
	KafkaPartitions int
	// NATSURL is the NATS server's URL (JetStream enabled). Defaults to
	// nats.DefaultURL, nats://127.0.0.1:4222.
	NATSURL string
	// RedisURL is the Redis server's URL. Defaults to
	// redisstream.DefaultURL, redis://127.0.0.1:6379/0.
	RedisURL string

	// ModeTimeout bounds each mode. Defaults to 10m.
	ModeTimeout time.Duration
	// Progress, if set, is called about every 200ms while a mode runs.
	Progress func(Progress)
	// Logger receives the run's logs. Defaults to discarding them.
	Logger *slog.Logger

	// effect replaces the ledger write of every mode, for tests of the
	// verification.
	effect func(ctx context.Context, tx pgx.Tx, ledger, id string, amount int64) error
	// shardsReady, if set, is called with the shard databases' names once
	// they are created and migrated, for tests.
	shardsReady func(names []string)
}

// Progress is a snapshot of the running mode.
type Progress struct {
	Mode      Mode
	Phase     string // with Config.Compare
	Published int
	Settled   int64
	Messages  int
	Elapsed   time.Duration
}

func (c Config) withDefaults() Config {
	if c.Broker == "" {
		c.Broker = BrokerMemory
	}
	if len(c.Modes) == 0 {
		c.Modes = AllModes
		if c.Shards > 0 {
			c.Modes = RuntimeModes
		}
	}
	if c.Messages == 0 {
		c.Messages = DefaultMessages
	}
	if c.DupRate == 0 && !c.NoDups {
		c.DupRate = DefaultDupRate
	}
	if c.NoDups {
		c.DupRate = 0
	}
	if c.Seed == 0 {
		c.Seed = 1
	}
	if c.Concurrency == 0 {
		c.Concurrency = DefaultConcurrency
	}
	if c.BatchSize == 0 {
		c.BatchSize = DefaultBatchSize
	}
	if c.BatchWait == 0 {
		c.BatchWait = 5 * time.Millisecond
	}
	if c.DatabaseURL == "" {
		c.DatabaseURL = DefaultDatabaseURL
	}
	if c.AMQPURL == "" {
		c.AMQPURL = DefaultAMQPURL
	}
	if c.KafkaPartitions == 0 {
		c.KafkaPartitions = c.Concurrency
	}
	if c.NATSURL == "" {
		c.NATSURL = nats.DefaultURL
	}
	if c.RedisURL == "" {
		c.RedisURL = redisstream.DefaultURL
	}
	if c.ModeTimeout == 0 {
		c.ModeTimeout = DefaultModeTimeout
	}
	if c.Logger == nil {
		c.Logger = slog.New(slog.DiscardHandler)
	}
	return c
}

func (c Config) validate() error {
	bad := func(field, format string, args ...any) error {
		return &consumer.ConfigError{Field: field, Reason: fmt.Sprintf(format, args...)}
	}
	switch {
	case c.Broker != BrokerMemory && c.Broker != BrokerRabbitMQ && c.Broker != BrokerKafka && c.Broker != BrokerNATS && c.Broker != BrokerRedis:
		return bad("Broker", "%q, want memory, rabbitmq, kafka, nats or redis", c.Broker)
	case c.Messages < 1:
		return bad("Messages", "%d, must be positive", c.Messages)
	case c.DupRate < 0 || c.DupRate >= 1:
		return bad("DupRate", "%g, must be in [0, 1)", c.DupRate)
	case c.Concurrency < 1:
		return bad("Concurrency", "%d, must be positive", c.Concurrency)
	case c.BatchSize < 2 || c.BatchSize > 10_000:
		return bad("BatchSize", "%d, must be between 2 and 10000", c.BatchSize)
	case c.BatchWait < 0:
		return bad("BatchWait", "negative")
	case c.Rate < 0:
		return bad("Rate", "%g, must be positive, or 0 for no pacing", c.Rate)
	case c.Warmup < 0:
		return bad("Warmup", "negative")
	case c.Warmup > 0 && c.Rate == 0:
		return bad("Warmup", "leaves the first deliveries of a paced publisher out of the latencies: it needs Rate")
	case c.Warmup > 0 && c.Warmup.Seconds()*c.Rate >= float64(c.Messages):
		return bad("Warmup", "%s at %g msgs/s leaves out all %d messages: no latency would be counted", c.Warmup, c.Rate, c.Messages)
	case c.Rate > 0 && c.Preload:
		return bad("Rate", "paces a publisher that runs beside the consumer; it cannot be combined with Preload")
	case c.Prefill < 0:
		return bad("Prefill", "negative")
	case c.PurgeDutyCycle < 0 || c.PurgeDutyCycle > 1:
		return bad("PurgeDutyCycle", "%g: must be in (0, 1], or 0 for the default", c.PurgeDutyCycle)
	case c.PurgePause < 0 && c.PurgePause != -1:
		return bad("PurgePause", "%s: must be positive, or -1 for none", c.PurgePause)
	case c.Compare && c.Prefill == 0 && !c.PurgeDuring:
		return bad("Compare", "needs Prefill or PurgeDuring: there is nothing to compare the base phase with")
	case c.KafkaPartitions < 1:
		return bad("KafkaPartitions", "%d, must be positive", c.KafkaPartitions)
	case c.ModeTimeout < 0:
		return bad("ModeTimeout", "negative")
	case c.Schema != "" && c.Partitioned:
		return bad("Partitioned", "with Schema, the existing table decides; leave Partitioned false")
	case c.Partitioned && (slices.Contains(c.Modes, ModeNaive) || slices.Contains(c.Modes, ModeNaive1)):
		return bad("Modes", "the naive modes need a plain dedup table (their INSERT ... ON CONFLICT goes into it; the partitioned layout's is a view)")
	case c.Shards < 0 || c.Shards > MaxShards:
		return bad("Shards", "%d, must be from 1 to %d, or 0 to run unsharded", c.Shards, MaxShards)
	case c.Shards > 0 && c.Schema != "":
		return bad("Shards", "a sharded run creates databases of its own; it cannot run in an existing Schema")
	}
	seen := map[Mode]bool{}
	for _, m := range c.Modes {
		if !slices.Contains(AllModes, m) {
			return bad("Modes", "unknown mode %q (want %s)", m, modeList())
		}
		if c.Shards > 0 && !slices.Contains(RuntimeModes, m) {
			return bad("Modes", "%s cannot run with Shards: only the idemq runtime routes messages to shards (the naive and broker-only modes have no sharded form); run the idemq modes", m)
		}
		if seen[m] {
			return bad("Modes", "mode %q given twice", m)
		}
		seen[m] = true
	}
	return nil
}

func modeList() string {
	s := make([]string, len(AllModes))
	for i, m := range AllModes {
		s[i] = string(m)
	}
	return strings.Join(s, ", ")
}

// ParseModes parses a comma-separated list of modes; "all" or "" is
// AllModes.
func ParseModes(s string) ([]Mode, error) {
	if s == "" || s == "all" {
		return slices.Clone(AllModes), nil
	}
	var out []Mode
	for _, f := range strings.Split(s, ",") {
		m := Mode(strings.TrimSpace(f))
		if !slices.Contains(AllModes, m) {
			return nil, fmt.Errorf("unknown mode %q (want %s or all)", m, modeList())
		}
		out = append(out, m)
	}
	return out, nil
}

// Result is the measurement of one mode.
type Result struct {
	Broker string `json:"broker"`
	Mode   Mode   `json:"mode"`
	// Messages is the number of deliveries published; Unique the
	// number of distinct ids among them.
	Messages int `json:"messages"`
	Unique   int `json:"unique"`
	// Concurrency and BatchSize (batch modes only) as configured.
	Concurrency int `json:"concurrency"`
	BatchSize   int `json:"batch_size,omitempty"`
	// Shards is Config.Shards: the number of databases the dedup store
	// and the ledger were sharded over; 0 (left out of the JSON) for an
	// unsharded run. Concurrency is per shard.
	Shards int `json:"shards,omitempty"`
	// Seconds is the time from the first settled delivery to the last.
	Seconds float64 `json:"seconds"`
	// MsgsPerSec is Messages / Seconds.
	MsgsPerSec float64 `json:"msgs_per_sec"`
	// PublishPerSec is the publisher's rate: consumption cannot be faster
	// while they run concurrently.
	PublishPerSec float64 `json:"publish_per_sec"`
	// P50Ms, P90Ms, P99Ms and MaxMs are publish-to-commit latencies
	// (publish-to-ack for broker-only), in milliseconds: quantiles within
	// 2%, the maximum exact.
	P50Ms float64 `json:"p50_ms"`
	P90Ms float64 `json:"p90_ms"`
	P99Ms float64 `json:"p99_ms"`
	MaxMs float64 `json:"max_ms"`
	// PeakRSSMiB is the process's peak resident set during the mode
	// (VmHWM, reset before each mode where the kernel allows it). It is
	// process-wide: it includes an in-process broker (memory, kfake).
	PeakRSSMiB float64 `json:"peak_rss_mib"`
	// CPUProcessUsPerMsg is this process's CPU time (user and system)
	// from the consumer's start to the mode's end, in microseconds per
	// delivery; it includes any in-process broker, and the publisher
	// unless Preload. CPUMachineUsPerMsg is the whole machine's over the
	// same time (Postgres, RabbitMQ, the kernel and anything else running;
	// Linux only, else 0). Busy CPU per message moves far less between
	// runs than msgs/s on a shared machine.
	CPUProcessUsPerMsg float64 `json:"cpu_process_us_per_msg"`
	CPUMachineUsPerMsg float64 `json:"cpu_machine_us_per_msg,omitempty"`
	// AllocBytesPerMsg is the heap this process allocated over the same
	// time, in bytes per delivery, and GCCycles the garbage collections
	// it completed: process-wide, like CPUProcessUsPerMsg. A mode that
	// allocates more collects more often, and each collection takes a
	// share of the CPU and briefly stops every goroutine: part of its
	// latency's tail.
	AllocBytesPerMsg float64 `json:"alloc_bytes_per_msg"`
	GCCycles         uint64  `json:"gc_cycles"`
	// PeakRSSReset reports that the peak could be reset before the mode;
	// if false, PeakRSSMiB is the peak since the process started.
	PeakRSSReset bool `json:"peak_rss_reset"`
	// DuplicatesSkipped counts deliveries found to be already applied.
	DuplicatesSkipped int64 `json:"duplicates_skipped"`
	// Effects and DistinctEffects are the ledger's count(*) and
	// count(DISTINCT id); both must equal Unique. With Shards, they count
	// the ledgers of all the shards together: an id on two shards counts
	// once in DistinctEffects.
	Effects         int64 `json:"effects"`
	DistinctEffects int64 `json:"distinct_effects"`
	// ShardEffects, with Shards, is the ledger's rows on each shard, by
	// shard number: how the messages spread.
	ShardEffects []int64 `json:"shard_effects,omitempty"`
	// Errors counts failed attempts (database errors, handler errors,
	// dead letters, failed acks).
	Errors int64 `json:"errors"`
	// Round is the round the result belongs to when the bench command
	// runs its modes several times (--rounds), counted from 1; 0 otherwise.
	Round int `json:"round,omitempty"`
	// Phase is "base", "prefill" or "purge" with Config.Compare, and
	// empty otherwise.
	Phase string `json:"phase,omitempty"`
	// Prefill is the number of other rows in the dedup table.
	Prefill int `json:"prefill"`
	// PurgedRows and PurgeErrors are set when Config.PurgeDuring.
	PurgeDuring bool  `json:"purge_during"`
	PurgedRows  int64 `json:"purged_rows"`
	PurgeErrors int64 `json:"purge_errors"`
	// RatioNaive, RatioNaive1 and RatioBrokerOnly are MsgsPerSec divided
	// by the naive, naive-1 and broker-only modes' rates in the same Run;
	// 0 if not measured.
	RatioNaive      float64 `json:"ratio_naive,omitempty"`
	RatioNaive1     float64 `json:"ratio_naive_1,omitempty"`
	RatioBrokerOnly float64 `json:"ratio_broker_only,omitempty"`
	// RatioPrevPhase, with Config.Compare, is MsgsPerSec divided by the
	// same mode's rate in the phase before: prefill over base (the cost of
	// the prefilled rows), purge over prefill, or over base without
	// Prefill (the cost of the purge loop). 0 in the base phase.
	RatioPrevPhase float64 `json:"ratio_prev_phase,omitempty"`
	// Verified reports that the checks passed; Error says why not.
	Verified bool   `json:"verified"`
	Error    string `json:"error,omitempty"`

	// err is the error behind Error.
	err error
}

// Run measures cfg.Modes one after another and returns a Result per mode
// run. If a mode fails, it returns the results and an error naming every
// failed run; the error wraps ErrVerify if a mode failed its checks (rather
// than, say, its broker setup or its time limit). If the run cannot be set
// up (the broker or the database cannot be reached), it returns no results
// and that error. A shard database it could not drop at the end (Shards) is
// an error too, naming it.
func Run(ctx context.Context, cfg Config) (_ []Result, err error) {
	cfg = cfg.withDefaults()
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	r := &runner{cfg: cfg, log: cfg.Logger, work: newWorkload(cfg.Messages, cfg.DupRate, cfg.Seed)}
	r.work.keyed = cfg.Shards > 0
	defer func() {
		if cerr := r.close(); cerr != nil {
			err = errors.Join(err, cerr)
		}
	}()
	if err := r.setup(ctx); err != nil {
		return nil, err
	}
	var (
		results []Result
		failed  []string
		errs    []error
	)
	for _, ph := range cfg.phases() {
		for _, m := range cfg.Modes {
			if m == ModeBrokerOnly && ph.name != "" && ph.name != phaseBase {
				continue
			}
			if err := ctx.Err(); err != nil {
				return results, err
			}
			res := r.runMode(ctx, m, ph)
			if !res.Verified {
				failed = append(failed, fmt.Sprintf("%s: %s", res.label(), res.Error))
				errs = append(errs, res.err)
			}
			results = append(results, res)
		}
	}
	fillRatios(results)
	if len(failed) > 0 {
		return results, &runError{msg: fmt.Sprintf("%d of %d runs failed: %s", len(failed), len(results), strings.Join(failed, "; ")), errs: errs}
	}
	return results, nil
}

// runError is Run's error when modes failed: it unwraps to each failed
// mode's error, so errors.Is(err, ErrVerify) says whether a check failed.
type runError struct {
	msg  string
	errs []error
}

func (e *runError) Error() string   { return e.msg }
func (e *runError) Unwrap() []error { return e.errs }

// The phases of a Run with Config.Compare.
const (
	phaseBase    = "base"
	phasePrefill = "prefill"
	phasePurge   = "purge"
)

// phase is one pass over the modes: how many old rows the dedup table holds
// and whether the purge loop runs.
type phase struct {
	name    string // empty without Config.Compare
	prefill int
	purge   bool
}

// phases returns the passes a Run makes over the modes.
func (c Config) phases() []phase {
	if !c.Compare {
		return []phase{{prefill: c.Prefill, purge: c.PurgeDuring}}
	}
	ps := []phase{{name: phaseBase}}
	if c.Prefill > 0 {
		ps = append(ps, phase{name: phasePrefill, prefill: c.Prefill})
	}
	if c.PurgeDuring {
		ps = append(ps, phase{name: phasePurge, prefill: c.Prefill, purge: true})
	}
	return ps
}

// label names a result in messages: the mode, and its phase if any.
func (r Result) label() string {
	if r.Phase == "" {
		return string(r.Mode)
	}
	return string(r.Mode) + "@" + r.Phase
}

// fillRatios sets each result's ratios to the naive modes of its phase, to
// broker-only, and to its own mode's run in the phase before.
func fillRatios(rs []Result) {
	rate := map[[2]string]float64{} // phase, mode
	only := 0.0
	for _, r := range rs {
		rate[[2]string{r.Phase, string(r.Mode)}] = r.MsgsPerSec
		if r.Mode == ModeBrokerOnly {
			only = r.MsgsPerSec
		}
	}
	div := func(x, y float64) float64 {
		if y <= 0 {
			return 0
		}
		return x / y
	}
	for i, r := range rs {
		rs[i].RatioNaive = div(r.MsgsPerSec, rate[[2]string{r.Phase, string(ModeNaive)}])
		rs[i].RatioNaive1 = div(r.MsgsPerSec, rate[[2]string{r.Phase, string(ModeNaive1)}])
		rs[i].RatioBrokerOnly = div(r.MsgsPerSec, only)
		switch r.Phase {
		case phasePrefill:
			rs[i].RatioPrevPhase = div(r.MsgsPerSec, rate[[2]string{phaseBase, string(r.Mode)}])
		case phasePurge:
			prev := phasePrefill
			if r.Prefill == 0 {
				prev = phaseBase
			}
			rs[i].RatioPrevPhase = div(r.MsgsPerSec, rate[[2]string{prev, string(r.Mode)}])
		}
	}
}

// runner holds what the modes of one Run share.
type runner struct {
	cfg    Config
	log    *slog.Logger
	work   *workload
	pool   *pgxpool.Pool
	schema string
	// own: the run created schema, and drops it at the end.
	own bool
	// partitioned: the dedup table is partitioned.
	partitioned bool
	// tag names this run's consumers and ledgers in a schema it does
	// not own.
	tag string
	// ledgers are the ledger tables created in a schema the run does not
	// own, dropped at the end.
	ledgers []string
	// shards are the databases of a sharded run (Config.Shards), each
	// holding the schema; pool then serves only to create and drop them.
	shards []*shardDB
	broker brokerEnv
}

func randomHex(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

func (r *runner) setup(ctx context.Context) error {
	// Set r.broker only on success: close must not see a nil broker in a
	// non-nil interface.
	b, err := newBrokerEnv(ctx, r.cfg)
	if err != nil {
		return err
	}
	r.broker = b
	return r.setupDB(ctx)
}

// close drops what the run created and closes its connections. It returns
// an error naming each shard database it could not drop.
func (r *runner) close() error {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	for _, sh := range r.shards {
		if sh.pool != nil {
			sh.pool.Close()
		}
	}
	var errs []error
	if r.pool != nil {
		for _, sh := range r.shards {
			if err := r.dropShard(ctx, sh.name); err != nil {
				r.log.Warn("bench: drop shard database", "database", sh.name, "error", err)
				errs = append(errs, err)
			}
		}
		if r.schema != "" && r.own && r.cfg.Shards == 0 { // a sharded run's schema goes with its databases
			if _, err := r.pool.Exec(ctx, "DROP SCHEMA IF EXISTS "+pgx.Identifier{r.schema}.Sanitize()+" CASCADE"); err != nil {
				r.log.Warn("bench: drop schema", "schema", r.schema, "error", err)
			}
		}
		for _, l := range r.ledgers {
			if _, err := r.pool.Exec(ctx, "DROP TABLE IF EXISTS "+l); err != nil {
				r.log.Warn("bench: drop ledger", "table", l, "error", err)
			}
		}
		r.pool.Close()
	}
	if r.broker != nil {
		r.broker.close()
	}
	return errors.Join(errs...)
}
