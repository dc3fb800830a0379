package bench

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"strings"
	"sync"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	kafkago "github.com/segmentio/kafka-go"
	"github.com/twmb/franz-go/pkg/kfake"

	"github.com/idemq/idemq/brokers/kafka"
	"github.com/idemq/idemq/brokers/memory"
	"github.com/idemq/idemq/brokers/rabbitmq"
	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/internal/kafkatest"
	"github.com/idemq/idemq/internal/redact"
)

// brokerEnv is one broker for a whole Run; each mode gets a fresh target
// (a queue or a topic) on it.
type brokerEnv interface {
	target(ctx context.Context, m Mode) (target, error)
	close()
}

// rawHandler handles one delivery of the raw-client modes; the delivery is
// acked if it returns nil. It returns an error only when ctx is done.
type rawHandler func(ctx context.Context, id string, body []byte, publishedAt string) error

// target is one mode's queue or topic.
type target interface {
	publish(ctx context.Context, msgs []*consumer.Message) error
	// source returns the idemq Source for mode m.
	source(ctx context.Context, m Mode) (consumer.Source, error)
	// consume runs the raw client with workers goroutines until ctx is
	// done, calling handle for each delivery, then acking it.
	consume(ctx context.Context, m Mode, workers int, handle rawHandler) error
	// ready waits until the consumer just started, with members group
	// members, receives: for Kafka, until its group is stable, so that
	// joining is not measured.
	ready(ctx context.Context, members int) error
	cleanup()
}

// newBrokerEnv connects to cfg's broker. On error it returns a nil
// brokerEnv, never a nil pointer in a non-nil interface.
func newBrokerEnv(ctx context.Context, cfg Config) (brokerEnv, error) {
	switch cfg.Broker {
	case BrokerRabbitMQ:
		e, err := newRabbitEnv(ctx, cfg)
		if err != nil {
			return nil, err
		}
		return e, nil
	case BrokerKafka:
		e, err := newKafkaEnv(ctx, cfg)
		if err != nil {
			return nil, err
		}
		return e, nil
	case BrokerNATS:
		e, err := newNATSEnv(ctx, cfg)
		if err != nil {
			return nil, err
		}
		return e, nil
	case BrokerRedis:
		e, err := newRedisEnv(ctx, cfg)
		if err != nil {
			return nil, err
		}
		return e, nil
	default:
		return &memoryEnv{cfg: cfg, b: memory.NewBroker()}, nil
	}
}

// prefetch is the number of unacked deliveries a consumer of mode m may
// hold: twice the lanes per message, a full batch per lane in batch modes
// and for broker-only (the ceiling). With Shards the runtime has
// Concurrency lanes on each shard.
func prefetch(cfg Config, m Mode) int {
	lanes := cfg.Concurrency * max(cfg.Shards, 1)
	switch m {
	case ModeNaive1:
		return 2
	case ModeIdemq, ModeNaive:
		return 2 * lanes
	default:
		return min(2*lanes*cfg.BatchSize, 65535)
	}
}

func targetName(m Mode) string { return "idemq-bench-" + string(m) + "-" + randomHex(4) }

// --- memory ---

type memoryEnv struct {
	cfg Config
	b   *memory.Broker
}

func (e *memoryEnv) target(context.Context, Mode) (target, error) {
	return &memoryTarget{e: e, queue: targetName("q")}, nil
}

func (e *memoryEnv) close() {}

type memoryTarget struct {
	e     *memoryEnv
	queue string
}

func (t *memoryTarget) publish(ctx context.Context, msgs []*consumer.Message) error {
	return t.e.b.Publish(ctx, t.queue, msgs...)
}

func (t *memoryTarget) source(_ context.Context, m Mode) (consumer.Source, error) {
	return t.e.b.Subscribe(t.queue, memory.SubscribeOptions{Prefetch: prefetch(t.e.cfg, m)})
}

func (t *memoryTarget) consume(ctx context.Context, m Mode, workers int, handle rawHandler) error {
	sub, err := t.e.b.Subscribe(t.queue, memory.SubscribeOptions{Prefetch: prefetch(t.e.cfg, m)})
	if err != nil {
		return err
	}
	defer sub.Close()
	var wg sync.WaitGroup
	for range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				d, err := sub.Receive(ctx)
				if err != nil {
					return
				}
				msg := d.Message()
				if err := handle(ctx, msg.ID, msg.Body, msg.Header(HeaderPublishedAt)); err != nil {
					_ = d.Nack(context.Background(), true)
					continue
				}
				_ = d.Ack(ctx)
			}
		}()
	}
	wg.Wait()
	return nil
}

func (t *memoryTarget) ready(context.Context, int) error { return nil }

func (t *memoryTarget) cleanup() {}

// --- RabbitMQ ---

type rabbitEnv struct {
	cfg  Config
	pub  *rabbitmq.Publisher
	conn *amqp.Connection
}

func newRabbitEnv(ctx context.Context, cfg Config) (*rabbitEnv, error) {
	conn, err := dialRabbit(cfg.AMQPURL, "idemq-bench")
	if err != nil {
		return nil, err
	}
	pub, err := rabbitmq.NewPublisher(ctx, rabbitmq.PublisherConfig{URL: cfg.AMQPURL, Channels: DefaultPublishers, ConnectionName: "idemq-bench-publisher"})
	if err != nil {
		_ = conn.Close()
		return nil, redact.Error(err, cfg.AMQPURL) // already says "rabbitmq: dial <URL>"
	}
	return &rabbitEnv{cfg: cfg, pub: pub, conn: conn}, nil
}

// dialRabbit opens a raw amqp091 connection. Its error names the URL
// without its password: amqp091's own errors may quote the whole URL.
func dialRabbit(url, name string) (*amqp.Connection, error) {
	conn, err := amqp.DialConfig(url, amqp.Config{Dial: amqp.DefaultDial(10 * time.Second), Properties: amqp.Table{"connection_name": name}})
	if err != nil {
		return nil, redact.Error(fmt.Errorf("connect to RabbitMQ at %s (set --amqp-url or AMQP_URL): %w", redact.URL(url), err), url)
	}
	return conn, nil
}

func (e *rabbitEnv) target(ctx context.Context, m Mode) (target, error) {
	ch, err := e.conn.Channel()
	if err != nil {
		return nil, fmt.Errorf("open channel: %w", err)
	}
	defer ch.Close()
	q := targetName(m)
	// The work queue and its dead-letter queue, as a user declares them.
	if err := rabbitmq.DeclareTopology(ctx, e.cfg.AMQPURL, rabbitmq.Topology{Queue: q}); err != nil {
		return nil, fmt.Errorf("declare queue %s: %w", q, err)
	}
	return &rabbitTarget{e: e, queue: q}, nil
}

func (e *rabbitEnv) close() {
	if e == nil {
		return
	}
	_ = e.pub.Close()
	_ = e.conn.Close()
}

type rabbitTarget struct {
	e     *rabbitEnv
	queue string
}

func (t *rabbitTarget) publish(ctx context.Context, msgs []*consumer.Message) error {
	return t.e.pub.Publish(ctx, "", t.queue, msgs...)
}

// source is the runtime's Source. Its prefetch is the Source's default,
// which the runtime sizes from its Concurrency and BatchSize: the bench
// measures what a user gets without tuning it.
func (t *rabbitTarget) source(ctx context.Context, m Mode) (consumer.Source, error) {
	return rabbitmq.NewSource(ctx, rabbitmq.Config{
		URL:            t.e.cfg.AMQPURL,
		Queue:          t.queue,
		ConnectionName: "idemq-bench-" + string(m),
	})
}

// consume is the plain amqp091 consumer: one channel with basic.qos, manual
// acks one at a time.
func (t *rabbitTarget) consume(ctx context.Context, m Mode, workers int, handle rawHandler) error {
	conn, err := dialRabbit(t.e.cfg.AMQPURL, "idemq-bench-"+string(m))
	if err != nil {
		return err
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		return err
	}
	if err := ch.Qos(prefetch(t.e.cfg, m), 0, false); err != nil {
		return err
	}
	deliveries, err := ch.Consume(t.queue, "", false, false, false, false, nil)
	if err != nil {
		return err
	}
	var wg sync.WaitGroup
	for range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				var d amqp.Delivery
				var ok bool
				select {
				case <-ctx.Done():
					return
				case d, ok = <-deliveries:
					if !ok {
						return
					}
				}
				at, _ := d.Headers[HeaderPublishedAt].(string)
				if err := handle(ctx, d.MessageId, d.Body, at); err != nil {
					_ = d.Nack(false, true)
					continue
				}
				_ = d.Ack(false)
			}
		}()
	}
	wg.Wait()
	_ = ch.Close()
	return nil
}

func (t *rabbitTarget) ready(context.Context, int) error { return nil }

func (t *rabbitTarget) cleanup() {
	ch, err := t.e.conn.Channel()
	if err != nil {
		return
	}
	defer ch.Close()
	_, _ = ch.QueueDelete(t.queue, false, false, false)
	_, _ = ch.QueueDelete(rabbitmq.DLQName(t.queue), false, false, false)
	_ = ch.ExchangeDelete(t.queue+".dlx", false, false)
}

// --- Kafka ---

type kafkaEnv struct {
	cfg     Config
	brokers []string
	cluster *kfake.Cluster
}

func newKafkaEnv(ctx context.Context, cfg Config) (*kafkaEnv, error) {
	e := &kafkaEnv{cfg: cfg, brokers: cfg.KafkaBrokers}
	if len(e.brokers) == 0 {
		listen := func(network, _ string) (net.Listener, error) { return net.Listen(network, "127.0.0.1:0") }
		c, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.ListenFn(listen),
			kfake.GroupMinSessionTimeout(kafkatest.MinSessionTimeout))
		if err != nil {
			return nil, fmt.Errorf("start kfake: %w", err)
		}
		e.cluster, e.brokers = c, c.ListenAddrs()
		return e, nil
	}
	if err := probeKafka(ctx, e.brokers); err != nil {
		return nil, err
	}
	return e, nil
}

// kafkaProbeTimeout bounds the metadata request that checks the brokers
// answer before any mode runs.
const kafkaProbeTimeout = 10 * time.Second

// probeKafka asks the brokers for their metadata, so that brokers that
// cannot be reached fail the run at once, saying so, rather than every mode.
func probeKafka(ctx context.Context, brokers []string) error {
	ctx, cancel := context.WithTimeout(ctx, kafkaProbeTimeout)
	defer cancel()
	transport := &kafkago.Transport{DialTimeout: kafkaProbeTimeout}
	defer transport.CloseIdleConnections()
	client := &kafkago.Client{Addr: kafkago.TCP(brokers...), Transport: transport}
	if _, err := client.Metadata(ctx, &kafkago.MetadataRequest{}); err != nil {
		return fmt.Errorf("could not connect to the Kafka brokers %s (set --kafka-brokers): %w", strings.Join(brokers, ","), err)
	}
	return nil
}

func (e *kafkaEnv) target(ctx context.Context, m Mode) (target, error) {
	name := targetName(m)
	if err := kafkatest.CreateTopic(ctx, e.brokers[0], name, e.cfg.KafkaPartitions); err != nil {
		return nil, err
	}
	// A publisher per topic: a shared one would keep metadata cached
	// from before the topic existed.
	pub, err := kafka.NewPublisher(kafka.PublisherConfig{Brokers: e.brokers})
	if err != nil {
		return nil, err
	}
	return &kafkaTarget{e: e, topic: name, group: name, pub: pub}, nil
}

func (e *kafkaEnv) close() {
	if e.cluster != nil {
		e.cluster.Close()
	}
}

type kafkaTarget struct {
	e            *kafkaEnv
	topic, group string
	pub          *kafka.Publisher
}

// publish writes msgs. The Publisher never writes Message.Key: a keyed
// message's key becomes its record key, which the consumer of a sharded run
// orders and routes by. The workload builds msgs for this call alone.
func (t *kafkaTarget) publish(ctx context.Context, msgs []*consumer.Message) error {
	for _, m := range msgs {
		if m.Key != "" {
			m.RecordKey = []byte(m.Key)
		}
	}
	return t.pub.Publish(ctx, t.topic, msgs...)
}

// Group timings shared by the idemq Source and the raw readers: quick to
// join, and valid on a real broker (whose minimum session timeout is 6s).
const (
	kafkaSession   = 6 * time.Second
	kafkaHeartbeat = 300 * time.Millisecond
	kafkaRebalance = 10 * time.Second
)

func (t *kafkaTarget) source(_ context.Context, _ Mode) (consumer.Source, error) {
	return kafka.NewSource(kafka.Config{
		Brokers:           t.e.brokers,
		Topic:             t.topic,
		GroupID:           t.group,
		SessionTimeout:    kafkaSession,
		HeartbeatInterval: kafkaHeartbeat,
		RebalanceTimeout:  kafkaRebalance,
		JoinGroupBackoff:  100 * time.Millisecond,
		FetchMaxWait:      100 * time.Millisecond,
	})
}

// consume is the plain kafka-go recipe: workers Readers in one group, each
// FetchMessage, handle, CommitMessages in turn. Naive commits synchronously
// after each message; broker-only lets the Reader commit every 100ms, since
// a synchronous commit per message measures the commit path (and floods
// kfake, which serves requests one at a time) rather than the broker's
// delivery rate.
func (t *kafkaTarget) consume(ctx context.Context, m Mode, workers int, handle rawHandler) error {
	var commitInterval time.Duration
	if m == ModeBrokerOnly {
		commitInterval = 100 * time.Millisecond
	}
	var wg sync.WaitGroup
	for range workers {
		r := kafkago.NewReader(kafkago.ReaderConfig{
			Brokers:           t.e.brokers,
			GroupID:           t.group,
			Topic:             t.topic,
			MinBytes:          1,
			MaxBytes:          10 << 20,
			MaxWait:           100 * time.Millisecond,
			ReadLagInterval:   -1,
			HeartbeatInterval: kafkaHeartbeat,
			SessionTimeout:    kafkaSession,
			RebalanceTimeout:  kafkaRebalance,
			JoinGroupBackoff:  100 * time.Millisecond,
			StartOffset:       kafkago.FirstOffset,
			CommitInterval:    commitInterval,
		})
		wg.Add(1)
		go func() {
			defer wg.Done()
			defer r.Close()
			for {
				m, err := r.FetchMessage(ctx)
				if err != nil {
					if ctx.Err() != nil || errors.Is(err, io.EOF) {
						return
					}
					continue
				}
				var id, at string
				for _, h := range m.Headers {
					switch h.Key {
					case "idempotency-key": // the id header the kafka Publisher writes
						id = string(h.Value)
					case HeaderPublishedAt:
						at = string(h.Value)
					}
				}
				if err := handle(ctx, id, m.Value, at); err != nil {
					return
				}
				// A commit that fails (a rebalance took the
				// partition) leaves the record to its next
				// owner, whose claim finds it applied.
				_ = r.CommitMessages(ctx, m)
			}
		}()
	}
	wg.Wait()
	return nil
}

func (t *kafkaTarget) ready(ctx context.Context, members int) error {
	ctx, cancel := context.WithTimeout(ctx, 60*time.Second)
	defer cancel()
	transport := &kafkago.Transport{}
	defer transport.CloseIdleConnections()
	client := &kafkago.Client{Addr: kafkago.TCP(t.e.brokers...), Transport: transport}
	state := "unknown"
	for {
		resp, err := client.DescribeGroups(ctx, &kafkago.DescribeGroupsRequest{GroupIDs: []string{t.group}})
		if err == nil && len(resp.Groups) == 1 && resp.Groups[0].Error == nil {
			g := resp.Groups[0]
			state = fmt.Sprintf("%s with %d members", g.GroupState, len(g.Members))
			if g.GroupState == "Stable" && len(g.Members) == members {
				return nil
			}
		}
		if ctx.Err() != nil {
			return fmt.Errorf("group %s not stable with %d members (last seen: %s): %w", t.group, members, state, ctx.Err())
		}
		sleepCtx(ctx, 50*time.Millisecond)
	}
}

func (t *kafkaTarget) cleanup() {
	_ = t.pub.Close()
	if t.e.cluster != nil {
		return // the cluster goes away with the run
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	transport := &kafkago.Transport{}
	defer transport.CloseIdleConnections()
	client := &kafkago.Client{Addr: kafkago.TCP(t.e.brokers...), Transport: transport}
	_, _ = client.DeleteTopics(ctx, &kafkago.DeleteTopicsRequest{Topics: []string{t.topic}})
}
