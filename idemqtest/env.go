package idemqtest

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"os"
	"slices"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// defaultDatabaseURL is the server used when Suite.DatabaseURL,
// IDEMQ_TEST_DATABASE_URL and DATABASE_URL are all empty.
const defaultDatabaseURL = "postgres://postgres@127.0.0.1:5432/test?sslmode=disable"

// databaseURL picks the URL: the suite's, else the environment's, else the
// local default.
func databaseURL(u string) string {
	for _, v := range []string{u, os.Getenv("IDEMQ_TEST_DATABASE_URL"), os.Getenv("DATABASE_URL")} {
		if v != "" {
			return v
		}
	}
	return defaultDatabaseURL
}

// Env is one run's world: a fresh schema, a pool whose connections have
// that schema first on their search_path (so unqualified table names in
// Setup, handlers and queries resolve to it), and a fresh Recorder. The kit
// creates an Env for every run of every case and drops its schema when the
// run ends.
type Env struct {
	// Schema is the fresh schema's name: a lower-case identifier.
	Schema string
	// Pool is a pool on the test database whose search_path is Schema,
	// public. Handlers must not write through it: their writes belong in
	// the transaction they are given.
	Pool *pgxpool.Pool
	// Recorder is an HTTP server, fresh for the run, that records the
	// calls it receives. Its calls are part of the compared effect.
	Recorder *Recorder
}

// admin is the connection the kit creates and drops schemas with.
type admin struct {
	url  string
	pool *pgxpool.Pool
}

func openAdmin(ctx context.Context, url string) (*admin, error) {
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		return nil, fmt.Errorf("idemqtest: database URL: %w", err)
	}
	cfg.MaxConns = 2
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err == nil {
		err = pool.Ping(ctx)
	}
	if err != nil {
		if pool != nil {
			pool.Close()
		}
		return nil, fmt.Errorf("idemqtest: cannot reach the test database %q on %s:%d (set Suite.DatabaseURL or IDEMQ_TEST_DATABASE_URL): %w",
			cfg.ConnConfig.Database, cfg.ConnConfig.Host, cfg.ConnConfig.Port, err)
	}
	return &admin{url: url, pool: pool}, nil
}

func (a *admin) close() { a.pool.Close() }

// newEnv creates a fresh schema and its pool. The returned close drops the
// schema with everything in it.
func (a *admin) newEnv(ctx context.Context, maxConns int32) (*Env, func(), error) {
	var b [6]byte
	_, _ = rand.Read(b[:])
	schema := "idemqtest_" + hex.EncodeToString(b[:])
	q := pgx.Identifier{schema}.Sanitize()
	if _, err := a.pool.Exec(ctx, "CREATE SCHEMA "+q); err != nil {
		return nil, nil, fmt.Errorf("idemqtest: create schema: %w", err)
	}
	drop := func() {
		dctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		_, _ = a.pool.Exec(dctx, "DROP SCHEMA IF EXISTS "+q+" CASCADE")
	}
	cfg, err := pgxpool.ParseConfig(a.url)
	if err != nil {
		drop()
		return nil, nil, err
	}
	cfg.MaxConns = maxConns
	cfg.ConnConfig.RuntimeParams["search_path"] = q + ", public"
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		drop()
		return nil, nil, fmt.Errorf("idemqtest: open pool: %w", err)
	}
	rec := NewRecorder()
	env := &Env{Schema: schema, Pool: pool, Recorder: rec}
	return env, func() {
		rec.Close()
		pool.Close()
		drop()
	}, nil
}

// EffectFunc reads a run's end state: the effect the handler left, as data
// the kit can compare (anything encoding/json can encode). It runs after the
// run's consumer has stopped.
type EffectFunc func(ctx context.Context, env *Env) (any, error)

// Rows returns an EffectFunc that runs query (with args) on the run's pool
// and returns its rows as column-to-value maps, sorted, so that the order
// the rows come back in does not matter. Leave volatile columns (now(),
// random ids) out of the query, or list them in Suite.Ignore.
func Rows(query string, args ...any) EffectFunc {
	return func(ctx context.Context, env *Env) (any, error) {
		rows, err := env.Pool.Query(ctx, query, args...)
		if err != nil {
			return nil, err
		}
		maps, err := pgx.CollectRows(rows, pgx.RowToMap)
		if err != nil {
			return nil, err
		}
		out := make([]any, len(maps))
		keys := make([]string, len(maps))
		for i, m := range maps {
			v, err := normalize(m)
			if err != nil {
				return nil, err
			}
			out[i] = v
			keys[i] = render(v)
		}
		idx := make([]int, len(out))
		for i := range idx {
			idx[i] = i
		}
		slices.SortStableFunc(idx, func(a, b int) int {
			switch {
			case keys[a] < keys[b]:
				return -1
			case keys[a] > keys[b]:
				return 1
			}
			return 0
		})
		sorted := make([]any, len(out))
		for i, j := range idx {
			sorted[i] = out[j]
		}
		return sorted, nil
	}
}
