package consumer

import (
	"crypto/sha256"
	"time"

	"github.com/idemq/idemq/consumer/dedup"
)

// Message is one message as the runtime and handlers see it. Brokers fill it
// in; handlers must treat it as read-only.
type Message struct {
	// ID is the broker's native message id, which its Publisher writes:
	// the AMQP message-id property, Nats-Msg-Id, the idempotency-key
	// Kafka header or Redis field (with a position-based fallback id). The
	// id used for deduplication is chosen by Config.MessageID, the one id
	// knob, which defaults to this field; no broker has one of its own.
	ID string
	// Key is the ordering key, and only that: messages with the same
	// non-empty key are handled one at a time, in delivery order; messages
	// with an empty key are not ordered relative to each other. A broker's
	// own record key is RecordKey. Each Source fills Key in from one
	// place, with no option:
	//
	//	rabbitmq, nats  the x-idemq-key header
	//	redisstream     the x-idemq-key entry field
	//	kafka, franz    "topic/partition": Kafka's own order
	//	memory          Key as published
	//
	// The rabbitmq, nats and redisstream Publishers write a non-empty Key
	// there; Kafka's never write it. To order by anything else (a header
	// of a foreign producer, a NATS subject, a Kafka record key), set
	// Config.OrderingKey: the one ordering knob.
	Key string
	// RecordKey is the broker's own record key (a Kafka record key), kept
	// byte for byte so that a dead-lettered or republished message keeps
	// it; nil where the broker has none or the record had no key. The
	// runtime never orders by it: ordering uses Key. Publishers write
	// RecordKey, never Key, as the record key.
	RecordKey []byte
	// Body is the payload. Its sha256 is the message's fingerprint.
	Body []byte
	// Headers are the message's application headers.
	Headers map[string]string
	// Source names where the message came from: a queue or a topic.
	Source string
	// Partition is the Kafka partition, or -1 where the broker has none.
	Partition int32
	// Offset is the Kafka offset, or -1 where the broker has none.
	Offset int64
	// Redelivered reports that the broker delivered this message before.
	Redelivered bool
	// Attempt is the 1-based in-process attempt number of the current
	// handler call. The runtime sets it before each call.
	Attempt int
	// Timestamp is when the message was produced, if the broker knows.
	Timestamp time.Time
	// Metadata carries broker-specific details (routing key, exchange,
	// delivery tag and so on) for logs and forensics.
	Metadata map[string]string

	// route is where a ShardedStore keeps the message's claim, set when
	// it is received; routeErr says why it has none.
	route    dedup.Route
	routeErr error
}

// Header returns the value of header name, or "" if it is absent.
func (m *Message) Header(name string) string {
	if m == nil || m.Headers == nil {
		return ""
	}
	return m.Headers[name]
}

// Fingerprint returns the sha256 of the message body. The dedup store keeps
// it so that a second message with the same id but a different payload is
// detected instead of being silently skipped.
func (m *Message) Fingerprint() [32]byte {
	return sha256.Sum256(m.Body)
}

// Clone returns a deep copy of m.
func (m *Message) Clone() *Message {
	if m == nil {
		return nil
	}
	c := *m
	c.Body = append([]byte(nil), m.Body...)
	if m.RecordKey != nil {
		c.RecordKey = append([]byte{}, m.RecordKey...)
	}
	c.Headers = cloneMap(m.Headers)
	c.Metadata = cloneMap(m.Metadata)
	return &c
}

func cloneMap(in map[string]string) map[string]string {
	if in == nil {
		return nil
	}
	out := make(map[string]string, len(in))
	for k, v := range in {
		out[k] = v
	}
	return out
}

// idFromMessage uses Message.ID, the id the broker carried: the default
// Config.MessageID.
func idFromMessage(m *Message) (string, error) { return m.ID, nil }

// IDFromHeader returns a Config.MessageID that reads the id from the named
// header, for example "Idempotency-Key". An empty header means the message
// has no usable id: it is dead-lettered with [ClassMissingID] and the
// handler never runs.
func IDFromHeader(name string) func(*Message) (string, error) {
	return func(m *Message) (string, error) { return m.Header(name), nil }
}
