package processed_test

import (
	"context"
	"crypto/sha256"
	"strconv"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/internal/testdb"
	"github.com/idemq/idemq/processed"
)

// benchStore returns a migrated store in a fresh schema.
func benchStore(b *testing.B) (*processed.Store, *pgxpool.Pool) {
	b.Helper()
	pool := testdb.Pool(b)
	store, err := processed.New(pool, processed.Config{Schema: testdb.Schema(b)})
	if err != nil {
		b.Fatal(err)
	}
	if err := store.Migrate(context.Background()); err != nil {
		b.Fatal(err)
	}
	return store, pool
}

func benchClaim(id string) consumer.Claim {
	return consumer.Claim{Consumer: "bench", MessageID: id, Fingerprint: sha256.Sum256([]byte(id)), Source: "q", Partition: -1, Offset: -1}
}

// BenchmarkClaim measures one transaction per claim, the per-message path,
// both ways the runtime can take it: "separate" sends BEGIN (with SET LOCAL
// synchronous_commit) and then Claim, two round trips; "queued" sends both
// in one pipelined batch with BeginClaim. Each op then commits. "new" claims
// fresh ids; "duplicate" claims an id already committed (an INSERT that
// conflicts, then the SELECT of the existing row).
func BenchmarkClaim(b *testing.B) {
	ctx := context.Background()
	store, pool := benchStore(b)
	const setSync = "SET LOCAL synchronous_commit = on"
	paths := []struct {
		name  string
		claim func(c consumer.Claim) (pgx.Tx, consumer.ClaimResult, error)
	}{
		{"separate", func(c consumer.Claim) (pgx.Tx, consumer.ClaimResult, error) {
			tx, err := pool.BeginTx(ctx, pgx.TxOptions{BeginQuery: "BEGIN ISOLATION LEVEL READ COMMITTED; " + setSync})
			if err != nil {
				return nil, consumer.ClaimResult{}, err
			}
			res, err := store.Claim(ctx, tx, c)
			return tx, res, err
		}},
		{"queued", func(c consumer.Claim) (pgx.Tx, consumer.ClaimResult, error) {
			tx, res, err := store.BeginClaim(ctx, []consumer.Claim{c})
			if err != nil {
				return tx, consumer.ClaimResult{}, err
			}
			return tx, res[0], nil
		}},
	}
	run := func(b *testing.B, claim func(consumer.Claim) (pgx.Tx, consumer.ClaimResult, error), id func(i int) string, want consumer.ClaimOutcome) {
		b.ReportAllocs()
		for i := 0; b.Loop(); i++ {
			tx, res, err := claim(benchClaim(id(i)))
			if err != nil || res.Outcome != want {
				b.Fatalf("claim: %v %v, want %v", res.Outcome, err, want)
			}
			if err := tx.Commit(ctx); err != nil {
				b.Fatal(err)
			}
		}
		b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "claims/s")
	}
	for _, p := range paths {
		b.Run(p.name+"/new", func(b *testing.B) {
			prefix := p.name + "-new-" + strconv.FormatInt(time.Now().UnixNano(), 36) + "-" // fresh per round (-count)
			run(b, p.claim, func(i int) string { return prefix + strconv.Itoa(i) }, consumer.ClaimNew)
		})
		b.Run(p.name+"/duplicate", func(b *testing.B) {
			dup := p.name + "-dup"
			if tx, _, err := p.claim(benchClaim(dup)); err != nil || tx.Commit(ctx) != nil {
				b.Fatalf("claim %s: %v", dup, err)
			}
			run(b, p.claim, func(int) string { return dup }, consumer.ClaimDuplicate)
		})
	}
}

// BenchmarkClaimBatch measures the batch path: BEGIN, ClaimBatch of size
// ids, COMMIT. One op is one batch; claims/s is the rate per id. "mixed"
// batches have a fifth of their ids already committed.
func BenchmarkClaimBatch(b *testing.B) {
	ctx := context.Background()
	store, pool := benchStore(b)
	for _, size := range []int{10, 100, 1000} {
		for _, mixed := range []bool{false, true} {
			name := strconv.Itoa(size)
			if mixed {
				name += "/mixed"
			} else {
				name += "/new"
			}
			b.Run(name, func(b *testing.B) {
				b.ReportAllocs()
				claims := make([]consumer.Claim, size)
				var next int
				for i := 0; b.Loop(); i++ {
					for j := range claims {
						if mixed && j%5 == 0 && next > size {
							// An id committed by an earlier batch.
							claims[j] = benchClaim(name + "-" + strconv.Itoa(next-size+j/5))
							continue
						}
						claims[j] = benchClaim(name + "-" + strconv.Itoa(next))
						next++
					}
					tx, err := pool.Begin(ctx)
					if err != nil {
						b.Fatal(err)
					}
					if _, err := store.ClaimBatch(ctx, tx, claims); err != nil {
						b.Fatal(err)
					}
					if err := tx.Commit(ctx); err != nil {
						b.Fatal(err)
					}
				}
				b.ReportMetric(float64(b.N*size)/b.Elapsed().Seconds(), "claims/s")
			})
		}
	}
}
