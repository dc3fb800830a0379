package dlq_test

import (
	"context"
	"errors"
	"io"
	"strings"
	"testing"
	"time"

	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/dlq"
	"github.com/idemq/idemq/processed"
)

var (
	signKey  = []byte("0123456789abcdef0123456789abcdef")
	oldKey   = []byte("fedcba9876543210fedcba9876543210")
	otherKey = []byte("an attacker's key, not trusted!!")
)

func signedEnvelope(t *testing.T, key []byte) *consumer.Message {
	t.Helper()
	msg := &consumer.Message{ID: "pay-1", Body: []byte(`{"amount":100}`), Source: "payments", Partition: -1, Offset: -1,
		Headers: map[string]string{"trace": "abc"}}
	return dlq.Envelope(msg, failure(consumer.ClassPermanent, "bad amount", time.Now()), dlq.Options{Host: "h1", SigningKey: key})
}

func TestSignedEnvelopeVerifies(t *testing.T) {
	t.Parallel()
	m := signedEnvelope(t, signKey)
	if !strings.HasPrefix(m.Header("x-idemq-signature"), "v1=") {
		t.Fatalf("no signature header: %v", m.Headers)
	}
	if err := dlq.Verify(m, signKey); err != nil {
		t.Fatalf("Verify with the signing key: %v", err)
	}
	// Rotation: any of the keys may match.
	if err := dlq.Verify(m, oldKey, signKey); err != nil {
		t.Fatalf("Verify with the key second in the list: %v", err)
	}
	if err := dlq.Verify(m, otherKey); !errors.Is(err, dlq.ErrBadSignature) {
		t.Fatalf("Verify with another key = %v, want ErrBadSignature", err)
	}
	if err := dlq.Verify(m); !errors.Is(err, dlq.ErrBadSignature) {
		t.Fatalf("Verify with no keys = %v, want ErrBadSignature", err)
	}
	unsigned := dlq.Envelope(&consumer.Message{ID: "x"}, failure(consumer.ClassPermanent, "e", time.Now()), dlq.Options{})
	if _, ok := unsigned.Headers["x-idemq-signature"]; ok {
		t.Fatal("an envelope without a key got a signature")
	}
	if err := dlq.Verify(unsigned, signKey); !errors.Is(err, dlq.ErrBadSignature) || !strings.Contains(err.Error(), "not signed") {
		t.Fatalf("Verify unsigned = %v, want ErrBadSignature: not signed", err)
	}
	for _, bad := range []string{"v1=zz", "v2=" + strings.Repeat("0", 64), "", strings.Repeat("0", 64)} {
		c := m.Clone()
		c.Headers["x-idemq-signature"] = bad
		if err := dlq.Verify(c, signKey); !errors.Is(err, dlq.ErrBadSignature) {
			t.Fatalf("signature %q: Verify = %v, want ErrBadSignature", bad, err)
		}
	}
}

// TestSignatureCoversEnvelopeAndBody: changing anything a replay trusts
// breaks the signature.
func TestSignatureCoversEnvelopeAndBody(t *testing.T) {
	t.Parallel()
	tamper := map[string]func(m *consumer.Message){
		"source (where requeue publishes)": func(m *consumer.Message) { m.Headers["x-idemq-source"] = "admin-commands" },
		"consumer (the dedup scope)":       func(m *consumer.Message) { m.Headers["x-idemq-consumer"] = "other" },
		"message id (the dedup id)":        func(m *consumer.Message) { m.Headers["x-idemq-message-id"] = "pay-2" },
		"error class":                      func(m *consumer.Message) { m.Headers["x-idemq-error-class"] = "timeout" },
		"first failure (the horizon)": func(m *consumer.Message) {
			m.Headers["x-idemq-first-failure"] = time.Now().UTC().Format(time.RFC3339Nano)
		},
		"an added x-idemq header": func(m *consumer.Message) { m.Headers["x-idemq-partition"] = "3" },
		"an added X-IDEMQ header": func(m *consumer.Message) { m.Headers["X-Idemq-Source"] = "admin-commands" },
		"a removed header":        func(m *consumer.Message) { delete(m.Headers, "x-idemq-host") },
		"the body":                func(m *consumer.Message) { m.Body = []byte(`{"amount":100000}`) },
		"an empty body":           func(m *consumer.Message) { m.Body = nil },
		// Length prefixes: moving bytes between a name and a value, or
		// between two values, changes the MAC.
		"bytes moved between fields": func(m *consumer.Message) {
			m.Headers["x-idemq-host"] = "h"
			m.Headers["x-idemq-attempts"] = "1" + m.Headers["x-idemq-attempts"]
		},
	}
	for name, f := range tamper {
		m := signedEnvelope(t, signKey)
		f(m)
		if err := dlq.Verify(m, signKey); !errors.Is(err, dlq.ErrBadSignature) {
			t.Errorf("%s changed, Verify = %v, want ErrBadSignature", name, err)
		}
	}
	// Other headers are the producer's, carried as they are: not covered.
	m := signedEnvelope(t, signKey)
	m.Headers["trace"] = "changed"
	m.ID = "broker-assigned-id"
	if err := dlq.Verify(m, signKey); err != nil {
		t.Fatalf("a non-envelope header or the transport id broke the signature: %v", err)
	}
}

// TestReEnvelopeSignsAgain: a replayed message that fails again gets a new
// signature over its grown envelope, and none without a key.
func TestReEnvelopeSignsAgain(t *testing.T) {
	t.Parallel()
	first := signedEnvelope(t, signKey)
	again := dlq.Envelope(mustParse(t, first).Restore(first), failure(consumer.ClassPermanent, "still bad", time.Now()),
		dlq.Options{SigningKey: signKey})
	if again.Header("x-idemq-signature") == first.Header("x-idemq-signature") {
		t.Fatal("the second envelope kept the first signature")
	}
	if err := dlq.Verify(again, signKey); err != nil {
		t.Fatalf("second envelope: %v", err)
	}
	if r := mustParse(t, again); r.DeadLetters != 2 || len(r.History) != 1 {
		t.Fatalf("second envelope record: %+v", r)
	}
	plain := dlq.Envelope(mustParse(t, first).Restore(first), failure(consumer.ClassPermanent, "x", time.Now()), dlq.Options{})
	if _, ok := plain.Headers["x-idemq-signature"]; ok {
		t.Fatal("a stale signature survived re-enveloping without a key")
	}
}

func mustParse(t *testing.T, m *consumer.Message) dlq.Record {
	t.Helper()
	r, err := dlq.Parse(m)
	if err != nil {
		t.Fatal(err)
	}
	return r
}

func TestSigningKeyValidation(t *testing.T) {
	t.Parallel()
	short := []byte("too short")
	var cerr *consumer.ConfigError
	publish := func(context.Context, *consumer.Message) error { return nil }
	if _, err := dlq.NewDeadLetterer(publish, dlq.Options{SigningKey: short}); !errors.As(err, &cerr) || cerr.Field != "SigningKey" {
		t.Fatalf("NewDeadLetterer with a short key: %v", err)
	}
	if _, err := dlq.NewDeadLetterer(publish, dlq.Options{SigningKey: signKey}); err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	keys := [][]byte{signKey, short}
	if _, err := dlq.Requeue(ctx, dlq.RequeueConfig{Browser: emptyBrowser{}, Publish: func(context.Context, string, *consumer.Message) error { return nil },
		VerifyKeys: keys}); !errors.As(err, &cerr) || cerr.Field != "VerifyKeys[1]" {
		t.Fatalf("Requeue with a short key: %v", err)
	}
	if _, err := dlq.Classify(ctx, dlq.ClassifyConfig{Browser: emptyBrowser{}, Store: nopLookuper{}, VerifyKeys: keys}); !errors.As(err, &cerr) || cerr.Field != "VerifyKeys[1]" {
		t.Fatalf("Classify with a short key: %v", err)
	}
	if _, err := dlq.Inspect(ctx, emptyBrowser{}, dlq.Filter{}, 0, keys...); !errors.As(err, &cerr) || cerr.Field != "VerifyKeys[1]" {
		t.Fatalf("Inspect with a short key: %v", err)
	}
	if _, err := dlq.Replay(ctx, dlq.ReplayConfig{Browser: emptyBrowser{}, VerifyKeys: keys}); !errors.As(err, &cerr) || cerr.Field != "VerifyKeys[1]" {
		t.Fatalf("Replay with a short key: %v", err)
	}
}

type emptyBrowser struct{}

func (emptyBrowser) Next(context.Context) (consumer.Delivery, error) { return nil, io.EOF }
func (emptyBrowser) Close() error                                    { return nil }

type nopLookuper struct{}

func (nopLookuper) Lookup(context.Context, string, string) (processed.Row, error) {
	return processed.Row{}, processed.ErrNotFound
}

// TestReplayVerifiesSignatures: with VerifyKeys, replay applies only the
// dead letters the consumer signed. Forged ones (unsigned, or signed with
// another key) stay in the queue, unapplied, and are counted; a dry run
// reports them; a requeue does not publish them to the source they name.
func TestReplayVerifiesSignatures(t *testing.T) {
	t.Parallel()
	e := newMemEnv(t)
	ctx := context.Background()
	dl, err := dlq.NewDeadLetterer(func(ctx context.Context, m *consumer.Message) error {
		return e.broker.Publish(ctx, memDLQ, m)
	}, dlq.Options{SigningKey: signKey})
	if err != nil {
		t.Fatal(err)
	}
	e.dl = dl
	e.broken.Store(true)
	e.publish(5)
	if s := e.consume(); s.DeadLettered != 5 {
		t.Fatalf("bug run: %+v", s)
	}
	// Someone who can publish to the DLQ forges two dead letters for the
	// same consumer, one unsigned and one signed with an untrusted key,
	// naming another queue as their source.
	forge := func(id string, key []byte) *consumer.Message {
		m := &consumer.Message{ID: id, Body: []byte(`{"order":999}`), Source: "admin", Partition: -1, Offset: -1}
		f := failure(consumer.ClassPermanent, "x", time.Now())
		f.Consumer, f.MessageID = "billing", id
		return dlq.Envelope(m, f, dlq.Options{SigningKey: key})
	}
	if err := e.broker.Publish(ctx, memDLQ, forge("forged-1", nil), forge("forged-2", otherKey)); err != nil {
		t.Fatal(err)
	}
	e.broken.Store(false)

	rep, err := dlq.Inspect(ctx, e.browser(), dlq.Filter{}, 0, signKey)
	if err != nil {
		t.Fatal(err)
	}
	if rep.Total != 7 || rep.Unverified != 2 {
		t.Fatalf("inspect: %+v", rep)
	}
	if rep, err := dlq.Inspect(ctx, e.browser(), dlq.Filter{}, 0); err != nil || rep.Unverified != 0 {
		t.Fatalf("inspect without keys: %+v, %v", rep, err)
	}
	cl, err := dlq.Classify(ctx, dlq.ClassifyConfig{Browser: e.browser(), Store: e.store, VerifyKeys: [][]byte{signKey}})
	if err != nil {
		t.Fatal(err)
	}
	if cl.WillApply != 5 || cl.Unverified != 2 {
		t.Fatalf("dry run: %+v", cl)
	}
	requeued := 0
	rq, err := dlq.Requeue(ctx, dlq.RequeueConfig{Browser: e.browser(), Limit: 0, VerifyKeys: [][]byte{signKey},
		Publish: func(ctx context.Context, dest string, m *consumer.Message) error {
			if dest != memQueue {
				t.Errorf("requeue published to %q", dest)
			}
			requeued++
			return e.broker.Publish(ctx, dest, m)
		}})
	if err != nil {
		t.Fatal(err)
	}
	if rq.Republished != 5 || rq.Unverified != 2 || requeued != 5 || e.broker.Ready(memDLQ) != 2 {
		t.Fatalf("requeue: %+v (published %d, %d left in the DLQ)", rq, requeued, e.broker.Ready(memDLQ))
	}
	if s := e.consume(); s.Applied != 5 {
		t.Fatalf("consumer after requeue: %+v", s)
	}

	// Replay (in-process handler) leaves the forged ones too.
	res := e.replay(func(c *dlq.ReplayConfig) { c.VerifyKeys = [][]byte{oldKey, signKey} })
	if res.Applied != 0 || res.Unverified != 2 || res.Matched != 0 || e.broker.Ready(memDLQ) != 2 {
		t.Fatalf("replay: %+v, %d left in the DLQ", res, e.broker.Ready(memDLQ))
	}
	if rows, distinct := e.effectCount(); rows != 5 || distinct != 5 {
		t.Fatalf("effects %d/%d, want only the 5 signed messages", rows, distinct)
	}
	// Without keys the same replay trusts the envelopes: this is what
	// VerifyKeys protects against.
	if res := e.replay(nil); res.Applied != 2 {
		t.Fatalf("replay without keys: %+v", res)
	}
}
