package dlq

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/processed"
)

// horizon is the replay-horizon guard of Replay, Requeue and Classify: it
// finds the dead letters whose dedup row may have been purged, so that
// replaying them could apply their id a second time.
//
// A dead letter is dated by the earliest time it knows of: its first
// failure (history included), the message's timestamp, and, for a
// fingerprint mismatch, when the original with the same id was applied
// (x-idemq-original-processed-at, or the dedup row itself). The mismatch's own
// failure is recent, but the row a replay depends on is the original's,
// which the janitor purges by the original's age.
//
// A fingerprint mismatch (in the latest failure or the history) is
// checked more closely, because replaying one whose original row is gone
// applies a second, different effect under the id:
//   - with a dedup store to look in (lookup), the row must still exist
//     and is dated by its processed_at; a missing row is beyond the
//     horizon whatever the envelope says;
//   - without one, the envelope must say when the original was applied; a
//     mismatch envelope without x-idemq-original-processed-at (written before
//     it existed) cannot be dated and is beyond the horizon.
type horizon struct {
	// retention is the dedup retention; 0 turns the guard off.
	retention time.Duration
	// lookup, if set, finds the original's dedup row of a mismatch.
	lookup lookuper
	// scope is the dedup scope to look a record's id up in.
	scope func(Record) string
}

// check reports why r, read from msg, is beyond the horizon at now, or ""
// if it is not (or the guard is off). Its error is a failed lookup.
func (h horizon) check(ctx context.Context, r Record, msg *consumer.Message, now time.Time) (string, error) {
	if h.retention <= 0 {
		return "", nil
	}
	first, what := r.FirstSeen(), "first failed"
	if !msg.Timestamp.IsZero() && (first.IsZero() || msg.Timestamp.Before(first)) {
		first, what = msg.Timestamp, "first published"
	}
	if first.IsZero() {
		return "no failure time or timestamp to date it by", nil
	}
	if p := r.originalProcessedAt(); !p.IsZero() && p.Before(first) {
		first, what = p, "original applied"
	}
	if r.mismatch() {
		switch {
		case h.lookup != nil && r.MessageID != "":
			row, err := lookupRow(ctx, h.lookup, h.scope(r), r, msg)
			if errors.Is(err, processed.ErrNotFound) {
				return "fingerprint mismatch whose original's dedup row is gone: replaying it would apply the id a second time", nil
			}
			if err != nil {
				return "", fmt.Errorf("dlq: replay-horizon guard: look up %q: %w", r.MessageID, err)
			}
			if !row.ProcessedAt.IsZero() && row.ProcessedAt.Before(first) {
				first, what = row.ProcessedAt, "original applied"
			}
		case r.originalProcessedAt().IsZero():
			return "fingerprint mismatch without " + headerOriginalProcessedAt +
				" (an envelope from before it existed) and no dedup store to find the original's row in", nil
		}
	}
	if age := now.Sub(first); age > h.retention {
		return fmt.Sprintf("%s %s ago, longer ago than the retention of %s", what, age.Round(time.Second), h.retention), nil
	}
	return "", nil
}

// mismatch reports whether the latest failure or an earlier one was a
// fingerprint mismatch: the id was applied before, with another payload.
func (r Record) mismatch() bool {
	if r.Class == consumer.ClassFingerprintMismatch {
		return true
	}
	for _, e := range r.History {
		if e.Class == consumer.ClassFingerprintMismatch {
			return true
		}
	}
	return false
}

// originalProcessedAt is the earliest time the record says the original of
// a mismatch was applied, history included; zero if it says none.
func (r Record) originalProcessedAt() time.Time {
	t := r.ProcessedAt
	for _, e := range r.History {
		if !e.ProcessedAt.IsZero() && (t.IsZero() || e.ProcessedAt.Before(t)) {
			t = e.ProcessedAt
		}
	}
	return t
}
