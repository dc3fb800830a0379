package httpidem

// SetAfterClaim installs a hook run after a claim commits; an error ends the
// request there, leaving the claim behind as a crash would.
func SetAfterClaim(m *Middleware, f func() error) { m.afterClaim = f }

// RetryAfter is retryAfter, for tests.
var RetryAfter = retryAfter
