package processed

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sort"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemq/idemq/consumer"
)

// The sealed partitions' filters, held in memory.
//
// A sealed partition takes no new row, and its filter rows are written once,
// in the transaction that records its seal, and deleted only with it. So a
// copy of them read after the seal stays exact for as long as the seal
// stands, and a claim can test an id against the copy instead of reading the
// filter's rows: a new id then costs what it costs on a plain table, the
// insert into the current partition (and the lock), with no probe of the
// filter's index, whose pages, at a hundred million ids, mostly miss
// Postgres's cache.
//
// CacheFilters (run by Maintain, so by the runtime's janitor, at its start
// and every JanitorInterval) reads the filters of the sealed partitions it
// does not hold yet, if all of them fit Config.FilterCacheBytes. The fast
// claim statements (see fast) are built from the sealed partitions at one
// time: if the cache holds the filter of every one of them, identified by
// name and seal time, the statements do not read the filter table, and the
// claim tests the id against the cached filters instead; an id that some
// of them may hold (a duplicate, or a false positive) is looked up in those
// partitions only, by name (see fastClaims.variant). A partition
// sealed after the statements were built is probed by name, as before. If
// the cache does not cover every sealed partition (one sealed since the last
// CacheFilters, or more than the budget), the statements read the filter
// table, as without a cache.

// DefaultFilterCacheBytes is Config.FilterCacheBytes's default: the filters
// of about 100 million sealed ids.
const DefaultFilterCacheBytes = 256 << 20

// sealInfo is a sealed partition's row in Table+"_sealed": when it was
// sealed (which, with its name, identifies the seal) and how many ids its
// filter holds.
type sealInfo struct {
	at  time.Time
	ids int64
}

// filterRowBytes is the size of a filter row of a partition of ids ids, as
// seal makes it.
func filterRowBytes(ids int64) int {
	return min(maxFilterBytes, max(minFilterBytes, int((ids*filterBitsPerID/filterBuckets+7)/8)))
}

// sealedFilter is one sealed partition's filter, as its rows are in the
// filter table.
type sealedFilter struct {
	partition string
	seal      sealInfo
	rowBytes  int
	// buckets lists the buckets that have a row, ascending, and bits holds
	// their rows in that order, rowBytes each; buckets is nil when every
	// bucket has one (the rows are then at bucket*rowBytes).
	buckets []int32
	bits    []byte
}

// size is the memory f holds.
func (f *sealedFilter) size() int64 { return int64(len(f.bits) + 4*len(f.buckets)) }

// row returns bucket b's row; nil if it has none (no id there).
func (f *sealedFilter) row(b int32) []byte {
	i := int(b)
	if f.buckets != nil {
		i = sort.Search(len(f.buckets), func(j int) bool { return f.buckets[j] >= b })
		if i == len(f.buckets) || f.buckets[i] != b {
			return nil
		}
	}
	return f.bits[i*f.rowBytes : (i+1)*f.rowBytes]
}

// mayHave reports whether the id of key k may be in the partition: false
// means it is not (a Bloom filter has no false negatives). It tests the
// bits the SQL of filterMatch tests.
func (f *sealedFilter) mayHave(k filterKey) bool {
	r := f.row(k.bucket)
	if r == nil {
		return false
	}
	nbits := int64(len(r)) * 8
	for j := int64(0); j < filterHashes; j++ {
		b := (k.h1 + j*k.h2 + cubic(j)) % nbits
		if r[b/8]&(1<<(b%8)) == 0 {
			return false
		}
	}
	return true
}

// filterSet is the cache's content: the filters it holds, by partition.
// It is never changed once stored; CacheFilters stores a new one.
type filterSet struct {
	byName map[string]*sealedFilter
	bytes  int64
}

// cover returns the cached filters of the sealed partitions, or nil if the
// cache lacks one of them (or holds an older seal of its name).
func (fs *filterSet) cover(sealed map[string]sealInfo) []*sealedFilter {
	if fs == nil || len(sealed) == 0 {
		return nil
	}
	out := make([]*sealedFilter, 0, len(sealed))
	for name, si := range sealed {
		f := fs.byName[name]
		if f == nil || !f.seal.at.Equal(si.at) {
			return nil
		}
		out = append(out, f)
	}
	// Oldest first, only for a stable order.
	sort.Slice(out, func(i, j int) bool { return out[i].seal.at.Before(out[j].seal.at) })
	return out
}

// cachedFilters are the filters a fast claim tests ids against.
type cachedFilters []*sealedFilter

// matching returns the filters that may hold the id of c; nil if none does.
func (cf cachedFilters) matching(c consumer.Claim) []*sealedFilter {
	k := newFilterKey(c.Consumer, c.MessageID)
	var out []*sealedFilter
	for _, f := range cf {
		if f.mayHave(k) {
			out = append(out, f)
		}
	}
	return out
}

// split splits claims into those whose ids no filter holds (none) and
// those one may hold (maybe), and returns the filters that may hold one of
// the latter.
func (cf cachedFilters) split(claims []consumer.Claim) (none, maybe []consumer.Claim, matched []*sealedFilter) {
	none = make([]consumer.Claim, 0, len(claims))
	for _, c := range claims {
		m := cf.matching(c)
		if m == nil {
			none = append(none, c)
			continue
		}
		maybe = append(maybe, c)
		for _, f := range m {
			if !slices.Contains(matched, f) {
				matched = append(matched, f)
			}
		}
	}
	return none, maybe, matched
}

// CacheFilters reads into memory the filters of the sealed partitions of a
// partitioned table that the store does not hold yet, and forgets those of
// partitions no longer sealed (dropped by a purge); it returns how many it
// read. It reads nothing if the filters of all the sealed partitions would
// take more than Config.FilterCacheBytes (the claims then read the filter
// table, as they do before the first call), or if the cache is off. Claims
// test new ids against the cached filters once the cache holds the filter
// of every sealed partition: see the comment of filtercache.go. Maintain,
// and so the runtime's janitor, calls it after sealing; reading a partition
// of ten million ids reads about 25 MB. It does nothing on a plain table.
func (s *Store) CacheFilters(ctx context.Context) (int, error) {
	if s.cfg.FilterCacheBytes < 0 {
		return 0, nil
	}
	st, partitioned, err := s.partitionedStatements(ctx)
	if err != nil || !partitioned {
		return 0, err
	}
	s.cacheMu.Lock()
	defer s.cacheMu.Unlock()
	_, _, sealed, err := s.partitionState(ctx, s.db, st, "cache filters", true)
	if err != nil {
		return 0, err
	}
	old := s.filters.Load()
	next := &filterSet{byName: make(map[string]*sealedFilter, len(sealed))}
	var need int64
	for name, si := range sealed {
		if f := old.get(name); f != nil && f.seal.at.Equal(si.at) {
			next.byName[name] = f
			next.bytes += f.size()
			continue
		}
		// At most one row per id, of filterRowBytes, and its bucket.
		rows := min(si.ids, filterBuckets)
		need += rows * int64(filterRowBytes(si.ids)+4)
	}
	if next.bytes+need > s.cfg.FilterCacheBytes {
		// Over the budget: no cache, and the memory is let go.
		if old != nil {
			s.filters.Store(nil)
			s.forgetFast()
		}
		return 0, nil
	}
	names := make([]string, 0, len(sealed))
	for name := range sealed {
		if next.byName[name] == nil {
			names = append(names, name)
		}
	}
	sort.Strings(names)
	for _, name := range names {
		f, err := s.readFilter(ctx, st, name, sealed[name])
		if err != nil {
			return 0, s.wrap("cache filter of "+name, err)
		}
		if f != nil {
			next.byName[name] = f
			next.bytes += f.size()
		}
	}
	if len(names) > 0 || (old != nil && len(old.byName) != len(next.byName)) {
		s.filters.Store(next)
		s.forgetFast()
	}
	return len(names), nil
}

// isSealed reports whether the named partition is sealed.
func isSealed(sealed map[string]sealInfo, name string) bool {
	_, ok := sealed[name]
	return ok
}

// get returns the filter of the named partition, nil if fs has none.
func (fs *filterSet) get(name string) *sealedFilter {
	if fs == nil {
		return nil
	}
	return fs.byName[name]
}

// readFilter reads the filter rows of the partition sealed as si, in one
// snapshot with its row of the sealed table; nil if that seal is gone
// (dropped, or sealed again since).
func (s *Store) readFilter(ctx context.Context, st *statements, name string, si sealInfo) (*sealedFilter, error) {
	var tx pgx.Tx
	var err error
	if b, ok := s.db.(beginTxer); ok {
		tx, err = b.BeginTx(ctx, pgx.TxOptions{IsoLevel: pgx.RepeatableRead, AccessMode: pgx.ReadOnly})
	} else {
		tx, err = s.db.Begin(ctx)
		if err == nil {
			_, err = tx.Exec(ctx, "SET TRANSACTION ISOLATION LEVEL REPEATABLE READ READ ONLY")
		}
	}
	if err != nil {
		if tx != nil {
			_ = tx.Rollback(ctx)
		}
		return nil, err
	}
	defer func() { _ = tx.Rollback(ctx) }()
	var at time.Time
	err = tx.QueryRow(ctx, `SELECT sealed_at FROM `+st.qSealed+` WHERE partition = $1`, name).Scan(&at)
	if errors.Is(err, pgx.ErrNoRows) || (err == nil && !at.Equal(si.at)) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	rows, err := tx.Query(ctx, `SELECT bucket, bits FROM `+st.qFilter+` WHERE partition = $1 ORDER BY bucket`, name)
	if err != nil {
		return nil, err
	}
	f := &sealedFilter{partition: name, seal: si, rowBytes: -1}
	var (
		bucket int32
		bits   []byte
	)
	_, err = pgx.ForEachRow(rows, []any{&bucket, &bits}, func() error {
		if f.rowBytes < 0 {
			f.rowBytes = len(bits)
			f.bits = make([]byte, 0, filterBuckets*len(bits))
		}
		if len(bits) != f.rowBytes || len(bits) == 0 || bucket < 0 || bucket >= filterBuckets {
			return fmt.Errorf("filter row of bucket %d: %d bytes, want %d; bucket in [0, %d)", bucket, len(bits), f.rowBytes, filterBuckets)
		}
		f.buckets = append(f.buckets, bucket)
		f.bits = append(f.bits, bits...)
		return nil
	})
	if err != nil {
		return nil, err
	}
	switch {
	case f.rowBytes < 0: // no id: no row
		f.rowBytes, f.buckets = 0, []int32{}
	case len(f.buckets) == filterBuckets:
		f.buckets = nil // every bucket, in order: indexed by bucket
	default:
		f.bits = append([]byte(nil), f.bits...) // let the unused capacity go
	}
	return f, nil
}
