package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemq/idemq/brokers/rabbitmq"
	"github.com/idemq/idemq/cmd/idemq/internal/reconcile"
	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/dlq"
	"github.com/idemq/idemq/internal/redact"
)

var reconcileCommand = &command{
	name:    "reconcile",
	args:    "--db NAME[=URL]... --flow SPEC...",
	summary: "join producers' outboxes with consumers' dedup tables over a window: lost, doubled, stuck, orphaned",
	help: `Joins what each producer recorded in its outbox with what each consumer
applied (its dedup rows), by message id and by derived key, over a time
window, and reports five kinds of discrepancy:

  published, never applied      an outbox row sent in the window whose id has
                                no dedup row of the flow's consumer in any of
                                its databases (a dead-lettered message is one:
                                give --dlq to count those apart)
  applied twice                 one id of a consumer with dedup rows in two of
                                its databases (shards), or twice in one
  outbox rows stuck unsent      unsent rows created more than --grace ago,
                                whatever the window
  dedup rows of unknown origin  a consumer's dedup row in the window whose id
                                is in no outbox of a flow feeding it
  applied, not forwarded        (a forward) a dedup row in the window without
                                the outbox row of its derived id,
                                keys.ChildKey(id, step)

Databases: --db NAME=URL names a service's database; --db NAME alone uses
--database-url ($DATABASE_URL, then the default). Its outbox is "outbox" and
its dedup table "processed_messages", in --schema NAME=SCHEMA or the
connection's current schema; --outbox-table and --dedup-table
NAME=[SCHEMA.]TABLE name others.

Flows (--flow, repeatable):
  PRODUCER:DESTINATION->CONSUMERDB[,CONSUMERDB...]:CONSUMER
      the outbox rows of PRODUCER for DESTINATION are applied by the
      consumer named CONSUMER, which records them in one of the CONSUMERDBs
  CONSUMERDB[,...]:CONSUMER=>OUTBOXDB[,...]:DESTINATION@STEP
      each message CONSUMER applied wrote, in the same transaction, an
      outbox row for DESTINATION whose id is keys.ChildKey(id, STEP)

The window is [--since, --until), in the databases' clocks: outbox rows by
sent_at, dedup rows by processed_at. It ends --grace (5m) before now at the
latest, so that messages in flight are not reported. A purge limits how far
back it can look: where a consumer recorded a purge horizon, or an outbox
holds no sent row before some time, the checks that would report what the
purge removed start there instead, and a note counts the rows they skipped.

It only reads: every query runs in a READ ONLY transaction, pages over an
index (--page rows at a time) or looks ids up by key.

Exit status: 0 clean; 1 discrepancies found (the report says which); 2 a
usage error, or a database or dead-letter queue that could not be read.

Examples:
  idemq reconcile --db payments=postgres://pay-db/payments --db ledger=postgres://ledger-db/ledger \
      --flow 'payments:charges->ledger:ledger' --since 25h
  idemq reconcile --db payments --db ledger --db notify \
      --schema payments=chain_payments --schema ledger=chain_ledger --schema notify=chain_notify \
      --flow 'payments:chain.charges->ledger:ledger' \
      --flow 'ledger:ledger=>ledger:chain.ledger@ledger-entry-recorded/v1' \
      --flow 'ledger:chain.ledger->notify:notify' --json --out /var/lib/idemq/reconcile.json`,
	run: runReconcile,
}

// pairFlag is a repeatable NAME=VALUE flag.
type pairFlag struct {
	name  string // the flag's name, for messages
	pairs [][2]string
	// optional allows NAME alone, with an empty value.
	optional bool
}

func (p *pairFlag) String() string { return "" }

func (p *pairFlag) Set(s string) error {
	k, v, ok := strings.Cut(s, "=")
	if k == "" || (!ok && !p.optional) || (ok && v == "") {
		if p.optional {
			return errors.New("want NAME or NAME=VALUE")
		}
		return errors.New("want NAME=VALUE")
	}
	p.pairs = append(p.pairs, [2]string{k, v})
	return nil
}

// reconcileFlags are reconcile's flags.
type reconcileFlags struct {
	db                     dbFlags
	dbs, schemas           pairFlag
	outboxes, dedups, dlqs pairFlag
	flows                  listOfFlag
	since, until           string
	grace                  durationFlag
	page, limit, dlqLimit  int
	json                   bool
	out                    string
	amqpURL, kafkaBrokers  string
	natsURL, redisURL      string
	redisBodyField         string
}

// listOfFlag is a repeatable flag whose values are kept whole (a flow
// spec may hold commas).
type listOfFlag []string

func (l *listOfFlag) String() string     { return strings.Join(*l, " ") }
func (l *listOfFlag) Set(s string) error { *l = append(*l, s); return nil }

func runReconcile(ctx context.Context, e *env, c *command, args []string) error {
	f := reconcileFlags{dbs: pairFlag{name: "db", optional: true}, schemas: pairFlag{name: "schema"},
		outboxes: pairFlag{name: "outbox-table"}, dedups: pairFlag{name: "dedup-table"}, dlqs: pairFlag{name: "dlq"}}
	fs := c.flagSet()
	fs.StringVar(&f.db.url, "database-url", "", "Postgres URL of the --db given without one (default $DATABASE_URL, then "+defaultDatabaseURL+")")
	fs.Var(&f.dbs, "db", "a service's database, `NAME=URL`, or NAME alone for --database-url (repeatable)")
	fs.Var(&f.schemas, "schema", "the schema of a database's outbox and dedup table, `NAME=SCHEMA` (repeatable; default: the connection's current schema)")
	fs.Var(&f.outboxes, "outbox-table", "a database's outbox table, `NAME=[SCHEMA.]TABLE` (repeatable; default outbox)")
	fs.Var(&f.dedups, "dedup-table", "a database's dedup table, `NAME=[SCHEMA.]TABLE` (repeatable; default processed_messages)")
	fs.Var(&f.flows, "flow", "a flow, `PRODUCER:DEST->DB[,DB]:CONSUMER`, or a forward, DB[,DB]:CONSUMER=>DB[,DB]:DEST@STEP (repeatable)")
	fs.StringVar(&f.since, "since", "24h", "start of the window: an RFC 3339 time, or a duration ago such as 25h or 7d")
	fs.StringVar(&f.until, "until", "", "end of the window (exclusive): an RFC 3339 time, or a duration ago (default now)")
	f.grace.d, f.grace.set = 5*time.Minute, true
	fs.Var(&f.grace, "grace", "how old a row must be to be judged: messages sent, and unsent rows created, more recently are in flight (default 5m)")
	fs.IntVar(&f.page, "page", 1000, "rows per page, and ids per lookup")
	fs.IntVar(&f.limit, "limit", 10, "samples kept of each kind of discrepancy")
	fs.BoolVar(&f.json, "json", false, "print the report as JSON")
	fs.StringVar(&f.out, "out", "", "also write the JSON report to this `file`, atomically (for 'idemq console --reconciliation')")
	fs.Var(&f.dlqs, "dlq", "a consumer's dead-letter queue, `CONSUMER=BROKER:NAME` (rabbitmq, kafka, nats or redis; repeatable): its ids count as dead-lettered, not never applied")
	fs.IntVar(&f.dlqLimit, "dlq-limit", 100000, "read at most this many dead letters of each --dlq")
	fs.StringVar(&f.amqpURL, "amqp-url", "", "RabbitMQ URL for --dlq (default $AMQP_URL, then "+rabbitmq.DefaultURL+")")
	fs.StringVar(&f.kafkaBrokers, "kafka-brokers", "", "Kafka bootstrap brokers for --dlq, comma-separated (default $KAFKA_BROKERS)")
	fs.StringVar(&f.natsURL, "nats-url", "", natsURLHelp)
	fs.StringVar(&f.redisURL, "redis-url", "", redisURLHelp)
	registerRedisFields(fs, &f.redisBodyField)
	if _, err := c.parse(e, fs, args, 0); err != nil {
		return err
	}
	cfg, urls, err := f.config(e)
	if err != nil {
		return err
	}
	if f.page < 1 {
		return usagef("--page %d: must be positive", f.page)
	}
	if f.limit < 1 {
		return usagef("--limit %d: must be positive", f.limit)
	}
	cfg.PageSize, cfg.SampleLimit = f.page, f.limit
	dead, err := f.deadLettered(ctx, e)
	if err != nil {
		return err
	}
	cfg.DeadLettered = dead

	pools := map[string]*pgxpool.Pool{}
	defer func() {
		for _, p := range pools {
			p.Close()
		}
	}()
	for i := range cfg.Databases {
		raw := urls[i]
		p, ok := pools[raw]
		if !ok {
			if p, err = openReadOnlyPool(ctx, raw); err != nil {
				return &exitError{code: exitUsage, err: fmt.Errorf("database %s: %w", cfg.Databases[i].Name, err)}
			}
			pools[raw] = p
		}
		cfg.Databases[i].DB = p
	}
	prog := newProgress(e.stderr)
	cfg.Progress = func(p reconcile.Progress) {
		prog.update("reconcile: %s rows of %s: %d", p.Phase, p.Database, p.Rows)
	}
	rep, err := reconcile.Run(ctx, cfg)
	prog.done()
	if err != nil {
		var ce *consumer.ConfigError
		if errors.As(err, &ce) {
			return usagef("%s: %s", ce.Field, ce.Reason)
		}
		// Not a discrepancy: the check could not run (exit 2, as a
		// cron job must tell it from a finding).
		return &exitError{code: exitUsage, err: fmt.Errorf("cannot reconcile: %w", redact.Error(err, urls...))}
	}
	if f.out != "" {
		if err := writeFileAtomic(f.out, rep); err != nil {
			return &exitError{code: exitUsage, err: fmt.Errorf("--out: %w", err)}
		}
	}
	if f.json {
		enc := json.NewEncoder(e.stdout)
		enc.SetIndent("", "  ")
		if err := enc.Encode(rep); err != nil {
			return err
		}
	} else if err := rep.WriteText(e.stdout); err != nil {
		return err
	}
	if !rep.Clean {
		return fmt.Errorf("%d discrepancies found", rep.Discrepancies)
	}
	return nil
}

// config reads the databases and flows into a reconcile.Config, and the
// URL of each database, in order.
func (f *reconcileFlags) config(e *env) (reconcile.Config, []string, error) {
	var cfg reconcile.Config
	var urls []string
	if len(f.dbs.pairs) == 0 {
		return cfg, nil, usagef("--db is required: name each service's database, --db NAME=URL")
	}
	if len(f.flows) == 0 {
		return cfg, nil, usagef("--flow is required: say what flows between the databases, such as --flow 'payments:charges->ledger:ledger'")
	}
	index := map[string]int{}
	for _, p := range f.dbs.pairs {
		if _, dup := index[p[0]]; dup {
			return cfg, nil, usagef("--db %s given twice", p[0])
		}
		raw := p[1]
		if raw == "" {
			raw, _ = f.db.databaseURL(e)
		}
		index[p[0]] = len(cfg.Databases)
		cfg.Databases = append(cfg.Databases, reconcile.Database{Name: p[0]})
		urls = append(urls, raw)
	}
	db := func(flagName, name string) (*reconcile.Database, error) {
		i, ok := index[name]
		if !ok {
			return nil, usagef("--%s %s: no --db %s", flagName, name, name)
		}
		return &cfg.Databases[i], nil
	}
	for _, p := range f.schemas.pairs {
		d, err := db("schema", p[0])
		if err != nil {
			return cfg, nil, err
		}
		d.Outbox.Schema, d.Dedup.Schema = p[1], p[1]
	}
	for _, tf := range []struct {
		flag  *pairFlag
		which func(*reconcile.Database) *reconcile.Table
	}{
		{&f.outboxes, func(d *reconcile.Database) *reconcile.Table { return &d.Outbox }},
		{&f.dedups, func(d *reconcile.Database) *reconcile.Table { return &d.Dedup }},
	} {
		for _, p := range tf.flag.pairs {
			d, err := db(tf.flag.name, p[0])
			if err != nil {
				return cfg, nil, err
			}
			t, err := splitTable(tf.flag.name, p[1])
			if err != nil {
				return cfg, nil, err
			}
			tbl := tf.which(d)
			tbl.Name = t.Name
			if t.Schema != "" {
				tbl.Schema = t.Schema
			}
		}
	}
	for _, spec := range f.flows {
		flow, fwd, err := parseFlow(spec)
		if err != nil {
			return cfg, nil, usagef("--flow %q: %v", spec, err)
		}
		if fwd != nil {
			cfg.Forwards = append(cfg.Forwards, *fwd)
		} else {
			cfg.Flows = append(cfg.Flows, *flow)
		}
	}
	now := time.Now()
	var err error
	if cfg.Since, err = parseWhen("--since", f.since, now); err != nil {
		return cfg, nil, err
	}
	if cfg.Until, err = parseWhen("--until", f.until, now); err != nil {
		return cfg, nil, err
	}
	if f.grace.d <= 0 {
		return cfg, nil, usagef("--grace %s: must be positive", f.grace.d)
	}
	cfg.Grace = f.grace.d
	return cfg, urls, nil
}

// parseFlow reads a --flow: a delivery (->) or a forward (=>).
func parseFlow(spec string) (*reconcile.Flow, *reconcile.Forward, error) {
	side := func(s, what string) (names []string, rest string, err error) {
		list, rest, ok := strings.Cut(s, ":")
		if !ok || list == "" || rest == "" {
			return nil, "", fmt.Errorf("%s: want DATABASE:%s", strings.TrimSpace(s), what)
		}
		for _, n := range strings.Split(list, ",") {
			if n = strings.TrimSpace(n); n == "" {
				return nil, "", fmt.Errorf("an empty database name in %q", list)
			}
			names = append(names, strings.TrimSpace(n))
		}
		return names, rest, nil
	}
	if from, to, ok := strings.Cut(spec, "=>"); ok {
		cdbs, cons, err := side(from, "CONSUMER")
		if err != nil {
			return nil, nil, err
		}
		odbs, rest, err := side(to, "DESTINATION@STEP")
		if err != nil {
			return nil, nil, err
		}
		at := strings.LastIndex(rest, "@")
		if at <= 0 || at == len(rest)-1 {
			return nil, nil, fmt.Errorf("%s: want DESTINATION@STEP, the step of keys.ChildKey", rest)
		}
		return nil, &reconcile.Forward{Consumer: cons, ConsumerDatabases: cdbs, OutboxDatabases: odbs, Destination: rest[:at], Step: rest[at+1:]}, nil
	}
	from, to, ok := strings.Cut(spec, "->")
	if !ok {
		return nil, nil, errors.New("want PRODUCER:DESTINATION->DATABASE:CONSUMER, or a forward DATABASE:CONSUMER=>DATABASE:DESTINATION@STEP")
	}
	pdbs, dest, err := side(from, "DESTINATION")
	if err != nil {
		return nil, nil, err
	}
	if len(pdbs) != 1 {
		return nil, nil, fmt.Errorf("one producer database, not %d: give a --flow for each", len(pdbs))
	}
	cdbs, cons, err := side(to, "CONSUMER")
	if err != nil {
		return nil, nil, err
	}
	return &reconcile.Flow{Producer: pdbs[0], Destination: dest, Consumer: cons, ConsumerDatabases: cdbs}, nil, nil
}

// openReadOnlyPool connects to raw with every transaction read-only by
// default, besides the READ ONLY transactions reconcile begins.
func openReadOnlyPool(ctx context.Context, raw string) (*pgxpool.Pool, error) {
	cfg, err := pgxpool.ParseConfig(raw)
	if err != nil {
		return nil, redact.Error(fmt.Errorf("invalid database URL %s: %w", redact.DSN(raw), err), raw)
	}
	if cfg.ConnConfig.ConnectTimeout == 0 {
		cfg.ConnConfig.ConnectTimeout = connectTimeout
	}
	cfg.ConnConfig.RuntimeParams["default_transaction_read_only"] = "on"
	cfg.ConnConfig.RuntimeParams["application_name"] = "idemq reconcile"
	cfg.MaxConns = 2
	p, err := pgxpool.NewWithConfig(ctx, cfg)
	if err == nil {
		err = p.Ping(ctx)
		if err != nil {
			p.Close()
		}
	}
	if err != nil {
		return nil, redact.Error(fmt.Errorf("cannot connect to Postgres at %s: %w", redact.DSN(raw), err), raw)
	}
	return p, nil
}

// deadLettered reads the ids in each --dlq, by consumer, as 'idemq dlq
// inspect' reads a dead-letter queue: consuming nothing.
func (f *reconcileFlags) deadLettered(ctx context.Context, e *env) (map[string][]string, error) {
	if len(f.dlqs.pairs) == 0 {
		return nil, nil
	}
	if f.dlqLimit < 1 {
		return nil, usagef("--dlq-limit %d: must be positive", f.dlqLimit)
	}
	out := map[string][]string{}
	for _, p := range f.dlqs.pairs {
		name := p[0]
		broker, queue, ok := strings.Cut(p[1], ":")
		if !ok || queue == "" {
			return nil, usagef("--dlq %s=%s: want CONSUMER=BROKER:NAME, such as ledger=rabbitmq:chain.charges.dlq", name, p[1])
		}
		bf := &brokerFlags{broker: broker, amqpURL: f.amqpURL, kafkaBrokers: f.kafkaBrokers, natsURL: f.natsURL,
			redisURL: f.redisURL, redisBodyField: f.redisBodyField}
		switch broker {
		case "rabbitmq":
			bf.queue = queue
		case "kafka":
			bf.topic = queue
		case "nats":
			bf.subject = queue
		case "redis":
			bf.streamKey = queue
		default:
			return nil, usagef("--dlq %s=%s: broker %q: want rabbitmq, kafka, nats or redis", name, p[1], broker)
		}
		if err := bf.validate(e); err != nil {
			return nil, err
		}
		ids, err := readDeadLetterIDs(ctx, bf, name, f.dlqLimit)
		if err != nil {
			return nil, &exitError{code: exitUsage, err: fmt.Errorf("--dlq %s=%s: %w", name, p[1], redact.Error(err, bf.secrets()...))}
		}
		out[name] = append(out[name], ids...)
	}
	return out, nil
}

// readDeadLetterIDs reads up to limit dead letters of bf and returns the
// message ids of those consumer name dead-lettered (and of those without
// an idemq envelope, by their own id).
func readDeadLetterIDs(ctx context.Context, bf *brokerFlags, name string, limit int) ([]string, error) {
	ctx, cancel := context.WithTimeout(ctx, statusCountTimeout)
	defer cancel()
	conn, err := bf.open(ctx, false)
	if err != nil {
		return nil, err
	}
	defer conn.close()
	var ids []string
	for range limit {
		d, err := conn.browser.Next(ctx)
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			return nil, fmt.Errorf("read the dead letters: %w", err)
		}
		m := d.Message()
		rec, err := dlq.Parse(m)
		switch {
		case err == nil && (rec.Consumer == "" || rec.Consumer == name) && rec.MessageID != "":
			ids = append(ids, rec.MessageID)
		case err != nil && m.ID != "":
			ids = append(ids, m.ID)
		}
	}
	return ids, nil
}

// writeFileAtomic writes rep as JSON to path through a temporary file in
// its directory, renamed over it: a reader sees the old report or the new
// one, never part of one.
func writeFileAtomic(path string, rep *reconcile.Report) error {
	b, err := json.MarshalIndent(rep, "", "  ")
	if err != nil {
		return err
	}
	tmp, err := os.CreateTemp(filepath.Dir(path), "."+filepath.Base(path)+".*.tmp")
	if err != nil {
		return err
	}
	done := false
	defer func() {
		if !done {
			_ = tmp.Close()
			_ = os.Remove(tmp.Name())
		}
	}()
	if _, err := tmp.Write(append(b, '\n')); err != nil {
		return err
	}
	if err := tmp.Chmod(0o644); err != nil {
		return err
	}
	if err := tmp.Sync(); err != nil {
		return err
	}
	if err := tmp.Close(); err != nil {
		return err
	}
	if err := os.Rename(tmp.Name(), path); err != nil {
		return err
	}
	done = true
	return nil
}

var _ flag.Value = (*pairFlag)(nil)
