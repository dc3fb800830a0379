package processed

import "context"

// ClaimSQL exposes the claim's statements to the plan test.
func (s *Store) ClaimSQL(ctx context.Context) (insert, existing string, err error) {
	st, err := s.statements(ctx)
	if err != nil {
		return "", "", err
	}
	return st.insert, st.existing, nil
}
