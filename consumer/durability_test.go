package consumer

import (
	"context"
	"errors"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/idemq/idemq/consumer/dedup"
	"github.com/idemq/idemq/internal/testlog"
)

// TestDurabilityString: the words for what an ack rests on, in the states
// the database tests cannot reach cheaply too.
func TestDurabilityString(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		d    dedup.Durability
		want string
	}{
		{dedup.Durability{Nodes: 1, SynchronousCommit: "on"},
			"a commit is on 1 node before the ack (this server; no standby streams from it)"},
		{dedup.Durability{Nodes: 1, SynchronousCommit: "remote_apply", Asynchronous: []string{"a", "b"}},
			"a commit is on 1 node before the ack (this primary; 2 standbys stream asynchronously, a, b: a failover to one of them can lose acked messages)"},
		{dedup.Durability{Nodes: 2, SynchronousCommit: "remote_write", Synchronous: []string{"s1"}, Asynchronous: []string{"s2"}},
			"a commit is on 2 nodes before the ack (this primary and 1 synchronous standby, s1; synchronous_commit=remote_write: they have written it, not flushed it; " +
				"1 standby streams asynchronously, s2: a failover to it can lose acked messages)"},
		{dedup.Durability{Nodes: 2, Quorum: true, SynchronousCommit: "on", Synchronous: []string{"s1", "s2", "s3"}},
			"a commit is on 2 nodes before the ack (this primary and any 1 of the quorum standbys s1, s2, s3, so a failover must promote the most advanced; synchronous_commit=on)"},
		{dedup.Durability{Nodes: 3, SynchronousCommit: "on", Synchronous: []string{"s1", "s2"}},
			"a commit is on 3 nodes before the ack (this primary and 2 synchronous standbys, s1, s2; synchronous_commit=on)"},
		{dedup.Durability{Nodes: 2, SynchronousCommit: "on"},
			"a commit is on 2 nodes before the ack (this primary and 1 synchronous standby; synchronous_commit=on; " +
				"only 0 of the 1 synchronous standbys a COMMIT waits for are connected: COMMITs wait until enough are)"},
		{dedup.Durability{Standby: true, SynchronousCommit: "on"},
			"none: this server is a standby (in recovery), where no claim can commit; the database URL must reach the primary"},
	} {
		if got := c.d.String(); got != c.want {
			t.Errorf("%+v:\n got %s\nwant %s", c.d, got, c.want)
		}
	}
}

// durableStore is a Store that reports a Durability, or fails to.
type durableStore struct {
	nopStore
	d   dedup.Durability
	err error
}

func (s durableStore) Durability(context.Context) (dedup.Durability, error) { return s.d, s.err }

// TestRunLogsDurability: Run reads a Store's Durability method when
// it starts and logs it, at Info when a failover loses nothing and commits
// do not wait, with a warning for each risk otherwise, and a warning when
// it cannot read it.
func TestRunLogsDurability(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		store dedup.Store
		want  []string
	}{
		{durableStore{d: dedup.Durability{Nodes: 2, SynchronousCommit: "on", Synchronous: []string{"s1"}}},
			[]string{`level=INFO msg="idemq: durability: a commit is on 2 nodes before the ack (this primary and 1 synchronous standby, s1; synchronous_commit=on)" consumer=payments nodes=2`}},
		{durableStore{d: dedup.Durability{Nodes: 2, SynchronousCommit: "on", Asynchronous: []string{"s2"}}},
			[]string{`level=WARN msg="idemq: 1 standby streams asynchronously, s2: a failover to it can lose acked messages"`,
				`level=WARN msg="idemq: only 0 of the 1 synchronous standbys a COMMIT waits for are connected: COMMITs wait until enough are"`}},
		{durableStore{d: dedup.Durability{Standby: true}},
			[]string{`level=WARN msg="idemq: the store's database is a standby (in recovery): no claim can commit there until it is promoted"`, "target_session_attrs=read-write"}},
		{durableStore{err: errors.New("no answer")},
			[]string{`level=WARN msg="idemq: cannot read the database's replication state, so cannot tell how many nodes hold a commit before its ack" consumer=payments error="no answer"`}},
		{nopStore{}, nil},
	} {
		logger, buf := testlog.New(slog.LevelInfo)
		cfg := validConfig()
		cfg.Store = c.store
		cfg.Logger = logger
		rt, err := New(cfg)
		if err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
		if err := rt.Run(ctx); err != nil {
			t.Fatal(err)
		}
		cancel()
		log := buf.String()
		for _, w := range c.want {
			if !strings.Contains(log, w) {
				t.Errorf("%T %+v: the log lacks %s:\n%s", c.store, c.store, w, log)
			}
		}
		if len(c.want) == 0 && strings.Contains(log, "durab") {
			t.Errorf("a Store that reports no durability: the log has\n%s", log)
		}
	}
}

// TestAgeBucketsMatchDedup: the runtime's histogram has one bucket per
// dedup.AgeBounds bound and one for older ages.
func TestAgeBucketsMatchDedup(t *testing.T) {
	if n := len(dedup.AgeBounds()) + 1; n != ageBuckets {
		t.Fatalf("ageBuckets %d, want %d", ageBuckets, n)
	}
}
