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
