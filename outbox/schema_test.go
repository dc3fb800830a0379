package outbox_test

import (
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemq/idemq/internal/testdb"
	"github.com/idemq/idemq/outbox"
)

// searchPathPool returns a pool whose connections have search_path schema.
func searchPathPool(t *testing.T, schema string) *pgxpool.Pool {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(testdb.URL())
	if err != nil {
		t.Fatal(err)
	}
	cfg.ConnConfig.RuntimeParams["search_path"] = schema
	pool, err := pgxpool.NewWithConfig(testCtx(t, 10*time.Second), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	return pool
}

// TestSchemaFromSearchPath: with Config.Schema empty, the outbox lives in
// the connection's current schema, as the dedup table does: learned on
// first use, from the outbox's handle or from the caller's transaction.
func TestSchemaFromSearchPath(t *testing.T) {
	ctx := testCtx(t, 30*time.Second)
	schema := testdb.Schema(t)
	pool := searchPathPool(t, schema)

	// Enqueue learns it from the caller's transaction.
	ob, err := outbox.New(pool, outbox.Config{})
	if err != nil {
		t.Fatal(err)
	}
	if ob.Schema() != "" || ob.String() != "(search_path).outbox" {
		t.Fatalf("before first use: Schema %q, String %q", ob.Schema(), ob.String())
	}
	migrator, err := outbox.New(pool, outbox.Config{})
	if err != nil {
		t.Fatal(err)
	}
	if err := migrator.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(ctx) }()
	if err := ob.Enqueue(ctx, tx, outbox.Message{Destination: "d", ID: "m-1", Body: []byte("x")}); err != nil {
		t.Fatal(err)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if ob.Schema() != schema || ob.String() != schema+".outbox" {
		t.Fatalf("after Enqueue: Schema %q, String %q, want %q", ob.Schema(), ob.String(), schema)
	}

	// Seen from an explicitly named outbox over another pool.
	named, err := outbox.New(testdb.Pool(t), outbox.Config{Schema: schema})
	if err != nil {
		t.Fatal(err)
	}
	if st, err := named.Stats(ctx); err != nil || st.Pending != 1 {
		t.Fatalf("Stats of %s.outbox: %+v, %v; want 1 pending", schema, st, err)
	}
}
