package redisstream

import (
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/internal/wire"
)

// HeaderEntryID is the header holding the id of the entry a message first
// had in Redis. The Source sets it when a message does not carry it yet, so
// that a dead-lettered copy (and a requeued one) still names the entry it
// came from, as x-idemq-source names its stream. The entry a message was
// read from now is always in Metadata[MetaEntryID].
const HeaderEntryID = "x-idemq-redis-entry-id"

// Keys of consumer.Message.Metadata set by Source and Browser.
const (
	MetaStream   = "redis.stream"
	MetaEntryID  = "redis.entry_id"
	MetaGroup    = "redis.group"
	MetaConsumer = "redis.consumer"
	// MetaDelivery says how the Source got the entry: "new"
	// (XREADGROUP >), "nack" (re-delivered to itself after a Nack),
	// "claimed" (XAUTOCLAIM from another consumer, or itself, after
	// MinIdle) or "pending" (one of its own pending entries it had lost
	// track of). Every delivery but "new" has a delivery count above one
	// and Message.Redelivered set.
	MetaDelivery = "redis.delivery"
)

// How a Source got an entry (Metadata[MetaDelivery]).
const (
	deliveryNew     = "new"
	deliveryNack    = "nack"
	deliveryClaimed = "claimed"
	deliveryPending = "pending"
)

// ErrReservedField is returned (wrapped) by Publish for a message with a
// header named like the body field: it would overwrite the body.
var ErrReservedField = errors.New("redisstream: header name is a reserved entry field")

// mapping turns stream entries into messages and back. The Source, the
// dead-letterer, the Publisher and the Browser share it, so an entry looks
// the same whoever reads it.
type mapping struct {
	bodyField         string
	disableFallbackID bool // the Browser's: a dead letter's entry id is not its identity
}

// message converts entry e of stream. Fields other than the body field
// become headers; the id and x-idemq-key fields are Message.ID and
// Message.Key too.
func (mp mapping) message(stream string, e redis.XMessage) *consumer.Message {
	headers := make(map[string]string, len(e.Values))
	var body []byte
	var id, key string
	for k, v := range e.Values {
		s := fieldString(v)
		switch {
		case k == mp.bodyField:
			body = []byte(s)
		case k == idField:
			// Kept as a header too, so that the runtime's
			// MessageID can read it without the fallback.
			id = s
			headers[k] = s
		case k == wire.KeyHeader:
			key = s
			headers[k] = s
		default:
			headers[k] = s
		}
	}
	if id == "" && !mp.disableFallbackID {
		id = fallbackID(stream, e.ID)
	}
	if _, ok := headers[HeaderEntryID]; !ok {
		headers[HeaderEntryID] = e.ID
	}
	return &consumer.Message{
		ID:        id,
		Key:       key,
		Body:      body,
		Headers:   headers,
		Source:    stream,
		Partition: -1,
		Offset:    -1,
		Timestamp: entryTime(e.ID),
		Metadata:  map[string]string{MetaStream: stream, MetaEntryID: e.ID},
	}
}

// values is the inverse of message: the fields XADD writes for m. The id
// field holds Message.ID and the x-idemq-key field Message.Key (a header
// of either name is dropped when the field is set), the body field the
// body, and every header a field of its own, sorted by name.
// RecordKey and Timestamp are not written: an entry has no record key, and
// its id carries its time.
func (mp mapping) values(m *consumer.Message) ([]any, error) {
	names := make([]string, 0, len(m.Headers))
	for k := range m.Headers {
		switch {
		case k == idField && m.ID != "", k == wire.KeyHeader && m.Key != "":
			continue
		case k == mp.bodyField:
			return nil, fmt.Errorf("%w: header %q", ErrReservedField, k)
		}
		names = append(names, k)
	}
	slices.Sort(names)
	vals := make([]any, 0, 2*len(names)+6)
	if m.ID != "" {
		vals = append(vals, idField, m.ID)
	}
	if m.Key != "" {
		vals = append(vals, wire.KeyHeader, m.Key)
	}
	for _, k := range names {
		vals = append(vals, k, m.Headers[k])
	}
	// Always written, even empty: XADD needs at least one field.
	vals = append(vals, mp.bodyField, m.Body)
	return vals, nil
}

func fieldString(v any) string {
	switch v := v.(type) {
	case string:
		return v
	case []byte:
		return string(v)
	case nil:
		return ""
	default:
		return fmt.Sprint(v)
	}
}

// entryTime is the time in an entry id's first part (milliseconds since the
// epoch), or the zero time if it has none.
func entryTime(id string) time.Time {
	ms, _, _ := strings.Cut(id, "-")
	n, err := strconv.ParseInt(ms, 10, 64)
	if err != nil || n <= 0 {
		return time.Time{}
	}
	return time.UnixMilli(n).UTC()
}
