package console

import (
	"encoding/json"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/idemq/idemq/cmd/idemq/internal/reconcile"
)

// writeReport writes rep where `idemq reconcile --out` would.
func writeReport(t *testing.T, path string, rep reconcile.Report) {
	t.Helper()
	b, err := json.Marshal(rep)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(path, b, 0o644); err != nil {
		t.Fatal(err)
	}
}

func TestConsoleReconciliation(t *testing.T) {
	path := filepath.Join(t.TempDir(), "reconcile.json")
	b := newBundle(t, func(c *Config) { c.Reconciliation = path })
	c := b.client()

	// No report yet: the card says how to make one.
	body := c.mustGet("/")
	must(t, body, `id="reconciliation"`, "no reconciliation yet: run &#39;idemq reconcile --out "+path)

	checked := time.Now().Add(-90 * time.Minute).UTC()
	rep := reconcile.Report{CheckedAt: checked, Since: checked.Add(-24 * time.Hour), Until: checked, End: checked.Add(-5 * time.Minute),
		Discrepancies: 3, Clean: false, Scanned: reconcile.Scanned{Sent: 200, Dedup: 199, Pending: 1},
		Warnings: []string{`a <b>note</b>`}}
	rep.NeverApplied = reconcile.Kind{Count: 2, Samples: []reconcile.Sample{
		{MessageID: `<script>alert("id")</script>`, Consumer: "notify", Destination: "chain.ledger", Database: "ledger"},
		{MessageID: "lost-2", Consumer: "notify", Destination: "chain.ledger", Database: "ledger"}}}
	rep.StuckUnsent = reconcile.Kind{Count: 1, Samples: []reconcile.Sample{{MessageID: "stuck-1", Database: "payments", Detail: `seq 7, 3 attempts, last error: <img src=x onerror=alert(1)>`}}}
	writeReport(t, path, rep)
	body = c.mustGet("/")
	must(t, body, `id="recon-verdict">3 discrepancies<`, "1h30m ago",
		`<tr data-kind="never_applied">`, `<span class="warn">2</span>`, "published, never applied",
		"&lt;script&gt;alert(&#34;id&#34;)&lt;/script&gt;", "lost-2", "stuck-1", "last error: &lt;img src=x onerror=alert(1)&gt;",
		"note: a &lt;b&gt;note&lt;/b&gt;", "200 sent outbox rows, 199 dedup rows, 1 pending rows",
		checked.Add(-24*time.Hour).Format("2006-01-02 15:04:05Z"))
	mustNot(t, body, `<script>alert`, `<img src=x`, "<b>note</b>")
	if regexp.MustCompile(`(?i)<[a-z][^>]*\son[a-z]+=`).MatchString(body) {
		t.Errorf("an element carries an event-handler attribute")
	}
	// Three samples at most per kind.
	rep.NeverApplied.Count = 9
	for i := range 7 {
		rep.NeverApplied.Samples = append(rep.NeverApplied.Samples, reconcile.Sample{MessageID: "more-" + string(rune('a'+i)), Database: "ledger"})
	}
	writeReport(t, path, rep)
	body = c.mustGet("/")
	must(t, body, "more-a")
	mustNot(t, body, "more-b")

	// A clean one replaces it (the console reads the file at each request).
	writeReport(t, path, reconcile.Report{CheckedAt: time.Now(), Clean: true})
	body = c.mustGet("/")
	must(t, body, `id="recon-verdict">clean<`)
	mustNot(t, body, "stuck-1", `class="warn"`)

	// A file that holds no report says so, and the page still serves.
	if err := os.WriteFile(path, []byte("not json <b>"), 0o644); err != nil {
		t.Fatal(err)
	}
	body = c.mustGet("/")
	must(t, body, "the file does not hold a report")
	mustNot(t, body, "<b>")
}

func TestConsoleNoReconciliation(t *testing.T) {
	body := newBundle(t).client().mustGet("/")
	if strings.Contains(body, `id="reconciliation"`) {
		t.Error("a reconciliation card without Config.Reconciliation")
	}
}
