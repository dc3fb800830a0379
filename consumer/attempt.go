package consumer

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"runtime/debug"
	"slices"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/idemq/idemq/consumer/dedup"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// This file is the attempt engine: one transaction over one message (per
// message mode) or a group of them (batch mode), and the one classifier of
// what the attempt came to. settle.go decides what to do about it.

// outcome is what one attempt's transaction came to.
type outcome int

const (
	// outApplied: the transaction committed. The claims say, per item,
	// whether it was new (applied), a duplicate or a mismatch.
	outApplied outcome = iota
	// outHandlerErr: the transaction definitely rolled back because of a
	// message: its handler returned an error or panicked, left the
	// transaction aborted (a statement failed and its error was ignored)
	// or ended it itself, or COMMIT was refused (a deferred constraint).
	// failed is the item's index, or -1 when no single message is known
	// (a BatchHandler, a refused COMMIT).
	outHandlerErr
	// outConflict: the transaction definitely rolled back on a
	// serialization failure or deadlock (40001, 40P01): a race between
	// transactions, nobody's fault. Retried whole.
	outConflict
	// outConnLost: the connection died after the handler started, in the
	// handler or at COMMIT, so the outcome may be unknown. Never acked:
	// the next attempt's claim finds out whether it committed.
	outConnLost
	// outInfraErr: BEGIN or the claim failed: the database's fault, not
	// the message's.
	outInfraErr
	// outFatal: the dedup store cannot work at all (its table does not
	// exist): the runtime stops.
	outFatal
)

// attemptResult is the result of one attempt over a group of items.
type attemptResult struct {
	out      outcome
	err      error
	failed   int  // for outHandlerErr: the failing item, or -1
	timedOut bool // the failing handler ran over HandlerTimeout
	claims   []dedup.ClaimResult
	handler  []time.Duration // per item: its handler call (the batch handler's, with BatchHandler)
	commit   time.Duration
	dur      time.Duration // the whole transaction
}

// item is a delivery that passed the input checks.
type item struct {
	del   Delivery
	msg   *Message
	claim dedup.Claim
	log   *slog.Logger
}

// precheck extracts the message id and checks the input. For a message
// that cannot be handled it returns fail, which dead-letters it (or
// requeues it at shutdown): the caller settles the deliveries before it
// first, so that a key's messages are settled in order.
func (r *Runtime) precheck(ctx context.Context, del Delivery) (it item, fail func()) {
	msg := del.Message()
	// The runtime logs at Error and below: with those off (the default
	// discarding logger), skip building a per-message logger.
	logging := r.log.Enabled(ctx, slog.LevelError)
	log := r.log
	if logging {
		log = log.With("source", msg.Source)
	}
	if ctx.Err() != nil {
		return it, func() { r.requeue(del, log) }
	}
	id, err := r.messageID(msg)
	switch {
	case err != nil:
	case id == "":
		err = errors.New("message has no id")
	case len(id) > r.cfg.MaxIDBytes:
		err = fmt.Errorf("message id is %d bytes, over the %d-byte limit", len(id), r.cfg.MaxIDBytes)
		id = ""
	case !isText(id):
		// Postgres would refuse it on every claim, forever.
		err = fmt.Errorf("message id %q is not valid UTF-8 text (or holds a NUL byte), which Postgres cannot store", id)
		id = ""
	}
	if err != nil {
		return it, func() {
			r.deadLetter(ctx, del, log, Failure{Class: ClassMissingID, Err: fmt.Errorf("extract message id: %w", err)})
		}
	}
	if logging {
		log = log.With("message_id", id)
	}
	if r.cfg.MaxBodyBytes >= 0 && len(msg.Body) > r.cfg.MaxBodyBytes {
		return it, func() {
			r.deadLetter(ctx, del, log, Failure{MessageID: id, Class: ClassTooLarge,
				Err: fmt.Errorf("body is %d bytes, over the %d-byte limit", len(msg.Body), r.cfg.MaxBodyBytes)})
		}
	}
	if msg.routeErr != nil {
		return it, func() {
			r.deadLetter(ctx, del, log, Failure{MessageID: id, Class: ClassUnroutable, Err: fmt.Errorf("route to a shard: %w", msg.routeErr)})
		}
	}
	claim := dedup.Claim{Consumer: r.cfg.Name, MessageID: id, Fingerprint: msg.Fingerprint(),
		Source: toText(msg.Source), Partition: msg.Partition, Offset: msg.Offset, Route: msg.route}
	return item{del: del, msg: msg, claim: claim, log: log}, nil
}

// isText reports whether s can be stored in a Postgres text column: valid
// UTF-8 without NUL bytes.
func isText(s string) bool {
	return utf8.ValidString(s) && strings.IndexByte(s, 0) < 0
}

// toText makes s storable in a Postgres text column, replacing invalid
// UTF-8 and NUL bytes with U+FFFD. It is used for forensic fields only.
func toText(s string) string {
	if isText(s) {
		return s
	}
	return strings.ReplaceAll(strings.ToValidUTF8(s, "\uFFFD"), "\x00", "\uFFFD")
}

// orderingKey sets msg.Key to Config.OrderingKey's result; a panic is
// logged and leaves msg.Key as it was.
func (r *Runtime) orderingKey(msg *Message) {
	defer func() {
		if v := recover(); v != nil {
			r.log.Error("idemq: OrderingKey function panicked; the message keeps its own key",
				"panic", fmt.Sprint(v), "key", msg.Key, "stack", string(debug.Stack()))
		}
	}()
	msg.Key = r.cfg.OrderingKey(msg)
}

// messageID runs Config.MessageID, turning a panic into an error: a
// body-dependent panic is the message's fault, and it is dead-lettered as
// ClassMissingID instead of crashing the process.
func (r *Runtime) messageID(msg *Message) (id string, err error) {
	defer func() {
		if v := recover(); v != nil {
			id, err = "", fmt.Errorf("MessageID function panicked: %v", v)
			r.log.Error("idemq: MessageID function panicked", "panic", fmt.Sprint(v), "stack", string(debug.Stack()))
		}
	}()
	return r.cfg.MessageID(msg)
}

// attempt runs one transaction over items: begin, claim them all, run the
// handler for each new one (or the BatchHandler once for all of them), and
// commit. attemptNo is the 1-based attempt number handlers see.
func (r *Runtime) attempt(ctx context.Context, items []item, attemptNo int) attemptResult {
	start := time.Now()
	tx, claims, err := r.beginClaims(ctx, items)
	committed := false
	if tx != nil {
		defer func() {
			if !committed { // after a commit there is nothing to end
				r.rollback(ctx, tx)
			}
		}()
	}
	if err != nil {
		// A store that cannot work as configured (its table missing, a
		// sharded store's map refused) stops the runtime.
		if errors.Is(err, ErrNotMigrated) || errors.Is(err, ErrInvalidConfig) {
			return attemptResult{out: outFatal, err: err}
		}
		if cerr := StatementCacheError(err); cerr != nil {
			return attemptResult{out: outFatal, err: cerr}
		}
		return attemptResult{out: outInfraErr, err: err}
	}
	res := attemptResult{claims: claims, handler: make([]time.Duration, len(items))}
	htx := &handlerTx{}
	htx.guardTx = guardTx{Tx: tx, cacheErr: &htx.cacheSeen}

	if r.cfg.BatchHandler != nil && len(items) > 1 {
		var msgs []*Message
		for i, it := range items {
			if claims[i].Outcome == dedup.ClaimNew {
				it.msg.Attempt = attemptNo
				msgs = append(msgs, it.msg)
			}
		}
		if len(msgs) > 0 {
			hctx, cancel := r.handlerContext(ctx)
			hstart := time.Now()
			htx.cur = -1
			err := handlerMisuse(htx, r.callBatchHandler(hctx, htx, msgs))
			d := time.Since(hstart)
			for i := range res.handler {
				res.handler[i] = d
			}
			if fail, failed := htx.failed(ctx, hctx, err); failed {
				cancel()
				return fail
			}
			cancel()
		}
	} else {
		for i, it := range items {
			if claims[i].Outcome != dedup.ClaimNew {
				continue
			}
			it.msg.Attempt = attemptNo
			hctx, cancel := r.handlerContext(ctx)
			hstart := time.Now()
			htx.cur = i
			err := handlerMisuse(htx, r.callHandler(hctx, htx, it.msg))
			res.handler[i] = time.Since(hstart)
			if fail, failed := htx.failed(ctx, hctx, err); failed {
				cancel()
				return fail
			}
			cancel()
		}
	}
	if len(htx.later) > 0 {
		// What the handlers queued with ExecLater, in one round trip.
		hctx, cancel := r.handlerContext(ctx)
		_ = htx.flush(hctx)
		fail, failed := htx.failed(ctx, hctx, nil)
		cancel()
		if failed {
			return fail
		}
	}

	res.out = outApplied
	applied := 0
	for _, c := range claims {
		if c.Outcome == dedup.ClaimNew {
			applied++
		}
	}
	if applied == 0 {
		// Nothing new: nothing to commit. The deferred rollback ends tx.
		res.dur = time.Since(start)
		return res
	}
	log := r.log
	if len(items) == 1 {
		log = items[0].log
	}
	res.commit, err = r.commit(ctx, tx, applied, log)
	committed = true // committed or not, the transaction has ended
	if err != nil {
		if cerr := StatementCacheError(err); cerr != nil {
			return attemptResult{out: outFatal, err: cerr}
		}
		return classifyCommitErr(err)
	}
	res.dur = time.Since(start)
	return res
}

// slowCommitHint is the hint of the slow-COMMIT warnings.
const slowCommitHint = "a synchronous standby that is slow or gone (synchronous_standby_names), a saturated disk, or a lock taken at commit (a deferred trigger); " +
	"the runtime never cancels a COMMIT, and acks only once it returns"

// commit commits tx, which holds applied new messages, and returns how
// long the COMMIT took. It never cancels the COMMIT: its context is
// detached from ctx, since pgx answers a cancelled context with a cancel
// request if the pool is so configured, and Postgres answers that, in a
// COMMIT waiting for a synchronous standby, by committing locally and
// reporting success. A COMMIT waiting longer than SlowCommit is logged then,
// and again when it returns; the hooks measure every COMMIT.
func (r *Runtime) commit(ctx context.Context, tx pgx.Tx, applied int, log *slog.Logger) (time.Duration, error) {
	start := time.Now()
	var slow *time.Timer
	if r.cfg.SlowCommit > 0 {
		slow = time.AfterFunc(r.cfg.SlowCommit, func() {
			log.Warn("idemq: a COMMIT is slow: it still waits for the database's answer",
				"waited", r.cfg.SlowCommit, "messages", applied, "hint", slowCommitHint)
		})
	}
	err := tx.Commit(context.WithoutCancel(ctx))
	d := time.Since(start)
	if slow != nil && !slow.Stop() {
		attrs := []any{"took", d, "messages", applied}
		if err != nil {
			attrs = append(attrs, "error", err)
		}
		log.Warn("idemq: a slow COMMIT returned", attrs...)
	}
	for _, h := range r.hooks.commit {
		r.hook("OnCommit", func() { h.OnCommit(ctx, applied, d, err) })
	}
	return d, err
}

// errStatementIgnored is the handler error of a handler that returned nil
// from a transaction it had left aborted.
var errStatementIgnored = errors.New("a statement in the handler's transaction failed and the handler returned nil, ignoring its error: " +
	"Postgres aborted the transaction, so nothing was applied (return the statement's error, or run the statement in a savepoint with tx.Begin to recover from it)")

// errTxEnded is the handler error of a handler that tried to commit or roll
// back the runtime's transaction itself.
var errTxEnded = errors.New("the handler called tx.Commit or tx.Rollback on the runtime's transaction, which the runtime refused: " +
	"handlers must leave that to the runtime (return nil to commit, an error to roll back); nothing was committed")

// errTxEndedBySQL is the handler error of a handler that ended the
// runtime's transaction with SQL of its own.
var errTxEndedBySQL = errors.New("the handler ended the runtime's transaction itself, with SQL (COMMIT, ROLLBACK, END, ABORT or PREPARE TRANSACTION; " +
	"for a processed store also CLOSE ALL, which closes the cursor its commit checks for): " +
	"what it ran after that was outside the transaction that holds the message's claim, so the runtime did not apply the message; " +
	"leave ending the transaction to the runtime (return nil to commit, an error to roll back)")

// handlerTx is the transaction handlers see: the runtime's own, except that
// Commit and Rollback are refused and remembered, and that it runs no
// statement once the handler has ended the transaction with SQL (see
// guardTx). Ending the transaction is the runtime's job; a handler that
// ended it would also hand its connection back to the pool while the
// runtime still uses it.
type handlerTx struct {
	guardTx
	ended bool
	// cacheSeen is where guardTx.cacheErr points.
	cacheSeen error

	// cur is the item whose handler runs (-1: the BatchHandler).
	cur int
	// later holds the statements queued by ExecLater, not yet sent.
	later []laterStmt
	// laterErr is the first error of a queued statement, which fails the
	// attempt as the handler error of item laterOwner.
	laterErr   error
	laterOwner int
}

// failed says whether the attempt fails after a handler returned err (its
// error after handlerMisuse), and how. A queued statement's failure comes
// first, and is the failure of the item that queued it, whatever the
// handler that ran when it was sent returned.
func (t *handlerTx) failed(ctx, hctx context.Context, err error) (attemptResult, bool) {
	if t.laterErr != nil {
		return t.classify(ctx, hctx, t.laterErr, t.laterOwner), true
	}
	if err != nil {
		return t.classify(ctx, hctx, err, t.cur), true
	}
	return attemptResult{}, false
}

// classify says what a handler error (of item i, or -1) means. A
// statement-cache error (see StatementCacheError) is the configuration's
// fault, not the message's, and stops the runtime: whether the handler
// returned it, or met it in one of its statements and returned another
// error, or none with the transaction aborted.
func (t *handlerTx) classify(ctx, hctx context.Context, err error, i int) attemptResult {
	cerr := StatementCacheError(err)
	if cerr == nil && t.cacheSeen != nil {
		cerr = StatementCacheError(t.cacheSeen)
	}
	if cerr != nil {
		return attemptResult{out: outFatal, err: fmt.Errorf("handler: %w", cerr)}
	}
	return classifyHandlerErr(ctx, hctx, t.Tx, err, i)
}

// Commit refuses to commit: see handlerTx.
func (t *handlerTx) Commit(context.Context) error {
	t.ended = true
	return Permanent(errTxEnded)
}

// Rollback refuses to roll back: see handlerTx.
func (t *handlerTx) Rollback(context.Context) error {
	t.ended = true
	return Permanent(errTxEnded)
}

// guardTx is a transaction, or a savepoint in one (tx.Begin), that refuses
// to run a statement once the connection has left the transaction: after a
// handler's own COMMIT, ROLLBACK or the like, the statements it runs next
// would be autocommitted one by one, outside the transaction that holds
// the claims, and nothing could take them back. The check reads the
// transaction status the server reported with its last answer, so it costs
// no round trip.
//
// It also keeps, in cacheErr (shared with its savepoints), the first
// statement-cache error one of its statements met (see
// StatementCacheError), so that the runtime recognises it even when the
// handler returns another error, or none.
type guardTx struct {
	pgx.Tx
	cacheErr *error
}

// note keeps err if it is the first statement-cache error.
func (g guardTx) note(err error) {
	if err != nil && *g.cacheErr == nil && isStatementCacheErr(err) {
		*g.cacheErr = err
	}
}

// ended returns errTxEndedBySQL, as a permanent error, once the connection
// is outside any transaction.
func (g guardTx) ended() error {
	if c := g.Tx.Conn(); c != nil && !c.IsClosed() && c.PgConn().TxStatus() == 'I' {
		return Permanent(errTxEndedBySQL)
	}
	return nil
}

// Begin starts a savepoint, guarded the same way.
func (g guardTx) Begin(ctx context.Context) (pgx.Tx, error) {
	if err := g.ended(); err != nil {
		return nil, err
	}
	sp, err := g.Tx.Begin(ctx)
	if err != nil {
		g.note(err)
		return nil, err
	}
	return guardTx{Tx: sp, cacheErr: g.cacheErr}, nil
}

// Exec runs sql unless the transaction has ended.
func (g guardTx) Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error) {
	if err := g.ended(); err != nil {
		return pgconn.CommandTag{}, err
	}
	tag, err := g.Tx.Exec(ctx, sql, args...)
	g.note(err)
	return tag, err
}

// Query runs sql unless the transaction has ended.
func (g guardTx) Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error) {
	if err := g.ended(); err != nil {
		return nil, err
	}
	rows, err := g.Tx.Query(ctx, sql, args...)
	g.note(err)
	if err != nil {
		return rows, err
	}
	return noteRows{rows, g}, nil
}

// QueryRow runs sql unless the transaction has ended.
func (g guardTx) QueryRow(ctx context.Context, sql string, args ...any) pgx.Row {
	if err := g.ended(); err != nil {
		return errRow{err}
	}
	return noteRow{g.Tx.QueryRow(ctx, sql, args...), g}
}

// SendBatch sends b unless the transaction has ended.
func (g guardTx) SendBatch(ctx context.Context, b *pgx.Batch) pgx.BatchResults {
	if err := g.ended(); err != nil {
		return errBatch{err}
	}
	return noteBatch{g.Tx.SendBatch(ctx, b), g}
}

// CopyFrom copies unless the transaction has ended.
func (g guardTx) CopyFrom(ctx context.Context, table pgx.Identifier, cols []string, src pgx.CopyFromSource) (int64, error) {
	if err := g.ended(); err != nil {
		return 0, err
	}
	n, err := g.Tx.CopyFrom(ctx, table, cols, src)
	g.note(err)
	return n, err
}

// Prepare prepares sql unless the transaction has ended.
func (g guardTx) Prepare(ctx context.Context, name, sql string) (*pgconn.StatementDescription, error) {
	if err := g.ended(); err != nil {
		return nil, err
	}
	sd, err := g.Tx.Prepare(ctx, name, sql)
	g.note(err)
	return sd, err
}

// noteRows, noteRow and noteBatch are the results of a guardTx's
// statements: they are pgx's own, except that the guardTx notes their
// errors (see guardTx.note).
type (
	noteRows struct {
		pgx.Rows
		g guardTx
	}
	noteRow struct {
		row pgx.Row
		g   guardTx
	}
	noteBatch struct {
		pgx.BatchResults
		g guardTx
	}
)

func (r noteRows) Err() error {
	err := r.Rows.Err()
	r.g.note(err)
	return err
}

func (r noteRow) Scan(dest ...any) error {
	err := r.row.Scan(dest...)
	r.g.note(err)
	return err
}

func (b noteBatch) Exec() (pgconn.CommandTag, error) {
	tag, err := b.BatchResults.Exec()
	b.g.note(err)
	return tag, err
}

func (b noteBatch) Query() (pgx.Rows, error) {
	rows, err := b.BatchResults.Query()
	b.g.note(err)
	if err != nil {
		return rows, err
	}
	return noteRows{rows, b.g}, nil
}

func (b noteBatch) QueryRow() pgx.Row { return noteRow{b.BatchResults.QueryRow(), b.g} }

func (b noteBatch) Close() error {
	err := b.BatchResults.Close()
	b.g.note(err)
	return err
}

// errRow is a pgx.Row whose Scan returns err.
type errRow struct{ err error }

func (r errRow) Scan(...any) error { return r.err }

// errBatch is a pgx.BatchResults of a batch that was not sent.
type errBatch struct{ err error }

func (b errBatch) Exec() (pgconn.CommandTag, error) { return pgconn.CommandTag{}, b.err }
func (b errBatch) Query() (pgx.Rows, error)         { return nil, b.err }
func (b errBatch) QueryRow() pgx.Row                { return errRow(b) }
func (b errBatch) Close() error                     { return b.err }
func (b errBatch) Tx() pgx.Tx                       { return nil }

// handlerMisuse checks, after each handler and before the next one runs,
// that the handler left the transaction usable, and returns the error the
// attempt fails with: err, the handler's own, unless the handler misused
// the transaction. A handler that returned nil must not have left it
// aborted by a failed statement whose error it ignored (COMMIT would only
// answer ROLLBACK). And no handler may have ended it, through tx.Commit or
// tx.Rollback (refused) or with SQL: the connection is then outside the
// transaction, and what runs next would be autocommitted without a claim
// (guardTx refuses it); this is permanent, whatever the handler returned.
// A transaction the handler ended and began anew with SQL is still open
// here: the Store's commit refuses it (see dedup.Store).
func handlerMisuse(tx *handlerTx, err error) error {
	if tx.ended {
		return Permanent(errTxEnded)
	}
	c := tx.Conn()
	if c == nil || c.IsClosed() {
		return err // a lost connection is found by the classifier or the commit
	}
	switch c.PgConn().TxStatus() {
	case 'E':
		if err == nil {
			return errStatementIgnored
		}
	case 'I':
		if err != nil {
			return Permanent(fmt.Errorf("%w (the handler returned: %w)", errTxEndedBySQL, err))
		}
		return Permanent(errTxEndedBySQL)
	}
	return err
}

// classifyHandlerErr says what a handler error (of item i, or -1) means.
func classifyHandlerErr(ctx, hctx context.Context, tx pgx.Tx, err error, i int) attemptResult {
	// pgx closes a connection whose query was cancelled, so check for a
	// timeout before blaming the database.
	timedOut := errors.Is(hctx.Err(), context.DeadlineExceeded) && ctx.Err() == nil
	if !timedOut && connLost(tx) {
		return attemptResult{out: outConnLost, err: fmt.Errorf("handler: database connection lost: %w", err), failed: i}
	}
	if isConflict(err) {
		return attemptResult{out: outConflict, err: err, failed: i}
	}
	return attemptResult{out: outHandlerErr, err: err, failed: i, timedOut: timedOut}
}

// classifyCommitErr says what a failed COMMIT means.
func classifyCommitErr(err error) attemptResult {
	var pgErr *pgconn.PgError
	switch {
	case errors.As(err, &pgErr) && isConflict(err):
		return attemptResult{out: outConflict, err: fmt.Errorf("commit: %w", err), failed: -1}
	case errors.As(err, &pgErr) && (pgErr.Severity == "FATAL" || pgErr.Severity == "PANIC"):
		// The server ended the session (idle_in_transaction_session_timeout
		// under a slow handler, an administrator): the outcome is not the
		// message's fault, and the next attempt's claim finds it out. (An
		// ERROR closes pgx's connection too, after a failed COMMIT: that
		// one is the server's answer, below.)
		return attemptResult{out: outConnLost, err: fmt.Errorf("commit: the session ended: %w", err), failed: -1}
	case errors.As(err, &pgErr) && strings.HasPrefix(pgErr.Code, "25"):
		// Invalid transaction state: the Store refused to commit a
		// transaction other than the one it began (a handler ended it
		// with SQL and began another; see dedup.Store). Nothing was committed.
		return attemptResult{out: outHandlerErr, err: Permanent(fmt.Errorf("commit: %w: %w", errTxEndedBySQL, err)), failed: -1}
	case errors.As(err, &pgErr):
		// The server answered: the transaction definitely rolled back
		// (a deferred constraint, say).
		return attemptResult{out: outHandlerErr, err: fmt.Errorf("commit: %w", err), failed: -1}
	case errors.Is(err, pgx.ErrTxCommitRollback):
		// COMMIT answered ROLLBACK: the transaction was aborted.
		return attemptResult{out: outHandlerErr, err: fmt.Errorf("commit: %w: %w", errStatementIgnored, err), failed: -1}
	}
	// The outcome is unknown. Never ack on it: the next attempt's claim
	// finds out whether it committed.
	return attemptResult{out: outConnLost, err: fmt.Errorf("commit outcome unknown: %w", err), failed: -1}
}

// isConflict reports whether err is a serialization failure or a deadlock.
func isConflict(err error) bool {
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && (pgErr.Code == "40001" || pgErr.Code == "40P01")
}

// connLost reports whether tx's connection died, which makes a handler
// error the database's fault rather than the message's.
func connLost(tx pgx.Tx) bool {
	c := tx.Conn()
	return c != nil && c.IsClosed()
}

// beginClaims begins a transaction and claims items in it: one claim per
// distinct message id, sorted so that concurrent batches take their locks in
// one order. A repeated id in a group is a duplicate of its first occurrence
// (or a mismatch, if the payload differs). A non-nil tx must be rolled back by
// the caller, also when err is not nil.
func (r *Runtime) beginClaims(ctx context.Context, items []item) (pgx.Tx, []dedup.ClaimResult, error) {
	if len(items) == 1 {
		tx, got, err := r.cfg.Store.BeginClaim(ctx, []dedup.Claim{items[0].claim})
		if err == nil {
			err = checkResults(got, 1)
		}
		if err != nil {
			return tx, nil, fmt.Errorf("begin and claim: %w", err)
		}
		return tx, got, nil
	}
	firstOf := make(map[string]int, len(items))
	var unique []int
	for i, it := range items {
		if _, seen := firstOf[it.claim.MessageID]; !seen {
			firstOf[it.claim.MessageID] = i
			unique = append(unique, i)
		}
	}
	slices.SortFunc(unique, func(a, b int) int { return cmp.Compare(items[a].claim.MessageID, items[b].claim.MessageID) })
	claims := make([]dedup.Claim, len(unique))
	for j, i := range unique {
		claims[j] = items[i].claim
	}
	tx, got, err := r.cfg.Store.BeginClaim(ctx, claims)
	if err == nil {
		err = checkResults(got, len(claims))
	}
	if err != nil {
		return tx, nil, fmt.Errorf("begin and claim batch: %w", err)
	}
	out := make([]dedup.ClaimResult, len(items))
	for j, i := range unique {
		out[i] = got[j]
	}
	for i, it := range items {
		f := firstOf[it.claim.MessageID]
		if f == i {
			continue
		}
		out[i] = dedup.ClaimResult{Outcome: dedup.ClaimDuplicate, ProcessedAt: out[f].ProcessedAt}
		switch {
		case out[f].Outcome == dedup.ClaimMismatch && it.claim.Fingerprint != items[f].claim.Fingerprint:
			// The applied row's payload is not the first copy's, and may
			// be this one's: only a claim of its own can tell.
			out[i] = dedup.ClaimResult{Outcome: claimAlone}
		case it.claim.Fingerprint != items[f].claim.Fingerprint || out[f].Outcome == dedup.ClaimMismatch:
			out[i].Outcome = dedup.ClaimMismatch
		}
	}
	return tx, out, nil
}

// claimAlone is the outcome beginClaims gives a repeated id in a group
// that only a claim of its own can judge: settleApplied applies it alone
// after the group.
const claimAlone dedup.ClaimOutcome = -1

// checkResults checks a Store's answer to n claims.
func checkResults(got []dedup.ClaimResult, n int) error {
	if len(got) != n {
		return fmt.Errorf("%d results for %d claims", len(got), n)
	}
	for _, res := range got {
		switch res.Outcome {
		case dedup.ClaimNew, dedup.ClaimDuplicate, dedup.ClaimMismatch:
		default:
			return fmt.Errorf("unknown claim outcome %d", res.Outcome)
		}
	}
	return nil
}

// rollback ends tx on a context detached from shutdown; after Commit it is
// a no-op.
func (r *Runtime) rollback(ctx context.Context, tx pgx.Tx) {
	rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), settleTimeout)
	defer cancel()
	_ = tx.Rollback(rctx)
}

func (r *Runtime) handlerContext(ctx context.Context) (context.Context, context.CancelFunc) {
	if r.cfg.HandlerTimeout > 0 {
		return context.WithTimeout(ctx, r.cfg.HandlerTimeout)
	}
	return ctx, func() {}
}

// callHandler runs the handler, turning a panic into a *PanicError.
func (r *Runtime) callHandler(ctx context.Context, tx pgx.Tx, msg *Message) (err error) {
	defer func() {
		if v := recover(); v != nil {
			err = &PanicError{Value: v, Stack: debug.Stack()}
		}
	}()
	return r.handler(ctx, tx, msg)
}

// callBatchHandler runs the batch handler, turning a panic into a
// *PanicError.
func (r *Runtime) callBatchHandler(ctx context.Context, tx pgx.Tx, msgs []*Message) (err error) {
	defer func() {
		if v := recover(); v != nil {
			err = &PanicError{Value: v, Stack: debug.Stack()}
		}
	}()
	return r.cfg.BatchHandler(ctx, tx, msgs)
}
