package main

import (
	"context"
	"errors"
	"fmt"
	"net/url"
	"strings"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	natsjs "github.com/idemq/idemq/brokers/nats"
	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/internal/redact"
)

// natsURLOr is the NATS URL of a flag, else $NATS_URL, else the default.
func natsURLOr(flagValue string, e *env) string {
	if flagValue != "" {
		return flagValue
	}
	if u := e.getenv("NATS_URL"); u != "" {
		return u
	}
	return nats.DefaultURL
}

// redactNATSURLs shows a comma-separated list of NATS URLs with their
// passwords and tokens masked.
func redactNATSURLs(raw string) string {
	parts := splitList(raw)
	for i, p := range parts {
		if !strings.Contains(p, "://") {
			p = "nats://" + p
		}
		if u, err := url.Parse(p); err == nil && natsToken(p) != "" {
			u.User = url.User(redact.Mask)
			p = u.String()
		}
		parts[i] = redact.URL(p)
	}
	return strings.Join(parts, ",")
}

// natsToken is the token of a NATS URL: nats.go takes a user name without
// a password (nats://token@host) for a token.
func natsToken(rawURL string) string {
	_, rest, ok := strings.Cut(rawURL, "://")
	if !ok {
		rest = rawURL
	}
	at := strings.LastIndex(rest, "@")
	if at < 0 || strings.Contains(rest[:at], ":") {
		return ""
	}
	return rest[:at]
}

// natsSecrets are what redact.Error masks the secrets of a comma-separated
// list of NATS URLs with: the URLs themselves (their passwords), and each
// token written as a password.
func natsSecrets(raw string) []string {
	var out []string
	for _, p := range splitList(raw) {
		out = append(out, p)
		if tok := natsToken(p); tok != "" {
			out = append(out, "nats://token:"+tok+"@")
		}
	}
	return out
}

// redactNATS masks the passwords and tokens of the NATS URLs raw in err.
func redactNATS(err error, raw string) error { return redact.Error(err, natsSecrets(raw)...) }

// validateNATS checks the NATS JetStream selection; subjectFlag and
// streamFlag are the flags' names, for the messages.
func (b *brokerFlags) validateNATS(e *env, subjectFlag, streamFlag string) error {
	if b.subject == "" {
		return usagef("%s is required with --broker nats", subjectFlag)
	}
	if strings.ContainsAny(b.subject, "*> \t\r\n") {
		return usagef("%s %q: a dead-letter subject has no wildcards or whitespace", subjectFlag, b.subject)
	}
	if strings.ContainsAny(b.natsStream, ". \t\r\n*>/\\") {
		return usagef("%s %q: stream names hold no whitespace, '.', '*', '>' or path separators", streamFlag, b.natsStream)
	}
	b.natsURL = natsURLOr(b.natsURL, e)
	return nil
}

// openNATSDLQ opens a NATS JetStream dead-letter subject: a browser that
// reads the messages the subject holds now with an ordered consumer (which
// leaves nothing on the server; acking a message deletes it from the
// stream) and, with withPublisher, a publisher that republishes each
// original to its source subject, its dedup id in Nats-Msg-Id, waiting for
// the stream's acknowledgement. The publisher rejects duplicates: an
// original the work stream discards as a duplicate (republished within its
// duplicate window) fails, and stays in the dead-letter stream, rather
// than counting as republished while its copy is deleted.
func openNATSDLQ(ctx context.Context, b *brokerFlags, withPublisher bool) (*dlqConn, error) {
	br, err := natsjs.NewBrowser(ctx, natsjs.BrowserConfig{URL: b.natsURL, Subject: b.subject, Stream: b.natsStream})
	if err != nil {
		return nil, redactNATS(err, b.natsURL)
	}
	c := &dlqConn{browser: br, close: func() { _ = br.Close() }}
	if withPublisher {
		pub, err := natsjs.NewPublisher(ctx, natsjs.PublisherConfig{URL: b.natsURL, RejectDuplicates: true})
		if err != nil {
			_ = br.Close()
			return nil, redactNATS(err, b.natsURL)
		}
		c.publish = func(ctx context.Context, subject string, m *consumer.Message) error {
			return pub.Publish(ctx, subject, m)
		}
		c.close = func() { _ = br.Close(); _ = pub.Close() }
	}
	return c, nil
}

// statusNATSDepth reads the number of messages the stream holds on the
// dead-letter subject (stream info filtered by the subject) and when the
// oldest of them was stored.
func statusNATSDepth(ctx context.Context, b *brokerFlags) statusDLQ {
	d := statusDLQ{Broker: "nats", Name: b.subject, Stream: b.natsStream}
	fail := func(err error) statusDLQ {
		d.Error = redactNATS(err, b.natsURL).Error()
		return d
	}
	ctx, cancel := context.WithTimeout(ctx, statusTimeout)
	defer cancel()
	nc, err := nats.Connect(b.natsURL, nats.Name("idemq status"), nats.Timeout(statusTimeout), nats.NoReconnect())
	if err != nil {
		return fail(fmt.Errorf("cannot reach NATS at %s: %w", redactNATSURLs(b.natsURL), err))
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		return fail(err)
	}
	if d.Stream == "" {
		if d.Stream, err = js.StreamNameBySubject(ctx, b.subject); err != nil {
			return fail(fmt.Errorf("no stream captures the subject: %w", err))
		}
	}
	stream, err := js.Stream(ctx, d.Stream)
	if err != nil {
		return fail(fmt.Errorf("stream %q: %w", d.Stream, err))
	}
	info, err := stream.Info(ctx, jetstream.WithSubjectFilter(b.subject))
	if err != nil {
		return fail(fmt.Errorf("stream %q: %w", d.Stream, err))
	}
	depth := int64(info.State.Subjects[b.subject])
	if depth > 0 {
		first, err := stream.GetMsg(ctx, max(info.State.FirstSeq, 1), jetstream.WithGetMsgSubject(b.subject))
		switch {
		case errors.Is(err, jetstream.ErrMsgNotFound):
			// Deleted since the stream info: nothing older is left.
		case err != nil:
			return fail(fmt.Errorf("stream %q: oldest message: %w", d.Stream, err))
		default:
			at := first.Time.UTC()
			d.Oldest = &at
		}
	}
	d.Depth = &depth
	return d
}
