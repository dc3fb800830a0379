package consumer

import (
	"context"
	"time"
)

// Hook receives the runtime's events, for metrics and tracing. A hook is a
// type that embeds HookDefaults, which makes it a Hook, and implements any of
// the Hook* interfaces below; the runtime detects each once, at New, and
// calls only the events the hook implements. Config.Hooks takes Hooks, so a
// value that is not one is refused by the compiler, and New refuses a hook
// that implements no event. Hooks are called synchronously on the message's
// goroutine and must be fast and safe for concurrent use; a panic in a hook
// is recovered and logged, and does not change what happens to the message.
type Hook interface {
	// IsHook marks the type as a hook. Embed HookDefaults to implement it.
	IsHook() bool
}

// HookDefaults, embedded in a struct, makes it a Hook.
type HookDefaults struct{}

// IsHook returns true.
func (HookDefaults) IsHook() bool { return true }

// HookReceived is called when a delivery is received.
type HookReceived interface {
	Hook
	OnReceived(ctx context.Context, msg *Message)
}

// HookApplied is called after the transaction holding a new message's
// effect committed. handler is the handler's duration, commit the commit's.
// In batch mode commit is the batch's commit, and with a BatchHandler
// handler is the batch handler's call.
type HookApplied interface {
	Hook
	OnApplied(ctx context.Context, msg *Message, handler, commit time.Duration)
}

// HookCommit is called after each COMMIT the runtime sends, once per
// transaction: in batch mode once per group, where HookApplied is called
// for each message the group applied. applied counts the new messages the
// transaction held; dur is how long the COMMIT took to answer or fail (the
// runtime never cancels one; see Config.SlowCommit). err is nil when it
// committed; otherwise the transaction rolled back or, when the
// connection was lost, its outcome is unknown: either way nothing is
// acked on it.
type HookCommit interface {
	Hook
	OnCommit(ctx context.Context, applied int, dur time.Duration, err error)
}

// HookDuplicate is called when a message is skipped as already applied.
// processedAt is when the original was committed: now minus it is the
// duplicate's age, a guide to the retention window.
type HookDuplicate interface {
	Hook
	OnDuplicate(ctx context.Context, msg *Message, processedAt time.Time)
}

// HookRetry is called before a failed handler attempt is retried.
type HookRetry interface {
	Hook
	OnRetry(ctx context.Context, msg *Message, attempt int, err error, delay time.Duration)
}

// HookDeadLettered is called after a message's dead-letter copy was accepted.
type HookDeadLettered interface {
	Hook
	OnDeadLettered(ctx context.Context, msg *Message, f Failure)
}

// HookAckFailed is called when an ack fails after a successful commit. The
// broker will redeliver and dedup absorbs it.
type HookAckFailed interface {
	Hook
	OnAckFailed(ctx context.Context, msg *Message, err error)
}

type hooks struct {
	received     []HookReceived
	applied      []HookApplied
	commit       []HookCommit
	duplicate    []HookDuplicate
	retry        []HookRetry
	deadLettered []HookDeadLettered
	ackFailed    []HookAckFailed
	batch        []HookBatch
}

func newHooks(hs []Hook) hooks {
	var h hooks
	for _, x := range hs {
		if v, ok := x.(HookReceived); ok {
			h.received = append(h.received, v)
		}
		if v, ok := x.(HookApplied); ok {
			h.applied = append(h.applied, v)
		}
		if v, ok := x.(HookCommit); ok {
			h.commit = append(h.commit, v)
		}
		if v, ok := x.(HookDuplicate); ok {
			h.duplicate = append(h.duplicate, v)
		}
		if v, ok := x.(HookRetry); ok {
			h.retry = append(h.retry, v)
		}
		if v, ok := x.(HookDeadLettered); ok {
			h.deadLettered = append(h.deadLettered, v)
		}
		if v, ok := x.(HookAckFailed); ok {
			h.ackFailed = append(h.ackFailed, v)
		}
		if v, ok := x.(HookBatch); ok {
			h.batch = append(h.batch, v)
		}
	}
	return h
}

// recognised reports whether x implements at least one hook interface.
func recognised(x Hook) bool {
	h := newHooks([]Hook{x})
	return len(h.received)+len(h.applied)+len(h.commit)+len(h.duplicate)+len(h.retry)+len(h.deadLettered)+len(h.ackFailed)+len(h.batch) > 0
}
