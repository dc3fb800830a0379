package bench

import (
	"context"
	"errors"
	"net"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"
	"go.uber.org/goleak"

	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/internal/natstest"
	"github.com/idemq/idemq/internal/testdb"
	"github.com/idemq/idemq/processed"
)

func TestMain(m *testing.M) {
	_ = natstest.EnsureAnchor(nats.DefaultURL) // see natstest
	goleak.VerifyTestMain(m, testdb.LeakOptions()...)
}

// smallConfig is a run small enough for CI.
func smallConfig(broker string) Config {
	return Config{
		Broker:      broker,
		Messages:    400,
		DatabaseURL: testdb.URL(),
		ModeTimeout: 30 * time.Second,
		BatchSize:   20,
	}
}

func run(t *testing.T, cfg Config) ([]Result, error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	return Run(ctx, cfg)
}

// checkAll checks that every mode ran, was verified, and applied each
// unique id exactly once.
func checkAll(t *testing.T, cfg Config, rs []Result, err error) {
	t.Helper()
	if err != nil {
		t.Fatalf("Run: %v", err)
	}
	if len(rs) != len(AllModes) {
		t.Fatalf("got %d results, want %d", len(rs), len(AllModes))
	}
	w := newWorkload(cfg.Messages, DefaultDupRate, 1)
	for i, r := range rs {
		if r.Mode != AllModes[i] || !r.Verified || r.Error != "" {
			t.Fatalf("result %d: %+v", i, r)
		}
		if r.MsgsPerSec <= 0 || r.P50Ms <= 0 || r.P99Ms < r.P50Ms || r.PeakRSSMiB <= 0 || r.CPUProcessUsPerMsg <= 0 || r.CPUMachineUsPerMsg < 0 || r.AllocBytesPerMsg <= 0 {
			t.Errorf("%s: implausible measurements %+v", r.Mode, r)
		}
		if r.Unique != w.unique || r.Messages != cfg.Messages {
			t.Errorf("%s: unique %d of %d, want %d of %d", r.Mode, r.Unique, r.Messages, w.unique, cfg.Messages)
		}
		if r.Mode == ModeBrokerOnly {
			if r.Effects != 0 || r.DuplicatesSkipped != 0 {
				t.Errorf("broker-only: %+v", r)
			}
			continue
		}
		if r.Effects != int64(w.unique) || r.DistinctEffects != int64(w.unique) {
			t.Errorf("%s: %d effects (%d distinct), want %d", r.Mode, r.Effects, r.DistinctEffects, w.unique)
		}
		// Every duplicate delivery was skipped (redeliveries may add
		// more).
		if r.DuplicatesSkipped < int64(cfg.Messages-w.unique) {
			t.Errorf("%s: %d duplicates skipped, want at least %d", r.Mode, r.DuplicatesSkipped, cfg.Messages-w.unique)
		}
		if r.RatioNaive <= 0 || r.RatioBrokerOnly <= 0 {
			t.Errorf("%s: ratios not filled: %+v", r.Mode, r)
		}
	}
}

func TestAllModesMemory(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: runs every bench mode")
	}
	cfg := smallConfig(BrokerMemory)
	rs, err := run(t, cfg)
	checkAll(t, cfg, rs, err)
}

func TestAllModesRabbitMQ(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: runs every bench mode")
	}
	cfg := smallConfig(BrokerRabbitMQ)
	rs, err := run(t, cfg)
	checkAll(t, cfg, rs, err)
}

func TestAllModesKafka(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: runs every bench mode")
	}
	cfg := smallConfig(BrokerKafka)
	cfg.Concurrency = 4
	rs, err := run(t, cfg)
	checkAll(t, cfg, rs, err)
}

// TestVerificationCatchesDoubleEffects breaks the effect so that some ids
// are applied twice, as a consumer without dedup would: every database mode
// must fail its checks.
func TestVerificationCatchesDoubleEffects(t *testing.T) {
	cfg := smallConfig(BrokerMemory)
	cfg.Modes = []Mode{ModeNaive, ModeIdemq, ModeBatchSet}
	cfg.effect = func(ctx context.Context, tx pgx.Tx, ledger, id string, amount int64) error {
		n := 1
		if strings.HasSuffix(id, "7") {
			n = 2
		}
		for range n {
			if _, err := tx.Exec(ctx, "INSERT INTO "+ledger+" (id, amount) VALUES ($1, $2)", id, amount); err != nil {
				return err
			}
		}
		return nil
	}
	rs, err := run(t, cfg)
	if !errors.Is(err, ErrVerify) {
		t.Fatalf("Run: %v, want ErrVerify", err)
	}
	if len(rs) != len(cfg.Modes) {
		t.Fatalf("got %d results", len(rs))
	}
	for _, r := range rs {
		if r.Verified || r.Effects <= int64(r.Unique) || r.DistinctEffects != int64(r.Unique) || !strings.Contains(r.Error, "effects") {
			t.Errorf("%s: the double effects were not caught: %+v", r.Mode, r)
		}
	}
}

// TestVerificationCatchesMissingEffects drops some effects while the claims
// commit: the ledger count falls short and the checks fail.
func TestVerificationCatchesMissingEffects(t *testing.T) {
	cfg := smallConfig(BrokerMemory)
	cfg.Modes = []Mode{ModeIdemq, ModeBatch}
	cfg.effect = func(ctx context.Context, tx pgx.Tx, ledger, id string, amount int64) error {
		if strings.HasSuffix(id, "3") {
			return nil
		}
		_, err := tx.Exec(ctx, "INSERT INTO "+ledger+" (id, amount) VALUES ($1, $2)", id, amount)
		return err
	}
	rs, err := run(t, cfg)
	if !errors.Is(err, ErrVerify) {
		t.Fatalf("Run: %v, want ErrVerify", err)
	}
	for _, r := range rs {
		if r.Verified || r.Effects >= int64(r.Unique) {
			t.Errorf("%s: the missing effects were not caught: %+v", r.Mode, r)
		}
	}
}

// TestDeadLetterFailsTheMode makes the effect fail permanently for one id:
// the runtime dead-letters it and the mode fails fast instead of timing out.
func TestDeadLetterFailsTheMode(t *testing.T) {
	cfg := smallConfig(BrokerMemory)
	cfg.Modes = []Mode{ModeIdemq}
	cfg.effect = func(ctx context.Context, tx pgx.Tx, ledger, id string, amount int64) error {
		if id == "m-5" {
			return consumer.Permanent(errors.New("poison"))
		}
		_, err := tx.Exec(ctx, "INSERT INTO "+ledger+" (id, amount) VALUES ($1, $2)", id, amount)
		return err
	}
	start := time.Now()
	rs, err := run(t, cfg)
	if !errors.Is(err, ErrVerify) || len(rs) != 1 || !strings.Contains(rs[0].Error, "dead-lettered") {
		t.Fatalf("Run: %v, %+v", err, rs)
	}
	if time.Since(start) > cfg.ModeTimeout {
		t.Fatalf("the mode ran into its timeout")
	}
}

func TestPrefillAndPurgeDuring(t *testing.T) {
	cfg := smallConfig(BrokerMemory)
	cfg.Modes = []Mode{ModeIdemq, ModeBatchSet}
	cfg.Prefill = 3000
	cfg.PurgeDuring = true
	rs, err := run(t, cfg)
	if err != nil {
		t.Fatalf("Run: %v", err)
	}
	for _, r := range rs {
		if !r.Verified || r.Prefill != 3000 || r.PurgeErrors != 0 {
			t.Errorf("%s: %+v", r.Mode, r)
		}
	}
	// The first mode's purge deleted old rows; the second's found them
	// topped up again. Whether a purge got to them before the mode ended
	// depends on timing, so only the total is checked.
	if rs[0].PurgedRows+rs[1].PurgedRows == 0 {
		t.Errorf("nothing purged: %+v", rs)
	}
}

// TestPartitionedAndExistingSchema: the runtime modes on a fresh partitioned
// dedup table, then twice in an existing schema (each run under names of
// its own, so that the second run's ids are new to it), which keeps its
// dedup rows and loses only the runs' ledgers; the naive modes refuse a
// partitioned table.
func TestPartitionedAndExistingSchema(t *testing.T) {
	cfg := smallConfig(BrokerMemory)
	cfg.Modes = []Mode{ModeIdemq, ModeDefault}
	cfg.Partitioned = true
	// Prefilled rows of the past (which the DEFAULT partition's floor
	// refuses: they get a partition of their own) that a purge drops
	// during the run.
	cfg.Prefill, cfg.PurgeDuring, cfg.Compare = 500, true, true
	rs, err := run(t, cfg)
	if err != nil {
		t.Fatalf("partitioned: %v", err)
	}
	for _, r := range rs {
		if !r.Verified || r.Phase == "purge" && r.PurgedRows != int64(cfg.Prefill) {
			t.Fatalf("partitioned %s: %+v", r.Mode, r)
		}
	}
	cfg.Prefill, cfg.PurgeDuring, cfg.Compare = 0, false, false

	pool := testdb.Pool(t)
	schema := testdb.Schema(t)
	store, err := processed.New(pool, processed.Config{Schema: schema, Partitioned: true})
	if err != nil {
		t.Fatal(err)
	}
	if err := store.Migrate(context.Background()); err != nil {
		t.Fatal(err)
	}
	cfg.Partitioned, cfg.Schema = false, schema
	for i := 0; i < 2; i++ {
		rs, err := run(t, cfg)
		if err != nil {
			t.Fatalf("existing schema, run %d: %v", i, err)
		}
		for _, r := range rs {
			if !r.Verified || r.Effects != int64(r.Unique) {
				t.Fatalf("existing schema, run %d, %s: %+v", i, r.Mode, r)
			}
		}
	}
	var rows, ledgers int
	if err := pool.QueryRow(context.Background(), `SELECT count(*) FROM `+pgx.Identifier{schema, "processed_messages"}.Sanitize()).Scan(&rows); err != nil {
		t.Fatal(err)
	}
	if err := pool.QueryRow(context.Background(), `SELECT count(*) FROM pg_tables WHERE schemaname = $1 AND tablename LIKE 'ledger%'`, schema).Scan(&ledgers); err != nil {
		t.Fatal(err)
	}
	w := newWorkload(cfg.Messages, DefaultDupRate, 1)
	if rows != 2*2*w.unique || ledgers != 0 {
		t.Fatalf("existing schema after two runs of two modes: %d dedup rows (want %d), %d ledgers left (want 0)", rows, 2*2*w.unique, ledgers)
	}
	cfg.Modes = []Mode{ModeNaive}
	if _, err := run(t, cfg); err == nil || !strings.Contains(err.Error(), "partitioned") {
		t.Fatalf("naive on an existing partitioned table: %v, want a refusal", err)
	}
}

// TestCompare: each database mode runs in the base, prefill and purge
// phases with its own dedup scope, broker-only in the base phase only, and
// each run after the base carries its ratio to the phase before.
func TestCompare(t *testing.T) {
	cfg := smallConfig(BrokerMemory)
	cfg.Modes = []Mode{ModeBrokerOnly, ModeIdemq}
	cfg.Prefill = 2000
	cfg.PurgeDuring = true
	cfg.Compare = true
	rs, err := run(t, cfg)
	if err != nil {
		t.Fatalf("Run: %v", err)
	}
	var got []string
	for _, r := range rs {
		got = append(got, r.label())
		if !r.Verified || r.PurgeErrors != 0 {
			t.Errorf("%s: %+v", r.label(), r)
		}
	}
	if want := "broker-only@base idemq@base idemq@prefill idemq@purge"; strings.Join(got, " ") != want {
		t.Fatalf("runs %q, want %q", got, want)
	}
	base, prefill, purge := rs[1], rs[2], rs[3]
	if base.Prefill != 0 || base.PurgeDuring || base.RatioPrevPhase != 0 {
		t.Errorf("base: %+v", base)
	}
	if prefill.Prefill != 2000 || prefill.PurgeDuring || prefill.PurgedRows != 0 {
		t.Errorf("prefill: %+v", prefill)
	}
	if purge.Prefill != 2000 || !purge.PurgeDuring {
		t.Errorf("purge: %+v", purge)
	}
	near := func(x, want float64) bool { return x > want*0.999 && x < want*1.001 }
	if !near(prefill.RatioPrevPhase, prefill.MsgsPerSec/base.MsgsPerSec) || !near(purge.RatioPrevPhase, purge.MsgsPerSec/prefill.MsgsPerSec) {
		t.Errorf("ratios: prefill %.3f, purge %.3f", prefill.RatioPrevPhase, purge.RatioPrevPhase)
	}
}

func TestPreloadAndNoDups(t *testing.T) {
	cfg := smallConfig(BrokerMemory)
	cfg.Modes = []Mode{ModeBrokerOnly, ModeBatch}
	cfg.Preload = true
	cfg.NoDups = true
	rs, err := run(t, cfg)
	if err != nil {
		t.Fatalf("Run: %v", err)
	}
	for _, r := range rs {
		if !r.Verified || r.Unique != cfg.Messages || r.DuplicatesSkipped != 0 {
			t.Errorf("%s: %+v", r.Mode, r)
		}
	}
}

func TestWorkload(t *testing.T) {
	w := newWorkload(10_000, 0.2, 7)
	if w2 := newWorkload(10_000, 0.2, 7); w2.unique != w.unique {
		t.Fatal("the workload is not deterministic")
	}
	if w.unique < 7_700 || w.unique > 8_300 {
		t.Fatalf("%d unique of 10000 at dup rate 0.2", w.unique)
	}
	seen := make([]bool, w.unique)
	next := int32(0)
	for i, j := range w.seq {
		if j > next || j < 0 {
			t.Fatalf("delivery %d re-sends id %d before it was sent", i, j)
		}
		if j == next {
			next++
		}
		seen[j] = true
	}
	for j, ok := range seen {
		if !ok {
			t.Fatalf("id %d never sent", j)
		}
	}
	id, amount, err := parseBody(body(42))
	if err != nil || id != msgID(42) || amount != amountOf(42) {
		t.Fatalf("parseBody: %q %d %v", id, amount, err)
	}
	if _, _, err := parseBody([]byte("junk")); err == nil {
		t.Fatal("parseBody accepted junk")
	}
}

func TestHistogram(t *testing.T) {
	var h histogram
	if h.quantile(0.5) != 0 {
		t.Fatal("empty histogram has a median")
	}
	for i := 1; i <= 1000; i++ {
		h.add(time.Duration(i) * time.Millisecond)
	}
	near := func(got, want time.Duration) bool {
		return got > want*97/100 && got < want*103/100
	}
	if p := h.quantile(0.5); !near(p, 500*time.Millisecond) {
		t.Errorf("p50 = %s", p)
	}
	if p := h.quantile(0.90); !near(p, 900*time.Millisecond) {
		t.Errorf("p90 = %s", p)
	}
	if p := h.quantile(0.99); !near(p, 990*time.Millisecond) {
		t.Errorf("p99 = %s", p)
	}
	if m := h.maximum(); m != time.Second {
		t.Errorf("max = %s, want 1s exactly", m)
	}
}

func TestConfigValidate(t *testing.T) {
	bad := []Config{
		{Broker: "pulsar"},
		{Messages: -1},
		{DupRate: 1},
		{BatchSize: 1},
		{Modes: []Mode{"fast"}},
		{Modes: []Mode{ModeIdemq, ModeIdemq}},
		{Prefill: -1},
		{Compare: true},
		{Partitioned: true, Modes: []Mode{ModeIdemq, ModeNaive}},
		{Partitioned: true, Schema: "kept"},
		{Shards: -1},
		{Shards: MaxShards + 1},
		{Shards: 2, Schema: "kept"},
		{Shards: 2, Modes: []Mode{ModeIdemq, ModeNaive}},
		{Shards: 1, Modes: []Mode{ModeBrokerOnly}},
		{Rate: 100, Warmup: -time.Second},
		{Messages: 100, Rate: 100, Warmup: time.Second},
		{Warmup: time.Second},
	}
	for _, c := range bad {
		var ce *consumer.ConfigError
		if _, err := Run(context.Background(), c); !errors.As(err, &ce) {
			t.Errorf("%+v: got %v, want a ConfigError", c, err)
		}
	}
	if ms, err := ParseModes("naive, idemq"); err != nil || len(ms) != 2 || ms[1] != ModeIdemq {
		t.Errorf("ParseModes: %v %v", ms, err)
	}
	if _, err := ParseModes("naive,warp"); err == nil {
		t.Error("ParseModes accepted an unknown mode")
	}
}

func TestCPUAccounting(t *testing.T) {
	before := cpuNow()
	if before.process <= 0 {
		t.Fatalf("process CPU %s", before.process)
	}
	if runtime.GOOS == "linux" && before.machine <= 0 {
		t.Fatalf("machine CPU %s from /proc/stat", before.machine)
	}
	// Burn at least 50ms of this process's CPU, measured by the process
	// counter itself rather than by the wall clock: on a loaded machine 50ms
	// of wall time can hold far less CPU. Per message is then the delta
	// divided by the count.
	deadline := time.Now().Add(30 * time.Second)
	for processCPU()-before.process < 50*time.Millisecond {
		if time.Now().After(deadline) {
			t.Fatal("the process CPU counter did not advance 50ms in 30s of busy work")
		}
		for end := time.Now().Add(time.Millisecond); time.Now().Before(end); {
		}
	}
	proc, machine := before.perMessage(10)
	if proc < 5_000 || proc > 100_000 {
		t.Errorf("process: %.0f µs per message for ~50ms of CPU over 10 messages, want about 5,000", proc)
	}
	if runtime.GOOS == "linux" && machine < proc/2 {
		t.Errorf("machine: %.0f µs per message, less than this process's %.0f", machine, proc)
	}
	if p, m := before.perMessage(0); p != 0 || m != 0 {
		t.Errorf("no messages: %g, %g", p, m)
	}
}

// deadAddr returns a loopback address nothing listens on.
func deadAddr(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}
	return addr
}

// TestUnreachableSetup: a broker or database that cannot be reached fails
// Run at once with no results and an error naming the address, without the
// password, neither as a panic nor as a failed verification.
func TestUnreachableSetup(t *testing.T) {
	const secret = "hunter2Secret"
	addr := deadAddr(t)
	for _, c := range []struct {
		name string
		cfg  func(*Config)
		want string
	}{
		{"rabbitmq", func(c *Config) { c.Broker, c.AMQPURL = BrokerRabbitMQ, "amqp://app:"+secret+"@"+addr+"/" },
			"connect to RabbitMQ at amqp://app:xxxxx@" + addr + "/"},
		{"kafka", func(c *Config) { c.Broker, c.KafkaBrokers = BrokerKafka, []string{addr} },
			"could not connect to the Kafka brokers " + addr},
		{"postgres", func(c *Config) { c.DatabaseURL = "postgres://app:" + secret + "@" + addr + "/test?sslmode=disable" },
			"connect to Postgres at postgres://app:xxxxx@" + addr + "/test"},
	} {
		t.Run(c.name, func(t *testing.T) {
			cfg := smallConfig(BrokerMemory)
			c.cfg(&cfg)
			rs, err := run(t, cfg)
			if err == nil || !strings.Contains(err.Error(), c.want) || len(rs) != 0 {
				t.Fatalf("Run: %d results, %v; want none and an error containing %q", len(rs), err, c.want)
			}
			if errors.Is(err, ErrVerify) || strings.Contains(err.Error(), secret) || strings.HasPrefix(err.Error(), "bench:") {
				t.Fatalf("Run: %v", err)
			}
		})
	}
}

// TestTimeoutIsNotAVerificationFailure: a mode that runs out of time fails
// the run, but its error does not claim the checks failed.
func TestTimeoutIsNotAVerificationFailure(t *testing.T) {
	cfg := smallConfig(BrokerMemory)
	cfg.Modes = []Mode{ModeNaive1}
	cfg.Messages = 5000
	cfg.ModeTimeout = time.Millisecond
	rs, err := run(t, cfg)
	if err == nil || errors.Is(err, ErrVerify) || !strings.Contains(err.Error(), "1 of 1 runs failed: naive-1: timed out") || len(rs) != 1 {
		t.Fatalf("Run: %d results, %v", len(rs), err)
	}
}
