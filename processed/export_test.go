package processed

import "context"

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
