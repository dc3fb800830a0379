package kafkatest_test

import (
	"context"
	"net"
	"testing"
	"time"

	"github.com/idemq/idemq/internal/kafkatest"
	"github.com/segmentio/kafka-go"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

func TestStartCreateTopic(t *testing.T) {
	c := kafkatest.Start(t)
	topic := kafkatest.Name(t, "t")
	c.CreateTopic(t, topic, 3)
	conn, err := kafka.Dial("tcp", c.Addrs()[0])
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	parts, err := conn.ReadPartitions(topic)
	if err != nil {
		t.Fatal(err)
	}
	if len(parts) != 3 {
		t.Fatalf("%d partitions, want 3", len(parts))
	}
}

func TestServe(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	_ = ln.Close()

	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- kafkatest.Serve(ctx, addr, 2) }()
	defer func() {
		cancel()
		if err := <-done; err != nil {
			t.Error(err)
		}
	}()

	deadline := time.Now().Add(10 * time.Second)
	var conn *kafka.Conn
	for {
		conn, err = kafka.Dial("tcp", addr)
		if err == nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("dial %s: %v", addr, err)
		}
		time.Sleep(10 * time.Millisecond)
	}
	defer conn.Close()
	// Topics are created on first use, with the given partitions.
	for {
		parts, err := conn.ReadPartitions("auto")
		if err == nil && len(parts) == 2 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("auto-created topic: %v partitions, err %v", len(parts), err)
		}
		time.Sleep(10 * time.Millisecond)
	}
	if err := kafkatest.Serve(context.Background(), addr, 0); err == nil {
		t.Error("Serve with 0 partitions: no error")
	}
}
