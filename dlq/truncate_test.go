package dlq_test

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/dlq"
)

// size is how a broker in these tests counts a message: its body and its
// headers' names and values.
func size(m *consumer.Message) int {
	n := len(m.Body)
	for k, v := range m.Headers {
		n += len(k) + len(v)
	}
	return n
}

// limitedDeadLetterer dead-letters to the memory broker's DLQ through a
// publish that refuses, as a broker does, every message over limit bytes.
// refused counts the refusals.
func limitedDeadLetterer(t *testing.T, e *memEnv, limit int, opts dlq.Options, refused *atomic.Int64) consumer.DeadLetterer {
	t.Helper()
	dl, err := dlq.NewDeadLetterer(func(ctx context.Context, m *consumer.Message) error {
		if n := size(m); n > limit {
			refused.Add(1)
			return fmt.Errorf("test broker: message of %d bytes over its %d-byte limit: %w", n, limit, consumer.ErrMessageTooLarge)
		}
		return e.broker.Publish(ctx, memDLQ, m)
	}, opts)
	if err != nil {
		t.Fatal(err)
	}
	return dl
}

// TestDeadLetterTooLargeForTheBroker: a message the broker accepted, whose
// dead letter (the envelope's headers added) the broker refuses, still
// reaches the DLQ, truncated: the first Options.PreviewBytes of its body,
// its original size and SHA-256, its coordinates and its small headers,
// signed. The consumer never stalls on it.
func TestDeadLetterTooLargeForTheBroker(t *testing.T) {
	t.Parallel()
	e := newMemEnv(t)
	key := bytes.Repeat([]byte("k"), 32)
	var refused atomic.Int64
	e.dl = limitedDeadLetterer(t, e, 4096, dlq.Options{SigningKey: key}, &refused)
	e.broken.Store(true)
	body := []byte(`{"order":1,"pad":"` + strings.Repeat("x", 4000-len(`{"order":1,"pad":""}`)) + `"}`)
	if err := e.broker.Publish(context.Background(), memQueue, &consumer.Message{ID: "big-1", Body: body,
		Headers: map[string]string{"traceparent": "00-abc-def-01"}}); err != nil {
		t.Fatal(err)
	}
	if s := e.consume(); s.DeadLettered != 1 {
		t.Fatalf("stats %+v, want 1 dead-lettered", s)
	}
	if refused.Load() != 1 {
		t.Fatalf("the broker refused %d publishes, want 1 (the whole envelope)", refused.Load())
	}
	msgs := e.broker.Messages(memDLQ)
	if len(msgs) != 1 {
		t.Fatalf("%d dead letters, want 1", len(msgs))
	}
	dead := msgs[0]
	rec, err := dlq.Parse(dead)
	if err != nil {
		t.Fatal(err)
	}
	sum := sha256.Sum256(body)
	if rec.Truncated != "body" || rec.OriginalSize != int64(len(body)) || rec.OriginalSHA256 != hex.EncodeToString(sum[:]) {
		t.Fatalf("record %+v: want truncated, headers kept, size %d, sha256 %x", rec, len(body), sum)
	}
	if !bytes.Equal(dead.Body, body[:1024]) {
		t.Fatalf("the truncated body is %d bytes, want the first %d of the original", len(dead.Body), 1024)
	}
	if rec.MessageID != "big-1" || rec.Class != consumer.ClassPermanent || !strings.Contains(rec.Error, "cannot parse order") {
		t.Fatalf("the failure is lost: %+v", rec)
	}
	if dead.Header("traceparent") != "00-abc-def-01" || rec.Source != memQueue {
		t.Fatalf("the header or the coordinates are lost: %v, source %q", dead.Headers, rec.Source)
	}
	if err := dlq.Verify(dead, key); err != nil {
		t.Fatalf("the truncated envelope does not verify: %v", err)
	}
}

// TestDeadLetterTooLargeHeaders: when even the truncated body with the
// original headers does not fit, the original headers go too, and the
// envelope says so.
func TestDeadLetterTooLargeHeaders(t *testing.T) {
	t.Parallel()
	e := newMemEnv(t)
	var refused atomic.Int64
	e.dl = limitedDeadLetterer(t, e, 3000, dlq.Options{}, &refused)
	e.broken.Store(true)
	if err := e.broker.Publish(context.Background(), memQueue, &consumer.Message{ID: "hdr-1", Body: []byte("{}"),
		Headers: map[string]string{"big": strings.Repeat("h", 2900), "small": "s"}}); err != nil {
		t.Fatal(err)
	}
	if s := e.consume(); s.DeadLettered != 1 {
		t.Fatalf("stats %+v, want 1 dead-lettered", s)
	}
	msgs := e.broker.Messages(memDLQ)
	if len(msgs) != 1 {
		t.Fatalf("%d dead letters, want 1", len(msgs))
	}
	rec, err := dlq.Parse(msgs[0])
	if err != nil {
		t.Fatal(err)
	}
	if rec.Truncated != "headers" || rec.OriginalSize != 2 {
		t.Fatalf("record %+v: want truncated with headers dropped", rec)
	}
	if _, ok := msgs[0].Headers["big"]; ok {
		t.Fatal("the header that did not fit is still there")
	}
	if msgs[0].Header("small") != "s" {
		t.Fatal("a header that fits was dropped")
	}
}

// TestDeadLetterNothingFits: a broker that refuses even the smallest
// envelope gets an error wrapping consumer.ErrMessageTooLarge, after a
// bounded number of attempts.
func TestDeadLetterNothingFits(t *testing.T) {
	t.Parallel()
	e := newMemEnv(t)
	var refused atomic.Int64
	dl := limitedDeadLetterer(t, e, 10, dlq.Options{}, &refused)
	err := dl.DeadLetter(context.Background(), &consumer.Message{ID: "m-1", Body: []byte("body"), Source: memQueue, Partition: -1, Offset: -1},
		consumer.Failure{Consumer: "billing", MessageID: "m-1", Class: consumer.ClassPermanent, Err: errors.New("bad")})
	if !errors.Is(err, consumer.ErrMessageTooLarge) {
		t.Fatalf("DeadLetter: %v, want ErrMessageTooLarge", err)
	}
	if n := refused.Load(); n > 3 {
		t.Fatalf("%d attempts, want at most 3", n)
	}
}

// truncatedDLQ leaves one truncated dead letter of "big-1" in the DLQ, with
// the handler fixed since.
func truncatedDLQ(t *testing.T) *memEnv {
	t.Helper()
	e := newMemEnv(t)
	var refused atomic.Int64
	e.dl = limitedDeadLetterer(t, e, 4096, dlq.Options{}, &refused)
	e.broken.Store(true)
	if err := e.broker.Publish(context.Background(), memQueue, &consumer.Message{ID: "big-1", Body: bytes.Repeat([]byte("x"), 4000)}); err != nil {
		t.Fatal(err)
	}
	e.publish(1) // o-000, small: dead-lettered whole
	if s := e.consume(); s.DeadLettered != 2 {
		t.Fatalf("stats %+v, want 2 dead-lettered", s)
	}
	e.broken.Store(false)
	return e
}

// TestReplayNeverAppliesATruncatedBody: a replay, its dry run, a requeue
// and inspect all tell a truncated dead letter apart, and none of them
// runs or republishes its body: it stays in the DLQ.
func TestReplayNeverAppliesATruncatedBody(t *testing.T) {
	t.Parallel()
	ctx := context.Background()

	e := truncatedDLQ(t)
	rep, err := dlq.Inspect(ctx, e.browser(), dlq.Filter{}, 0)
	if err != nil {
		t.Fatal(err)
	}
	if rep.Total != 2 || rep.Truncated != 1 || len(rep.Groups) != 1 || rep.Groups[0].Truncated != 1 {
		t.Fatalf("inspect %+v", rep)
	}
	c, err := dlq.Classify(ctx, dlq.ClassifyConfig{Browser: e.browser(), Store: e.store})
	if err != nil {
		t.Fatal(err)
	}
	if c.Truncated != 1 || c.WillApply != 1 {
		t.Fatalf("dry run %+v, want 1 truncated and 1 to apply", c)
	}
	for _, it := range c.Items {
		if it.Record.MessageID == "big-1" && it.Verdict != dlq.VerdictTruncated {
			t.Fatalf("the truncated dead letter's verdict is %q", it.Verdict)
		}
	}
	res := e.replay(nil)
	if res.Truncated != 1 || res.Applied != 1 {
		t.Fatalf("replay %+v, want 1 truncated left and 1 applied", res)
	}
	if rows, _ := e.effectCount(); rows != 1 {
		t.Fatalf("%d effects, want 1 (the truncated body must not be applied)", rows)
	}
	if n := e.broker.Ready(memDLQ); n != 1 {
		t.Fatalf("%d dead letters left, want the truncated one", n)
	}

	e = truncatedDLQ(t)
	var republished []string
	rq, err := dlq.Requeue(ctx, dlq.RequeueConfig{Browser: e.browser(),
		Publish: func(_ context.Context, _ string, m *consumer.Message) error {
			republished = append(republished, m.ID)
			return nil
		}})
	if err != nil {
		t.Fatal(err)
	}
	if rq.Truncated != 1 || rq.Republished != 1 || len(republished) != 1 || republished[0] != "o-000" {
		t.Fatalf("requeue %+v republished %v", rq, republished)
	}
	if n := e.broker.Ready(memDLQ); n != 1 {
		t.Fatalf("%d dead letters left, want the truncated one", n)
	}
}
