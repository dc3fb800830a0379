// Package kafkatest runs franz-go's kfake, an in-process Kafka-protocol
// cluster, on 127.0.0.1 for tests, examples and a throwaway container. It is
// a real Kafka wire-protocol server reached over real TCP: clients such as
// kafka-go cannot tell it from a broker.
package kafkatest

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"net"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/segmentio/kafka-go"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kmsg"
)

// MinSessionTimeout is the smallest group session timeout the clusters made
// here accept (Kafka's default is 6s), so tests can tune consumer groups to
// rebalance quickly.
const MinSessionTimeout = 100 * time.Millisecond

// Cluster is a running kfake cluster. The embedded *kfake.Cluster gives
// access to fault injection (ControlKey, KeepControl and friends).
//
// Its consumer groups time out members the way Apache Kafka does: Sessions
// removes the members kfake keeps past their session timeout (see
// SessionEnforcer), so a consumer killed during a rebalance cannot hold its
// partitions, or the group's next rebalance, for good.
type Cluster struct {
	*kfake.Cluster
	Sessions *SessionEnforcer
}

// NewCluster starts a kfake cluster with opts and session-timeout
// enforcement. Close it with Close, which stops the enforcer first.
func NewCluster(opts ...kfake.Opt) (*Cluster, error) {
	c, err := kfake.NewCluster(opts...)
	if err != nil {
		return nil, err
	}
	return &Cluster{Cluster: c, Sessions: EnforceSessionTimeouts(c, 0, nil)}, nil
}

// Close stops the session enforcer and closes the cluster. It is
// idempotent.
func (c *Cluster) Close() {
	if c.Sessions != nil {
		c.Sessions.Close()
	}
	c.Cluster.Close()
}

// Start starts a one-broker kfake cluster on an ephemeral 127.0.0.1 port and
// closes it when the test ends. opts are appended to the defaults (one
// broker, MinSessionTimeout) and may override them.
func Start(t testing.TB, opts ...kfake.Opt) *Cluster {
	t.Helper()
	base := []kfake.Opt{
		kfake.NumBrokers(1),
		kfake.GroupMinSessionTimeout(MinSessionTimeout),
	}
	c, err := NewCluster(append(base, opts...)...)
	if err != nil {
		t.Fatalf("kafkatest: start kfake: %v", err)
	}
	t.Cleanup(c.Close)
	return c
}

// Addrs returns the brokers' host:port addresses.
func (c *Cluster) Addrs() []string { return c.ListenAddrs() }

// CreateTopic creates topic with the given number of partitions, failing
// the test on error.
func (c *Cluster) CreateTopic(t testing.TB, topic string, partitions int) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := CreateTopic(ctx, c.Addrs()[0], topic, partitions); err != nil {
		t.Fatalf("kafkatest: %v", err)
	}
}

// CreateTopicConfig creates topic as CreateTopic does, with the given
// topic configuration (max.message.bytes, say).
func (c *Cluster) CreateTopicConfig(t testing.TB, topic string, partitions int, config map[string]string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := createTopic(ctx, c.Addrs()[0], topic, partitions, config); err != nil {
		t.Fatalf("kafkatest: %v", err)
	}
}

// CreateTopic creates topic with the given number of partitions on the
// cluster reachable at addr.
func CreateTopic(ctx context.Context, addr, topic string, partitions int) error {
	return createTopic(ctx, addr, topic, partitions, nil)
}

func createTopic(ctx context.Context, addr, topic string, partitions int, config map[string]string) error {
	transport := &kafka.Transport{}
	defer transport.CloseIdleConnections()
	client := &kafka.Client{Addr: kafka.TCP(addr), Transport: transport}
	tc := kafka.TopicConfig{Topic: topic, NumPartitions: partitions, ReplicationFactor: 1}
	for k, v := range config {
		tc.ConfigEntries = append(tc.ConfigEntries, kafka.ConfigEntry{ConfigName: k, ConfigValue: v})
	}
	resp, err := client.CreateTopics(ctx, &kafka.CreateTopicsRequest{Topics: []kafka.TopicConfig{tc}})
	if err != nil {
		return fmt.Errorf("create topic %q: %w", topic, err)
	}
	if err := resp.Errors[topic]; err != nil {
		return fmt.Errorf("create topic %q: %w", topic, err)
	}
	return nil
}

var unsafeChars = regexp.MustCompile(`[^a-zA-Z0-9._-]+`)

// Name returns a name unique to this test run, made from the test's name,
// for a topic or consumer group.
func Name(t testing.TB, prefix string) string {
	var b [4]byte
	_, _ = rand.Read(b[:])
	n := unsafeChars.ReplaceAllString(strings.ToLower(t.Name()), "-")
	if len(n) > 80 {
		n = n[len(n)-80:]
	}
	return prefix + "-" + n + "-" + hex.EncodeToString(b[:])
}

// Serve runs a one-broker kfake cluster listening on addr (host:port; port 0
// picks a free one) until ctx is done. Topics are created on first use with
// the given number of partitions. The broker advertises the address it
// listens on, so clients must be able to reach that very address: to serve
// other hosts, listen on a routable address rather than 0.0.0.0.
func Serve(ctx context.Context, addr string, partitions int) error {
	if partitions < 1 {
		return fmt.Errorf("kafkatest: partitions %d, must be at least 1", partitions)
	}
	listen := func(network, _ string) (net.Listener, error) { return net.Listen(network, addr) }
	c, err := NewCluster(
		kfake.NumBrokers(1),
		kfake.ListenFn(listen),
		kfake.AllowAutoTopicCreation(),
		kfake.DefaultNumPartitions(partitions),
		kfake.GroupMinSessionTimeout(MinSessionTimeout),
	)
	if err != nil {
		return fmt.Errorf("kafkatest: start kfake on %s: %w", addr, err)
	}
	<-ctx.Done()
	c.Close()
	return nil
}

// OffsetCommitError answers req with code for every partition it commits,
// for fault injection through kfake's ControlKey(kmsg.OffsetCommit, ...).
func OffsetCommitError(req *kmsg.OffsetCommitRequest, code int16) *kmsg.OffsetCommitResponse {
	resp := req.ResponseKind().(*kmsg.OffsetCommitResponse)
	for _, t := range req.Topics {
		rt := kmsg.NewOffsetCommitResponseTopic()
		rt.Topic = t.Topic
		for _, p := range t.Partitions {
			rp := kmsg.NewOffsetCommitResponseTopicPartition()
			rp.Partition = p.Partition
			rp.ErrorCode = code
			rt.Partitions = append(rt.Partitions, rp)
		}
		resp.Topics = append(resp.Topics, rt)
	}
	return resp
}
