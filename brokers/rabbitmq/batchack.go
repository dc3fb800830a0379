package rabbitmq

import (
	"context"
	"errors"
	"fmt"
	"slices"

	"github.com/idemq/idemq/consumer"
)

var _ consumer.BatchAcker = (*Source)(nil)

// AckBatch acks deliveries this Source delivered, in as few broker calls as
// it safely can. It implements consumer.BatchAcker for the runtime's batch
// mode. On each channel, the deliveries whose tags lie below every other
// unacked tag of that channel are acked with one multiple ack; the rest,
// whose tags interleave with deliveries still in flight elsewhere, are acked
// one by one, so an ack never covers a message whose effect is not yet
// committed. Deliveries of a lost channel are abandoned (ErrDeliveryStale),
// exactly as Ack does.
func (s *Source) AckBatch(ctx context.Context, ds []consumer.Delivery) error {
	bySession := map[*session][]*delivery{}
	var errs []error
	for _, cd := range ds {
		d, ok := cd.(*delivery)
		if !ok || d.src != s {
			errs = append(errs, fmt.Errorf("rabbitmq: ack batch: %T is not a delivery of this source", cd))
			continue
		}
		bySession[d.sess] = append(bySession[d.sess], d)
	}
	for sess, group := range bySession {
		errs = append(errs, s.ackSession(ctx, sess, group))
	}
	return errors.Join(errs...)
}

func (s *Source) ackSession(ctx context.Context, sess *session, group []*delivery) error {
	var errs []error
	mine := make([]*delivery, 0, len(group))
	for _, d := range group {
		if !d.settled.CompareAndSwap(false, true) {
			errs = append(errs, fmt.Errorf("rabbitmq: ack delivery %d: already settled: %w", d.d.DeliveryTag, consumer.ErrDeliveryStale))
			continue
		}
		mine = append(mine, d)
	}
	if len(mine) == 0 {
		return errors.Join(errs...)
	}
	if sess.dead.Load() {
		for _, d := range mine {
			errs = append(errs, d.abandon("ack", nil))
		}
		return errors.Join(errs...)
	}
	slices.SortFunc(mine, func(a, b *delivery) int {
		switch {
		case a.d.DeliveryTag < b.d.DeliveryTag:
			return -1
		case a.d.DeliveryTag > b.d.DeliveryTag:
			return 1
		}
		return 0
	})
	batch := make(map[uint64]bool, len(mine))
	for _, d := range mine {
		batch[d.d.DeliveryTag] = true
	}
	// The lowest unacked tag outside this batch bounds the multiple ack.
	sess.mu.Lock()
	limit := ^uint64(0)
	for t := range sess.unacked {
		if !batch[t] && t < limit {
			limit = t
		}
	}
	sess.mu.Unlock()
	n := 0
	for n < len(mine) && mine[n].d.DeliveryTag < limit {
		n++
	}
	if n > 1 {
		last := mine[n-1]
		if err := sess.ch.Ack(last.d.DeliveryTag, true); err != nil {
			for _, d := range mine[:n] {
				errs = append(errs, d.abandon("ack", err))
			}
		} else {
			tags := make([]uint64, n)
			for i, d := range mine[:n] {
				tags[i] = d.d.DeliveryTag
			}
			sess.forget(tags...)
			s.acked.Add(int64(n))
			s.multiAcks.Add(1)
		}
		mine = mine[n:]
	}
	for _, d := range mine {
		if err := d.d.Ack(false); err != nil {
			errs = append(errs, d.abandon("ack", err))
			continue
		}
		sess.forget(d.d.DeliveryTag)
		s.acked.Add(1)
	}
	return errors.Join(errs...)
}
