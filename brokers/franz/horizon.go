package franz

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/idemq/idemq/consumer"
)

// RedeliveryHorizon implements the RedeliveryHorizon of consumer.Source, as the kafka
// package's Source does: the timestamp of the oldest record the group could
// still read again, over every partition of the topic (the record at the
// group's committed offset, or, with none committed, at the reset offset),
// zero if every partition is committed to its end. It asks the brokers each
// time; if they cannot be asked it returns the error, and the janitor does
// not purge. It assumes timestamps do not decrease within a partition, up
// to the skew consumer.Config.HorizonMargin covers.
func (s *Source) RedeliveryHorizon(ctx context.Context) (time.Time, bool, error) {
	if s.isClosed() {
		return time.Time{}, false, fmt.Errorf("franz: horizon: %w", consumer.ErrSourceClosed)
	}
	topic := s.cfg.Topic
	fail := func(what string, err error) (time.Time, bool, error) {
		return time.Time{}, false, fmt.Errorf("franz: horizon: %s: %w", what, err)
	}
	mreq := kmsg.NewPtrMetadataRequest()
	mt := kmsg.NewMetadataRequestTopic()
	mt.Topic = kmsg.StringPtr(topic)
	mreq.Topics = append(mreq.Topics, mt)
	mresp, err := mreq.RequestWith(ctx, s.cl)
	if err != nil {
		return fail("metadata", err)
	}
	leaders := map[int32]int32{}
	var topicID [16]byte
	for _, t := range mresp.Topics {
		if t.Topic == nil || *t.Topic != topic {
			continue
		}
		if err := kerr.ErrorForCode(t.ErrorCode); err != nil {
			return fail("metadata of "+topic, err)
		}
		topicID = t.TopicID
		for _, p := range t.Partitions {
			leaders[p.Partition] = p.Leader
		}
	}
	if len(leaders) == 0 {
		return fail("metadata", fmt.Errorf("topic %s has no partitions", topic))
	}

	oreq := kmsg.NewPtrOffsetFetchRequest()
	oreq.Group = s.cfg.Group
	ot := kmsg.NewOffsetFetchRequestTopic()
	ot.Topic = topic
	for p := range leaders {
		ot.Partitions = append(ot.Partitions, p)
	}
	oreq.Topics = append(oreq.Topics, ot)
	oresp, err := oreq.RequestWith(ctx, s.cl)
	if err == nil {
		err = kerr.ErrorForCode(oresp.ErrorCode)
	}
	noGroup := errors.Is(err, kerr.GroupIDNotFound) // kfake, for a group that never committed
	if err != nil && !noGroup {
		return fail("committed offsets of group "+s.cfg.Group, err)
	}
	committed := map[int32]int64{}
	for _, t := range oresp.Topics {
		if noGroup {
			break
		}
		for _, p := range t.Partitions {
			if err := kerr.ErrorForCode(p.ErrorCode); err != nil {
				return fail(fmt.Sprintf("committed offset of partition %d", p.Partition), err)
			}
			committed[p.Partition] = p.Offset
		}
	}

	bounds := func(ts int64) (map[int32]int64, error) {
		req := kmsg.NewPtrListOffsetsRequest()
		req.ReplicaID = -1
		req.IsolationLevel = 1
		rt := kmsg.NewListOffsetsRequestTopic()
		rt.Topic = topic
		for p := range leaders {
			rp := kmsg.NewListOffsetsRequestTopicPartition()
			rp.Partition, rp.Timestamp, rp.CurrentLeaderEpoch = p, ts, -1
			rt.Partitions = append(rt.Partitions, rp)
		}
		req.Topics = append(req.Topics, rt)
		resp, err := req.RequestWith(ctx, s.cl)
		if err != nil {
			return nil, err
		}
		out := map[int32]int64{}
		for _, t := range resp.Topics {
			for _, p := range t.Partitions {
				if err := kerr.ErrorForCode(p.ErrorCode); err != nil {
					return nil, fmt.Errorf("partition %d: %w", p.Partition, err)
				}
				out[p.Partition] = p.Offset
			}
		}
		return out, nil
	}
	first, err := bounds(-2)
	if err != nil {
		return fail("earliest offsets", err)
	}
	last, err := bounds(-1)
	if err != nil {
		return fail("latest offsets", err)
	}
	var horizon time.Time
	for p, leader := range leaders {
		from, ok := committed[p]
		if !ok || from < 0 {
			from = first[p]
			if s.cfg.ResetToLatest {
				from = last[p]
			}
		}
		from = max(from, first[p])
		if from >= last[p] {
			continue
		}
		ts, err := s.recordTime(ctx, topicID, leader, p, from)
		if err != nil {
			return fail(fmt.Sprintf("record at %d of partition %d", from, p), err)
		}
		if horizon.IsZero() || ts.Before(horizon) {
			horizon = ts
		}
	}
	return horizon, true, nil
}

// recordTime fetches from the partition's leader the first committed record
// at or after offset and returns its timestamp.
func (s *Source) recordTime(ctx context.Context, topicID [16]byte, leader, partition int32, offset int64) (time.Time, error) {
	req := kmsg.NewPtrFetchRequest()
	req.ReplicaID = -1
	req.MaxWaitMillis = 500
	req.MinBytes = 1
	req.MaxBytes = 1 << 20
	req.IsolationLevel = 1
	req.SessionEpoch = -1
	rt := kmsg.NewFetchRequestTopic()
	rt.Topic, rt.TopicID = s.cfg.Topic, topicID // by name up to v12, by id from v13
	rp := kmsg.NewFetchRequestTopicPartition()
	rp.Partition, rp.FetchOffset, rp.PartitionMaxBytes, rp.CurrentLeaderEpoch, rp.LogStartOffset = partition, offset, 1<<20, -1, -1
	rt.Partitions = append(rt.Partitions, rp)
	req.Topics = append(req.Topics, rt)
	resp, err := req.RequestWith(ctx, s.cl.Broker(int(leader)))
	if err != nil {
		return time.Time{}, err
	}
	if err := kerr.ErrorForCode(resp.ErrorCode); err != nil {
		return time.Time{}, err
	}
	for _, t := range resp.Topics {
		for i := range t.Partitions {
			fp, _ := kgo.ProcessFetchPartition(kgo.ProcessFetchPartitionOpts{
				Offset: offset, IsolationLevel: kgo.ReadCommitted(), Topic: s.cfg.Topic, Partition: partition,
			}, &t.Partitions[i], kgo.DefaultDecompressor(), nil)
			if fp.Err != nil {
				return time.Time{}, fp.Err
			}
			for _, r := range fp.Records {
				if r.Offset >= offset {
					return r.Timestamp, nil
				}
			}
		}
	}
	return time.Time{}, fmt.Errorf("no record at %d yet", offset)
}
