package consumer

import (
	"context"
	"time"

	"github.com/jackc/pgx/v5"
)

// BatchHandler applies the effects of a whole batch of new messages inside
// tx, the transaction that holds their dedup claims: for example with one
// multi-row INSERT or a COPY. It only receives messages whose claim is new,
// in delivery order. Returning an error rolls back the batch; the runtime
// then splits it to isolate the failing message, which is retried and
// dead-lettered on its own, so one bad message never sinks the others.
type BatchHandler func(ctx context.Context, tx pgx.Tx, msgs []*Message) error

// HookBatch is called after each batch transaction commits, with the
// number of deliveries in the batch and how many of them were new.
type HookBatch interface {
	Hook
	OnBatch(ctx context.Context, size, applied int, dur time.Duration)
}
