package httpidem

import (
	"fmt"
	"log/slog"
	"net/http"
	"time"

	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/internal/pgmigrate"
)

// Mode says what happens to a request without an idempotency key.
type Mode int

const (
	// Strict rejects a request without a key with 400 Bad Request.
	Strict Mode = iota
	// Lax passes it through: the handler runs once per request, still in
	// a transaction it gets from Tx, but nothing is stored.
	Lax
)

// The defaults of Config's fields, which their doc comments state.
const (
	defaultTable            = "idempotency_keys"
	defaultHeader           = "Idempotency-Key"
	defaultLockTimeout      = time.Minute
	defaultMaxBodyBytes     = 1 << 20
	defaultMaxResponseBytes = 1 << 20
	defaultPurgeBatchSize   = 1000
)

// MaxKeyLen is the longest idempotency key accepted, in bytes; a longer one
// gets 400 Bad Request.
const MaxKeyLen = 255

// ReplayedHeader is set to "true" on a response replayed from the store.
const ReplayedHeader = "Idempotent-Replayed"

// Config configures a Middleware. The zero value of every optional field
// selects a documented default.
type Config struct {
	// Schema holds the table, a plain identifier (letters, digits and
	// underscores, not starting with a digit, at most 48 bytes). Migrate
	// creates it if it is missing. Defaults to the connection's
	// current_schema(): the first schema of its search_path that exists,
	// so a search_path set in the URL or on the role is honoured, learned
	// on first use.
	Schema string
	// Table is the table's name, with the same rules as Schema;
	// Table+"_migrations" tracks migrations. Defaults to
	// "idempotency_keys".
	Table string

	// Mode says what to do with a request that has no key. Defaults to
	// Strict.
	Mode Mode
	// Header is the request header carrying the key. Defaults to
	// "Idempotency-Key".
	Header string
	// Scope returns the key's scope, such as the tenant or the API
	// client, from an authenticated request: the same key in two scopes
	// names two operations. Defaults to one scope, "", for everyone; set
	// it whenever clients are not trusted to pick unique keys.
	Scope func(*http.Request) string
	// Methods are the methods the middleware covers; other requests pass
	// straight through, with no transaction. Defaults to POST, PUT, PATCH
	// and DELETE.
	Methods []string

	// IgnoreFields are JSON fields dropped from the body before it is
	// fingerprinted, such as a client timestamp that changes on every
	// retry. A name is a top-level field ("sent_at") or a dotted path into
	// nested objects ("meta.request_time"). Defaults to none.
	IgnoreFields []string
	// Canonicalize, if set, replaces the default canonicalization of the
	// body (see [CanonicalJSON]) before fingerprinting.
	Canonicalize func(r *http.Request, body []byte) ([]byte, error)

	// LockTimeout is how long a claim stays locked without its request
	// finishing. A request that crashed mid-way leaves its claim behind;
	// after LockTimeout a retry with the same fingerprint takes it over.
	// A request still running holds a row lock on its claim, so it is
	// never taken over, however long it runs. It also bounds the
	// Retry-After of a 409: a duplicate is told to wait as long as the
	// request in progress has run so far, at least 1s and at most the time
	// left on its lock. Defaults to 1m.
	LockTimeout time.Duration
	// ReplayHeaders are the response headers stored and replayed with the
	// status and body. Defaults to Content-Type and Location.
	ReplayHeaders []string
	// Cacheable reports whether a response with status is stored (and its
	// transaction committed). Otherwise the transaction rolls back and the
	// claim is released so the client can retry. Defaults to status < 500.
	Cacheable func(status int) bool
	// MaxBodyBytes is the largest request body accepted; larger requests
	// get 413. Defaults to 1 MiB.
	MaxBodyBytes int64
	// MaxResponseBytes is the largest response body stored; a larger
	// response rolls back and becomes a 500. Defaults to 1 MiB.
	MaxResponseBytes int
	// PurgeBatchSize is the number of rows Purge deletes per statement.
	// Defaults to 1000.
	PurgeBatchSize int
	// Logger receives the middleware's logs. Defaults to a logger that
	// discards everything.
	Logger *slog.Logger
}

func (c Config) withDefaults() Config {
	if c.Table == "" {
		c.Table = defaultTable
	}
	if c.Header == "" {
		c.Header = defaultHeader
	}
	if c.Scope == nil {
		c.Scope = func(*http.Request) string { return "" }
	}
	if c.Methods == nil {
		c.Methods = []string{http.MethodPost, http.MethodPut, http.MethodPatch, http.MethodDelete}
	}
	if c.LockTimeout == 0 {
		c.LockTimeout = defaultLockTimeout
	}
	if c.ReplayHeaders == nil {
		c.ReplayHeaders = []string{"Content-Type", "Location"}
	}
	if c.Cacheable == nil {
		c.Cacheable = func(status int) bool { return status < 500 }
	}
	if c.MaxBodyBytes == 0 {
		c.MaxBodyBytes = defaultMaxBodyBytes
	}
	if c.MaxResponseBytes == 0 {
		c.MaxResponseBytes = defaultMaxResponseBytes
	}
	if c.PurgeBatchSize == 0 {
		c.PurgeBatchSize = defaultPurgeBatchSize
	}
	if c.Logger == nil {
		c.Logger = slog.New(slog.DiscardHandler)
	}
	return c
}

func (c Config) validate() error {
	if c.Schema != "" {
		if err := pgmigrate.ValidIdent("Schema", c.Schema); err != nil {
			return err
		}
	}
	if err := pgmigrate.ValidIdent("Table", c.Table); err != nil {
		return err
	}
	switch {
	case c.Mode != Strict && c.Mode != Lax:
		return configError("Mode", "%d is neither Strict nor Lax", c.Mode)
	case c.LockTimeout < time.Millisecond:
		return configError("LockTimeout", "%s, must be at least 1ms", c.LockTimeout)
	case c.MaxBodyBytes < 0:
		return configError("MaxBodyBytes", "negative")
	case c.MaxResponseBytes < 0:
		return configError("MaxResponseBytes", "negative")
	case c.PurgeBatchSize < 1:
		return configError("PurgeBatchSize", "%d, must be positive", c.PurgeBatchSize)
	}
	for _, f := range c.IgnoreFields {
		if f == "" {
			return configError("IgnoreFields", "empty field name")
		}
	}
	return nil
}

func configError(field, format string, args ...any) error {
	return &consumer.ConfigError{Field: field, Reason: fmt.Sprintf(format, args...)}
}
