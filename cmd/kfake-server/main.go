// Command kfake-server serves franz-go's kfake, an in-memory Kafka-protocol
// TEST broker, on a TCP port. It is NOT Apache Kafka: it speaks the Kafka wire
// protocol well enough for idemq's integration tests (produce, fetch,
// consumer groups, offset commits), keeps everything in memory, and has none
// of Kafka's durability, replication or operational behaviour. Use it where
// no Kafka image can be pulled; use apache/kafka everywhere else.
//
// It is built into the idemq-test/kfake image by .ci/containers.sh.
//
// Usage:
//
//	kfake-server [-listen :9092] [-advertise 127.0.0.1:9092] [-partitions 3]
//
// Each flag falls back to an environment variable, so a container can be
// configured without changing its command: IDEMQ_KFAKE_LISTEN,
// IDEMQ_KFAKE_ADVERTISE and IDEMQ_KFAKE_PARTITIONS.
//
// The broker tells clients to reconnect to the address it advertises, so
// -advertise must be the host:port clients reach it at. In a container with a
// port mapping, that is the host side of the mapping (map the same port on
// both sides to keep it simple). It defaults to the listen address.
package main

import (
	"context"
	"flag"
	"fmt"
	"log"
	"net"
	"os"
	"os/signal"
	"strconv"
	"syscall"
	"time"

	"github.com/twmb/franz-go/pkg/kfake"

	"github.com/idemq/idemq/internal/kafkatest"
)

// minSessionTimeout lets tests tune consumer groups to rebalance quickly;
// Kafka's default minimum is 6s.
const minSessionTimeout = 100 * time.Millisecond

func main() {
	log.SetFlags(log.LstdFlags | log.LUTC)
	log.SetPrefix("kfake-server: ")
	if err := run(os.Args[1:]); err != nil {
		log.Fatal(err)
	}
}

func run(args []string) error {
	fs := flag.NewFlagSet("kfake-server", flag.ContinueOnError)
	listen := fs.String("listen", envOr("IDEMQ_KFAKE_LISTEN", ":9092"), "address to listen on")
	advertise := fs.String("advertise", os.Getenv("IDEMQ_KFAKE_ADVERTISE"), "host:port advertised to clients (defaults to -listen)")
	partitionsDefault, err := strconv.Atoi(envOr("IDEMQ_KFAKE_PARTITIONS", "3"))
	if err != nil {
		return fmt.Errorf("IDEMQ_KFAKE_PARTITIONS: %w", err)
	}
	partitions := fs.Int("partitions", partitionsDefault, "partitions of auto-created topics")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if *partitions < 1 {
		return fmt.Errorf("-partitions %d: must be at least 1", *partitions)
	}
	var adv net.Addr
	if *advertise != "" {
		a, err := net.ResolveTCPAddr("tcp", *advertise)
		if err != nil {
			return fmt.Errorf("-advertise %q: %w", *advertise, err)
		}
		adv = a
	}

	listenFn := func(network, _ string) (net.Listener, error) {
		ln, err := net.Listen(network, *listen)
		if err != nil {
			return nil, err
		}
		if adv == nil {
			return ln, nil
		}
		return advertisedListener{Listener: ln, addr: adv}, nil
	}
	// kafkatest's cluster times out group members the way Apache Kafka
	// does, which kfake alone does not for a member killed in a
	// rebalance (see kafkatest.SessionEnforcer).
	c, err := kafkatest.NewCluster(
		kfake.NumBrokers(1),
		kfake.ListenFn(listenFn),
		kfake.AllowAutoTopicCreation(),
		kfake.DefaultNumPartitions(*partitions),
		kfake.GroupMinSessionTimeout(minSessionTimeout),
	)
	if err != nil {
		return fmt.Errorf("start kfake on %s: %w", *listen, err)
	}
	defer c.Close()
	// The readiness line the integration tests (and humans) look for.
	log.Printf("Kafka-protocol TEST broker (franz-go kfake, not Apache Kafka) listening on %s, advertising %v", *listen, c.ListenAddrs())

	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	<-ctx.Done()
	log.Printf("shutting down: %v", context.Cause(ctx))
	return nil
}

// advertisedListener reports addr as its address, which is what kfake
// advertises in metadata responses.
type advertisedListener struct {
	net.Listener
	addr net.Addr
}

func (l advertisedListener) Addr() net.Addr { return l.addr }

func envOr(name, def string) string {
	if v := os.Getenv(name); v != "" {
		return v
	}
	return def
}
