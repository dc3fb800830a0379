package processed

import (
	"context"
	"errors"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/consumer/dedup"
)

func (s *Store) retentionTable(st *statements) string {
	return pgx.Identifier{st.schema, s.cfg.Table + retentionSuffix}.Sanitize()
}

// RecordRetention is the optional Store method of that name (see
// dedup.Store): it writes the
// janitor's report as a row of Table+"_retention" (migration 0002), and
// deletes the consumer's reports older than 35 days. The runtime's role
// needs INSERT and DELETE on that table.
func (s *Store) RecordRetention(ctx context.Context, r dedup.RetentionReport) error {
	st, err := s.statements(ctx)
	if err != nil {
		return err
	}
	ageBounds := dedup.AgeBounds()
	bounds := make([]int64, len(ageBounds))
	for i, b := range ageBounds {
		bounds[i] = b.Milliseconds()
	}
	ms := func(d time.Duration) *int64 {
		if d <= 0 {
			return nil
		}
		v := d.Milliseconds()
		return &v
	}
	q := func(p float64) *int64 { return ms(r.Quantile(p)) }
	var horizon *time.Time
	if !r.Horizon.IsZero() {
		horizon = &r.Horizon
	}
	_, err = s.db.Exec(ctx, `INSERT INTO `+s.retentionTable(st)+` (consumer, window_start, window_end, duplicates,
	p50_ms, p99_ms, p999_ms, max_ms, buckets, bucket_bounds_ms, retention_ms, horizon, horizon_state, purged_older_than_ms, purged)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15)
ON CONFLICT (consumer, window_end) DO NOTHING`,
		r.Consumer, r.WindowStart, r.WindowEnd, r.Duplicates,
		q(0.5), q(0.99), q(0.999), ms(r.MaxAge), r.Buckets, bounds, r.Retention.Milliseconds(),
		horizon, r.HorizonState, ms(r.PurgedOlderThan), r.Purged)
	if err != nil {
		return s.wrap("record the janitor's report", err)
	}
	// The reports keep themselves: status reads a week of them.
	if _, err := s.db.Exec(ctx, `DELETE FROM `+s.retentionTable(st)+` WHERE consumer = $1 AND window_end < now() - interval '35 days'`, r.Consumer); err != nil {
		return s.wrap("delete the janitor's old reports", err)
	}
	return nil
}

// RetentionSummary sums the janitor's reports of one consumer over a
// period: the evidence that the retention covers the duplicates.
type RetentionSummary struct {
	// Reports is the number of janitor reports in the period; From is the
	// start of the oldest.
	Reports int
	From    time.Time
	// Duplicates counts the duplicates; P50, P99, P999 and Max are their
	// ages (quantiles rounded up to a bucket bound, see
	// dedup.AgeBounds).
	Duplicates          int64
	P50, P99, P999, Max time.Duration
	// Retention is the latest report's retention.
	Retention time.Duration
	// The latest report's horizon, its state, and the age it purged by
	// (0 if it did not purge).
	Horizon         time.Time
	HorizonState    string
	PurgedOlderThan time.Duration
	LastReport      time.Time
}

// Retention sums the janitor's reports of consumerName since since. It
// returns a zero summary if there are none, or if the table does not exist
// (a store migrated before version 2).
func (s *Store) Retention(ctx context.Context, consumerName string, since time.Time) (RetentionSummary, error) {
	st, err := s.statements(ctx)
	if err != nil {
		return RetentionSummary{}, err
	}
	rows, err := s.db.Query(ctx, `SELECT window_start, window_end, duplicates, buckets, coalesce(max_ms, 0), retention_ms,
	horizon, horizon_state, coalesce(purged_older_than_ms, 0)
FROM `+s.retentionTable(st)+` WHERE consumer = $1 AND window_end >= $2 ORDER BY window_end`, consumerName, since)
	if err != nil {
		if errors.Is(s.wrap("", err), consumer.ErrNotMigrated) {
			return RetentionSummary{}, nil
		}
		return RetentionSummary{}, s.wrap("read the janitor's reports", err)
	}
	var (
		sum     RetentionSummary
		buckets []int64
	)
	var (
		ws, we          time.Time
		n, maxMS, retMS int64
		b               []int64
		h               *time.Time
		state           string
		purgedMS        int64
	)
	_, err = pgx.ForEachRow(rows, []any{&ws, &we, &n, &b, &maxMS, &retMS, &h, &state, &purgedMS}, func() error {
		if sum.Reports == 0 {
			sum.From = ws
		}
		sum.Reports++
		sum.Duplicates += n
		for len(buckets) < len(b) {
			buckets = append(buckets, 0)
		}
		for i, v := range b {
			buckets[i] += v
		}
		sum.Max = max(sum.Max, time.Duration(maxMS)*time.Millisecond)
		sum.Retention = time.Duration(retMS) * time.Millisecond
		sum.Horizon = time.Time{}
		if h != nil {
			sum.Horizon = *h
		}
		sum.HorizonState, sum.PurgedOlderThan, sum.LastReport = state, time.Duration(purgedMS)*time.Millisecond, we
		return nil
	})
	if err != nil {
		return RetentionSummary{}, s.wrap("read the janitor's reports", err)
	}
	all := dedup.RetentionReport{Buckets: buckets, MaxAge: sum.Max}
	sum.P50, sum.P99, sum.P999 = all.Quantile(0.5), all.Quantile(0.99), all.Quantile(0.999)
	return sum, nil
}
