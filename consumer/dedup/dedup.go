// Package dedup is the contract between the runtime (package consumer) and
// its dedup store: the Store interface, the claims the runtime makes in a
// Store's transaction and their results, and what a Store reports (its
// Durability, the janitor's RetentionReport). Package processed implements
// it on Postgres; a handler writer never needs this package, as a
// database/sql user never needs database/sql/driver.
package dedup

import (
	"context"
	"fmt"
	"strings"
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
	// Route is where a sharded store keeps the claim; a store of one
	// database ignores it.
	Route Route
}

// Route says which shard of a sharded store holds a message's claim and
// effect.
type Route struct {
	// Shard is the shard the claim goes to, from 0.
	Shard int
	// Was is the shard the message went to under the shard map before a
	// reshard that is under way: the store checks it too, so that nothing
	// applied there is applied again. It equals Shard when no reshard is
	// under way, or the message stays where it was.
	Was int
	// Key is the shard key the map placed the message by, which the store
	// keeps with the claim so that a reshard can move its row.
	Key string
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
	// never delete one sooner. The janitor that consumer.Config.Retention starts
	// calls it with consumer.Config.Name.
	Purge(ctx context.Context, consumerName string, olderThan time.Duration) (int64, error)
	// MaxConns is the most transactions the store can have open at once:
	// its pool's size, 1 for a single connection, 0 if unknown. With 1,
	// consumer.New refuses a Concurrency above 1 and a Retention (a single
	// connection is not safe for concurrent use).
	MaxConns() int
}

// Durability is what an ack rests on: how many database servers hold a
// message's commit when its COMMIT returns, which is when the runtime acks.
// A Store with a Durability method (see Store) reads it; Run logs it when it
// starts, with a warning when a failover can lose acked messages, and
// `idemq status` prints it (its String).
type Durability struct {
	// Nodes is how many servers hold a commit when its COMMIT returns:
	// this one, plus the synchronous standbys a COMMIT waits for, which
	// SynchronousStandbyNames names (FIRST n or ANY n of them; one, for a
	// plain list). 0 on a standby.
	Nodes int
	// Quorum is true when SynchronousStandbyNames asks for ANY n: a COMMIT
	// waits for any n of the listed standbys, not for the first n.
	Quorum bool
	// SynchronousCommit is the synchronous_commit the claims' transactions
	// commit with: remote_write, on or remote_apply (the synchronous
	// standbys have written, flushed or applied the commit when it
	// returns; without them, all three wait for this server's flush).
	SynchronousCommit string
	// SynchronousStandbyNames is the server's synchronous_standby_names:
	// "" when no COMMIT waits for a standby.
	SynchronousStandbyNames string
	// Standby is true when the server is itself a standby (in recovery):
	// it takes no writes, so no claim commits there.
	Standby bool
	// Synchronous and Asynchronous name the physical standbys streaming
	// from the server (their application_name), by their sync_state in
	// pg_stat_replication: sync and quorum ones confirm commits; async and
	// potential ones do not, so a failover to one of them can lose acked
	// messages.
	Synchronous, Asynchronous []string
	// Unknown counts the standbys whose sync_state the Store's role may
	// not read (pg_stat_replication shows it to superusers and members of
	// pg_read_all_stats) while SynchronousStandbyNames is set; without it,
	// every standby is asynchronous.
	Unknown int
}

// String says in words what a commit rests on when the runtime acks, such
// as "a commit is on 2 nodes before the ack (this primary and synchronous
// standby s1; synchronous_commit=on)".
func (d Durability) String() string {
	if d.Standby {
		return "none: this server is a standby (in recovery), where no claim can commit; the database URL must reach the primary"
	}
	var b strings.Builder
	fmt.Fprintf(&b, "a commit is on %s before the ack (", countNoun(d.Nodes, "node", "nodes"))
	want := d.Nodes - 1
	switch {
	case want <= 0 && len(d.Synchronous)+len(d.Asynchronous)+d.Unknown == 0:
		b.WriteString("this server; no standby streams from it")
	case want <= 0:
		b.WriteString("this primary")
	case d.Quorum:
		fmt.Fprintf(&b, "this primary and any %d of the quorum standbys%s", want, standbyList(d.Synchronous, " "))
		if len(d.Synchronous) > want {
			b.WriteString(", so a failover must promote the most advanced")
		}
	default:
		fmt.Fprintf(&b, "this primary and %s%s", countNoun(want, "synchronous standby", "synchronous standbys"), standbyList(d.Synchronous, ", "))
	}
	if want > 0 {
		fmt.Fprintf(&b, "; synchronous_commit=%s", d.SynchronousCommit)
		switch d.SynchronousCommit {
		case "remote_write":
			b.WriteString(": they have written it, not flushed it")
		case "remote_apply":
			b.WriteString(": they have applied it")
		}
	}
	for _, w := range d.Warnings() {
		b.WriteString("; " + w)
	}
	if d.Unknown > 0 {
		fmt.Fprintf(&b, "; %s whose sync_state this role cannot read (grant it pg_read_all_stats)",
			countNoun(d.Unknown, "standby streams", "standbys stream"))
	}
	b.WriteString(")")
	return b.String()
}

// Warnings says what, in d, can lose acked messages or stall commits: the
// runtime's Run logs each as a warning.
func (d Durability) Warnings() []string {
	if d.Standby {
		return nil // String says it; the warning is Run's own
	}
	var w []string
	if n := len(d.Asynchronous); n > 0 {
		w = append(w, fmt.Sprintf("%s%s: a failover to %s can lose acked messages",
			countNoun(n, "standby streams asynchronously", "standbys stream asynchronously"), standbyList(d.Asynchronous, ", "), pluralNoun(n, "it", "one of them")))
	}
	if want := d.Nodes - 1; want > 0 && d.Unknown == 0 && len(d.Synchronous) < want {
		w = append(w, fmt.Sprintf("only %d of the %d synchronous standbys a COMMIT waits for %s connected: COMMITs wait until enough are",
			len(d.Synchronous), want, pluralNoun(len(d.Synchronous), "is", "are")))
	}
	return w
}

// ageBounds are the upper bounds of a RetentionReport's duplicate-age
// buckets (see AgeBounds).
var ageBounds = []time.Duration{
	time.Second, 10 * time.Second, time.Minute, 5 * time.Minute, 15 * time.Minute, 30 * time.Minute,
	time.Hour, 2 * time.Hour, 4 * time.Hour, 8 * time.Hour, 12 * time.Hour, 24 * time.Hour,
	48 * time.Hour, 72 * time.Hour, 7 * 24 * time.Hour, 14 * 24 * time.Hour, 30 * 24 * time.Hour,
}

// AgeBounds returns the upper bounds of a RetentionReport's duplicate-age
// buckets, 1s to 30 days: Buckets[i] counts the duplicates whose age was at
// most AgeBounds()[i], and the last bucket, Buckets[len(AgeBounds())],
// those older than every bound.
func AgeBounds() []time.Duration { return append([]time.Duration(nil), ageBounds...) }

// AgeBucket returns the index of the bucket that counts a duplicate of age
// age.
func AgeBucket(age time.Duration) int {
	i := 0
	for i < len(ageBounds) && age > ageBounds[i] {
		i++
	}
	return i
}

// RetentionReport is what the runtime's janitor saw in one JanitorInterval: the ages
// of the duplicates it skipped (the evidence for the retention), the
// source's horizon, and what it purged.
type RetentionReport struct {
	Consumer               string
	WindowStart, WindowEnd time.Time
	// Duplicates is the number of duplicates in the window; Buckets[i]
	// counts those whose age (now minus the original's processed_at) was
	// at most the i-th bound of the runtime's fixed bucket bounds (1s to
	// 30 days), the last bucket those older than every
	// bound. MaxAge is the oldest.
	Duplicates int64
	Buckets    []int64
	MaxAge     time.Duration
	// Retention is consumer.Config.Retention.
	Retention time.Duration
	// Horizon is the source's redelivery horizon, zero if none.
	Horizon time.Time
	// HorizonState says what the horizon did to the purge: "none" (the
	// source has no RedeliveryHorizon), "clear" (nothing redeliverable),
	// "within" (the horizon is within the retention), "held" (the purge
	// was held back to the horizon), "unknown" or "error" (no purge).
	HorizonState string
	// PurgedOlderThan is the age the janitor purged by: Retention, or
	// longer when the horizon held it back; 0 if it did not purge.
	PurgedOlderThan time.Duration
	// Purged counts the rows purged.
	Purged int64
}

// countNoun renders "1 node", "2 nodes".
func countNoun(n int, one, many string) string {
	return fmt.Sprintf("%d %s", n, pluralNoun(n, one, many))
}

func pluralNoun(n int, one, many string) string {
	if n == 1 {
		return one
	}
	return many
}

// standbyList renders standby names after sep, or nothing without any.
func standbyList(ns []string, sep string) string {
	if len(ns) == 0 {
		return ""
	}
	return sep + strings.Join(ns, ", ")
}

// Quantile returns the duplicate age below which about q (0 to 1) of the
// report's duplicates fell: the bound of the bucket that holds the q-th
// one, or MaxAge when that is lower or the bucket has no bound. It is 0
// for a report without duplicates.
func (r RetentionReport) Quantile(q float64) time.Duration {
	var total int64
	for _, n := range r.Buckets {
		total += n
	}
	if total == 0 {
		return 0
	}
	rank := int64(q*float64(total) + 0.999999)
	rank = max(1, min(rank, total))
	var seen int64
	for i, n := range r.Buckets {
		seen += n
		if seen >= rank {
			if i < len(ageBounds) && (r.MaxAge == 0 || ageBounds[i] < r.MaxAge) {
				return ageBounds[i]
			}
			return r.MaxAge
		}
	}
	return r.MaxAge
}
