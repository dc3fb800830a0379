package kafka

import (
	"context"
	"errors"
	"fmt"
	"io"
	"time"

	"github.com/idemq/idemq/consumer"
	kafkago "github.com/segmentio/kafka-go"
)

// RedeliveryHorizon implements the RedeliveryHorizon of consumer.Source: it returns the
// timestamp of the oldest record the group could still read again, over
// every partition of the topic (the janitor's purge covers the whole group,
// not this member's partitions): for each partition, the record at the
// group's committed offset, or, with no committed offset, at the offset
// Config.StartOffset resolves to. A partition read up to its end
// contributes nothing; with every partition read up to its end the horizon
// is zero (nothing redeliverable). It asks the brokers each time: the
// committed offsets are the ones a restarted or rebalanced member resumes
// from.
//
// It assumes timestamps do not decrease within a partition (true of
// LogAppendTime topics, and of CreateTime topics up to the producers' clock
// skew, which consumer.Config.HorizonMargin covers). If the brokers cannot
// be asked, it returns the error, and the janitor does not purge.
func (s *Source) RedeliveryHorizon(ctx context.Context) (time.Time, bool, error) {
	if s.isClosed() {
		return time.Time{}, false, fmt.Errorf("kafka: horizon: %w", consumer.ErrSourceClosed)
	}
	topic := s.cfg.Topic
	md, err := s.client.Metadata(ctx, &kafkago.MetadataRequest{Topics: []string{topic}})
	if err != nil {
		return time.Time{}, false, fmt.Errorf("kafka: horizon: metadata: %w", err)
	}
	var ids []int
	for _, t := range md.Topics {
		if t.Name != topic {
			continue
		}
		if t.Error != nil {
			return time.Time{}, false, fmt.Errorf("kafka: horizon: metadata of %s: %w", topic, t.Error)
		}
		for _, p := range t.Partitions {
			ids = append(ids, p.ID)
		}
	}
	if len(ids) == 0 {
		return time.Time{}, false, fmt.Errorf("kafka: horizon: topic %s has no partitions", topic)
	}
	of, err := s.client.OffsetFetch(ctx, &kafkago.OffsetFetchRequest{GroupID: s.cfg.GroupID, Topics: map[string][]int{topic: ids}})
	if err == nil && of.Error != nil && !errors.Is(of.Error, kafkago.GroupIdNotFound) {
		err = of.Error // GroupIdNotFound (kfake, a group that never committed): no commits
	}
	if err != nil {
		return time.Time{}, false, fmt.Errorf("kafka: horizon: committed offsets of group %s: %w", s.cfg.GroupID, err)
	}
	committed := map[int]int64{}
	for _, p := range of.Topics[topic] {
		if p.Error != nil {
			return time.Time{}, false, fmt.Errorf("kafka: horizon: committed offset of partition %d: %w", p.Partition, p.Error)
		}
		committed[p.Partition] = p.CommittedOffset
	}
	reqs := make([]kafkago.OffsetRequest, 0, 2*len(ids))
	for _, id := range ids {
		reqs = append(reqs, kafkago.FirstOffsetOf(id), kafkago.LastOffsetOf(id))
	}
	lo, err := s.client.ListOffsets(ctx, &kafkago.ListOffsetsRequest{Topics: map[string][]kafkago.OffsetRequest{topic: reqs}, IsolationLevel: kafkago.ReadCommitted})
	if err != nil {
		return time.Time{}, false, fmt.Errorf("kafka: horizon: list offsets: %w", err)
	}
	var horizon time.Time
	for _, p := range lo.Topics[topic] {
		if p.Error != nil {
			return time.Time{}, false, fmt.Errorf("kafka: horizon: offsets of partition %d: %w", p.Partition, p.Error)
		}
		from, ok := committed[p.Partition]
		if !ok || from < 0 {
			from = p.FirstOffset
			if s.cfg.StartOffset == kafkago.LastOffset {
				from = p.LastOffset
			}
		}
		from = max(from, p.FirstOffset) // older records are gone from the log
		if from >= p.LastOffset {
			continue // read to the end: nothing to redeliver
		}
		ts, err := s.recordTime(ctx, p.Partition, from)
		if err != nil {
			return time.Time{}, false, err
		}
		if horizon.IsZero() || ts.Before(horizon) {
			horizon = ts
		}
	}
	return horizon, true, nil
}

// recordTime returns the timestamp of the first record at or after offset
// in partition.
func (s *Source) recordTime(ctx context.Context, partition int, offset int64) (time.Time, error) {
	resp, err := s.client.Fetch(ctx, &kafkago.FetchRequest{Topic: s.cfg.Topic, Partition: partition, Offset: offset,
		MinBytes: 1, MaxBytes: 1 << 20, MaxWait: 500 * time.Millisecond, IsolationLevel: kafkago.ReadCommitted})
	if err == nil && resp.Error != nil {
		err = resp.Error
	}
	if err != nil {
		return time.Time{}, fmt.Errorf("kafka: horizon: fetch partition %d at %d: %w", partition, offset, err)
	}
	if resp.Records == nil {
		return time.Time{}, fmt.Errorf("kafka: horizon: partition %d has no record at %d yet", partition, offset)
	}
	if c, ok := resp.Records.(io.Closer); ok {
		defer c.Close()
	}
	for {
		r, err := resp.Records.ReadRecord()
		if errors.Is(err, io.EOF) {
			return time.Time{}, fmt.Errorf("kafka: horizon: partition %d has no record at %d yet", partition, offset)
		}
		if err != nil {
			return time.Time{}, fmt.Errorf("kafka: horizon: read partition %d at %d: %w", partition, offset, err)
		}
		if r.Offset >= offset {
			return r.Time, nil
		}
	}
}
