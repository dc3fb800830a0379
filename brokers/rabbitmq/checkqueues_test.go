package rabbitmq_test

import (
	"bufio"
	"encoding/binary"
	"io"
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/idemq/idemq/brokers/rabbitmq"
)

// resetOnDeclare relays AMQP connections to the test broker and resets
// (TCP RST) the first one that sends a queue.declare: the connection is
// lost while NewSource checks its queues, which do exist.
func resetOnDeclare(t *testing.T) string {
	t.Helper()
	ln, target := proxyListener(t)
	var wg sync.WaitGroup
	t.Cleanup(func() { _ = ln.Close(); wg.Wait() })
	wg.Go(func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			up, err := net.Dial("tcp", target)
			if err != nil {
				_ = c.Close()
				continue
			}
			wg.Go(func() { _, _ = io.Copy(c, up); _ = c.Close() })
			wg.Go(func() {
				defer up.Close()
				r := bufio.NewReader(c)
				w := func(b []byte) bool { _, err := up.Write(b); return err == nil }
				header := make([]byte, 8) // "AMQP" 0 0 9 1
				if _, err := io.ReadFull(r, header); err != nil || !w(header) {
					return
				}
				for {
					head := make([]byte, 7) // type, channel, size
					if _, err := io.ReadFull(r, head); err != nil {
						return
					}
					rest := make([]byte, binary.BigEndian.Uint32(head[3:])+1) // payload, frame end
					if _, err := io.ReadFull(r, rest); err != nil {
						return
					}
					if head[0] == 1 && len(rest) >= 5 && binary.BigEndian.Uint16(rest) == 50 && binary.BigEndian.Uint16(rest[2:]) == 10 {
						_ = c.(*net.TCPConn).SetLinger(0)
						_ = c.Close()
						return
					}
					if !w(head) || !w(rest) {
						return
					}
				}
			})
		}
	})
	return strings.Replace(amqpURL(), target, ln.Addr().String(), 1)
}

// TestNewSourceConnectionLostDuringQueueCheck: a connection reset while
// NewSource checks that its queues exist is reported as a lost
// connection, not as a missing queue to declare.
func TestNewSourceConnectionLostDuringQueueCheck(t *testing.T) {
	q := newQueue(t)
	ctx := testCtx(t, 20*time.Second)
	_, err := rabbitmq.NewSource(ctx, rabbitmq.Config{URL: resetOnDeclare(t), Queue: q})
	if err == nil {
		t.Fatal("NewSource succeeded over a connection reset during its queue check")
	}
	msg := err.Error()
	if strings.Contains(msg, "declare it") || strings.Contains(msg, "Config.Topology") {
		t.Errorf("a lost connection is reported as a missing queue: %v", err)
	}
	if !strings.Contains(msg, "connection was lost while checking queue") {
		t.Errorf("the error does not say the connection was lost: %v", err)
	}
}

// TestNewSourceMissingQueue: a queue the broker says does not exist (404)
// is reported as missing, with how to declare it.
func TestNewSourceMissingQueue(t *testing.T) {
	ctx := testCtx(t, 20*time.Second)
	_, err := rabbitmq.NewSource(ctx, rabbitmq.Config{URL: amqpURL(), Queue: uniqueName(t)})
	if err == nil || !strings.Contains(err.Error(), "does not exist (declare it: set Config.Topology") {
		t.Fatalf("NewSource on a missing queue: %v", err)
	}
}
