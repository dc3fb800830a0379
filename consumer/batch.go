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

// BatchAcker is implemented by sources that can settle many deliveries in
// fewer broker calls than one per delivery (RabbitMQ multiple acks, Kafka
// offset commits). When the Source implements it, the runtime acks every
// committed transaction's deliveries through it, a group's or a single
// one's alike; acks of dead-lettered deliveries go through Delivery.Ack.
type BatchAcker interface {
	// AckBatch acks every delivery in ds, which this source delivered,
	// after their effects committed. It may send the acks later than the
	// call (RabbitMQ waits until no unsettled delivery lies below them, to
	// use one multiple ack), never earlier; the source must send whatever
	// still waits when it is closed.
	AckBatch(ctx context.Context, ds []Delivery) error
}

// HookBatch is called after each batch transaction commits, with the
// number of deliveries in the batch and how many of them were new.
type HookBatch interface {
	Hook
	OnBatch(ctx context.Context, size, applied int, dur time.Duration)
}
