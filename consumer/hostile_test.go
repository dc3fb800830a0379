package consumer_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"strings"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/jackc/pgx/v5"

	"github.com/idemq/idemq/brokers/memory"
	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/dlq"
)

const hostileDLQ = "work.dlq"

// order is the JSON body the hostile-input handler decodes.
type order struct {
	Kind string `json:"kind"` // ok, panic, hang, reject
	N    int    `json:"n"`
}

// decodingHandler is a handler as users write them: it decodes a JSON body
// and returns consumer.Permanent for input that can never succeed. Besides
// that, the body's Kind makes it panic, hang until its context ends, or
// reject the message.
func (b *bundle) decodingHandler(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
	if !utf8.Valid(m.Body) {
		return consumer.Permanent(errors.New("decode order: body is not valid UTF-8"))
	}
	var o order
	if err := json.Unmarshal(m.Body, &o); err != nil {
		return consumer.Permanent(fmt.Errorf("decode order: %w", err))
	}
	switch o.Kind {
	case "panic":
		panic(strings.Repeat("boom\x00\r\n\x1b[31m", 10_000)) // 130 KB of control characters
	case "hang":
		<-ctx.Done()
		return ctx.Err()
	case "reject":
		return consumer.Permanent(errors.New("order rejected"))
	}
	return b.insertEffect(ctx, tx, m)
}

func okBody(n int) []byte { return fmt.Appendf(nil, `{"kind":"ok","n":%d}`, n) }

// hostileHeaders has control characters, invalid UTF-8, an empty name and
// forged idemq envelope headers that do not parse.
func hostileHeaders() map[string]string {
	return map[string]string{
		"":                     "empty name",
		"nul\x00name":          "nul\x00value",
		"crlf\r\nInjected: 1":  "line1\r\nline2\n",
		"escape\x1b[2J":        "\x1b]0;title\x07",
		"bad-utf8-\xff\xfe":    "\xc3\x28\xa0\xa1",
		"x-idemq-history":      "[not json",
		"x-idemq-attempts":     "NaN",
		"x-idemq-partition":    "99999999999999999999",
		"x-idemq-offset":       "-x",
		"x-idemq-dead-letters": "many",
		"x-idemq-last-failure": "yesterday",
		"x-idemq-error-class":  "forged",
		"x-idemq-consumer":     "someone-else",
		"x-idemq-message-id":   "forged-id",
		"x-idemq-source":       "forged-source",
		"Idempotency-Key":      "",
	}
}

// TestHostileInput sends one hostile message at a time through the runtime
// (memory broker, real Postgres), followed by normal messages on the same
// key and on other keys. Each hostile message ends in the dead-letter queue
// with its class and a reason, its dead-letter envelope parses with
// dlq.Parse and keeps its headers; the normal messages are applied exactly
// once; the queue drains and the runtime stops cleanly.
func TestHostileInput(t *testing.T) {
	t.Parallel()
	huge := make(map[string]string, 10_000)
	for i := range 10_000 {
		huge[fmt.Sprintf("h-%05d\x01", i)] = strings.Repeat("v\x00", 50)
	}
	cases := []struct {
		name    string
		msgs    []*consumer.Message // the first ones may be normal set-up messages
		idFunc  func(*consumer.Message) (string, error)
		class   consumer.FailureClass
		reason  string // in the DLQ's error header
		dedupID string // the DLQ's message-id header
		apply   int    // effects expected from msgs (set-up messages)
		att     string // the DLQ's attempts header
	}{
		{name: "missing id", msgs: []*consumer.Message{{Body: okBody(1)}},
			class: consumer.ClassMissingID, reason: "message has no id", att: "0"},
		{name: "empty id from header", idFunc: consumer.IDFromHeader("Idempotency-Key"),
			msgs:  []*consumer.Message{{ID: "ignored", Body: okBody(1), Headers: map[string]string{"Idempotency-Key": ""}}},
			class: consumer.ClassMissingID, reason: "message has no id", att: "0"},
		{name: "id extraction error", idFunc: func(m *consumer.Message) (string, error) {
			if m.Header("sig") != "" {
				return "", errors.New("signature \x00 invalid")
			}
			return m.ID, nil
		}, msgs: []*consumer.Message{{ID: "h-1", Body: okBody(1), Headers: map[string]string{"sig": "x"}}},
			class: consumer.ClassMissingID, reason: "extract message id: signature \x00 invalid", att: "0"},
		{name: "id over the length bound", msgs: []*consumer.Message{{ID: strings.Repeat("\xff", 513), Body: okBody(1)}},
			class: consumer.ClassMissingID, reason: "message id is 513 bytes, over the 512-byte limit", att: "0"},
		{name: "id at the length bound", msgs: []*consumer.Message{
			{ID: strings.Repeat("i", 512), Body: okBody(1)},
			{ID: strings.Repeat("i", 512), Body: []byte(`{"kind":"reject"}`)}},
			class: consumer.ClassFingerprintMismatch, reason: "with a different payload", dedupID: strings.Repeat("i", 512), apply: 1, att: "0"},
		{name: "id with a NUL byte", msgs: []*consumer.Message{{ID: "h-\x00-1", Body: okBody(1)}},
			class: consumer.ClassMissingID, reason: "not valid UTF-8 text (or holds a NUL byte)", att: "0"},
		{name: "id not valid UTF-8", msgs: []*consumer.Message{{ID: "h-\xff\xfe", Body: okBody(1)}},
			class: consumer.ClassMissingID, reason: "not valid UTF-8 text (or holds a NUL byte)", att: "0"},
		{name: "id with control characters", msgs: []*consumer.Message{{ID: "h-\r\n\x1b[2J\x7f", Body: []byte(`{"kind":"reject"}`)}},
			class: consumer.ClassPermanent, reason: "order rejected", dedupID: "h-\r\n\x1b[2J\x7f", att: "1"},
		{name: "empty body", msgs: []*consumer.Message{{ID: "h-1"}},
			class: consumer.ClassPermanent, reason: "decode order: unexpected end of JSON input", dedupID: "h-1", att: "1"},
		{name: "oversized body", msgs: []*consumer.Message{{ID: "h-1", Body: append(okBody(1), make([]byte, 4096)...)}},
			class: consumer.ClassTooLarge, reason: "over the 4096-byte limit", dedupID: "h-1", att: "0"},
		{name: "invalid UTF-8", msgs: []*consumer.Message{{ID: "h-1", Body: []byte("{\"kind\":\"ok\xff\"}")}},
			class: consumer.ClassPermanent, reason: "body is not valid UTF-8", dedupID: "h-1", att: "1"},
		{name: "invalid JSON", msgs: []*consumer.Message{{ID: "h-1", Body: []byte(`{"kind":`)}},
			class: consumer.ClassPermanent, reason: "decode order: unexpected end of JSON input", dedupID: "h-1", att: "1"},
		{name: "JSON of the wrong type", msgs: []*consumer.Message{{ID: "h-1", Body: []byte(`{"n":"one"}`)}},
			class: consumer.ClassPermanent, reason: "decode order: json: cannot unmarshal string", dedupID: "h-1", att: "1"},
		{name: "control characters and forged envelope in headers",
			msgs:  []*consumer.Message{{ID: "h-1", Body: []byte(`{"kind":"reject"}`), Headers: hostileHeaders()}},
			class: consumer.ClassPermanent, reason: "order rejected", dedupID: "h-1", att: "1"},
		{name: "huge header map", msgs: []*consumer.Message{{ID: "h-1", Body: []byte(`{"kind":"reject"}`), Headers: huge}},
			class: consumer.ClassPermanent, reason: "order rejected", dedupID: "h-1", att: "1"},
		{name: "fingerprint mismatch", msgs: []*consumer.Message{{ID: "h-1", Body: okBody(1)}, {ID: "h-1", Body: okBody(2)}},
			class: consumer.ClassFingerprintMismatch, reason: `message id "h-1" was applied at`, dedupID: "h-1", apply: 1, att: "0"},
		{name: "panic", msgs: []*consumer.Message{{ID: "h-1", Body: []byte(`{"kind":"panic"}`)}},
			class: consumer.ClassPanic, reason: "handler panic: boom\x00\r\n", dedupID: "h-1", att: "1"},
		{name: "times out every attempt", msgs: []*consumer.Message{{ID: "h-1", Body: []byte(`{"kind":"hang"}`)}},
			class: consumer.ClassTimeout, reason: "context deadline exceeded", dedupID: "h-1", att: "3"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			b := newBundle(t)
			cfg := b.config(b.decodingHandler)
			cfg.DeadLetterer = nil // the Subscription's own, to hostileDLQ
			cfg.MessageID = c.idFunc
			cfg.MaxBodyBytes = 4096
			cfg.HandlerTimeout = 100 * time.Millisecond
			cfg.Retry.MaxAttempts = 3
			cfg.Concurrency = 4
			r := start(t, cfg)

			// Set-up messages, then the hostile one, all on key k; then
			// normal messages on k (they must not be stuck behind it)
			// and on other keys.
			const key = "k"
			setup, hostile := c.msgs[:len(c.msgs)-1], c.msgs[len(c.msgs)-1]
			for _, m := range setup {
				m.Key = key
				b.publish(m)
				waitFor(t, "the set-up message to settle", b.settled)
			}
			hostile.Key = key
			sent := hostile.Clone()
			b.publish(hostile)
			var normal []*consumer.Message
			for i := range 6 {
				m := &consumer.Message{ID: fmt.Sprintf("ok-%d", i), Body: okBody(i)}
				m.Headers = map[string]string{"Idempotency-Key": m.ID} // for IDFromHeader
				if i%2 == 0 {
					m.Key = key
				} else {
					m.Key = fmt.Sprintf("other-%d", i)
				}
				normal = append(normal, m)
			}
			b.publish(normal...)

			ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
			defer cancel()
			if err := b.broker.WaitFor(ctx, queue, memory.Drained); err != nil {
				t.Fatalf("the queue did not drain: %v; stats %+v", err, r.rt.Stats())
			}
			r.stop(t)

			// Normal messages: each applied exactly once.
			counts := b.effectCounts()
			for _, m := range normal {
				if counts[m.ID] != 1 {
					t.Errorf("normal message %s applied %d times", m.ID, counts[m.ID])
				}
			}
			total := 0
			for _, n := range counts {
				total += n
			}
			if want := len(normal) + c.apply; total != want {
				t.Errorf("%d effects, want %d: %v", total, want, counts)
			}
			st := r.rt.Stats()
			if st.DeadLettered != 1 || st.Received != int64(len(c.msgs)+len(normal)) || st.InFlight != 0 || st.Requeued != 0 {
				t.Errorf("stats %+v", st)
			}

			// The hostile message: one dead letter, with its reason.
			dl := b.broker.Messages(hostileDLQ)
			if len(dl) != 1 {
				t.Fatalf("%d dead letters, want 1", len(dl))
			}
			got := dl[0]
			rec, err := dlq.Parse(got)
			if err != nil {
				t.Fatalf("dlq.Parse of the dead letter: %v\nheaders: %q", err, envelopeHeaders(got.Headers))
			}
			if rec.Class != c.class || !strings.Contains(rec.Error, c.reason) || rec.MessageID != c.dedupID ||
				rec.Consumer != cfg.Name || rec.Source != queue || rec.DeadLetters != 1 || len(rec.History) != 0 {
				t.Errorf("envelope %+v\nwant class %s, reason containing %q, message id %q", rec, c.class, c.reason, c.dedupID)
			}
			if len(rec.Error) > 1024 { // the default dlq.Options.MaxErrorBytes
				t.Errorf("error header is %d bytes, over %d", len(rec.Error), 1024)
			}
			if h := got.Headers["x-idemq-attempts"]; h != c.att {
				t.Errorf("attempts header %q, want %q", h, c.att)
			}
			// The copy is the message as sent: body, id, key and every
			// header that is not part of the envelope.
			if string(got.Body) != string(sent.Body) || got.ID != sent.ID || got.Key != sent.Key {
				t.Errorf("dead letter id %q key %q body %q; sent id %q key %q body %q", got.ID, got.Key, got.Body, sent.ID, sent.Key, sent.Body)
			}
			want := maps.Clone(sent.Headers)
			if want == nil {
				want = map[string]string{}
			}
			gotUser := map[string]string{}
			for k, v := range got.Headers {
				if !strings.HasPrefix(k, "x-idemq-") {
					gotUser[k] = v
				}
			}
			for k := range want {
				if strings.HasPrefix(k, "x-idemq-") {
					delete(want, k)
				}
			}
			if !maps.Equal(gotUser, want) {
				t.Errorf("headers did not survive: got %d, sent %d", len(gotUser), len(want))
			}
			// Replaying it restores the dedup id the runtime used.
			if c.dedupID != "" {
				if m := rec.Restore(got); m.ID != c.dedupID || m.Source != queue {
					t.Errorf("Restore: id %q source %q", m.ID, m.Source)
				}
			}
		})
	}
}

// envelopeHeaders returns the idemq headers of h, for failure messages.
func envelopeHeaders(h map[string]string) map[string]string {
	out := map[string]string{}
	for k, v := range h {
		if strings.HasPrefix(k, "x-idemq-") {
			out[k] = v
		}
	}
	return out
}

// TestHostileInputBatchMode sends a mix of hostile and normal messages
// through batch mode: the hostile ones are isolated and dead-lettered, the
// normal ones applied exactly once, and the queue drains.
func TestHostileInputBatchMode(t *testing.T) {
	t.Parallel()
	b := newBundle(t)
	cfg := b.config(b.decodingHandler)
	cfg.DeadLetterer = nil // the Subscription's own, to hostileDLQ
	cfg.MaxBodyBytes = 4096
	cfg.HandlerTimeout = 200 * time.Millisecond
	cfg.Retry.MaxAttempts = 2
	cfg.BatchSize = 16
	cfg.BatchWait = 20 * time.Millisecond
	r := start(t, cfg)

	hostile := map[string]consumer.FailureClass{}
	var all []*consumer.Message
	for i := range 60 {
		m := &consumer.Message{ID: fmt.Sprintf("m-%d", i), Body: okBody(i), Key: fmt.Sprintf("k-%d", i%5)}
		switch i % 10 {
		case 1:
			m.Body = []byte("{not json")
			hostile[m.ID] = consumer.ClassPermanent
		case 3:
			m.Body = []byte(`{"kind":"panic"}`)
			hostile[m.ID] = consumer.ClassPanic
		case 5:
			m.Body = make([]byte, 5000)
			hostile[m.ID] = consumer.ClassTooLarge
		case 7:
			m.Headers = hostileHeaders()
			m.Body = []byte(`{"kind":"reject"}`)
			hostile[m.ID] = consumer.ClassPermanent
		case 9:
			if i == 59 {
				m.Body = []byte(`{"kind":"hang"}`)
				hostile[m.ID] = consumer.ClassTimeout
			}
		}
		all = append(all, m)
	}
	all = append(all, &consumer.Message{Body: okBody(0)}) // no id
	b.publish(all...)

	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := b.broker.WaitFor(ctx, queue, memory.Drained); err != nil {
		t.Fatalf("the queue did not drain: %v; stats %+v", err, r.rt.Stats())
	}
	r.stop(t)

	counts := b.effectCounts()
	for _, m := range all[:60] {
		_, bad := hostile[m.ID]
		if want := map[bool]int{true: 0, false: 1}[bad]; counts[m.ID] != want {
			t.Errorf("%s applied %d times, want %d", m.ID, counts[m.ID], want)
		}
	}
	got := map[string]consumer.FailureClass{}
	for _, m := range b.broker.Messages(hostileDLQ) {
		rec, err := dlq.Parse(m)
		if err != nil {
			t.Fatalf("dlq.Parse: %v", err)
		}
		got[rec.MessageID] = rec.Class
	}
	hostile[""] = consumer.ClassMissingID
	if !maps.Equal(got, hostile) {
		t.Errorf("dead letters %v\nwant %v", got, hostile)
	}
}
