// Package pgpurge deletes old rows in bounded batches, for the retention of
// idemq's Postgres tables (processed, outbox, httpidem).
package pgpurge

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// DB is what Run needs from a database handle.
type DB interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// Step names the part of Run that failed, for the caller's error message.
type Step string

// Steps of Run.
const (
	StepCutoff Step = "purge: cutoff"
	StepDelete Step = "purge"
)

// Run computes the cutoff now() - olderThan on the database's clock, then
// runs del with $1 = cutoff and $2 = batch, each execution its own short
// statement, until one deletes fewer than batch rows or ctx is done. It
// waits pause between two batches (none if pause is 0), so that deleting a
// large backlog leaves the database to the work it runs beside. It returns
// the rows deleted, and on failure the step that failed.
func Run(ctx context.Context, db DB, del string, olderThan time.Duration, batch int, pause time.Duration) (int64, Step, error) {
	if olderThan <= 0 {
		return 0, StepDelete, fmt.Errorf("olderThan is %s, must be positive", olderThan)
	}
	var cutoff time.Time
	if err := db.QueryRow(ctx, `SELECT now() - $1::bigint * interval '1 microsecond'`, olderThan.Microseconds()).Scan(&cutoff); err != nil {
		return 0, StepCutoff, err
	}
	var total int64
	for {
		tag, err := db.Exec(ctx, del, cutoff, batch)
		if err != nil {
			return total, StepDelete, err
		}
		total += tag.RowsAffected()
		if tag.RowsAffected() < int64(batch) {
			return total, "", nil
		}
		if err := ctx.Err(); err != nil {
			return total, StepDelete, err
		}
		if pause > 0 {
			t := time.NewTimer(pause)
			select {
			case <-t.C:
			case <-ctx.Done():
				t.Stop()
				return total, StepDelete, ctx.Err()
			}
		}
	}
}
