package consumer

import (
	"context"
	"time"

	"github.com/jackc/pgx/v5"
)

// DB begins transactions: a *pgxpool.Pool, or a *pgx.Conn with Concurrency 1.
// A pgx.Tx satisfies the interface but Config.validate refuses it: its
// Begin starts a savepoint, whose release is not durable.
type DB interface {
	Begin(ctx context.Context) (pgx.Tx, error)
}

// Claim asks the dedup store to record that a consumer is applying a message.
type Claim struct {
	// Consumer is the dedup scope: the consumer's name.
	Consumer string
	// MessageID is the id being claimed.
	MessageID string
	// Fingerprint is the sha256 of the payload.
	Fingerprint [32]byte
	// Source, Partition and Offset are kept for forensics only.
	Source    string
	Partition int32
	Offset    int64
}

// ClaimOutcome says what a claim found.
type ClaimOutcome int

const (
	// ClaimNew: the id was not yet recorded; the row is now inserted in
	// the caller's transaction and the handler should run.
	ClaimNew ClaimOutcome = iota + 1
	// ClaimDuplicate: the id was already committed with the same
	// fingerprint. The handler must not run; the message is acked.
	ClaimDuplicate
	// ClaimMismatch: the id was already committed with a different
	// fingerprint: the same id for a different payload, a producer bug.
	// The message is dead-lettered, never applied silently.
	ClaimMismatch
)

// String returns "new", "duplicate" or "mismatch".
func (o ClaimOutcome) String() string {
	switch o {
	case ClaimNew:
		return "new"
	case ClaimDuplicate:
		return "duplicate"
	case ClaimMismatch:
		return "mismatch"
	default:
		return "unknown"
	}
}

// ClaimResult is the answer to a Claim.
type ClaimResult struct {
	Outcome ClaimOutcome
	// ProcessedAt is when the existing row was committed, for duplicates
	// and mismatches. It is zero for ClaimNew.
	ProcessedAt time.Time
}

// Store is the dedup store. Package processed provides the Postgres
// implementation; other implementations must give the same guarantee:
// Claim inserts in the caller's transaction, so the claim commits or rolls
// back together with the handler's effect, and a concurrent claim of the same
// id waits for the first transaction to finish rather than both succeeding.
type Store interface {
	Claim(ctx context.Context, tx pgx.Tx, c Claim) (ClaimResult, error)
}

// ClaimQueuer is an optional extension of Store for stores whose claim is one
// statement. The runtime queues that statement on the batch that begins the
// message's transaction (see [pgx.Batch.BeginTx]), so BEGIN and the claim
// cost one round trip instead of two. *processed.Store implements it.
type ClaimQueuer interface {
	// QueueClaim queues c's claim on b, which begins the transaction.
	// Once b has been sent and closed, the runtime calls finish with the
	// transaction and the error the batch's Close returned. finish returns
	// what Claim would have: the outcome, for which it may run further
	// statements in tx (to tell a duplicate from a mismatch), or sendErr
	// translated as Claim translates its errors.
	QueueClaim(b *pgx.Batch, c Claim) (finish func(ctx context.Context, tx pgx.Tx, sendErr error) (ClaimResult, error))
}

// Purger deletes dedup rows older than a retention window. The runtime's
// optional janitor calls it; *processed.Store implements it.
type Purger interface {
	Purge(ctx context.Context, olderThan time.Duration) (int64, error)
}

// BatchStore is a Store that claims many ids in one statement. Batch mode
// uses it when the Store implements it, and falls back to one Claim per
// message otherwise. *processed.Store implements it.
type BatchStore interface {
	Store
	// ClaimBatch claims every element of claims in tx, with the same
	// semantics as Claim; results[i] answers claims[i]. The claims share
	// one Consumer and have distinct message ids.
	ClaimBatch(ctx context.Context, tx pgx.Tx, claims []Claim) ([]ClaimResult, error)
}
