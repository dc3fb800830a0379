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
	args:    "--older-than <duration>",
	summary: "delete old dedup records",
	help: `Deletes the dedup records processed more than --older-than ago, in batches
with a --pause between them, and prints how many it deleted. A message redelivered after its record is
purged is applied again, so keep records longer than any redelivery can lag.`,
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
		batch     int
		pause     time.Duration
		duty      float64
	)
	fs := c.flagSet()
	db.register(fs)
	fs.Var(&olderThan, "older-than", "delete records processed more than this long ago: a `duration` such as 72h, 90m or 7d (required)")
	fs.IntVar(&batch, "batch-size", processed.DefaultPurgeBatchSize, "rows deleted per statement")
	fs.DurationVar(&pause, "pause", processed.DefaultPurgePause, "least pause between two batches, so live consumers keep the database; 0 for none")
	fs.Float64Var(&duty, "duty", processed.DefaultPurgeDutyCycle, "largest share of the time spent deleting: after a batch that took d, wait at least d*(1-duty)/duty; 1 for no such wait (with --pause 0: flat out)")
	if _, err := c.parse(e, fs, args, 0); err != nil {
		return err
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
	store, conn, err := db.openStore(ctx, e, batch, pause, duty)
	if err != nil {
		return err
	}
	defer closeConn(conn)

	n, err := store.Purge(ctx, olderThan.d)
	if err != nil {
		if n > 0 {
			fmt.Fprintf(e.stdout, "deleted %d records from %s before the error\n", n, store)
		}
		return hint(err, store)
	}
	fmt.Fprintf(e.stdout, "deleted %d records processed more than %s ago from %s\n", n, olderThan.d, store)
	return nil
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
