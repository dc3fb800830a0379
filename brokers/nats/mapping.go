package natsjs

import (
	"strconv"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/internal/wire"
)

// mapper turns JetStream messages into consumer.Messages. The Source and the
// Browser share it, so a browsed message looks exactly like a consumed one.
// Message.Key is the x-idemq-key header, which Publisher writes (the header
// stays among Headers).
type mapper struct{}

func (mapper) message(msg jetstream.Msg) *consumer.Message {
	headers := headerMap(msg.Headers())
	out := &consumer.Message{
		ID:        msg.Headers().Get(headerMsgID),
		Key:       msg.Headers().Get(wire.KeyHeader),
		Body:      msg.Data(),
		Headers:   headers,
		Source:    msg.Subject(),
		Partition: -1,
		Offset:    -1,
		Metadata:  map[string]string{MetaSubject: msg.Subject()},
	}
	if md, err := msg.Metadata(); err == nil {
		out.Offset = int64(md.Sequence.Stream)
		out.Redelivered = md.NumDelivered > 1
		out.Timestamp = md.Timestamp
		out.Metadata[MetaStream] = md.Stream
		out.Metadata[MetaConsumer] = md.Consumer
		out.Metadata[MetaStreamSeq] = strconv.FormatUint(md.Sequence.Stream, 10)
		out.Metadata[MetaConsumerSeq] = strconv.FormatUint(md.Sequence.Consumer, 10)
		out.Metadata[MetaNumDelivered] = strconv.FormatUint(md.NumDelivered, 10)
		out.Metadata[MetaNumPending] = strconv.FormatUint(md.NumPending, 10)
	}
	return out
}

// headerMap keeps the first value of each header. JetStream's own headers
// (Nats-Msg-Id among them) are kept: they are part of what was published.
func headerMap(h nats.Header) map[string]string {
	if len(h) == 0 {
		return map[string]string{}
	}
	out := make(map[string]string, len(h))
	for k, vs := range h {
		if len(vs) > 0 {
			out[k] = vs[0]
		} else {
			out[k] = ""
		}
	}
	return out
}
