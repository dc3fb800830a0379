package processed_test

import (
	"context"
	"crypto/sha256"
	"fmt"
	"testing"

	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/internal/testdb"
	"github.com/idemq/idemq/processed"
)

func TestClaimBatch(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testdb.Pool(t)
	store, err := processed.New(pool, processed.Config{Schema: testdb.Schema(t)})
	if err != nil {
		t.Fatal(err)
	}
	if err := store.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	claim := func(id, body string) consumer.Claim {
		return consumer.Claim{Consumer: "c", MessageID: id, Fingerprint: sha256.Sum256([]byte(body)), Source: "q", Partition: -1, Offset: -1}
	}
	// Commit a and b first.
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	res, err := store.ClaimBatch(ctx, tx, []consumer.Claim{claim("a", "1"), claim("b", "2")})
	if err != nil || res[0].Outcome != consumer.ClaimNew || res[1].Outcome != consumer.ClaimNew {
		t.Fatalf("first batch: %v %+v", err, res)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}

	tx, err = pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	var claims []consumer.Claim
	for i := 0; i < 50; i++ {
		claims = append(claims, claim(fmt.Sprintf("n-%d", i), "x"))
	}
	claims = append(claims, claim("b", "2"), claim("a", "changed"))
	res, err = store.ClaimBatch(ctx, tx, claims)
	if err != nil {
		t.Fatal(err)
	}
	for i := 0; i < 50; i++ {
		if res[i].Outcome != consumer.ClaimNew {
			t.Fatalf("claim %d: %v", i, res[i].Outcome)
		}
	}
	if res[50].Outcome != consumer.ClaimDuplicate || res[50].ProcessedAt.IsZero() {
		t.Fatalf("b: %+v", res[50])
	}
	if res[51].Outcome != consumer.ClaimMismatch {
		t.Fatalf("a: %+v", res[51])
	}
	if _, err := store.ClaimBatch(ctx, tx, []consumer.Claim{claim("z", "1"), claim("z", "1")}); err == nil {
		t.Fatal("repeated id accepted")
	}
}

func TestClaimBatchWaitsForConcurrentClaim(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testdb.Pool(t)
	store, err := processed.New(pool, processed.Config{Schema: testdb.Schema(t)})
	if err != nil {
		t.Fatal(err)
	}
	if err := store.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	c := consumer.Claim{Consumer: "c", MessageID: "x", Fingerprint: sha256.Sum256([]byte("b")), Partition: -1, Offset: -1}
	first, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := store.Claim(ctx, first, c); err != nil {
		t.Fatal(err)
	}
	done := make(chan consumer.ClaimResult, 1)
	go func() {
		tx, err := pool.Begin(ctx)
		if err != nil {
			t.Error(err)
			return
		}
		defer tx.Rollback(ctx)
		res, err := store.ClaimBatch(ctx, tx, []consumer.Claim{c})
		if err != nil {
			t.Error(err)
		}
		done <- res[0]
	}()
	if err := first.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if got := <-done; got.Outcome != consumer.ClaimDuplicate {
		t.Fatalf("concurrent batch claim after commit: %v", got.Outcome)
	}
}
