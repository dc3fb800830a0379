// Package httpidem is a net/http middleware for idempotency keys, stored in
// Postgres next to idemq's other tables.
//
// A client sends a unique Idempotency-Key header with each mutating request
// and reuses it when it retries. The middleware guarantees that the
// handler's database effect is applied once per key, and that every retry
// gets the original response:
//
//   - First request: the key is claimed (a row committed in its own short
//     transaction, locked until LockTimeout). The handler then runs in a
//     transaction the middleware begins and passes through the request
//     context ([Tx]); the handler's database work, the completion of the
//     claim and the stored response (status, body, ReplayHeaders) commit
//     together, and only then is the response sent.
//   - A retry of a completed key gets the stored response, with the header
//     Idempotent-Replayed: true. The handler does not run.
//   - A retry while the first request is still running gets 409 Conflict
//     with Retry-After: as many seconds as that request has been running
//     (it will likely need about as long again), at least 1 and at most
//     the time left on its lock (see [Config.LockTimeout]). Duplicates of a
//     request that takes milliseconds are told to retry after 1 second,
//     not after the whole lock timeout.
//   - The same key with a different request (another method, path, query or
//     body) gets 422 Unprocessable Entity: the key was reused by mistake.
//   - A 5xx response or a panic rolls the transaction back and releases the
//     claim, so the client can retry. (A panic is re-raised after that.)
//   - A claim left by a crashed request (its transaction rolled back with
//     its connection) is taken over by the first retry after LockTimeout,
//     only if the retry has the same fingerprint.
//
// The request's fingerprint is the sha256 of its method, its path with its
// sorted query, and its canonical body: JSON bodies are re-encoded with
// sorted keys and without [Config.IgnoreFields] (see [CanonicalJSON]); other
// bodies are used as they are.
//
// # The API contract, for clients
//
// Send Idempotency-Key (at most 255 printable ASCII characters; a random
// UUID is ideal) on POST, PUT, PATCH and DELETE. Retry a failed or timed-out
// request with the same key and the same body. On 409, wait Retry-After
// seconds (1 while the first request is young) and retry. On 422, the key
// was already used for a different request: use a new key. Keys are
// remembered for the retention the operator chooses ([Middleware.Purge]); a
// key reused after its record was purged is a new request.
//
// Responses are buffered until the transaction commits: streaming handlers
// (http.Flusher) are not supported.
package httpidem

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"strconv"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/internal/pgmigrate"
	"github.com/idemq/idemq/internal/pgpurge"
	"github.com/idemq/idemq/processed"
)

type ctxKey struct{}

// Tx returns the transaction the middleware began for this request. The
// handler makes its database changes through it and must not commit or roll
// it back: the middleware commits it together with the stored response, or
// rolls it back on a 5xx. ok is false for requests the middleware does not
// cover (see Config.Methods).
func Tx(ctx context.Context) (tx pgx.Tx, ok bool) {
	tx, ok = ctx.Value(ctxKey{}).(pgx.Tx)
	return tx, ok
}

// Middleware is the idempotency-key middleware. Create it with New, run
// Migrate once, and wrap handlers with Wrap. It is safe for concurrent use.
//
// Errors caused by its table (or its schema) not existing wrap
// [consumer.ErrNotMigrated]: run [Middleware.Migrate].
type Middleware struct {
	db      processed.DB
	cfg     Config
	methods map[string]bool
	// table is the table, its schema resolved on first use, and the
	// statements on it.
	table *pgmigrate.Table[statements]

	// afterClaim, set by tests, runs after a claim commits; an error ends
	// the request there, as a crash would.
	afterClaim func() error
}

// New validates cfg and returns a Middleware over db, the database the
// keys' table lives in and the handlers' transactions are begun on: a
// *pgxpool.Pool (the caller keeps owning it), or a *pgx.Conn, which serves
// one request at a time. It does not touch the database; call Migrate to
// create the table.
func New(db processed.DB, cfg Config) (*Middleware, error) {
	if db == nil {
		return nil, configError("db", "required")
	}
	cfg = cfg.withDefaults()
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	indexes := map[string]string{"created_at_index": "_created_at"}
	m := &Middleware{db: db, cfg: cfg, methods: map[string]bool{},
		table: pgmigrate.NewTable("httpidem", cfg.Schema, cfg.Table, indexes, newStatements)}
	for _, meth := range cfg.Methods {
		m.methods[meth] = true
	}
	return m, nil
}

// statements are the middleware's SQL, for one resolved schema.
type statements struct {
	insert, lockSkip, peek, takeover, own, complete, release, purge string
}

// statements returns the middleware's SQL, resolving the schema the first
// time.
func (m *Middleware) statements(ctx context.Context) (*statements, error) {
	return m.table.Statements(ctx, m.db)
}

// newStatements returns the SQL for the quoted, qualified table t.
func newStatements(t string) *statements {
	m := &statements{}
	lease := `now() + $5::bigint * interval '1 microsecond'`
	m.insert = `INSERT INTO ` + t + ` (scope, key, fingerprint, method, path, state, lock_token, locked_until)
VALUES ($1, $2, $3, $6, $7, 'in_progress', $4, ` + lease + `)
ON CONFLICT (scope, key) DO NOTHING`
	// The time left on the lock, in microseconds (0 once completed).
	remaining := `coalesce((extract(epoch FROM locked_until - now()) * 1000000)::bigint, 0)`
	m.lockSkip = `SELECT fingerprint, state, coalesce(status, 0), coalesce(headers, '{}'), coalesce(body, ''),
	coalesce(locked_until <= now(), false), ` + remaining + `
FROM ` + t + ` WHERE scope = $1 AND key = $2 FOR UPDATE SKIP LOCKED`
	m.peek = `SELECT fingerprint, state, coalesce(status, 0), coalesce(headers, '{}'), coalesce(body, ''), ` + remaining + `
FROM ` + t + ` WHERE scope = $1 AND key = $2`
	m.takeover = `UPDATE ` + t + ` SET lock_token = $3, locked_until = now() + $4::bigint * interval '1 microsecond',
	takeovers = takeovers + 1 WHERE scope = $1 AND key = $2`
	// A row lock, not an update: a new row version would make concurrent
	// claims (INSERT ... ON CONFLICT) wait for this transaction.
	m.own = `SELECT 1 FROM ` + t + `
WHERE scope = $1 AND key = $2 AND lock_token = $3 AND state = 'in_progress' FOR UPDATE`
	m.complete = `UPDATE ` + t + ` SET state = 'completed', status = $4, headers = $5, body = $6,
	completed_at = now(), lock_token = NULL, locked_until = NULL
WHERE scope = $1 AND key = $2 AND lock_token = $3`
	m.release = `DELETE FROM ` + t + ` WHERE scope = $1 AND key = $2 AND lock_token = $3 AND state = 'in_progress'`
	m.purge = `DELETE FROM ` + t + ` WHERE (scope, key) IN (
	SELECT scope, key FROM ` + t + `
	WHERE created_at < $1 AND (state = 'completed' OR locked_until < now())
	LIMIT $2
	FOR UPDATE SKIP LOCKED)`
	return m
}

// logger returns the middleware's logger, naming the table: with its schema
// once the first claim has learned it from the search_path.
func (m *Middleware) logger() *slog.Logger {
	return m.cfg.Logger.With(slog.String("idempotency_table", m.String()))
}

// String returns "schema.table", unquoted, for messages.
func (m *Middleware) String() string { return m.table.String() }

// Wrap returns next wrapped by the middleware.
func (m *Middleware) Wrap(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		m.serve(w, r, next)
	})
}

func (m *Middleware) serve(w http.ResponseWriter, r *http.Request, next http.Handler) {
	if !m.methods[r.Method] {
		next.ServeHTTP(w, r)
		return
	}
	key := r.Header.Get(m.cfg.Header)
	if key == "" {
		if m.cfg.Mode == Strict {
			reject(w, http.StatusBadRequest, m.cfg.Header+" header required")
			return
		}
		m.execute(w, r, next, nil)
		return
	}
	if err := validKey(key); err != nil {
		reject(w, http.StatusBadRequest, m.cfg.Header+": "+err.Error())
		return
	}
	body, err := io.ReadAll(io.LimitReader(r.Body, m.cfg.MaxBodyBytes+1))
	if err != nil {
		reject(w, http.StatusBadRequest, "reading request body: "+err.Error())
		return
	}
	if int64(len(body)) > m.cfg.MaxBodyBytes {
		reject(w, http.StatusRequestEntityTooLarge, fmt.Sprintf("request body over %d bytes", m.cfg.MaxBodyBytes))
		return
	}
	_ = r.Body.Close()
	r.Body = io.NopCloser(bytes.NewReader(body))
	fp, err := m.Fingerprint(r, body)
	if err != nil {
		reject(w, http.StatusBadRequest, "fingerprinting request: "+err.Error())
		return
	}
	c := &claim{scope: m.cfg.Scope(r), key: key, fp: fp}
	// The claim runs to its end even if the client goes away: pgx answers
	// a cancelled COMMIT at once, and the server may commit the claim
	// after a release meant to undo it, leaving the key locked until
	// LockTimeout for the client's retry.
	cctx, cancel := context.WithTimeout(context.WithoutCancel(r.Context()), claimTimeout)
	res, err := m.claim(cctx, c, r.Method, r.URL.Path)
	cancel()
	if err != nil {
		// The claim may have committed all the same (its COMMIT's answer
		// lost with the connection): release it, by its token.
		m.release(r.Context(), c)
		m.logger().Error("httpidem: claim failed", slog.String("key", key), slog.Any("error", err))
		w.Header().Set("Retry-After", "1")
		reject(w, http.StatusServiceUnavailable, "idempotency store unavailable")
		return
	}
	switch res.outcome {
	case outcomeReplay:
		h := w.Header()
		for k, vs := range res.headers {
			h[k] = vs
		}
		h.Set(ReplayedHeader, "true")
		w.WriteHeader(res.status)
		_, _ = w.Write(res.body)
	case outcomeInProgress:
		w.Header().Set("Retry-After", strconv.FormatInt(retryAfter(res.remaining, m.cfg.LockTimeout), 10))
		reject(w, http.StatusConflict, "a request with this "+m.cfg.Header+" is in progress")
	case outcomeMismatch:
		reject(w, http.StatusUnprocessableEntity, "this "+m.cfg.Header+" was used for a different request")
	case outcomeClaimed:
		if r.Context().Err() != nil {
			m.release(r.Context(), c) // the client is gone: free the key for its retry
			return
		}
		if m.afterClaim != nil {
			if err := m.afterClaim(); err != nil {
				return
			}
		}
		m.execute(w, r, next, c)
	}
}

// claim identifies one claimed key.
type claim struct {
	scope, key, token string
	fp                [32]byte
}

type outcome int

const (
	outcomeClaimed outcome = iota + 1
	outcomeReplay
	outcomeInProgress
	outcomeMismatch
)

type claimResult struct {
	outcome outcome
	status  int
	headers http.Header
	body    []byte
	// remaining is the time left on the lock of a claim in progress.
	remaining time.Duration
}

// retryAfter is the Retry-After, in whole seconds, for a duplicate of a
// request in progress whose lock has remaining left of lockTimeout. The lock
// was taken lockTimeout-remaining ago, when the request claimed the key (or
// took it over): that is how long the request has been running, and about
// how much longer it is likely to need. The wait is that age, at least 1s
// and at most remaining, after which a claim left by a crashed request can
// be taken over. A request still running past its lock (it keeps the claim)
// gets at most lockTimeout.
func retryAfter(remaining, lockTimeout time.Duration) int64 {
	age := lockTimeout - remaining
	limit := remaining
	if limit <= 0 {
		limit = lockTimeout
	}
	wait := min(max(age, time.Second), max(limit, time.Second))
	return int64((wait + time.Second - 1) / time.Second)
}

// claimTimeout bounds the claim, which the client's going away does not
// cut short.
const claimTimeout = 10 * time.Second

// maxClaimAttempts bounds the loop when a conflicting row vanishes (is
// released or purged) between two statements.
const maxClaimAttempts = 3

// claim claims c's key in its own transaction, or reports who holds it.
func (m *Middleware) claim(ctx context.Context, c *claim, method, path string) (claimResult, error) {
	var b [16]byte
	_, _ = rand.Read(b[:])
	c.token = hex.EncodeToString(b[:])
	lease := m.cfg.LockTimeout.Microseconds()
	for attempt := 1; ; attempt++ {
		res, retry, err := m.claimOnce(ctx, c, lease, method, path)
		if err != nil || !retry {
			return res, err
		}
		if attempt == maxClaimAttempts {
			return claimResult{}, fmt.Errorf("httpidem: claim %q: row conflicted but vanished %d times", c.key, attempt)
		}
	}
}

func (m *Middleware) claimOnce(ctx context.Context, c *claim, lease int64, method, path string) (res claimResult, retry bool, err error) {
	st, err := m.statements(ctx)
	if err != nil {
		return res, false, fmt.Errorf("httpidem: claim: %w", err)
	}
	tx, err := m.db.Begin(ctx)
	if err != nil {
		return res, false, m.wrap("claim: begin", err)
	}
	defer func() { _ = tx.Rollback(context.WithoutCancel(ctx)) }()
	tag, err := tx.Exec(ctx, st.insert, c.scope, c.key, c.fp[:], c.token, lease, method, path)
	if err != nil {
		return res, false, m.wrap("claim: insert", err)
	}
	if tag.RowsAffected() == 0 {
		var (
			fp      []byte
			state   string
			headers map[string][]string
			stale   bool
		)
		var remainingUs int64
		err = tx.QueryRow(ctx, st.lockSkip, c.scope, c.key).Scan(&fp, &state, &res.status, &headers, &res.body, &stale, &remainingUs)
		res.remaining = time.Duration(remainingUs) * time.Microsecond
		switch {
		case errors.Is(err, pgx.ErrNoRows):
			// Locked by a request that is running its handler, or gone.
			err = tx.QueryRow(ctx, st.peek, c.scope, c.key).Scan(&fp, &state, &res.status, &headers, &res.body, &remainingUs)
			if errors.Is(err, pgx.ErrNoRows) {
				return res, true, nil
			}
			res.remaining = time.Duration(remainingUs) * time.Microsecond
			switch {
			case err != nil:
				return res, false, m.wrap("claim: read", err)
			case !bytes.Equal(fp, c.fp[:]):
				res.outcome = outcomeMismatch
			case state == "completed":
				// Completed since SKIP LOCKED skipped it: the lock
				// was the completing transaction's, or another
				// duplicate's reading it.
				res.outcome = outcomeReplay
				res.headers = headers
			default:
				res.outcome = outcomeInProgress
			}
			return res, false, nil
		case err != nil:
			return res, false, m.wrap("claim: read", err)
		case !bytes.Equal(fp, c.fp[:]):
			res.outcome = outcomeMismatch
			return res, false, nil
		case state == "completed":
			res.outcome = outcomeReplay
			res.headers = headers
			return res, false, nil
		case !stale:
			res.outcome = outcomeInProgress
			return res, false, nil
		}
		// A stale claim with our fingerprint: its request died.
		if _, err := tx.Exec(ctx, st.takeover, c.scope, c.key, c.token, lease); err != nil {
			return res, false, m.wrap("claim: take over", err)
		}
		m.logger().Warn("httpidem: took over a stale claim", slog.String("key", c.key))
	}
	if err := tx.Commit(ctx); err != nil {
		return res, false, m.wrap("claim: commit", err)
	}
	res.outcome = outcomeClaimed
	return res, false, nil
}

// execute runs next in a transaction. With a claim, it stores the response
// and completes the claim in the same transaction, or releases the claim.
func (m *Middleware) execute(w http.ResponseWriter, r *http.Request, next http.Handler, c *claim) {
	ctx := r.Context()
	tx, err := m.db.Begin(ctx)
	if err != nil {
		m.logger().Error("httpidem: begin", slog.Any("error", err))
		m.release(ctx, c)
		w.Header().Set("Retry-After", "1")
		reject(w, http.StatusServiceUnavailable, "database unavailable")
		return
	}
	defer func() { _ = tx.Rollback(context.WithoutCancel(ctx)) }()
	var st *statements
	if c != nil {
		// Lock the claim for the handler's whole run, so that it is never
		// taken over while the request lives, and check that it is still
		// ours. (The claim resolved the schema: st is at hand.)
		st, err = m.statements(ctx)
		var tag pgconn.CommandTag
		if err == nil {
			tag, err = tx.Exec(ctx, st.own, c.scope, c.key, c.token)
		}
		if err != nil {
			m.logger().Error("httpidem: lock claim", slog.Any("error", err))
			_ = tx.Rollback(context.WithoutCancel(ctx))
			m.release(ctx, c)
			w.Header().Set("Retry-After", "1")
			reject(w, http.StatusServiceUnavailable, "database unavailable")
			return
		}
		if tag.RowsAffected() == 0 {
			w.Header().Set("Retry-After", "1")
			reject(w, http.StatusConflict, "the claim on this "+m.cfg.Header+" was taken over")
			return
		}
	}

	rec := &recorder{header: http.Header{}, limit: m.cfg.MaxResponseBytes}
	panicked := true
	defer func() {
		if panicked {
			// Roll back before releasing: the release must not wait on
			// our own row lock.
			_ = tx.Rollback(context.WithoutCancel(ctx))
			m.release(ctx, c)
		}
	}()
	next.ServeHTTP(rec, r.WithContext(context.WithValue(ctx, ctxKey{}, tx)))
	panicked = false

	status := rec.statusCode()
	switch {
	case rec.overflow:
		_ = tx.Rollback(context.WithoutCancel(ctx))
		m.release(ctx, c)
		reject(w, http.StatusInternalServerError, fmt.Sprintf("response over %d bytes cannot be stored", m.cfg.MaxResponseBytes))
		return
	case !m.cfg.Cacheable(status):
		_ = tx.Rollback(context.WithoutCancel(ctx))
		m.release(ctx, c)
		rec.writeTo(w, nil)
		return
	}
	if c != nil {
		stored := http.Header{}
		for _, h := range m.cfg.ReplayHeaders {
			if vs := rec.header.Values(h); len(vs) > 0 {
				stored[http.CanonicalHeaderKey(h)] = vs
			}
		}
		body := rec.buf.Bytes()
		if body == nil {
			body = []byte{}
		}
		tag, err := tx.Exec(ctx, st.complete, c.scope, c.key, c.token, status, stored, body)
		if err != nil || tag.RowsAffected() != 1 {
			m.logger().Error("httpidem: store response", slog.Any("error", err), slog.Int64("rows", tag.RowsAffected()))
			_ = tx.Rollback(context.WithoutCancel(ctx))
			m.release(ctx, c)
			w.Header().Set("Retry-After", "1")
			reject(w, http.StatusServiceUnavailable, "could not store the response")
			return
		}
	}
	if err := tx.Commit(context.WithoutCancel(ctx)); err != nil {
		// The commit may or may not have happened: keep the claim. If it
		// did not, a retry takes it over after LockTimeout.
		m.logger().Error("httpidem: commit", slog.Any("error", err))
		w.Header().Set("Retry-After", strconv.FormatInt(max(1, int64(m.cfg.LockTimeout/time.Second)), 10))
		reject(w, http.StatusServiceUnavailable, "could not commit; retry with the same "+m.cfg.Header)
		return
	}
	rec.writeTo(w, nil)
}

// release deletes c's claim so that the client can retry. If it fails, the
// claim expires after LockTimeout.
func (m *Middleware) release(ctx context.Context, c *claim) {
	if c == nil {
		return
	}
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
	defer cancel()
	st, err := m.statements(ctx)
	if err == nil {
		_, err = m.db.Exec(ctx, st.release, c.scope, c.key, c.token)
	}
	if err != nil {
		m.logger().Warn("httpidem: release claim failed; it expires after LockTimeout",
			slog.String("key", c.key), slog.Any("error", err))
	}
}

// Purge deletes the keys created more than olderThan ago (by the database's
// clock), completed or abandoned, and returns how many it deleted. Claims of
// requests still running are kept. After a key is purged, a request reusing
// it is treated as new: choose olderThan longer than clients may retry (24h
// is common). It deletes in batches of Config.PurgeBatchSize rows.
func (m *Middleware) Purge(ctx context.Context, olderThan time.Duration) (int64, error) {
	st, err := m.statements(ctx)
	if err != nil {
		return 0, fmt.Errorf("httpidem: purge: %w", err)
	}
	n, step, err := pgpurge.Run(ctx, m.db, st.purge, olderThan, m.cfg.PurgeBatchSize, pgpurge.Pace{})
	if err != nil {
		return n, m.wrap(string(step), err)
	}
	return n, nil
}

func (m *Middleware) wrap(op string, err error) error {
	if pgmigrate.IsUndefined(err) {
		return fmt.Errorf("httpidem: %s on %s: %w: %w", op, m, consumer.ErrNotMigrated, err)
	}
	return fmt.Errorf("httpidem: %s on %s: %w", op, m, err)
}

func validKey(k string) error {
	if len(k) > MaxKeyLen {
		return fmt.Errorf("%d bytes, more than %d", len(k), MaxKeyLen)
	}
	for i := 0; i < len(k); i++ {
		if k[i] < 0x20 || k[i] > 0x7e {
			return errors.New("must be printable ASCII")
		}
	}
	return nil
}

func reject(w http.ResponseWriter, status int, msg string) {
	http.Error(w, msg, status)
}

// recorder buffers a response until the transaction commits.
type recorder struct {
	header   http.Header
	status   int
	buf      bytes.Buffer
	limit    int
	overflow bool
}

func (rec *recorder) Header() http.Header { return rec.header }

func (rec *recorder) WriteHeader(code int) {
	if rec.status == 0 {
		rec.status = code
	}
}

func (rec *recorder) Write(b []byte) (int, error) {
	if rec.status == 0 {
		rec.status = http.StatusOK
	}
	if rec.buf.Len()+len(b) > rec.limit {
		rec.overflow = true
		return 0, errors.New("httpidem: response too large to store")
	}
	return rec.buf.Write(b)
}

func (rec *recorder) statusCode() int {
	if rec.status == 0 {
		return http.StatusOK
	}
	return rec.status
}

func (rec *recorder) writeTo(w http.ResponseWriter, extra http.Header) {
	h := w.Header()
	for k, vs := range rec.header {
		h[k] = vs
	}
	for k, vs := range extra {
		h[k] = vs
	}
	w.WriteHeader(rec.statusCode())
	_, _ = w.Write(rec.buf.Bytes())
}
