package console

import (
	"context"
	"errors"
	"fmt"
	"io"
	"slices"
	"time"

	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/dlq"
)

// readRecord is what dlq's browsing functions read: the envelope, or for a
// message without one, a record made from the message.
func readRecord(msg *consumer.Message) (dlq.Record, error) {
	r, err := dlq.Parse(msg)
	if errors.Is(err, dlq.ErrNoEnvelope) {
		return dlq.Record{Entry: dlq.Entry{MessageID: msg.ID, Source: msg.Source, Partition: -1, Offset: -1}}, nil
	}
	return r, err
}

// groupBrowser passes on only the messages of one failure fingerprint; the
// others stay unacked, so the underlying browser gives them back at Close.
type groupBrowser struct {
	dlq.Browser
	fingerprint string
}

func (b *groupBrowser) Next(ctx context.Context) (consumer.Delivery, error) {
	for {
		d, err := b.Browser.Next(ctx)
		if err != nil {
			return nil, err
		}
		rec, err := readRecord(d.Message())
		if err == nil && rec.Entry.Fingerprint() == b.fingerprint {
			return d, nil
		}
	}
}

// selection is what an action or a dry run applies to: a group of one
// queue, and optionally some of its message ids.
type selection struct {
	DLQ         string   `json:"dlq"`
	Fingerprint string   `json:"fingerprint"`
	IDs         []string `json:"ids,omitempty"`
}

// lockWait is how long a page waits for a queue another request browses.
var lockWait = 10 * time.Second

// withConn opens the queue named id and runs fn, holding the queue's lock.
func (s *Server) withConn(ctx context.Context, id string, publish bool, fn func(*Conn) error) error {
	q, ok := s.dlqs[id]
	if !ok {
		return fmt.Errorf("no dead-letter queue %q", id)
	}
	lock := s.locks[id]
	wait := time.NewTimer(lockWait)
	defer wait.Stop()
	select {
	case lock <- struct{}{}:
	case <-wait.C:
		return fmt.Errorf("%s %s is busy: a replay is running on it; try again when it ends", q.Broker, q.Name)
	case <-ctx.Done():
		return fmt.Errorf("%s %s is busy: %w", q.Broker, q.Name, context.Cause(ctx))
	}
	defer func() { <-lock }()
	c, err := q.Open(ctx, publish)
	if err != nil {
		return fmt.Errorf("open %s %s: %w", q.Broker, q.Name, err)
	}
	defer c.Close()
	return fn(c)
}

// groupRow is one failure group of one queue.
type groupRow struct {
	DLQ DLQ
	dlq.Group
}

// inspect groups every queue's dead letters, as `idemq dlq inspect` does.
func (s *Server) inspect(ctx context.Context, only string, f dlq.Filter) ([]groupRow, []error) {
	return s.inspectTimes(ctx, only, f, nil)
}

// inspectTimes is inspect, telling times, if not nil, when each dead letter
// it groups was dead-lettered: the charts' data, read in the same pass.
func (s *Server) inspectTimes(ctx context.Context, only string, f dlq.Filter, times *deadLetterTimes) ([]groupRow, []error) {
	var (
		out  []groupRow
		errs []error
	)
	for _, q := range s.cfg.DLQs {
		if only != "" && q.ID() != only {
			continue
		}
		err := s.withConn(ctx, q.ID(), false, func(c *Conn) error {
			b := c.Browser
			var rec *recordingBrowser
			if times != nil {
				rec = &recordingBrowser{Browser: b, filter: f, out: times}
				b = rec
			}
			rep, err := dlq.Inspect(ctx, b, f, s.cfg.ScanLimit, s.cfg.VerifyKeys...)
			for _, g := range rep.Groups {
				out = append(out, groupRow{DLQ: q, Group: g})
			}
			if rec != nil && rep.Total >= s.cfg.ScanLimit {
				times.truncated = append(times.truncated, q.ID())
			}
			return err
		})
		if err != nil {
			errs = append(errs, err)
		}
	}
	slices.SortStableFunc(out, func(a, b groupRow) int { return b.Count - a.Count })
	return out, errs
}

// envelope is one dead letter as the group page shows it.
type envelope struct {
	Index     int
	Msg       *consumer.Message
	Record    dlq.Record
	ParseErr  string
	Signature string // "verified", "unsigned", "bad signature", or "" without keys
	Timeline  []dlq.Entry
}

// groupPage reads the page-th page of a group's envelopes and counts them
// all.
func (s *Server) groupPage(ctx context.Context, sel selection, page int) (items []envelope, total int, err error) {
	start := (page - 1) * s.cfg.PageSize
	err = s.withConn(ctx, sel.DLQ, false, func(c *Conn) error {
		b := &groupBrowser{Browser: c.Browser, fingerprint: sel.Fingerprint}
		for scanned := 0; scanned < s.cfg.ScanLimit; scanned++ {
			d, err := b.Next(ctx)
			if errors.Is(err, io.EOF) {
				return nil
			}
			if err != nil {
				return err
			}
			total++
			if total <= start || total > start+s.cfg.PageSize {
				continue
			}
			msg := d.Message()
			e := envelope{Index: total, Msg: msg}
			rec, perr := readRecord(msg)
			if perr != nil {
				e.ParseErr = perr.Error()
			}
			e.Record = rec
			e.Timeline = timeline(rec)
			if len(s.cfg.VerifyKeys) > 0 {
				_, signed := msg.Headers["x-idemq-signature"]
				switch verr := dlq.Verify(msg, s.cfg.VerifyKeys...); {
				case verr == nil:
					e.Signature = "verified"
				case !signed:
					e.Signature = "unsigned"
				default:
					e.Signature = "bad signature"
				}
			}
			items = append(items, e)
		}
		return nil
	})
	return items, total, err
}

// timeline is a record's failures, oldest first: its history, then its
// latest failure.
func timeline(r dlq.Record) []dlq.Entry {
	out := append([]dlq.Entry(nil), r.History...)
	if r.Class != "" {
		out = append(out, r.Entry)
	}
	slices.SortStableFunc(out, func(a, b dlq.Entry) int { return a.LastFailure.Compare(b.LastFailure) })
	return out
}

// classify is the dry run of sel (dlq.Classify, as `idemq dlq replay
// --dry-run`).
func (s *Server) classify(ctx context.Context, sel selection) (dlq.Classification, error) {
	var cl dlq.Classification
	err := s.withConn(ctx, sel.DLQ, false, func(c *Conn) error {
		var err error
		cl, err = dlq.Classify(ctx, dlq.ClassifyConfig{Browser: &groupBrowser{Browser: c.Browser, fingerprint: sel.Fingerprint},
			Store: s.lookup, Filter: dlq.Filter{MessageIDs: sel.IDs}, Limit: s.cfg.ScanLimit,
			Retention: s.cfg.Retention, VerifyKeys: s.cfg.VerifyKeys})
		return err
	})
	return cl, err
}

// dryCounts are a dry run's counts, as the confirmation and the audit show
// them.
type dryCounts struct {
	Selected       int `json:"selected"`
	AlreadyApplied int `json:"already_applied"`
	WillApply      int `json:"will_apply"`
	Mismatch       int `json:"fingerprint_mismatch"`
	BeyondHorizon  int `json:"beyond_horizon"`
	Unverified     int `json:"unverified"`
	MissingID      int `json:"missing_id"`
	Truncated      int `json:"truncated"`
}

func countsOf(cl dlq.Classification) dryCounts {
	return dryCounts{Selected: len(cl.Items), AlreadyApplied: cl.AlreadyApplied, WillApply: cl.WillApply, Mismatch: cl.Mismatch,
		BeyondHorizon: cl.BeyondHorizon, Unverified: cl.Unverified, MissingID: cl.MissingID, Truncated: cl.Truncated}
}

// tile is one count of a dry run, as the dry-run page shows it.
type tile struct {
	Key   string // its data-count
	Count int
	Label string
	Note  string
	// tone is the colour of a count that is not zero: "ok" and "info" for
	// what a replay settles, "warn" and "bad" for what it leaves in the
	// queue for a human.
	tone string
}

// Class is the tile's CSS class: a zero is calm whatever the tile, so
// only a count of a bad outcome that is not zero takes a warning colour.
func (t tile) Class() string {
	if t.Count == 0 {
		return "tile-zero"
	}
	return "tile-" + t.tone
}

// tiles are the counts as the dry-run page shows them, in order.
func (c dryCounts) tiles() []tile {
	const left = "left in the queue"
	return []tile{
		{Key: "already-applied", Count: c.AlreadyApplied, Label: "already applied", Note: "replay removes them, republishes nothing", tone: "ok"},
		{Key: "will-apply", Count: c.WillApply, Label: "will apply", tone: "info"},
		{Key: "fingerprint-mismatch", Count: c.Mismatch, Label: "fingerprint mismatch", Note: left, tone: "bad"},
		{Key: "beyond-horizon", Count: c.BeyondHorizon, Label: "beyond the retention horizon", Note: left, tone: "warn"},
		{Key: "unverified", Count: c.Unverified, Label: "unverified signature", Note: left, tone: "bad"},
		{Key: "missing-id", Count: c.MissingID, Label: "without an id", Note: left, tone: "warn"},
		{Key: "truncated", Count: c.Truncated, Label: "truncated to fit the broker", Note: left + ": the body is not whole", tone: "warn"},
	}
}

// requeue runs an action on sel. "replay" is `idemq dlq replay`: each
// message is checked against the dedup table first (already applied:
// removed, not republished; fingerprint mismatch: left), the others are
// republished to their source, where the consumer applies them once.
// "requeue" republishes every selected message to its source as it is,
// leaving the dedup check to the consumer. Both keep the horizon guard and
// signature checks, and are rate-limited.
func (s *Server) requeue(ctx context.Context, action string, sel selection, progress func(dlq.RequeueResult)) (dlq.RequeueResult, error) {
	var res dlq.RequeueResult
	err := s.withConn(ctx, sel.DLQ, true, func(c *Conn) error {
		if c.Publish == nil {
			return errors.New("this queue cannot be republished from")
		}
		cfg := dlq.RequeueConfig{Browser: &groupBrowser{Browser: c.Browser, fingerprint: sel.Fingerprint}, Publish: c.Publish,
			Filter: dlq.Filter{MessageIDs: sel.IDs}, Limit: s.cfg.ScanLimit, Rate: s.cfg.Rate, Retention: s.cfg.Retention,
			VerifyKeys: s.cfg.VerifyKeys, Progress: progress}
		if action == "replay" {
			cfg.Store = s.lookup
		}
		var err error
		res, err = dlq.Requeue(ctx, cfg)
		return err
	})
	return res, err
}

// parseWhen reads a filter time: RFC 3339, a datetime-local value (UTC),
// or a duration ago such as 24h.
func parseWhen(s string, now time.Time) (time.Time, error) {
	if s == "" {
		return time.Time{}, nil
	}
	for _, layout := range []string{time.RFC3339Nano, "2006-01-02T15:04", "2006-01-02T15:04:05", "2006-01-02"} {
		if t, err := time.Parse(layout, s); err == nil {
			return t, nil
		}
	}
	if d, err := time.ParseDuration(s); err == nil && d >= 0 {
		return now.Add(-d), nil
	}
	return time.Time{}, fmt.Errorf("%q: want an RFC 3339 time or a duration ago such as 24h", s)
}
