package franz_test

import (
	"context"
	"errors"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/idemq/idemq/brokers/franz"
	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/internal/kafkatest"
	"github.com/idemq/idemq/internal/testlog"
)

// logLines returns the lines of b holding every one of parts.
func logLines(b *testlog.Buffer, parts ...string) []string {
	var out []string
	for _, line := range strings.Split(b.String(), "\n") {
		ok := line != ""
		for _, p := range parts {
			ok = ok && strings.Contains(line, p)
		}
		if ok {
			out = append(out, line)
		}
	}
	return out
}

// TestConfigureLogger: the Source and its client log to the runtime's
// logger given by Configure, with the topic and group.
func TestConfigureLogger(t *testing.T) {
	e := newEnv(t, 1)
	group := kafkatest.Name(t, "g")
	rtLog, rtBuf := testlog.New(slog.LevelDebug)
	src := e.source(t, func(c *franz.Config) { c.Group = group })
	src.Configure(consumer.SourceSettings{Window: 4, Logger: rtLog})
	waitFor(t, 20*time.Second, "an assignment", func() bool { ps, _ := src.Assigned(); return len(ps) == 1 })
	if err := src.Close(); err != nil { // logs "partitions revoked"
		t.Fatal(err)
	}
	if got := logLines(rtBuf, `msg="franz: partitions revoked"`, "topic="+e.topic, "group="+group); len(got) == 0 {
		t.Errorf("no partitions-revoked line with the topic and group in the logger used:\n%s", rtBuf.String())
	}
	if got := logLines(rtBuf, `msg="franz-go: `); len(got) == 0 {
		t.Errorf("no franz-go line in the logger used:\n%s", rtBuf.String())
	}
}

// TestConfigureMaxInFlight: the runtime's window raises the default
// MaxInFlight, of a Source already polling too, and an explicit
// MaxInFlight is kept; Configure returns the bound in force.
func TestConfigureMaxInFlight(t *testing.T) {
	ctx := testCtx(t, 60*time.Second)
	e := newEnv(t, 1)
	const n = franz.DefaultMaxInFlight + 76
	e.publish(t, "m", n, 1)
	// blocked asserts that no further record is handed out while the
	// held ones are unacked.
	blocked := func(t *testing.T, src *franz.Source, held int) {
		t.Helper()
		rctx, cancel := context.WithTimeout(ctx, 700*time.Millisecond)
		defer cancel()
		if d, err := src.Receive(rctx); !errors.Is(err, context.DeadlineExceeded) {
			t.Fatalf("receive with %d unacked records held: %v, %v; want it to block", held, d, err)
		}
	}

	t.Run("default raised", func(t *testing.T) {
		src := e.source(t, func(c *franz.Config) { c.Group = kafkatest.Name(t, "g") })
		if w := src.Configure(consumer.SourceSettings{Window: 4}); w != franz.DefaultMaxInFlight {
			t.Errorf("Configure with a small window = %d, want the default %d", w, franz.DefaultMaxInFlight)
		}
		for range franz.DefaultMaxInFlight {
			receiveOne(ctx, t, src)
		}
		blocked(t, src, franz.DefaultMaxInFlight)
		if w := src.Configure(consumer.SourceSettings{Window: n}); w != n {
			t.Errorf("Configure with window %d = %d", n, w)
		}
		for range n - franz.DefaultMaxInFlight {
			receiveOne(ctx, t, src)
		}
	})
	t.Run("explicit kept", func(t *testing.T) {
		src := e.source(t, func(c *franz.Config) { c.Group = kafkatest.Name(t, "g"); c.MaxInFlight = 3 })
		if w := src.Configure(consumer.SourceSettings{Window: n}); w != 3 {
			t.Errorf("Configure with window %d and MaxInFlight 3 = %d, want 3", n, w)
		}
		first := receiveOne(ctx, t, src)
		receiveOne(ctx, t, src)
		receiveOne(ctx, t, src)
		blocked(t, src, 3)
		if err := first.Ack(ctx); err != nil {
			t.Fatal(err)
		}
		receiveOne(ctx, t, src)
	})
}
