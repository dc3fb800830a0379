package dlq

import (
	"cmp"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"

	"github.com/idemq/idemq/consumer"
)

// deadLetterer is the consumer.DeadLetterer NewDeadLetterer makes.
type deadLetterer struct {
	publish func(context.Context, *consumer.Message) error
	opts    Options
}

// NewDeadLetterer returns a consumer.DeadLetterer for any broker: it wraps
// each failed message in the envelope and publishes it with publish, which
// must return only once the broker has durably accepted the message (a
// confirmed publish, an acknowledged write).
//
// Every Source in brokers/ makes one of its own, from its Config.DeadLetter,
// publishing on the Source's own connection and closed with it, and the
// runtime uses it when consumer.Config.DeadLetterer is nil: that is the one
// way to say where a broker's dead letters go. NewDeadLetterer is for
// other brokers, or another publish path, for instance:
//
//	dl, err := dlq.NewDeadLetterer(func(ctx context.Context, m *consumer.Message) error {
//		return publisher.Publish(ctx, "", "payments.dlq", m)
//	}, dlq.Options{})
func NewDeadLetterer(publish func(ctx context.Context, msg *consumer.Message) error, opts Options) (consumer.DeadLetterer, error) {
	if publish == nil {
		return nil, &consumer.ConfigError{Field: "publish", Reason: "required"}
	}
	opts = opts.withDefaults()
	if err := opts.validate(); err != nil {
		return nil, err
	}
	return &deadLetterer{publish: publish, opts: opts}, nil
}

// DeadLetter publishes the envelope of msg and returns once the broker
// accepted it. The runtime acks the original only after a nil return.
//
// A message the broker accepted always yields a dead letter it accepts:
// if the publish fails with an error wrapping consumer.ErrMessageTooLarge
// (the envelope's headers took it over the broker's limit), DeadLetter
// publishes it truncated (HeaderTruncated): the first Options.PreviewBytes
// of the body, the original headers that fit in as many bytes, smallest
// first, and the original body's size and SHA-256 (HeaderOriginalSize,
// HeaderOriginalSHA256), with the envelope's coordinates of the original
// (source, partition, offset). If that is refused too, it publishes the
// envelope alone: no body, no original header, no history.
func (d *deadLetterer) DeadLetter(ctx context.Context, msg *consumer.Message, f consumer.Failure) error {
	if msg == nil {
		return errors.New("dlq: nil message")
	}
	env := Envelope(msg, f, d.opts)
	err := d.publish(ctx, env)
	for _, bare := range []bool{false, true} {
		if !errors.Is(err, consumer.ErrMessageTooLarge) {
			break
		}
		cut := truncateEnvelope(env, msg, d.opts, bare)
		if cut == nil {
			continue // nothing more to cut at this tier
		}
		env, err = cut, d.publish(ctx, cut)
	}
	if err != nil {
		return fmt.Errorf("dlq: publish dead letter for %q: %w", f.MessageID, err)
	}
	return nil
}

// truncateEnvelope returns env cut to fit a broker that refused it: the
// body cut to opts.PreviewBytes and the original headers kept, smallest
// first, while they fit in as many bytes; or, if bare, the envelope's own
// current failure alone. It returns nil if that would not make env any
// smaller. orig is the message env was made of.
func truncateEnvelope(env, orig *consumer.Message, opts Options, bare bool) *consumer.Message {
	out := env.Clone()
	h := out.Headers
	var cut []string
	preview := opts.PreviewBytes
	if bare {
		preview = 0
	}
	if len(out.Body) > preview {
		out.Body = out.Body[:preview]
		cut = append(cut, "body")
	}
	// The original's headers, smallest first: a coordinate or a trace id
	// is worth more per byte than one large header.
	var names []string
	for k := range h {
		if !strings.HasPrefix(strings.ToLower(k), headerPrefix) {
			names = append(names, k)
		}
	}
	slices.SortFunc(names, func(a, b string) int {
		return cmp.Or(cmp.Compare(len(a)+len(h[a]), len(b)+len(h[b])), strings.Compare(a, b))
	})
	budget := preview
	for _, k := range names {
		if n := len(k) + len(h[k]); n <= budget {
			budget -= n
			continue
		}
		delete(h, k)
		if !slices.Contains(cut, "headers") {
			cut = append(cut, "headers")
		}
	}
	if _, ok := h[HeaderHistory]; ok && bare {
		delete(h, HeaderHistory)
		cut = append(cut, "history")
	}
	if len(cut) == 0 {
		return nil
	}
	// A dead letter cut before (one republished by hand) keeps the
	// true original's size and hash.
	if _, ok := h[HeaderOriginalSize]; !ok {
		sum := sha256.Sum256(orig.Body)
		h[HeaderOriginalSize] = strconv.Itoa(len(orig.Body))
		h[HeaderOriginalSHA256] = hex.EncodeToString(sum[:])
	}
	if prev := h[HeaderTruncated]; prev != "" {
		for _, p := range strings.Split(prev, ",") {
			if !slices.Contains(cut, p) {
				cut = append(cut, p)
			}
		}
	}
	h[HeaderTruncated] = strings.Join(cut, ",")
	if opts.SigningKey != nil {
		Sign(out, opts.SigningKey)
	}
	return out
}
