package processed

import "context"

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
