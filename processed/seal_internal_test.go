package processed

import (
	"fmt"
	"testing"
)

// TestFilterRates builds a sealed partition's filter of a million ids as
// seal does and checks it: every member is found, and the false-positive
// rate for other ids is near the design's 0.009% (0.027% measured at this size).
func TestFilterRates(t *testing.T) {
	const n, probes = 1_000_000, 200_000
	rowBytes := filterRowBytes(n)
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
	if rate := float64(hits) / probes; rate > 0.001 {
		t.Fatalf("false-positive rate %.3f%%, want under 0.1%%", 100*rate)
	} else {
		t.Logf("%d-byte rows, false-positive rate %.3f%%", rowBytes, 100*rate)
	}
	// Another consumer's same id is another key.
	if newFilterKey("orders", "x") == newFilterKey("refunds", "x") {
		t.Fatal("consumers share filter keys")
	}
}

// TestSealedFilterLayouts: a cached filter finds every id seal put in it,
// whatever its row size (a row's bit count is its length, so partitions
// sealed with other sizes stay readable) and whether every bucket has a row
// (dense) or only some (sparse, found by binary search).
func TestSealedFilterLayouts(t *testing.T) {
	for _, tc := range []struct {
		ids      int
		rowBytes int
	}{{50, 16}, {20_000, 16}, {200_000, 77}, {1_000_000, 77}, {200_000, 534}, {20_000, 2600}} {
		bits := make([]byte, filterBuckets*tc.rowBytes)
		nbits := int64(tc.rowBytes * 8)
		var pos []int64
		for g := 0; g < tc.ids; g++ {
			k := newFilterKey("c", fmt.Sprintf("id-%d", g))
			row := bits[int(k.bucket)*tc.rowBytes : int(k.bucket+1)*tc.rowBytes]
			for _, b := range k.positions(nbits, pos) {
				row[b/8] |= 1 << (b % 8)
			}
		}
		// As readFilter stores them: the rows with a bit set, in order.
		f := &sealedFilter{rowBytes: tc.rowBytes}
		for b := int32(0); b < filterBuckets; b++ {
			row := bits[int(b)*tc.rowBytes : int(b+1)*tc.rowBytes]
			if !allZero(row) {
				f.buckets = append(f.buckets, b)
				f.bits = append(f.bits, row...)
			}
		}
		dense := len(f.buckets) == filterBuckets
		if dense {
			f.buckets = nil
		}
		for g := 0; g < tc.ids; g++ {
			if !f.mayHave(newFilterKey("c", fmt.Sprintf("id-%d", g))) {
				t.Fatalf("%d ids, %d-byte rows (dense %v): member id-%d not found", tc.ids, tc.rowBytes, dense, g)
			}
		}
		hits := 0
		for g := 0; g < 20_000; g++ {
			if f.mayHave(newFilterKey("c", fmt.Sprintf("other-%d", g))) {
				hits++
			}
		}
		if hits > 200 {
			t.Fatalf("%d ids, %d-byte rows: %d of 20000 other ids match", tc.ids, tc.rowBytes, hits)
		}
		t.Logf("%d ids, %d-byte rows, dense %v: %d of 20000 other ids match", tc.ids, tc.rowBytes, dense, hits)
	}
}

func allZero(b []byte) bool {
	for _, x := range b {
		if x != 0 {
			return false
		}
	}
	return true
}
