package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"os"
	"strings"
	"text/tabwriter"
	"time"
	"unicode/utf8"

	"github.com/jackc/pgx/v5"
	"github.com/redis/go-redis/v9"

	"github.com/idemq/idemq/brokers/rabbitmq"
	"github.com/idemq/idemq/brokers/redisstream"
	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/dlq"
	"github.com/idemq/idemq/internal/redact"
	"github.com/idemq/idemq/processed"
)

var dlqInspectCommand = &command{
	name:    "dlq inspect",
	summary: "summarise a dead-letter queue without consuming it",
	help: `Reads every message of a dead-letter queue (RabbitMQ: fetched and then
requeued in place; Kafka: read without committing; NATS JetStream: read with
an ordered consumer, which leaves nothing on the server; Redis Streams: read
with XRANGE, without a consumer group) and groups them by failure
fingerprint: consumer, original source, error class and the shape of the error
text, in which message ids, timestamps, UUIDs, hex ids, numbers and quoted
values are replaced by placeholders (<id>, <time>, <uuid>, <hex>, <n>, "<q>"),
so the dead letters of one cause form one group although each text names its
own id and time. Each group shows its count, first and last failure, the shape
and one sample error text (--json adds the fingerprint and up to five ids).
Nothing is consumed.

The broker is the one whose dead-letter flag is given: --queue (RabbitMQ,
--amqp-url), --topic (Kafka, --kafka-brokers), --subject (NATS JetStream,
--nats-url; the stream is the one that captures the subject unless --stream
names it) or --stream-key (Redis Streams, --redis-url); --broker says it
explicitly. A Redis stream key that does not exist reads as empty, and a
note on stderr says so.

Examples:
  idemq dlq inspect --queue payments.dlq
  idemq dlq inspect --broker kafka --kafka-brokers 127.0.0.1:9092 --topic payments.dlq --json
  idemq dlq inspect --nats-url nats://127.0.0.1:4222 --subject payments.dlq
  idemq dlq inspect --redis-url redis://127.0.0.1:6379/0 --stream-key payments.dlq`,
	run: runDLQInspect,
}

var dlqReplayCommand = &command{
	name:    "dlq replay",
	summary: "republish dead letters to their original queue, or dry-run",
	help: `Replays a dead-letter queue through the live consumer's dedup path. Each
selected message is checked against the dedup table:

  already applied         removed from the DLQ, not republished (skipped)
  not applied yet         republished to its original queue, topic, subject or
                          stream (confirmed), then removed from the DLQ; the
                          consumer applies it once
  fingerprint mismatch    left in the DLQ: the same id was applied with another
                          payload, which needs a human

Messages first seen longer ago than --retention may have lost their dedup row
to purging, so replaying them could apply them twice: they are left in the DLQ
unless --force is given.

--dry-run consumes nothing: it classifies every selected message as
already-applied, will-apply, fingerprint-mismatch or missing-id, and flags the
ones beyond the retention horizon with the reason (how long ago it first
failed, or the original it mismatched was applied; or that a mismatch's
original dedup row is gone); --json gives it as horizon_reason.

--verify-key-file replays only messages whose envelope was signed with one
of the listed keys (dlq.Options.SigningKey in the consumer); the others stay in
the DLQ and are counted as unverified. Without it, envelopes are trusted as
they are, so whoever can publish to the DLQ chooses where a message is
republished.

The DLQ is chosen as for 'idemq dlq inspect'. On NATS JetStream an original
is republished with its dedup id in Nats-Msg-Id and duplicates rejected: one
the work stream discards as a duplicate (republished within its duplicate
window) fails and stays in the DLQ. A removed dead letter is deleted from its
stream (NATS: by sequence; Redis: XDEL). On Redis Streams the original is
added (XADD) with its dedup id in the idempotency-key field and its body in
the field the consumer reads it from: --redis-body-field, if its Source sets
BodyField.

To run the handler in this process instead, use the Go API dlq.Replay.

Examples:
  idemq dlq replay --queue payments.dlq --dry-run
  idemq dlq replay --queue payments.dlq --class permanent --retention 72h --rate 200
  idemq dlq replay --queue payments.dlq --verify-key-file /etc/idemq/dlq.key,/etc/idemq/dlq-old.key
  idemq dlq replay --subject payments.dlq --retention 72h --dry-run
  idemq dlq replay --stream-key payments.dlq --retention 72h`,
	run: runDLQReplay,
}

// brokerFlags select a dead-letter queue.
type brokerFlags struct {
	broker       string
	amqpURL      string
	queue        string
	kafkaBrokers string
	topic        string
	natsURL      string
	subject      string
	natsStream   string
	redisURL     string
	streamKey    string
	// redisBodyField is the consumer's body field
	// (redisstream.Config.BodyField).
	redisBodyField string
}

func (b *brokerFlags) register(fs *flag.FlagSet) {
	fs.StringVar(&b.broker, "broker", "", "broker of the dead-letter queue: rabbitmq, kafka, nats or redis (default: the one whose --queue, --topic, --subject or --stream-key is given, else rabbitmq)")
	fs.StringVar(&b.amqpURL, "amqp-url", "", "RabbitMQ URL (default $AMQP_URL, then "+rabbitmq.DefaultURL+")")
	fs.StringVar(&b.queue, "queue", "", "RabbitMQ dead-letter queue")
	fs.StringVar(&b.kafkaBrokers, "kafka-brokers", "", "Kafka bootstrap brokers, comma-separated (default $KAFKA_BROKERS)")
	fs.StringVar(&b.topic, "topic", "", "Kafka dead-letter topic")
	b.registerStreams(fs)
}

// dlqConn is an open dead-letter queue: a browser, and a way to republish.
type dlqConn struct {
	browser dlq.Browser
	publish func(ctx context.Context, destination string, msg *consumer.Message) error
	close   func()
	// note, if set, is said on stderr: the DLQ reads as empty because it
	// does not exist.
	note string
}

// name is the dead-letter queue's name: its queue, topic, subject or
// stream key.
func (b *brokerFlags) name() string {
	switch b.broker {
	case "kafka":
		return b.topic
	case "nats":
		return b.subject
	case "redis":
		return b.streamKey
	}
	return b.queue
}

func (b *brokerFlags) validate(e *env) error {
	if b.broker == "" {
		b.broker = "rabbitmq"
		switch {
		case b.queue != "":
		case b.topic != "":
			b.broker = "kafka"
		case b.subject != "":
			b.broker = "nats"
		case b.streamKey != "":
			b.broker = "redis"
		}
	}
	switch b.broker {
	case "rabbitmq":
		if b.queue == "" {
			return usagef("--queue is required with --broker rabbitmq")
		}
		if b.amqpURL == "" {
			b.amqpURL = e.getenv("AMQP_URL")
		}
		if b.amqpURL == "" {
			b.amqpURL = rabbitmq.DefaultURL
		}
	case "kafka":
		if b.topic == "" {
			return usagef("--topic is required with --broker kafka")
		}
		if b.kafkaBrokers == "" {
			b.kafkaBrokers = e.getenv("KAFKA_BROKERS")
		}
		if b.kafkaBrokers == "" {
			return usagef("--kafka-brokers (or $KAFKA_BROKERS) is required with --broker kafka")
		}
	case "nats":
		return b.validateNATS(e, "--subject", "--stream")
	case "redis":
		return b.validateRedis(e, "--stream-key")
	default:
		return usagef("--broker %q: want rabbitmq, kafka, nats or redis", b.broker)
	}
	return nil
}

// open opens the dead-letter queue; withPublisher also opens a publisher
// for republishing.
func (b *brokerFlags) open(ctx context.Context, withPublisher bool) (*dlqConn, error) {
	switch b.broker {
	case "kafka":
		return openKafkaDLQ(ctx, b, withPublisher)
	case "nats":
		return openNATSDLQ(ctx, b, withPublisher)
	case "redis":
		c, err := openRedisDLQ(ctx, b, withPublisher)
		if err != nil {
			return nil, err
		}
		if c.note, err = missingRedisStream(ctx, b, c.browser); err != nil {
			c.close()
			return nil, err
		}
		return c, nil
	default:
		br, err := rabbitmq.NewBrowser(ctx, rabbitmq.BrowserConfig{URL: b.amqpURL, Queue: b.queue})
		if err != nil {
			return nil, err
		}
		c := &dlqConn{browser: br, close: func() { _ = br.Close() }}
		if withPublisher {
			pub, err := rabbitmq.NewPublisher(ctx, rabbitmq.PublisherConfig{URL: b.amqpURL})
			if err != nil {
				_ = br.Close()
				return nil, err
			}
			c.publish = func(ctx context.Context, dest string, m *consumer.Message) error {
				return pub.Publish(ctx, "", dest, m)
			}
			c.close = func() { _ = br.Close(); _ = pub.Close() }
		}
		return c, nil
	}
}

// missingRedisStream returns a note when b's Redis dead-letter stream does
// not exist. It then browses as empty, as an emptied one does, and a
// mistyped key or database would go unnoticed; a dead-letterer creates the
// stream with its first dead letter, so a missing one is not an error.
func missingRedisStream(ctx context.Context, b *brokerFlags, br dlq.Browser) (string, error) {
	if rb, ok := br.(*redisstream.Browser); ok && rb.Depth() > 0 {
		return "", nil
	}
	opt, err := redis.ParseURL(b.redisURL)
	if err != nil {
		return "", fmt.Errorf("--redis-url: %w", redact.Error(err, b.redisURL))
	}
	rdb := redis.NewClient(opt)
	defer rdb.Close()
	n, err := rdb.Exists(ctx, b.streamKey).Result()
	if err != nil {
		return "", fmt.Errorf("EXISTS %q at %s: %w", b.streamKey, redact.URL(b.redisURL), redact.Error(err, b.redisURL))
	}
	if n > 0 {
		return "", nil
	}
	return fmt.Sprintf("the Redis stream %q does not exist at %s: nothing was dead-lettered to it yet, or the key (or the URL's database) is wrong",
		b.streamKey, redact.URL(b.redisURL)), nil
}

// filterFlags select messages.
type filterFlags struct {
	consumer string
	classes  string
	ids      string
	sources  string
	since    string
	until    string
	limit    int
}

func (f *filterFlags) register(fs *flag.FlagSet) {
	fs.StringVar(&f.consumer, "consumer", "", "only messages dead-lettered by this consumer")
	fs.StringVar(&f.classes, "class", "", "only these error classes, comma-separated (retryable-exhausted, permanent, panic, missing-id, fingerprint-mismatch, too-large, timeout, broker)")
	fs.StringVar(&f.ids, "id", "", "only these message ids, comma-separated")
	fs.StringVar(&f.sources, "source", "", "only messages from these original queues or topics, comma-separated")
	fs.StringVar(&f.since, "since", "", "only messages whose last failure is at or after this time (RFC 3339, or a duration ago such as 24h)")
	fs.StringVar(&f.until, "until", "", "only messages whose last failure is before this time (RFC 3339, or a duration ago)")
	fs.IntVar(&f.limit, "limit", 0, "handle at most this many messages (0: all)")
}

var knownClasses = map[consumer.FailureClass]bool{
	consumer.ClassRetryableExhausted: true, consumer.ClassPermanent: true, consumer.ClassPanic: true,
	consumer.ClassMissingID: true, consumer.ClassFingerprintMismatch: true, consumer.ClassTooLarge: true, consumer.ClassTimeout: true,
	consumer.ClassBroker: true,
}

func (f *filterFlags) filter(now time.Time) (dlq.Filter, error) {
	out := dlq.Filter{Consumer: f.consumer, MessageIDs: splitList(f.ids), Sources: splitList(f.sources)}
	for _, c := range splitList(f.classes) {
		if !knownClasses[consumer.FailureClass(c)] {
			return out, usagef("--class %q is not an error class", c)
		}
		out.Classes = append(out.Classes, consumer.FailureClass(c))
	}
	var err error
	if out.Since, err = parseWhen("--since", f.since, now); err != nil {
		return out, err
	}
	if out.Until, err = parseWhen("--until", f.until, now); err != nil {
		return out, err
	}
	if f.limit < 0 {
		return out, usagef("--limit %d: must not be negative", f.limit)
	}
	return out, nil
}

func splitList(s string) []string {
	var out []string
	for _, p := range strings.Split(s, ",") {
		if p = strings.TrimSpace(p); p != "" {
			out = append(out, p)
		}
	}
	return out
}

// parseWhen reads an RFC 3339 time or a duration before now.
func parseWhen(name, s string, now time.Time) (time.Time, error) {
	if s == "" {
		return time.Time{}, nil
	}
	if t, err := time.Parse(time.RFC3339Nano, s); err == nil {
		return t, nil
	}
	if d, err := parseAge(s); err == nil {
		return now.Add(-d), nil
	}
	return time.Time{}, usagef("%s %q: want an RFC 3339 time or a duration such as 24h or 7d", name, s)
}

// parseAge parses a Go duration, or a number of days such as "7d".
func parseAge(s string) (time.Duration, error) {
	var f durationFlag
	err := f.Set(s)
	return f.d, err
}

// keyFileFlag is the --verify-key-file flag's help.
const keyFileFlag = "check envelope signatures against the key in each of these files, comma-separated (current key first)"

// readKeyFiles reads the comma-separated --verify-key-file list.
func readKeyFiles(list string) ([][]byte, error) {
	var keys [][]byte
	for _, f := range strings.Split(list, ",") {
		if f = strings.TrimSpace(f); f == "" {
			continue
		}
		k, err := dlq.ReadKeyFile(f)
		if err != nil {
			return nil, usagef("--verify-key-file: %v", err)
		}
		keys = append(keys, k)
	}
	return keys, nil
}

func runDLQInspect(ctx context.Context, e *env, c *command, args []string) error {
	var (
		bf       brokerFlags
		ff       filterFlags
		asJSON   bool
		keyFiles string
	)
	fs := c.flagSet()
	bf.register(fs)
	ff.register(fs)
	fs.BoolVar(&asJSON, "json", false, "print the report as JSON")
	fs.StringVar(&keyFiles, "verify-key-file", "", keyFileFlag+"; count the messages none verifies")
	if _, err := c.parse(e, fs, args, 0); err != nil {
		return err
	}
	keys, err := readKeyFiles(keyFiles)
	if err != nil {
		return err
	}
	if err := bf.validate(e); err != nil {
		return err
	}
	filter, err := ff.filter(time.Now())
	if err != nil {
		return err
	}
	conn, err := bf.open(ctx, false)
	if err != nil {
		return err
	}
	defer conn.close()
	conn.sayNote(e)
	rep, err := dlq.Inspect(ctx, conn.browser, filter, ff.limit, keys...)
	if err != nil {
		return err
	}
	if asJSON {
		enc := json.NewEncoder(e.stdout)
		enc.SetIndent("", "  ")
		enc.SetEscapeHTML(false) // error texts and patterns hold <, > and &
		return enc.Encode(rep)
	}
	fmt.Fprintf(e.stdout, "%d dead-lettered messages in %d groups", rep.Total, len(rep.Groups))
	if rep.Malformed > 0 {
		fmt.Fprintf(e.stdout, " (%d with an unreadable envelope)", rep.Malformed)
	}
	if len(keys) > 0 {
		fmt.Fprintf(e.stdout, "; %d unverified (not signed with a given key)", rep.Unverified)
	}
	if rep.Truncated > 0 {
		fmt.Fprintf(e.stdout, "; %d truncated to fit the broker (%s)", rep.Truncated, truncatedNote)
	}
	fmt.Fprintln(e.stdout)
	if len(rep.Groups) == 0 {
		return nil
	}
	// One row per group: the shape of its error texts, and below it, if
	// they differ, one sample text.
	tw := tabwriter.NewWriter(e.stdout, 2, 8, 2, ' ', 0)
	fmt.Fprintln(tw, "\nCOUNT\tCLASS\tCONSUMER\tSOURCE\tFIRST SEEN\tLAST SEEN\tERROR")
	for _, g := range rep.Groups {
		fmt.Fprintf(tw, "%d\t%s\t%s\t%s\t%s\t%s\t%s\n", g.Count, orDash(string(g.Class)), orDash(strings.Join(g.Consumers, ",")),
			orDash(strings.Join(g.Sources, ",")), when(g.FirstSeen), when(g.LastSeen), orDash(oneLine(g.Pattern, 160)))
		if sample := oneLine(g.Error, 160); sample != oneLine(g.Pattern, 160) {
			fmt.Fprintf(tw, "\t\t\t\t\t\te.g. %s\n", sample)
		}
		if g.Truncated > 0 {
			fmt.Fprintf(tw, "\t\t\t\t\t\t%d of them truncated to fit the broker\n", g.Truncated)
		}
	}
	return tw.Flush()
}

func when(t time.Time) string {
	if t.IsZero() {
		return "-"
	}
	return t.UTC().Format(time.RFC3339)
}

// oneLine puts s on one line of at most about n bytes. A longer text loses
// its middle, not its end: a wrapped error ends with its cause (a SQLSTATE,
// say).
func oneLine(s string, n int) string {
	s = strings.Join(strings.Fields(s), " ")
	if len(s) <= n {
		return s
	}
	head, tail := 2*n/3, len(s)-(n-2*n/3-1)
	for head > 0 && !utf8.RuneStart(s[head]) {
		head--
	}
	for tail < len(s) && !utf8.RuneStart(s[tail]) {
		tail++
	}
	return s[:head] + "…" + s[tail:]
}

func runDLQReplay(ctx context.Context, e *env, c *command, args []string) error {
	var (
		bf          brokerFlags
		ff          filterFlags
		db          dbFlags
		dryRun      bool
		force       bool
		asJSON      bool
		rate        float64
		retention   string
		destination string
		keyFiles    string
	)
	fs := c.flagSet()
	bf.register(fs)
	ff.register(fs)
	db.register(fs)
	fs.BoolVar(&dryRun, "dry-run", false, "classify every selected message against the dedup table; consume nothing")
	fs.BoolVar(&force, "force", false, "also replay messages beyond the --retention horizon")
	fs.BoolVar(&asJSON, "json", false, "print the result as JSON")
	fs.Float64Var(&rate, "rate", 0, "republish at most this many messages per second (0: no limit)")
	fs.StringVar(&retention, "retention", "", "the dedup table's retention window (e.g. 72h or 7d); older messages need --force")
	fs.StringVar(&destination, "destination", "", "republish to this queue, topic, subject or stream instead of each message's original source")
	fs.StringVar(&keyFiles, "verify-key-file", "", keyFileFlag+"; replay only those one verifies, leave the rest in the DLQ")
	var shardURLs listOfFlag
	fs.Var(&shardURLs, "shard-url", "a shard of a sharded dedup store (processed.Sharded): repeat it for each, instead of --database-url; originals are looked up on every shard")
	if _, err := c.parse(e, fs, args, 0); err != nil {
		return err
	}
	if len(shardURLs) > 0 && db.url != "" {
		return usagef("--shard-url and --database-url: give the shards' URLs, or the one database's")
	}
	keys, err := readKeyFiles(keyFiles)
	if err != nil {
		return err
	}
	if err := bf.validate(e); err != nil {
		return err
	}
	filter, err := ff.filter(time.Now())
	if err != nil {
		return err
	}
	if rate < 0 {
		return usagef("--rate %g: must not be negative", rate)
	}
	var keep time.Duration
	if retention != "" {
		if keep, err = parseAge(retention); err != nil || keep <= 0 {
			return usagef("--retention %q: want a positive duration such as 72h or 7d", retention)
		}
	} else if !asJSON {
		fmt.Fprintln(e.stderr, "idemq: no --retention given: the replay-horizon guard is off")
	}
	store, closeStore, err := lookupStore(ctx, e, db, shardURLs)
	if err != nil {
		return err
	}
	defer closeStore()
	conn, err := bf.open(ctx, !dryRun)
	if err != nil {
		return err
	}
	defer conn.close()
	conn.sayNote(e)
	prog := newProgress(e.stderr)

	if dryRun {
		cl, err := dlq.Classify(ctx, dlq.ClassifyConfig{Browser: conn.browser, Store: store, Consumer: ff.consumer,
			Filter: filter, Limit: ff.limit, Retention: keep, VerifyKeys: keys,
			Progress: func(c dlq.Classification) { prog.update("classified %d (scanned %d)", len(c.Items), c.Scanned) }})
		prog.done()
		if err != nil {
			return store.hint(err)
		}
		if asJSON {
			enc := json.NewEncoder(e.stdout)
			enc.SetIndent("", "  ")
			enc.SetEscapeHTML(false) // error texts hold <, > and &
			return enc.Encode(cl)
		}
		tw := tabwriter.NewWriter(e.stdout, 2, 8, 2, ' ', 0)
		// The last column says why a message is beyond the horizon, or
		// "-" if it is not.
		fmt.Fprintln(tw, "MESSAGE ID\tCONSUMER\tCLASS\tVERDICT\tAPPLIED AT\tBEYOND HORIZON")
		for _, it := range cl.Items {
			horizon := "-"
			if it.BeyondHorizon {
				horizon = "yes: " + it.HorizonReason
			}
			fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\n", orDash(it.Record.MessageID), it.Record.Consumer, it.Record.Class,
				it.Verdict, when(it.AppliedAt), horizon)
		}
		_ = tw.Flush()
		unverified := ""
		if len(keys) > 0 {
			unverified = fmt.Sprintf(", %d unverified (not signed with a given key)", cl.Unverified)
		}
		truncated := ""
		if cl.Truncated > 0 {
			truncated = fmt.Sprintf(", %d truncated (%s)", cl.Truncated, truncatedNote)
		}
		fmt.Fprintf(e.stdout, "\ndry run: scanned %d, selected %d: %d will apply, %d already applied, %d fingerprint mismatch, %d missing id%s%s; %d beyond the retention horizon. Nothing was consumed.\n",
			cl.Scanned, len(cl.Items), cl.WillApply, cl.AlreadyApplied, cl.Mismatch, cl.MissingID, unverified, truncated, cl.BeyondHorizon)
		return nil
	}

	res, err := dlq.Requeue(ctx, dlq.RequeueConfig{Browser: conn.browser, Publish: conn.publish, Destination: destination,
		Store: store, Consumer: ff.consumer, Filter: filter, Limit: ff.limit, Rate: rate, Retention: keep, Force: force,
		VerifyKeys: keys,
		Progress: func(r dlq.RequeueResult) {
			prog.update("scanned %d · republished %d · skipped %d · mismatched %d", r.Scanned, r.Republished, r.Skipped, r.Mismatched)
		}})
	prog.done()
	if asJSON {
		enc := json.NewEncoder(e.stdout)
		enc.SetIndent("", "  ")
		enc.SetEscapeHTML(false) // error texts hold <, > and &
		if jerr := enc.Encode(res); jerr != nil {
			return jerr
		}
	} else {
		fmt.Fprintf(e.stdout, "replay: scanned %d; republished %d (the consumer applies them once); skipped %d already applied; left %d fingerprint mismatches, %d without an id and %d beyond the retention horizon in the DLQ",
			res.Scanned, res.Republished, res.Skipped, res.Mismatched, res.MissingID, res.BeyondHorizon)
		if res.Malformed > 0 {
			fmt.Fprintf(e.stdout, "; %d with an unreadable envelope", res.Malformed)
		}
		if res.Unverified > 0 {
			fmt.Fprintf(e.stdout, "; %d unverified (not signed with a given key)", res.Unverified)
		}
		if res.Truncated > 0 {
			fmt.Fprintf(e.stdout, "; left %d truncated", res.Truncated)
		}
		fmt.Fprintln(e.stdout)
	}
	if res.Truncated > 0 {
		fmt.Fprintf(e.stderr, "idemq: %d truncated dead letters were left in place: each was cut to fit the broker, so its body is not the original's. "+
			"Its envelope holds the original's size and sha256 (%s, %s) and, where the broker keeps them, its source and offset (%s, %s): "+
			"republish the original from there, and delete the dead letter by hand\n",
			res.Truncated, dlq.HeaderOriginalSize, dlq.HeaderOriginalSHA256, "x-idemq-source", "x-idemq-offset")
	}
	if err != nil {
		return store.hint(err)
	}
	if res.BeyondHorizon > 0 && !force {
		fmt.Fprintf(e.stderr, "idemq: %d messages are older than --retention %s and were left in place; replay them with --force once you are sure their dedup rows were not purged\n", res.BeyondHorizon, retention)
	}
	return nil
}

// truncatedNote says what a truncated dead letter is, after its count.
const truncatedNote = "their body is not whole: replay leaves them"

// sayNote writes the DLQ's note, if any, to stderr: stdout stays the
// report (JSON with --json).
func (c *dlqConn) sayNote(e *env) {
	if c.note != "" {
		fmt.Fprintln(e.stderr, "idemq: "+c.note)
	}
}

func orDash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}

// progress draws one updating status line on a terminal, and nothing
// otherwise.
type progress struct {
	w    io.Writer
	tty  bool
	last time.Time
	used bool
}

func newProgress(w io.Writer) *progress {
	p := &progress{w: w}
	if f, ok := w.(*os.File); ok {
		if st, err := f.Stat(); err == nil && st.Mode()&os.ModeCharDevice != 0 {
			p.tty = true
		}
	}
	return p
}

func (p *progress) update(format string, args ...any) {
	if !p.tty || time.Since(p.last) < 100*time.Millisecond {
		return
	}
	p.last = time.Now()
	p.used = true
	fmt.Fprintf(p.w, "\r\033[K"+format, args...)
}

func (p *progress) done() {
	if p.used {
		fmt.Fprint(p.w, "\r\033[K")
	}
}

// dlqStore is where dlq replay looks originals up: one database's store,
// or every shard of a sharded one.
type dlqStore struct {
	rowLookuper
	first *processed.Store // for the hint of a table not migrated
}

// rowLookuper looks a message's dedup row up.
type rowLookuper interface {
	Lookup(ctx context.Context, consumerName, id string) (processed.Row, error)
}

func (d dlqStore) hint(err error) error { return hint(err, d.first) }

// LookupMessage finds the row of msg, a dead letter restored as its
// consumer saw it: by its own shard key on shards that keep the key in
// their primary key (processed.Sharded.LookupMessage), where another key's
// row of the same id is not msg's; by its id otherwise. Package dlq asks
// for it; without it a dead letter was taken for another key's applied
// message and dropped.
func (d dlqStore) LookupMessage(ctx context.Context, consumerName, id string, msg *consumer.Message) (processed.Row, error) {
	if ml, ok := d.rowLookuper.(interface {
		LookupMessage(context.Context, string, string, *consumer.Message) (processed.Row, error)
	}); ok {
		return ml.LookupMessage(ctx, consumerName, id, msg)
	}
	return d.Lookup(ctx, consumerName, id)
}

// lookupStore opens the dedup store of the flags, or with shardURLs the
// shards' (a processed.Sharded, whose Lookup asks each in turn), and the
// function that closes it.
func lookupStore(ctx context.Context, e *env, db dbFlags, shardURLs []string) (dlqStore, func(), error) {
	if len(shardURLs) == 0 {
		store, conn, err := db.openStore(ctx, e, 0, 0, 0)
		if err != nil {
			return dlqStore{}, nil, err
		}
		return dlqStore{store, store}, func() { closeConn(conn) }, nil
	}
	var (
		stores []*processed.Store
		conns  []*pgx.Conn
	)
	closeAll := func() {
		for _, c := range conns {
			closeConn(c)
		}
	}
	for i, u := range shardURLs {
		sd := db
		sd.url = u
		store, conn, err := sd.openStore(ctx, e, 0, 0, 0)
		if err != nil {
			closeAll()
			return dlqStore{}, nil, fmt.Errorf("shard %d: %w", i, err)
		}
		stores, conns = append(stores, store), append(conns, conn)
	}
	// The default map, of the shards' count: Lookup asks every shard,
	// and LookupMessage (on shards keyed by shard key) the message's key,
	// Message.Key. A consumer whose map computes another key (ShardMap.Key)
	// finds its applied dead letters not found, so republished, and the
	// consumer skips them as duplicates.
	sharded, err := processed.NewSharded(stores, processed.ShardedConfig{Map: processed.ShardMap{Shards: len(stores)}})
	if err != nil {
		closeAll()
		return dlqStore{}, nil, err
	}
	return dlqStore{sharded, stores[0]}, closeAll, nil
}
