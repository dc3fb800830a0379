package main

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"maps"
	"slices"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/jackc/pgx/v5"
	kafkago "github.com/segmentio/kafka-go"

	"github.com/idemq/idemq/brokers/rabbitmq"
	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/dlq"
	"github.com/idemq/idemq/internal/redact"
	"github.com/idemq/idemq/processed"
)

var statusCommand = &command{
	name:    "status",
	args:    "--consumer <name>",
	summary: "show a consumer's dedup table, purge backlog, DLQ depth by class and last applied message",
	help: `Shows, for one consumer: the number of its rows in the dedup table and the
age of the oldest, how many of them are older than --retention, the last
message it applied, and the depth of its dead-letter queues.

It also shows what an ack rests on: on how many servers a commit is when
its COMMIT returns, which is when the runtime acks (this one, and the
synchronous standbys that synchronous_standby_names makes a COMMIT wait
for), and the standbys that stream asynchronously, to which a failover can
lose acked messages. The standbys' sync_state is visible to superusers and
members of pg_read_all_stats only.

It also shows the dedup table's layout. On the partitioned layout (see
'idemq migrate'), it lists the generations, the current one first: each
one's table, when it became current and when the next one did, and the
planner's estimate of its rows; and, when the oldest is held back from
retirement, the consumers that hold it (those with rows in it whose purge
horizon is not past its end). Rows older than --retention go only with
their generation, so they may stay longer there. On a plain table, a purge
deletes them in batches.

The DLQ depth is read from RabbitMQ with a passive queue declare (ready
messages; messages being browsed or replayed are not counted) when
--dlq-queue is given, and from Kafka as the records retained in the topic
(the sum over partitions of the high minus the low watermark) when
--dlq-topic is given. For NATS JetStream (--dlq-subject, repeatable) it is
the number of messages the stream holds on that subject, with the time the
oldest was stored; for Redis Streams (--dlq-stream-key, repeatable) the
stream's length (XLEN), with the time of the oldest entry; a stream key that
does not exist yet has depth 0. A DLQ shared by several consumers is counted
whole.
Every count scans the consumer's rows: it is meant for operators, not for
frequent polling (use the Prometheus metrics for that).

Each DLQ's line also counts its dead letters by failure class. It reads the
first --dlq-count-limit (1000) of them as 'idemq dlq inspect' does,
consuming none (RabbitMQ: fetched and then given back in place; Kafka: read
without a consumer group; NATS JetStream: an ordered consumer; Redis
Streams: XRANGE). Those RabbitMQ dead-lettered itself (a quorum queue's
delivery limit, a TTL, a length limit: x-death headers, no idemq envelope)
count apart, as "broker-dead-lettered (no idemq envelope)": they may never
have been applied. Messages with no envelope at all count as "no envelope".
When the bound cuts the count short, the line says so ("counted 1000 of
5234"). --json gives classes (the count of each class: "broker" for the
broker's, "none" for no envelope), counted, count_limit and
count_truncated. A count that fails is said on the line, after the depth,
and does not make status fail; --dlq-count-limit 0 reads nothing.

On a RabbitMQ quorum queue, before RabbitMQ 4.3, every read of a message
counts as a delivery toward the queue's x-delivery-limit (20 by default
from 4.0), at which the broker drops or dead-letters it; 'idemq dlq
inspect' and the console read the same way. When the dead letters read
carry x-delivery-count, as a quorum queue's do, the line warns: give such a
DLQ --dlq-count-limit 0.

For a dedup store sharded across databases (processed.Sharded), give each
shard's URL with --shard-url, in shard order, instead of --database-url:
status then shows each shard's report, headed by the map the shard records
(its number, the map, and a reshard under way), and the totals over the
shards; the DLQs are shown once.

Exits 1 if the database or a DLQ's depth cannot be read.

Examples:
  idemq status --consumer ledger --retention 7d
  idemq status --consumer ledger --dlq-queue payments.dlq --json
  idemq status --consumer ledger --dlq-queue payments.dlq --dlq-count-limit 10000
  idemq status --consumer ledger --kafka-brokers 127.0.0.1:9092 --dlq-topic payments.dlq
  idemq status --consumer ledger --nats-url nats://127.0.0.1:4222 --dlq-subject payments.dlq
  idemq status --consumer ledger --redis-url redis://127.0.0.1:6379/0 --dlq-stream-key payments.dlq
  idemq status --consumer ledger --shard-url postgres://db0/ledger --shard-url postgres://db1/ledger`,
	run: runStatus,
}

// statusTimeout bounds each broker query.
const statusTimeout = 15 * time.Second

// statusReport is what status prints; it is also the --json form.
type statusReport struct {
	Consumer  string    `json:"consumer"`
	Table     string    `json:"table"`
	CheckedAt time.Time `json:"checked_at"`
	// Rows counts the consumer's rows, TableRows every consumer's.
	Rows      int64 `json:"rows"`
	TableRows int64 `json:"table_rows"`
	// OldestProcessedAt is the consumer's oldest row; nil without rows.
	OldestProcessedAt *time.Time `json:"oldest_processed_at"`
	OldestAgeSeconds  *float64   `json:"oldest_age_seconds"`
	// Retention and the purge counts are set only with --retention.
	Retention          string `json:"retention,omitempty"`
	RetentionSeconds   *int64 `json:"retention_seconds,omitempty"`
	PurgeEligible      *int64 `json:"purge_eligible"`
	PurgeEligibleTable *int64 `json:"purge_eligible_table"`
	// LastApplied is the consumer's newest row; nil without rows.
	LastApplied *statusLast `json:"last_applied"`
	DLQ         []statusDLQ `json:"dlq"`
	// Partitioned says whether the dedup table has the partitioned
	// layout (processed.Config.Partitioned); Generations then describes
	// its generations, the current one first (omitted for a plain table).
	Partitioned bool               `json:"partitioned"`
	Generations []statusGeneration `json:"generations,omitempty"`
	// Evidence sums the janitor's reports of the last statusEvidenceWindow;
	// nil when there are none (no janitor ran, or before migration 2).
	Evidence *statusEvidence `json:"retention_evidence"`
	// Durability is what an ack rests on, as the database reports it.
	Durability statusDurability `json:"durability"`
}

// statusDurability is dedup.Durability, read by processed.Store's
// Durability: how many servers hold a commit when its COMMIT returns,
// which is when the runtime acks.
type statusDurability struct {
	// Nodes counts this server and the synchronous standbys a COMMIT
	// waits for; 0 on a standby.
	Nodes                   int    `json:"nodes"`
	Standby                 bool   `json:"standby"`
	SynchronousCommit       string `json:"synchronous_commit"`
	SynchronousStandbyNames string `json:"synchronous_standby_names"`
	Quorum                  bool   `json:"quorum"`
	// The physical standbys streaming from the server, by sync_state;
	// Unknown counts those whose sync_state the role may not read.
	Synchronous  []string `json:"synchronous_standbys"`
	Asynchronous []string `json:"asynchronous_standbys"`
	Unknown      int      `json:"unknown_standbys"`
	// Summary is the line the text form prints.
	Summary string `json:"summary"`
}

// statusEvidenceWindow is how far back status reads the janitor's reports.
const statusEvidenceWindow = 7 * 24 * time.Hour

// statusEvidence is the retention's evidence: the ages of the duplicates
// the runtime skipped, and the janitor's horizon and purges.
type statusEvidence struct {
	Since      time.Time `json:"since"`
	Reports    int       `json:"reports"`
	Duplicates int64     `json:"duplicates"`
	// Ages in seconds; quantiles rounded up to the histogram's buckets.
	P50Seconds  float64 `json:"p50_seconds"`
	P99Seconds  float64 `json:"p99_seconds"`
	P999Seconds float64 `json:"p999_seconds"`
	MaxSeconds  float64 `json:"max_seconds"`
	// RetentionSeconds is the retention judged: --retention, else the
	// janitor's latest.
	RetentionSeconds float64 `json:"retention_seconds"`
	// Verdict is "covered", "thin" (less than twice the oldest duplicate),
	// "not covered" or "no duplicates".
	Verdict string `json:"verdict"`
	// The janitor's latest round: the source's horizon, what it did to
	// the purge, and the age it purged by (0: no purge).
	LastReport             time.Time  `json:"last_report"`
	HorizonState           string     `json:"horizon_state"`
	Horizon                *time.Time `json:"horizon,omitempty"`
	PurgedOlderThanSeconds float64    `json:"purged_older_than_seconds"`
}

// statusGeneration is one generation of the partitioned layout
// (processed.Generation).
type statusGeneration struct {
	// Table is the generation's table, without its schema.
	Table string `json:"table"`
	// Current is true for the current generation, the first: claims
	// insert into it.
	Current bool `json:"current"`
	// BeganAt is when it became current: nil if before the layout did
	// (the rows of the plain table it was converted from). EndedAt is
	// when the next one did: nil for the current one, and for one that
	// ended before the layout began.
	BeganAt *time.Time `json:"began_at"`
	EndedAt *time.Time `json:"ended_at"`
	// EstimatedRows is the planner's estimate of its rows: nil if it has
	// none yet (the table was never analyzed).
	EstimatedRows *int64 `json:"estimated_rows"`
	// HeldBy, for the oldest, names the consumers with rows in it whose
	// purge horizon is not past its end: they keep it from being retired.
	HeldBy []string `json:"held_by,omitempty"`
}

// statusLast is the consumer's last applied message.
type statusLast struct {
	MessageID   string    `json:"message_id"`
	ProcessedAt time.Time `json:"processed_at"`
	AgeSeconds  float64   `json:"age_seconds"`
	Source      string    `json:"source"`
	Partition   *int32    `json:"partition"`
	Offset      *int64    `json:"offset"`
}

// statusDLQ is the depth of one dead-letter queue.
type statusDLQ struct {
	Broker string `json:"broker"`
	Name   string `json:"name"`
	// Depth is nil when it could not be read; Error says why.
	Depth      *int64 `json:"depth"`
	Partitions int    `json:"partitions,omitempty"`
	// Stream is the NATS stream that stores the subject.
	Stream string `json:"stream,omitempty"`
	// Oldest is when the oldest dead letter (NATS, Redis) was stored;
	// nil when there is none, or for RabbitMQ and Kafka.
	Oldest *time.Time `json:"oldest_at,omitempty"`
	Error  string     `json:"error,omitempty"`

	// Classes counts the dead letters read, by failure class
	// (consumer.FailureClass): "broker" for those the broker dead-lettered
	// itself (RabbitMQ's x-death headers, no idemq envelope), "none" for
	// those with neither. Nil when none were read: the depth is unknown,
	// CountLimit is 0 (--dlq-count-limit 0), or reading failed
	// (CountError); empty for an empty DLQ.
	Classes map[string]int `json:"classes"`
	// Malformed counts the dead letters read whose idemq envelope is
	// unreadable: in Counted, in no class.
	Malformed int `json:"malformed,omitempty"`
	// Counted is how many dead letters were read, the first CountLimit at
	// most (--dlq-count-limit); CountTruncated says the bound cut counting
	// short: Depth is more than Counted.
	Counted        int  `json:"counted"`
	CountLimit     int  `json:"count_limit"`
	CountTruncated bool `json:"count_truncated"`
	// XDeliveryCount says the dead letters read carry x-delivery-count, as
	// a RabbitMQ quorum queue's do: before RabbitMQ 4.3 every read counts
	// a delivery toward the queue's x-delivery-limit (see the help).
	XDeliveryCount bool `json:"x_delivery_count,omitempty"`
	// CountError says why the dead letters could not be counted; Depth
	// stays, and status does not fail for it.
	CountError string `json:"count_error,omitempty"`
}

func runStatus(ctx context.Context, e *env, c *command, args []string) error {
	var (
		db           dbFlags
		name         string
		asJSON       bool
		retention    durationFlag
		amqpURL      string
		dlqQueue     string
		kafkaBrokers string
		dlqTopic     string
		streams      streamDLQFlags
		countLimit   int
	)
	fs := c.flagSet()
	db.register(fs)
	fs.StringVar(&name, "consumer", "", "the consumer's name (required)")
	fs.BoolVar(&asJSON, "json", false, "print the status as JSON")
	fs.Var(&retention, "retention", "count the rows a purge would delete with this retention: a `duration` such as 72h or 7d")
	fs.StringVar(&amqpURL, "amqp-url", "", "RabbitMQ URL for --dlq-queue (default $AMQP_URL, then "+rabbitmq.DefaultURL+")")
	fs.StringVar(&dlqQueue, "dlq-queue", "", "RabbitMQ dead-letter queue whose depth to show")
	fs.StringVar(&kafkaBrokers, "kafka-brokers", "", "Kafka bootstrap brokers for --dlq-topic, comma-separated (default $KAFKA_BROKERS)")
	fs.StringVar(&dlqTopic, "dlq-topic", "", "Kafka dead-letter topic whose depth to show")
	streams.register(fs, "whose depth and oldest dead letter to show", false)
	fs.IntVar(&countLimit, "dlq-count-limit", statusCountLimit, "read at most this many dead letters of each DLQ, consuming none, to count them by class (0: read none)")
	var shardURLs listOfFlag
	fs.Var(&shardURLs, "shard-url", "a shard of a sharded dedup store (processed.Sharded), in shard order: repeat it for each; the status is then shown per shard, with the totals (instead of --database-url)")
	if _, err := c.parse(e, fs, args, 0); err != nil {
		return err
	}
	if len(shardURLs) > 0 && db.url != "" {
		return usagef("--shard-url and --database-url: give the shards' URLs, or the one database's")
	}
	if name == "" {
		return usagef("--consumer is required")
	}
	if retention.set && retention.d <= 0 {
		return usagef("--retention must be positive, got %s", retention.d)
	}
	if countLimit < 0 {
		return usagef("--dlq-count-limit %d: must not be negative", countLimit)
	}
	if dlqQueue != "" && amqpURL == "" {
		if amqpURL = e.getenv("AMQP_URL"); amqpURL == "" {
			amqpURL = rabbitmq.DefaultURL
		}
	}
	var brokers []string
	if dlqTopic != "" {
		if kafkaBrokers == "" {
			kafkaBrokers = e.getenv("KAFKA_BROKERS")
		}
		if brokers = splitList(kafkaBrokers); len(brokers) == 0 {
			return usagef("--kafka-brokers (or $KAFKA_BROKERS) is required with --dlq-topic")
		}
	}
	streamDLQs, err := streams.resolve(e)
	if err != nil {
		return err
	}

	var (
		rep     *statusReport
		sharded *statusSharded
	)
	if len(shardURLs) > 0 {
		if sharded, err = statusShards(ctx, e, db, shardURLs, name, retention); err != nil {
			return err
		}
		rep = &statusReport{CheckedAt: sharded.CheckedAt, DLQ: []statusDLQ{}}
	} else {
		store, conn, err := db.openStore(ctx, e, 0, 0, 0)
		if err != nil {
			return err
		}
		defer closeConn(conn)
		if rep, err = statusFromDB(ctx, conn, store, name, retention); err != nil {
			return hint(err, store)
		}
	}

	// A DLQ whose depth cannot be read fails the command; one whose dead
	// letters cannot be counted says so on its line only.
	var dlqErr error
	add := func(what string, d statusDLQ, bf *brokerFlags) {
		if d.Error != "" {
			dlqErr = errors.Join(dlqErr, fmt.Errorf("%s %q: %s", what, d.Name, d.Error))
		}
		statusCountClasses(ctx, bf, &d, countLimit)
		rep.DLQ = append(rep.DLQ, d)
	}
	if dlqQueue != "" {
		add("RabbitMQ queue", statusRabbitDepth(ctx, amqpURL, dlqQueue), &brokerFlags{broker: "rabbitmq", amqpURL: amqpURL, queue: dlqQueue})
	}
	if dlqTopic != "" {
		add("Kafka topic", statusKafkaDepth(ctx, brokers, dlqTopic), &brokerFlags{broker: "kafka", kafkaBrokers: kafkaBrokers, topic: dlqTopic})
	}
	for _, b := range streamDLQs {
		add(streamDLQKind(b.broker), statusStreamDepth(ctx, b), b)
	}

	switch {
	case sharded != nil && asJSON:
		sharded.DLQ = rep.DLQ
		enc := json.NewEncoder(e.stdout)
		enc.SetIndent("", "  ")
		if err := enc.Encode(sharded); err != nil {
			return err
		}
	case sharded != nil:
		sharded.DLQ = rep.DLQ
		if err := sharded.print(e.stdout); err != nil {
			return err
		}
	case asJSON:
		enc := json.NewEncoder(e.stdout)
		enc.SetIndent("", "  ")
		if err := enc.Encode(rep); err != nil {
			return err
		}
	default:
		if err := rep.print(e.stdout); err != nil {
			return err
		}
	}
	if dlqErr != nil {
		return fmt.Errorf("cannot read the dead-letter queue depth: %w", dlqErr)
	}
	return nil
}

// statusFromDB fills in the dedup table's part of the report. Ages are
// measured by the database's clock, as Purge measures retention.
func statusFromDB(ctx context.Context, conn *pgx.Conn, store *processed.Store, name string, retention durationFlag) (*statusReport, error) {
	rep := &statusReport{Consumer: name, Table: store.String(), DLQ: []statusDLQ{}}
	st, err := store.Stats(ctx, name)
	if err != nil {
		return nil, err
	}
	all, err := store.Stats(ctx, "")
	if err != nil {
		return nil, err
	}
	rep.Rows, rep.TableRows = st.Rows, all.Rows
	if err := conn.QueryRow(ctx, "SELECT now()").Scan(&rep.CheckedAt); err != nil {
		return nil, fmt.Errorf("read the database clock: %w", err)
	}
	rep.CheckedAt = rep.CheckedAt.UTC()
	if !st.Oldest.IsZero() {
		oldest := st.Oldest.UTC()
		age := rep.CheckedAt.Sub(oldest).Seconds()
		rep.OldestProcessedAt, rep.OldestAgeSeconds = &oldest, &age
	}
	table := pgx.Identifier{store.Schema(), store.Table()}.Sanitize()

	if retention.set {
		var mine, total int64
		err := conn.QueryRow(ctx, `SELECT count(*) FILTER (WHERE consumer = $1), count(*) FROM `+table+`
WHERE processed_at < now() - $2::bigint * interval '1 microsecond'`, name, retention.d.Microseconds()).Scan(&mine, &total)
		if err != nil {
			return nil, fmt.Errorf("processed: count rows to purge on %s: %w", store, err)
		}
		secs := int64(retention.d / time.Second)
		rep.Retention, rep.RetentionSeconds = retention.d.String(), &secs
		rep.PurgeEligible, rep.PurgeEligibleTable = &mine, &total
	}

	gens, err := store.Generations(ctx)
	if err != nil {
		return nil, err
	}
	rep.Partitioned = gens != nil
	for i, g := range gens {
		sg := statusGeneration{Table: g.Table, Current: i == 0, BeganAt: utcOrNil(g.BeganAt), EndedAt: utcOrNil(g.EndedAt), HeldBy: g.HeldBy}
		if g.Rows >= 0 {
			rows := g.Rows
			sg.EstimatedRows = &rows
		}
		rep.Generations = append(rep.Generations, sg)
	}
	d, err := store.Durability(ctx)
	if err != nil {
		return nil, err
	}
	rep.Durability = statusDurability{Nodes: d.Nodes, Standby: d.Standby, SynchronousCommit: d.SynchronousCommit,
		SynchronousStandbyNames: d.SynchronousStandbyNames, Quorum: d.Quorum,
		Synchronous: nonNil(d.Synchronous), Asynchronous: nonNil(d.Asynchronous), Unknown: d.Unknown, Summary: d.String()}
	sum, err := store.Retention(ctx, name, rep.CheckedAt.Add(-statusEvidenceWindow))
	if err != nil {
		return nil, err
	}
	if sum.Reports > 0 {
		rep.Evidence = evidence(sum, retention)
	}

	var last statusLast
	err = conn.QueryRow(ctx, `SELECT message_id, processed_at, source, partition, "offset" FROM `+table+`
WHERE consumer = $1 ORDER BY processed_at DESC, message_id DESC LIMIT 1`, name).Scan(
		&last.MessageID, &last.ProcessedAt, &last.Source, &last.Partition, &last.Offset)
	switch {
	case errors.Is(err, pgx.ErrNoRows):
	case err != nil:
		return nil, fmt.Errorf("processed: read the last applied message on %s: %w", store, err)
	default:
		last.ProcessedAt = last.ProcessedAt.UTC()
		last.AgeSeconds = rep.CheckedAt.Sub(last.ProcessedAt).Seconds()
		rep.LastApplied = &last
	}
	return rep, nil
}

// nonNil returns s, or an empty slice for nil: [] in JSON, not null.
func nonNil(s []string) []string {
	if s == nil {
		return []string{}
	}
	return s
}

// utcOrNil returns t in UTC, or nil if it is zero.
func utcOrNil(t time.Time) *time.Time {
	if t.IsZero() {
		return nil
	}
	t = t.UTC()
	return &t
}

// generationTime renders when a generation began or ended, or ifZero when
// the time is zero (before the partitioned layout began, or not yet).
func generationTime(t time.Time, ifZero string) string {
	if t.IsZero() {
		return ifZero
	}
	return t.UTC().Format(time.RFC3339)
}

// evidence judges the retention (--retention, else the janitor's) against
// the duplicates' ages.
func evidence(sum processed.RetentionSummary, retention durationFlag) *statusEvidence {
	ev := &statusEvidence{Since: sum.From.UTC(), Reports: sum.Reports, Duplicates: sum.Duplicates,
		P50Seconds: sum.P50.Seconds(), P99Seconds: sum.P99.Seconds(), P999Seconds: sum.P999.Seconds(), MaxSeconds: sum.Max.Seconds(),
		LastReport: sum.LastReport.UTC(), HorizonState: sum.HorizonState, PurgedOlderThanSeconds: sum.PurgedOlderThan.Seconds()}
	if !sum.Horizon.IsZero() {
		h := sum.Horizon.UTC()
		ev.Horizon = &h
	}
	ret := sum.Retention
	if retention.set {
		ret = retention.d
	}
	ev.RetentionSeconds = ret.Seconds()
	switch worst := max(sum.P999, sum.Max); {
	case sum.Duplicates == 0:
		ev.Verdict = "no duplicates"
	case worst > ret:
		ev.Verdict = "not covered"
	case 2*worst > ret:
		ev.Verdict = "thin"
	default:
		ev.Verdict = "covered"
	}
	return ev
}

// statusRabbitDepth reads the number of ready messages in queue with a
// passive declare (which is what opening a Browser does).
func statusRabbitDepth(ctx context.Context, url, queue string) statusDLQ {
	d := statusDLQ{Broker: "rabbitmq", Name: queue}
	ctx, cancel := context.WithTimeout(ctx, statusTimeout)
	defer cancel()
	b, err := rabbitmq.NewBrowser(ctx, rabbitmq.BrowserConfig{URL: url, Queue: queue, ConnectionName: "idemq status", DialTimeout: statusTimeout})
	if err != nil {
		d.Error = err.Error()
		return d
	}
	depth := int64(b.Depth())
	d.Depth = &depth
	if err := b.Close(); err != nil {
		d.Error = err.Error()
	}
	return d
}

// statusKafkaDepth sums, over topic's partitions, the high watermark minus
// the low watermark: the records the topic retains.
func statusKafkaDepth(ctx context.Context, brokers []string, topic string) statusDLQ {
	d := statusDLQ{Broker: "kafka", Name: topic}
	ctx, cancel := context.WithTimeout(ctx, statusTimeout)
	defer cancel()
	transport := &kafkago.Transport{DialTimeout: statusTimeout}
	defer transport.CloseIdleConnections()
	client := &kafkago.Client{Addr: kafkago.TCP(brokers...), Transport: transport, Timeout: statusTimeout}
	md, err := client.Metadata(ctx, &kafkago.MetadataRequest{Topics: []string{topic}})
	if err != nil {
		d.Error = err.Error()
		return d
	}
	var reqs []kafkago.OffsetRequest
	for _, t := range md.Topics {
		if t.Name != topic {
			continue
		}
		if t.Error != nil {
			d.Error = t.Error.Error()
			return d
		}
		for _, p := range t.Partitions {
			reqs = append(reqs, kafkago.FirstOffsetOf(p.ID), kafkago.LastOffsetOf(p.ID))
		}
	}
	if len(reqs) == 0 {
		d.Error = "topic not found"
		return d
	}
	resp, err := client.ListOffsets(ctx, &kafkago.ListOffsetsRequest{Topics: map[string][]kafkago.OffsetRequest{topic: reqs}})
	if err != nil {
		d.Error = err.Error()
		return d
	}
	var depth int64
	parts := resp.Topics[topic]
	for _, p := range parts {
		if p.Error != nil {
			d.Error = fmt.Sprintf("partition %d: %v", p.Partition, p.Error)
			return d
		}
		depth += max(p.LastOffset-p.FirstOffset, 0)
	}
	if len(parts) != len(reqs)/2 {
		d.Error = fmt.Sprintf("offsets of %d partitions returned, want %d", len(parts), len(reqs)/2)
		return d
	}
	d.Depth, d.Partitions = &depth, len(parts)
	return d
}

// statusCountLimit is how many dead letters of each DLQ status reads by
// default to count them by class (--dlq-count-limit).
const statusCountLimit = 1000

// statusCountTimeout bounds reading one DLQ's dead letters to count them.
const statusCountTimeout = 30 * time.Second

// statusNoClass is the key in statusDLQ.Classes of the dead letters with
// neither an idemq envelope nor the broker's dead-lettering headers.
const statusNoClass = "none"

// statusCountClasses reads the first limit dead letters of the DLQ bf
// selects, whose depth d holds, as 'idemq dlq inspect' does (bf.open,
// dlq.Inspect): without consuming them. It counts them by class into d, or
// says in d.CountError why it could not. It reads nothing when the depth
// is unknown or 0, or limit is 0.
func statusCountClasses(ctx context.Context, bf *brokerFlags, d *statusDLQ, limit int) {
	d.CountLimit = limit
	if limit <= 0 || d.Depth == nil {
		return
	}
	if *d.Depth == 0 {
		d.Classes = map[string]int{}
		return
	}
	ctx, cancel := context.WithTimeout(ctx, statusCountTimeout)
	defer cancel()
	rep, b, err := func() (dlq.Report, *statusCountBrowser, error) {
		conn, err := bf.open(ctx, false)
		if err != nil {
			return dlq.Report{}, nil, err
		}
		defer conn.close()
		b := &statusCountBrowser{Browser: conn.browser, left: limit, rabbitmq: bf.broker == "rabbitmq"}
		rep, err := dlq.Inspect(ctx, b, dlq.Filter{}, 0)
		return rep, b, err
	}()
	if err != nil {
		d.CountError = redact.Error(err, bf.secrets()...).Error()
		return
	}
	d.Classes = map[string]int{}
	for _, g := range rep.Groups {
		key := string(g.Class)
		if key == "" {
			key = statusNoClass
		}
		d.Classes[key] += g.Count
	}
	d.Malformed, d.Counted = rep.Malformed, rep.Total+rep.Malformed
	d.CountTruncated = d.Counted >= limit && *d.Depth > int64(d.Counted)
	d.XDeliveryCount = b.xDeliveryCount
}

// secrets are the URLs of bf whose passwords must not be shown.
func (b *brokerFlags) secrets() []string {
	switch b.broker {
	case "rabbitmq":
		return []string{b.amqpURL}
	case "nats":
		return natsSecrets(b.natsURL)
	case "redis":
		return []string{b.redisURL}
	}
	return nil
}

// statusCountBrowser passes on the first left deliveries of a Browser,
// then io.EOF; on RabbitMQ it notes whether one carried x-delivery-count.
type statusCountBrowser struct {
	dlq.Browser
	left           int
	rabbitmq       bool
	xDeliveryCount bool
}

func (b *statusCountBrowser) Next(ctx context.Context) (consumer.Delivery, error) {
	if b.left <= 0 {
		return nil, io.EOF
	}
	d, err := b.Browser.Next(ctx)
	if err != nil {
		return nil, err
	}
	b.left--
	if _, ok := d.Message().Headers["x-delivery-count"]; ok && b.rabbitmq {
		b.xDeliveryCount = true
	}
	return d, nil
}

// classText is what the text form says, after a DLQ's depth, of its dead
// letters by class: the broker's first, then the most frequent.
func (d statusDLQ) classText() string {
	switch {
	case d.CountError != "":
		return "; not counted by class: " + d.CountError
	case d.Counted == 0:
		return ""
	}
	broker := string(consumer.ClassBroker)
	keys := slices.Collect(maps.Keys(d.Classes))
	slices.SortFunc(keys, func(a, b string) int {
		if (a == broker) != (b == broker) {
			if a == broker {
				return -1
			}
			return 1
		}
		return cmp.Or(cmp.Compare(d.Classes[b], d.Classes[a]), strings.Compare(a, b))
	})
	var parts []string
	for _, k := range keys {
		name := k
		switch k {
		case broker:
			name = "broker-dead-lettered (no idemq envelope)"
		case statusNoClass:
			name = "no envelope"
		}
		parts = append(parts, fmt.Sprintf("%s: %d", name, d.Classes[k]))
	}
	if d.Malformed > 0 {
		parts = append(parts, fmt.Sprintf("unreadable envelope: %d", d.Malformed))
	}
	head := "; by class: "
	if d.CountTruncated {
		head = fmt.Sprintf("; counted %d of %d (--dlq-count-limit), by class: ", d.Counted, *d.Depth)
	}
	s := head + strings.Join(parts, ", ")
	if d.XDeliveryCount {
		s += "; warning: they carry x-delivery-count, as a quorum queue's do: before RabbitMQ 4.3 every read counts toward its x-delivery-limit (give --dlq-count-limit 0)"
	}
	return s
}

// print writes the report as aligned text.
func (r *statusReport) print(w io.Writer) error {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	ago := func(t time.Time) string {
		return fmt.Sprintf("%s (%s ago)", t.Format(time.RFC3339), statusAge(r.CheckedAt.Sub(t)))
	}
	fmt.Fprintf(tw, "consumer:\t%s\n", r.Consumer)
	fmt.Fprintf(tw, "dedup table:\t%s\n", r.Table)
	fmt.Fprintf(tw, "dedup rows:\t%d (%d in the table, all consumers)\n", r.Rows, r.TableRows)
	oldest := "-"
	if r.OldestProcessedAt != nil {
		oldest = ago(*r.OldestProcessedAt)
	}
	fmt.Fprintf(tw, "oldest row:\t%s\n", oldest)
	if r.PurgeEligible != nil {
		fmt.Fprintf(tw, "purge eligible:\t%d rows older than %s (%d in the table)\n", *r.PurgeEligible, r.Retention, *r.PurgeEligibleTable)
	} else {
		fmt.Fprintf(tw, "purge eligible:\t- (give --retention)\n")
	}
	if l := r.LastApplied; l != nil {
		where := l.Source
		if l.Partition != nil && l.Offset != nil {
			where += fmt.Sprintf(" [%d] @%d", *l.Partition, *l.Offset)
		}
		if where == "" {
			where = "-"
		}
		fmt.Fprintf(tw, "last applied:\t%s at %s, from %s\n", l.MessageID, ago(l.ProcessedAt), where)
	} else {
		fmt.Fprintf(tw, "last applied:\tnone\n")
	}
	if r.Partitioned {
		fmt.Fprintf(tw, "layout:\tpartitioned: %d generations, current first; the oldest is retired once every consumer with rows in it has purged past its end\n", len(r.Generations))
		for i, g := range r.Generations {
			began := "before the layout began"
			if g.BeganAt != nil {
				began = ago(*g.BeganAt)
			}
			var span string
			switch {
			case g.Current:
				span = "current since " + began
			case g.EndedAt != nil:
				span = "from " + began + " to " + ago(*g.EndedAt)
			default:
				span = "ended before the layout began"
			}
			rows := "rows not estimated yet"
			if g.EstimatedRows != nil {
				rows = fmt.Sprintf("about %d rows", *g.EstimatedRows)
			}
			fmt.Fprintf(tw, "generation %d:\t%s: %s, %s\n", i, g.Table, span, rows)
			if len(g.HeldBy) > 0 {
				fmt.Fprintf(tw, "held by:\t%s (their purge horizons are not past its end)\n", quoteList(g.HeldBy))
			}
		}
	} else {
		fmt.Fprintf(tw, "layout:\tplain table (a purge deletes each consumer's old rows in batches)\n")
	}
	fmt.Fprintf(tw, "durability:\t%s\n", r.Durability.Summary)
	if ev := r.Evidence; ev != nil {
		secs := func(s float64) string { return statusAge(time.Duration(s * float64(time.Second))) }
		ret := secs(ev.RetentionSeconds)
		window := statusAge(r.CheckedAt.Sub(ev.Since))
		switch ev.Verdict {
		case "no duplicates":
			fmt.Fprintf(tw, "duplicates:\tnone in %s (%d janitor reports); retention %s: no evidence either way\n", window, ev.Reports, ret)
		default:
			fmt.Fprintf(tw, "duplicates:\t%d in %s; they arrive up to %s after the original (p99.9; p50 %s, p99 %s, max %s)\n",
				ev.Duplicates, window, secs(ev.P999Seconds), secs(ev.P50Seconds), secs(ev.P99Seconds), secs(ev.MaxSeconds))
			verdict := ev.Verdict
			switch ev.Verdict {
			case "thin":
				verdict = "covered, but the margin is thin (less than 2x the oldest duplicate): raise it"
			case "not covered":
				verdict = "NOT covered: duplicates older than the retention find no row and are applied again; raise it"
			}
			fmt.Fprintf(tw, "retention:\t%s: %s\n", ret, verdict)
		}
		h := ev.HorizonState
		switch ev.HorizonState {
		case "none":
			h = "the source gives none: purged by the retention alone"
		case "clear":
			h = "nothing redeliverable: purged by the retention"
		case "within":
			h = fmt.Sprintf("oldest redeliverable %s, within the retention", ago(*ev.Horizon))
		case "held":
			h = fmt.Sprintf("oldest redeliverable %s, older than the retention: purge held back to %s", ago(*ev.Horizon), secs(ev.PurgedOlderThanSeconds))
		case "unknown", "error":
			h = "the source could not tell: no purge"
		}
		fmt.Fprintf(tw, "purge horizon:\t%s (janitor %s ago)\n", h, statusAge(r.CheckedAt.Sub(ev.LastReport)))
	}
	r.dlqLines(tw)
	return tw.Flush()
}

// dlqLines writes the report's DLQ lines to tw, a tabwriter.
func (r *statusReport) dlqLines(tw io.Writer) {
	ago := func(t time.Time) string {
		return fmt.Sprintf("%s (%s ago)", t.Format(time.RFC3339), statusAge(r.CheckedAt.Sub(t)))
	}
	for _, d := range r.DLQ {
		var v string
		switch {
		case d.Depth == nil:
			v = "error: " + d.Error
		case d.Broker == "kafka":
			v = fmt.Sprintf("%d records in %d partitions", *d.Depth, d.Partitions)
		case d.Broker == "nats":
			v = fmt.Sprintf("%d messages in stream %s", *d.Depth, d.Stream)
		case d.Broker == "redis":
			v = fmt.Sprintf("%d entries", *d.Depth)
		default:
			v = fmt.Sprintf("%d ready messages", *d.Depth)
		}
		if d.Oldest != nil {
			v += ", oldest " + ago(*d.Oldest)
		}
		fmt.Fprintf(tw, "dlq %s:\t%s: %s%s\n", d.Broker, d.Name, v, d.classText())
	}
}

// statusAge renders a duration coarsely: 42s, 3m12s, 5h3m, 12d4h.
func statusAge(d time.Duration) string {
	if d < 0 {
		d = 0
	}
	switch {
	case d < time.Hour:
		return d.Round(time.Second).String()
	case d < 48*time.Hour:
		return strings.TrimSuffix(d.Round(time.Minute).String(), "0s")
	}
	days := int64(d / (24 * time.Hour))
	hours := int64((d % (24 * time.Hour)) / time.Hour)
	return strconv.FormatInt(days, 10) + "d" + strconv.FormatInt(hours, 10) + "h"
}
