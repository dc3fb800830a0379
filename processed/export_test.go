package processed

import (
	"context"
	"sort"
	"time"
)

// BatchSQL exposes ClaimBatch's statements to the plan test.
func (s *Store) BatchSQL() (insert, existing string) {
	st, err := s.statements(context.Background())
	if err != nil {
		panic(err)
	}
	return st.batchInsert, st.batchExisting
}

// FastInsertSQL exposes the fast claim statement, built afresh, to the
// test of its text's stability.
func (s *Store) FastInsertSQL(ctx context.Context) (string, error) {
	st, err := s.statements(ctx)
	if err != nil {
		return "", err
	}
	s.forgetFast()
	f, err := s.fast(ctx, s.db, st)
	if err != nil || f == nil {
		return "", err
	}
	return f.insert, nil
}

// Floor returns the DEFAULT partition's floor (nil if it has none) and the
// upper bound of the newest range partition.
func (s *Store) Floor(ctx context.Context) (floor *time.Time, newest time.Time, err error) {
	st, err := s.statements(ctx)
	if err != nil {
		return nil, newest, err
	}
	parts, err := s.partitions(ctx, s.db, st)
	if err != nil {
		return nil, newest, err
	}
	for _, p := range parts {
		if p.upper != nil && p.upper.After(newest) {
			newest = *p.upper
		}
	}
	floor, err = readFloor(ctx, s.db, st, s.cfg.Table+floorSuffix)
	return floor, newest, err
}

// CachedFilters returns the partitions whose filters the store holds,
// sorted.
func (s *Store) CachedFilters() []string {
	fs := s.filters.Load()
	if fs == nil {
		return nil
	}
	var names []string
	for name := range fs.byName {
		names = append(names, name)
	}
	sort.Strings(names)
	return names
}
