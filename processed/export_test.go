package processed

import (
	"context"

	"github.com/idemq/idemq/internal/pgmigrate"
)

// ClaimSQL exposes the claim's statements to the plan test, by name.
func (s *Store) ClaimSQL(ctx context.Context) (map[string]string, error) {
	st, err := s.statements(ctx)
	if err != nil {
		return nil, err
	}
	return map[string]string{"insert": st.insert, "existing": st.existing,
		"insertOne": st.insertOne, "existingOne": st.existingOne}, nil
}

// ErrPostponed exposes the error of a postponed rotation to the tests that
// run the upkeep beside claims, where the lock timeout may be hit.
var ErrPostponed = errPostponed

// DefaultMaxConns is the size of the pool Open makes by default.
const DefaultMaxConns = defaultMaxConns

// LatestVersion is the version Migrate brings the main line to.
func LatestVersion() int { return migrations.Latest() }

// Applied returns the rows of the main line's migrations-tracking table.
func (s *Store) Applied(ctx context.Context) ([]pgmigrate.Applied, error) {
	t, err := s.target(ctx, "")
	if err != nil {
		return nil, err
	}
	return migrations.AppliedTo(ctx, s.db, t)
}
