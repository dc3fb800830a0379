package main

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"flag"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/idemq/idemq/internal/testdb"
)

// TestChainExactlyOnce runs the chain on schemas, a queue and a stream of
// its own: every key is charged, entered and notified once, and every
// changed body is refused.
func TestChainExactlyOnce(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	t.Setenv("DATABASE_URL", testdb.URL())
	if u := os.Getenv("IDEMQ_TEST_AMQP_URL"); u != "" {
		t.Setenv("AMQP_URL", u)
	}
	var b [4]byte
	_, _ = rand.Read(b[:])
	r := hex.EncodeToString(b[:])
	prefix := "idemq_test_chain_" + r
	t.Cleanup(func() {
		pool := testdb.Pool(t)
		for _, s := range []string{"payments", "ledger", "notify"} {
			_, _ = pool.Exec(context.Background(), "DROP SCHEMA IF EXISTS "+prefix+"_"+s+" CASCADE")
		}
	})
	var out bytes.Buffer
	err := run(ctx, []string{"-keys", "120", "-schema-prefix", prefix, "-queue", "idemq-test.chain." + r,
		"-stream", "IDEMQ_TEST_CHAIN_" + r, "-subject", "idemq-test.chain." + r}, &out)
	t.Logf("\n%s", out.String())
	if err != nil {
		t.Fatal(err)
	}
	for _, w := range []string{"keys accepted (2xx)       120", "notifications             120", "changed bodies refused      6 of 6 (422)",
		"dead letters                0", "OK: every key charged once"} {
		if !strings.Contains(out.String(), w) {
			t.Errorf("output lacks %q", w)
		}
	}
}

func TestHelp(t *testing.T) {
	var out bytes.Buffer
	if err := run(context.Background(), []string{"-h"}, &out); !errors.Is(err, flag.ErrHelp) {
		t.Fatalf("-h: %v", err)
	}
	if !strings.Contains(out.String(), "-keys") {
		t.Errorf("-h printed %q", out.String())
	}
}
