package kafka

import (
	"slices"
	"strconv"

	"github.com/idemq/idemq/consumer"
	kafkago "github.com/segmentio/kafka-go"
)

// Mapping is how a record becomes a consumer.Message: the Source and the
// Browser use it, and so does brokers/franz's Source, so that a message
// looks the same whichever of them, and whichever Kafka client, read it.
// Its zero value maps like a Source with a zero Config.
type Mapping struct {
	// IDHeader is the record header holding the message id. Defaults to
	// "idempotency-key".
	IDHeader string
	// DisableFallbackID leaves Message.ID empty for a record without the
	// IDHeader header, instead of FallbackID's "topic/partition/offset".
	DisableFallbackID bool
	// KeyMode chooses Message.Key, the ordering key. Defaults to
	// KeyPartition.
	KeyMode KeyMode
}

// Message converts a kafka-go record. Key is the runtime's ordering key
// (see KeyMode) and RecordKey the record's own key, byte for byte (nil for a
// null key); Metadata holds the record's coordinates and key, and callers
// may add their own entries.
func (mp Mapping) Message(m kafkago.Message) *consumer.Message {
	idHeader := mp.IDHeader
	if idHeader == "" {
		idHeader = DefaultIDHeader
	}
	headers := make(map[string]string, len(m.Headers))
	for _, h := range m.Headers {
		headers[h.Key] = string(h.Value)
	}
	id := headers[idHeader]
	if id == "" && !mp.DisableFallbackID {
		id = FallbackID(m.Topic, m.Partition, m.Offset)
	}
	key := m.Topic + "/" + strconv.Itoa(m.Partition)
	if mp.KeyMode == KeyRecord {
		key += "/" + string(m.Key)
	}
	return &consumer.Message{
		ID:        id,
		Key:       key,
		RecordKey: recordKey(m.Key),
		Body:      m.Value,
		Headers:   headers,
		Source:    m.Topic,
		Partition: int32(m.Partition),
		Offset:    m.Offset,
		Timestamp: m.Time,
		Metadata: map[string]string{
			"kafka.topic":     m.Topic,
			"kafka.partition": strconv.Itoa(m.Partition),
			"kafka.offset":    strconv.FormatInt(m.Offset, 10),
			"kafka.key":       string(m.Key),
		},
	}
}

// Record is the inverse of Message: the record Publisher writes for m to
// topic, and brokers/franz's dead-letterer too. Message.ID goes to the
// IDHeader header (replacing a header of that name in Headers), Headers to
// record headers (sorted by name), RecordKey to the record key (nil writes
// a null key), Body to the value and Timestamp to the record time. Key, the
// runtime's ordering key, is never written.
func (mp Mapping) Record(topic string, m *consumer.Message) kafkago.Message {
	idHeader := mp.IDHeader
	if idHeader == "" {
		idHeader = DefaultIDHeader
	}
	r := kafkago.Message{Topic: topic, Value: m.Body, Time: m.Timestamp}
	if m.RecordKey != nil {
		r.Key = m.RecordKey
	}
	names := make([]string, 0, len(m.Headers))
	for k := range m.Headers {
		if m.ID != "" && k == idHeader {
			continue
		}
		names = append(names, k)
	}
	slices.Sort(names)
	for _, k := range names {
		r.Headers = append(r.Headers, kafkago.Header{Key: k, Value: []byte(m.Headers[k])})
	}
	if m.ID != "" {
		r.Headers = append(r.Headers, kafkago.Header{Key: idHeader, Value: []byte(m.ID)})
	}
	return r
}

// recordKey returns k as a Message.RecordKey: nil for a null key, a
// non-nil (possibly empty) slice otherwise.
func recordKey(k []byte) []byte {
	if k == nil {
		return nil
	}
	return append([]byte{}, k...)
}
