package pgpurge

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

func TestPaceWait(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		pace Pace
		took time.Duration
		want time.Duration
	}{
		{Pace{}, time.Second, 0},
		{Pace{Pause: 10 * time.Millisecond}, time.Second, 10 * time.Millisecond},
		{Pace{Pause: 10 * time.Millisecond, Duty: 0.5}, 4 * time.Millisecond, 10 * time.Millisecond},
		{Pace{Pause: 10 * time.Millisecond, Duty: 0.5}, 40 * time.Millisecond, 40 * time.Millisecond},
		{Pace{Duty: 0.25}, 40 * time.Millisecond, 120 * time.Millisecond},
		{Pace{Pause: 10 * time.Millisecond, Duty: 1}, time.Second, 10 * time.Millisecond},
	} {
		if got := tc.pace.wait(tc.took); got != tc.want {
			t.Errorf("%+v after %s: wait %s, want %s", tc.pace, tc.took, got, tc.want)
		}
	}
}

// slowDB deletes full batches that each take took, until rows run out.
type slowDB struct {
	took  time.Duration
	rows  int
	calls []time.Time
}

type cutoffRow struct{}

func (cutoffRow) Scan(dest ...any) error {
	*dest[0].(*time.Time) = time.Now().Add(-time.Hour)
	return nil
}

func (d *slowDB) QueryRow(context.Context, string, ...any) pgx.Row { return cutoffRow{} }

func (d *slowDB) Exec(_ context.Context, _ string, args ...any) (pgconn.CommandTag, error) {
	d.calls = append(d.calls, time.Now())
	time.Sleep(d.took)
	n := min(d.rows, args[1].(int))
	d.rows -= n
	return pgconn.NewCommandTag(fmt.Sprintf("DELETE %d", n)), nil
}

// TestRunBacksOffWithSlowBatches: with a duty cycle, the pause after a slow
// batch grows with it, so a purge of a slowed-down database yields more.
func TestRunBacksOffWithSlowBatches(t *testing.T) {
	t.Parallel()
	db := &slowDB{took: 40 * time.Millisecond, rows: 30}
	n, _, err := Run(context.Background(), db, "DELETE", time.Minute, 10, Pace{Pause: time.Millisecond, Duty: 0.25})
	if err != nil || n != 30 {
		t.Fatalf("Run: %d, %v", n, err)
	}
	if len(db.calls) != 4 {
		t.Fatalf("%d batches, want 4 (three full, one empty)", len(db.calls))
	}
	for i := 1; i < len(db.calls); i++ {
		// 40ms deleting, then at least 40*(0.75/0.25) = 120ms waiting.
		if gap := db.calls[i].Sub(db.calls[i-1]); gap < 160*time.Millisecond {
			t.Fatalf("batch %d started %s after the one before, want at least 160ms", i, gap)
		}
	}
	cctx, cancel := context.WithTimeout(context.Background(), 60*time.Millisecond)
	defer cancel()
	db = &slowDB{took: 40 * time.Millisecond, rows: 30}
	if _, _, err := Run(cctx, db, "DELETE", time.Minute, 10, Pace{Duty: 0.25}); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("cancelled during a back-off: %v", err)
	}
}
