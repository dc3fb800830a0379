package httpidem_test

import (
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemq/idemq/httpidem"
	"github.com/idemq/idemq/internal/testdb"
)

// TestSchemaFromSearchPath: with Config.Schema empty, the keys' table lives
// in the connection's current schema, as the dedup table does, learned on
// first use.
func TestSchemaFromSearchPath(t *testing.T) {
	ctx := testCtx(t, 30*time.Second)
	schema := testdb.Schema(t)
	cfg, err := pgxpool.ParseConfig(testdb.URL())
	if err != nil {
		t.Fatal(err)
	}
	cfg.ConnConfig.RuntimeParams["search_path"] = schema
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()

	mw, err := httpidem.New(pool, httpidem.Config{})
	if err != nil {
		t.Fatal(err)
	}
	if err := mw.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	if mw.String() != schema+".idempotency_keys" {
		t.Fatalf("String() = %q, want %s.idempotency_keys", mw.String(), schema)
	}
	h := mw.Wrap(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { w.WriteHeader(http.StatusCreated) }))
	req := httptest.NewRequest(http.MethodPost, "/x", strings.NewReader(`{}`))
	req.Header.Set("Idempotency-Key", "k-1")
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, req)
	if rec.Code != http.StatusCreated {
		t.Fatalf("status %d: %s", rec.Code, rec.Body)
	}
	var n int
	if err := testdb.Pool(t).QueryRow(ctx, `SELECT count(*) FROM `+pgx.Identifier{schema, "idempotency_keys"}.Sanitize()).Scan(&n); err != nil || n != 1 {
		t.Fatalf("keys in %s: %d, %v; want 1", schema, n, err)
	}
}
