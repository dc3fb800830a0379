package dedup_test

import (
	"testing"
	"time"

	"github.com/idemq/idemq/consumer/dedup"
)

// TestAgeBucketsAndQuantile: the buckets' bounds, a duplicate's bucket and
// a report's quantiles, MaxAge capping the bound of the bucket it is in.
func TestAgeBucketsAndQuantile(t *testing.T) {
	bounds := dedup.AgeBounds()
	b := make([]int64, len(bounds)+1)
	b[0], b[len(bounds)] = 99, 1
	r := dedup.RetentionReport{Buckets: b, MaxAge: 50 * time.Minute}
	if q := r.Quantile(0.5); q != time.Second {
		t.Errorf("p50 %s", q)
	}
	if q := r.Quantile(0.999); q != 50*time.Minute {
		t.Errorf("p99.9 %s", q)
	}
	if q := (dedup.RetentionReport{Buckets: make([]int64, len(bounds)+1)}).Quantile(0.5); q != 0 {
		t.Errorf("p50 of no duplicates %s", q)
	}
	for age, want := range map[time.Duration]int{0: 0, time.Second: 0, 90 * time.Second: 3, 365 * 24 * time.Hour: len(bounds)} {
		if i := dedup.AgeBucket(age); i != want {
			t.Errorf("bucket of %s: %d, want %d", age, i, want)
		}
	}
	bounds[0] = time.Hour // a copy
	if dedup.AgeBounds()[0] != time.Second {
		t.Error("AgeBounds returned its own slice")
	}
}
