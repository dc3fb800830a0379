package console

import (
	"context"
	"encoding/json"
	"fmt"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemq/idemq/processed"
)

// AuditTable is the audit table's name, in the dedup table's schema.
const AuditTable = "idemq_console_audit"

// auditDDL creates the audit table on first use.
const auditDDL = `CREATE TABLE IF NOT EXISTS %s (
    id          bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    started_at  timestamptz NOT NULL DEFAULT now(),
    finished_at timestamptz,
    who         text        NOT NULL,
    action      text        NOT NULL CHECK (action IN ('replay', 'requeue')),
    dlq         text        NOT NULL,
    filter      jsonb       NOT NULL,
    dry_run     jsonb       NOT NULL,
    result      jsonb,
    outcome     text        NOT NULL DEFAULT 'running',
    error       text
)`

// AuditRow is one recorded replay or requeue.
type AuditRow struct {
	ID         int64
	StartedAt  time.Time
	FinishedAt *time.Time
	Who        string
	Action     string
	DLQ        string
	// Filter, DryRun and Result are the JSON as stored, whatever its
	// shape: a row another version wrote is shown, not dropped. Result is
	// null until the action finishes.
	Filter  json.RawMessage
	DryRun  json.RawMessage
	Result  json.RawMessage
	Outcome string
	Error   string
}

type audit struct {
	db     processed.DB
	schema string
	once   sync.Mutex
	ready  bool
}

func (a *audit) table() string { return pgx.Identifier{a.schema, AuditTable}.Sanitize() }

// ensure creates the table the first time it is needed.
func (a *audit) ensure(ctx context.Context) error {
	a.once.Lock()
	defer a.once.Unlock()
	if a.ready {
		return nil
	}
	if _, err := a.db.Exec(ctx, fmt.Sprintf(auditDDL, a.table())); err != nil {
		return fmt.Errorf("console: create the audit table %s: %w", a.table(), err)
	}
	a.ready = true
	return nil
}

// start records an action before it runs, so that even a crash leaves a
// row saying it started.
func (a *audit) start(ctx context.Context, who, action, dlqID string, filter, dry any) (int64, error) {
	if err := a.ensure(ctx); err != nil {
		return 0, err
	}
	fj, _ := json.Marshal(filter)
	dj, _ := json.Marshal(dry)
	var id int64
	err := a.db.QueryRow(ctx, `INSERT INTO `+a.table()+` (who, action, dlq, filter, dry_run) VALUES ($1, $2, $3, $4, $5) RETURNING id`,
		who, action, dlqID, fj, dj).Scan(&id)
	if err != nil {
		return 0, fmt.Errorf("console: record the %s in %s: %w", action, a.table(), err)
	}
	return id, nil
}

func (a *audit) finish(ctx context.Context, id int64, result any, outcome string, runErr error) error {
	rj, _ := json.Marshal(result)
	var msg *string
	if runErr != nil {
		m := runErr.Error()
		msg = &m
	}
	_, err := a.db.Exec(ctx, `UPDATE `+a.table()+` SET finished_at = now(), result = $2, outcome = $3, error = $4 WHERE id = $1`, id, rj, outcome, msg)
	return err
}

// list returns the newest rows first; no table yet means no rows.
func (a *audit) list(ctx context.Context, limit int) ([]AuditRow, error) {
	var exists bool
	if err := a.db.QueryRow(ctx, `SELECT to_regclass($1) IS NOT NULL`, a.table()).Scan(&exists); err != nil {
		return nil, fmt.Errorf("console: look for %s: %w", a.table(), err)
	}
	if !exists {
		return nil, nil
	}
	rows, err := a.db.Query(ctx, `SELECT id, started_at, finished_at, who, action, dlq, filter, dry_run, coalesce(result, 'null'), outcome, coalesce(error, '')
FROM `+a.table()+` ORDER BY id DESC LIMIT $1`, limit)
	if err != nil {
		return nil, fmt.Errorf("console: read %s: %w", a.table(), err)
	}
	defer rows.Close()
	var out []AuditRow
	for rows.Next() {
		var r AuditRow
		var fj, dj, rj []byte
		if err := rows.Scan(&r.ID, &r.StartedAt, &r.FinishedAt, &r.Who, &r.Action, &r.DLQ, &fj, &dj, &rj, &r.Outcome, &r.Error); err != nil {
			return nil, fmt.Errorf("console: read %s: %w", a.table(), err)
		}
		r.Filter, r.DryRun, r.Result = fj, dj, rj
		out = append(out, r)
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("console: read %s: %w", a.table(), err)
	}
	return out, nil
}
