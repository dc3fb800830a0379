package dlq_test

// Regression tests for issue 14, items 2 to 4: the replay-horizon guard
// dates a fingerprint mismatch by its original, ReplayConfig.Retention
// defaults to the consumer's, and a replay runs no janitor. Every helper
// here starts with "edge".

import (
	"context"
	"errors"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/dlq"
	"github.com/idemq/idemq/processed"
)

// The timeline: the original was applied 70 h before its
// mismatching copy was dead-lettered, and the janitor (72 h retention) ran
// 3 h after that, removing the original's row. "Now" is just after that
// purge.
const (
	edgeRetention       = 72 * time.Hour
	edgeSinceDeadLetter = 3 * time.Hour
	edgeAppliedBefore   = 70 * time.Hour
)

// edgeTable is the store's dedup table, quoted.
func edgeTable(s *processed.Store) string {
	return pgx.Identifier(strings.SplitN(s.String(), ".", 2)).Sanitize()
}

// edgeMismatchAfterPurge applies one message through the live consumer,
// dates its dedup row back, dead-letters a copy with the same id and
// another body as the runtime does for a fingerprint mismatch (with the
// original's processed_at in the Failure if withProcessedAt; an envelope
// from before the header existed otherwise), and purges the row as the
// janitor would 3 h later. It returns the id, which has one effect row.
func edgeMismatchAfterPurge(t *testing.T, e *rmqEnv, withProcessedAt bool) string {
	t.Helper()
	orig := rmqMessages("pay", 1)[0]
	e.publish(e.queue, orig)
	if s := e.consume(1); s.Applied != 1 {
		t.Fatalf("live consumer: %+v", s)
	}
	now := time.Now()
	deadLetteredAt := now.Add(-edgeSinceDeadLetter)
	appliedAt := deadLetteredAt.Add(-edgeAppliedBefore)
	tag, err := e.pool.Exec(e.ctx, "UPDATE "+edgeTable(e.store)+" SET processed_at = $3 WHERE consumer = $1 AND message_id = $2",
		rmqConsumerName, orig.ID, appliedAt)
	if err != nil || tag.RowsAffected() != 1 {
		t.Fatalf("date the dedup row back: %v (%d rows)", err, tag.RowsAffected())
	}

	copyMsg := orig.Clone()
	copyMsg.Body = []byte(`{"payment":"` + orig.ID + `","cents":999999}`)
	copyMsg.Source, copyMsg.Partition, copyMsg.Offset = e.queue, -1, -1
	f := consumer.Failure{Consumer: rmqConsumerName, MessageID: orig.ID, Class: consumer.ClassFingerprintMismatch,
		Err:          errors.New("message id " + orig.ID + " was applied with a different payload"),
		FirstFailure: deadLetteredAt, LastFailure: deadLetteredAt}
	if withProcessedAt {
		f.ProcessedAt = appliedAt // what the runtime fills in for a mismatch
	}
	if err := e.dl.DeadLetter(e.ctx, copyMsg, f); err != nil {
		t.Fatal(err)
	}
	e.waitDepth(e.dlqName, 1)

	if n, err := e.store.Purge(e.ctx, rmqConsumerName, edgeRetention); err != nil || n != 1 {
		t.Fatalf("purge: %d rows, %v; want the original's row", n, err)
	}
	if _, err := e.store.Lookup(e.ctx, rmqConsumerName, orig.ID); !errors.Is(err, processed.ErrNotFound) {
		t.Fatalf("the original's row survived the purge: %v", err)
	}
	return orig.ID
}

// TestEdgeReplayMismatchAfterPurge is issue 14 item 3 on RabbitMQ: a
// fingerprint-mismatch dead letter whose original was applied 70 h before
// it, replayed with Retention 72h after the purge removed the original's
// row, is refused (and the dry run says so) instead of applying a second,
// different effect. Also for an envelope written before
// x-idemq-original-processed-at existed: the row's absence is what refuses it.
func TestEdgeReplayMismatchAfterPurge(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name   string
		header bool
	}{{"header", true}, {"old-envelope", false}} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			e := rmqNewEnv(t)
			id := edgeMismatchAfterPurge(t, e, tc.header)
			if tc.header {
				m := e.dlqContents()[0]
				r, err := dlq.Parse(m)
				if err != nil {
					t.Fatal(err)
				}
				if m.Header("x-idemq-original-processed-at") == "" || time.Since(r.ProcessedAt) < edgeAppliedBefore {
					t.Fatalf("envelope without the original's processed_at: %q, %v", m.Header("x-idemq-original-processed-at"), r.ProcessedAt)
				}
			}

			c, err := dlq.Classify(e.ctx, dlq.ClassifyConfig{Browser: e.browser(), Store: e.store, Retention: edgeRetention})
			if err != nil {
				t.Fatal(err)
			}
			if c.BeyondHorizon != 1 || len(c.Items) != 1 || !strings.Contains(c.Items[0].HorizonReason, "gone") {
				t.Errorf("dry run does not see the mismatch beyond the horizon: %+v", c)
			}

			res := e.replay(func(c *dlq.ReplayConfig) { c.Retention = edgeRetention })
			if res.BeyondHorizon != 1 || res.Applied != 0 || res.Matched != 0 {
				t.Errorf("replay: %+v, want BeyondHorizon:1 Applied:0", res)
			}
			e.expectEffects(id)
			e.waitDepth(e.dlqName, 1)
		})
	}
}

// TestEdgeRequeueMismatchAfterPurge is the same for Requeue, with and
// without a Store: with one, the original's row is gone; without one, the
// envelope's x-idemq-original-processed-at dates it 73 h back, and a mismatch
// envelope without it cannot be dated, so both are refused.
func TestEdgeRequeueMismatchAfterPurge(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name          string
		header, store bool
	}{{"header/store", true, true}, {"header/no-store", true, false}, {"old-envelope/store", false, true}, {"old-envelope/no-store", false, false}} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			e := rmqNewEnv(t)
			id := edgeMismatchAfterPurge(t, e, tc.header)
			cfg := dlq.RequeueConfig{
				Browser:   e.browser(),
				Retention: edgeRetention,
				Publish: func(ctx context.Context, dest string, m *consumer.Message) error {
					return e.pub.Publish(ctx, "", dest, m)
				},
			}
			if tc.store {
				cfg.Store = e.store
			}
			res, err := dlq.Requeue(e.ctx, cfg)
			if err != nil {
				t.Fatal(err)
			}
			if res.BeyondHorizon != 1 || res.Republished != 0 {
				t.Fatalf("requeue: %+v, want BeyondHorizon:1 Republished:0", res)
			}
			e.waitDepth(e.dlqName, 1)
			e.waitDepth(e.queue, 0)
			e.expectEffects(id)
		})
	}
}

// TestEdgeMismatchWithinHorizon: the guard still lets a mismatch through
// when its original's row exists and is young enough (the replay then
// dead-letters it again, applying nothing), and dates it by the original
// even though its own failure is recent.
func TestEdgeMismatchWithinHorizon(t *testing.T) {
	t.Parallel()
	e := newMemEnv(t)
	ctx := context.Background()
	e.publish(1)
	e.consume()
	const id = "o-000"
	now := time.Now()
	m := dlq.Envelope(&consumer.Message{ID: id, Body: []byte(`{"order":"other"}`), Source: memQueue, Partition: -1, Offset: -1},
		consumer.Failure{Consumer: "billing", MessageID: id, Class: consumer.ClassFingerprintMismatch, Err: errors.New("mismatch"),
			FirstFailure: now, LastFailure: now, ProcessedAt: now.Add(-time.Hour)}, dlq.Options{})
	if err := e.broker.Publish(ctx, memDLQ, m); err != nil {
		t.Fatal(err)
	}
	c, err := dlq.Classify(ctx, dlq.ClassifyConfig{Browser: e.browser(), Store: e.store, Retention: edgeRetention})
	if err != nil {
		t.Fatal(err)
	}
	if c.BeyondHorizon != 0 || c.Mismatch != 1 {
		t.Fatalf("dry run: %+v", c)
	}
	c, err = dlq.Classify(ctx, dlq.ClassifyConfig{Browser: e.browser(), Store: e.store, Retention: 30 * time.Minute})
	if err != nil {
		t.Fatal(err)
	}
	if c.BeyondHorizon != 1 || !strings.Contains(c.Items[0].HorizonReason, "original applied") {
		t.Fatalf("dry run with a retention shorter than the original's age: %+v", c)
	}
	res := e.replay(func(c *dlq.ReplayConfig) { c.Retention = edgeRetention })
	if res.BeyondHorizon != 0 || res.Mismatched != 1 || res.Applied != 0 {
		t.Fatalf("replay: %+v", res)
	}
	if rows, _ := e.effectCount(); rows != 1 {
		t.Fatalf("%d effect rows, want 1", rows)
	}
}

// edgeOldDeadLetter puts a permanent-failure dead letter first seen 100 h
// ago in the memory DLQ.
func edgeOldDeadLetter(t *testing.T, e *memEnv) {
	t.Helper()
	old := time.Now().Add(-100 * time.Hour)
	m := dlq.Envelope(&consumer.Message{ID: "old-1", Body: []byte("b"), Source: memQueue, Partition: -1, Offset: -1},
		consumer.Failure{Consumer: "billing", MessageID: "old-1", Class: consumer.ClassPermanent,
			Err: errors.New("x"), FirstFailure: old, LastFailure: old}, dlq.Options{})
	if err := e.broker.Publish(context.Background(), memDLQ, m); err != nil {
		t.Fatal(err)
	}
}

// edgeReplay runs dlq.Replay as the README shows it, with the live
// consumer's configuration and nothing else, and reports how long it took.
func edgeReplay(t *testing.T, e *memEnv, cfg consumer.Config, mod func(*dlq.ReplayConfig)) (dlq.Result, time.Duration) {
	t.Helper()
	rc := dlq.ReplayConfig{Browser: e.browser(), Consumer: cfg}
	if mod != nil {
		mod(&rc)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	start := time.Now()
	res, err := dlq.Replay(ctx, rc)
	if err != nil {
		t.Fatal(err)
	}
	return res, time.Since(start)
}

// TestEdgeReplayRetentionDefaultsToConsumer is issue 14 item 4: following
// the README (ReplayConfig{Browser, Consumer: cfg}) with a consumer whose
// Retention is set, an over-horizon dead letter is refused: the guard takes
// the consumer's Retention. Force still replays it.
func TestEdgeReplayRetentionDefaultsToConsumer(t *testing.T) {
	t.Parallel()
	e := newMemEnv(t)
	edgeOldDeadLetter(t, e)
	cfg := e.config(nil)
	cfg.Retention = edgeRetention

	res, _ := edgeReplay(t, e, cfg, nil)
	if res.BeyondHorizon != 1 || res.Applied != 0 || e.broker.Ready(memDLQ) != 1 {
		t.Fatalf("replay with the consumer's Retention let an over-horizon dead letter through: %+v, DLQ %d", res, e.broker.Ready(memDLQ))
	}
	if rows, _ := e.effectCount(); rows != 0 {
		t.Fatalf("%d effect rows, want 0", rows)
	}
	res, _ = edgeReplay(t, e, cfg, func(c *dlq.ReplayConfig) { c.Force = true })
	if res.Applied != 1 || e.broker.Ready(memDLQ) != 0 {
		t.Fatalf("forced replay: %+v", res)
	}
}

// edgePurger counts the purges the runtime asks for.
type edgePurger struct {
	*processed.Store
	calls atomic.Int64
}

func (p *edgePurger) Purge(ctx context.Context, consumerName string, olderThan time.Duration) (int64, error) {
	p.calls.Add(1)
	return p.Store.Purge(ctx, consumerName, olderThan)
}

// TestEdgeReplayWithRetentionReturnsWithoutPurging is issue 14 item 2 seen
// from dlq: a replay given a live consumer's configuration with Retention
// set returns as soon as the DLQ has been read, and runs no purge of its
// own (which could remove the rows the guard just relied on).
func TestEdgeReplayWithRetentionReturnsWithoutPurging(t *testing.T) {
	t.Parallel()
	e := newMemEnv(t)
	e.broken.Store(true)
	e.publish(3)
	e.consume()
	e.broken.Store(false)
	cfg := e.config(nil)
	cfg.Retention = edgeRetention
	purger := &edgePurger{Store: e.store}
	cfg.Store = purger

	res, took := edgeReplay(t, e, cfg, nil)
	if res.Applied != 3 || res.BeyondHorizon != 0 {
		t.Fatalf("replay: %+v", res)
	}
	// The browser reports the end after 200ms without a message.
	if took > 5*time.Second {
		t.Fatalf("replay took %s to return at the end of the DLQ", took)
	}
	if n := purger.calls.Load(); n != 0 {
		t.Fatalf("the replay ran %d purges", n)
	}
}

// TestEnvelopeOriginalProcessedAt: the original's processed_at round
// trips through the envelope, is covered by the signature, and moves into
// the history (and out of the header) when the message is dead-lettered
// again for another reason.
func TestEnvelopeOriginalProcessedAt(t *testing.T) {
	t.Parallel()
	at := time.Date(2026, 11, 1, 12, 0, 0, 7, time.UTC)
	applied := at.Add(-70 * time.Hour)
	msg := &consumer.Message{ID: "m-1", Body: []byte("{}"), Source: "orders", Partition: -1, Offset: -1}
	f := consumer.Failure{Consumer: "billing", MessageID: "m-1", Class: consumer.ClassFingerprintMismatch,
		Err: errors.New("mismatch"), FirstFailure: at, LastFailure: at, ProcessedAt: applied}
	env := dlq.Envelope(msg, f, dlq.Options{Host: "h", SigningKey: signKey})
	if got := env.Header("x-idemq-original-processed-at"); got != applied.Format(time.RFC3339Nano) {
		t.Fatalf("header %q", got)
	}
	r, err := dlq.Parse(env)
	if err != nil || !r.ProcessedAt.Equal(applied) {
		t.Fatalf("parsed %v, %v", r.ProcessedAt, err)
	}
	if err := dlq.Verify(env, signKey); err != nil {
		t.Fatal(err)
	}
	for _, v := range []string{"", at.Format(time.RFC3339Nano)} {
		forged := env.Clone()
		if v == "" {
			delete(forged.Headers, "x-idemq-original-processed-at")
		} else {
			forged.Headers["x-idemq-original-processed-at"] = v
		}
		if err := dlq.Verify(forged, signKey); !errors.Is(err, dlq.ErrBadSignature) {
			t.Fatalf("header changed to %q and the signature still verifies: %v", v, err)
		}
	}
	// An envelope from before the header existed, signed then, verifies.
	oldF := f
	oldF.ProcessedAt = time.Time{}
	if old := dlq.Envelope(msg, oldF, dlq.Options{Host: "h", SigningKey: signKey}); dlq.Verify(old, signKey) != nil {
		t.Fatal("signed envelope without the header does not verify")
	}
	bad := env.Clone()
	bad.Headers["x-idemq-original-processed-at"] = "yesterday"
	if _, err := dlq.Parse(bad); err == nil || !strings.Contains(err.Error(), "x-idemq-original-processed-at") {
		t.Fatalf("malformed header: %v", err)
	}

	again := dlq.Envelope(env, consumer.Failure{Consumer: "billing", MessageID: "m-1", Class: consumer.ClassPermanent,
		Err: errors.New("x"), FirstFailure: at.Add(time.Hour), LastFailure: at.Add(time.Hour)}, dlq.Options{Host: "h"})
	if _, ok := again.Headers["x-idemq-original-processed-at"]; ok {
		t.Fatal("the header outlived the failure it describes")
	}
	r, err = dlq.Parse(again)
	if err != nil || len(r.History) != 1 || !r.History[0].ProcessedAt.Equal(applied) || !r.ProcessedAt.IsZero() {
		t.Fatalf("history %+v, %v", r.History, err)
	}
}

// TestEdgeRuntimeMismatchAfterPurge is issue 14 item 3 end to end on
// RabbitMQ: the real runtime dead-letters a mismatching copy with the
// original's processed_at (consumer.Failure.ProcessedAt), the janitor's
// purge removes the original's row, and neither Replay nor Requeue (which
// without a Store has only the envelope to go by) applies the copy. The
// dead-letterer shifts the failure's times back 3 h, as if the copy had
// been dead-lettered then; the original's row is dated to match.
func TestEdgeRuntimeMismatchAfterPurge(t *testing.T) {
	t.Parallel()
	e := rmqNewEnv(t)
	orig := rmqMessages("pay", 1)[0]
	e.publish(e.queue, orig)
	if s := e.consume(1); s.Applied != 1 {
		t.Fatalf("live consumer: %+v", s)
	}
	table := edgeTable(e.store)
	appliedAt := time.Now().Add(-edgeAppliedBefore).Truncate(time.Microsecond)
	if _, err := e.pool.Exec(e.ctx, "UPDATE "+table+" SET processed_at = $3 WHERE consumer = $1 AND message_id = $2",
		rmqConsumerName, orig.ID, appliedAt); err != nil {
		t.Fatal(err)
	}

	var seen atomic.Value // the Failure the runtime gave the dead-letterer
	cfg := e.config(e.source(e.queue))
	cfg.DeadLetterer = consumer.DeadLettererFunc(func(ctx context.Context, m *consumer.Message, f consumer.Failure) error {
		seen.Store(f)
		f.FirstFailure = f.FirstFailure.Add(-edgeSinceDeadLetter)
		f.LastFailure = f.LastFailure.Add(-edgeSinceDeadLetter)
		if !f.ProcessedAt.IsZero() {
			f.ProcessedAt = f.ProcessedAt.Add(-edgeSinceDeadLetter)
		}
		return e.dl.DeadLetter(ctx, m, f)
	})
	copyMsg := orig.Clone()
	copyMsg.Body = []byte(`{"payment":"` + orig.ID + `","cents":999999}`)
	e.publish(e.queue, copyMsg)
	if s := e.run(cfg, func(s consumer.Stats) bool { return s.DeadLettered == 1 && s.InFlight == 0 }); s.Applied != 0 {
		t.Fatalf("live consumer applied the mismatching copy: %+v", s)
	}
	f, _ := seen.Load().(consumer.Failure)
	if f.Class != consumer.ClassFingerprintMismatch || !f.ProcessedAt.Equal(appliedAt) {
		t.Errorf("runtime dead-lettered %s with ProcessedAt %v, want the original's %v", f.Class, f.ProcessedAt, appliedAt)
	}
	e.waitDepth(e.dlqName, 1)

	// The janitor, 3 h later: the original's row is 73 h old.
	if _, err := e.pool.Exec(e.ctx, "UPDATE "+table+" SET processed_at = processed_at - $1::interval WHERE consumer = $2",
		edgeSinceDeadLetter.String(), rmqConsumerName); err != nil {
		t.Fatal(err)
	}
	if n, err := e.store.Purge(e.ctx, rmqConsumerName, edgeRetention); err != nil || n != 1 {
		t.Fatalf("purge: %d rows, %v", n, err)
	}

	res := e.replay(func(c *dlq.ReplayConfig) { c.Retention = edgeRetention })
	if res.BeyondHorizon != 1 || res.Applied != 0 {
		t.Errorf("replay: %+v, want BeyondHorizon:1 Applied:0", res)
	}
	rq, err := dlq.Requeue(e.ctx, dlq.RequeueConfig{Browser: e.browser(), Retention: edgeRetention,
		Publish: func(ctx context.Context, dest string, m *consumer.Message) error {
			return e.pub.Publish(ctx, "", dest, m)
		}})
	if err != nil {
		t.Fatal(err)
	}
	if rq.BeyondHorizon != 1 || rq.Republished != 0 {
		t.Errorf("requeue without a store: %+v, want BeyondHorizon:1 Republished:0", rq)
	}
	e.expectEffects(orig.ID)
	e.waitDepth(e.dlqName, 1)
}
