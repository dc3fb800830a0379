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

	"github.com/idemq/idemq/consumer/dedup"
	"github.com/idemq/idemq/processed"
)

// exampleDB connects to DATABASE_URL and returns a migrated store in a fresh
// schema, and a cleanup function that drops the schema and closes the pool.
func exampleDB(ctx context.Context) (*processed.Store, func(), error) {
	url := os.Getenv("DATABASE_URL")
	if url == "" {
		url = "postgres://postgres@127.0.0.1:5432/test?sslmode=disable"
	}
	pool, err := pgxpool.New(ctx, url)
	if err != nil {
		return nil, nil, err
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
		return nil, nil, err
	}
	return store, cleanup, nil
}

func ExampleStore_BeginClaim() {
	ctx := context.Background()
	store, cleanup, err := exampleDB(ctx)
	if err != nil {
		fmt.Println(err)
		return
	}
	defer cleanup()

	claim := func(id, body string) {
		tx, res, err := store.BeginClaim(ctx, []dedup.Claim{{
			Consumer:    "billing",
			MessageID:   id,
			Fingerprint: sha256.Sum256([]byte(body)),
			Source:      "payments",
			Partition:   -1,
			Offset:      -1,
		}})
		if tx != nil {
			defer func() { _ = tx.Rollback(ctx) }()
		}
		if err != nil {
			fmt.Println(err)
			return
		}
		fmt.Println(id, res[0].Outcome)
		// ... apply the effect in tx only if the outcome is dedup.ClaimNew ...
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

// commitClaim claims c alone and commits it.
func commitClaim(ctx context.Context, store *processed.Store, c dedup.Claim) error {
	tx, _, err := store.BeginClaim(ctx, []dedup.Claim{c})
	if tx != nil {
		defer func() { _ = tx.Rollback(ctx) }()
	}
	if err != nil {
		return err
	}
	return tx.Commit(ctx)
}

func ExampleStore_Lookup() {
	ctx := context.Background()
	store, cleanup, err := exampleDB(ctx)
	if err != nil {
		fmt.Println(err)
		return
	}
	defer cleanup()

	err = commitClaim(ctx, store, dedup.Claim{
		Consumer: "billing", MessageID: "m-1", Fingerprint: sha256.Sum256([]byte("x")),
		Source: "payments", Partition: 2, Offset: 1234,
	})
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
	store, cleanup, err := exampleDB(ctx)
	if err != nil {
		fmt.Println(err)
		return
	}
	defer cleanup()

	if err := commitClaim(ctx, store, dedup.Claim{Consumer: "billing", MessageID: "m-1", Partition: -1, Offset: -1}); err != nil {
		fmt.Println(err)
		return
	}
	// The row is fresh: a 72-hour retention keeps it. Only billing's
	// rows are purged: another consumer's are its own janitor's.
	n, err := store.Purge(ctx, "billing", 72*time.Hour)
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
