package processed

// BatchSQL exposes ClaimBatch's statements to the plan test.
func (s *Store) BatchSQL() (insert, existing string) { return s.batchSQL() }
