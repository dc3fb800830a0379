package console

import (
	"context"
	"regexp"
	"strings"
	"testing"

	"github.com/idemq/idemq/dlq"
)

// detailsRE is a raw JSON behind a click: a <details> holding a <pre>.
var (
	detailsRE = regexp.MustCompile(`(?s)<details class="raw">\s*<summary>[^<]*</summary>\s*<pre class="json">(.*?)</pre>\s*</details>`)
	tableRE   = regexp.MustCompile(`(?s)<table id="audit">.*?</table>`)
)

// TestConsoleAuditSummary: each audit row says in words what its JSON
// holds (every shape the console writes, and keys it does not know), and
// keeps the JSON as stored behind a <details>, not on the page.
func TestConsoleAuditSummary(t *testing.T) {
	b := newBundle(t)
	ctx := context.Background()
	a := b.srv.audit
	fp := "0123456789abcdef"

	// A finished replay of a whole group, written as the console writes it.
	id, err := a.start(ctx, "alice", "replay", "memory:payments.dlq", filterOf(selection{DLQ: "memory:payments.dlq", Fingerprint: fp}),
		dryCounts{Selected: 5, WillApply: 3, AlreadyApplied: 1, Mismatch: 1})
	if err != nil {
		t.Fatal(err)
	}
	if err := a.finish(ctx, id, dlq.RequeueResult{Scanned: 5, Republished: 3, Skipped: 1, Mismatched: 1}, "done", nil); err != nil {
		t.Fatal(err)
	}
	// A requeue of a selection, still running (or its process died).
	if _, err := a.start(ctx, "alice", "requeue", "memory:payments.dlq", filterOf(selection{DLQ: "memory:payments.dlq", Fingerprint: fp, IDs: []string{"pay-1", "pay-2"}}),
		dryCounts{Selected: 2, WillApply: 2}); err != nil {
		t.Fatal(err)
	}
	// Rows of another version: keys this console does not know, and JSON
	// that is not an object.
	if _, err := b.pool.Exec(ctx, `INSERT INTO `+a.table()+` (who, action, dlq, filter, dry_run, result, outcome) VALUES
('carol', 'replay', 'memory:payments.dlq', '{"dlq": "memory:other.dlq", "fingerprint": "fedcba9876543210", "ids": null, "consumer": "ledger"}',
 '{"selected": 1, "will_apply": 1, "already_applied": 0, "forged": 0}',
 '{"republished": 1, "skipped_already_applied": 0, "requeued_by_hand": 2, "note": "from a <newer> console"}', 'done'),
('dave', 'requeue', 'memory:payments.dlq', '{"fingerprint": "fedcba9876543210"}', '[1, 2]', '"odd"', 'failed')`); err != nil {
		t.Fatal(err)
	}

	body := b.client().mustGet("/audit")
	table := tableRE.FindString(body)
	if table == "" {
		t.Fatalf("no audit table:\n%s", body)
	}
	visible := detailsRE.ReplaceAllString(table, "")
	must(t, visible,
		// The replay, in words.
		"group 0123456789abcdef, every message",
		"5 selected, 3 would apply, 1 already applied, 1 with a fingerprint mismatch",
		"republished 3, skipped 1 as already applied, left 1 with a fingerprint mismatch, 5 scanned",
		// The requeue.
		"group 0123456789abcdef, 2 ids: pay-1, pay-2",
		"2 selected, 2 would apply, 0 already applied",
		"not finished",
		// Unknown keys are said, not dropped; a known zero count that is
		// not one of the main ones is left out of the words.
		"group fedcba9876543210, queue memory:other.dlq, every message, consumer: ledger",
		"1 selected, 1 would apply, 0 already applied, forged: 0",
		"republished 1, skipped 0 as already applied, note: from a &lt;newer&gt; console, requeued_by_hand: 2",
		// JSON that is not an object.
		"not an object: see the JSON",
	)
	// No JSON blob on the page, only behind a click.
	mustNot(t, visible, "&#34;", "{")

	var raw strings.Builder
	for _, m := range detailsRE.FindAllStringSubmatch(table, -1) {
		raw.WriteString(m[1])
	}
	must(t, raw.String(),
		`&#34;republished&#34;: 3`, `&#34;fingerprint_mismatch&#34;: 1`, `&#34;ids&#34;: [`, `&#34;pay-2&#34;`,
		`&#34;requeued_by_hand&#34;: 2`, `&#34;consumer&#34;: &#34;ledger&#34;`, `&#34;forged&#34;: 0`, `&#34;odd&#34;`)
	// A row still running has no result to show.
	if n := len(detailsRE.FindAllString(table, -1)); n != 11 {
		t.Errorf("%d raw JSON blocks, want 11 (3 rows of 3, one of 2)", n)
	}
}

// TestAuditSummaryUnreadable: a summary never fails, whatever is stored.
func TestAuditSummaryUnreadable(t *testing.T) {
	r := AuditRow{DLQ: "memory:q", Outcome: "done", Filter: []byte(`{"ids": ["a", "b", "c", "d", "e", "f", "g"]}`), DryRun: []byte(`not json`), Result: nil}
	if got, want := r.FilterSummary(), "7 ids: a, b, c, d, e and 2 more"; got != want {
		t.Errorf("filter: %q, want %q", got, want)
	}
	if got, want := r.DryRunSummary(), "unreadable: see the JSON"; got != want {
		t.Errorf("dry run: %q, want %q", got, want)
	}
	if got, want := r.ResultSummary(), "no result recorded"; got != want {
		t.Errorf("result: %q, want %q", got, want)
	}
}
