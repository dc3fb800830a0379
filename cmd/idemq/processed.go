package main

import (
	"context"
	"encoding/hex"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/idemq/idemq/processed"
)

var processedShowCommand = &command{
	name:    "processed show",
	args:    "<consumer> <id>",
	summary: "print the dedup record of one message id",
	help: `Prints the dedup record of message <id> for consumer <consumer>: when it was
processed, its payload fingerprint and where it came from. Exits 1 if there is
no such record (the message was never applied, or its record was purged).`,
	run: runProcessedShow,
}

var processedPurgeCommand = &command{
	name:    "processed purge",
	args:    "--older-than <duration> (--consumer <name> | --all-consumers)",
	summary: "purge old dedup records of one consumer, or of all",
	help: `Purges the dedup records processed more than --older-than ago of the consumer
--consumer names, and of no other; --all-consumers purges every consumer's
that has records instead, as if each were named in turn. One of the two is
required.

The purge first records the consumer's purge horizon (now minus
--older-than, by the database's clock) in <table>_horizons: a statement
that its records older than that may go. What happens then depends on the
table's layout (see 'idemq migrate'):

  plain table: the consumer's records older than the horizon are deleted
    in batches of --batch-size, each its own short statement, with at least
    --pause between two and no more than the --duty share of the time
    spent deleting, so that live consumers keep the database. It prints
    how many it deleted.
  partitioned layout: records go a generation at a time. The oldest
    generation is retired (truncated) only once every consumer with records
    in it has recorded a purge horizon past its end, so records may stay
    longer than --older-than: until the other consumers' purges, or their
    janitors', allow it. It prints whether it retired a generation (the
    count of its records is the planner's estimate) and, if the oldest is
    still held, by which consumers. --batch-size, --pause and --duty do not
    apply.

A message redelivered after its record is purged is applied again, so keep
records longer than any redelivery can lag.

Examples:
  idemq processed purge --consumer ledger --older-than 7d
  idemq processed purge --all-consumers --older-than 30d`,
	run: runProcessedPurge,
}

// jsonRecord is the --json form of a record.
type jsonRecord struct {
	Consumer    string    `json:"consumer"`
	MessageID   string    `json:"message_id"`
	Fingerprint string    `json:"fingerprint"`
	ProcessedAt time.Time `json:"processed_at"`
	Source      string    `json:"source"`
	Partition   *int32    `json:"partition"`
	Offset      *int64    `json:"offset"`
}

func runProcessedShow(ctx context.Context, e *env, c *command, args []string) error {
	var (
		db     dbFlags
		asJSON bool
	)
	fs := c.flagSet()
	db.register(fs)
	fs.BoolVar(&asJSON, "json", false, "print the record as JSON")
	pos, err := c.parse(e, fs, args, 2)
	if err != nil {
		return err
	}
	store, conn, err := db.openStore(ctx, e, 0, 0, 0)
	if err != nil {
		return err
	}
	defer closeConn(conn)

	r, err := store.Lookup(ctx, pos[0], pos[1])
	if errors.Is(err, processed.ErrNotFound) {
		return fmt.Errorf("not found: no record of message id %q for consumer %q in %s", pos[1], pos[0], store)
	}
	if err != nil {
		return hint(err, store)
	}
	if asJSON {
		enc := json.NewEncoder(e.stdout)
		enc.SetIndent("", "  ")
		return enc.Encode(jsonRecord{
			Consumer: r.Consumer, MessageID: r.MessageID, Fingerprint: hex.EncodeToString(r.Fingerprint),
			ProcessedAt: r.ProcessedAt.UTC(), Source: r.Source, Partition: r.Partition, Offset: r.Offset,
		})
	}
	orDash := func(p *int64) string {
		if p == nil {
			return "-"
		}
		return strconv.FormatInt(*p, 10)
	}
	var part *int64
	if r.Partition != nil {
		v := int64(*r.Partition)
		part = &v
	}
	fmt.Fprintf(e.stdout, "consumer:     %s\n", r.Consumer)
	fmt.Fprintf(e.stdout, "message id:   %s\n", r.MessageID)
	fmt.Fprintf(e.stdout, "fingerprint:  sha256:%s\n", hex.EncodeToString(r.Fingerprint))
	fmt.Fprintf(e.stdout, "processed at: %s (%s ago)\n", r.ProcessedAt.UTC().Format(time.RFC3339Nano), time.Since(r.ProcessedAt).Round(time.Second))
	fmt.Fprintf(e.stdout, "source:       %s\n", r.Source)
	fmt.Fprintf(e.stdout, "partition:    %s\n", orDash(part))
	fmt.Fprintf(e.stdout, "offset:       %s\n", orDash(r.Offset))
	return nil
}

func runProcessedPurge(ctx context.Context, e *env, c *command, args []string) error {
	var (
		db        dbFlags
		olderThan durationFlag
		name      string
		all       bool
		batch     int
		pause     time.Duration
		duty      float64
	)
	fs := c.flagSet()
	db.register(fs)
	fs.Var(&olderThan, "older-than", "purge records processed more than this long ago: a `duration` such as 72h, 90m or 7d (required)")
	fs.StringVar(&name, "consumer", "", "purge the records of this consumer, and of no other (or --all-consumers)")
	fs.BoolVar(&all, "all-consumers", false, "purge the records of every consumer that has records, each by --older-than (or --consumer)")
	fs.IntVar(&batch, "batch-size", 1000, "plain table: rows deleted per statement")
	fs.DurationVar(&pause, "pause", 10*time.Millisecond, "plain table: least pause between two batches, so live consumers keep the database; 0 for none")
	fs.Float64Var(&duty, "duty", 0.25, "plain table: largest share of the time spent deleting: after a batch that took d, wait at least d*(1-duty)/duty; 1 for no such wait (with --pause 0: flat out)")
	if _, err := c.parse(e, fs, args, 0); err != nil {
		return err
	}
	named := false
	fs.Visit(func(f *flag.Flag) { named = named || f.Name == "consumer" })
	switch {
	case named && all:
		return usagef("give either --consumer <name> or --all-consumers, not both")
	case named && name == "":
		return usagef("--consumer needs a consumer's name (or give --all-consumers)")
	case !named && !all:
		return usagef("say whose records to purge: --consumer <name> for one consumer's, or --all-consumers for every consumer's")
	}
	if !olderThan.set {
		return usagef("--older-than is required")
	}
	if olderThan.d <= 0 {
		return usagef("--older-than must be positive, got %s", olderThan.d)
	}
	if batch < 1 {
		return usagef("--batch-size must be positive, got %d", batch)
	}
	if pause < 0 {
		return usagef("--pause must not be negative, got %s", pause)
	}
	if pause == 0 {
		pause = -1 // processed.Config: no pause
	}
	if !(duty > 0 && duty <= 1) {
		return usagef("--duty must be in (0, 1], got %g", duty)
	}
	store, cfg, conn, err := db.open(ctx, e, processed.Config{PurgeBatchSize: batch, PurgePause: pause, PurgeDutyCycle: duty})
	if err != nil {
		return err
	}
	defer closeConn(conn)

	// whose names the records in the output, horizonOf the horizons
	// recorded.
	whose := fmt.Sprintf("of consumer %q", name)
	horizonOf := whose
	var n int64
	if all {
		whose, horizonOf = "of any consumer", "of every consumer with records"
		n, err = store.PurgeAll(ctx, olderThan.d)
	} else {
		n, err = store.Purge(ctx, name, olderThan.d)
	}
	if !cfg.Partitioned {
		if err != nil {
			if n > 0 {
				fmt.Fprintf(e.stdout, "deleted %d records %s from %s before the error\n", n, whose, store)
			}
			return hint(err, store)
		}
		fmt.Fprintf(e.stdout, "deleted %d records %s processed more than %s ago from %s (plain table)\n", n, whose, olderThan.d, store)
		return nil
	}
	if err != nil {
		if n > 0 {
			fmt.Fprintf(e.stdout, "retired about %d records from %s before the error\n", n, store)
		}
		return hint(err, store)
	}
	return printPurgedGenerations(ctx, e, store, horizonOf, olderThan.d, n)
}

// printPurgedGenerations reports a purge on the partitioned layout: the
// purge horizons it recorded (horizonOf says whose), the generation it
// retired (about retired rows), and who holds the oldest generation now.
func printPurgedGenerations(ctx context.Context, e *env, store *processed.Store, horizonOf string, olderThan time.Duration, retired int64) error {
	fmt.Fprintf(e.stdout, "recorded the purge horizon %s on %s (partitioned layout): records processed more than %s ago may go\n", horizonOf, store, olderThan)
	if retired > 0 {
		fmt.Fprintf(e.stdout, "retired about %d records, a whole generation at a time (the planner's estimate of its rows, when it has one)\n", retired)
	} else {
		fmt.Fprintf(e.stdout, "retired no generation: records go a generation at a time, once every consumer with records in it allows, so they may stay longer than %s\n", olderThan)
	}
	gens, err := store.Generations(ctx)
	if err != nil {
		return hint(err, store)
	}
	if len(gens) == 0 {
		return nil
	}
	if oldest := gens[len(gens)-1]; len(oldest.HeldBy) > 0 {
		fmt.Fprintf(e.stdout, "the oldest generation, %s (ended %s), is held by %s: their purge horizons are not past its end\n",
			oldest.Table, generationTime(oldest.EndedAt, "before the layout began"), quoteList(oldest.HeldBy))
	}
	return nil
}

// quoteList renders names quoted and comma-separated.
func quoteList(names []string) string {
	q := make([]string, len(names))
	for i, n := range names {
		q[i] = strconv.Quote(n)
	}
	return strings.Join(q, ", ")
}

// durationFlag is a time.Duration flag that also accepts whole days, such
// as "7d".
type durationFlag struct {
	d   time.Duration
	set bool
}

func (f *durationFlag) String() string {
	if f == nil || !f.set {
		return ""
	}
	return f.d.String()
}

func (f *durationFlag) Set(s string) error {
	if days, ok := strings.CutSuffix(s, "d"); ok {
		n, err := strconv.ParseInt(days, 10, 64)
		if err != nil || n < 0 || n > 100000 {
			return errors.New("want a duration such as 72h, 90m or 7d")
		}
		f.d, f.set = time.Duration(n)*24*time.Hour, true
		return nil
	}
	d, err := time.ParseDuration(s)
	if err != nil {
		return errors.New("want a duration such as 72h, 90m or 7d")
	}
	f.d, f.set = d, true
	return nil
}

var _ flag.Value = (*durationFlag)(nil)
