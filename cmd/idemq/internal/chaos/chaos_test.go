package chaos

import (
	"context"
	"fmt"
	"os"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"go.uber.org/goleak"
)

// TestMain doubles as the worker process: the harness starts this test
// binary with WorkerEnv set.
func TestMain(m *testing.M) {
	if os.Getenv(WorkerEnv) != "" || os.Getenv(ChainServiceEnv) != "" {
		os.Exit(WorkerMain())
	}
	goleak.VerifyTestMain(m)
}

func ids(n int, prefix string) map[string]bool {
	out := map[string]bool{}
	for i := range n {
		out[fmt.Sprintf("%s%d", prefix, i)] = true
	}
	return out
}

// consistent returns a CheckInput in which every id of a 10-id workload
// was applied exactly once.
func consistent() CheckInput {
	in := CheckInput{Confirmed: ids(10, "m"), Attempted: ids(10, "m"), Processed: ids(10, "m"),
		Effects: map[string]int{}, DeadLetters: map[string]int{}}
	for id := range in.Confirmed {
		in.Effects[id] = 1
	}
	return in
}

func TestCheckPassesExactlyOnce(t *testing.T) {
	v := Check(consistent())
	if !v.Pass() {
		t.Fatalf("consistent run failed the check: %+v", v)
	}
	if v.Confirmed != 10 || v.Processed != 10 || v.Effects != 10 {
		t.Fatalf("counts: %+v", v)
	}
}

func TestCheckDetectsLostMessage(t *testing.T) {
	in := consistent()
	delete(in.Effects, "m3")
	delete(in.Processed, "m3")
	v := Check(in)
	if v.Pass() || !slices.Equal(v.Lost, []string{"m3"}) {
		t.Fatalf("planted lost message m3 not reported: %+v", v)
	}
}

func TestCheckDetectsDuplicateEffect(t *testing.T) {
	in := consistent()
	in.Effects["m7"] = 2
	v := Check(in)
	if v.Pass() || !slices.Equal(v.Duplicates, []string{"m7"}) || v.Effects != 11 {
		t.Fatalf("planted duplicate effect m7 not reported: %+v", v)
	}
}

func TestCheckDetectsUnexpectedEffect(t *testing.T) {
	in := consistent()
	in.Effects["x1"] = 1
	in.Processed["x1"] = true
	v := Check(in)
	if v.Pass() || !slices.Equal(v.Unexpected, []string{"x1"}) {
		t.Fatalf("planted unexpected effect x1 not reported: %+v", v)
	}
	// An effect for an id whose publish was attempted but never confirmed
	// is allowed: the broker may have stored it.
	in = consistent()
	in.Attempted["u1"] = true
	in.Effects["u1"] = 1
	in.Processed["u1"] = true
	if v := Check(in); !v.Pass() {
		t.Fatalf("attempted-but-unconfirmed effect flagged: %+v", v)
	}
}

func TestCheckDetectsInconsistencyAndDeadLetters(t *testing.T) {
	in := consistent()
	delete(in.Processed, "m1") // effect without its claim
	in.DeadLetters["m2"] = 1
	v := Check(in)
	if v.Pass() || !slices.Equal(v.Inconsistent, []string{"m1"}) || !slices.Equal(v.DeadLettered, []string{"m2"}) {
		t.Fatalf("inconsistency or dead letter not reported: %+v", v)
	}
	in = consistent()
	in.Effects["m4"] = 0 // claim without its effect: also lost
	v = Check(in)
	if !slices.Equal(v.Lost, []string{"m4"}) || !slices.Equal(v.Inconsistent, []string{"m4"}) {
		t.Fatalf("claim without effect not reported: %+v", v)
	}
}

func TestCheckDetectsAbortedTransactionApplied(t *testing.T) {
	in := consistent()
	in.Aborted = map[string]bool{"x1": true, "x2": true}
	in.Attempted["x1"], in.Attempted["x2"] = true, true
	if v := Check(in); !v.Pass() || v.Aborted != 2 {
		t.Fatalf("aborted ids without effects failed the check: %+v", v)
	}
	in.Effects["x2"], in.Processed["x2"] = 1, true
	v := Check(in)
	if v.Pass() || !slices.Equal(v.AbortedApplied, []string{"x2"}) || len(v.Unexpected) != 0 {
		t.Fatalf("planted effect of aborted x2 not reported: %+v", v)
	}
}

func TestRedeliveriesPerKill(t *testing.T) {
	a, b, c := incKey{0, 0}, incKey{0, 1}, incKey{1, 0}
	dl := &deliveryLog{receipts: []receipt{
		{t: 1, inc: a, copy: "1"}, {t: 2, inc: a, copy: "2"}, {t: 3, inc: a, copy: "3"},
		{t: 4, inc: c, copy: "4"},
		// a is killed at 5: copies 2 and 3 come back, 1 was acked.
		{t: 6, inc: b, copy: "2"}, {t: 7, inc: c, copy: "3"},
		// c redelivers 4 to itself (a reconnect): not a kill's doing.
		{t: 8, inc: c, copy: "4"},
	}}
	r := redeliveriesPerKill(dl, map[incKey]int64{a: 5})
	if r.Deliveries != 7 || r.Total != 3 || !slices.Equal(r.PerKill, []int{2}) || r.Max != 2 {
		t.Fatalf("redeliveries: %+v", r)
	}
}

func TestProxyResetsAtCommit(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	db := quickHarness(t).DatabaseURL
	direct, err := pgx.Connect(ctx, db)
	if err != nil {
		t.Fatal(err)
	}
	defer direct.Close(ctx)
	table := "chaos_proxy_" + randomHex(4)
	if _, err := direct.Exec(ctx, "CREATE TABLE "+table+" (v text)"); err != nil {
		t.Fatal(err)
	}
	defer direct.Exec(context.Background(), "DROP TABLE "+table)
	target, err := hostPort(db)
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		action    CommitAction
		committed bool
	}{{CommitResetAfter, true}, {CommitResetBefore, false}, {CommitPass, true}} {
		p, err := NewProxy(target, ProxyOptions{Postgres: true, OnCommit: func() CommitAction { return tc.action }})
		if err != nil {
			t.Fatal(err)
		}
		cc, err := pgx.ParseConfig(db)
		if err != nil {
			t.Fatal(err)
		}
		cc.Host, cc.Port = "127.0.0.1", uint16(portOf(p.Addr()))
		conn, err := pgx.ConnectConfig(ctx, cc)
		if err != nil {
			t.Fatal(err)
		}
		tx, err := conn.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		v := fmt.Sprint(tc.action)
		if _, err := tx.Exec(ctx, "INSERT INTO "+table+" VALUES ($1)", v); err != nil {
			t.Fatal(err)
		}
		err = tx.Commit(ctx)
		if (err == nil) != (tc.action == CommitPass) {
			t.Errorf("action %d: commit error %v", tc.action, err)
		}
		var n int
		// The server may still be finishing the commit it was sent.
		deadline := time.Now().Add(5 * time.Second)
		for {
			if err := direct.QueryRow(ctx, "SELECT count(*) FROM "+table+" WHERE v = $1", v).Scan(&n); err != nil {
				t.Fatal(err)
			}
			if (n == 1) == tc.committed || time.Now().After(deadline) {
				break
			}
			time.Sleep(20 * time.Millisecond)
		}
		if (n == 1) != tc.committed {
			t.Errorf("action %d: %d rows, want committed=%v", tc.action, n, tc.committed)
		}
		_ = conn.Close(ctx)
		p.Close()
		st := p.Stats()
		if st.Commits != 1 {
			t.Errorf("action %d: proxy saw %d commits", tc.action, st.Commits)
		}
	}
}

// quickHarness returns the database and broker URLs the quick scenarios
// share with the other tests.
func quickHarness(t *testing.T) Config {
	t.Helper()
	db := os.Getenv("DATABASE_URL")
	if db == "" {
		db = "postgres://postgres@127.0.0.1:5432/test?sslmode=disable"
	}
	amqpURL := os.Getenv("AMQP_URL")
	if amqpURL == "" {
		amqpURL = "amqp://guest:guest@127.0.0.1:5672/"
	}
	dir := t.TempDir()
	if keep := os.Getenv("CHAOS_KEEP_DIR"); keep != "" {
		// Keep the workers' logs past the test, for a failure to be read.
		var err error
		if dir, err = os.MkdirTemp(keep, t.Name()+"-"); err != nil {
			t.Fatal(err)
		}
	}
	return Config{DatabaseURL: db, AMQPURL: amqpURL, WorkerCommand: []string{os.Args[0]}, Seed: 42, Dir: dir}
}

func runQuick(t *testing.T, cfg Config) []Result {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	var events strings.Builder
	cfg.Events = &events
	results, err := Run(ctx, cfg)
	if err != nil {
		t.Fatalf("run: %v\n%s", err, events.String())
	}
	if os.Getenv("CHAOS_DEBUG") != "" {
		t.Log(events.String())
	}
	for _, r := range results {
		t.Logf("%s: %d ids, %d kills (%d after commit), injected %v, verdict lost=%d dup=%d unexpected=%d, redeliveries per kill max %d (bound %d), %d graceful exits, %s",
			r.Scenario, r.Messages, r.Kills, r.KillsAfterCommit, r.Injected, len(r.Verdict.Lost), len(r.Verdict.Duplicates),
			len(r.Verdict.Unexpected), r.Redeliveries.Max, r.RedeliveryBound, r.GracefulExits, r.Duration.Round(time.Millisecond))
		if !r.Passed() {
			t.Errorf("scenario %s failed: %v (logs in %s)\n%s", r.Scenario, r.Failures, r.Dir, events.String())
		}
	}
	return results
}

// TestQuickScenarios runs small scenarios against the shared Postgres and
// RabbitMQ and an in-process kfake: real worker processes, SIGKILLs at
// random and right after COMMIT, Postgres resets at COMMIT, AMQP drops after
// commit, Kafka rebalances and offset-commit errors.
func TestQuickScenarios(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: chaos runs")
	}
	cfg := quickHarness(t)
	cfg.Scenarios = []Scenario{
		{Name: "quick-rabbit", Broker: BrokerRabbitMQ, Messages: 400, PublishOver: 3 * time.Second, Workers: 2,
			Kills: 3, SelfKills: 3, SelfKillEvery: 10, PGResetRate: 0.05, AMQPDropEvery: 50, Timeout: 90 * time.Second},
		{Name: "quick-kafka", Broker: BrokerKafka, Mode: ModeBatch, BatchSize: 8, Messages: 400, PublishOver: 3 * time.Second,
			Workers: 2, Kills: 2, SelfKills: 2, SelfKillEvery: 10, Rebalances: 1, OffsetCommitErrorRate: 0.5, Timeout: 90 * time.Second},
	}
	results := runQuick(t, cfg)
	if len(results) != 2 {
		t.Fatalf("%d results", len(results))
	}
	for _, r := range results {
		if r.Verdict.Confirmed != r.Messages {
			t.Errorf("%s: %d of %d ids confirmed", r.Scenario, r.Verdict.Confirmed, r.Messages)
		}
		if r.KillsAfterCommit == 0 || r.KillsRandom == 0 {
			t.Errorf("%s: kills random %d, after commit %d", r.Scenario, r.KillsRandom, r.KillsAfterCommit)
		}
		if r.ProducerDuplicates == 0 {
			t.Errorf("%s: no producer duplicates", r.Scenario)
		}
	}
	if r := results[0]; r.Injected["pg-reset-after-commit"]+r.Injected["pg-reset-before-commit"] == 0 || r.Injected["amqp-drop-after-commit"] == 0 {
		t.Errorf("rabbit: proxy faults not injected: %v", r.Injected)
	}
	if r := results[1]; r.Injected["offset-commit-error"] == 0 || r.Injected["member-join"] != 1 {
		t.Errorf("kafka: faults not injected: %v", r.Injected)
	}
}

// TestQuickTransactional runs a Kafka scenario with a transactional
// producer, a third of its transactions aborted, consumed read_committed
// through brokers/franz under SIGKILLs: every committed id is applied once,
// and no id of an aborted transaction at all.
func TestQuickTransactional(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: a chaos run")
	}
	cfg := quickHarness(t)
	cfg.Scenarios = []Scenario{
		{Name: "quick-kafka-txn", Broker: BrokerKafka, KafkaSource: SourceFranz, AbortRate: 0.33, Mode: ModeBatch, BatchSize: 8,
			Messages: 400, PublishOver: 3 * time.Second, Workers: 2, Kills: 2, SelfKills: 2, SelfKillEvery: 10, Timeout: 90 * time.Second},
	}
	results := runQuick(t, cfg)
	if len(results) != 1 {
		t.Fatalf("%d results", len(results))
	}
	r := results[0]
	if r.Injected["txn-abort"] == 0 || r.Verdict.Aborted == 0 {
		t.Errorf("no transaction aborted: %v, %d ids only in aborted transactions", r.Injected, r.Verdict.Aborted)
	}
	if r.Verdict.Confirmed == 0 || r.Verdict.Confirmed+r.Verdict.Aborted > r.Messages {
		t.Errorf("%d committed and %d aborted ids of %d", r.Verdict.Confirmed, r.Verdict.Aborted, r.Messages)
	}
	if r.KillsRandom == 0 || r.KillsAfterCommit == 0 {
		t.Errorf("kills random %d, after commit %d", r.KillsRandom, r.KillsAfterCommit)
	}
}

// TestQuickPrivatePostgresRestart runs a Kafka scenario on a Postgres
// cluster the harness starts itself, restarting it with pg_ctl -m
// immediate mid-run.
func TestQuickPrivatePostgresRestart(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: a chaos run on a private Postgres cluster")
	}
	cfg := quickHarness(t)
	cfg.DatabaseURL = ""
	cfg.Scenarios = []Scenario{
		{Name: "quick-pg-restart", Broker: BrokerKafka, Messages: 300, PublishOver: 3 * time.Second, Workers: 2,
			PGRestarts: 1, Kills: 1, PGLatency: time.Millisecond, Timeout: 90 * time.Second},
	}
	results := runQuick(t, cfg)
	if len(results) != 1 || results[0].Injected["pg-restart"] != 1 {
		t.Fatalf("postgres restart not injected: %+v", results)
	}
}

// TestQuickSabotageIsCaught is the negative control: workers that write
// their effect outside the dedup transaction, under Postgres resets at
// COMMIT, must be caught with duplicate effects.
func TestQuickSabotageIsCaught(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: a chaos run")
	}
	cfg := quickHarness(t)
	cfg.Scenarios = []Scenario{{Name: "quick-sabotage", Broker: BrokerKafka, Messages: 200, PublishOver: 2 * time.Second,
		Workers: 1, PGResetRate: 0.3, Sabotage: SabotageEffectOutsideTx, Timeout: 60 * time.Second}}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	results, err := Run(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	r := results[0]
	t.Logf("sabotaged run: %d duplicate effects, %d inconsistent, failures %v", len(r.Verdict.Duplicates), len(r.Verdict.Inconsistent), r.Failures)
	if r.Passed() || len(r.Verdict.Duplicates) == 0 {
		t.Fatalf("sabotaged run passed the checker: %+v", r.Verdict)
	}
}

// TestQuickPGFailover runs a scenario on a private Postgres primary with a
// synchronous standby, crashes the primary mid-stream and promotes the
// standby: every message is applied exactly once, with no gap between
// applies over PGFailoverStallBound. TestQuickAsyncFailoverIsCaught is its
// negative control.
func TestQuickPGFailover(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: a chaos run on a private Postgres pair")
	}
	cfg := quickHarness(t)
	cfg.Scenarios = []Scenario{{Name: "quick-pg-failover", Broker: BrokerRabbitMQ, PGFailover: true, Messages: 600,
		PublishOver: 8 * time.Second, Workers: 2, Kills: 2, Timeout: 90 * time.Second}}
	results := runQuick(t, cfg)
	if len(results) != 1 || results[0].Injected["pg-failover"] != 1 {
		t.Fatalf("failover not injected: %+v", results)
	}
	if r := results[0]; r.StallBound != PGFailoverStallBound || r.Stall.Max == 0 {
		t.Errorf("stall not measured: %+v, bound %s", r.Stall, r.StallBound)
	}
}

// TestQuickAsyncFailoverIsCaught is the failover's negative control: with
// an asynchronous standby a second behind, the commits acked on the
// crashed primary are missing on the promoted standby, and the checker
// must report them lost.
func TestQuickAsyncFailoverIsCaught(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: a chaos run on a private Postgres pair")
	}
	cfg := quickHarness(t)
	cfg.Scenarios = []Scenario{{Name: "quick-async-failover", Broker: BrokerRabbitMQ, PGFailover: true, Messages: 600,
		PublishOver: 8 * time.Second, Workers: 2, Sabotage: SabotageAsyncStandby, Timeout: 30 * time.Second}}
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	results, err := Run(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	r := results[0]
	t.Logf("asynchronous failover: %d lost, %d duplicate effects, failures %v", len(r.Verdict.Lost), len(r.Verdict.Duplicates), r.Failures)
	if r.Passed() || len(r.Verdict.Lost) == 0 {
		t.Fatalf("a failover to a lagging asynchronous standby passed the checker: %+v", r.Verdict)
	}
}
