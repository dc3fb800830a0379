package processed

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemq/idemq/consumer"
)

// batchSQL returns the statements of ClaimBatch for the quoted table t.
func batchSQL(t string) (insert, existing string) {
	insert = `INSERT INTO ` + t + ` (consumer, message_id, fingerprint, source, partition, "offset")
SELECT $1, u.id, u.fp, u.src, NULLIF(u.part, -1), NULLIF(u.off, -1)
FROM unnest($2::text[], $3::bytea[], $4::text[], $5::int[], $6::bigint[]) AS u(id, fp, src, part, off)
ON CONFLICT (consumer, message_id) DO NOTHING
RETURNING message_id`
	// One primary-key probe per id, whatever the planner believes. The
	// plain form, WHERE consumer = $1 AND message_id = ANY($2), is planned
	// as an index scan on consumer alone that filters message_id whenever
	// the statistics do not know the consumer (a new consumer, stale
	// statistics, or a generic plan made while the table was small): it
	// then reads every row the consumer has, per batch. LIMIT 1 keeps the
	// lateral subquery from being flattened into such a join.
	existing = `SELECT p.message_id, p.fingerprint, p.processed_at
FROM unnest($2::text[]) AS u(id)
CROSS JOIN LATERAL (
	SELECT message_id, fingerprint, processed_at FROM ` + t + `
	WHERE consumer = $1 AND message_id = u.id
	LIMIT 1) AS p`
	return insert, existing
}

// ClaimBatch claims many message ids of one consumer in tx with one INSERT
// (and, if some already exist, one SELECT): the batch form of Claim, with the
// same semantics per id. The claims must share a Consumer and have distinct
// message ids. Insertion follows the order of claims; callers that run
// concurrent batches should sort them, so that two batches never wait on
// each other's ids in opposite orders.
func (s *Store) ClaimBatch(ctx context.Context, tx pgx.Tx, claims []consumer.Claim) ([]consumer.ClaimResult, error) {
	if tx == nil {
		return nil, errors.New("processed: claim batch: nil transaction")
	}
	b, err := s.newBatchClaim(ctx, claims)
	if err != nil || len(claims) == 0 {
		return b.results, err
	}
	var inserted []string
	if b.st.partitioned {
		fis, err := s.firstBatchClaim(ctx, tx, b, claims)
		if err != nil {
			return nil, err
		}
		bt := &pgx.Batch{}
		bt.Queue(b.st.batchLock, claimLockKeys(claims), "")
		fis.queue(bt, func(rows pgx.Rows) error {
			ids, err := pgx.CollectRows(rows, pgx.RowTo[string])
			inserted = append(inserted, ids...)
			return err
		})
		if err := tx.SendBatch(ctx, bt).Close(); err != nil {
			return nil, fis.wrap("claim batch: lock and insert", err)
		}
		return b.finish(ctx, tx, inserted, fis.existing, fis.wrap)
	}
	if inserted, err = b.insert(ctx, tx, claims); err != nil {
		return nil, err
	}
	return b.finish(ctx, tx, inserted, "", nil)
}

// batchClaim is one ClaimBatch in progress.
type batchClaim struct {
	s       *Store
	st      *statements
	name    string
	claims  []consumer.Claim
	index   map[string]int
	results []consumer.ClaimResult
}

// newBatchClaim checks claims and prepares their claim.
func (s *Store) newBatchClaim(ctx context.Context, claims []consumer.Claim) (*batchClaim, error) {
	b := &batchClaim{s: s, claims: claims, results: make([]consumer.ClaimResult, len(claims))}
	if len(claims) == 0 {
		return b, nil
	}
	b.name = claims[0].Consumer
	b.index = make(map[string]int, len(claims))
	for i, c := range claims {
		if c.Consumer != b.name || c.Consumer == "" || c.MessageID == "" {
			return b, fmt.Errorf("processed: claim batch: claim %d: consumer %q, message id %q: want one non-empty consumer and non-empty ids", i, c.Consumer, c.MessageID)
		}
		if _, dup := b.index[c.MessageID]; dup {
			return b, fmt.Errorf("processed: claim batch: message id %q appears twice", c.MessageID)
		}
		b.index[c.MessageID] = i
	}
	st, err := s.statements(ctx)
	if err != nil {
		return b, err
	}
	b.st = st
	return b, nil
}

// insertArgs are the arguments of the batch INSERT of pending.
func (b *batchClaim) insertArgs(pending []consumer.Claim) []any {
	ids := make([]string, len(pending))
	fps := make([][]byte, len(pending))
	srcs := make([]string, len(pending))
	parts := make([]int32, len(pending))
	offs := make([]int64, len(pending))
	for i, c := range pending {
		ids[i], fps[i], srcs[i] = c.MessageID, c.Fingerprint[:], c.Source
		parts[i], offs[i] = max(c.Partition, -1), max(c.Offset, -1)
	}
	return []any{b.name, ids, fps, srcs, parts, offs}
}

// insert runs the batch INSERT of pending in tx and returns the ids it
// inserted; on a partitioned table, the full lookup's, between noScans and
// restoreScans, in one round trip.
func (b *batchClaim) insert(ctx context.Context, tx pgx.Tx, pending []consumer.Claim) ([]string, error) {
	var inserted []string
	err := b.query(ctx, tx, b.st.batchInsert, b.insertArgs(pending), func(rows pgx.Rows) error {
		var err error
		inserted, err = pgx.CollectRows(rows, pgx.RowTo[string])
		return err
	})
	if err != nil {
		return nil, b.s.wrap("claim batch: insert", err)
	}
	return inserted, nil
}

// query runs sql with args in tx, its rows to f; on a partitioned table
// between noScans and restoreScans (see partitionedSQL), in one round trip.
func (b *batchClaim) query(ctx context.Context, tx pgx.Tx, sql string, args []any, f func(pgx.Rows) error) error {
	if !b.st.partitioned {
		rows, err := tx.Query(ctx, sql, args...)
		if err != nil {
			return err
		}
		defer rows.Close()
		if err := f(rows); err != nil {
			return err
		}
		return rows.Err()
	}
	bt := &pgx.Batch{}
	bt.Queue(noScans)
	bt.Queue(sql, args...).Query(f)
	bt.Queue(b.st.restoreScans)
	return tx.SendBatch(ctx, bt).Close()
}

// finish records the first inserts' inserted ids, reads the rows the others
// conflicted with, and claims afresh the ids whose rows were purged in
// between, until every claim has its answer. After fast inserts (see
// seal.go), fastExisting is their batch read of the rows where they
// looked, which finds most rows more cheaply than the full lookup; the ids
// it does not find take the full lookup (wrap wraps its errors).
func (b *batchClaim) finish(ctx context.Context, tx pgx.Tx, inserted []string, fastExisting string, wrap func(op string, err error) error) ([]consumer.ClaimResult, error) {
	pending := b.claims
	for attempt := 1; ; attempt++ {
		claimed := make(map[string]bool, len(inserted))
		for _, id := range inserted {
			claimed[id] = true
			b.results[b.index[id]] = consumer.ClaimResult{Outcome: consumer.ClaimNew}
		}
		if len(inserted) == len(pending) {
			return b.results, nil
		}
		var conflicted []string
		for _, c := range pending {
			if !claimed[c.MessageID] {
				conflicted = append(conflicted, c.MessageID)
			}
		}
		// A new statement, so a new snapshot: it sees the rows of the
		// transactions the insert waited for. Its shape fixes the plan, so
		// it can be a cached prepared statement (see batchSQL).
		if attempt == 1 && fastExisting != "" {
			var err error
			if conflicted, err = b.existing(ctx, tx, fastExisting, conflicted); err != nil {
				return nil, wrap("claim batch: select existing", err)
			}
		}
		var missing []string
		if len(conflicted) > 0 {
			var err error
			if missing, err = b.existing(ctx, tx, b.st.batchExisting, conflicted); err != nil {
				return nil, b.s.wrap("claim batch: select existing", err)
			}
		}
		// Rows purged between the two statements are claimed afresh.
		pending = pending[:0:0]
		for _, id := range missing {
			pending = append(pending, b.claims[b.index[id]])
		}
		if len(pending) == 0 {
			return b.results, nil
		}
		if attempt >= maxClaimAttempts {
			return nil, fmt.Errorf("processed: claim batch: %d rows conflicted but vanished %d times", len(pending), attempt)
		}
		var err error
		if inserted, err = b.insert(ctx, tx, pending); err != nil {
			return nil, err
		}
	}
}

// existing reads, with sql (batchExisting or a fast one), the rows of ids,
// records them as duplicates or mismatches, and returns the ids it did not
// find.
func (b *batchClaim) existing(ctx context.Context, tx pgx.Tx, sql string, ids []string) ([]string, error) {
	found := make(map[string]bool, len(ids))
	err := b.query(ctx, tx, sql, []any{b.name, ids}, func(rows pgx.Rows) error {
		var (
			id string
			fp []byte
			at time.Time
		)
		_, err := pgx.ForEachRow(rows, []any{&id, &fp, &at}, func() error {
			i := b.index[id]
			out := consumer.ClaimDuplicate
			if !bytes.Equal(fp, b.claims[i].Fingerprint[:]) {
				out = consumer.ClaimMismatch
			}
			b.results[i] = consumer.ClaimResult{Outcome: out, ProcessedAt: at}
			found[id] = true
			return nil
		})
		return err
	})
	if err != nil {
		return nil, err
	}
	var missing []string
	for _, id := range ids {
		if !found[id] {
			missing = append(missing, id)
		}
	}
	return missing, nil
}
