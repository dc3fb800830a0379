package consumer

import (
	"context"
	"fmt"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// ExecLater has the runtime run sql, with args, in tx after the handler
// returns: with every statement the transaction's handlers queued, in one
// round trip to Postgres, before the runtime commits. Use it for writes whose
// result the handler does not need (an INSERT of the effect, an UPDATE by
// key). A group of messages whose handlers each write with ExecLater costs
// the round trips of one set-based BatchHandler, where each tx.Exec costs
// one of its own.
//
// Statements run in the order they were queued, and before any statement
// the handler (or the next message's handler in the group) runs through tx
// itself, so a handler reads what an earlier one queued. A queued statement
// that fails fails the message whose handler queued it, as if its handler
// had returned the error: the transaction rolls back, and that message is
// retried or dead-lettered on its own while the others of its group are
// applied. Its error says which statement it was.
//
// The args are encoded when the statement is sent: do not change them after
// the call. In a savepoint (tx.Begin), or in a transaction that is not the
// runtime's (a test's, say), ExecLater runs the statement at once, as
// tx.Exec would.
func ExecLater(ctx context.Context, tx pgx.Tx, sql string, args ...any) error {
	if t, ok := tx.(*handlerTx); ok {
		return t.queue(sql, args)
	}
	_, err := tx.Exec(ctx, sql, args...)
	return err
}

// laterStmt is a statement queued by ExecLater, with the index of the item
// whose handler queued it (-1 under a BatchHandler).
type laterStmt struct {
	sql   string
	args  []any
	owner int
}

// queue queues a statement for the next flush.
func (t *handlerTx) queue(sql string, args []any) error {
	if t.ended {
		return Permanent(errTxEnded)
	}
	if t.laterErr != nil {
		return t.laterErr
	}
	if err := t.guardTx.ended(); err != nil {
		return err
	}
	t.later = append(t.later, laterStmt{sql: sql, args: args, owner: t.cur})
	return nil
}

// flush sends the queued statements in one batch. The first that fails is
// kept, with its owner, in laterErr: the attempt fails as that item's
// handler error, whichever handler ran when the flush did.
func (t *handlerTx) flush(ctx context.Context) error {
	if t.laterErr != nil {
		return t.laterErr
	}
	if len(t.later) == 0 {
		return nil
	}
	q := t.later
	t.later = nil
	fail := func(owner int, err error) error {
		t.laterErr, t.laterOwner = err, owner
		return err
	}
	if err := t.guardTx.ended(); err != nil {
		return fail(q[0].owner, err)
	}
	var b pgx.Batch
	for _, s := range q {
		b.Queue(s.sql, s.args...)
	}
	br := t.guardTx.Tx.SendBatch(ctx, &b)
	for k, s := range q {
		if _, err := br.Exec(); err != nil {
			t.note(err)
			_ = br.Close()
			return fail(s.owner, fmt.Errorf("statement %d of %d queued by ExecLater (%.80s): %w", k+1, len(q), s.sql, err))
		}
	}
	if err := br.Close(); err != nil {
		t.note(err)
		return fail(q[len(q)-1].owner, fmt.Errorf("statements queued by ExecLater: %w", err))
	}
	return nil
}

// flushErr wraps a failed flush for the direct statement that set it off.
func flushErr(err error) error {
	return fmt.Errorf("not run: an earlier statement queued by ExecLater failed: %w", err)
}

// The statements a handler runs through tx itself first send what is
// queued, so that they see it.

// Begin starts a savepoint once the queued statements have run.
func (t *handlerTx) Begin(ctx context.Context) (pgx.Tx, error) {
	if err := t.flush(ctx); err != nil {
		return nil, flushErr(err)
	}
	return t.guardTx.Begin(ctx)
}

// Exec runs sql once the queued statements have run.
func (t *handlerTx) Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error) {
	if err := t.flush(ctx); err != nil {
		return pgconn.CommandTag{}, flushErr(err)
	}
	return t.guardTx.Exec(ctx, sql, args...)
}

// Query runs sql once the queued statements have run.
func (t *handlerTx) Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error) {
	if err := t.flush(ctx); err != nil {
		return nil, flushErr(err)
	}
	return t.guardTx.Query(ctx, sql, args...)
}

// QueryRow runs sql once the queued statements have run.
func (t *handlerTx) QueryRow(ctx context.Context, sql string, args ...any) pgx.Row {
	if err := t.flush(ctx); err != nil {
		return errRow{flushErr(err)}
	}
	return t.guardTx.QueryRow(ctx, sql, args...)
}

// SendBatch sends b once the queued statements have run.
func (t *handlerTx) SendBatch(ctx context.Context, b *pgx.Batch) pgx.BatchResults {
	if err := t.flush(ctx); err != nil {
		return errBatch{flushErr(err)}
	}
	return t.guardTx.SendBatch(ctx, b)
}

// CopyFrom copies once the queued statements have run.
func (t *handlerTx) CopyFrom(ctx context.Context, table pgx.Identifier, cols []string, src pgx.CopyFromSource) (int64, error) {
	if err := t.flush(ctx); err != nil {
		return 0, flushErr(err)
	}
	return t.guardTx.CopyFrom(ctx, table, cols, src)
}
