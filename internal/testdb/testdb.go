// Package testdb gives tests a shared Postgres pool and a fresh schema per
// test, so database tests can run in parallel without seeing each other.
//
// The server is taken from IDEMQ_TEST_DATABASE_URL, then DATABASE_URL, and
// defaults to postgres://postgres@127.0.0.1:5432/test. A test that cannot
// reach it fails: it is never skipped.
package testdb

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"go.uber.org/goleak"
)

// DefaultURL is used when neither IDEMQ_TEST_DATABASE_URL nor DATABASE_URL
// is set.
const DefaultURL = "postgres://postgres@127.0.0.1:5432/test?sslmode=disable"

// URL returns the database URL tests use.
func URL() string {
	if u := os.Getenv("IDEMQ_TEST_DATABASE_URL"); u != "" {
		return u
	}
	if u := os.Getenv("DATABASE_URL"); u != "" {
		return u
	}
	return DefaultURL
}

var (
	once    sync.Once
	pool    *pgxpool.Pool
	poolErr error
)

// Pool returns the process-wide pool, creating it on first use. It is never
// closed: it lives as long as the test binary.
func Pool(t testing.TB) *pgxpool.Pool {
	t.Helper()
	once.Do(func() {
		cfg, err := pgxpool.ParseConfig(URL())
		if err != nil {
			poolErr = err
			return
		}
		cfg.MaxConns = 32
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		pool, poolErr = pgxpool.NewWithConfig(ctx, cfg)
		if poolErr == nil {
			poolErr = pool.Ping(ctx)
		}
	})
	if poolErr != nil {
		t.Fatalf("testdb: Postgres at %s: %v (set IDEMQ_TEST_DATABASE_URL)", URL(), poolErr)
	}
	return pool
}

// Schema creates a fresh, uniquely named schema for the test and drops it
// (with everything in it) when the test ends. It returns the schema's name,
// which is a plain lower-case identifier.
func Schema(t testing.TB) string {
	t.Helper()
	p := Pool(t)
	var b [6]byte
	_, _ = rand.Read(b[:])
	name := "idemq_test_" + hex.EncodeToString(b[:])
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if _, err := p.Exec(ctx, "CREATE SCHEMA "+pgx.Identifier{name}.Sanitize()); err != nil {
		t.Fatalf("testdb: create schema: %v", err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		if _, err := p.Exec(ctx, "DROP SCHEMA "+pgx.Identifier{name}.Sanitize()+" CASCADE"); err != nil {
			t.Errorf("testdb: drop schema %s: %v", name, err)
		}
	})
	return name
}

// LeakOptions are the goleak options every package whose tests use Pool
// needs: the shared pool lives as long as the test binary, so its health
// checker, and the background reader of a connection draining a cancelled
// query, may still run when the leak check looks.
func LeakOptions() []goleak.Option {
	return []goleak.Option{
		goleak.IgnoreTopFunction("github.com/jackc/pgx/v5/pgxpool.(*Pool).backgroundHealthCheck"),
		goleak.IgnoreAnyFunction("github.com/jackc/pgx/v5/pgxpool.(*Pool).triggerHealthCheck.func1"),
		goleak.IgnoreAnyFunction("github.com/jackc/puddle/v2.(*Pool[...]).backgroundHealthCheck"),
		goleak.IgnoreAnyFunction("github.com/jackc/pgx/v5/pgconn/internal/bgreader.(*BGReader).bgRead"),
	}
}
