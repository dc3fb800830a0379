package natsjs

// KillConn closes s's connection as a crash would: no nak, no flush.
func KillConn(s *Source) { s.nc.Close() }

// Defaults the tests check.
const (
	DefaultWindow  = defaultWindow
	DefaultAckWait = defaultAckWait
)
