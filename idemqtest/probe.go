package idemqtest

import (
	"context"
	"fmt"
	"runtime/debug"
	"sort"
	"strings"

	"github.com/jackc/pgx/v5"

	"github.com/idemq/idemq/consumer"
)

// The rolled-back case: each sample's handler runs in a transaction the kit
// then rolls back. Whatever changed meanwhile changed outside that
// transaction: a write through the pool or another connection, a call to
// another service. The end-state cases can miss such a write, when a retry
// cannot double it (ON CONFLICT DO NOTHING, a value set rather than added
// to); this one cannot.

// snapshot is what the probe compares: a digest of every table of the run's
// schema but the dedup store's, and the Recorder's calls.
type snapshot struct {
	tables map[string]string
	calls  int
}

// takeSnapshot reads the run's tables, each as one digest of its rows.
func takeSnapshot(ctx context.Context, env *Env) (snapshot, error) {
	rows, err := env.Pool.Query(ctx, `SELECT c.relname::text FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
WHERE n.nspname = $1 AND c.relkind IN ('r', 'p') AND c.relname::text NOT LIKE 'processed\_messages%'
ORDER BY 1`, env.Schema)
	if err != nil {
		return snapshot{}, err
	}
	names, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return snapshot{}, err
	}
	s := snapshot{tables: map[string]string{}, calls: len(env.Recorder.Calls())}
	for _, name := range names {
		var digest *string
		q := `SELECT md5(string_agg(t::text, E'\n' ORDER BY t::text)) FROM ` + pgx.Identifier{env.Schema, name}.Sanitize() + ` t`
		if err := env.Pool.QueryRow(ctx, q).Scan(&digest); err != nil {
			return snapshot{}, fmt.Errorf("read table %s: %w", name, err)
		}
		s.tables[name] = ""
		if digest != nil {
			s.tables[name] = *digest
		}
	}
	return s, nil
}

// changed names what differs from before to after.
func changed(before, after snapshot) []string {
	var out []string
	for name, d := range after.tables {
		if b, ok := before.tables[name]; !ok || b != d {
			out = append(out, "table "+name)
		}
	}
	sort.Strings(out)
	if n := after.calls - before.calls; n > 0 {
		out = append(out, fmt.Sprintf("%d call(s) to the Recorder", n))
	}
	return out
}

// rolledBack runs the probe.
func (k *kit) rolledBack(t tb) {
	const name = "rolled-back"
	err := k.with(func(ctx context.Context, r *consumerRun) error {
		for _, m := range k.samples() {
			before, err := takeSnapshot(ctx, r.env)
			if err != nil {
				return err
			}
			m.Attempt = 1
			if err := probeHandler(ctx, r, m); err != nil {
				return fmt.Errorf("message %q: %w", r.id(m), err)
			}
			after, err := takeSnapshot(ctx, r.env)
			if err != nil {
				return err
			}
			if diff := changed(before, after); len(diff) > 0 {
				t.Errorf("%s: each sample's handler ran in a transaction that was then rolled back; for message %q, %s changed all the same. "+
					"The handler wrote outside its transaction (through the pool or another connection), or called another service: "+
					"that change stays when the runtime rolls back, and happens again at each retry. Make every change through the tx it is given.",
					name, r.id(m), strings.Join(diff, " and "))
			}
		}
		return nil
	})
	if err != nil {
		t.Fatalf("%s: %v", name, err)
	}
}

// probeHandler runs the run's handler on m in a transaction of the pool
// and rolls it back, whatever the handler returned; a panic is an error.
func probeHandler(ctx context.Context, r *consumerRun, m *consumer.Message) (err error) {
	tx, err := r.env.Pool.Begin(ctx)
	if err != nil {
		return err
	}
	defer func() { _ = tx.Rollback(context.WithoutCancel(ctx)) }()
	defer func() {
		if v := recover(); v != nil {
			err = fmt.Errorf("the handler panicked: %v\n%s", v, debug.Stack())
		}
	}()
	_ = r.h(ctx, tx, m) // its error does not matter: the transaction rolls back
	return nil
}
