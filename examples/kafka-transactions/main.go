// Command kafka-transactions runs an idemq consumer on a Kafka topic written
// by a transactional producer, with brokers/franz's Source.
//
// A payments service writes its payments in Kafka transactions, as Kafka
// Streams, Flink or Spring with a KafkaTransactionManager do: one batch is
// committed, one is aborted (the service crashed half way), the aborted
// batch is retried in a committed transaction, and one payment is retried
// again in a later transaction, under the same idempotency-key. The ledger
// consumer reads the topic with franz.NewSource, which reads committed data
// only (read_committed), and books each payment once in Postgres. At the end
// it checks that exactly the committed payments were booked, each once, that
// no transaction marker reached the handler, and that the group committed
// every offset; it exits non-zero otherwise.
//
//	go run ./examples/kafka-transactions
//
// By default it starts an in-process Kafka-protocol cluster (franz-go's
// kfake) on 127.0.0.1; set KAFKA_BROKERS (host:port,...) to use a real
// cluster instead. Postgres comes from DATABASE_URL (default the local
// server). The program works in its own schema, idemq_example_kafka_txn,
// recreated on every run.
package main

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"os"
	"os/signal"
	"strings"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/idemq/idemq/brokers/franz"
	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/processed"
)

const (
	defaultDatabaseURL = "postgres://postgres@127.0.0.1:5432/test?sslmode=disable"
	schema             = "idemq_example_kafka_txn"
	partitions         = 3
	batch              = 20
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, os.Stdout); err != nil {
		fmt.Fprintln(os.Stderr, "kafka-transactions example:", err)
		os.Exit(1)
	}
}

func run(ctx context.Context, out io.Writer) error {
	dbURL := os.Getenv("DATABASE_URL")
	if dbURL == "" {
		dbURL = defaultDatabaseURL
	}
	var brokers []string
	for _, b := range strings.Split(os.Getenv("KAFKA_BROKERS"), ",") {
		if b = strings.TrimSpace(b); b != "" {
			brokers = append(brokers, b)
		}
	}
	where := "KAFKA_BROKERS"
	if len(brokers) == 0 {
		cluster, err := kfake.NewCluster(kfake.NumBrokers(1))
		if err != nil {
			return fmt.Errorf("start an in-process Kafka cluster: %w", err)
		}
		defer cluster.Close()
		brokers, where = cluster.ListenAddrs(), "in-process kfake"
	}
	store, err := processed.Open(ctx, dbURL, processed.Config{Schema: schema})
	if errors.As(err, new(*pgconn.ParseConfigError)) { // its text may quote the password
		return errors.New("invalid DATABASE_URL: check its syntax and parameters")
	}
	if err == nil {
		defer store.Close()
		err = setupSchema(ctx, store)
	}
	if err != nil {
		return fmt.Errorf("cannot set up Postgres (start it, or set DATABASE_URL): %w", err)
	}

	var b [4]byte
	_, _ = rand.Read(b[:])
	topic := "idemq-example.payments." + hex.EncodeToString(b[:])
	group := "idemq-example-ledger-" + hex.EncodeToString(b[:])
	admin, err := kgo.NewClient(kgo.SeedBrokers(brokers...))
	if err != nil {
		return err
	}
	defer admin.Close()
	if err := createTopic(ctx, admin, topic, topic+".dlq"); err != nil {
		return fmt.Errorf("cannot set up Kafka at %v (%s): %w", brokers, where, err)
	}

	// The payments service: a transactional producer.
	producer, err := kgo.NewClient(kgo.SeedBrokers(brokers...), kgo.DefaultProduceTopic(topic),
		kgo.TransactionalID("payments-service-"+hex.EncodeToString(b[:])))
	if err != nil {
		return err
	}
	defer producer.Close()
	txn := func(commit bool, from, to int) error {
		if err := producer.BeginTransaction(); err != nil {
			return err
		}
		var recs []*kgo.Record
		for i := from; i < to; i++ {
			id := fmt.Sprintf("payment-%03d", i)
			recs = append(recs, &kgo.Record{Key: fmt.Appendf(nil, "account-%d", i%7), Value: []byte(id),
				Headers: []kgo.RecordHeader{{Key: "idempotency-key", Value: []byte(id)}}})
		}
		if err := producer.ProduceSync(ctx, recs...).FirstErr(); err != nil {
			return err
		}
		end := kgo.TryAbort
		if commit {
			end = kgo.TryCommit
		}
		return producer.EndTransaction(ctx, end)
	}
	for _, step := range []struct {
		commit   bool
		from, to int
	}{
		{true, 0, batch},              // committed
		{false, batch, 2 * batch},     // aborted: the service crashed half way
		{true, batch, 2 * batch},      // the retry, committed
		{true, batch, batch + 1},      // one payment retried once more: a duplicate
		{false, 2 * batch, 3 * batch}, // aborted, never retried
	} {
		if err := txn(step.commit, step.from, step.to); err != nil {
			return fmt.Errorf("produce: %w", err)
		}
	}
	fmt.Fprintf(out, "produced to %s (%s, %d partitions): 2 committed batches of %d, 1 duplicate, 2 aborted batches of %d\n",
		topic, where, partitions, batch, batch)

	// The ledger: franz's Source reads committed records only.
	src, err := franz.NewSource(franz.Config{Brokers: brokers, Topic: topic, Group: group, CommitInterval: 100 * time.Millisecond})
	if err != nil {
		return err
	}
	var markers atomic.Int64
	rt, err := consumer.New(consumer.Config{
		Name: "ledger", Source: src, Store: store, Concurrency: 4,
		// Failed payments go to the dead-letter topic, topic+".dlq", on
		// the Source's own client, before their offsets may be committed.
		Handler: func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
			if !strings.HasPrefix(string(m.Body), "payment-") {
				markers.Add(1) // a transaction marker or an aborted record: never happens
			}
			_, err := tx.Exec(ctx, "INSERT INTO "+schema+".ledger (payment_id) VALUES ($1)", string(m.Body))
			return err
		},
	})
	if err != nil {
		_ = src.Close()
		return err
	}
	runCtx, cancel := context.WithCancel(ctx)
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- rt.Run(runCtx) }()
	want := int64(2 * batch)
	for s := rt.Stats(); s.Applied+s.Duplicates < want+1 || s.InFlight > 0; s = rt.Stats() {
		select {
		case err := <-done:
			return fmt.Errorf("runtime stopped early: %v", err)
		case <-ctx.Done():
			cancel()
			<-done
			return ctx.Err()
		case <-time.After(10 * time.Millisecond):
		}
	}
	time.Sleep(time.Second) // anything aborted would arrive now
	cancel()
	if err := <-done; err != nil {
		return err
	}

	var booked, distinct, aborted int64
	if err := store.Pool().QueryRow(ctx, `SELECT count(*), count(DISTINCT payment_id), count(*) FILTER (WHERE payment_id >= $1)
		FROM `+schema+`.ledger`, fmt.Sprintf("payment-%03d", 2*batch)).Scan(&booked, &distinct, &aborted); err != nil {
		return err
	}
	lag, err := groupLag(ctx, admin, group, topic)
	if err != nil {
		return err
	}
	s := rt.Stats()
	fmt.Fprintf(out, "applied             %d\n", s.Applied)
	fmt.Fprintf(out, "duplicates skipped  %d\n", s.Duplicates)
	fmt.Fprintf(out, "ledger rows         %d (%d distinct)\n", booked, distinct)
	fmt.Fprintf(out, "aborted booked      %d\n", aborted)
	fmt.Fprintf(out, "markers handled     %d\n", markers.Load())
	fmt.Fprintf(out, "group lag           %d\n", lag)
	if booked != want || distinct != want || aborted != 0 || markers.Load() != 0 || lag != 0 {
		return errors.New("FAILED: the ledger does not hold exactly the committed payments, each once")
	}
	fmt.Fprintln(out, "OK: exactly the committed payments booked, each once")
	return nil
}

// setupSchema recreates the example's schema: the dedup table and the
// ledger.
func setupSchema(ctx context.Context, store *processed.Store) error {
	if _, err := store.Pool().Exec(ctx, "DROP SCHEMA IF EXISTS "+schema+" CASCADE"); err != nil {
		return err
	}
	if err := store.Migrate(ctx); err != nil {
		return err
	}
	_, err := store.Pool().Exec(ctx, "CREATE TABLE "+schema+".ledger (payment_id text NOT NULL)")
	return err
}

func createTopic(ctx context.Context, cl *kgo.Client, topics ...string) error {
	req := kmsg.NewPtrCreateTopicsRequest()
	for _, topic := range topics {
		t := kmsg.NewCreateTopicsRequestTopic()
		t.Topic, t.NumPartitions, t.ReplicationFactor = topic, partitions, 1
		req.Topics = append(req.Topics, t)
	}
	resp, err := req.RequestWith(ctx, cl)
	if err != nil {
		return err
	}
	for _, t := range resp.Topics {
		if t.ErrorCode != 0 {
			return fmt.Errorf("create topic %s: error code %d", t.Topic, t.ErrorCode)
		}
	}
	return nil
}

// groupLag is the sum over the topic's partitions of the end offset minus
// the group's committed offset.
func groupLag(ctx context.Context, cl *kgo.Client, group, topic string) (int64, error) {
	lo := kmsg.NewPtrListOffsetsRequest()
	lt := kmsg.NewListOffsetsRequestTopic()
	lt.Topic = topic
	for p := range int32(partitions) {
		lp := kmsg.NewListOffsetsRequestTopicPartition()
		lp.Partition, lp.Timestamp = p, -1
		lt.Partitions = append(lt.Partitions, lp)
	}
	lo.Topics = append(lo.Topics, lt)
	lresp, err := lo.RequestWith(ctx, cl)
	if err != nil {
		return 0, err
	}
	of := kmsg.NewPtrOffsetFetchRequest()
	of.Group = group
	ot := kmsg.NewOffsetFetchRequestTopic()
	ot.Topic, ot.Partitions = topic, []int32{0, 1, 2}
	of.Topics = append(of.Topics, ot)
	oresp, err := of.RequestWith(ctx, cl)
	if err != nil {
		return 0, err
	}
	committed := map[int32]int64{}
	for _, t := range oresp.Topics {
		for _, p := range t.Partitions {
			committed[p.Partition] = max(p.Offset, 0)
		}
	}
	var lag int64
	for _, t := range lresp.Topics {
		for _, p := range t.Partitions {
			lag += p.Offset - committed[p.Partition]
		}
	}
	return lag, nil
}
