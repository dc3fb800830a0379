package processed

import (
	"fmt"
	"math/rand"
	"testing"

	"github.com/idemq/idemq/consumer"
)

// BenchmarkCachedFiltersMatching: the in-memory test of one id against
// eleven dense filters of ten million ids each (763-byte rows), as a claim
// runs it at the retention benchmark's sizes.
func BenchmarkCachedFiltersMatching(b *testing.B) {
	const parts, rowBytes = 11, 763
	rnd := rand.New(rand.NewSource(1))
	var cf cachedFilters
	for p := 0; p < parts; p++ {
		f := &sealedFilter{partition: fmt.Sprint(p), rowBytes: rowBytes, bits: make([]byte, filterBuckets*rowBytes)}
		// A quarter of the bits set (a full filter has about 40%).
		other := make([]byte, len(f.bits))
		rnd.Read(f.bits)
		rnd.Read(other)
		for i := range f.bits {
			f.bits[i] &= other[i]
		}
		cf = append(cf, f)
	}
	claims := make([]consumer.Claim, 4096)
	for i := range claims {
		claims[i] = consumer.Claim{Consumer: "bench", MessageID: fmt.Sprintf("new-%d", i)}
	}
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		_ = cf.matching(claims[i%len(claims)])
	}
}
