package processed_test

import (
	"context"
	"errors"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/internal/testdb"
	"github.com/idemq/idemq/processed"
)

// TestOpenThroughPgBouncer: through PgBouncer in transaction mode with one
// server connection, with pgx's default query exec mode, a second store's
// Open meets the statement the first one prepared on that connection
// (42P05), and fails with the configuration error that names the fix,
// without the URL's password. With default_query_exec_mode=exec in the
// URL, any number of stores open and work.
func TestOpenThroughPgBouncer(t *testing.T) {
	t.Parallel()
	base := testdb.PgBouncer(t, testdb.PgBouncerOptions{PoolMode: "transaction", PoolSize: 1})
	u, err := url.Parse(base)
	if err != nil {
		t.Fatal(err)
	}
	u.User = url.UserPassword(u.User.Username(), "s3cret-pw") // PgBouncer's trust never asks for it
	withPassword := u.String()
	schema := testdb.Schema(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	cfg := processed.Config{Schema: schema, MaxConns: 2}

	first, err := processed.Open(ctx, withPassword, cfg)
	if err != nil {
		t.Fatalf("first Open: %v", err)
	}
	defer first.Close()
	second, err := processed.Open(ctx, withPassword, cfg)
	if err == nil {
		second.Close()
		t.Fatal("second Open through PgBouncer with the statement cache succeeded; want the configuration error")
	}
	var ce *consumer.ConfigError
	if !errors.Is(err, consumer.ErrInvalidConfig) || !errors.As(err, &ce) || ce.Field != "Store" {
		t.Fatalf("second Open = %v; want a *consumer.ConfigError for Store", err)
	}
	for _, want := range []string{"default_query_exec_mode=exec", "simple_protocol", "42P05"} {
		if !strings.Contains(err.Error(), want) {
			t.Fatalf("second Open = %v; want it to name %q", err, want)
		}
	}
	if strings.Contains(err.Error(), "s3cret-pw") {
		t.Fatalf("second Open = %v: prints the password", err)
	}

	q := u.Query()
	q.Set("default_query_exec_mode", "exec")
	u.RawQuery = q.Encode()
	for i := range 3 {
		s, err := processed.Open(ctx, u.String(), cfg)
		if err != nil {
			t.Fatalf("Open %d with default_query_exec_mode=exec: %v", i, err)
		}
		defer s.Close()
		if i == 0 {
			if err := s.Migrate(ctx); err != nil {
				t.Fatal(err)
			}
		}
		if _, err := s.Stats(ctx, ""); err != nil {
			t.Fatalf("Stats through store %d: %v", i, err)
		}
	}
}
