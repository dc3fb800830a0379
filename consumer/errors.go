package consumer

import (
	"errors"
	"fmt"
)

// Sentinel errors. Compare with errors.Is.
var (
	// ErrSourceClosed is returned (wrapped) by Source.Receive and by
	// Delivery.Ack/Nack once the source is closed. Adapters translate
	// their broker's own closed errors into it.
	ErrSourceClosed = errors.New("idemq: source closed")
	// ErrDeliveryStale is returned by Ack or Nack on a delivery whose
	// channel or session is gone, or which was already settled. The
	// broker will redeliver the message (if it was not settled) and dedup
	// absorbs it.
	ErrDeliveryStale = errors.New("idemq: delivery no longer ackable")
	// ErrShutdown is the cause of handler contexts cancelled because the
	// shutdown timeout ran out.
	ErrShutdown = errors.New("idemq: runtime shutdown timeout exceeded")
	// ErrInvalidConfig is wrapped by every configuration validation error.
	ErrInvalidConfig = errors.New("idemq: invalid config")
	// ErrNotMigrated is wrapped by store errors caused by a dedup table that
	// does not exist. The runtime does not retry it: Run returns it, since
	// no message can be applied until the migrations have run.
	// processed.ErrNotMigrated wraps it.
	ErrNotMigrated = errors.New("idemq: dedup table does not exist (run migrations)")
	// ErrMessageTooLarge is wrapped by a publish that the broker, or its
	// client, refused for the message's size (body and headers, as the
	// broker counts them): publishing it again as it is fails again. The
	// broker adapters translate their own errors into it; a dlq
	// DeadLetterer then publishes the dead letter truncated.
	ErrMessageTooLarge = errors.New("idemq: message too large for the broker")
)

// Permanent wraps err so that the runtime does not retry it: the message is
// dead-lettered at once with [ClassPermanent]. Use it for input that can
// never succeed, such as a payment for an unknown account.
// Permanent(nil) returns nil.
func Permanent(err error) error {
	if err == nil {
		return nil
	}
	return &PermanentError{Err: err}
}

// PermanentError is the error made by [Permanent].
type PermanentError struct{ Err error }

func (e *PermanentError) Error() string { return "permanent: " + e.Err.Error() }

// Unwrap returns the wrapped error.
func (e *PermanentError) Unwrap() error { return e.Err }

// Is reports whether target is a *PermanentError, so that
// errors.Is(err, &PermanentError{}) matches any permanent error.
func (e *PermanentError) Is(target error) bool {
	_, ok := target.(*PermanentError)
	return ok
}

// IsPermanent reports whether err, or any error it wraps, was made by
// [Permanent].
func IsPermanent(err error) bool {
	var p *PermanentError
	return errors.As(err, &p)
}

// PanicError is the error a recovered handler panic becomes.
type PanicError struct {
	// Value is what the handler panicked with.
	Value any
	// Stack is the goroutine stack at the panic.
	Stack []byte
}

func (e *PanicError) Error() string { return fmt.Sprintf("handler panic: %v", e.Value) }

// ConfigError describes one invalid configuration field. It wraps
// [ErrInvalidConfig].
type ConfigError struct {
	Field  string
	Reason string
}

func (e *ConfigError) Error() string {
	return fmt.Sprintf("idemq: invalid config: %s: %s", e.Field, e.Reason)
}

// Unwrap returns ErrInvalidConfig.
func (e *ConfigError) Unwrap() error { return ErrInvalidConfig }
