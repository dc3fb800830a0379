package kafka

import (
	"github.com/idemq/idemq/internal/kafkamsg"
	kafkago "github.com/segmentio/kafka-go"
)

// record converts a kafka-go message for kafkamsg, which maps records the
// same way for both Kafka adapters.
func record(m kafkago.Message) kafkamsg.Record {
	r := kafkamsg.Record{Topic: m.Topic, Partition: m.Partition, Offset: m.Offset, Key: m.Key, Value: m.Value, Time: m.Time}
	if len(m.Headers) > 0 {
		r.Headers = make([]kafkamsg.Header, len(m.Headers))
		for i, h := range m.Headers {
			r.Headers[i] = kafkamsg.Header{Key: h.Key, Value: h.Value}
		}
	}
	return r
}

// kafkaRecord is the inverse of record: the kafka-go message Publisher
// writes.
func kafkaRecord(r kafkamsg.Record) kafkago.Message {
	m := kafkago.Message{Topic: r.Topic, Key: r.Key, Value: r.Value, Time: r.Time}
	if len(r.Headers) > 0 {
		m.Headers = make([]kafkago.Header, len(r.Headers))
		for i, h := range r.Headers {
			m.Headers[i] = kafkago.Header{Key: h.Key, Value: h.Value}
		}
	}
	return m
}
