package outbox

import (
	"context"
	"time"
)

// SetAfterPublish installs a hook run after each successful Publish and
// before the rows are marked sent; an error aborts the batch like a crash.
func SetAfterPublish(r *Relay, f func(ctx context.Context) error) { r.afterPublish = f }

// Delay exposes BackoffConfig.delay after defaults.
func Delay(b BackoffConfig, attempts int) (BackoffConfig, int64) {
	b = RelayConfig{Backoff: b}.withDefaults().Backoff
	return b, int64(b.delay(attempts))
}

// RelayLease returns the relay's Lease after defaults.
func RelayLease(r *Relay) time.Duration { return r.cfg.Lease }

// MessageErrors exposes messageErrors.
func MessageErrors(err error, n int) (map[int]error, bool) { return messageErrors(err, n) }
