package redisstream_test

import (
	"bytes"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/idemq/idemq/brokers/redisstream"
	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/dlq"
)

// TestDeadLetterOfALargeEntry: Redis bounds each field of an entry (512 MB
// by default), not the entry, and the envelope adds fields of its own: the
// dead letter of an entry with an 8 MiB body and a 1 MiB header is whole,
// never truncated.
func TestDeadLetterOfALargeEntry(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t, 30*time.Second)
	stream := newStream(t, testURL())
	src := newSource(t, redisstream.Config{Stream: stream, Group: "g"})
	body := bytes.Repeat([]byte("b"), 8<<20)
	m := &consumer.Message{ID: "big-1", Body: body, Headers: map[string]string{"trace": strings.Repeat("t", 1<<20)}, Partition: -1, Offset: -1}
	if err := src.DeadLetterer().DeadLetter(ctx, m, consumer.Failure{Consumer: "c", MessageID: "big-1", Class: consumer.ClassPermanent,
		Attempts: 1, Err: errors.New("cannot parse"), FirstFailure: time.Now(), LastFailure: time.Now()}); err != nil {
		t.Fatalf("DeadLetter: %v", err)
	}
	b, err := redisstream.NewBrowser(ctx, redisstream.BrowserConfig{URL: testURL(), Stream: redisstream.DLQName(stream)})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = b.Close() })
	d, err := b.Next(ctx)
	if err != nil {
		t.Fatal(err)
	}
	got := d.Message()
	r, err := dlq.Parse(got)
	if err != nil {
		t.Fatal(err)
	}
	if r.Truncated != "" || !bytes.Equal(got.Body, body) || len(got.Headers["trace"]) != 1<<20 {
		t.Fatalf("dead letter truncated %q, body %d bytes, trace %d bytes: want it whole", r.Truncated, len(got.Body), len(got.Headers["trace"]))
	}
}
