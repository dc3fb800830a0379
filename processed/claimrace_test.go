package processed_test

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemq/idemq/consumer/dedup"
	"github.com/idemq/idemq/processed"
)

// hookedDB runs hook once, armed, right after a batch (BeginClaim's BEGIN
// and INSERT) has been read, before the claim's next statement.
type hookedDB struct {
	*pgxpool.Pool
	armed atomic.Bool
	hook  func()
}

func (d *hookedDB) SendBatch(ctx context.Context, b *pgx.Batch) pgx.BatchResults {
	return hookedResults{d.Pool.SendBatch(ctx, b), d}
}

type hookedResults struct {
	pgx.BatchResults
	d *hookedDB
}

func (r hookedResults) Close() error {
	err := r.BatchResults.Close()
	if r.d.armed.CompareAndSwap(true, false) {
		r.d.hook()
	}
	return err
}

// TestClaimRacingPurgeNeverDeadlocks: claim 1 of ids a and b inserts b and
// conflicts with a's old row; a purge deletes that row before claim 1 reads
// it; claim 2 of the same ids inserts a and waits on claim 1's b. Claim 1
// claiming a afresh in its transaction would wait on claim 2: a deadlock
// (CI saw one beside a purge). It begins again instead, and both claims
// end without an error, each id applied once.
func TestClaimRacingPurgeNeverDeadlocks(t *testing.T) {
	t.Parallel()
	s2, pool := setup(t, processed.Config{})
	claims := []dedup.Claim{claimOf("p", "a", "x"), claimOf("p", "b", "x")}
	claim(t, s2, claims[0]) // a's old row
	db := &hookedDB{Pool: pool}
	s1, err := processed.New(db, processed.Config{Schema: s2.Schema()})
	if err != nil {
		t.Fatal(err)
	}
	second := make(chan error, 1)
	var res2 []dedup.ClaimResult
	db.hook = func() {
		if _, err := pool.Exec(ctx(t), "DELETE FROM "+pgx.Identifier{s2.Schema(), "processed_messages"}.Sanitize()+" WHERE message_id = 'a'"); err != nil {
			t.Error(err)
		}
		go func() {
			tx, res, err := s2.BeginClaim(ctx(t), claims)
			if err == nil {
				res2 = res
				err = tx.Commit(ctx(t))
			}
			second <- err
		}()
		// Until claim 2 waits on claim 1's b.
		deadline := time.Now().Add(10 * time.Second)
		for time.Now().Before(deadline) {
			var waiting int
			if err := pool.QueryRow(ctx(t), `SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND position($1 in query) > 0`, s2.Schema()).Scan(&waiting); err != nil {
				t.Error(err)
				return
			}
			if waiting > 0 {
				return
			}
			time.Sleep(10 * time.Millisecond)
		}
		t.Error("claim 2 never waited on claim 1")
	}
	db.armed.Store(true)
	tx, res1, err := s1.BeginClaim(ctx(t), claims)
	if err != nil {
		t.Fatalf("claim 1: %v", err)
	}
	// Claim 1 began again, behind claim 2's rows: it answers only once
	// claim 2 committed.
	if err := <-second; err != nil {
		t.Fatalf("claim 2: %v", err)
	}
	if err := tx.Commit(ctx(t)); err != nil {
		t.Fatal(err)
	}
	for i := range claims {
		if res2[i].Outcome != dedup.ClaimNew || res1[i].Outcome != dedup.ClaimDuplicate {
			t.Errorf("%s: claim 1 %v, claim 2 %v; want duplicate and new", claims[i].MessageID, res1[i].Outcome, res2[i].Outcome)
		}
	}
}
