package dlq

import (
	"context"
	"errors"
	"fmt"
	"io"
	"time"

	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/processed"
)

// RequeueConfig configures Requeue.
type RequeueConfig struct {
	// Browser reads the dead-letter queue. Required. Requeue closes it.
	Browser Browser
	// Publish sends msg to destination, a queue or topic (the message's
	// original source, or Destination), and returns once the broker
	// durably accepted it: wrap a broker adapter's Publisher. Required.
	Publish func(ctx context.Context, destination string, msg *consumer.Message) error
	// Destination overrides where messages go. Defaults to each
	// message's original source (x-idemq-source).
	Destination string
	// Store, if set, is checked first: already-applied messages are
	// removed from the dead-letter queue without being republished, and
	// fingerprint mismatches stay in it. Without it every selected message
	// is republished, which is still safe: the consumer dedupes. Use the
	// live consumer's *processed.Store, or its *processed.Sharded, which
	// finds a message's own row where an id has one per shard key.
	Store interface {
		Lookup(ctx context.Context, consumerName, messageID string) (processed.Row, error)
	}
	// Consumer is the dedup scope for Store. Defaults to each message's
	// x-idemq-consumer.
	Consumer string
	// Filter, Limit, Rate, Force and VerifyKeys are as for Replay.
	// Requeue publishes to each message's x-idemq-source, so without
	// VerifyKeys a forged envelope chooses where it goes.
	Filter Filter
	Limit  int
	Rate   float64
	// Retention is the dedup retention for the replay-horizon guard, as
	// for Replay: a fingerprint mismatch is dated by when its original was
	// applied, and with Store set one whose original's row is gone is
	// refused; without Store, a mismatch envelope that does not say when
	// its original was applied (x-idemq-original-processed-at) is refused.
	// Requeue has no consumer configuration to take it from: set it to the
	// live consumer's consumer.Config.Retention. Defaults to 0: no guard.
	Retention  time.Duration
	Force      bool
	VerifyKeys [][]byte
	// Progress, if set, is called after each message.
	Progress func(RequeueResult)
}

// RequeueResult counts what Requeue did.
type RequeueResult struct {
	Scanned       int64 `json:"scanned"`
	Republished   int64 `json:"republished"`
	Skipped       int64 `json:"skipped_already_applied"`
	Mismatched    int64 `json:"mismatched_left"`
	MissingID     int64 `json:"missing_id_left"`
	BeyondHorizon int64 `json:"beyond_horizon"`
	Malformed     int64 `json:"malformed"`
	Unverified    int64 `json:"unverified"`
	// Truncated counts dead letters left in the queue because they were
	// cut to fit the broker (HeaderTruncated): never republished.
	Truncated int64 `json:"truncated_left"`
}

// Requeue is the alternative replay mode: instead of running a handler here,
// it publishes each selected dead-lettered message back to its original
// queue or topic, where the live consumer applies it through its dedup path,
// and then removes it from the dead-letter queue. The publish is confirmed
// before the dead-letter copy is acked, so nothing is lost; a crash in
// between yields a duplicate that the consumer skips.
func Requeue(ctx context.Context, cfg RequeueConfig) (RequeueResult, error) {
	var res RequeueResult
	if cfg.Browser == nil || cfg.Publish == nil {
		return res, &consumer.ConfigError{Field: "Browser/Publish", Reason: "required"}
	}
	defer cfg.Browser.Close()
	verify, err := newVerifier(cfg.VerifyKeys)
	if err != nil {
		return res, err
	}
	rate := newLimiter(cfg.Rate)
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
	if cfg.Force {
		guard.retention = 0
	}
	progress := func() {
		if cfg.Progress != nil {
			cfg.Progress(res)
		}
	}
	for done := int64(0); cfg.Limit <= 0 || done < int64(cfg.Limit); {
		d, err := cfg.Browser.Next(ctx)
		if errors.Is(err, io.EOF) {
			return res, nil
		}
		if err != nil {
			return res, fmt.Errorf("dlq: read dead-letter queue: %w", err)
		}
		res.Scanned++
		msg := d.Message()
		rec, err := readRecord(msg)
		switch {
		case err != nil:
			res.Malformed++
			continue
		case !filter.Match(rec):
			continue
		case !verify.trusted(msg):
			res.Unverified++
			progress()
			continue
		case rec.Truncated != "":
			res.Truncated++
			progress()
			continue
		}
		beyond, err := guard.check(ctx, rec, msg, time.Now())
		if err != nil {
			return res, err
		}
		if beyond != "" {
			res.BeyondHorizon++
			progress()
			continue
		}
		done++
		if rec.MessageID == "" {
			// A missing-id dead letter needs a human to give it an id.
			res.MissingID++
			progress()
			continue
		}
		if cfg.Store != nil {
			verdict, _, err := lookupVerdict(ctx, cfg.Store, scope(rec), rec, msg)
			if err != nil {
				return res, err
			}
			switch verdict {
			case VerdictAlreadyApplied:
				if err := d.Ack(ctx); err != nil {
					return res, fmt.Errorf("dlq: remove already-applied %q: %w", rec.MessageID, err)
				}
				res.Skipped++
				progress()
				continue
			case VerdictMismatch:
				res.Mismatched++
				progress()
				continue
			}
		}
		dest := cfg.Destination
		if dest == "" {
			dest = rec.Source
		}
		if dest == "" {
			return res, fmt.Errorf("dlq: message %q has no original source; set a destination", rec.MessageID)
		}
		if err := rate.wait(ctx); err != nil {
			return res, err
		}
		out := rec.Restore(msg)
		if err := cfg.Publish(ctx, dest, out); err != nil {
			return res, fmt.Errorf("dlq: republish %q to %s: %w", rec.MessageID, dest, err)
		}
		if err := d.Ack(ctx); err != nil {
			// Republished but still in the DLQ: a later replay finds
			// it applied and skips it.
			return res, fmt.Errorf("dlq: remove republished %q: %w", rec.MessageID, err)
		}
		res.Republished++
		progress()
	}
	return res, nil
}
