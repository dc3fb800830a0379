package processed_test

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/processed"
)

// exampleDB connects to DATABASE_URL and returns a migrated store in a fresh
// schema, and a cleanup function that drops the schema and closes the pool.
func exampleDB(ctx context.Context) (*pgxpool.Pool, *processed.Store, func(), error) {
	url := os.Getenv("DATABASE_URL")
	if url == "" {
		url = "postgres://postgres@127.0.0.1:5432/test?sslmode=disable"
	}
	pool, err := pgxpool.New(ctx, url)
	if err != nil {
		return nil, nil, nil, err
	}
	var b [6]byte
	_, _ = rand.Read(b[:])
	schema := "idemq_example_" + hex.EncodeToString(b[:])
	cleanup := func() {
		_, _ = pool.Exec(context.Background(), "DROP SCHEMA IF EXISTS "+pgx.Identifier{schema}.Sanitize()+" CASCADE")
		pool.Close()
	}
	store, err := processed.New(pool, processed.Config{Schema: schema})
	if err == nil {
		err = store.Migrate(ctx) // creates the schema and the table
	}
	if err != nil {
		cleanup()
		return nil, nil, nil, err
	}
	return pool, store, cleanup, nil
}

func ExampleStore_Claim() {
	ctx := context.Background()
	pool, store, cleanup, err := exampleDB(ctx)
	if err != nil {
		fmt.Println(err)
		return
	}
	defer cleanup()

	claim := func(id, body string) {
		tx, err := pool.Begin(ctx)
		if err != nil {
			fmt.Println(err)
			return
		}
		defer func() { _ = tx.Rollback(ctx) }()
		res, err := store.Claim(ctx, tx, consumer.Claim{
			Consumer:    "billing",
			MessageID:   id,
			Fingerprint: sha256.Sum256([]byte(body)),
			Source:      "payments",
			Partition:   -1,
			Offset:      -1,
		})
		if err != nil {
			fmt.Println(err)
			return
		}
		fmt.Println(id, res.Outcome)
		// ... apply the effect in tx only if res.Outcome == consumer.ClaimNew ...
		if err := tx.Commit(ctx); err != nil {
			fmt.Println(err)
		}
	}
	claim("m-1", `{"amount":10}`)
	claim("m-1", `{"amount":10}`)   // redelivery
	claim("m-1", `{"amount":1000}`) // same id, different payload
	claim("m-2", `{"amount":10}`)
	// Output:
	// m-1 new
	// m-1 duplicate
	// m-1 mismatch
	// m-2 new
}

func ExampleStore_Lookup() {
	ctx := context.Background()
	pool, store, cleanup, err := exampleDB(ctx)
	if err != nil {
		fmt.Println(err)
		return
	}
	defer cleanup()

	tx, err := pool.Begin(ctx)
	if err != nil {
		fmt.Println(err)
		return
	}
	_, err = store.Claim(ctx, tx, consumer.Claim{
		Consumer: "billing", MessageID: "m-1", Fingerprint: sha256.Sum256([]byte("x")),
		Source: "payments", Partition: 2, Offset: 1234,
	})
	if err == nil {
		err = tx.Commit(ctx)
	}
	if err != nil {
		fmt.Println(err)
		return
	}

	rec, err := store.Lookup(ctx, "billing", "m-1")
	if err != nil {
		fmt.Println(err)
		return
	}
	fmt.Println(rec.Source, *rec.Partition, *rec.Offset, hex.EncodeToString(rec.Fingerprint)[:8])

	_, err = store.Lookup(ctx, "billing", "m-2")
	fmt.Println(errors.Is(err, processed.ErrNotFound))
	// Output:
	// payments 2 1234 2d711642
	// true
}

func ExampleStore_Purge() {
	ctx := context.Background()
	pool, store, cleanup, err := exampleDB(ctx)
	if err != nil {
		fmt.Println(err)
		return
	}
	defer cleanup()

	tx, err := pool.Begin(ctx)
	if err != nil {
		fmt.Println(err)
		return
	}
	_, err = store.Claim(ctx, tx, consumer.Claim{Consumer: "billing", MessageID: "m-1", Partition: -1, Offset: -1})
	if err == nil {
		err = tx.Commit(ctx)
	}
	if err != nil {
		fmt.Println(err)
		return
	}

	// The row is fresh: a 72-hour retention keeps it.
	n, err := store.Purge(ctx, 72*time.Hour)
	fmt.Println(n, err)
	// Output:
	// 0 <nil>
}

func ExampleNew() {
	// Table and schema names are identifiers, never SQL.
	_, err := processed.New(&pgx.Conn{}, processed.Config{Table: "x; drop table y"})
	fmt.Println(err)
	// Output:
	// idemq: invalid config: Table: "x; drop table y" is not a plain identifier (letters, digits and underscores, not starting with a digit)
}
