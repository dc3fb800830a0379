package processed_test

import (
	"context"
	"crypto/sha256"
	"strconv"
	"testing"
	"time"

	"github.com/idemq/idemq/consumer/dedup"
	"github.com/idemq/idemq/internal/testdb"
	"github.com/idemq/idemq/processed"
)

// benchStore returns a migrated store in a fresh schema.
func benchStore(b *testing.B, cfg processed.Config) *processed.Store {
	b.Helper()
	cfg.Schema = testdb.Schema(b)
	store, err := processed.New(testdb.Pool(b), cfg)
	if err != nil {
		b.Fatal(err)
	}
	if err := store.Migrate(context.Background()); err != nil {
		b.Fatal(err)
	}
	return store
}

func benchClaim(id string) dedup.Claim {
	return dedup.Claim{Consumer: "bench", MessageID: id, Fingerprint: sha256.Sum256([]byte(id)), Source: "q", Partition: -1, Offset: -1}
}

// BenchmarkClaim measures one transaction per claim, the per-message path:
// BEGIN, the synchronous commit and the claim's INSERT in one pipelined
// round trip (BeginClaim), then COMMIT. "new" claims fresh ids;
// "duplicate" claims an id already committed (an INSERT that conflicts,
// then the SELECT of the existing row).
func BenchmarkClaim(b *testing.B) {
	for _, layout := range []processed.Config{{}, {Partitioned: true}} {
		name := map[bool]string{false: "plain", true: "partitioned"}[layout.Partitioned]
		ctx := context.Background()
		store := benchStore(b, layout)
		run := func(b *testing.B, id func(i int) string, want dedup.ClaimOutcome) {
			b.ReportAllocs()
			for i := 0; b.Loop(); i++ {
				tx, res, err := store.BeginClaim(ctx, []dedup.Claim{benchClaim(id(i))})
				if err != nil || res[0].Outcome != want {
					b.Fatalf("claim: %v %v, want %v", res, err, want)
				}
				if err := tx.Commit(ctx); err != nil {
					b.Fatal(err)
				}
			}
			b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "claims/s")
		}
		b.Run(name+"/new", func(b *testing.B) {
			prefix := "new-" + strconv.FormatInt(time.Now().UnixNano(), 36) + "-" // fresh per round (-count)
			run(b, func(i int) string { return prefix + strconv.Itoa(i) }, dedup.ClaimNew)
		})
		b.Run(name+"/duplicate", func(b *testing.B) {
			tx, _, err := store.BeginClaim(ctx, []dedup.Claim{benchClaim("dup")}) // new, or a duplicate already
			if err == nil {
				err = tx.Commit(ctx)
			}
			if err != nil {
				b.Fatalf("claim dup: %v", err)
			}
			run(b, func(int) string { return "dup" }, dedup.ClaimDuplicate)
		})
	}
}

// BenchmarkClaimBatch measures the batch path: BeginClaim of size ids,
// COMMIT. One op is one batch; claims/s is the rate per id. "mixed"
// batches have a fifth of their ids already committed.
func BenchmarkClaimBatch(b *testing.B) {
	ctx := context.Background()
	store := benchStore(b, processed.Config{})
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
				claims := make([]dedup.Claim, size)
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
					tx, _, err := store.BeginClaim(ctx, claims)
					if err != nil {
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
