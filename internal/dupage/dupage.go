// Package dupage is the duplicate-age histogram the runtime's janitor
// keeps and the dedup store records: the ages of the duplicates seen, in
// fixed buckets, so that `idemq status` can weigh the retention against
// them. It is shared by consumer and processed, and by no user.
package dupage

import "time"

// Bounds are the upper bounds of the histogram's buckets; one more bucket
// counts the ages beyond the last.
var Bounds = []time.Duration{
	time.Second, 10 * time.Second, time.Minute, 5 * time.Minute, 15 * time.Minute, 30 * time.Minute,
	time.Hour, 2 * time.Hour, 4 * time.Hour, 8 * time.Hour, 12 * time.Hour, 24 * time.Hour,
	48 * time.Hour, 72 * time.Hour, 7 * 24 * time.Hour, 14 * 24 * time.Hour, 30 * 24 * time.Hour,
}

// Buckets is the number of buckets: len(Bounds)+1.
const Buckets = 17 + 1

// Bucket returns the index of the bucket counting age.
func Bucket(age time.Duration) int {
	i := 0
	for i < len(Bounds) && age > Bounds[i] {
		i++
	}
	return i
}

// Quantile returns the upper bound of the bucket holding quantile q
// (0 < q <= 1) of the ages counted in buckets (see Bounds), at most maxAge
// when it is known; 0 if buckets are empty. An age beyond the last bound is
// reported as maxAge.
func Quantile(buckets []int64, q float64, maxAge time.Duration) time.Duration {
	var total int64
	for _, n := range buckets {
		total += n
	}
	if total == 0 {
		return 0
	}
	rank := int64(q*float64(total) + 0.999999)
	rank = max(1, min(rank, total))
	var seen int64
	for i, n := range buckets {
		seen += n
		if seen >= rank {
			if i < len(Bounds) && (maxAge == 0 || Bounds[i] < maxAge) {
				return Bounds[i]
			}
			return maxAge
		}
	}
	return maxAge
}
