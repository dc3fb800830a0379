package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"runtime/pprof"
	"slices"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/idemq/idemq/brokers/rabbitmq"
	"github.com/idemq/idemq/brokers/redisstream"
	"github.com/idemq/idemq/cmd/idemq/internal/bench"
)

var benchCommand = &command{
	name:    "bench",
	summary: "measure throughput against the naive recipe and the broker alone",
	help: `Publishes --messages deliveries, a --dup-rate fraction of them re-sending an
earlier id, to --broker (memory, rabbitmq, kafka: an in-process kfake
cluster unless --kafka-brokers is given, nats: JetStream, or redis: Redis
Streams), and consumes them into a ledger
table in each of --modes, one mode after another:

  broker-only       consume and ack with the raw broker client, no database
  naive             the plain recipe by hand: per message BEGIN; INSERT into
                    the dedup table ON CONFLICT DO NOTHING; if new, the ledger
                    INSERT; COMMIT; then ack
  idemq             the idemq runtime in strict per-message mode (BatchSize 1):
                    one transaction per message
  idemq-default     the idemq runtime with its defaults: a lane groups the
                    deliveries already waiting into one transaction
  idemq-default-later
                    the same, the handler writing with consumer.ExecLater (a
                    group's rows sent in one round trip)
  idemq-batch       the runtime in batch mode, same per-message handler
  idemq-batch-set   the runtime in batch mode with a BatchHandler (one INSERT
                    per batch)

The publisher runs concurrently with the consumer (unless --preload). Each
mode reports msgs/s (first to last settled delivery), p50/p90/p99/max
publish-to-commit latency (publish-to-ack for broker-only), peak RSS (process-wide, reset before
each mode), CPU per delivery from the consumer's start (this process's, and
the whole machine's from /proc/stat: steadier than msgs/s on a busy machine),
the duplicates skipped, and its ratio to naive and broker-only.
After each mode the ledger must hold exactly one row per unique id; otherwise
the command exits 1.

--rounds N runs the whole comparison N times, the modes in the order given
in odd rounds and reversed in even ones (a mode that runs later in a run
finds a warmer machine and a dedup table already written), each round in a
fresh schema and fresh queues (with --schema, in that schema, whose dedup
table keeps each round's rows). It prints each round's table, then a
summary per mode: medians over the rounds of its figures and of its
ratios, each ratio taken within its own round (p99 ×naive: the mode's p99
over the recipe's); the rates, p99s and ratios with their lowest and
highest. Compare builds or schemas by running one round of each in turn
instead.

--compare measures what --prefill and --purge-during cost, side by side in
one run: each mode runs first with neither, then with the prefilled rows,
then with the purge loop as well, and each run shows its rate over the run
before it (×prev phase).

Everything runs in a fresh schema (and fresh queues or topics), removed at the
end. --partitioned gives its dedup table the partitioned layout (three
generations of rows; see 'idemq migrate'). With --schema, the modes run in an
existing schema instead, on its dedup table and the rows already in it (a
large prefilled table, plain or partitioned, such as the retention benchmark
keeps), under consumer and ledger names of their own; the ledgers are dropped
at the end, the dedup rows stay. The naive modes need a plain table.

--shards N (1 to 8) runs the idemq modes over a processed.Sharded of N
databases that the run creates on the server of --database-url
(idemq_bench_<random>_0 to N-1; the role needs CREATEDB) and drops at the end,
also when the run fails or is interrupted. Each database holds the dedup table
and each mode's ledger; every message is keyed "acct-<id mod 1000>" (a
duplicate like its original), and the runtime claims it and writes its ledger
row on the shard its key maps to. On Kafka the record key carries the key, and
the runtime orders by partition and record key. --concurrency is per shard, as
in the runtime, and each shard's pool holds --concurrency+2 connections; the
checks count the ledgers of all the shards together (every id once in all), and
each mode reports its ledger rows per shard. --shards 1 also runs through the
sharded store, so that 1, 2 and 3 shards compare like with like. Only the idemq
modes run sharded ("all" then means them), not with --schema; --prefill is
split over the shards, --purge-during purges them all, and --partitioned
partitions every shard's dedup table.`,
	run: runBench,
}

func runBench(ctx context.Context, e *env, c *command, args []string) error {
	var (
		cfg          bench.Config
		modes        string
		dbURL        string
		kafkaBrokers string
		asJSON       bool
		cpuProfile   string
		memProfile   string
		rounds       int
	)
	fs := c.flagSet()
	fs.StringVar(&cfg.Broker, "broker", bench.BrokerMemory, "broker: memory, rabbitmq, kafka, nats or redis")
	fs.StringVar(&modes, "modes", "all", "comma-separated modes: broker-only, naive-1, naive, idemq, idemq-default, idemq-default-later, idemq-batch, idemq-batch-set, or all")
	fs.IntVar(&cfg.Messages, "messages", bench.DefaultMessages, "deliveries to publish, duplicates included")
	fs.Float64Var(&cfg.DupRate, "dup-rate", bench.DefaultDupRate, "fraction of deliveries that re-send an earlier id")
	fs.Uint64Var(&cfg.Seed, "seed", 1, "seed of the workload's duplicates")
	fs.IntVar(&cfg.Concurrency, "concurrency", bench.DefaultConcurrency, "runtime concurrency, and naive/broker-only workers")
	fs.IntVar(&cfg.BatchSize, "batch-size", bench.DefaultBatchSize, "batch size of the batch modes")
	fs.DurationVar(&cfg.BatchWait, "batch-wait", 0, "batch wait of the batch modes (default 5ms)")
	fs.BoolVar(&cfg.Preload, "preload", false, "publish everything before consuming (latency then includes queueing)")
	fs.Float64Var(&cfg.Rate, "rate", 0, "pace the publisher to this many messages a second, one per publish (an idle consumer's latency; not with --preload)")
	fs.DurationVar(&cfg.Warmup, "warmup", 0, "with --rate, leave the deliveries published in each mode's first this long out of its latencies")
	fs.IntVar(&cfg.Prefill, "prefill", 0, "insert this many old rows for another consumer into the dedup table first")
	fs.BoolVar(&cfg.PurgeDuring, "purge-during", false, "run Purge in a loop on the dedup table during each mode")
	fs.DurationVar(&cfg.PurgePause, "purge-pause", 10*time.Millisecond, "with --purge-during, the pause between two purge batches of 1000 rows (processed.Config.PurgePause); 0 for none")
	fs.Float64Var(&cfg.PurgeDutyCycle, "purge-duty", 0.25, "with --purge-during, the largest share of time the purge spends deleting (processed.Config.PurgeDutyCycle); 1 for no limit")
	fs.BoolVar(&cfg.Compare, "compare", false, "run each mode with neither --prefill nor --purge-during first, then adding each in turn, and print each run's ratio to the one before (×prev phase)")
	fs.BoolVar(&cfg.Partitioned, "partitioned", false, "give the fresh schema's dedup table the partitioned layout (generations); the naive modes need a plain one")
	fs.StringVar(&cfg.Schema, "schema", "", "run in this existing schema, on its dedup table as it is, keeping its rows")
	fs.IntVar(&cfg.Shards, "shards", 0, "run the idemq modes over a dedup store sharded across this many new databases (1 to 8), dropped at the end; not with --schema or the naive and broker-only modes (0: one schema, unsharded)")
	fs.StringVar(&dbURL, "database-url", "", "Postgres URL (default $DATABASE_URL, then "+defaultDatabaseURL+")")
	fs.StringVar(&cfg.AMQPURL, "amqp-url", "", "RabbitMQ URL (default $AMQP_URL, then "+rabbitmq.DefaultURL+")")
	fs.StringVar(&kafkaBrokers, "kafka-brokers", "", "comma-separated Kafka brokers (default: an in-process kfake cluster)")
	fs.IntVar(&cfg.KafkaPartitions, "kafka-partitions", 0, "partitions per topic (default --concurrency)")
	fs.StringVar(&cfg.NATSURL, "nats-url", "", "NATS URL, JetStream enabled (default $NATS_URL, then "+nats.DefaultURL+")")
	fs.StringVar(&cfg.RedisURL, "redis-url", "", "Redis URL (default $REDIS_URL, then "+redisstream.DefaultURL+")")
	fs.DurationVar(&cfg.ModeTimeout, "timeout", bench.DefaultModeTimeout, "time limit of each mode")
	fs.IntVar(&rounds, "rounds", 1, "run the modes this many times, in the order given in odd rounds and reversed in even ones, and summarise each mode's medians")
	fs.BoolVar(&asJSON, "json", false, "print one JSON object per mode, one per line (with --rounds, per mode and round)")
	fs.StringVar(&cpuProfile, "cpuprofile", "", "write a CPU profile of the whole run to this file, for go tool pprof (each mode's consumer is labelled: -tagfocus=mode=idemq-default)")
	fs.StringVar(&memProfile, "memprofile", "", "write an allocation profile of the whole run (every mode) to this file at the end, for go tool pprof -sample_index=alloc_space")
	if _, err := c.parse(e, fs, args, 0); err != nil {
		return err
	}
	var err error
	if cfg.Modes, err = bench.ParseModes(modes); err != nil {
		return usagef("--modes: %v", err)
	}
	if cfg.Shards > 0 && (modes == "" || modes == "all") {
		cfg.Modes = slices.Clone(bench.RuntimeModes)
	}
	switch {
	case cfg.Shards < 0 || cfg.Shards > bench.MaxShards:
		return usagef("--shards must be from 1 to %d, or 0 to run unsharded, got %d", bench.MaxShards, cfg.Shards)
	case cfg.Shards > 0 && cfg.Schema != "":
		return usagef("--shards creates databases of its own; it cannot be combined with --schema")
	}
	if cfg.Shards > 0 {
		for _, m := range cfg.Modes {
			if !slices.Contains(bench.RuntimeModes, m) {
				return usagef("--shards runs the idemq modes only (%s has no sharded form: only the runtime routes messages to shards); --modes all then means them", m)
			}
		}
	}
	switch {
	case cfg.Messages < 1:
		return usagef("--messages must be positive, got %d", cfg.Messages)
	case cfg.DupRate < 0 || cfg.DupRate >= 1:
		return usagef("--dup-rate must be in [0, 1), got %g", cfg.DupRate)
	case cfg.Concurrency < 1:
		return usagef("--concurrency must be positive, got %d", cfg.Concurrency)
	case cfg.BatchSize < 2:
		return usagef("--batch-size must be at least 2, got %d", cfg.BatchSize)
	case cfg.Prefill < 0:
		return usagef("--prefill must not be negative, got %d", cfg.Prefill)
	case !(cfg.PurgeDutyCycle > 0 && cfg.PurgeDutyCycle <= 1):
		return usagef("--purge-duty must be in (0, 1], got %g", cfg.PurgeDutyCycle)
	case cfg.PurgePause < 0:
		return usagef("--purge-pause must not be negative, got %s", cfg.PurgePause)
	case cfg.PurgePause == 0:
		cfg.PurgePause = -1 // none
	case cfg.Compare && cfg.Prefill == 0 && !cfg.PurgeDuring:
		return usagef("--compare needs --prefill or --purge-during")
	case cfg.Warmup < 0 || cfg.Warmup > 0 && cfg.Rate == 0:
		return usagef("--warmup must not be negative, and needs --rate, got %s", cfg.Warmup)
	case cfg.ModeTimeout <= 0:
		return usagef("--timeout must be positive, got %s", cfg.ModeTimeout)
	case rounds < 1:
		return usagef("--rounds must be positive, got %d", rounds)
	case rounds > 1 && cfg.Compare:
		return usagef("--rounds cannot be combined with --compare, whose phases are rounds of their own")
	}
	switch cfg.Broker {
	case bench.BrokerMemory, bench.BrokerRabbitMQ, bench.BrokerKafka, bench.BrokerNATS, bench.BrokerRedis:
	default:
		return usagef("--broker must be memory, rabbitmq, kafka, nats or redis, got %q", cfg.Broker)
	}
	cfg.NoDups = cfg.DupRate == 0
	if kafkaBrokers != "" {
		cfg.KafkaBrokers = strings.Split(kafkaBrokers, ",")
	}
	cfg.DatabaseURL, _ = (&dbFlags{url: dbURL}).databaseURL(e)
	cfg.AMQPURL = amqpURL(e, cfg.AMQPURL)
	cfg.NATSURL = urlFlag(e, cfg.NATSURL, "NATS_URL", nats.DefaultURL)
	cfg.RedisURL = urlFlag(e, cfg.RedisURL, "REDIS_URL", redisstream.DefaultURL)

	tty := isTerminal(e.stderr)
	round := "" // "round i/N " while several run
	if tty {
		cfg.Progress = func(p bench.Progress) {
			rate := float64(p.Settled) / max(p.Elapsed.Seconds(), 1e-9)
			label := round + string(p.Mode)
			if p.Phase != "" {
				label += "@" + p.Phase
			}
			fmt.Fprintf(e.stderr, "\r\033[K%-24s published %d/%d  settled %d/%d  %.0f msgs/s  %s",
				label, p.Published, p.Messages, p.Settled, p.Messages, rate, p.Elapsed.Round(100*time.Millisecond))
		}
	}
	if cpuProfile != "" {
		f, err := os.Create(cpuProfile)
		if err != nil {
			return fmt.Errorf("--cpuprofile: %w", err)
		}
		defer f.Close()
		if err := pprof.StartCPUProfile(f); err != nil {
			return fmt.Errorf("--cpuprofile: %w", err)
		}
		defer pprof.StopCPUProfile()
	}
	var (
		all    [][]bench.Result // per round
		tables = e.stdout
	)
	if asJSON {
		tables = nil
		if tty {
			tables = e.stderr
		}
	}
	for i := range rounds {
		rcfg := cfg
		if i%2 == 1 {
			rcfg.Modes = slices.Clone(cfg.Modes)
			slices.Reverse(rcfg.Modes)
		}
		if rounds > 1 {
			round = fmt.Sprintf("round %d/%d ", i+1, rounds)
		}
		var results []bench.Result
		results, err = bench.Run(ctx, rcfg)
		if tty {
			fmt.Fprint(e.stderr, "\r\033[K")
		}
		if rounds > 1 {
			for j := range results {
				results[j].Round = i + 1
			}
		}
		if asJSON {
			enc := json.NewEncoder(e.stdout)
			for _, r := range results {
				if encErr := enc.Encode(r); encErr != nil {
					return encErr
				}
			}
		}
		if tables != nil && len(results) > 0 {
			if rounds > 1 {
				fmt.Fprintf(tables, "round %d of %d: %s\n", i+1, rounds, modeList(rcfg.Modes))
			}
			printBenchTable(tables, rcfg, results)
		}
		all = append(all, results)
		if err != nil {
			break
		}
	}
	if memProfile != "" {
		if perr := writeHeapProfile(memProfile); perr != nil {
			return perr
		}
	}
	if rounds > 1 && tables != nil {
		printRoundsSummary(tables, cfg.Modes, all)
	}
	// bench's errors carry no "bench: " prefix: runEnv adds "idemq bench: ".
	return err
}

// modeList is modes as --modes takes them.
func modeList(modes []bench.Mode) string {
	s := make([]string, len(modes))
	for i, m := range modes {
		s[i] = string(m)
	}
	return strings.Join(s, ",")
}

// roundsFigure is one figure of a mode over the rounds: its median, and
// its lowest and highest.
type roundsFigure struct {
	n                 int
	median, low, high float64
}

// summarise returns the median, lowest and highest of xs, leaving out
// zeros (a figure not measured in that round).
func summarise(xs []float64) roundsFigure {
	var v []float64
	for _, x := range xs {
		if x != 0 {
			v = append(v, x)
		}
	}
	if len(v) == 0 {
		return roundsFigure{}
	}
	slices.Sort(v)
	med := v[len(v)/2]
	if len(v)%2 == 0 {
		med = (v[len(v)/2-1] + v[len(v)/2]) / 2
	}
	return roundsFigure{n: len(v), median: med, low: v[0], high: v[len(v)-1]}
}

// printRoundsSummary prints each mode's medians over the rounds in which
// it passed its check, in the order of modes. A ratio to naive or
// broker-only is taken within a round, and only where that mode passed its
// check too.
func printRoundsSummary(w io.Writer, modes []bench.Mode, rounds [][]bench.Result) {
	complete := 0
	for _, rs := range rounds {
		if len(rs) == len(modes) && !slices.ContainsFunc(rs, func(r bench.Result) bool { return !r.Verified }) {
			complete++
		}
	}
	note := ""
	if n := len(rounds) - complete; n > 0 {
		note = fmt.Sprintf(" (and %d that did not complete: its verified modes count)", n)
	}
	fmt.Fprintf(w, "\nmedians over %d rounds%s, the order reversed in every other round (lowest–highest); each ratio is taken within its round\n", complete, note)
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "mode\trounds\tmsgs/s\tp50 ms\tp99 ms\tmachine cpu µs/msg\talloc KB/msg\t×naive\tp99 ×naive\t×broker-only\t")
	for _, m := range modes {
		var rate, p50, p99, cpu, alloc, xNaive, p99Naive, xBroker []float64
		for _, rs := range rounds {
			// The references of the round's ratios, where they passed.
			var naive, brokerOnly *bench.Result
			for i, r := range rs {
				switch {
				case !r.Verified:
				case r.Mode == bench.ModeNaive:
					naive = &rs[i]
				case r.Mode == bench.ModeBrokerOnly:
					brokerOnly = &rs[i]
				}
			}
			for _, r := range rs {
				if r.Mode != m || !r.Verified {
					continue
				}
				rate = append(rate, r.MsgsPerSec)
				p50 = append(p50, r.P50Ms)
				p99 = append(p99, r.P99Ms)
				cpu = append(cpu, r.CPUMachineUsPerMsg)
				alloc = append(alloc, r.AllocBytesPerMsg/1024)
				if naive != nil && naive.MsgsPerSec > 0 && naive.P99Ms > 0 {
					xNaive = append(xNaive, r.MsgsPerSec/naive.MsgsPerSec)
					p99Naive = append(p99Naive, r.P99Ms/naive.P99Ms)
				}
				if brokerOnly != nil && brokerOnly.MsgsPerSec > 0 {
					xBroker = append(xBroker, r.MsgsPerSec/brokerOnly.MsgsPerSec)
				}
			}
		}
		f := func(xs []float64, prec int, spread bool) string {
			s := summarise(xs)
			if s.n == 0 {
				return "-"
			}
			if !spread {
				return strconv.FormatFloat(s.median, 'f', prec, 64)
			}
			return fmt.Sprintf("%.*f (%.*f–%.*f)", prec, s.median, prec, s.low, prec, s.high)
		}
		fmt.Fprintf(tw, "%s\t%d\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t\n", m, len(rate),
			f(rate, 0, true), f(p50, 1, false), f(p99, 1, true), f(cpu, 0, false), f(alloc, 1, false),
			f(xNaive, 2, true), f(p99Naive, 2, true), f(xBroker, 2, true))
	}
	_ = tw.Flush()
}

// amqpURL returns the RabbitMQ URL a command uses: its --amqp-url flag if
// set, then $AMQP_URL, then rabbitmq.DefaultURL.
func amqpURL(e *env, flagValue string) string {
	if flagValue != "" {
		return flagValue
	}
	if u := e.getenv("AMQP_URL"); u != "" {
		return u
	}
	return rabbitmq.DefaultURL
}

// urlFlag returns a broker URL: the flag's value if set, then the
// environment variable env, then def.
func urlFlag(e *env, flagValue, env, def string) string {
	if flagValue != "" {
		return flagValue
	}
	if u := e.getenv(env); u != "" {
		return u
	}
	return def
}

// printBenchTable prints the summary table.
func printBenchTable(w io.Writer, cfg bench.Config, rs []bench.Result) {
	r0 := rs[0]
	fmt.Fprintf(w, "broker %s, %d messages (%d unique, dup-rate %g), %s, batch size %d%s%s\n",
		r0.Broker, r0.Messages, r0.Unique, cfg.DupRate, concurrencyLabel(r0), cfg.BatchSize,
		map[bool]string{true: fmt.Sprintf(", prefill %d", cfg.Prefill)}[cfg.Prefill > 0],
		map[bool]string{true: fmt.Sprintf(", purge during (pause %s, duty %g)", max(cfg.PurgePause, 0), cfg.PurgeDutyCycle)}[cfg.PurgeDuring])
	if cfg.Warmup > 0 {
		fmt.Fprintf(w, "the latencies leave out what was published in each mode's first %s\n", cfg.Warmup)
	}
	fmt.Fprintln(w, "modes ran one after another; peak RSS, cpu µs/msg, alloc KB/msg and GCs are process-wide (an in-process broker included, and the publisher unless --preload); machine cpu is every process's")
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	head := "mode\tmsgs/s\tp50 ms\tp90 ms\tp99 ms\tmax ms\tpeak RSS MiB\tcpu µs/msg\tmachine cpu µs/msg\talloc KB/msg\tGCs\tdups skipped\t×naive-1\t×naive\t×broker-only\tpublish/s\tverified\t"
	if cfg.Compare {
		head = "phase\t" + head + "×prev phase\t"
	}
	fmt.Fprintln(tw, head)
	ratio := func(x float64) string {
		if x == 0 {
			return "-"
		}
		return fmt.Sprintf("%.2f", x)
	}
	for _, r := range rs {
		ok := "yes"
		if !r.Verified {
			ok = "NO"
		}
		if cfg.Compare {
			fmt.Fprintf(tw, "%s\t", r.Phase)
		}
		fmt.Fprintf(tw, "%s\t%.0f\t%.1f\t%.1f\t%.1f\t%.1f\t%.0f\t%.0f\t%s\t%.1f\t%d\t%d\t%s\t%s\t%s\t%.0f\t%s\t",
			r.Mode, r.MsgsPerSec, r.P50Ms, r.P90Ms, r.P99Ms, r.MaxMs, r.PeakRSSMiB, r.CPUProcessUsPerMsg, orNA(r.CPUMachineUsPerMsg),
			r.AllocBytesPerMsg/1024, r.GCCycles, r.DuplicatesSkipped,
			ratio(r.RatioNaive1), ratio(r.RatioNaive), ratio(r.RatioBrokerOnly), r.PublishPerSec, ok)
		if cfg.Compare {
			fmt.Fprintf(tw, "%s\t", ratio(r.RatioPrevPhase))
		}
		fmt.Fprintln(tw)
	}
	_ = tw.Flush()
	for _, r := range rs {
		label := string(r.Mode)
		if r.Phase != "" {
			label += "@" + r.Phase
		}
		if r.Error != "" {
			fmt.Fprintf(w, "%s: %s\n", label, r.Error)
		}
		if r.PurgeDuring {
			fmt.Fprintf(w, "%s: purged %d rows, %d purge errors\n", label, r.PurgedRows, r.PurgeErrors)
		}
		if len(r.ShardEffects) > 0 {
			fmt.Fprintf(w, "%s: ledger rows by shard %v\n", label, r.ShardEffects)
		}
	}
}

// concurrencyLabel is the header's concurrency, with the shards of a
// sharded run.
func concurrencyLabel(r bench.Result) string {
	if r.Shards == 0 {
		return fmt.Sprintf("concurrency %d", r.Concurrency)
	}
	unit := "shards (databases)"
	if r.Shards == 1 {
		unit = "shard (database)"
	}
	return fmt.Sprintf("%d %s, concurrency %d per shard", r.Shards, unit, r.Concurrency)
}

// isTerminal reports whether w is a character device, such as a terminal.
func isTerminal(w io.Writer) bool {
	f, ok := w.(*os.File)
	if !ok {
		return false
	}
	st, err := f.Stat()
	return err == nil && st.Mode()&os.ModeCharDevice != 0
}

// writeHeapProfile writes the heap profile, whose alloc_* samples cover every
// allocation since the process started.
func writeHeapProfile(path string) error {
	f, err := os.Create(path)
	if err != nil {
		return fmt.Errorf("--memprofile: %w", err)
	}
	if err := pprof.Lookup("allocs").WriteTo(f, 0); err != nil {
		f.Close()
		return fmt.Errorf("--memprofile: %w", err)
	}
	if err := f.Close(); err != nil {
		return fmt.Errorf("--memprofile: %w", err)
	}
	return nil
}

// orNA prints a measurement, or "-" when it is unknown (0).
func orNA(x float64) string {
	if x == 0 {
		return "-"
	}
	return fmt.Sprintf("%.0f", x)
}
