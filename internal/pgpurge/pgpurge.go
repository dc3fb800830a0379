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

// Pace spaces the batches of Run.
type Pace struct {
	// Pause is the least wait between two batches; 0 for none.
	Pause time.Duration
	// Duty, in (0, 1), also makes the wait after a batch that took d at
	// least d*(1-Duty)/Duty, so that the purge deletes during at most
	// that fraction of its time, and backs off as the database slows
	// down under other load. 0 or 1 turns this off.
	Duty float64
}

// wait is the pause after a batch that took took.
func (p Pace) wait(took time.Duration) time.Duration {
	w := p.Pause
	if p.Duty > 0 && p.Duty < 1 {
		w = max(w, time.Duration(float64(took)*(1-p.Duty)/p.Duty))
	}
	return w
}

// Run computes the cutoff now() - olderThan on the database's clock, then
// deletes by it as Batches does. It returns the rows deleted, and on
// failure the step that failed.
func Run(ctx context.Context, db DB, del string, olderThan time.Duration, batch int, pace Pace) (int64, Step, error) {
	if olderThan <= 0 {
		return 0, StepDelete, fmt.Errorf("olderThan is %s, must be positive", olderThan)
	}
	var cutoff time.Time
	if err := db.QueryRow(ctx, `SELECT now() - $1::bigint * interval '1 microsecond'`, olderThan.Microseconds()).Scan(&cutoff); err != nil {
		return 0, StepCutoff, err
	}
	n, err := Batches(ctx, db, del, cutoff, batch, pace)
	if err != nil {
		return n, StepDelete, err
	}
	return n, "", nil
}

// Batches runs del with $1 = cutoff, $2 = batch and args from $3 on, each
// execution its own short statement, until one deletes fewer than batch
// rows or ctx is done. It waits between two batches as pace says, so that
// deleting a large backlog leaves the database to the work it runs beside.
// It returns the rows deleted.
func Batches(ctx context.Context, db DB, del string, cutoff time.Time, batch int, pace Pace, args ...any) (int64, error) {
	args = append([]any{cutoff, batch}, args...)
	var total int64
	for {
		start := time.Now()
		tag, err := db.Exec(ctx, del, args...)
		if err != nil {
			return total, err
		}
		took := time.Since(start)
		total += tag.RowsAffected()
		if tag.RowsAffected() < int64(batch) {
			return total, nil
		}
		if err := ctx.Err(); err != nil {
			return total, err
		}
		if pause := pace.wait(took); pause > 0 {
			t := time.NewTimer(pause)
			select {
			case <-t.C:
			case <-ctx.Done():
				t.Stop()
				return total, ctx.Err()
			}
		}
	}
}
