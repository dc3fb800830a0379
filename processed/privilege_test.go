package processed_test

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemq/idemq/brokers/memory"
	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/consumer/dedup"
	"github.com/idemq/idemq/internal/testdb"
	"github.com/idemq/idemq/processed"
)

// leastPrivilegeGrants are the statements the README gives for the runtime's
// role: USAGE on the schema, SELECT, INSERT, DELETE on the dedup table and
// on the business tables, and SELECT, INSERT, UPDATE on the table of purge
// horizons. No CREATE, no UPDATE of claims, no TRUNCATE, no ownership.
// %[1]s is the schema, %[2]s the dedup table, %[3]s a business table, %[4]s
// the role and %[5]s the horizons table, all quoted.
var leastPrivilegeGrants = []string{
	`CREATE ROLE %[4]s LOGIN`,
	`GRANT USAGE ON SCHEMA %[1]s TO %[4]s`,
	`GRANT SELECT, INSERT, DELETE ON %[2]s TO %[4]s`,
	`GRANT SELECT, INSERT, DELETE ON %[3]s TO %[4]s`,
	`GRANT SELECT, INSERT, UPDATE ON %[5]s TO %[4]s`,
}

// limitedRole creates a uniquely named role with the least-privilege grants
// on store's table and the business table, and returns a pool connected as
// that role. The role is dropped at cleanup.
func limitedRole(t *testing.T, admin *pgxpool.Pool, store *processed.Store, business string) (string, *pgxpool.Pool) {
	t.Helper()
	ctx := context.Background()
	var b [6]byte
	_, _ = rand.Read(b[:])
	role := "idemq_app_" + hex.EncodeToString(b[:])
	q := func(parts ...string) string { return pgx.Identifier(parts).Sanitize() }
	for _, stmt := range leastPrivilegeGrants {
		sql := fmt.Sprintf(stmt, q(store.Schema()), q(store.Schema(), store.Table()), q(store.Schema(), business), q(role), q(store.Schema(), store.Table()+"_horizons"))
		if _, err := admin.Exec(ctx, sql); err != nil {
			t.Fatalf("%s: %v", sql, err)
		}
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		// DROP OWNED revokes the role's grants; it owns nothing.
		if _, err := admin.Exec(ctx, "DROP OWNED BY "+q(role)); err != nil {
			t.Errorf("drop owned by %s: %v", role, err)
		}
		if _, err := admin.Exec(ctx, "DROP ROLE "+q(role)); err != nil {
			t.Errorf("drop role %s: %v", role, err)
		}
	})

	cfg, err := pgxpool.ParseConfig(testdb.URL())
	if err != nil {
		t.Fatal(err)
	}
	cfg.ConnConfig.User = role // trust auth on 127.0.0.1
	cfg.MaxConns = 8
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close) // runs before the role is dropped
	var who string
	if err := pool.QueryRow(ctx, "SELECT current_user").Scan(&who); err != nil || who != role {
		t.Fatalf("connected as %q (%v), want %q", who, err, role)
	}
	return role, pool
}

// TestLeastPrivilegeRole runs the runtime end to end, in per-message and in
// batch mode, as a role that holds only USAGE on the schema,
// SELECT/INSERT/DELETE on the dedup and business tables and
// SELECT/INSERT/UPDATE on the purge horizons: claims,
// duplicates, a fingerprint mismatch, Lookup, Stats and Purge all work.
// Migrate, which creates tables, fails with a clear permission error.
func TestLeastPrivilegeRole(t *testing.T) {
	ctx := context.Background()
	admin := testdb.Pool(t)
	schema := testdb.Schema(t)
	adminStore, err := processed.New(admin, processed.Config{Schema: schema})
	if err != nil {
		t.Fatal(err)
	}
	if err := adminStore.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	// No serial column: a sequence would need its own USAGE grant.
	ledger := pgx.Identifier{schema, "ledger"}.Sanitize()
	if _, err := admin.Exec(ctx, "CREATE TABLE "+ledger+" (message_id text NOT NULL, body text NOT NULL)"); err != nil {
		t.Fatal(err)
	}
	role, pool := limitedRole(t, admin, adminStore, "ledger")

	// The role really is limited.
	table := schema + "." + adminStore.Table()
	for _, c := range []struct {
		sql  string
		want bool
	}{
		{fmt.Sprintf("SELECT has_schema_privilege('%s', '%s', 'CREATE')", role, schema), false},
		{fmt.Sprintf("SELECT has_table_privilege('%s', '%s', 'TRUNCATE')", role, table), false},
		{fmt.Sprintf("SELECT has_table_privilege('%s', '%s', 'UPDATE')", role, table), false},
		{fmt.Sprintf("SELECT pg_has_role('%s', (SELECT tableowner FROM pg_tables WHERE schemaname = '%s' AND tablename = '%s'), 'MEMBER')", role, schema, adminStore.Table()), false},
		{fmt.Sprintf("SELECT has_table_privilege('%s', '%s', 'INSERT')", role, table), true},
	} {
		var got bool
		if err := admin.QueryRow(ctx, c.sql).Scan(&got); err != nil || got != c.want {
			t.Fatalf("%s = %v (%v), want %v", c.sql, got, err, c.want)
		}
	}

	store, err := processed.New(pool, processed.Config{Schema: schema})
	if err != nil {
		t.Fatal(err)
	}

	for _, mode := range []struct {
		name  string
		batch int
	}{{"per message", 1}, {"batch", 16}} {
		t.Run(mode.name, func(t *testing.T) {
			prefix := strings.ReplaceAll(mode.name, " ", "-")
			broker := memory.NewBroker()
			sub, err := broker.Subscribe("work", memory.SubscribeOptions{})
			if err != nil {
				t.Fatal(err)
			}
			const n = 40
			var published []*consumer.Message
			for i := range n {
				m := &consumer.Message{ID: fmt.Sprintf("%s-%d", prefix, i), Body: fmt.Appendf(nil, "body %d", i)}
				published = append(published, m)
				if i%4 == 0 {
					published = append(published, m.Clone()) // a redelivered duplicate
				}
			}
			// The same id with another payload: a producer bug.
			published = append(published, &consumer.Message{ID: prefix + "-0", Body: []byte("other payload")})
			cfg := consumer.Config{
				Name:   "ledger",
				Source: sub,
				Store:  store,
				Handler: func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
					_, err := tx.Exec(ctx, "INSERT INTO "+ledger+" (message_id, body) VALUES ($1, $2)", m.ID, string(m.Body))
					return err
				},
				Concurrency:     4,
				BatchSize:       mode.batch,
				ShutdownTimeout: 5 * time.Second,
			}
			rt, err := consumer.New(cfg)
			if err != nil {
				t.Fatal(err)
			}
			runCtx, cancel := context.WithCancel(ctx)
			done := make(chan error, 1)
			go func() { done <- rt.Run(runCtx) }()
			// Publish in order after the runtime started: the mismatch
			// comes last, after its id committed.
			for _, m := range published[:len(published)-1] {
				if err := broker.Publish(ctx, "work", m); err != nil {
					t.Fatal(err)
				}
			}
			wctx, wcancel := context.WithTimeout(ctx, 20*time.Second)
			defer wcancel()
			if err := broker.WaitFor(wctx, "work", memory.Drained); err != nil {
				t.Fatalf("queue not drained: %v (stats %+v)", err, rt.Stats())
			}
			if err := broker.Publish(ctx, "work", published[len(published)-1]); err != nil {
				t.Fatal(err)
			}
			if err := broker.WaitFor(wctx, "work", memory.Drained); err != nil {
				t.Fatalf("queue not drained: %v (stats %+v)", err, rt.Stats())
			}
			cancel()
			if err := <-done; err != nil {
				t.Fatalf("Run: %v", err)
			}

			st := rt.Stats()
			if st.Applied != n || st.Duplicates != int64(len(published)-1-n) || st.DeadLettered != 1 {
				t.Fatalf("stats %+v: want %d applied, %d duplicates, 1 dead-lettered", st, n, len(published)-1-n)
			}
			dl := broker.Messages("work.dlq")
			if len(dl) != 1 || dl[0].Headers["x-idemq-error-class"] != string(consumer.ClassFingerprintMismatch) {
				t.Fatalf("dead letters: %+v", dl)
			}
			var rows, distinct int
			if err := admin.QueryRow(ctx, "SELECT count(*), count(DISTINCT message_id) FROM "+ledger+" WHERE message_id LIKE $1", prefix+"-%").
				Scan(&rows, &distinct); err != nil {
				t.Fatal(err)
			}
			if rows != n || distinct != n {
				t.Fatalf("ledger: %d rows, %d distinct, want %d each", rows, distinct, n)
			}
			rec, err := store.Lookup(ctx, "ledger", prefix+"-7")
			if err != nil || rec.MessageID != prefix+"-7" {
				t.Fatalf("Lookup as the limited role: %+v, %v", rec, err)
			}
		})
	}

	st, err := store.Stats(ctx, "ledger")
	if err != nil || st.Rows != 80 {
		t.Fatalf("Stats as the limited role: %+v, %v", st, err)
	}
	// Age half the rows, then purge them as the limited role.
	if _, err := admin.Exec(ctx, "UPDATE "+pgx.Identifier{schema, adminStore.Table()}.Sanitize()+
		" SET processed_at = now() - interval '2 hours' WHERE message_id LIKE 'batch-%'"); err != nil {
		t.Fatal(err)
	}
	purged, err := store.Purge(ctx, "ledger", time.Hour)
	if err != nil || purged != 40 {
		t.Fatalf("Purge as the limited role: %d rows, %v; want 40", purged, err)
	}

	// Migrate needs more than the runtime: it creates tables.
	for _, cfg := range []processed.Config{
		{Schema: schema},                   // already migrated
		{Schema: schema, Table: "another"}, // a new table
	} {
		s, err := processed.New(pool, cfg)
		if err != nil {
			t.Fatal(err)
		}
		err = s.Migrate(ctx)
		var pgErr *pgconn.PgError
		if !errors.As(err, &pgErr) || pgErr.Code != "42501" || !strings.Contains(err.Error(), "processed: migrate "+s.String()) {
			t.Fatalf("Migrate(%+v) as the limited role: %v, want a permission denied (42501) error naming the table", cfg, err)
		}
		t.Logf("Migrate as the limited role: %v", err)
	}
}

// TestHostileIdentifiersRejected: schema and table names that are not plain
// identifiers are rejected by New before any SQL runs; plain names that are
// SQL keywords work, because every name is quoted.
func TestHostileIdentifiersRejected(t *testing.T) {
	pool := testdb.Pool(t)
	for _, name := range []string{
		"t\x00x", "t\nx", "t;x", "t--x", "t/*x*/", `t"x`, "t'x", "t x", "t.x", "t\u00a0x", "tх", // Cyrillic х
	} {
		for _, cfg := range []processed.Config{{Table: name}, {Schema: name}} {
			if _, err := processed.New(pool, cfg); !errors.Is(err, consumer.ErrInvalidConfig) {
				t.Errorf("New(%+v): %v, want ErrInvalidConfig", cfg, err)
			}
		}
	}
	ctx := context.Background()
	schema := testdb.Schema(t)
	s, err := processed.New(pool, processed.Config{Schema: schema, Table: "select"})
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Migrate(ctx); err != nil {
		t.Fatalf("Migrate with table name select: %v", err)
	}
	tx, res, err := s.BeginClaim(ctx, []dedup.Claim{{Consumer: "c", MessageID: "'; DROP TABLE x; --", Partition: -1, Offset: -1}})
	if err != nil || res[0].Outcome != dedup.ClaimNew {
		t.Fatalf("BeginClaim: %+v, %v", res, err)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
}

// TestLeastPrivilegeRolePartitioned: the least-privilege grants, made on a
// plain table, carry over when Migrate converts it: the limited role
// claims on the partitioned layout (new, duplicate, mismatch, in the
// generations the conversion made); its upkeep, which renames tables,
// needs the owner, and says so.
func TestLeastPrivilegeRolePartitioned(t *testing.T) {
	ctx := context.Background()
	admin := testdb.Pool(t)
	schema := testdb.Schema(t)
	plain, err := processed.New(admin, processed.Config{Schema: schema})
	if err != nil {
		t.Fatal(err)
	}
	if err := plain.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := admin.Exec(ctx, "CREATE TABLE "+pgx.Identifier{schema, "ledger"}.Sanitize()+" (id text)"); err != nil {
		t.Fatal(err)
	}
	_, pool := limitedRole(t, admin, plain, "ledger")
	part, err := processed.New(admin, processed.Config{Schema: schema, Partitioned: true})
	if err != nil {
		t.Fatal(err)
	}
	if err := part.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	store, err := processed.New(pool, processed.Config{Schema: schema, Partitioned: true})
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		body string
		want dedup.ClaimOutcome
	}{{"x", dedup.ClaimNew}, {"x", dedup.ClaimDuplicate}, {"y", dedup.ClaimMismatch}} {
		if got := claim(t, store, claimOf("c", "m", tc.body), claimOf("c", "m-"+tc.body+tc.want.String(), "z"))[0]; got.Outcome != tc.want {
			t.Fatalf("claim as the limited role: %v, want %v", got.Outcome, tc.want)
		}
	}
	if _, err := store.Lookup(ctx, "c", "m"); err != nil {
		t.Fatalf("Lookup as the limited role: %v", err)
	}
	_, err = store.Purge(ctx, "c", time.Millisecond)
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) || pgErr.Code != "42501" || !strings.Contains(err.Error(), "upkeep of the generations") {
		t.Fatalf("upkeep as the limited role: %v, want a permission error (42501) naming the upkeep", err)
	}
}
