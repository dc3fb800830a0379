package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/idemq/idemq/internal/redact"
)

// statusSharded is status over the shards of a sharded dedup store: each
// shard's report, and the totals. It is also the --json form.
type statusSharded struct {
	Consumer  string        `json:"consumer"`
	CheckedAt time.Time     `json:"checked_at"`
	Shards    []statusShard `json:"shards"`
	Total     statusTotal   `json:"total"`
	DLQ       []statusDLQ   `json:"dlq"`
}

// statusShard is one shard's report, with what the shard records of the
// map.
type statusShard struct {
	Shard    int    `json:"shard"`
	Database string `json:"database"` // the URL, without its password
	// Records is what the shard records of the map: "shard 1 of key/3",
	// "shard 2 of a reshard from key/2 to key/3", or "no map".
	Records string        `json:"records"`
	Report  *statusReport `json:"report"`
}

// statusTotal sums the shards.
type statusTotal struct {
	Rows              int64       `json:"rows"`
	TableRows         int64       `json:"table_rows"`
	OldestProcessedAt *time.Time  `json:"oldest_processed_at"`
	PurgeEligible     *int64      `json:"purge_eligible"`
	LastApplied       *statusLast `json:"last_applied"`
}

// statusShards reads every shard's report, in order.
func statusShards(ctx context.Context, e *env, db dbFlags, urls []string, name string, retention durationFlag) (*statusSharded, error) {
	out := &statusSharded{Consumer: name, Shards: []statusShard{}, DLQ: []statusDLQ{}}
	for i, u := range urls {
		sd := db
		sd.url = u
		store, conn, err := sd.openStore(ctx, e, 0, 0, 0)
		if err != nil {
			return nil, fmt.Errorf("shard %d: %w", i, err)
		}
		rep, err := statusFromDB(ctx, conn, store, name, retention)
		if err != nil {
			closeConn(conn)
			return nil, fmt.Errorf("shard %d: %w", i, hint(err, store))
		}
		records, err := shardRecord(ctx, conn, pgx.Identifier{store.Schema(), store.Table() + "_shard_map"}.Sanitize())
		closeConn(conn)
		if err != nil {
			return nil, redact.Error(fmt.Errorf("shard %d: %w", i, err), u)
		}
		if strings.HasPrefix(records, "shard ") && !strings.HasPrefix(records, fmt.Sprintf("shard %d ", i)) {
			records += fmt.Sprintf(" (given as shard %d: the URLs are in another order than the map's)", i)
		}
		out.Shards = append(out.Shards, statusShard{Shard: i, Database: redact.DSN(u), Records: records, Report: rep})
		t := &out.Total
		t.Rows += rep.Rows
		t.TableRows += rep.TableRows
		if rep.CheckedAt.After(out.CheckedAt) {
			out.CheckedAt = rep.CheckedAt
		}
		if o := rep.OldestProcessedAt; o != nil && (t.OldestProcessedAt == nil || o.Before(*t.OldestProcessedAt)) {
			t.OldestProcessedAt = o
		}
		if p := rep.PurgeEligible; p != nil {
			sum := *p
			if t.PurgeEligible != nil {
				sum += *t.PurgeEligible
			}
			t.PurgeEligible = &sum
		}
		if l := rep.LastApplied; l != nil && (t.LastApplied == nil || l.ProcessedAt.After(t.LastApplied.ProcessedAt)) {
			t.LastApplied = l
		}
	}
	return out, nil
}

// shardRecord describes what the table of a shard's map holds.
func shardRecord(ctx context.Context, conn *pgx.Conn, table string) (string, error) {
	var (
		shard    int
		m        string
		previous *string
		since    *time.Time
		complete *bool
	)
	// complete through to_jsonb: a table before migration 0008 has no
	// such column, and its records were complete.
	err := conn.QueryRow(ctx, "SELECT shard, map, previous, moving_since, (to_jsonb(m)->>'complete')::boolean FROM "+table+" m").Scan(&shard, &m, &previous, &since, &complete)
	var pgErr *pgconn.PgError
	switch {
	case errors.Is(err, pgx.ErrNoRows):
		return "no map", nil
	case errors.As(err, &pgErr) && pgErr.Code == "42P01":
		return "no map (the table predates sharding: run idemq migrate)", nil
	case err != nil:
		return "", fmt.Errorf("read the shard map: %w", err)
	case previous != nil:
		return fmt.Sprintf("shard %d of a reshard from %s to %s, since %s", shard, *previous, m, since.UTC().Format(time.RFC3339)), nil
	case complete != nil && !*complete:
		return fmt.Sprintf("shard %d of %s, its first use not yet recorded on every shard (the next consumer to start finishes it)", shard, m), nil
	}
	return fmt.Sprintf("shard %d of %s", shard, m), nil
}

// print writes each shard's report, indented under its heading, the totals
// and the DLQs.
func (s *statusSharded) print(w io.Writer) error {
	for _, sh := range s.Shards {
		fmt.Fprintf(w, "shard %d: %s (records %s)\n", sh.Shard, sh.Database, sh.Records)
		var b strings.Builder
		if err := sh.Report.print(&b); err != nil {
			return err
		}
		for _, line := range strings.SplitAfter(strings.TrimRight(b.String(), "\n"), "\n") {
			fmt.Fprintf(w, "  %s", line)
		}
		fmt.Fprintln(w)
	}
	t := s.Total
	total := &statusReport{Consumer: s.Consumer, CheckedAt: s.CheckedAt, DLQ: s.DLQ}
	fmt.Fprintf(w, "total over %d shards:\n", len(s.Shards))
	fmt.Fprintf(w, "  dedup rows: %d (%d in the tables, all consumers)\n", t.Rows, t.TableRows)
	if t.OldestProcessedAt != nil {
		fmt.Fprintf(w, "  oldest row: %s (%s ago)\n", t.OldestProcessedAt.Format(time.RFC3339), statusAge(s.CheckedAt.Sub(*t.OldestProcessedAt)))
	}
	if t.PurgeEligible != nil {
		fmt.Fprintf(w, "  purge eligible: %d rows\n", *t.PurgeEligible)
	}
	if l := t.LastApplied; l != nil {
		fmt.Fprintf(w, "  last applied: %s at %s (%s ago)\n", l.MessageID, l.ProcessedAt.Format(time.RFC3339), statusAge(s.CheckedAt.Sub(l.ProcessedAt)))
	}
	for _, sh := range s.Shards {
		if strings.Contains(sh.Records, "a reshard from") {
			fmt.Fprintf(w, "  (a reshard is under way: a duplicate's claim on its new shard copies its row there, so some are counted twice)\n")
			break
		}
	}
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	total.dlqLines(tw)
	return tw.Flush()
}
