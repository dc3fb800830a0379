package franz_test

import (
	"context"
	"log/slog"
	"os"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/idemq/idemq/brokers/franz"
	"github.com/idemq/idemq/brokers/kafka"
	"github.com/idemq/idemq/internal/kafkatest"
	"github.com/idemq/idemq/internal/testdb"
	"github.com/twmb/franz-go/pkg/kfake"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m, testdb.LeakOptions()...)
}

// env is one test's cluster, topic, group and publisher.
type env struct {
	c     *kafkatest.Cluster
	topic string
	group string
	pub   *kafka.Publisher
}

func newEnv(t *testing.T, partitions int, opts ...kfake.Opt) *env {
	t.Helper()
	c := kafkatest.Start(t, opts...)
	e := &env{c: c, topic: kafkatest.Name(t, "t"), group: kafkatest.Name(t, "g")}
	c.CreateTopic(t, e.topic, partitions)
	pub, err := kafka.NewPublisher(kafka.PublisherConfig{Brokers: c.Addrs()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = pub.Close() })
	e.pub = pub
	return e
}

// config is a Source config tuned for fast tests.
func (e *env) config() franz.Config {
	return franz.Config{
		Brokers:           e.c.Addrs(),
		Topic:             e.topic,
		Group:             e.group,
		CommitInterval:    50 * time.Millisecond,
		SessionTimeout:    3 * time.Second,
		HeartbeatInterval: 100 * time.Millisecond,
		RebalanceTimeout:  5 * time.Second,
		DrainTimeout:      time.Second,
		FetchMaxWait:      100 * time.Millisecond,
	}
}

// testLogger logs to stderr when IDEMQ_TEST_LOG is set, else discards.
func testLogger() *slog.Logger {
	if os.Getenv("IDEMQ_TEST_LOG") == "" {
		return nil
	}
	return slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelDebug}))
}

func (e *env) source(t *testing.T, mod ...func(*franz.Config)) *franz.Source {
	t.Helper()
	cfg := e.config()
	for _, f := range mod {
		f(&cfg)
	}
	s, err := franz.NewSource(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = s.Close() })
	return s
}

func testCtx(t *testing.T, d time.Duration) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	t.Cleanup(cancel)
	return ctx
}

// waitFor polls cond until it holds or the deadline passes.
func waitFor(t testing.TB, d time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(d)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %s waiting for %s", d, what)
		}
		time.Sleep(10 * time.Millisecond) // polling interval
	}
}
