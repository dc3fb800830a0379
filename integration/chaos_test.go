//go:build integration

package integration

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/idemq/idemq/internal/chaos"
)

// TestChaosShort runs the chaos harness's short suite (the same as
// `idemq chaos --short`): consumer processes under SIGKILLs, Postgres and
// RabbitMQ restarts, connection resets and Kafka rebalances, then the
// exactly-once check. It starts its own Postgres cluster and RabbitMQ node
// from the local installation (see chaos.DefaultPGBin and
// chaos.DefaultRabbitMQServer), not containers, because it must crash and
// restart them. The consumer processes are the idemq command, built here.
func TestChaosShort(t *testing.T) {
	bin := filepath.Join(t.TempDir(), "idemq")
	build := exec.Command("go", "build", "-o", bin, "github.com/idemq/idemq/cmd/idemq")
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("build idemq: %v\n%s", err, out)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	var events strings.Builder
	results, err := chaos.Run(ctx, chaos.Config{
		Scenarios:     chaos.ShortSuite(),
		WorkerCommand: []string{bin, "chaos", "worker"},
		Dir:           t.TempDir(),
		Events:        &events, // written under the harness's lock
	})
	var summary strings.Builder
	chaos.WriteSummary(&summary, results)
	t.Log("\n" + summary.String())
	if err != nil {
		t.Fatalf("chaos run: %v\n%s", err, events.String())
	}
	for _, r := range results {
		if !r.Passed() {
			t.Errorf("scenario %s failed: %v\n%s", r.Scenario, r.Failures, events.String())
		}
	}
	if os.Getenv("IDEMQ_CHAOS_VERBOSE") != "" {
		t.Log(events.String())
	}
}
