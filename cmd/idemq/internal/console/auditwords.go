package console

import (
	"bytes"
	"encoding/json"
	"fmt"
	"maps"
	"slices"
	"strings"
)

// The audit page says each row's JSON in words, and keeps the JSON as
// stored behind a click. The words know the shapes the console writes
// (filterOf, dryCounts, dlq.RequeueResult); a key they do not know is
// said as "key: value", never dropped.

// phrase says one key of an audit row's JSON in words; %s is its value.
type phrase struct {
	key, words string
	// always: said even when it is zero. The other counts are said only
	// when they are not; the JSON holds them all.
	always bool
}

var (
	filterPhrases = []phrase{{"fingerprint", "group %s", true}, {"dlq", "queue %s", true}}
	dryRunPhrases = []phrase{
		{"selected", "%s selected", true},
		{"will_apply", "%s would apply", true},
		{"already_applied", "%s already applied", true},
		{"fingerprint_mismatch", "%s with a fingerprint mismatch", false},
		{"beyond_horizon", "%s beyond the retention horizon", false},
		{"unverified", "%s with an unverified signature", false},
		{"missing_id", "%s without an id", false},
		{"truncated", "%s truncated to fit the broker", false},
	}
	resultPhrases = []phrase{
		{"republished", "republished %s", true},
		{"skipped_already_applied", "skipped %s as already applied", true},
		{"mismatched_left", "left %s with a fingerprint mismatch", false},
		{"beyond_horizon", "left %s beyond the retention horizon", false},
		{"unverified", "left %s with an unverified signature", false},
		{"missing_id_left", "left %s without an id", false},
		{"truncated_left", "left %s truncated", false},
		{"malformed", "left %s unreadable", false},
		{"scanned", "%s scanned", true},
	}
)

// idsShown bounds the message ids a filter's words name.
const idsShown = 5

// AuditField is one JSON column of an audit row: in words, and as stored
// (indented; empty for null).
type AuditField struct {
	Words string
	JSON  string
}

// Fields are the row's filter, dry run and result, as the audit page's
// columns show them.
func (r AuditRow) Fields() []AuditField {
	return []AuditField{
		{r.FilterSummary(), indentJSON(r.Filter)},
		{r.DryRunSummary(), indentJSON(r.DryRun)},
		{r.ResultSummary(), indentJSON(r.Result)},
	}
}

// FilterSummary says what the action applied to: a failure group, and
// the message ids selected in it or every message. The queue is said
// only when it is not the row's own.
func (r AuditRow) FilterSummary() string {
	return summarize(r.Filter, "no selection recorded", func(m map[string]any) []string {
		if q, ok := m["dlq"].(string); ok && q == r.DLQ {
			delete(m, "dlq") // the row's Queue column says it
		}
		out := say(m, filterPhrases)
		if ids, ok := idsOf(m["ids"]); ok {
			delete(m, "ids")
			out = append(out, ids)
		}
		return out
	})
}

// DryRunSummary says the counts of the dry run the action was confirmed
// on.
func (r AuditRow) DryRunSummary() string {
	return summarize(r.DryRun, "no dry run recorded", func(m map[string]any) []string { return say(m, dryRunPhrases) })
}

// ResultSummary says what the action did: republished, skipped as
// already applied, left in the queue and why, scanned.
func (r AuditRow) ResultSummary() string {
	none := "no result recorded"
	if r.Outcome == "running" {
		// Still running, or its process stopped before it could say.
		none = "not finished"
	}
	return summarize(r.Result, none, func(m map[string]any) []string { return say(m, resultPhrases) })
}

// summarize puts a JSON object in words: what known says of it, then
// the keys it left, sorted. none is the words for null.
func summarize(raw json.RawMessage, none string, known func(map[string]any) []string) string {
	if len(bytes.TrimSpace(raw)) == 0 {
		return none
	}
	var v any
	d := json.NewDecoder(bytes.NewReader(raw))
	d.UseNumber() // 3, not 3e+00
	if err := d.Decode(&v); err != nil {
		return "unreadable: see the JSON"
	}
	if v == nil {
		return none
	}
	m, ok := v.(map[string]any)
	if !ok {
		return "not an object: see the JSON"
	}
	parts := known(m)
	for _, k := range slices.Sorted(maps.Keys(m)) {
		parts = append(parts, k+": "+text(m[k]))
	}
	if len(parts) == 0 {
		return "–"
	}
	return strings.Join(parts, ", ")
}

// say puts the keys of m that phrases know in words, in the phrases'
// order, and removes them from m.
func say(m map[string]any, phrases []phrase) []string {
	var out []string
	for _, p := range phrases {
		v, ok := m[p.key]
		if !ok {
			continue
		}
		delete(m, p.key)
		if p.always || !isZero(v) {
			out = append(out, fmt.Sprintf(p.words, text(v)))
		}
	}
	return out
}

// idsOf says a filter's message ids: null or none is the whole group.
// ok is false for a value that is not a list of strings.
func idsOf(v any) (words string, ok bool) {
	if v == nil {
		return "every message", true
	}
	list, ok := v.([]any)
	if !ok {
		return "", false
	}
	ids := make([]string, 0, len(list))
	for _, e := range list {
		s, ok := e.(string)
		if !ok {
			return "", false
		}
		ids = append(ids, s)
	}
	switch n := len(ids); {
	case n == 0:
		return "every message", true
	case n > idsShown:
		return fmt.Sprintf("%d ids: %s and %d more", n, strings.Join(ids[:idsShown], ", "), n-idsShown), true
	}
	return fmt.Sprintf("%d ids: %s", len(ids), strings.Join(ids, ", ")), true
}

// isZero reports whether v is the number 0.
func isZero(v any) bool {
	n, ok := v.(json.Number)
	if !ok {
		return false
	}
	f, err := n.Float64()
	return err == nil && f == 0
}

// text is a JSON value in words: a string or a number as it is, anything
// else as JSON.
func text(v any) string {
	switch v := v.(type) {
	case string:
		return v
	case json.Number:
		return v.String()
	}
	b, err := json.Marshal(v)
	if err != nil {
		return fmt.Sprint(v)
	}
	return string(b)
}

// indentJSON is stored JSON, indented to read; empty for null.
func indentJSON(raw json.RawMessage) string {
	t := bytes.TrimSpace(raw)
	if len(t) == 0 || string(t) == "null" {
		return ""
	}
	var out bytes.Buffer
	if err := json.Indent(&out, t, "", "  "); err != nil {
		return string(raw)
	}
	return out.String()
}
