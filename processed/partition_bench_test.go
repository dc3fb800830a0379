package processed_test

import (
	"context"
	"strconv"
	"testing"
	"time"

	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/internal/testdb"
	"github.com/idemq/idemq/processed"
)

// BenchmarkClaimPartitioned compares one pipelined claim and its commit
// (BeginClaim) on the plain table and on a partitioned one (the DEFAULT
// partition, the current day and two ahead), for new ids and duplicates.
func BenchmarkClaimPartitioned(b *testing.B) {
	ctx := context.Background()
	for _, partitioned := range []bool{false, true} {
		cfg := processed.Config{Schema: testdb.Schema(b)}
		name := "plain"
		if partitioned {
			cfg.Partitioned, cfg.PartitionInterval, name = true, 24*time.Hour, "partitioned"
		}
		store, err := processed.New(testdb.Pool(b), cfg)
		if err != nil {
			b.Fatal(err)
		}
		if err := store.Migrate(ctx); err != nil {
			b.Fatal(err)
		}
		claim := func(b *testing.B, id string) {
			tx, _, err := store.BeginClaim(ctx, []consumer.Claim{benchClaim(id)})
			if err != nil {
				b.Fatal(err)
			}
			if err := tx.Commit(ctx); err != nil {
				b.Fatal(err)
			}
		}
		b.Run(name+"/new", func(b *testing.B) {
			for i := 0; i < b.N; i++ {
				claim(b, name+"-"+strconv.Itoa(i))
			}
		})
		claim(b, "dup")
		b.Run(name+"/duplicate", func(b *testing.B) {
			for i := 0; i < b.N; i++ {
				claim(b, "dup")
			}
		})
	}
}
