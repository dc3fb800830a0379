package processed

import (
	"bytes"
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
)

// MoveReport counts what MoveRows did, or what FinishReshard found.
type MoveReport struct {
	// Scanned counts the rows read on the shard.
	Scanned int64
	// Moved counts the rows copied to the target shard, checked there,
	// and deleted from the source; Present those of them the target
	// already held (a duplicate's claim there copies its row).
	Moved, Present int64
	// Misplaced counts the rows whose shard key the map places on another
	// shard: what MoveRows has left to move.
	Misplaced int64
	// Unkeyed counts the rows without a shard key (claimed by a store of
	// one database, or before migration 0007): no map places them, so
	// they stay until the janitor's purges remove them.
	Unkeyed int64
}

// movePage is how many rows MoveRows reads, copies and deletes at a time.
const movePage = 1000

// movedRow is a row of a shard's dedup table, with its shard key.
type movedRow struct {
	Row
	key *string
}

// scanRows reads shard st's rows in pages of primary key order, those
// processed before before if it is not zero, and calls fn with each page.
func scanRows(ctx context.Context, st *Store, before time.Time, fn func([]movedRow) error) error {
	stm, err := st.statements(ctx)
	if err != nil {
		return err
	}
	after, order := `(consumer, message_id) > ($1, $2)`, `consumer, message_id`
	if stm.keyed {
		after, order = `(consumer, shard_key, message_id) > ($1, $5, $2)`, `consumer, shard_key, message_id`
	}
	q := `SELECT consumer, message_id, fingerprint, processed_at, source, partition, "offset", shard_key FROM ` + stm.layout.readFrom() + `
WHERE ` + after + ` AND ($4::timestamptz IS NULL OR processed_at < $4)
ORDER BY ` + order + ` LIMIT $3`
	var (
		lastConsumer, lastID, lastKey string
		cutoff                        *time.Time
	)
	if !before.IsZero() {
		cutoff = &before
	}
	for {
		args := []any{lastConsumer, lastID, movePage, cutoff}
		if stm.keyed {
			args = append(args, lastKey)
		}
		rows, err := st.db.Query(ctx, q, args...)
		if err != nil {
			return st.wrap("read the rows to move", err)
		}
		page, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (movedRow, error) {
			var m movedRow
			err := r.Scan(&m.Consumer, &m.MessageID, &m.Fingerprint, &m.ProcessedAt, &m.Source, &m.Partition, &m.Offset, &m.key)
			return m, err
		})
		if err != nil {
			return st.wrap("read the rows to move", err)
		}
		if len(page) == 0 {
			return nil
		}
		if err := fn(page); err != nil {
			return err
		}
		last := page[len(page)-1]
		lastConsumer, lastID = last.Consumer, last.MessageID
		if last.key != nil {
			lastKey = *last.key
		}
		if len(page) < movePage {
			return nil
		}
	}
}

// scanPlaced reads st's rows as scanRows does, counting them and those
// without a shard key in rep, and calls fn with each page's keyed rows and
// the shard the map places each on.
func (s *Sharded) scanPlaced(ctx context.Context, st *Store, before time.Time, rep *MoveReport, fn func(keyed []movedRow, shards []int) error) error {
	return scanRows(ctx, st, before, func(page []movedRow) error {
		rep.Scanned += int64(len(page))
		var (
			keyed  []movedRow
			shards []int
		)
		for _, r := range page {
			if r.key == nil || *r.key == "" { // the empty key: a row inserted by hand
				rep.Unkeyed++
				continue
			}
			n, err := s.cur.place(*r.key)
			if err != nil {
				return fmt.Errorf("processed: place a row's shard key: %w", err)
			}
			keyed, shards = append(keyed, r), append(shards, n)
		}
		return fn(keyed, shards)
	})
}

// MoveRows moves the dedup rows of shard from whose shard keys the map
// (ShardedConfig.Map) places on shard to: during a reshard, the rows of
// the keys that moved, so that FinishReshard can end it without waiting
// for them to age out. The consumers keep running (with both maps, as the
// reshard has them). A page of rows at a time is inserted on to (keeping
// each row's fingerprint and time; a row to already holds is kept), read
// back there and compared, and only then deleted from from. A row whose
// id to holds with another fingerprint stops the move with an error. Rows
// without a shard key are counted, and left. progress, if not nil, is
// called after each page.
func (s *Sharded) MoveRows(ctx context.Context, from, to int, progress func(MoveReport)) (MoveReport, error) {
	var rep MoveReport
	switch {
	case from < 0 || from >= len(s.stores) || to < 0 || to >= s.cur.Shards:
		return rep, fmt.Errorf("processed: move rows from shard %d to shard %d: the store has %d shards, and the map %d", from, to, len(s.stores), s.cur.Shards)
	case from == to:
		return rep, fmt.Errorf("processed: move rows from shard %d to itself", from)
	}
	if err := s.check(ctx); err != nil {
		return rep, err
	}
	src, dst := s.stores[from], s.stores[to]
	dstStm, err := dst.statements(ctx)
	if err != nil {
		return rep, err
	}
	srcStm, err := src.statements(ctx)
	if err != nil {
		return rep, err
	}
	err = s.scanPlaced(ctx, src, time.Time{}, &rep, func(keyed []movedRow, shards []int) error {
		var move []movedRow
		for j, r := range keyed {
			if shards[j] == to {
				move = append(move, r)
			}
		}
		if len(move) == 0 {
			return nil
		}
		present, err := copyRows(ctx, dst, dstStm, move)
		if err != nil {
			return fmt.Errorf("processed: move rows to shard %d: %w", to, err)
		}
		if err := deleteRows(ctx, src, srcStm, move); err != nil {
			return fmt.Errorf("processed: move rows: delete them from shard %d: %w", from, err)
		}
		rep.Moved += int64(len(move))
		rep.Present += present
		if progress != nil {
			progress(rep)
		}
		return nil
	})
	return rep, err
}

// copyRows inserts rows on st where it holds no row of their ids, then
// reads them back and checks each one's fingerprint; it returns how many
// st held already.
func copyRows(ctx context.Context, st *Store, stm *statements, rows []movedRow) (int64, error) {
	into, others := stm.layout.claimTables()
	cons := make([]string, len(rows))
	ids := make([]string, len(rows))
	fps := make([][]byte, len(rows))
	ats := make([]time.Time, len(rows))
	srcs := make([]string, len(rows))
	parts := make([]*int32, len(rows))
	offs := make([]*int64, len(rows))
	keys := make([]*string, len(rows))
	for i, r := range rows {
		cons[i], ids[i], fps[i], ats[i], srcs[i], parts[i], offs[i], keys[i] = r.Consumer, r.MessageID, r.Fingerprint, r.ProcessedAt, r.Source, r.Partition, r.Offset, r.key
	}
	sk := "u.sk"
	if stm.keyed {
		sk = "coalesce(u.sk, '')" // its shard keys are never NULL
	}
	q := `INSERT INTO ` + into + ` (consumer, message_id, fingerprint, processed_at, source, partition, "offset", shard_key)
SELECT u.c, u.id, u.fp, u.at, u.src, u.part, u.off, ` + sk + `
FROM unnest($1::text[], $2::text[], $3::bytea[], $4::timestamptz[], $5::text[], $6::int[], $7::bigint[], $8::text[]) AS u(c, id, fp, at, src, part, off, sk)
WHERE true`
	for _, g := range others {
		q += "\n\tAND NOT EXISTS (SELECT 1 FROM " + g + " g WHERE g.consumer = u.c AND g.message_id = u.id)"
	}
	q += "\nON CONFLICT " + stm.conflictKey() + " DO NOTHING"
	tag, err := st.db.Exec(ctx, q, cons, ids, fps, ats, srcs, parts, offs, keys)
	if err != nil {
		return 0, st.wrap("copy rows", err)
	}
	// Read them back: every id must be there, with its fingerprint (with
	// the shard key in the primary key, every id and key; checkKeys[i] is
	// row i's key there, "" elsewhere).
	sameKey, checkKeys := "", make([]string, len(rows))
	if stm.keyed {
		sameKey = " AND shard_key = u.sk"
		for i, r := range rows {
			if r.key != nil {
				checkKeys[i] = *r.key
			}
		}
	}
	check, err := st.db.Query(ctx, `SELECT p.consumer, p.message_id, u.sk, p.fingerprint
FROM unnest($1::text[], $2::text[], $3::text[]) AS u(c, id, sk)
CROSS JOIN LATERAL (SELECT consumer, message_id, fingerprint FROM `+stm.layout.readFrom()+`
	WHERE consumer = u.c AND message_id = u.id`+sameKey+` LIMIT 1) AS p`, cons, ids, checkKeys)
	if err != nil {
		return 0, st.wrap("check the copied rows", err)
	}
	type ck struct{ c, id, sk string }
	have := map[ck][]byte{}
	for check.Next() {
		var c, id, sk string
		var fp []byte
		if err := check.Scan(&c, &id, &sk, &fp); err != nil {
			check.Close()
			return 0, err
		}
		have[ck{c, id, sk}] = fp
	}
	check.Close()
	if err := check.Err(); err != nil {
		return 0, st.wrap("check the copied rows", err)
	}
	for i, r := range rows {
		fp, ok := have[ck{r.Consumer, r.MessageID, checkKeys[i]}]
		switch {
		case !ok:
			return 0, fmt.Errorf("the row of consumer %q, message id %q is not there after the copy", r.Consumer, r.MessageID)
		case !bytes.Equal(fp, r.Fingerprint):
			return 0, fmt.Errorf("consumer %q, message id %q is there with another fingerprint: the same id applied with two bodies, on two shards", r.Consumer, r.MessageID)
		}
	}
	return int64(len(rows)) - tag.RowsAffected(), nil
}

// deleteRows deletes rows, each of its id and shard key, from every table
// of st's layout, in one transaction.
func deleteRows(ctx context.Context, st *Store, stm *statements, rows []movedRow) error {
	cons := make([]string, len(rows))
	ids := make([]string, len(rows))
	keys := make([]*string, len(rows))
	for i, r := range rows {
		cons[i], ids[i], keys[i] = r.Consumer, r.MessageID, r.key
	}
	return pgx.BeginFunc(ctx, st.db, func(tx pgx.Tx) error {
		for _, t := range stm.layout.allTables() {
			if _, err := tx.Exec(ctx, `DELETE FROM `+t+` t USING unnest($1::text[], $2::text[], $3::text[]) AS u(c, id, sk)
WHERE t.consumer = u.c AND t.message_id = u.id AND t.shard_key IS NOT DISTINCT FROM u.sk`, cons, ids, keys); err != nil {
				return st.wrap("delete the moved rows", err)
			}
		}
		return nil
	})
}
