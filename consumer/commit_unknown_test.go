package consumer_test

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/consumer/dedup"
)

// commitLosingStore loses the connection of its first five transactions
// at COMMIT: the first four before COMMIT reaches the server, the fifth
// after it committed, its answer lost.
type commitLosingStore struct {
	dedup.Store
	n atomic.Int32
}

type commitLosingTx struct {
	pgx.Tx
	committed bool
}

func (t commitLosingTx) Commit(ctx context.Context) error {
	if t.committed {
		if err := t.Tx.Commit(ctx); err != nil {
			return err
		}
		return errors.New("unexpected EOF")
	}
	_ = t.Tx.Conn().Close(ctx)
	return t.Tx.Commit(ctx)
}

func (s *commitLosingStore) BeginClaim(ctx context.Context, c []dedup.Claim) (pgx.Tx, []dedup.ClaimResult, error) {
	tx, res, err := s.Store.BeginClaim(ctx, c)
	if tx == nil || err != nil {
		return tx, res, err
	}
	n := s.n.Add(1)
	if n > 5 {
		return tx, res, nil
	}
	return commitLosingTx{Tx: tx, committed: n == 5}, res, nil
}

// A message whose transactions lose their connection at COMMIT as many
// times as Retry.MaxConnLosses, the last one after the COMMIT took
// effect, is not dead-lettered as never applied: the runtime asks its
// claim whether the last COMMIT took, and acks it as a duplicate of it.
func TestEdgeUnknownCommitOutcomeAskedBeforeDeadLetter(t *testing.T) {
	b := newBundle(t)
	b.publish(msg("m", "body"))
	cfg := b.config(b.insertEffect)
	cfg.Store = &commitLosingStore{Store: b.store}
	cfg.BatchSize = 1
	r := start(t, cfg)
	waitFor(t, "settled", func() bool {
		st := r.rt.Stats()
		return b.settled() && st.InFlight == 0 && st.Received == 1
	})
	st := r.rt.Stats()
	if got := b.effectCounts()["m"]; got != 1 {
		t.Fatalf("m's effect %d times, want once", got)
	}
	if st.DeadLettered != 0 || st.Duplicates != 1 {
		t.Fatalf("stats %+v, dead letters %v: want m acked as the duplicate of its own commit, not dead-lettered", st, b.dlq.list())
	}
}

// probeFailingStore commits its first transaction and loses the answer;
// its second BeginClaim, the runtime asking whether that COMMIT took,
// fails: at once, or, with block, only when its context ends.
type probeFailingStore struct {
	dedup.Store
	n       atomic.Int32
	block   bool
	probing chan struct{}
}

func (s *probeFailingStore) BeginClaim(ctx context.Context, c []dedup.Claim) (pgx.Tx, []dedup.ClaimResult, error) {
	switch s.n.Add(1) {
	case 1:
		tx, res, err := s.Store.BeginClaim(ctx, c)
		if err != nil {
			return tx, res, err
		}
		return commitLosingTx{Tx: tx, committed: true}, res, nil
	case 2:
		if s.block {
			close(s.probing)
			<-ctx.Done()
			return nil, nil, ctx.Err()
		}
		return nil, nil, errors.New("dial tcp: connection reset by peer")
	}
	return s.Store.BeginClaim(ctx, c)
}

// When asking whether an unknown COMMIT took fails too, the message is
// not dead-lettered: it is retried (and found a duplicate), or, at
// shutdown, requeued.
func TestEdgeUnknownCommitOutcomeWhenAskingFails(t *testing.T) {
	for _, block := range []bool{false, true} {
		t.Run(map[bool]string{false: "asking fails", true: "shutdown while asking"}[block], func(t *testing.T) {
			b := newBundle(t)
			b.publish(msg("m", "body"))
			cfg := b.config(b.insertEffect)
			st := &probeFailingStore{Store: b.store, block: block, probing: make(chan struct{})}
			cfg.Store = st
			cfg.BatchSize = 1
			cfg.Retry.MaxConnLosses = 1
			cfg.ShutdownTimeout = 200 * time.Millisecond
			r := start(t, cfg)
			if block {
				<-st.probing
				r.stop(t)
			} else {
				waitFor(t, "settled", func() bool { return b.settled() && r.rt.Stats().InFlight == 0 })
			}
			if got := b.effectCounts()["m"]; got != 1 {
				t.Fatalf("m's effect %d times, want once", got)
			}
			if dl := b.dlq.list(); len(dl) != 0 {
				t.Fatalf("m dead-lettered as %s though its COMMIT took", dl[0].f.Class)
			}
			if st := r.rt.Stats(); !block && st.Duplicates != 1 {
				t.Fatalf("stats %+v: want m acked as a duplicate", st)
			}
		})
	}
}

// rivalStore loses its first transaction's connection at COMMIT, the
// COMMIT not taken; while that answer is lost, another process applies
// the same id with another payload.
type rivalStore struct {
	dedup.Store
	n atomic.Int32
}

type rivalTx struct {
	pgx.Tx
	store dedup.Store
}

func (t rivalTx) Commit(ctx context.Context) error {
	_ = t.Tx.Conn().Close(ctx)
	rival := dedup.Claim{Consumer: "test-consumer", MessageID: "m", Fingerprint: msg("m", "another body").Fingerprint()}
	tx, _, err := t.store.BeginClaim(ctx, []dedup.Claim{rival})
	if err != nil {
		return err
	}
	if err := tx.Commit(ctx); err != nil {
		return err
	}
	return t.Tx.Commit(ctx)
}

func (s *rivalStore) BeginClaim(ctx context.Context, c []dedup.Claim) (pgx.Tx, []dedup.ClaimResult, error) {
	tx, res, err := s.Store.BeginClaim(ctx, c)
	if tx == nil || err != nil || s.n.Add(1) > 1 {
		return tx, res, err
	}
	return rivalTx{Tx: tx, store: s.Store}, res, nil
}

// When asking whether an unknown COMMIT took finds the id applied with
// another payload, the message was not applied: it is dead-lettered as a
// fingerprint mismatch, neither acked as a duplicate nor applied.
func TestEdgeUnknownCommitOutcomeFindsAnotherPayload(t *testing.T) {
	b := newBundle(t)
	b.publish(msg("m", "body"))
	cfg := b.config(b.insertEffect)
	cfg.Store = &rivalStore{Store: b.store}
	cfg.BatchSize = 1
	cfg.Retry.MaxConnLosses = 1
	r := start(t, cfg)
	waitFor(t, "settled", func() bool { return b.settled() && r.rt.Stats().InFlight == 0 })
	if got := b.effectCounts()["m"]; got != 0 {
		t.Fatalf("m's effect %d times, want none: its COMMIT did not take", got)
	}
	dl := b.dlq.list()
	if len(dl) != 1 || dl[0].f.Class != consumer.ClassFingerprintMismatch {
		t.Fatalf("dead letters %v, stats %+v: want m dead-lettered once as a fingerprint mismatch", dl, r.rt.Stats())
	}
}
