package dlq

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"time"

	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/processed"
)

// lookuper finds a message's dedup row: the Store of ClassifyConfig and
// RequeueConfig. *processed.Store and *processed.Sharded implement it.
type lookuper = interface {
	Lookup(ctx context.Context, consumerName, messageID string) (processed.Row, error)
}

// messageLookuper is a lookuper that tells apart the rows one id has under
// different shard keys, and finds a message's own: *processed.Sharded.
type messageLookuper interface {
	LookupMessage(ctx context.Context, consumerName, messageID string, msg *consumer.Message) (processed.Row, error)
}

// lookupRow finds the dedup row of the dead letter msg, whose envelope is
// r: by the message its consumer saw (r.Restore) where the store can, so
// that on a table keyed by shard key another key's row of the same id is
// not taken for its own; by its id otherwise.
func lookupRow(ctx context.Context, store lookuper, scope string, r Record, msg *consumer.Message) (processed.Row, error) {
	if ml, ok := store.(messageLookuper); ok {
		return ml.LookupMessage(ctx, scope, r.MessageID, r.Restore(msg))
	}
	return store.Lookup(ctx, scope, r.MessageID)
}

// Verdict is what a replay would do with one message.
type Verdict string

// Verdicts.
const (
	// VerdictAlreadyApplied: the id is in the dedup table with the same
	// fingerprint; replay skips it and removes it from the queue.
	VerdictAlreadyApplied Verdict = "already-applied"
	// VerdictWillApply: the id is not in the dedup table; replay runs the
	// handler.
	VerdictWillApply Verdict = "will-apply"
	// VerdictMismatch: the id is in the dedup table with a different
	// fingerprint; replay dead-letters it again.
	VerdictMismatch Verdict = "fingerprint-mismatch"
	// VerdictMissingID: the message has no dedup id; replay dead-letters it
	// again.
	VerdictMissingID Verdict = "missing-id"
	// VerdictUnverified: ClassifyConfig.VerifyKeys is set and the
	// envelope is not signed by any of them; replay leaves it in the queue.
	VerdictUnverified Verdict = "unverified"
	// VerdictTruncated: the dead letter was cut to fit the broker
	// (HeaderTruncated); replay leaves it in the queue, never applying a
	// body that is not whole.
	VerdictTruncated Verdict = "truncated"
)

// Item is one classified message.
type Item struct {
	Record  Record  `json:"record"`
	Verdict Verdict `json:"verdict"`
	// AppliedAt is the dedup row's time, for already-applied and
	// mismatched messages.
	AppliedAt time.Time `json:"applied_at,omitzero"`
	// BeyondHorizon reports that the message's dedup row may have been
	// purged (see ReplayConfig.Retention): replay refuses it without Force.
	BeyondHorizon bool `json:"beyond_horizon"`
	// HorizonReason says why, when BeyondHorizon is set: how old the
	// message or its original is, or that a fingerprint mismatch's
	// original row is gone.
	HorizonReason string `json:"horizon_reason,omitempty"`
}

// Classification is the result of a dry run.
type Classification struct {
	Items          []Item `json:"items"`
	Scanned        int    `json:"scanned"`
	AlreadyApplied int    `json:"already_applied"`
	WillApply      int    `json:"will_apply"`
	Mismatch       int    `json:"fingerprint_mismatch"`
	MissingID      int    `json:"missing_id"`
	Unverified     int    `json:"unverified"`
	Truncated      int    `json:"truncated"`
	BeyondHorizon  int    `json:"beyond_horizon"`
	Malformed      int    `json:"malformed"`
}

// ClassifyConfig configures Classify.
type ClassifyConfig struct {
	// Browser reads the dead-letter queue. Required. Classify closes it,
	// which gives every message back: a dry run consumes nothing.
	Browser Browser
	// Store answers whether an id was applied: the live consumer's
	// *processed.Store, or its *processed.Sharded (whose LookupMessage
	// finds a message's own row where an id has one per shard key).
	// Required.
	Store interface {
		Lookup(ctx context.Context, consumerName, messageID string) (processed.Row, error)
	}
	// Consumer is the dedup scope to check. Defaults to each message's
	// x-idemq-consumer.
	Consumer string
	// Filter, Limit and VerifyKeys are as for Replay.
	Filter Filter
	Limit  int
	// Retention is the dedup retention for the replay-horizon guard, as
	// for Replay (a fingerprint mismatch is dated by its original, whose
	// row is looked up in Store). Classify has no consumer configuration
	// to take it from: set it to the live consumer's
	// consumer.Config.Retention. Defaults to 0: no item is beyond the
	// horizon.
	Retention  time.Duration
	VerifyKeys [][]byte
	// Progress, if set, is called after each classified message.
	Progress func(Classification)
}

// Classify is the dry run of Replay: it reads the dead-letter queue, checks
// each selected message against the dedup table and reports what a replay
// would do. It acks nothing.
func Classify(ctx context.Context, cfg ClassifyConfig) (Classification, error) {
	var out Classification
	if cfg.Browser == nil || cfg.Store == nil {
		return out, &consumer.ConfigError{Field: "Browser/Store", Reason: "required"}
	}
	defer cfg.Browser.Close()
	verify, err := newVerifier(cfg.VerifyKeys)
	if err != nil {
		return out, err
	}
	filter := cfg.Filter
	if cfg.Consumer != "" {
		filter.Consumer = cfg.Consumer
	}
	scope := func(r Record) string {
		if cfg.Consumer != "" {
			return cfg.Consumer
		}
		return r.Consumer
	}
	guard := horizon{retention: cfg.Retention, lookup: cfg.Store, scope: scope}
	now := time.Now()
	for cfg.Limit <= 0 || len(out.Items) < cfg.Limit {
		d, err := cfg.Browser.Next(ctx)
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			return out, fmt.Errorf("dlq: read dead-letter queue: %w", err)
		}
		out.Scanned++
		msg := d.Message()
		rec, err := readRecord(msg)
		if err != nil {
			out.Malformed++
			continue
		}
		if !filter.Match(rec) {
			continue
		}
		reason, err := guard.check(ctx, rec, msg, now)
		if err != nil {
			return out, err
		}
		it := Item{Record: rec, BeyondHorizon: reason != "", HorizonReason: reason}
		// An envelope without an id is a missing-id dead letter: never
		// fall back to a broker-made id, which would apply it under an id
		// no producer gave it.
		id := rec.MessageID
		switch {
		case !verify.trusted(msg):
			it.Verdict = VerdictUnverified
		case rec.Truncated != "":
			it.Verdict = VerdictTruncated
		case id == "":
			it.Verdict = VerdictMissingID
		default:
			it.Verdict, it.AppliedAt, err = lookupVerdict(ctx, cfg.Store, scope(rec), rec, msg)
		}
		if err != nil {
			return out, err
		}
		out.add(it)
		if cfg.Progress != nil {
			cfg.Progress(out)
		}
	}
	return out, nil
}

func (c *Classification) add(it Item) {
	c.Items = append(c.Items, it)
	switch it.Verdict {
	case VerdictAlreadyApplied:
		c.AlreadyApplied++
	case VerdictWillApply:
		c.WillApply++
	case VerdictMismatch:
		c.Mismatch++
	case VerdictMissingID:
		c.MissingID++
	case VerdictUnverified:
		c.Unverified++
	case VerdictTruncated:
		c.Truncated++
	}
	if it.BeyondHorizon {
		c.BeyondHorizon++
	}
}

// lookupVerdict checks the dead letter msg, whose envelope is r, against
// the dedup table.
func lookupVerdict(ctx context.Context, store lookuper, scope string, r Record, msg *consumer.Message) (Verdict, time.Time, error) {
	row, err := lookupRow(ctx, store, scope, r, msg)
	switch {
	case errors.Is(err, processed.ErrNotFound):
		return VerdictWillApply, time.Time{}, nil
	case err != nil:
		return "", time.Time{}, fmt.Errorf("dlq: look up %q: %w", r.MessageID, err)
	}
	fp := msg.Fingerprint()
	if !bytes.Equal(row.Fingerprint, fp[:]) {
		return VerdictMismatch, row.ProcessedAt, nil
	}
	return VerdictAlreadyApplied, row.ProcessedAt, nil
}
