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

	"github.com/nats-io/nats.go"

	"github.com/idemq/idemq/internal/natstest"
	"github.com/idemq/idemq/internal/testdb"
)

func TestMain(m *testing.M) {
	_ = natstest.EnsureAnchor(nats.DefaultURL) // see natstest
	os.Exit(m.Run())
}

// TestRunsTwiceExactlyOnce runs the example twice on its own schema and
// streams: the first run applies the five good payments, the second (on a
// fresh stream, beyond JetStream's duplicate window) skips them all, and
// both dead-letter the two bad ones and find every balance right.
func TestRunsTwiceExactlyOnce(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	schema := testdb.Schema(t)
	t.Setenv("DATABASE_URL", testdb.URL())
	var b [4]byte
	_, _ = rand.Read(b[:])
	r := hex.EncodeToString(b[:])
	args := []string{"-schema", schema, "-stream", "IDEMQ_TEST_EXAMPLE_" + r, "-subject", "idemq-test.example." + r}
	t.Cleanup(func() {
		var out bytes.Buffer
		if err := run(context.Background(), append(args, "-delete"), &out); err != nil {
			t.Errorf("-delete: %v", err)
		}
	})
	for i, want := range []string{"applied 5, skipped 0 as duplicates, dead-lettered 2", "applied 0, skipped 5 as duplicates, dead-lettered 2"} {
		var out bytes.Buffer
		if err := run(ctx, args, &out); err != nil {
			t.Fatalf("run %d: %v\n%s", i+1, err, out.String())
		}
		got := out.String()
		t.Logf("run %d:\n%s", i+1, got)
		for _, w := range []string{want, "discarded 1 republished copy", `dead letter "pay-70100": permanent`, "missing-id", "balances check out"} {
			if !strings.Contains(got, w) {
				t.Errorf("run %d: output lacks %q", i+1, w)
			}
		}
	}
}

func TestHelp(t *testing.T) {
	var out bytes.Buffer
	if err := run(context.Background(), []string{"-h"}, &out); !errors.Is(err, flag.ErrHelp) {
		t.Fatalf("-h: %v", err)
	}
	if !strings.Contains(out.String(), "Usage: go run ./examples/nats") {
		t.Errorf("-h printed %q", out.String())
	}
}

// TestErrorsRedacted: credentials in NATS_URL and DATABASE_URL never show.
func TestErrorsRedacted(t *testing.T) {
	t.Setenv("NATS_URL", "nats://user:secret@127.0.0.1:1")
	t.Setenv("DATABASE_URL", "postgres://postgres:pgsecret@127.0.0.1:1/test?sslmode=disable")
	var out bytes.Buffer
	err := run(context.Background(), nil, &out)
	if err == nil {
		t.Fatal("run succeeded against unreachable servers")
	}
	if strings.Contains(err.Error(), "secret") {
		t.Errorf("error shows a password: %v", err)
	}
	t.Log(err)

	// NATS reachable, Postgres not.
	t.Setenv("NATS_URL", "")
	out.Reset()
	err = run(context.Background(), []string{"-stream", "IDEMQ_TEST_EXAMPLE_REDACT", "-subject", "idemq-test.example.redact"}, &out)
	if err == nil {
		t.Fatal("run succeeded against an unreachable database")
	}
	if strings.Contains(err.Error(), "pgsecret") {
		t.Errorf("error shows the database password: %v", err)
	}
	t.Log(err)
}
