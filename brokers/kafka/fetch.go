package kafka

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"time"

	kafkago "github.com/segmentio/kafka-go"
	"github.com/segmentio/kafka-go/protocol"
	fetchAPI "github.com/segmentio/kafka-go/protocol/fetch"
)

// A partReader reads one partition with the read_committed isolation level.
//
// kafka-go's Reader cannot: whatever its IsolationLevel, it hands out the
// records of aborted transactions (it parses the fetch response's list of
// aborted transactions and drops it) and the transaction markers themselves
// (control records, as 4-byte-key, 6-byte-value messages), because its
// message reader ignores the batch attributes (segmentio/kafka-go issue
// 1332). So the Source fetches through kafka-go's Transport and protocol
// package instead, which expose the batch attributes, producer ids and the
// aborted transactions, and filters the way the Java client does: a
// transactional batch of a producer with an aborted transaction open at
// that offset is dropped, up to that producer's abort marker.
//
// next returns control records too, flagged, so that the Source can commit
// past them without handing them out.
type partReader struct {
	transport *kafkago.Transport
	addr      net.Addr
	topic     string
	partition int
	maxBytes  int
	maxWait   time.Duration

	offset  int64          // next offset to fetch
	buf     []fetched      // records of the last response not returned yet
	aborted map[int64]bool // producers with an aborted transaction open at offset
	pending []fetchAPI.ResponseTransaction
}

// fetched is one record of a fetch response.
type fetched struct {
	msg     kafkago.Message
	control bool // a transaction marker: never handed out
}

// errOffsetOutOfRange is returned by next when the partition no longer has
// (or does not yet have) the offset asked for.
var errOffsetOutOfRange = errors.New("offset out of range")

// next returns the partition's next record at or after the reader's offset,
// fetching when its buffer is empty. It skips aborted records.
func (r *partReader) next(ctx context.Context) (fetched, error) {
	for len(r.buf) == 0 {
		if err := r.fetch(ctx); err != nil {
			return fetched{}, err
		}
	}
	f := r.buf[0]
	r.buf = r.buf[1:]
	return f, nil
}

// fetch makes one fetch request and fills buf with what it returns.
func (r *partReader) fetch(ctx context.Context) error {
	req := &fetchAPI.Request{
		ReplicaID:      -1,
		MaxWaitTime:    int32(r.maxWait / time.Millisecond),
		MinBytes:       1,
		MaxBytes:       int32(r.maxBytes),
		IsolationLevel: int8(kafkago.ReadCommitted),
		SessionID:      -1,
		SessionEpoch:   -1,
		Topics: []fetchAPI.RequestTopic{{
			Topic: r.topic,
			Partitions: []fetchAPI.RequestPartition{{
				Partition:          int32(r.partition),
				CurrentLeaderEpoch: -1,
				FetchOffset:        r.offset,
				LogStartOffset:     -1,
				PartitionMaxBytes:  int32(r.maxBytes),
			}},
		}},
	}
	// The broker holds a fetch up to MaxWaitTime; bound the round trip.
	rctx, cancel := context.WithTimeout(ctx, r.maxWait+30*time.Second)
	defer cancel()
	m, err := r.transport.RoundTrip(rctx, r.addr, req)
	if err != nil {
		return fmt.Errorf("fetch: %w", err)
	}
	res, ok := m.(*fetchAPI.Response)
	if !ok {
		return fmt.Errorf("fetch: unexpected response %T", m)
	}
	if res.ErrorCode != 0 {
		return fmt.Errorf("fetch: %w", kafkago.Error(res.ErrorCode))
	}
	if len(res.Topics) != 1 || len(res.Topics[0].Partitions) != 1 {
		return errors.New("fetch: response is not for one partition")
	}
	p := &res.Topics[0].Partitions[0]
	if p.ErrorCode != 0 {
		if kafkago.Error(p.ErrorCode) == kafkago.OffsetOutOfRange {
			return fmt.Errorf("fetch at offset %d: %w", r.offset, errOffsetOutOfRange)
		}
		return fmt.Errorf("fetch: %w", kafkago.Error(p.ErrorCode))
	}
	r.pending = append(r.pending, p.AbortedTransactions...)
	if p.RecordSet.Records == nil {
		return nil
	}
	return r.decode(p.RecordSet.Records)
}

// decode appends the records of rr at or after the reader's offset to buf,
// dropping aborted ones, and advances the offset past everything seen.
func (r *partReader) decode(rr protocol.RecordReader) error {
	batches := []protocol.RecordReader{rr}
	if s, ok := rr.(*protocol.RecordStream); ok {
		batches = s.Records
	}
	for _, b := range batches {
		var (
			producer      int64 = -1
			transactional bool
			control       bool
		)
		switch b := b.(type) {
		case *protocol.RecordBatch:
			producer, transactional = b.ProducerID, b.Attributes.Transactional()
		case *protocol.ControlBatch:
			producer, transactional, control = b.ProducerID, true, true
		}
		for {
			rec, err := b.ReadRecord()
			if errors.Is(err, io.EOF) {
				break
			}
			if err != nil {
				return fmt.Errorf("decode records at offset %d: %w", r.offset, err)
			}
			f, keep, err := r.record(rec, producer, transactional, control)
			if err != nil {
				return err
			}
			if keep {
				r.buf = append(r.buf, f)
			}
		}
	}
	return nil
}

// record reads one record of a batch, and reports whether it is returned.
func (r *partReader) record(rec *protocol.Record, producer int64, transactional, control bool) (fetched, bool, error) {
	defer closeBytes(rec.Key)
	defer closeBytes(rec.Value)
	if rec.Offset < r.offset {
		return fetched{}, false, nil // a batch may start before the offset asked for
	}
	r.offset = rec.Offset + 1
	// Aborted transactions that began at or before this offset are open.
	rest := r.pending[:0]
	for _, t := range r.pending {
		if t.FirstOffset <= rec.Offset {
			if r.aborted == nil {
				r.aborted = map[int64]bool{}
			}
			r.aborted[t.ProducerID] = true
		} else {
			rest = append(rest, t)
		}
	}
	r.pending = rest
	key, err := protocol.ReadAll(rec.Key)
	if err != nil {
		return fetched{}, false, fmt.Errorf("read key at offset %d: %w", rec.Offset, err)
	}
	if control {
		// The key is version int16, type int16: 0 aborts, 1 commits.
		if len(key) == 4 && key[2] == 0 && key[3] == 0 {
			delete(r.aborted, producer)
		}
		return fetched{msg: kafkago.Message{Topic: r.topic, Partition: r.partition, Offset: rec.Offset}, control: true}, true, nil
	}
	if transactional && r.aborted[producer] {
		return fetched{}, false, nil
	}
	value, err := protocol.ReadAll(rec.Value)
	if err != nil {
		return fetched{}, false, fmt.Errorf("read value at offset %d: %w", rec.Offset, err)
	}
	m := kafkago.Message{
		Topic:     r.topic,
		Partition: r.partition,
		Offset:    rec.Offset,
		Key:       key,
		Value:     value,
		Time:      rec.Time,
	}
	if len(rec.Headers) > 0 {
		m.Headers = append([]kafkago.Header(nil), rec.Headers...)
	}
	return fetched{msg: m}, true, nil
}

func closeBytes(b protocol.Bytes) {
	if b != nil {
		_ = b.Close()
	}
}

// resolveOffset turns kafkago.FirstOffset or kafkago.LastOffset into the
// partition's earliest or latest offset; other offsets are returned as
// they are.
func resolveOffset(ctx context.Context, client *kafkago.Client, topic string, partition int, offset int64) (int64, error) {
	if offset != kafkago.FirstOffset && offset != kafkago.LastOffset {
		return offset, nil
	}
	req := kafkago.FirstOffsetOf(partition)
	if offset == kafkago.LastOffset {
		req = kafkago.LastOffsetOf(partition)
	}
	resp, err := client.ListOffsets(ctx, &kafkago.ListOffsetsRequest{
		Topics:         map[string][]kafkago.OffsetRequest{topic: {req}},
		IsolationLevel: kafkago.ReadCommitted,
	})
	if err != nil {
		return 0, fmt.Errorf("list offsets: %w", err)
	}
	for _, p := range resp.Topics[topic] {
		if p.Partition != partition {
			continue
		}
		if p.Error != nil {
			return 0, fmt.Errorf("list offsets: %w", p.Error)
		}
		if offset == kafkago.FirstOffset {
			return p.FirstOffset, nil
		}
		return p.LastOffset, nil
	}
	return 0, fmt.Errorf("list offsets: no answer for partition %d", partition)
}
