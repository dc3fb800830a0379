package kafka

// DeadLetterPublisher reports whether s's dead-letter Publisher writes on
// s's own transport, and whether it is closed.
func DeadLetterPublisher(s *Source) (sharesTransport, closed bool) {
	pub := s.dlPub
	pub.mu.RLock()
	defer pub.mu.RUnlock()
	return pub.transport == s.transport && !pub.owned, pub.closed
}

// TooLarge is tooLarge, for its unit test.
var TooLarge = tooLarge

// DefaultMaxInFlight is Config.MaxInFlight's default.
const DefaultMaxInFlight = defaultMaxInFlight
