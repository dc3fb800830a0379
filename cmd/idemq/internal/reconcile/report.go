package reconcile

import (
	"fmt"
	"io"
	"strings"
	"time"
)

// Report is what Run found. Its JSON form is what `idemq reconcile --json`
// prints and --out writes, and what the console reads.
type Report struct {
	// CheckedAt is when Run started, by the local clock.
	CheckedAt time.Time `json:"checked_at"`
	// Since and Until are the window asked for, Until capped at CheckedAt.
	Since time.Time `json:"since"`
	Until time.Time `json:"until"`
	// End is where the window ends: Until, or CheckedAt minus Grace if
	// that is earlier.
	End          time.Time `json:"end"`
	GraceSeconds float64   `json:"grace_seconds"`
	PageSize     int       `json:"page_size"`
	// Flows and Forwards are the checks, as --flow takes them.
	Flows    []string `json:"flows"`
	Forwards []string `json:"forwards"`
	// Windows say where a check's window starts when a purge horizon
	// (or the start of a table's history) moved it after Since.
	Windows []Window `json:"windows"`
	// Warnings are what the reader should know: rows a moved window
	// skipped, dead letters counted among the never applied.
	Warnings []string `json:"warnings"`
	// The discrepancies, by kind.
	NeverApplied  Kind `json:"never_applied"`
	AppliedTwice  Kind `json:"applied_twice"`
	StuckUnsent   Kind `json:"stuck_unsent"`
	UnknownOrigin Kind `json:"unknown_origin"`
	NotForwarded  Kind `json:"not_forwarded"`
	// DeadLettered counts the messages published but never applied whose
	// id Config.DeadLettered lists: accounted for, not discrepancies.
	DeadLettered Kind `json:"dead_lettered"`
	// Scanned counts the rows the passes read.
	Scanned Scanned `json:"scanned"`
	// Discrepancies sums the counts of the five kinds; Clean says it is 0.
	Discrepancies int64 `json:"discrepancies"`
	Clean         bool  `json:"clean"`
}

// Window is where one check's window starts when it is later than Since.
type Window struct {
	// Check is "never_applied", "unknown_origin" or "not_forwarded".
	Check string `json:"check"`
	// Subject is the flow or consumer the window is for.
	Subject string    `json:"subject"`
	Start   time.Time `json:"start"`
	// Reason names the horizon that moved it.
	Reason string `json:"reason"`
	// Skipped counts the rows of the window before Start whose
	// counterpart the check did not find: a purge may have removed it, so
	// they are not reported, and a warning says how many.
	Skipped int64 `json:"skipped"`
}

// Kind is one kind of discrepancy: how many, and the first samples.
type Kind struct {
	Count   int64    `json:"count"`
	Samples []Sample `json:"samples"`
}

// Sample is one discrepancy.
type Sample struct {
	// MessageID is the message's id: the outbox row's, or the dedup
	// row's.
	MessageID string `json:"message_id"`
	// Consumer is the consumer concerned, if any.
	Consumer string `json:"consumer,omitempty"`
	// Destination is the outbox row's destination, if any.
	Destination string `json:"destination,omitempty"`
	// Database is where the row was read.
	Database string `json:"database"`
	// At is the row's time: sent_at (never applied), processed_at (the
	// dedup kinds) or created_at (stuck unsent).
	At time.Time `json:"at"`
	// ChildID is, for not forwarded, the id the forwarded row should have.
	ChildID string `json:"child_id,omitempty"`
	// Copies is, for applied twice, the number of dedup rows in each
	// database that holds the id.
	Copies map[string]int `json:"copies,omitempty"`
	// Detail says more: a stuck row's attempts and last error.
	Detail string `json:"detail,omitempty"`
}

// Scanned counts the rows read by the paged passes.
type Scanned struct {
	Sent    int64 `json:"sent"`
	Dedup   int64 `json:"dedup"`
	Pending int64 `json:"pending"`
}

// KindInfo describes one field of the Report.
type KindInfo struct {
	// Key is the field's JSON name.
	Key string
	// Title is how summaries name it.
	Title string
	// Failing says whether the kind is a discrepancy (DeadLettered is
	// not).
	Failing bool
	// Kind is the field's value.
	Kind Kind
}

// Kinds returns the kinds, in the order summaries show them.
func (r *Report) Kinds() []KindInfo {
	return []KindInfo{
		{"never_applied", "published, never applied", true, r.NeverApplied},
		{"applied_twice", "applied twice", true, r.AppliedTwice},
		{"stuck_unsent", "outbox rows stuck unsent", true, r.StuckUnsent},
		{"unknown_origin", "dedup rows of unknown origin", true, r.UnknownOrigin},
		{"not_forwarded", "applied, not forwarded", true, r.NotForwarded},
		{"dead_lettered", "published, dead-lettered", false, r.DeadLettered},
	}
}

// DeadLetterNote is what a report says of dead letters: why a message a
// consumer dead-lettered counts as never applied, and how to check.
const DeadLetterNote = "a message the consumer dead-lettered has no dedup row, so it counts as published, never applied unless its dead-letter queue is given (--dlq); check the ids with 'idemq dlq inspect --id ID' on the consumer's dead-letter queue"

// WriteText writes the report as a human summary.
func (r *Report) WriteText(w io.Writer) error {
	var b strings.Builder
	t := func(x time.Time) string { return x.UTC().Format(time.RFC3339) }
	verdict := "CLEAN"
	if !r.Clean {
		verdict = fmt.Sprintf("%d DISCREPANCIES", r.Discrepancies)
	}
	fmt.Fprintf(&b, "reconciliation %s: %s\n", t(r.CheckedAt), verdict)
	fmt.Fprintf(&b, "  window          %s to %s (until %s, minus the %s grace)\n", t(r.Since), t(r.End), t(r.Until), time.Duration(r.GraceSeconds*float64(time.Second)))
	for _, f := range r.Flows {
		fmt.Fprintf(&b, "  flow            %s\n", f)
	}
	for _, f := range r.Forwards {
		fmt.Fprintf(&b, "  forward         %s\n", f)
	}
	fmt.Fprintf(&b, "  scanned         %d sent outbox rows, %d dedup rows, %d pending outbox rows\n", r.Scanned.Sent, r.Scanned.Dedup, r.Scanned.Pending)
	for _, k := range r.Kinds() {
		fmt.Fprintf(&b, "  %-30s %6d\n", k.Title, k.Kind.Count)
	}
	for _, k := range r.Kinds() {
		if len(k.Kind.Samples) == 0 {
			continue
		}
		more := ""
		if n := k.Kind.Count - int64(len(k.Kind.Samples)); n > 0 {
			more = fmt.Sprintf(" (first %d of %d)", len(k.Kind.Samples), k.Kind.Count)
		}
		fmt.Fprintf(&b, "\n%s%s:\n", k.Title, more)
		for _, s := range k.Kind.Samples {
			fmt.Fprintf(&b, "  %s\n", s.text())
		}
	}
	if len(r.Warnings) > 0 {
		b.WriteString("\n")
		for _, w := range r.Warnings {
			fmt.Fprintf(&b, "note: %s\n", w)
		}
	}
	_, err := io.WriteString(w, b.String())
	return err
}

// text is the sample on one line.
func (s Sample) text() string {
	var b strings.Builder
	b.WriteString(safe(s.MessageID))
	if s.Consumer != "" {
		b.WriteString("  consumer " + safe(s.Consumer))
	}
	if s.Destination != "" {
		b.WriteString("  destination " + safe(s.Destination))
	}
	b.WriteString("  in " + s.Database)
	if !s.At.IsZero() {
		b.WriteString("  at " + s.At.UTC().Format(time.RFC3339))
	}
	if s.ChildID != "" {
		b.WriteString("  child " + s.ChildID)
	}
	if len(s.Copies) > 0 {
		b.WriteString("  copies")
		for _, name := range sortedKeys(s.Copies) {
			fmt.Fprintf(&b, " %s=%d", name, s.Copies[name])
		}
	}
	if s.Detail != "" {
		b.WriteString("  (" + safe(s.Detail) + ")")
	}
	return b.String()
}
