package franz_test

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/idemq/idemq/internal/kafkatest"
)

// kcat runs librdkafka's kcat as a transactional producer of e's topic,
// writing lines (each "key:value") in one transaction with the given
// extra arguments. It commits when commit is set; otherwise it waits until
// the records are in the log (the high watermarks moved by len(lines)) and
// interrupts kcat, which aborts the transaction.
func kcat(ctx context.Context, t *testing.T, bin string, e *env, commit bool, lines []string, args ...string) {
	t.Helper()
	before := sum(txnHighWatermarks(ctx, t, e))
	argv := append([]string{"-P", "-b", e.c.Addrs()[0], "-t", e.topic, "-K:",
		"-X", "transactional.id=" + kafkatest.Name(t, "kcat"), "-X", "transaction.timeout.ms=10000"}, args...)
	cmd := exec.CommandContext(ctx, bin, argv...)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	stdin, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	// kcat reads its input 1024 bytes at a time with stdio, so a short
	// input is only read at end of file: pad it with empty lines, which
	// kcat skips, to make it read every record while stdin stays open.
	input := strings.Join(lines, "\n") + "\n"
	input += strings.Repeat("\n", 2048-len(input)%1024)
	if _, err := fmt.Fprint(stdin, input); err != nil {
		t.Fatal(err)
	}
	if commit {
		_ = stdin.Close() // end of input: kcat commits
		if err := cmd.Wait(); err != nil {
			t.Fatalf("kcat %q: %v\n%s", argv, err, stderr.Bytes())
		}
		return
	}
	deadline := time.Now().Add(20 * time.Second)
	for sum(txnHighWatermarks(ctx, t, e)) < before+int64(len(lines)) {
		if time.Now().After(deadline) {
			_ = cmd.Process.Kill()
			_ = cmd.Wait()
			t.Fatalf("kcat's records did not reach the log within 20s (high watermarks %v, from a sum of %d)\n%s", txnHighWatermarks(ctx, t, e), before, stderr.Bytes())
		}
		time.Sleep(10 * time.Millisecond) // polling interval
	}
	if err := cmd.Process.Signal(syscall.SIGINT); err != nil {
		t.Fatal(err)
	}
	_ = stdin.Close()
	_ = cmd.Wait() // interrupted: a non-zero exit is expected
}

func sum(m map[int]int64) int64 {
	var n int64
	for _, v := range m {
		n += v
	}
	return n
}

// TestEdgeKafkaTransactionalLibrdkafka: the reproduction with a
// real librdkafka transactional producer (kcat -X transactional.id=…): a
// committed transaction, an aborted one without ids, an aborted one with an
// id, that record re-sent in a committed transaction. Each Source yields
// exactly the committed records and no marker, and commits past the
// markers. It is skipped only if kcat is not installed.
func TestEdgeKafkaTransactionalLibrdkafka(t *testing.T) {
	bin, err := exec.LookPath("kcat")
	if err != nil {
		if os.Getenv("IDEMQ_REQUIRE_KCAT") != "" {
			t.Fatal("kcat is required (IDEMQ_REQUIRE_KCAT is set) but not installed")
		}
		t.Skip("kcat (librdkafka's command-line client) is not installed: apt-get install kcat to run this test")
	}
	for _, ts := range txnSources {
		t.Run(ts.name, func(t *testing.T) {
			ctx := testCtx(t, 90*time.Second)
			e := newEnv(t, 2)
			var committed, abortedNoID []string
			for i := range 5 {
				committed = append(committed, fmt.Sprintf("k%d:kc-committed-%03d", i, i))
			}
			for i := range 40 {
				abortedNoID = append(abortedNoID, fmt.Sprintf("k%d:kc-aborted-%03d", i, i))
			}
			idHeader := "idempotency-key=kc-resent"
			kcat(ctx, t, bin, e, true, committed)
			kcat(ctx, t, bin, e, false, abortedNoID)
			kcat(ctx, t, bin, e, false, []string{"r:kc-resent"}, "-H", idHeader)
			kcat(ctx, t, bin, e, true, []string{"r:kc-resent"}, "-H", idHeader)
			want := []string{"kc-resent"}
			for i := range 5 {
				want = append(want, fmt.Sprintf("kc-committed-%03d", i))
			}
			slices.Sort(want)

			src := ts.open(t, e)
			var got []string
			ids := map[string]string{}
			for range want {
				d, err := src.Receive(ctx)
				if err != nil {
					t.Fatalf("receive after %q: %v", got, err)
				}
				m := d.Message()
				if isMarker(m) {
					t.Errorf("received a transaction marker at %d@%d", m.Partition, m.Offset)
				}
				got = append(got, string(m.Body))
				ids[string(m.Body)] = m.ID
				if err := d.Ack(ctx); err != nil {
					t.Fatal(err)
				}
			}
			rctx, cancel := context.WithTimeout(ctx, 1500*time.Millisecond)
			defer cancel()
			if d, err := src.Receive(rctx); err == nil {
				t.Errorf("received %q (offset %d) after every committed record", d.Message().Body, d.Message().Offset)
			}
			slices.Sort(got)
			if !slices.Equal(got, want) {
				t.Fatalf("received %q,\nwant %q", trim(got), want)
			}
			if ids["kc-resent"] != "kc-resent" {
				t.Errorf("the re-sent record's id is %q, want its header's", ids["kc-resent"])
			}
			if id := ids["kc-committed-000"]; !strings.HasPrefix(id, e.topic+"/") {
				t.Errorf("a record without the id header has id %q, want the fallback topic/partition/offset", id)
			}
			high := txnHighWatermarks(ctx, t, e)
			waitFor(t, 10*time.Second, fmt.Sprintf("the group to commit up to the high watermarks %v", high), func() bool {
				c := txnCommitted(ctx, t, e)
				for p, hw := range high {
					if c[p] != hw {
						return false
					}
				}
				return true
			})
		})
	}
}
