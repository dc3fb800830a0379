package dupage

import (
	"testing"
	"time"
)

func TestBoundsAndQuantile(t *testing.T) {
	if len(Bounds)+1 != Buckets {
		t.Fatalf("%d bounds, %d buckets", len(Bounds), Buckets)
	}
	b := make([]int64, Buckets)
	b[0], b[len(Bounds)] = 99, 1
	if q := Quantile(b, 0.5, 50*time.Minute); q != time.Second {
		t.Errorf("p50 %s", q)
	}
	if q := Quantile(b, 0.999, 50*time.Minute); q != 50*time.Minute {
		t.Errorf("p99.9 %s", q)
	}
	if i := Bucket(90 * time.Second); i != 3 {
		t.Errorf("bucket of 90s: %d", i)
	}
}
