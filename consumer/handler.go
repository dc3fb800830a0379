package consumer

import (
	"context"
	"encoding/json"
	"fmt"

	"github.com/jackc/pgx/v5"
)

// Handler applies one message's effect inside tx, the transaction that also
// holds the message's dedup claim. It must make its changes through tx only
// and must not commit or roll it back: the runtime does. A handler that
// ends tx, with tx.Commit, tx.Rollback or SQL (COMMIT, ROLLBACK, END,
// ABORT, PREPARE TRANSACTION), has its message dead-lettered as permanent,
// and tx runs no statement after that. Savepoints (tx.Begin) are fine. In
// a processed store's transaction, SET CONSTRAINTS ALL IMMEDIATE fails (it
// would fire the store's commit guard): name your constraints instead, and
// CLOSE ALL closes the cursor the store's commit checks for, so the message
// is dead-lettered as if the handler had ended tx: close your cursors by
// name. Any side effect outside tx (an HTTP call, a publish) is not
// covered by the exactly-once guarantee; use an outbox for those.
//
// Returning nil commits. An error rolls back the effect and the claim
// together; the message is retried unless the error was made by Permanent.
type Handler func(ctx context.Context, tx pgx.Tx, msg *Message) error

// Middleware wraps a Handler, for cross-cutting concerns such as tracing or
// logging. Middleware runs inside the transaction, after the claim: it only
// sees messages that are new.
type Middleware func(Handler) Handler

// chain applies middleware to h so that the first middleware is the
// outermost.
func chain(h Handler, mw ...Middleware) Handler {
	for i := len(mw) - 1; i >= 0; i-- {
		h = mw[i](h)
	}
	return h
}

// JSON adapts a handler of decoded values to a Handler. It decodes each
// message body as JSON into a T and calls h with it. A body that is not
// valid JSON for T can never succeed, so it is returned as a permanent
// error: the message is dead-lettered at once (ClassPermanent) with the
// decode error as the reason, and never retried. Errors from h are returned
// as they are.
func JSON[T any](h func(ctx context.Context, tx pgx.Tx, msg *Message, v T) error) Handler {
	return func(ctx context.Context, tx pgx.Tx, msg *Message) error {
		var v T
		if err := json.Unmarshal(msg.Body, &v); err != nil {
			return Permanent(fmt.Errorf("decode JSON body into %T: %w", v, err))
		}
		return h(ctx, tx, msg, v)
	}
}
