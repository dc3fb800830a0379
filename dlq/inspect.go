package dlq

import (
	"context"
	"errors"
	"fmt"
	"io"
	"slices"
	"time"

	"github.com/idemq/idemq/consumer"
)

// Group is the dead-lettered messages sharing an Entry.Fingerprint: one
// consumer, one original source, one error class and one shape of the
// error text, however their texts differ in ids, times and values.
type Group struct {
	// Fingerprint is the group's Entry.Fingerprint.
	Fingerprint string                `json:"fingerprint"`
	Class       consumer.FailureClass `json:"class"`
	// Pattern is the shape of the group's error texts: the text with its
	// variable parts replaced by placeholders (see the package doc).
	Pattern string `json:"pattern"`
	// Error is one sample error text of the group: the first one read.
	Error string `json:"error"`
	Count int    `json:"count"`
	// FirstSeen is the earliest first failure of the group's messages
	// (Record.FirstSeen); LastSeen the latest last failure.
	FirstSeen time.Time `json:"first_seen,omitzero"`
	LastSeen  time.Time `json:"last_seen,omitzero"`
	// Consumers and Sources hold the group's consumer and original
	// source: at most one each, since both are part of the fingerprint
	// (none for a message without an envelope, or without a source).
	Consumers []string `json:"consumers"`
	Sources   []string `json:"sources"`
	// Sample holds up to five message ids of the group.
	Sample []string `json:"sample_ids"`
	// Unverified counts the group's messages whose envelope is not signed
	// by any key given to Inspect (always 0 without keys).
	Unverified int `json:"unverified,omitempty"`
	// Truncated counts the group's dead letters that were cut to fit the
	// broker (Record.Truncated): a replay leaves them in the queue.
	Truncated int `json:"truncated,omitempty"`
}

// Report is what Inspect found.
type Report struct {
	Total     int `json:"total"`
	Malformed int `json:"malformed"`
	// Unverified counts the messages whose envelope is not signed by any
	// key given to Inspect; a replay with those keys leaves them.
	Unverified int `json:"unverified,omitempty"`
	// Truncated counts the dead letters cut to fit the broker.
	Truncated int     `json:"truncated,omitempty"`
	Groups    []Group `json:"groups"`
}

// Inspect reads the dead-letter queue, as it was at the start, and groups its
// messages by their Entry.Fingerprint (consumer, source, error class and the
// shape of the error text), largest group first, groups of one size in the
// order their first message was read; limit, if positive, bounds the
// messages it groups. Given verifyKeys, it also checks each envelope's
// signature (see Verify) and counts the messages no key verifies as
// Unverified. It consumes nothing: it closes the browser, which gives every
// message back.
func Inspect(ctx context.Context, b Browser, filter Filter, limit int, verifyKeys ...[]byte) (Report, error) {
	var rep Report
	if b == nil {
		return rep, &consumer.ConfigError{Field: "Browser", Reason: "required"}
	}
	defer b.Close()
	verify, err := newVerifier(verifyKeys)
	if err != nil {
		return rep, err
	}
	index := map[string]int{}
	for limit <= 0 || rep.Total < limit {
		d, err := b.Next(ctx)
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			return rep, fmt.Errorf("dlq: read dead-letter queue: %w", err)
		}
		msg := d.Message()
		rec, err := readRecord(msg)
		if err != nil {
			rep.Malformed++
			continue
		}
		if !filter.Match(rec) {
			continue
		}
		rep.Total++
		shape := normalizeError(rec.Error, rec.MessageID)
		fp := rec.fingerprint(shape)
		i, ok := index[fp]
		if !ok {
			i = len(rep.Groups)
			index[fp] = i
			rep.Groups = append(rep.Groups, Group{Fingerprint: fp, Class: rec.Class, Pattern: shape, Error: rec.Error,
				Consumers: []string{}, Sources: []string{}})
		}
		g := &rep.Groups[i]
		g.Count++
		if t := rec.FirstSeen(); !t.IsZero() && (g.FirstSeen.IsZero() || t.Before(g.FirstSeen)) {
			g.FirstSeen = t
		}
		if t := rec.LastFailure; t.After(g.LastSeen) {
			g.LastSeen = t
		}
		g.Consumers = addUnique(g.Consumers, rec.Consumer)
		g.Sources = addUnique(g.Sources, rec.Source)
		if len(g.Sample) < 5 && rec.MessageID != "" {
			g.Sample = append(g.Sample, rec.MessageID)
		}
		if !verify.trusted(msg) {
			g.Unverified++
			rep.Unverified++
		}
		if rec.Truncated != "" {
			g.Truncated++
			rep.Truncated++
		}
	}
	slices.SortStableFunc(rep.Groups, func(a, b Group) int { return b.Count - a.Count })
	return rep, nil
}

func addUnique(list []string, s string) []string {
	if s == "" || slices.Contains(list, s) {
		return list
	}
	return append(list, s)
}
