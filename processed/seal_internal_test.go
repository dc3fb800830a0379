package processed

import (
	"fmt"
	"testing"
)

// TestFilterRates builds a sealed partition's filter of a million ids as
// seal does and checks it: every member is found, and the false-positive
// rate for other ids is near the design's 0.12%.
func TestFilterRates(t *testing.T) {
	const n, probes = 1_000_000, 200_000
	rowBytes := min(maxFilterBytes, max(minFilterBytes, int((int64(n)*filterBitsPerID/filterBuckets+7)/8)))
	bits := make([]byte, filterBuckets*rowBytes)
	nbits := int64(rowBytes * 8)
	var pos []int64
	row := func(k filterKey) []byte { return bits[int(k.bucket)*rowBytes : int(k.bucket+1)*rowBytes] }
	has := func(k filterKey) bool {
		r := row(k)
		for _, b := range k.positions(nbits, pos) {
			if r[b/8]&(1<<(b%8)) == 0 {
				return false
			}
		}
		return true
	}
	for g := 0; g < n; g++ {
		k := newFilterKey("orders", fmt.Sprintf("order-%d", g))
		r := row(k)
		for _, b := range k.positions(nbits, pos) {
			r[b/8] |= 1 << (b % 8)
		}
	}
	for g := 0; g < n; g += 97 {
		if !has(newFilterKey("orders", fmt.Sprintf("order-%d", g))) {
			t.Fatalf("member order-%d not found", g)
		}
	}
	hits := 0
	for i := 0; i < probes; i++ {
		if has(newFilterKey("orders", fmt.Sprintf("other-%d", i))) {
			hits++
		}
	}
	if rate := float64(hits) / probes; rate > 0.004 {
		t.Fatalf("false-positive rate %.3f%%, want under 0.4%%", 100*rate)
	} else {
		t.Logf("%d-byte rows, false-positive rate %.3f%%", rowBytes, 100*rate)
	}
	// Another consumer's same id is another key.
	if newFilterKey("orders", "x") == newFilterKey("refunds", "x") {
		t.Fatal("consumers share filter keys")
	}
}
