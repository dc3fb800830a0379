package processed_test

import (
	"context"
	"log/slog"
	"net/url"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemq/idemq/brokers/memory"
	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/consumer/dedup"
	"github.com/idemq/idemq/internal/testdb"
	"github.com/idemq/idemq/internal/testlog"
	"github.com/idemq/idemq/processed"
)

// TestDurability runs a primary of its own with a standby, s1, streaming
// from it, and reads the Durability of a store on each, and what Run logs
// when it starts: with s1 asynchronous, a commit is on one node and a
// failover can lose acked messages (a warning); once
// synchronous_standby_names names it, on two, and Run says so without a
// warning. A role that may not read pg_stat_replication's sync_state sees
// s1 as asynchronous while no standby can be synchronous, and as unknown
// after. It also reads a quorum, remote_apply set in the URL, a COMMIT
// that waits for more synchronous standbys than are connected, and the
// standby itself.
func TestDurability(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: starts private Postgres clusters with standbys")
	}
	t.Parallel()
	primary := testdb.NewCluster(t)
	standby := primary.Standby(t, "s1")
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	open := func(u string) *processed.Store {
		t.Helper()
		s, err := processed.Open(ctx, u, processed.Config{MaxConns: 2})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(s.Close)
		return s
	}
	store := open(primary.URL())
	if err := store.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	primary.Exec(t, "CREATE ROLE app LOGIN")
	limited := open(withUser(t, primary.URL(), "app"))

	// Asynchronous.
	const async = "a commit is on 1 node before the ack (this primary; 1 standby streams asynchronously, s1: a failover to it can lose acked messages)"
	d := durability(t, store, nil)
	wantDurability(t, "asynchronous", d, dedup.Durability{Nodes: 1, SynchronousCommit: "on", Asynchronous: []string{"s1"}}, async)
	wantDurability(t, "asynchronous, as a limited role", durability(t, limited, nil),
		dedup.Durability{Nodes: 1, SynchronousCommit: "on", Asynchronous: []string{"s1"}}, async)
	log := runLog(t, store, "idemq: 1 standby streams asynchronously")
	if !strings.Contains(log, `level=WARN msg="idemq: 1 standby streams asynchronously, s1: a failover to it can lose acked messages"`) {
		t.Errorf("Run's log with an asynchronous standby:\n%s", log)
	}

	// Synchronous.
	primary.Set(t, "synchronous_standby_names", "FIRST 1 (s1)")
	const sync = "a commit is on 2 nodes before the ack (this primary and 1 synchronous standby, s1; synchronous_commit=on)"
	d = durability(t, store, func(d dedup.Durability) bool {
		return d.SynchronousStandbyNames == "FIRST 1 (s1)" && len(d.Synchronous) == 1
	})
	wantDurability(t, "synchronous", d, dedup.Durability{Nodes: 2, SynchronousCommit: "on",
		SynchronousStandbyNames: "FIRST 1 (s1)", Synchronous: []string{"s1"}}, sync)
	log = runLog(t, store, "idemq: durability")
	if !strings.Contains(log, `level=INFO msg="idemq: durability: `+sync+`"`) || strings.Contains(log, "level=WARN") {
		t.Errorf("Run's log with a synchronous standby:\n%s", log)
	}
	wantDurability(t, "synchronous, as a limited role", durability(t, limited, nil),
		dedup.Durability{Nodes: 2, SynchronousCommit: "on", SynchronousStandbyNames: "FIRST 1 (s1)", Unknown: 1},
		"a commit is on 2 nodes before the ack (this primary and 1 synchronous standby; synchronous_commit=on; "+
			"1 standby streams whose sync_state this role cannot read (grant it pg_read_all_stats))")

	// remote_apply, from the URL: kept, and said.
	u, err := url.Parse(primary.URL())
	if err != nil {
		t.Fatal(err)
	}
	q := u.Query()
	q.Set("synchronous_commit", "remote_apply")
	u.RawQuery = q.Encode()
	wantDurability(t, "remote_apply", durability(t, open(u.String()), nil),
		dedup.Durability{Nodes: 2, SynchronousCommit: "remote_apply", SynchronousStandbyNames: "FIRST 1 (s1)", Synchronous: []string{"s1"}},
		"a commit is on 2 nodes before the ack (this primary and 1 synchronous standby, s1; synchronous_commit=remote_apply: they have applied it)")

	// A quorum.
	primary.Set(t, "synchronous_standby_names", "ANY 1 (s1, s2)")
	d = durability(t, store, func(d dedup.Durability) bool {
		return d.SynchronousStandbyNames == "ANY 1 (s1, s2)" && len(d.Synchronous) == 1
	})
	wantDurability(t, "quorum", d, dedup.Durability{Nodes: 2, Quorum: true, SynchronousCommit: "on",
		SynchronousStandbyNames: "ANY 1 (s1, s2)", Synchronous: []string{"s1"}},
		"a commit is on 2 nodes before the ack (this primary and any 1 of the quorum standbys s1; synchronous_commit=on)")

	// More synchronous standbys than are connected: COMMITs wait.
	primary.Set(t, "synchronous_standby_names", "FIRST 2 (s1, s2)")
	d = durability(t, store, func(d dedup.Durability) bool {
		return d.SynchronousStandbyNames == "FIRST 2 (s1, s2)" && len(d.Synchronous) == 1
	})
	const waits = "only 1 of the 2 synchronous standbys a COMMIT waits for is connected: COMMITs wait until enough are"
	wantDurability(t, "waiting", d, dedup.Durability{Nodes: 3, SynchronousCommit: "on",
		SynchronousStandbyNames: "FIRST 2 (s1, s2)", Synchronous: []string{"s1"}},
		"a commit is on 3 nodes before the ack (this primary and 2 synchronous standbys, s1; synchronous_commit=on; "+waits+")")
	if log := runLog(t, store, waits); !strings.Contains(log, `level=WARN msg="idemq: `+waits+`"`) {
		t.Errorf("Run's log with a missing synchronous standby:\n%s", log)
	}

	// The standby.
	onStandby := open(standby.URL())
	wantDurability(t, "standby", durability(t, onStandby, nil), dedup.Durability{Standby: true, SynchronousCommit: "on"},
		"none: this server is a standby (in recovery), where no claim can commit; the database URL must reach the primary")
	if log := runLog(t, onStandby, "is a standby"); !strings.Contains(log, `level=WARN msg="idemq: the store's database is a standby (in recovery)`) {
		t.Errorf("Run's log on a standby:\n%s", log)
	}
}

// durability reads s's Durability until ok accepts it (nil accepts any):
// a reloaded configuration takes a moment to show.
func durability(t *testing.T, s *processed.Store, ok func(dedup.Durability) bool) dedup.Durability {
	t.Helper()
	// A standby's sync_state changes when the walsender next hears from
	// it: on new WAL, or every wal_receiver_status_interval (10 s) on an
	// idle server, later still on a loaded machine. And an idle pooled
	// connection runs its first statement after a reload on the old
	// settings (it reloads before reading the next one), so the store's
	// connections may disagree with the walsender for a moment: wait for
	// the names and the states together.
	deadline := time.Now().Add(40 * time.Second)
	for {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		d, err := s.Durability(ctx)
		cancel()
		if err != nil {
			t.Fatalf("Durability: %v", err)
		}
		if ok == nil || ok(d) || time.Now().After(deadline) {
			return d
		}
		time.Sleep(50 * time.Millisecond)
	}
}

func wantDurability(t *testing.T, what string, got, want dedup.Durability, line string) {
	t.Helper()
	if !reflect.DeepEqual(got, want) {
		t.Errorf("%s: Durability\n%+v, want\n%+v", what, got, want)
	}
	if got.String() != line {
		t.Errorf("%s: Durability.String\n%s, want\n%s", what, got, line)
	}
}

// withUser returns u with its user replaced.
func withUser(t *testing.T, u, user string) string {
	t.Helper()
	p, err := url.Parse(u)
	if err != nil {
		t.Fatal(err)
	}
	p.User = url.User(user)
	return p.String()
}

// runLog runs a runtime over s until its log holds marker, and returns the
// log.
func runLog(t *testing.T, s *processed.Store, marker string) string {
	t.Helper()
	broker := memory.NewBroker()
	sub, err := broker.Subscribe("work", memory.SubscribeOptions{})
	if err != nil {
		t.Fatal(err)
	}
	logger, buf := testlog.New(slog.LevelInfo)
	rt, err := consumer.New(consumer.Config{
		Name: "durability", Source: sub, Store: s, Concurrency: 1,
		Handler: func(context.Context, pgx.Tx, *consumer.Message) error { return nil },
		Logger:  logger,
	})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- rt.Run(ctx) }()
	deadline := time.Now().Add(10 * time.Second)
	for !strings.Contains(buf.String(), marker) && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	cancel()
	if err := <-done; err != nil {
		t.Fatalf("Run: %v", err)
	}
	return buf.String()
}
