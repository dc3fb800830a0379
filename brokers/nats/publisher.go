package natsjs

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync/atomic"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/internal/wire"
)

// PublisherConfig configures a Publisher. The zero value of every field
// selects a documented default.
type PublisherConfig struct {
	// URL is the server's URL, or a comma-separated list of them.
	// Defaults to nats://127.0.0.1:4222 (nats.DefaultURL).
	URL string
	// Options are extra connection options, applied after the
	// Publisher's own (reconnecting forever, 2 s to reach each server).
	// Defaults to none.
	Options []nats.Option
	// RejectDuplicates makes Publish fail with ErrDuplicate for a message
	// the stream discarded as a duplicate (same Nats-Msg-Id inside its
	// duplicate window). Defaults to false: such a message counts as
	// published, since the stream holds a copy, which is what a retried
	// publish (the outbox relay's, say) wants. Set it to republish
	// dead letters (dlq.Requeue): a message requeued within the window
	// of its first publish would otherwise be discarded while its
	// dead-letter copy is removed.
	RejectDuplicates bool
}

// Publisher publishes to JetStream and waits for the stream's
// acknowledgements. It is safe for concurrent use; create it with
// NewPublisher and Close it when done.
type Publisher struct {
	cfg    PublisherConfig
	nc     *nats.Conn
	js     jetstream.JetStream
	closed atomic.Bool
}

// NewPublisher connects to the server.
func NewPublisher(ctx context.Context, cfg PublisherConfig) (*Publisher, error) {
	if cfg.URL == "" {
		cfg.URL = nats.DefaultURL
	}
	if err := checkURL(cfg.URL); err != nil {
		return nil, err
	}
	nc, err := connect(ctx, cfg.URL, "idemq-publisher", nil, cfg.Options)
	if err != nil {
		return nil, err
	}
	js, err := jetstream.New(nc)
	if err != nil {
		nc.Close()
		return nil, fmt.Errorf("natsjs: jetstream: %w", err)
	}
	return &Publisher{cfg: cfg, nc: nc, js: js}, nil
}

// Publish publishes msgs, in order, to subject, and returns once the stream
// has stored (acknowledged) every one of them, or an error joining one
// *PublishError per message that failed. Message.ID becomes the Nats-Msg-Id
// header, JetStream's deduplication id, replacing any such header in
// Headers; Headers become the message's headers (plus a
// non-empty Key in the x-idemq-key header, where the Source reads it). The messages are sent without waiting
// for each other's acknowledgements, then awaited together.
func (p *Publisher) Publish(ctx context.Context, subject string, msgs ...*consumer.Message) error {
	if p.closed.Load() {
		return ErrPublisherClosed
	}
	if err := checkSubject("subject", subject, false); err != nil {
		return fmt.Errorf("natsjs: publish: %w", err)
	}
	out := make([]*nats.Msg, len(msgs))
	for i, m := range msgs {
		if m == nil {
			return fmt.Errorf("natsjs: publish: message %d is nil", i)
		}
		out[i] = natsMsg(subject, m, true)
	}
	err := publishAll(ctx, p.js, out, msgs, p.cfg.RejectDuplicates)
	if err != nil && p.closed.Load() {
		return fmt.Errorf("%w: %w", ErrPublisherClosed, err)
	}
	return err
}

// Close closes the connection. Publish then returns ErrPublisherClosed.
// Close is idempotent.
func (p *Publisher) Close() error {
	if p.closed.CompareAndSwap(false, true) {
		p.nc.Close()
	}
	return nil
}

// natsMsg maps m to a NATS message on subject, a non-empty Key in the
// x-idemq-key header. With setID, Message.ID is
// the Nats-Msg-Id; without (dead letters), every JetStream control header
// (Nats-*) of the original is dropped, so that the dead-letter stream
// neither discards a second dead letter of one id as a duplicate nor
// obeys the original's expectations or rollups.
func natsMsg(subject string, m *consumer.Message, setID bool) *nats.Msg {
	nm := nats.NewMsg(subject)
	nm.Data = m.Body
	for k, v := range m.Headers {
		if strings.EqualFold(k, headerMsgID) || (!setID && isJetStreamHeader(k)) {
			continue
		}
		nm.Header[k] = []string{v}
	}
	if setID && m.ID != "" {
		nm.Header[headerMsgID] = []string{m.ID}
	}
	if m.Key != "" {
		nm.Header[wire.KeyHeader] = []string{m.Key}
	}
	return nm
}

// isJetStreamHeader reports a header the server interprets (Nats-Msg-Id,
// Nats-Expected-*, Nats-Rollup, Nats-TTL...) or sets (Nats-Stream...).
func isJetStreamHeader(k string) bool {
	return len(k) >= 5 && strings.EqualFold(k[:5], "Nats-")
}

// publishAll sends every message, then waits for all the acknowledgements.
func publishAll(ctx context.Context, js jetstream.JetStream, out []*nats.Msg, msgs []*consumer.Message, rejectDup bool) error {
	futures := make([]jetstream.PubAckFuture, len(out))
	var errs []error
	fail := func(i int, err error) {
		errs = append(errs, &PublishError{Index: i, MessageID: msgs[i].ID, Err: err})
	}
	for i, nm := range out {
		f, err := js.PublishMsgAsync(nm)
		if err != nil {
			fail(i, classifyPublish(err))
			continue
		}
		futures[i] = f
	}
	for i, f := range futures {
		if f == nil {
			continue
		}
		select {
		case ack := <-f.Ok():
			if ack.Duplicate && rejectDup {
				fail(i, fmt.Errorf("%w: stream %s already holds it (seq %d)", ErrDuplicate, ack.Stream, ack.Sequence))
			}
		case err := <-f.Err():
			fail(i, classifyPublish(err))
		case <-ctx.Done():
			fail(i, fmt.Errorf("%w: %w", ErrUnconfirmed, ctx.Err()))
		}
	}
	return errors.Join(errs...)
}

// classifyPublish translates the client's publish errors: the sentinel says
// what happened, the client's text says why, unwrapped.
func classifyPublish(err error) error {
	var apiErr *jetstream.APIError
	switch {
	case errors.Is(err, nats.ErrNoResponders), errors.Is(err, jetstream.ErrNoStreamResponse):
		return fmt.Errorf("%w (%v)", ErrNoStream, err)
	case errors.Is(err, nats.ErrMaxPayload):
		// The client checks the server's max_payload before sending.
		return fmt.Errorf("%w: %v", consumer.ErrMessageTooLarge, err)
	case errors.As(err, &apiErr) && apiErr.ErrorCode == jetstream.JSErrCodeStreamMessageExceedsMaximum:
		// The stream's own max_msg_size.
		return fmt.Errorf("%w: %w: %s (code %d)", ErrRejected, consumer.ErrMessageTooLarge, apiErr.Description, apiErr.ErrorCode)
	case errors.As(err, &apiErr):
		return fmt.Errorf("%w: %s (code %d)", ErrRejected, apiErr.Description, apiErr.ErrorCode)
	default:
		return fmt.Errorf("%w: %v", ErrUnconfirmed, err)
	}
}
