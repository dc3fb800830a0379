package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"slices"
	"strings"
	"time"

	"github.com/idemq/idemq/cmd/idemq/internal/chaos"
)

var chaosCommand = &command{
	name:    "chaos",
	summary: "run the chaos suite: consumer processes under faults, then an exactly-once check",
	help: `Runs consumer processes (this binary, as hidden "chaos worker" subprocesses)
against RabbitMQ, Kafka (an in-process kfake cluster), NATS JetStream and
Redis Streams (private servers the harness starts) while a nemesis
injects faults: SIGKILLs at random moments and right after COMMIT before the
ack, Postgres connections reset at COMMIT, added database latency, AMQP
connections dropped after commit, Postgres restarted with pg_ctl -m immediate,
RabbitMQ, nats-server and redis-server restarted (SIGKILL), Kafka members
joining and leaving, OffsetCommit errors and
handlers slower than consumer_timeout. One long-run scenario publishes to Kafka
transactionally, aborting a quarter of the transactions, and consumes
read_committed through brokers/franz: no record of an aborted transaction may
be applied.

The chain scenarios (chain, long-chain) run the whole chain of
examples/chain as five processes: a payments API with idempotency keys
writing each charge and an outbox row in one transaction, a relay publishing
to RabbitMQ, a ledger consumer writing an entry and an outbox row with a
derived key, a relay publishing to NATS JetStream, and a notify consumer.
A load client retries as a real one would (timeouts, re-sends, a changed
body that must get 422). Each service is SIGKILLed at random and at its own
crash point (the API after its commit and before its response, each relay
after the broker's confirm and before marking the rows sent, each consumer
after COMMIT and before the ack); Postgres is restarted and every Postgres,
AMQP and NATS connection cut in turn. The check is per key: a 201 without
its charge, ledger entry and notification is lost, any of them twice is a
duplicate, and an outbox row never sent is orphaned.

Then it compares the published-and-confirmed ids, the processed_messages ids
and the business effects, and reports lost messages, duplicate effects,
unexpected effects, redeliveries per kill against the prefetch bound, and
goroutines leaked by the workers. A scenario passes with 0 lost, 0 duplicate
and 0 unexpected.

By default the harness starts its own Postgres cluster (initdb into a
temporary directory, from --pg-bin, as user postgres when run as root) and
its own RabbitMQ node (a private node name and ports), all on 127.0.0.1, and
removes them at the end; for NATS and Redis scenarios it always starts its
own nats-server (--nats-server) and redis-server (--redis-server, appendonly
yes, appendfsync always). --short is the CI run (4 scenarios, 79 SIGKILLs,
about 3 minutes on the project's 2-core CI machine); without it the long run
(15 scenarios, 565 SIGKILLs, about 37 minutes there). RELIABILITY.md has
the last results.

The cluster scenarios start their own nodes and remove them, and also fail
if no message was applied (overall or in any one worker) for longer than
their bound while messages waited: long-rabbit-cluster a private 3-node
RabbitMQ cluster with a quorum queue (the node a worker consumes on and the
queue leader's SIGKILLed and restarted in turn, then one lost for good;
bound 10s), long-nats-cluster a private 3-server NATS cluster with R3
streams (a worker's server and the durable consumer leader's SIGKILLed, one
server cut off by a network partition in a namespace of its own; bound
30s), and long-pg-failover a private Postgres primary with a synchronous
standby (the primary crashed, the standby promoted; bound 15s). --cluster
adds their short forms, rabbit-cluster, nats-cluster and pg-failover, to
--short: about three minutes more. The partition needs root, iproute2 and
iptables.

--only runs the suite's scenarios by name (the "long-" prefix may be left
out: --only nats-kills), and --messages, --kills, --self-kills and
--publish-over scale the scenarios picked down (or up) for a quick run.

Exit status 0 if every scenario passed, 1 otherwise.`,
	run: runChaos,
}

func runChaos(ctx context.Context, e *env, c *command, args []string) error {
	if len(args) > 0 && args[0] == "worker" {
		// The hidden consumer process started by the harness.
		if code := chaos.WorkerMain(); code != 0 {
			return fmt.Errorf("worker exited with status %d", code)
		}
		return nil
	}
	var (
		short      bool
		cluster    bool
		only       string
		seed       uint64
		asJSON     bool
		keep       bool
		markdown   string
		dbURL      string
		amqpURL    string
		pgBin      string
		rabbitBin  string
		consumerTO time.Duration
		list       bool
		natsBin    string
		redisBin   string
		over       struct {
			messages, kills, selfKills int
			publishOver                time.Duration
		}
	)
	fs := c.flagSet()
	fs.BoolVar(&short, "short", false, "run the short CI suite instead of the long run")
	fs.BoolVar(&cluster, "cluster", false, "with --short, add the cluster scenarios rabbit-cluster, nats-cluster and pg-failover (about three minutes more; nats-cluster needs root)")
	fs.StringVar(&only, "only", "", "comma-separated names of the suite's scenarios to run, \"long-\" optional (default all of the suite)")
	fs.BoolVar(&list, "list", false, "list the suite's scenarios and exit")
	fs.Uint64Var(&seed, "seed", 0, "seed of the fault schedule and workload (default random)")
	fs.BoolVar(&asJSON, "json", false, "print the results as JSON on stdout")
	fs.BoolVar(&keep, "keep", false, "keep the delivery logs and worker output (always kept for failed scenarios)")
	fs.StringVar(&markdown, "markdown", "", "also write the results as a Markdown table to this file")
	fs.StringVar(&dbURL, "database-url", "", "use this Postgres instead of a private cluster (Postgres restarts are then impossible)")
	fs.StringVar(&amqpURL, "amqp-url", "", "use this RabbitMQ instead of a private node (RabbitMQ restarts are then impossible)")
	fs.StringVar(&pgBin, "pg-bin", chaos.DefaultPGBin, "directory of initdb and pg_ctl")
	fs.StringVar(&rabbitBin, "rabbitmq-server", chaos.DefaultRabbitMQServer, "rabbitmq-server script for the private node")
	fs.DurationVar(&consumerTO, "consumer-timeout", 5*time.Second, "consumer_timeout of the private RabbitMQ node")
	fs.StringVar(&natsBin, "nats-server", chaos.DefaultNATSServer, "nats-server binary for the private NATS server")
	fs.StringVar(&redisBin, "redis-server", chaos.DefaultRedisServer, "redis-server binary for the private Redis server")
	fs.IntVar(&over.messages, "messages", 0, "override the picked scenarios' distinct ids")
	fs.IntVar(&over.kills, "kills", -1, "override the picked scenarios' random SIGKILLs")
	fs.IntVar(&over.selfKills, "self-kills", -1, "override the picked scenarios' SIGKILLs right after COMMIT")
	fs.DurationVar(&over.publishOver, "publish-over", 0, "override the picked scenarios' publishing window")
	if _, err := c.parse(e, fs, args, 0); err != nil {
		return err
	}
	suite := chaos.LongSuite()
	if short {
		suite = chaos.ShortSuite()
		if cluster {
			suite = append(suite, chaos.ShortClusterSuite()...)
		}
	} else if cluster {
		return usagef("--cluster adds to --short; the long run has its cluster scenario already")
	}
	if list {
		for _, s := range suite {
			fmt.Fprintf(e.stdout, "%-24s %-8s %s\n", s.Name, s.Broker, s.Faults())
		}
		return nil
	}
	for i := range suite {
		s := &suite[i]
		if over.messages > 0 {
			s.Messages = over.messages
		}
		if over.kills >= 0 {
			s.Kills = over.kills
		}
		if over.selfKills >= 0 {
			s.SelfKills = over.selfKills
		}
		if over.publishOver > 0 {
			s.PublishOver = over.publishOver
		}
	}
	if only != "" {
		var picked []chaos.Scenario
		for _, name := range strings.Split(only, ",") {
			i := slices.IndexFunc(suite, func(s chaos.Scenario) bool { return s.Name == name || s.Name == "long-"+name })
			if i < 0 {
				return usagef("--only %q: no such scenario in the suite (see --list, or --list --short)", name)
			}
			picked = append(picked, suite[i])
		}
		suite = picked
	}
	self, err := os.Executable()
	if err != nil {
		return fmt.Errorf("find own executable: %w", err)
	}
	cfg := chaos.Config{
		Scenarios:       suite,
		WorkerCommand:   []string{self, "chaos", "worker"},
		DatabaseURL:     dbURL,
		AMQPURL:         amqpURL,
		PGBin:           pgBin,
		RabbitMQServer:  rabbitBin,
		NATSServer:      natsBin,
		RedisServer:     redisBin,
		ConsumerTimeout: consumerTO,
		Seed:            seed,
		KeepDir:         keep,
		Events:          &lineWriter{e: e},
	}
	tty := isTerminal(e.stderr)
	var lastLine time.Time
	cfg.Progress = func(p chaos.Progress) {
		line := fmt.Sprintf("[%d/%d] %-24s %-9s confirmed %d/%d  processed %d  kills %d  faults %d  %s",
			p.Index, p.Of, p.Scenario, p.Phase, p.Published, p.Messages, p.Processed, p.Kills, p.Faults, p.Elapsed.Round(time.Second))
		switch {
		case tty:
			fmt.Fprintf(e.stderr, "\r\033[K%s", line)
		case time.Since(lastLine) >= 10*time.Second:
			lastLine = time.Now()
			fmt.Fprintln(e.stderr, line)
		}
	}
	if tty {
		cfg.Events.(*lineWriter).clear = true
	}
	fmt.Fprintf(e.stderr, "idemq chaos: %d scenarios\n", len(suite))
	results, runErr := chaos.Run(ctx, cfg)
	if tty {
		fmt.Fprint(e.stderr, "\r\033[K")
	}
	if asJSON {
		enc := json.NewEncoder(e.stdout)
		enc.SetIndent("", "  ")
		if err := enc.Encode(results); err != nil {
			return err
		}
	} else {
		chaos.WriteSummary(e.stdout, results)
	}
	if markdown != "" {
		f, err := os.Create(markdown)
		if err != nil {
			return err
		}
		chaos.WriteMarkdown(f, results)
		if err := f.Close(); err != nil {
			return err
		}
	}
	if runErr != nil {
		return fmt.Errorf("chaos: %w", runErr)
	}
	failed := 0
	for _, r := range results {
		if !r.Passed() {
			failed++
		}
	}
	if failed > 0 {
		return errors.New(fmt.Sprint(failed, " of ", len(results), " scenarios failed"))
	}
	fmt.Fprintln(e.stdout, "OK: every confirmed message applied exactly once in every scenario.")
	return nil
}

// lineWriter writes the harness's event lines to stderr, clearing the
// progress line first on a terminal.
type lineWriter struct {
	e     *env
	clear bool
}

func (w *lineWriter) Write(p []byte) (int, error) {
	if w.clear {
		fmt.Fprint(w.e.stderr, "\r\033[K")
	}
	return w.e.stderr.Write(p)
}
