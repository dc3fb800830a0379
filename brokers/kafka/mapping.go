package kafka

import (
	"strconv"

	"github.com/idemq/idemq/consumer"
	kafkago "github.com/segmentio/kafka-go"
)

// mapper turns kafka-go records into consumer.Messages. A Source and a
// Browser share it, so a browsed record looks exactly like a consumed one.
type mapper struct {
	idHeader        string
	disableFallback bool
	keyMode         KeyMode
}

// message converts a kafka-go record. Key is the runtime's ordering key
// (see KeyMode) and RecordKey the record's own key, byte for byte; Metadata
// holds the record's coordinates and key; callers add their own entries.
func (mp mapper) message(m kafkago.Message) *consumer.Message {
	headers := make(map[string]string, len(m.Headers))
	for _, h := range m.Headers {
		headers[h.Key] = string(h.Value)
	}
	id := headers[mp.idHeader]
	if id == "" && !mp.disableFallback {
		id = FallbackID(m.Topic, m.Partition, m.Offset)
	}
	key := m.Topic + "/" + strconv.Itoa(m.Partition)
	if mp.keyMode == KeyRecord {
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

// recordKey returns k as a Message.RecordKey: nil for a null key, a
// non-nil (possibly empty) slice otherwise.
func recordKey(k []byte) []byte {
	if k == nil {
		return nil
	}
	return append([]byte{}, k...)
}
