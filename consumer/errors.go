package consumer

import (
	"errors"
	"fmt"
	"strings"

	"github.com/jackc/pgx/v5/pgconn"
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
	// ErrInvalidConfig is wrapped by every configuration validation error,
	// and by the error of StatementCacheError, on which Run stops.
	ErrInvalidConfig = errors.New("idemq: invalid config")
	// ErrNotMigrated is wrapped by the errors of idemq's Postgres
	// components (processed, outbox, httpidem) caused by a table that does
	// not exist, each with the operation and the table. The runtime does
	// not retry it: Run returns it, since no message can be applied until
	// the migrations have run.
	ErrNotMigrated = errors.New("idemq: table does not exist (run migrations)")
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
	return &permanentError{Err: err}
}

// permanentError is the error made by [Permanent]; IsPermanent reports it.
type permanentError struct{ Err error }

func (e *permanentError) Error() string { return "permanent: " + e.Err.Error() }

// Unwrap returns the wrapped error.
func (e *permanentError) Unwrap() error { return e.Err }

// Is reports whether target is a *permanentError, so that
// errors.Is(err, &permanentError{}) matches any permanent error.
func (e *permanentError) Is(target error) bool {
	_, ok := target.(*permanentError)
	return ok
}

// IsPermanent reports whether err, or any error it wraps, was made by
// [Permanent].
func IsPermanent(err error) bool {
	var p *permanentError
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

// StatementCacheError returns the configuration error that err means if it
// is the database refusing one of pgx's cached prepared statements, and
// nil otherwise.
//
// In its default query exec mode (cache_statement) pgx prepares each
// statement once per connection, under a name that starts with
// "stmtcache_", and runs it by that name from then on. A proxy that pools
// server connections per transaction (PgBouncer with pool_mode =
// transaction, unless it tracks prepared statements itself, which
// PgBouncer can from 1.21 on with max_prepared_statements) hands the next
// transaction of the same client connection to another server connection,
// which either lacks the statement ("prepared statement "stmtcache_…" does
// not exist", SQLSTATE 26000) or already has it from another client ("…
// already exists", 42P05). Retrying does not fix it and the message is not
// at fault: the
// runtime stops on this error (Run returns it, after requeueing what it
// holds, and dead-letters nothing for it), whether it came from a claim,
// a handler's statement (even one whose error the handler replaced or
// ignored) or the janitor. The fix is in the database URL:
// default_query_exec_mode=exec (or simple_protocol), or session pooling.
//
// The error is a *ConfigError (for the field Store, so it wraps
// ErrInvalidConfig) and wraps err. err may already be one: it is then
// returned as it is. Package processed returns its database errors so.
func StatementCacheError(err error) error {
	var done *statementCacheError
	switch {
	case err == nil:
		return nil
	case errors.As(err, &done):
		return err
	case !isStatementCacheErr(err):
		return nil
	}
	return &statementCacheError{cfg: &ConfigError{Field: "Store", Reason: statementCacheReason}, err: err}
}

const statementCacheReason = "its database connections lose pgx's cached prepared statements (stmtcache_…) between transactions: " +
	"they go through a proxy that pools connections per transaction, such as PgBouncer in pool_mode=transaction, " +
	"while pgx runs in its default query exec mode, cache_statement. " +
	"Add default_query_exec_mode=exec (or default_query_exec_mode=simple_protocol) to the database URL " +
	"(or set the pool's ConnConfig.DefaultQueryExecMode), or pool per session"

// statementCacheError is the error StatementCacheError makes: the
// configuration error, and the database's.
type statementCacheError struct {
	cfg *ConfigError
	err error
}

func (e *statementCacheError) Error() string { return e.cfg.Error() + ": " + e.err.Error() }

// Unwrap returns the *ConfigError and the database's error.
func (e *statementCacheError) Unwrap() []error { return []error{e.cfg, e.err} }

// isStatementCacheErr reports whether err is the server refusing a pgx
// cached statement: SQLSTATE 26000 (invalid_sql_statement_name) or 42P05
// (duplicate_prepared_statement) about a statement named stmtcache_…, as a
// *pgconn.PgError or, from a handler that kept only its text, as that text.
func isStatementCacheErr(err error) bool {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && (pgErr.Code == "26000" || pgErr.Code == "42P05") && strings.Contains(pgErr.Message, "stmtcache_") {
		return true
	}
	s := err.Error()
	return strings.Contains(s, "stmtcache_") && (strings.Contains(s, "(SQLSTATE 26000)") || strings.Contains(s, "(SQLSTATE 42P05)"))
}
