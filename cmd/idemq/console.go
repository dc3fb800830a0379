package main

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"strings"

	"github.com/idemq/idemq/brokers/rabbitmq"
	"github.com/idemq/idemq/cmd/idemq/internal/console"
	"github.com/idemq/idemq/internal/redact"
	"github.com/idemq/idemq/processed"
)

var consoleCommand = &command{
	name:    "console",
	summary: "serve the web console: dedup tables, dead letters by cause, dry runs, replays, audit, lookups",
	help: `Serves a web console, embedded in this binary, on --addr (loopback by
default). Its pages:

  Overview      each consumer's dedup rows, oldest row, purge-eligible rows at
                --retention and last applied message; each --dlq-queue's,
                --dlq-topic's, --dlq-subject's and --dlq-stream-key's depth
                and oldest dead letter; the outbox backlog and the HTTP
                idempotency key table, if they exist; with --reconciliation,
                the last 'idemq reconcile --out' report: when, its window,
                its counts by kind and a few samples; charts of the last hour
                and the last day: applied messages, duplicates skipped and
                their ages, dead letters by group, the outbox backlog
  Activity      one consumer's charts (its "activity" link on the overview)
  Dead letters  grouped by failure fingerprint, as 'idemq dlq inspect' groups
                them; filter by queue, consumer, class, source and time
  A group       its envelopes (every x-idemq-* field, the failure history,
                the signature checked with --verify-key-file), headers and body
  Dry run       what a replay would do: already applied, will apply,
                fingerprint mismatch, beyond the --retention horizon, unverified
  Replay        after confirming the dry run: 'idemq dlq replay' (the dedup
                table is checked first; the rest is republished to its source),
                or requeue (every original republished to its source), at most
                --rate messages a second, with live progress
  Audit         every replay and requeue, in idemq_console_audit (created in
                the dedup table's schema on first use): when, who, what, result
  Lookup        consumer and message id: applied or not, when, from where, and
                its dead-letter copies; an HTTP idempotency key's state

With a dedup store sharded across databases (processed.Sharded), give each
shard's URL with --shard-url, in the map's order, instead of --database-url:
the overview and a consumer's page show each shard's rows and their total,
the applied charts sum the shards, and lookups, dry runs and replays look an
id up on every shard. Shard 0 holds the audit table, and its outbox and HTTP
key tables are the ones shown.

Replays need a token: --token, $IDEMQ_CONSOLE_TOKEN or --token-file (one per
line), each "name:secret" (the audit records the name) or a bare secret.
Prefer $IDEMQ_CONSOLE_TOKEN or --token-file to --token, which other users of
the host can see in ps. Without a token, or with --read-only, the console
changes nothing. It refuses to listen beyond loopback without a token, and
serves only the Host names of --allowed-host (by default, loopback names when
--addr is loopback), against DNS rebinding.

Examples:
  idemq console --dlq-queue payments.dlq --retention 7d
  IDEMQ_CONSOLE_TOKEN=alice:$(cat /etc/idemq/console.secret) idemq console \
      --dlq-queue payments.dlq --dlq-topic orders.dlq --kafka-brokers 127.0.0.1:9092 \
      --verify-key-file /etc/idemq/dlq.key --retention 72h
  idemq console --nats-url nats://127.0.0.1:4222 --dlq-subject payments.dlq \
      --redis-url redis://127.0.0.1:6379/0 --dlq-stream-key orders.dlq`,
	run: runConsole,
}

// The console is listed after the other commands.
func init() { commands = append(commands, consoleCommand) }

// listFlag is a repeatable flag that also takes comma-separated values.
type listFlag []string

func (l *listFlag) String() string { return strings.Join(*l, ",") }
func (l *listFlag) Set(s string) error {
	*l = append(*l, splitList(s)...)
	return nil
}

// consoleFlags are the console's flags.
type consoleFlags struct {
	db           dbFlags
	addr         string
	retention    durationFlag
	amqpURL      string
	queues       listFlag
	kafkaBrokers string
	topics       listFlag
	tokens       listFlag
	tokenFile    string
	readOnly     bool
	keyFiles     string
	rate         float64
	outbox       string
	httpKeys     string
	hosts        listFlag
	streams      streamDLQFlags
	recon        string
	shardURLs    listOfFlag
}

func runConsole(ctx context.Context, e *env, c *command, args []string) error {
	var f consoleFlags
	fs := c.flagSet()
	f.db.register(fs)
	fs.Var(&f.shardURLs, "shard-url", "a shard of a sharded dedup store (processed.Sharded), in the map's order: repeat it for each, instead of --database-url; shard 0 holds the audit, the outbox and the HTTP keys shown")
	fs.StringVar(&f.addr, "addr", "127.0.0.1:8080", "address to listen on; beyond loopback only with a token")
	fs.Var(&f.retention, "retention", "the dedup retention: purge-eligible counts and the replay-horizon guard, a `duration` such as 72h or 7d")
	fs.StringVar(&f.amqpURL, "amqp-url", "", "RabbitMQ URL for --dlq-queue (default $AMQP_URL, then "+rabbitmq.DefaultURL+")")
	fs.Var(&f.queues, "dlq-queue", "RabbitMQ dead-letter `queue` to show (repeatable)")
	fs.StringVar(&f.kafkaBrokers, "kafka-brokers", "", "Kafka bootstrap brokers for --dlq-topic, comma-separated (default $KAFKA_BROKERS)")
	fs.Var(&f.topics, "dlq-topic", "Kafka dead-letter `topic` to show (repeatable)")
	f.streams.register(fs, "to show", true)
	fs.Var(&f.tokens, "token", "a token that may replay: \"name:secret\" or a secret (repeatable; default $IDEMQ_CONSOLE_TOKEN)")
	fs.StringVar(&f.tokenFile, "token-file", "", "read tokens from this `file`, one per line (# starts a comment)")
	fs.BoolVar(&f.readOnly, "read-only", false, "offer and accept no replay or requeue")
	fs.StringVar(&f.keyFiles, "verify-key-file", "", keyFileFlag+"; replays take only verified envelopes")
	fs.Float64Var(&f.rate, "rate", 50, "republish at most this many messages per second")
	fs.StringVar(&f.outbox, "outbox-table", "outbox", "the outbox `table` (schema.table, or table in the connection's current schema) whose backlog to show, if it exists")
	fs.StringVar(&f.httpKeys, "http-key-table", "idempotency_keys", "the HTTP idempotency key `table` (schema.table, or table in the connection's current schema) to show, if it exists")
	fs.StringVar(&f.recon, "reconciliation", "", "show the last reconciliation on the overview: the `file` 'idemq reconcile --out' writes (read at each request)")
	fs.Var(&f.hosts, "allowed-host", "serve requests whose Host header is this `name` (repeatable; default: loopback names when --addr is loopback, any otherwise), against DNS rebinding")
	if _, err := c.parse(e, fs, args, 0); err != nil {
		return err
	}
	cfg, cleanup, err := f.config(ctx, e)
	if err != nil {
		return err
	}
	defer cleanup()
	srv, err := console.New(cfg)
	if err != nil {
		return err
	}
	return console.ListenAndServe(ctx, f.addr, srv, func(a net.Addr) {
		mode := fmt.Sprintf("%d token(s) may replay", len(cfg.Tokens))
		if !srv.Mutable() {
			mode = "read-only"
		}
		fmt.Fprintf(e.stderr, "idemq console: serving on http://%s/ (%s)\n", a, mode)
	})
}

// tokens gathers --token, $IDEMQ_CONSOLE_TOKEN and --token-file.
func (f *consoleFlags) readTokens(e *env) ([]console.Token, error) {
	raw := append([]string(nil), f.tokens...)
	if len(raw) == 0 && f.tokenFile == "" {
		raw = append(raw, splitList(e.getenv("IDEMQ_CONSOLE_TOKEN"))...)
	}
	if f.tokenFile != "" {
		fh, err := os.Open(f.tokenFile)
		if err != nil {
			return nil, usagef("--token-file: %v", err)
		}
		defer fh.Close()
		sc := bufio.NewScanner(fh)
		for sc.Scan() {
			if line := strings.TrimSpace(sc.Text()); line != "" && !strings.HasPrefix(line, "#") {
				raw = append(raw, line)
			}
		}
		if err := sc.Err(); err != nil {
			return nil, usagef("--token-file: %v", err)
		}
	}
	var out []console.Token
	names := map[string]bool{}
	for _, r := range raw {
		t, err := console.ParseToken(r)
		if err != nil {
			// The error names the token, never its secret.
			return nil, usagef("token: %v", err)
		}
		if names[t.Name] {
			return nil, usagef("token %q given twice", t.Name)
		}
		names[t.Name] = true
		out = append(out, t)
	}
	return out, nil
}

// splitTable reads a table flag: schema.table, or a table alone, in the
// connection's current schema (Schema "" until inSearchPath fills it in),
// as outbox.Config and httpidem.Config default to.
func splitTable(flagName, s string) (console.Table, error) {
	schema, table, ok := strings.Cut(s, ".")
	if !ok {
		schema, table = "", s
	}
	if (ok && schema == "") || table == "" {
		return console.Table{}, usagef("--%s %q: want schema.table, or a table", flagName, s)
	}
	return console.Table{Schema: schema, Name: table}, nil
}

// inSearchPath sets the schema of the tables that name none to the
// connection's current_schema().
func inSearchPath(ctx context.Context, db processed.DB, tables ...*console.Table) error {
	for _, t := range tables {
		if t.Schema != "" {
			continue
		}
		var schema *string
		if err := db.QueryRow(ctx, `SELECT current_schema()`).Scan(&schema); err != nil {
			return fmt.Errorf("read the schema of %s from search_path: %w", t.Name, err)
		}
		if schema == nil {
			return fmt.Errorf("the schema of %s: the connection's search_path names no existing schema", t.Name)
		}
		t.Schema = *schema
	}
	return nil
}

// config validates the flags, connects, and returns the console's
// configuration and what closes its connections.
func (f *consoleFlags) config(ctx context.Context, e *env) (console.Config, func(), error) {
	var cfg console.Config
	if f.retention.set && f.retention.d <= 0 {
		return cfg, nil, usagef("--retention must be positive, got %s", f.retention.d)
	}
	if f.rate <= 0 {
		return cfg, nil, usagef("--rate must be positive, got %g", f.rate)
	}
	tokens, err := f.readTokens(e)
	if err != nil {
		return cfg, nil, err
	}
	if err := console.CheckAddr(f.addr, len(tokens) > 0); err != nil {
		return cfg, nil, &usageError{msg: err.Error()}
	}
	keys, err := readKeyFiles(f.keyFiles)
	if err != nil {
		return cfg, nil, err
	}
	ob, err := splitTable("outbox-table", f.outbox)
	if err != nil {
		return cfg, nil, err
	}
	hk, err := splitTable("http-key-table", f.httpKeys)
	if err != nil {
		return cfg, nil, err
	}
	amqpURL := f.amqpURL
	if amqpURL == "" {
		if amqpURL = e.getenv("AMQP_URL"); amqpURL == "" {
			amqpURL = rabbitmq.DefaultURL
		}
	}
	kafkaBrokers := f.kafkaBrokers
	if kafkaBrokers == "" {
		kafkaBrokers = e.getenv("KAFKA_BROKERS")
	}
	brokers := splitList(kafkaBrokers)
	if len(f.topics) > 0 && len(brokers) == 0 {
		return cfg, nil, usagef("--kafka-brokers (or $KAFKA_BROKERS) is required with --dlq-topic")
	}
	streamDLQs, err := f.streams.resolve(e)
	if err != nil {
		return cfg, nil, err
	}

	shards, err := f.openShards(ctx, e)
	if err != nil {
		return cfg, nil, err
	}
	closeAll := func() {
		for _, sh := range shards {
			sh.Store.Close()
		}
	}
	store := shards[0].Store
	if err := inSearchPath(ctx, store.Pool(), &ob, &hk); err != nil {
		closeAll()
		return cfg, nil, err
	}
	dbURL, _ := f.db.databaseURL(e)
	cfg = console.Config{Retention: f.retention.d, Tokens: tokens, ReadOnly: f.readOnly,
		VerifyKeys: keys, Rate: f.rate, Outbox: ob, HTTPKeys: hk, AllowedHosts: f.hosts, Reconciliation: f.recon,
		Secrets: append([]string{dbURL, amqpURL}, append(f.streams.secrets(e), f.shardURLs...)...),
		Logger:  slog.New(slog.NewTextHandler(e.stderr, &slog.HandlerOptions{Level: slog.LevelInfo}))}
	if len(f.shardURLs) == 0 {
		cfg.Store, cfg.DB = store, store.Pool()
		cfg.Info = append(cfg.Info, [2]string{"Postgres", redact.DSN(dbURL)})
	} else {
		cfg.Shards = shards
		for i, u := range f.shardURLs {
			cfg.Info = append(cfg.Info, [2]string{fmt.Sprintf("Postgres, shard %d", i), redact.DSN(u)})
		}
	}
	cfg.Info = append(cfg.Info, [2]string{"dedup table", store.String()})
	cfg.Status = func(ctx context.Context, db console.Shard, name string) (console.ConsumerStatus, error) {
		return consoleStatus(ctx, db.Store, name, f.retention)
	}
	for _, q := range f.queues {
		bf := &brokerFlags{broker: "rabbitmq", amqpURL: amqpURL, queue: q}
		cfg.DLQs = append(cfg.DLQs, consoleDLQ(bf, func(ctx context.Context) statusDLQ { return statusRabbitDepth(ctx, amqpURL, q) }))
	}
	if len(f.queues) > 0 {
		cfg.Info = append(cfg.Info, [2]string{"RabbitMQ", redact.URL(amqpURL)})
	}
	for _, t := range f.topics {
		bf := &brokerFlags{broker: "kafka", kafkaBrokers: kafkaBrokers, topic: t}
		cfg.DLQs = append(cfg.DLQs, consoleDLQ(bf, func(ctx context.Context) statusDLQ { return statusKafkaDepth(ctx, brokers, t) }))
	}
	if len(f.topics) > 0 {
		cfg.Info = append(cfg.Info, [2]string{"Kafka", strings.Join(brokers, ",")})
	}
	for _, bf := range streamDLQs {
		cfg.DLQs = append(cfg.DLQs, consoleDLQ(bf, func(ctx context.Context) statusDLQ { return statusStreamDepth(ctx, bf) }))
	}
	cfg.Info = append(cfg.Info, f.streams.info(e)...)
	return cfg, closeAll, nil
}

// openShards opens the dedup store of --database-url, or each of
// --shard-url's, with a pool.
func (f *consoleFlags) openShards(ctx context.Context, e *env) ([]console.Shard, error) {
	if len(f.shardURLs) == 0 {
		store, err := f.db.openPool(ctx, e)
		if err != nil {
			return nil, err
		}
		return []console.Shard{{Store: store, DB: store.Pool()}}, nil
	}
	if f.db.url != "" {
		return nil, usagef("--shard-url and --database-url: give the shards' URLs, or the one database's")
	}
	var shards []console.Shard
	for i, u := range f.shardURLs {
		sd := f.db
		sd.url = u
		store, err := sd.openPool(ctx, e)
		if err != nil {
			for _, sh := range shards {
				sh.Store.Close()
			}
			return nil, fmt.Errorf("shard %d: %w", i, err)
		}
		shards = append(shards, console.Shard{Store: store, DB: store.Pool()})
	}
	return shards, nil
}

// consoleDLQ is a dead-letter queue opened as `idemq dlq` opens it, with
// its depth read as `idemq status` reads it.
func consoleDLQ(bf *brokerFlags, depth func(context.Context) statusDLQ) console.DLQ {
	return console.DLQ{Broker: bf.broker, Name: bf.name(),
		Depth: func(ctx context.Context) (int64, error) {
			d := depth(ctx)
			if d.Depth == nil {
				return 0, errors.New(d.Error)
			}
			return *d.Depth, nil
		},
		Open: func(ctx context.Context, publish bool) (*console.Conn, error) {
			c, err := bf.open(ctx, publish)
			if err != nil {
				return nil, err
			}
			return &console.Conn{Browser: c.browser, Publish: c.publish, Close: c.close}, nil
		}}
}

// consoleStatus is `idemq status` for one consumer, on a connection of the
// pool.
func consoleStatus(ctx context.Context, store *processed.Store, name string, retention durationFlag) (console.ConsumerStatus, error) {
	conn, err := store.Pool().Acquire(ctx)
	if err != nil {
		return console.ConsumerStatus{}, err
	}
	defer conn.Release()
	rep, err := statusFromDB(ctx, conn.Conn(), store, name, retention)
	if err != nil {
		return console.ConsumerStatus{}, hint(err, store)
	}
	st := console.ConsumerStatus{Consumer: name, Rows: rep.Rows, PurgeEligible: rep.PurgeEligible}
	if rep.OldestProcessedAt != nil {
		st.Oldest = *rep.OldestProcessedAt
	}
	if l := rep.LastApplied; l != nil {
		st.LastApplied = &processed.Row{Consumer: name, MessageID: l.MessageID, ProcessedAt: l.ProcessedAt,
			Source: l.Source, Partition: l.Partition, Offset: l.Offset}
	}
	return st, nil
}

// openPool is openStore with a pool, which the console's concurrent
// requests share. Like openStore, it opens the store with the layout the
// table has.
func (d *dbFlags) openPool(ctx context.Context, e *env) (*processed.Store, error) {
	// connect validates the names, reports connection errors with the
	// password redacted and reads the table's layout; the pool is opened
	// only once it succeeded.
	cfg, conn, err := d.connect(ctx, e, processed.Config{})
	if err != nil {
		return nil, err
	}
	closeConn(conn)
	raw, from := d.databaseURL(e)
	store, err := processed.Open(ctx, raw, cfg)
	if err != nil {
		return nil, redact.Error(fmt.Errorf("cannot open a pool to Postgres at %s (URL from %s): %w", redact.DSN(raw), from, err), raw)
	}
	return store, nil
}
