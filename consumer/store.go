package consumer

import (
	"context"
	"time"

	"github.com/jackc/pgx/v5"
)

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

// Store is the runtime's one Postgres handle: it begins the transactions the
// handlers run in, records the claims in them, and purges old claims.
// Package processed provides it ([processed.Open] makes one with its own
// pool); consumer.Config takes nothing else from the database.
//
// Another implementation must give processed's guarantees: BeginClaim's
// transaction is READ COMMITTED and its commit is durable when Commit
// returns (the runtime acks then); a claim is an insert in that transaction,
// so it commits or rolls back with the handler's effect; a concurrent claim
// of the same id waits for the first transaction to end rather than both
// succeeding; and only the runtime commits the transaction. The runtime
// refuses a handler's tx.Commit and tx.Rollback, and any statement once the
// connection has left the transaction. The Store must also make the tx's
// Commit fail, committing nothing, with an error of SQLSTATE class 25
// (invalid transaction state) when the transaction open on the connection
// is no longer the one BeginClaim began, and make a COMMIT that a handler
// runs as SQL fail (processed does both, with a token per transaction and
// a deferred trigger).
//
// A Store may also have these methods, which the runtime finds when New
// is called (processed.Store has all three):
//
//	// Maintain runs the Store's own upkeep (on processed's partitioned
//	// layout: retiring and rotating the generations). The janitor calls
//	// it every JanitorInterval before it purges, whether or not it
//	// purges then.
//	Maintain(ctx context.Context) error
//	// RecordRetention keeps the janitor's report, one per
//	// JanitorInterval, for `idemq status` to weigh the retention against.
//	RecordRetention(ctx context.Context, r RetentionReport) error
//	// Durability reads how many servers hold a commit when it returns;
//	// Run reads it once, when it starts, and logs it (a warning for
//	// each way a failover can lose acked messages).
//	Durability(ctx context.Context) (Durability, error)
//
// [processed.Open]: https://pkg.go.dev/github.com/idemq/idemq/processed#Open
type Store interface {
	// BeginClaim begins a transaction and claims every element of claims
	// in it; results[i] answers claims[i]. The claims share one Consumer,
	// have distinct message ids and are sorted by message id, so that
	// concurrent batches take their locks in one order. A non-nil tx must
	// be rolled back by the caller unless it commits, also when err is not
	// nil.
	BeginClaim(ctx context.Context, claims []Claim) (tx pgx.Tx, results []ClaimResult, err error)
	// Ping reports whether the database answers: the runtime tells a lost
	// connection that is the message's fault from a database outage by it.
	Ping(ctx context.Context) error
	// Purge deletes the claims of the consumer named consumerName older
	// than olderThan, and never another consumer's claims younger than
	// their own purges allow, and returns how many rows went (a Store that
	// retires rows in bulk counts the bulk). It may keep claims longer,
	// never delete one sooner. The janitor that Config.Retention starts
	// calls it with Config.Name.
	Purge(ctx context.Context, consumerName string, olderThan time.Duration) (int64, error)
	// MaxConns is the most transactions the store can have open at once:
	// its pool's size, 1 for a single connection, 0 if unknown. With 1,
	// New refuses a Concurrency above 1 and a Retention (a single
	// connection is not safe for concurrent use).
	MaxConns() int
}
