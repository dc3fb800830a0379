package processed

import (
	"context"
	"strconv"
	"time"

	"github.com/idemq/idemq/internal/pgpurge"
)

// layout is what the two layouts of the dedup table do each their own way;
// Store keeps what they share (the pipelined BEGIN, the claim and its
// retries, the commit's token, wrapping errors). A *plain is the plain
// table, a *generations the partitioned layout (generations.go).
type layout interface {
	// claimTables returns the quoted table a claim inserts into, and
	// those it must find the id in none of first.
	claimTables() (into string, others []string)
	// readFrom is the relation, named t, the store reads rows from.
	readFrom() string
	// purge purges consumerName's rows older than cutoff, the horizon
	// Store.Purge just recorded, and returns how many went.
	purge(ctx context.Context, s *Store, st *statements, consumerName string, cutoff time.Time) (int64, error)
	// maintain is the upkeep (Store.Maintain); it returns the rows it
	// retired.
	maintain(ctx context.Context, s *Store, st *statements) (int64, error)
	// allTables returns every quoted table that holds rows.
	allTables() []string
}

// plain is the plain table: one table with a primary key, whose purge
// deletes rows in batches.
type plain struct {
	// table is quoted and qualified; del is the purge's DELETE.
	table, del string
}

func newPlain(table string) *plain {
	return &plain{table: table,
		// The index on (consumer COLLATE "C", processed_at) of migration
		// 0005, which only this statement asks for.
		del: `DELETE FROM ` + table + ` WHERE ctid = ANY(ARRAY(
	SELECT ctid FROM ` + table + `
	WHERE consumer COLLATE "C" = $3 AND processed_at < $1
	LIMIT $2))`}
}

func (p *plain) claimTables() (string, []string) { return p.table, nil }

func (p *plain) readFrom() string { return p.table + " AS t" }

func (p *plain) allTables() []string { return []string{p.table} }

// purge deletes the consumer's rows older than cutoff in batches of
// Config.PurgeBatchSize, each its own short statement, paced by PurgePause
// and PurgeDutyCycle.
func (p *plain) purge(ctx context.Context, s *Store, _ *statements, consumerName string, cutoff time.Time) (int64, error) {
	n, err := pgpurge.Batches(ctx, s.db, p.del, cutoff, s.cfg.PurgeBatchSize, s.cfg.pace(), consumerName)
	if err != nil {
		return n, s.wrap("purge "+strconv.Quote(consumerName), err)
	}
	return n, nil
}

// maintain does nothing: a plain table needs no upkeep.
func (p *plain) maintain(context.Context, *Store, *statements) (int64, error) { return 0, nil }
