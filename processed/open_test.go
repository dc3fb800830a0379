package processed_test

import (
	"errors"
	"net/url"
	"strings"
	"testing"

	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/consumer/dedup"
	"github.com/idemq/idemq/internal/testdb"
	"github.com/idemq/idemq/processed"
)

// withParam returns testdb.URL() with one more query parameter.
func withParam(t *testing.T, key, value string) string {
	t.Helper()
	u, err := url.Parse(testdb.URL())
	if err != nil {
		t.Fatal(err)
	}
	q := u.Query()
	q.Set(key, value)
	u.RawQuery = q.Encode()
	return u.String()
}

// TestOpenOwnsASizedPool: Open makes a pool of DefaultMaxConns unless
// Config.MaxConns or the URL's pool_max_conns says otherwise, refuses both
// at once, serves the runtime through dedup.Store, and Close closes it.
func TestOpenOwnsASizedPool(t *testing.T) {
	t.Parallel()
	schema := testdb.Schema(t)
	for _, tc := range []struct {
		name string
		url  string
		cfg  processed.Config
		want int
	}{
		{"default", testdb.URL(), processed.Config{}, processed.DefaultMaxConns},
		{"config", testdb.URL(), processed.Config{MaxConns: 3}, 3},
		{"url", withParam(t, "pool_max_conns", "5"), processed.Config{}, 5},
	} {
		tc.cfg.Schema = schema
		s, err := processed.Open(ctx(t), tc.url, tc.cfg)
		if err != nil {
			t.Fatalf("%s: %v", tc.name, err)
		}
		var store dedup.Store = s
		if got := store.MaxConns(); got != tc.want {
			t.Errorf("%s: MaxConns %d, want %d", tc.name, got, tc.want)
		}
		if err := s.Migrate(ctx(t)); err != nil {
			t.Fatal(err)
		}
		tx, res, err := s.BeginClaim(ctx(t), []dedup.Claim{claimOf("c", tc.name, "x")})
		if err != nil || res[0].Outcome != dedup.ClaimNew {
			t.Fatalf("%s: BeginClaim %+v, %v", tc.name, res, err)
		}
		if err := tx.Commit(ctx(t)); err != nil {
			t.Fatal(err)
		}
		if s.Pool() == nil || s.Ping(ctx(t)) != nil {
			t.Fatalf("%s: no live pool", tc.name)
		}
		s.Close()
		if err := s.Ping(ctx(t)); err == nil {
			t.Errorf("%s: Ping after Close succeeded: the pool is still open", tc.name)
		}
	}

	var ce *consumer.ConfigError
	_, err := processed.Open(ctx(t), withParam(t, "pool_max_conns", "5"), processed.Config{Schema: schema, MaxConns: 3})
	if !errors.As(err, &ce) || ce.Field != "MaxConns" {
		t.Errorf("MaxConns in both places: %v, want a ConfigError on MaxConns", err)
	}
	if _, err := processed.New(testdb.Pool(t), processed.Config{MaxConns: 3}); !errors.As(err, &ce) || ce.Field != "MaxConns" {
		t.Errorf("New with MaxConns: %v, want a ConfigError: the pool passed decides", err)
	}
	if _, err := processed.Open(ctx(t), testdb.URL(), processed.Config{Schema: "bad-name"}); !errors.As(err, &ce) || ce.Field != "Schema" {
		t.Errorf("bad schema: %v, want a ConfigError before connecting", err)
	}
}

// TestOpenUnreachableRedactsPassword: a database that does not answer fails
// Open, and the error names it without the password.
func TestOpenUnreachableRedactsPassword(t *testing.T) {
	t.Parallel()
	const secret = "s3cret-pw"
	_, err := processed.Open(ctx(t), "postgres://app:"+secret+"@127.0.0.1:1/ledger?connect_timeout=2", processed.Config{})
	if err == nil {
		t.Fatal("Open of a closed port succeeded")
	}
	if strings.Contains(err.Error(), secret) {
		t.Fatalf("the error shows the password: %v", err)
	}
	if !strings.Contains(err.Error(), "127.0.0.1") {
		t.Errorf("the error does not say where: %v", err)
	}
}

// TestSchemaFromSearchPath: with Config.Schema empty, the table lives in the
// connection's current schema, here set by the URL's search_path, for the
// runtime's claims and the operator's lookups alike, and for New as for Open.
func TestSchemaFromSearchPath(t *testing.T) {
	t.Parallel()
	schema := testdb.Schema(t)
	if _, err := testdb.Pool(t).Exec(ctx(t), "CREATE SCHEMA IF NOT EXISTS "+schema); err != nil {
		t.Fatal(err)
	}
	u := withParam(t, "search_path", schema)
	s, err := processed.Open(ctx(t), u, processed.Config{})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	if s.Schema() != schema {
		t.Fatalf("Schema() = %q, want %q from the search_path", s.Schema(), schema)
	}
	if err := s.Migrate(ctx(t)); err != nil {
		t.Fatal(err)
	}
	tx, _, err := s.BeginClaim(ctx(t), []dedup.Claim{claimOf("c", "m-1", "x")})
	if err != nil {
		t.Fatal(err)
	}
	if err := tx.Commit(ctx(t)); err != nil {
		t.Fatal(err)
	}
	// Seen from an explicitly named store over another pool.
	named, err := processed.New(testdb.Pool(t), processed.Config{Schema: schema})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := named.Lookup(ctx(t), "c", "m-1"); err != nil {
		t.Fatalf("the row is not in %s: %v", schema, err)
	}
	// New learns the schema too, on first use.
	lazy, err := processed.New(s.Pool(), processed.Config{})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := lazy.Lookup(ctx(t), "c", "m-1"); err != nil || lazy.Schema() != schema {
		t.Fatalf("New over the pool: schema %q, lookup %v", lazy.Schema(), err)
	}

	// A search_path that names no existing schema is a clear error.
	_, err = processed.Open(ctx(t), withParam(t, "search_path", "no_such_schema_here"), processed.Config{})
	var ce *consumer.ConfigError
	if !errors.As(err, &ce) || ce.Field != "Schema" || !strings.Contains(err.Error(), "search_path") {
		t.Fatalf("search_path of a missing schema: %v, want a ConfigError on Schema", err)
	}
}
