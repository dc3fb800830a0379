package dlq_test

import (
	"errors"
	"strings"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/dlq"
)

// FuzzEnvelopeRoundTrip: for any message and failure the runtime can
// produce, the envelope parses back to the failure, keeps the message's own
// headers, and a second dead-lettering moves the first into the history.
// Headers named like the envelope's are included, as a hostile producer
// could set them.
func FuzzEnvelopeRoundTrip(f *testing.F) {
	f.Add("billing", "m-1", "permanent", "boom", 3, "payments", int32(-1), int64(-1), "k", "v", "x-idemq-history", "[not json", int64(1_700_000_000))
	f.Add("c", "", "missing-id", "", 0, "", int32(2), int64(42), "x-idemq-attempts", "NaN", "\x00", "\xff\xfe", int64(0))
	f.Add("c", "m-2", "permanent", "e", 1, "q", int32(-1), int64(-1), "x-idemq-signature", "v1=00", "x-idemq-source", "admin", int64(5))
	f.Add("c\x00", "id\r\n", "panic", strings.Repeat("é", 2000), 1, "orders", int32(0), int64(0), "", "", "x-idemq-error-class", "forged", int64(-1))
	f.Fuzz(func(t *testing.T, name, id, class, errText string, attempts int, source string, partition int32, offset int64,
		k1, v1, k2, v2 string, unix int64) {
		at := time.Unix(unix%(1<<35), 0) // years 885 to 3058: all RFC 3339
		msg := &consumer.Message{ID: id, Body: []byte(v1), Headers: map[string]string{k1: v1, k2: v2},
			Source: source, Partition: partition, Offset: offset}
		var err error
		if errText != "" {
			err = errors.New(errText)
		}
		fl := consumer.Failure{Consumer: name, MessageID: id, Class: consumer.FailureClass(class), Err: err,
			Attempts: attempts, FirstFailure: at, LastFailure: at.Add(time.Second)}
		prev, prevErr := dlq.Parse(msg)

		env := dlq.Envelope(msg, fl, dlq.Options{Host: "h"})
		rec, perr := dlq.Parse(env)
		if perr != nil {
			t.Fatalf("Parse(Envelope(msg)): %v\nheaders %q", perr, env.Headers)
		}
		if rec.Consumer != name || rec.MessageID != id || string(rec.Class) != class || rec.Attempts != attempts ||
			!rec.FirstFailure.Equal(at) || !rec.LastFailure.Equal(at.Add(time.Second)) || rec.Host != "h" {
			t.Fatalf("parsed %+v from failure %+v", rec.Entry, fl)
		}
		if len(rec.Error) > 1024 || !strings.HasPrefix(errText, strings.TrimSuffix(rec.Error, "…[truncated]")) {
			t.Fatalf("error header %q from %q", rec.Error, errText)
		}
		if utf8.ValidString(errText) && !utf8.ValidString(rec.Error) {
			t.Fatalf("truncation split a UTF-8 sequence: %q", rec.Error)
		}
		wantSrc, wantPart, wantOff := source, partition, offset
		if prevErr == nil && prev.Source != "" && prev.Consumer == name {
			// Only an earlier envelope of the same consumer gives them.
			wantSrc, wantPart, wantOff = prev.Source, prev.Partition, prev.Offset
		}
		// Each is kept where it is known: a JetStream sequence has no
		// partition.
		wantPart, wantOff = max(wantPart, -1), max(wantOff, -1)
		if rec.Source != wantSrc || rec.Partition != wantPart || rec.Offset != wantOff {
			t.Fatalf("source %q/%d/%d, want %q/%d/%d", rec.Source, rec.Partition, rec.Offset, wantSrc, wantPart, wantOff)
		}
		if prevErr == nil {
			if rec.DeadLetters != prev.DeadLetters+1 {
				t.Fatalf("dead letters %d after %d", rec.DeadLetters, prev.DeadLetters)
			}
		} else if rec.DeadLetters != 1 || len(rec.History) != 0 {
			t.Fatalf("first dead letter: count %d, history %d", rec.DeadLetters, len(rec.History))
		}
		// The message's own headers survive byte for byte.
		for k, v := range msg.Headers {
			if strings.HasPrefix(k, "x-idemq-") {
				continue
			}
			if env.Headers[k] != v {
				t.Fatalf("header %q: %q, want %q", k, env.Headers[k], v)
			}
		}
		if string(env.Body) != string(msg.Body) || env.ID != msg.ID {
			t.Fatal("body or id changed")
		}

		// Signed, the same envelope verifies, whatever the message carried
		// (a forged signature header included), and only under its key.
		signed := dlq.Envelope(msg, fl, dlq.Options{Host: "h", SigningKey: signKey})
		if err := dlq.Verify(signed, signKey); err != nil {
			t.Fatalf("Verify(Envelope(msg, key)): %v\nheaders %q", err, signed.Headers)
		}
		if err := dlq.Verify(signed, otherKey); !errors.Is(err, dlq.ErrBadSignature) {
			t.Fatalf("Verify under another key: %v", err)
		}
		if srec, err := dlq.Parse(signed); err != nil || srec.Consumer != rec.Consumer || srec.MessageID != rec.MessageID || srec.Source != rec.Source {
			t.Fatalf("signed envelope parses as %+v, %v; unsigned as %+v", srec, err, rec)
		}

		// Dead-lettered again, on replay: the first failure goes to the
		// history and the source stays the original one.
		again, err := dlq.Parse(dlq.Envelope(env, consumer.Failure{Consumer: name, Class: consumer.ClassPermanent}, dlq.Options{Host: "h"}))
		if err != nil {
			t.Fatalf("second envelope: %v", err)
		}
		if again.DeadLetters != rec.DeadLetters+1 || len(again.History) != min(len(rec.History)+1, 10) ||
			again.History[len(again.History)-1].Attempts != rec.Attempts ||
			again.Source != rec.Source || again.Partition != rec.Partition || again.Offset != rec.Offset {
			t.Fatalf("second envelope %+v after %+v", again, rec)
		}
	})
}

// FuzzParse feeds arbitrary envelope header values to Parse: it never
// panics, and whatever it accepts can be dead-lettered again and parsed.
func FuzzParse(f *testing.F) {
	f.Add("permanent", "3", "2024-01-02T03:04:05.123456789Z", "", "1", "17", "2", `[{"consumer":"c","class":"panic","error":"x","attempts":1,"partition":-1,"offset":-1}]`)
	f.Add("", "", "", "", "", "", "", "")
	f.Add("x", "-1", "9999-12-31T23:59:59-23:59", "0000-01-01T00:00:00Z", "2147483647", "9223372036854775807", "-5", "null")
	f.Add("x", "1e3", "yesterday", "", "99999999999", "-", "many", "[not json")
	f.Add("x", "1", "", "", "", "", "", `[{"first_failure":"10000-01-01T00:00:00Z"}]`)
	f.Fuzz(func(t *testing.T, class, attempts, first, last, partition, offset, deadLetters, history string) {
		msg := &consumer.Message{Headers: map[string]string{
			"x-idemq-error-class":   class,
			"x-idemq-attempts":      attempts,
			"x-idemq-first-failure": first,
			"x-idemq-last-failure":  last,
			"x-idemq-partition":     partition,
			"x-idemq-offset":        offset,
			"x-idemq-dead-letters":  deadLetters,
			dlq.HeaderHistory:       history,
		}}
		rec, err := dlq.Parse(msg)
		if err != nil {
			if errors.Is(err, dlq.ErrNoEnvelope) {
				t.Fatalf("ErrNoEnvelope for a message with a class header: %v", err)
			}
			return
		}
		_ = rec.Restore(msg)
		env := dlq.Envelope(msg, consumer.Failure{Consumer: "c", Class: consumer.ClassPermanent, LastFailure: time.Unix(0, 0)}, dlq.Options{Host: "h"})
		again, err := dlq.Parse(env)
		if err != nil {
			t.Fatalf("Parse after Envelope of an accepted envelope: %v\nheaders %q", err, env.Headers)
		}
		if again.DeadLetters != rec.DeadLetters+1 {
			t.Fatalf("dead letters %d after %d", again.DeadLetters, rec.DeadLetters)
		}
	})
}

// TestParseNoEnvelope: a message without the class header is not an
// envelope, whatever else it carries.
func TestParseNoEnvelope(t *testing.T) {
	for _, h := range []map[string]string{nil, {}, {"x-idemq-attempts": "x", dlq.HeaderHistory: "["}} {
		if _, err := dlq.Parse(&consumer.Message{Headers: h}); !errors.Is(err, dlq.ErrNoEnvelope) {
			t.Errorf("Parse(%q): %v", h, err)
		}
	}
}
