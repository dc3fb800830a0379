package kafka

// DeadLetterPublisher reports whether s has made its dead-letter Publisher,
// whether that Publisher writes on s's own transport, and whether it is
// closed.
func DeadLetterPublisher(s *Source) (made, sharesTransport, closed bool) {
	s.dlMu.Lock()
	pub := s.dlPub
	s.dlMu.Unlock()
	if pub == nil {
		return false, false, false
	}
	pub.mu.RLock()
	defer pub.mu.RUnlock()
	return true, pub.transport == s.transport && !pub.owned, pub.closed
}
