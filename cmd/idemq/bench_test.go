package main

import (
	"encoding/json"
	"strings"
	"testing"

	"github.com/idemq/idemq/internal/bench"
	"github.com/idemq/idemq/internal/testdb"
)

func TestBenchJSON(t *testing.T) {
	r := idemq(t, "bench", "--messages", "300", "--batch-size", "20", "--json", "--database-url", testdb.URL())
	if r.code != 0 {
		t.Fatalf("exit %d\nstdout: %s\nstderr: %s", r.code, r.stdout, r.stderr)
	}
	lines := strings.Split(strings.TrimSpace(r.stdout), "\n")
	if len(lines) != len(bench.AllModes) {
		t.Fatalf("%d lines of JSON, want one per mode:\n%s", len(lines), r.stdout)
	}
	for i, line := range lines {
		var res bench.Result
		if err := json.Unmarshal([]byte(line), &res); err != nil {
			t.Fatalf("line %d: %v: %s", i, err, line)
		}
		if res.Mode != bench.AllModes[i] || !res.Verified || res.Broker != "memory" || res.Messages != 300 || res.MsgsPerSec <= 0 {
			t.Errorf("line %d: %s", i, line)
		}
		if res.Mode != bench.ModeBrokerOnly && res.Effects != int64(res.Unique) {
			t.Errorf("line %d: effects %d, unique %d", i, res.Effects, res.Unique)
		}
	}
}

func TestBenchTable(t *testing.T) {
	r := idemq(t, "bench", "--broker", "rabbitmq", "--modes", "naive,idemq-batch", "--messages", "200",
		"--batch-size", "20", "--dup-rate", "0.1", "--database-url", testdb.URL())
	want(t, r, 0, "idemq-batch", "")
	for _, s := range []string{"broker rabbitmq, 200 messages", "dup-rate 0.1", "msgs/s", "×naive", "naive", "yes"} {
		if !strings.Contains(r.stdout, s) {
			t.Errorf("table lacks %q:\n%s", s, r.stdout)
		}
	}
	if strings.Contains(r.stdout, "NO") {
		t.Errorf("a mode failed:\n%s", r.stdout)
	}
}

func TestBenchCompareTable(t *testing.T) {
	r := idemq(t, "bench", "--modes", "idemq", "--messages", "200", "--prefill", "500", "--purge-during", "--compare",
		"--cpuprofile", t.TempDir()+"/cpu.prof", "--database-url", testdb.URL())
	want(t, r, 0, "×prev phase", "")
	for _, s := range []string{"base", "prefill", "purge", "idemq@purge: purged"} {
		if !strings.Contains(r.stdout, s) {
			t.Errorf("table lacks %q:\n%s", s, r.stdout)
		}
	}
}

func TestBenchUsage(t *testing.T) {
	for _, args := range [][]string{
		{"bench", "--broker", "nats"},
		{"bench", "--modes", "naive,warp"},
		{"bench", "--messages", "0"},
		{"bench", "--dup-rate", "1.5"},
		{"bench", "--batch-size", "1"},
		{"bench", "--compare"},
		{"bench", "extra"},
	} {
		want(t, idemq(t, args...), exitUsage, "", "Run 'idemq bench --help'")
	}
	want(t, idemq(t, "bench", "--help"), 0, "--dup-rate", "")
}

func TestBenchBadDatabase(t *testing.T) {
	r := idemq(t, "bench", "--messages", "10", "--database-url", "postgres://nobody@127.0.0.1:1/none?connect_timeout=2")
	want(t, r, exitFail, "", "Postgres")
}
