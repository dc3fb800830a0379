// Package kafkamsg maps Kafka records to consumer.Messages and back, for
// both Kafka adapters, brokers/kafka (kafka-go) and brokers/franz
// (franz-go), so that a message looks the same whichever client read it.
// It depends on neither client, so that neither adapter pulls in the
// other's.
package kafkamsg

import (
	"errors"
	"fmt"
	"slices"
	"strconv"
	"time"

	"github.com/idemq/idemq/consumer"
)

// IDHeader is the record header carrying the message id: the publishers
// write Message.ID there, and the Sources read it back.
const IDHeader = "idempotency-key"

// Header is one record header.
type Header struct {
	Key   string
	Value []byte
}

// Record is a Kafka record, as either client hands it over.
type Record struct {
	Topic     string
	Partition int
	Offset    int64
	Key       []byte // nil for a null key
	Value     []byte
	Headers   []Header
	Time      time.Time
}

// Mapping says how a record becomes a Message.
type Mapping struct {
	// NoFallbackID leaves Message.ID empty for a record without IDHeader,
	// instead of FallbackID's "topic/partition/offset". The Browsers set
	// it: a dead letter's position is not the original's identity.
	NoFallbackID bool
}

// FallbackID is the id of a record without IDHeader: "topic/partition/offset".
// It identifies the record, so it deduplicates redeliveries of it, but not
// a producer's duplicates, which are new records at new offsets.
func FallbackID(topic string, partition int, offset int64) string {
	return topic + "/" + strconv.Itoa(partition) + "/" + strconv.FormatInt(offset, 10)
}

// Message converts r. Message.ID is the IDHeader header or, unless
// NoFallbackID, FallbackID; Key is the ordering key, "topic/partition",
// and RecordKey the record's own key, byte for byte (nil for a null key);
// Headers hold every record header, IDHeader included, so that
// consumer.IDFromHeader(IDHeader) reads the id without the fallback;
// Metadata holds the record's coordinates and key.
func (mp Mapping) Message(r Record) *consumer.Message {
	headers := make(map[string]string, len(r.Headers))
	for _, h := range r.Headers {
		headers[h.Key] = string(h.Value)
	}
	id := headers[IDHeader]
	if id == "" && !mp.NoFallbackID {
		id = FallbackID(r.Topic, r.Partition, r.Offset)
	}
	key := r.Topic + "/" + strconv.Itoa(r.Partition)
	var recordKey []byte
	if r.Key != nil {
		recordKey = append([]byte{}, r.Key...)
	}
	return &consumer.Message{
		ID:        id,
		Key:       key,
		RecordKey: recordKey,
		Body:      r.Value,
		Headers:   headers,
		Source:    r.Topic,
		Partition: int32(r.Partition),
		Offset:    r.Offset,
		Timestamp: r.Time,
		Metadata: map[string]string{
			"kafka.topic":     r.Topic,
			"kafka.partition": strconv.Itoa(r.Partition),
			"kafka.offset":    strconv.FormatInt(r.Offset, 10),
			"kafka.key":       string(r.Key),
		},
	}
}

// Out is the inverse of Message: the record a publisher writes for m to
// topic. Message.ID goes to IDHeader (replacing a header of that name in
// Headers), Headers to record headers (sorted by name, IDHeader last),
// RecordKey to the record key (nil writes a null key), Body to the value
// and Timestamp to the record time. Key, the runtime's ordering key, is
// never written.
func Out(topic string, m *consumer.Message) Record {
	r := Record{Topic: topic, Key: m.RecordKey, Value: m.Body, Time: m.Timestamp}
	names := make([]string, 0, len(m.Headers))
	for k := range m.Headers {
		if m.ID != "" && k == IDHeader {
			continue
		}
		names = append(names, k)
	}
	slices.Sort(names)
	for _, k := range names {
		r.Headers = append(r.Headers, Header{Key: k, Value: []byte(m.Headers[k])})
	}
	if m.ID != "" {
		r.Headers = append(r.Headers, Header{Key: IDHeader, Value: []byte(m.ID)})
	}
	return r
}

// DLQName is the default dead-letter topic of topic: topic + ".dlq".
func DLQName(topic string) string { return topic + ".dlq" }

// DeadLetterTopic returns the dead-letter topic of a Source consuming
// topic: dl, or DLQName(topic) if dl is empty. It fails if that is not a
// legal topic name or is topic itself.
func DeadLetterTopic(dl, topic string) (string, error) {
	if dl == "" {
		dl = DLQName(topic)
	}
	if err := ValidTopic(dl); err != nil {
		return "", err
	}
	if dl == topic {
		return "", fmt.Errorf("%q is the Source's own topic: dead letters would be consumed again", dl)
	}
	return dl, nil
}

// maxTopicLen is the longest topic name Kafka accepts.
const maxTopicLen = 249

// ValidTopic checks name against Kafka's rules for topic names: 1 to 249
// of the characters a-z, A-Z, 0-9, '.', '_' and '-', and not "." or "..".
func ValidTopic(name string) error {
	switch {
	case name == "":
		return errors.New("required")
	case len(name) > maxTopicLen:
		return fmt.Errorf("%d bytes, more than Kafka's %d", len(name), maxTopicLen)
	case name == "." || name == "..":
		return fmt.Errorf("%q is not a legal topic name", name)
	}
	for i := 0; i < len(name); i++ {
		c := name[i]
		if !('a' <= c && c <= 'z' || 'A' <= c && c <= 'Z' || '0' <= c && c <= '9' || c == '.' || c == '_' || c == '-') {
			return fmt.Errorf("%q holds %q: Kafka topic names use only a-z, A-Z, 0-9, '.', '_' and '-'", name, c)
		}
	}
	return nil
}
