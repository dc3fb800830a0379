package consumer_test

import (
	"context"
	"fmt"
	"os/exec"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemq/idemq/brokers/memory"
	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/internal/testdb"
	"github.com/idemq/idemq/processed"
)

// failoverStallBound is the longest gap between two applies this test
// allows across a failover: the promotion (a second or two), pgx's next
// connection to the host that now accepts writes, and the runtime's backoff
// on the database errors meanwhile.
const failoverStallBound = 15 * time.Second

// TestPostgresFailoverWithSyncStandby: a consumer on a primary with a
// synchronous standby, through a multi-host URL with
// target_session_attrs=read-write. Mid-stream the primary dies (an
// immediate stop) and the standby is promoted. Every message is applied
// exactly once on the promoted node, nothing acked is lost, and the
// consumer stops for no longer than failoverStallBound.
func TestPostgresFailoverWithSyncStandby(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: starts a private Postgres pair and fails it over")
	}
	t.Parallel()
	primary := testdb.NewCluster(t)
	standby := primary.Standby(t, "s1")
	primary.Set(t, "synchronous_standby_names", "s1")
	deadline := time.Now().Add(30 * time.Second)
	for {
		var sync bool
		if err := primary.QueryRow(t, `SELECT EXISTS (SELECT 1 FROM pg_stat_replication WHERE application_name = 's1' AND sync_state = 'sync')`).Scan(&sync); err == nil && sync {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the standby never became synchronous")
		}
		time.Sleep(50 * time.Millisecond)
	}

	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	url := fmt.Sprintf("postgres://postgres@127.0.0.1:%d,127.0.0.1:%d/postgres?sslmode=disable&target_session_attrs=read-write&connect_timeout=2",
		primary.Port, standby.Port)
	store, err := processed.Open(ctx, url, processed.Config{Schema: "failover", MaxConns: 8})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(store.Close)
	if err := store.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	applied := pgx.Identifier{"failover", "applied"}.Sanitize()
	if _, err := store.Pool().Exec(ctx, "CREATE TABLE "+applied+" (message_id text NOT NULL, at timestamptz NOT NULL DEFAULT clock_timestamp())"); err != nil {
		t.Fatal(err)
	}

	const total = 2000
	broker := memory.NewBroker()
	msgs := make([]*consumer.Message, total)
	for i := range msgs {
		msgs[i] = msg(fmt.Sprintf("f-%04d", i), "x")
	}
	if err := broker.Publish(ctx, "payments", msgs...); err != nil {
		t.Fatal(err)
	}
	sub, err := broker.Subscribe("payments", memory.SubscribeOptions{})
	if err != nil {
		t.Fatal(err)
	}
	r := start(t, consumer.Config{Name: "failover", Source: sub, Store: store, Concurrency: 4, ShutdownTimeout: 10 * time.Second,
		DeadLetterer: consumer.DeadLettererFunc(func(_ context.Context, m *consumer.Message, f consumer.Failure) error {
			t.Errorf("dead-lettered %s: %s: %v", m.ID, f.Class, f.Err)
			return fmt.Errorf("the test refuses dead letters")
		}),
		Handler: func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
			time.Sleep(2 * time.Millisecond)
			_, err := tx.Exec(ctx, "INSERT INTO "+applied+" (message_id) VALUES ($1)", m.ID)
			return err
		}})

	waitFor(t, "a quarter applied", func() bool { return r.rt.Stats().Applied >= total/4 })
	for _, args := range [][]string{
		{"pg_ctlcluster", primary.Version, primary.Name, "stop", "-m", "immediate"},
		{"pg_ctlcluster", standby.Version, standby.Name, "promote"},
	} {
		if out, err := exec.Command(args[0], args[1:]...).CombinedOutput(); err != nil {
			t.Fatalf("%v: %v: %s", args, err, out)
		}
	}
	t.Logf("primary stopped and standby promoted after %d applied", r.rt.Stats().Applied)
	deadline = time.Now().Add(2 * time.Minute)
	for !(broker.Ready("payments") == 0 && broker.Unacked("payments") == 0) {
		if time.Now().After(deadline) {
			t.Fatalf("not settled 2 minutes after the failover: %+v", r.rt.Stats())
		}
		time.Sleep(20 * time.Millisecond)
	}

	var rows, distinct int
	var secs float64
	if err := standby.QueryRow(t, `SELECT count(*), count(DISTINCT message_id),
		coalesce(extract(epoch FROM max(d)), 0)::float8 FROM (SELECT message_id, at - lag(at) OVER (ORDER BY at) AS d FROM `+applied+`) g`).
		Scan(&rows, &distinct, &secs); err != nil {
		t.Fatal(err)
	}
	gap := time.Duration(secs * float64(time.Second))
	t.Logf("on the promoted node: %d rows, %d ids; the longest gap between applies %s; runtime %+v", rows, distinct, gap.Round(time.Millisecond), r.rt.Stats())
	if rows != total || distinct != total {
		t.Fatalf("%d effects of %d ids for %d messages on the promoted node: want each once", rows, distinct, total)
	}
	if gap > failoverStallBound {
		t.Fatalf("the consumer stalled %s across the failover, longer than %s", gap.Round(time.Millisecond), failoverStallBound)
	}
}
