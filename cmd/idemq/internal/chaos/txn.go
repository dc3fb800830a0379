package chaos

import (
	"context"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/idemq/idemq/consumer"
)

// txnProducer publishes each call as one Kafka transaction, with franz-go
// and one transactional id, committed or aborted as the caller asks.
type txnProducer struct {
	brokers []string
	topic   string
	txnID   string
	cl      *kgo.Client
}

// txnOutcome is what became of a transaction.
type txnOutcome int

const (
	txnUnknown   txnOutcome = iota // an error left the outcome open
	txnCommitted                   // EndTransaction(TryCommit) succeeded
	txnAborted                     // EndTransaction(TryAbort) succeeded: never visible to read_committed
)

func (p *txnProducer) client() (*kgo.Client, error) {
	if p.cl != nil {
		return p.cl, nil
	}
	cl, err := kgo.NewClient(kgo.SeedBrokers(p.brokers...), kgo.TransactionalID(p.txnID),
		kgo.DefaultProduceTopic(p.topic), kgo.TransactionTimeout(10*time.Second),
		kgo.RecordPartitioner(kgo.StickyKeyPartitioner(nil)))
	if err != nil {
		return nil, err
	}
	p.cl = cl
	return cl, nil
}

// reset drops the client after an error; the next one's InitProducerID
// fences this one and aborts a transaction it left open.
func (p *txnProducer) reset() {
	if p.cl != nil {
		p.cl.Close()
		p.cl = nil
	}
}

func (p *txnProducer) close() { p.reset() }

// publish writes msgs in one transaction and commits it, or aborts it if
// abort is set (or a record failed). The error is the first failure.
func (p *txnProducer) publish(ctx context.Context, msgs []*consumer.Message, abort bool) (txnOutcome, error) {
	cl, err := p.client()
	if err != nil {
		return txnUnknown, err
	}
	if err := cl.BeginTransaction(); err != nil {
		p.reset()
		return txnUnknown, err
	}
	recs := make([]*kgo.Record, len(msgs))
	for i, m := range msgs {
		r := &kgo.Record{Key: []byte(m.ID), Value: m.Body,
			Headers: []kgo.RecordHeader{{Key: "idempotency-key", Value: []byte(m.ID)}}}
		for k, v := range m.Headers {
			r.Headers = append(r.Headers, kgo.RecordHeader{Key: k, Value: []byte(v)})
		}
		recs[i] = r
	}
	perr := cl.ProduceSync(ctx, recs...).FirstErr()
	end := kgo.TryCommit
	if abort || perr != nil {
		end = kgo.TryAbort
	}
	if err := cl.EndTransaction(ctx, end); err != nil {
		p.reset()
		return txnUnknown, err
	}
	if end == kgo.TryAbort {
		return txnAborted, perr
	}
	return txnCommitted, nil
}
