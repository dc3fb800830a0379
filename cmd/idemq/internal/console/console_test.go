package console

import (
	"context"
	"encoding/json"
	"errors"
	"net"
	"net/http"
	"net/url"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/idemq/idemq/dlq"
)

func TestConsoleSecurityHeadersAndNoInlineScript(t *testing.T) {
	b := newBundle(t)
	c := b.client()
	fp := b.fingerprint("pay-1")
	for _, path := range []string{"/", "/dead-letters", "/group?" + sel(fp), "/dry-run?" + sel(fp), "/audit", "/lookup?consumer=ledger&id=pay-1", "/login", "/nope"} {
		_, body, h := c.get(path)
		csp := h.Get("Content-Security-Policy")
		for _, want := range []string{"default-src 'self'", "script-src 'self'", "frame-ancestors 'none'", "object-src 'none'"} {
			if !strings.Contains(csp, want) {
				t.Errorf("%s: CSP %q lacks %q", path, csp, want)
			}
		}
		if strings.Contains(csp, "unsafe-inline") || strings.Contains(csp, "unsafe-eval") {
			t.Errorf("%s: CSP %q allows inline script", path, csp)
		}
		// same-origin, so that browsers send the Origin the CSRF check
		// wants (no-referrer makes them send "Origin: null").
		if h.Get("X-Content-Type-Options") != "nosniff" || h.Get("X-Frame-Options") != "DENY" || h.Get("Referrer-Policy") != "same-origin" {
			t.Errorf("%s: headers %v", path, h)
		}
		// The only script is the embedded file: no inline script, no
		// event-handler attribute, no CDN.
		for _, m := range regexp.MustCompile(`(?s)<script[^>]*>.*?</script>`).FindAllString(body, -1) {
			if m != `<script src="/static/console.js" defer></script>` {
				t.Errorf("%s: inline or foreign script %q", path, m)
			}
		}
		if regexp.MustCompile(`(?i)<[a-z][^>]*\son[a-z]+=`).MatchString(body) {
			t.Errorf("%s: an element carries an event-handler attribute", path)
		}
		mustNot(t, body, "http://", "https://")
	}
	for _, path := range []string{"/static/console.js", "/static/console.css"} {
		code, body, h := c.get(path)
		if code != 200 || len(body) < 100 || h.Get("X-Content-Type-Options") != "nosniff" {
			t.Errorf("%s: %d, %d bytes", path, code, len(body))
		}
	}
}

func TestConsoleOverview(t *testing.T) {
	b := newBundle(t)
	body := b.client().mustGet("/")
	must(t, body,
		`<a href="/lookup?consumer=ledger">ledger</a>`,     // the consumer
		`<a class="dim" href="/consumer?name=ledger"`,      // its page
		`<td class="num">3</td>`,                           // its dedup rows
		`memory`, `payments.dlq`, `<td class="num">6</td>`, // the queue's depth
		`<td class="num">4</td>`, // its groups
		`id="outbox-pending">1<`, `id="http-keys">1<`,
		"postgres://app:xxxxx@db/prod")
	mustNot(t, body, "error")
}

func TestConsoleOverviewStatusFunc(t *testing.T) {
	eligible := int64(2)
	b := newBundle(t, func(c *Config) {
		c.Status = func(ctx context.Context, db Shard, name string) (ConsumerStatus, error) {
			st, err := db.Store.Stats(ctx, name)
			rec, _ := db.Store.Lookup(ctx, name, "pay-1")
			return ConsumerStatus{Consumer: name, Rows: st.Rows, Oldest: st.Oldest, PurgeEligible: &eligible, LastApplied: &rec}, err
		}
	})
	body := b.client().mustGet("/")
	must(t, body, `<td class="num">2</td>`, "<code>pay-1</code>", "payments [2] @1234")
}

func TestConsoleDeadLettersGrouped(t *testing.T) {
	b := newBundle(t)
	c := b.client()
	body := c.mustGet("/dead-letters")
	must(t, body, "6 dead letters in 4 groups")
	// One row per failure fingerprint, the one dlq inspect uses.
	rep, err := dlq.Inspect(context.Background(), mustBrowser(t, b), dlq.Filter{}, 0)
	if err != nil {
		t.Fatal(err)
	}
	for _, g := range rep.Groups {
		must(t, body, `data-fingerprint="`+g.Fingerprint+`"`)
	}
	// The three declined cards are one group of three.
	fp := b.fingerprint("pay-1")
	if !regexp.MustCompile(`data-fingerprint="` + fp + `">\s*<td class="num"><a href="[^"]+">3</a>`).MatchString(body) {
		t.Errorf("the card-declined group is not one row of 3")
	}
	must(t, body, "charge &#34;&lt;id&gt;&#34; failed: card &lt;n&gt; declined", "e.g. charge &#34;pay-1&#34;")
	// The forged envelope is unverified.
	must(t, body, `<span class="warn">1</span>`)

	for q, want := range map[string]string{
		"class=panic":     "1 dead letters in 1 groups",
		"consumer=ledger": "6 dead letters in 4 groups",
		"consumer=nobody": "0 dead letters in 0 groups",
		"source=refunds":  "1 dead letters in 1 groups",
		"since=1h":        "6 dead letters in 4 groups",
		"until=1h":        "0 dead letters in 0 groups",
		"dlq=memory%3Apayments.dlq&class=permanent": "4 dead letters in 2 groups",
	} {
		must(t, c.mustGet("/dead-letters?"+q), want)
	}
	_, body, _ = c.get("/dead-letters?since=yesterday")
	must(t, body, "since: ")
	if code, _, _ := c.get("/dead-letters?dlq=nope"); code != http.StatusNotFound {
		t.Errorf("unknown queue: %d", code)
	}
}

func mustBrowser(t *testing.T, b *bundle) dlq.Browser {
	t.Helper()
	conn, err := b.q.dlq("x").Open(context.Background(), false)
	if err != nil {
		t.Fatal(err)
	}
	return conn.Browser
}

func TestConsoleGroupPage(t *testing.T) {
	b := newBundle(t, pageSize(2))
	c := b.client()
	body := c.mustGet("/group?" + sel(b.fingerprint("pay-1")))
	must(t, body, `id="group-total">3<`, "page 1 of 2", `id="next-page"`,
		"<code class=\"msgid\">pay-1</code>", "signature verified", "x-idemq-consumer", "x-idemq-history",
		"<dt>Key</dt><dd><code>customer-pay-1</code>", // the original's ordering key
		"Body · json", "&#34;amount&#34;: 42", // pretty JSON
		"timeout talking to the bank", "retryable-exhausted", // the history timeline
		"<th>trace</th>")
	if strings.Count(body, `<article class="envelope"`) != 2 {
		t.Errorf("page 1 shows %d envelopes, want 2", strings.Count(body, `<article class="envelope"`))
	}
	body = c.mustGet("/group?" + sel(b.fingerprint("pay-1")) + "&page=2")
	must(t, body, "pay-3", "page 2 of 2", "← newer page")

	// HTML in a body, a header and an error is text.
	body = c.mustGet("/group?" + sel(b.fingerprint("evil-1")))
	must(t, body, "&lt;script&gt;alert(&#34;body&#34;)&lt;/script&gt;", "&lt;img src=x onerror=alert(&#34;header&#34;)&gt;", "panic: &lt;b&gt;boom&lt;/b&gt;")
	mustNot(t, body, `<script>alert`, `<img src=x`, "<b>boom")

	// A binary body is a hex dump.
	body = c.mustGet("/group?" + sel(b.fingerprint("bin-1")))
	must(t, body, "Body · binary · 5 bytes", "00 ff 10 41 80")

	// A forged envelope fails verification.
	body = c.mustGet("/group?" + sel(b.fingerprint("forged-1")))
	must(t, body, "signature bad signature")

	for _, q := range []string{"dlq=memory%3Apayments.dlq&fp=xyz", "dlq=nope&fp=0123456789abcdef"} {
		if code, _, _ := c.get("/group?" + q); code != http.StatusBadRequest {
			t.Errorf("%s: %d", q, code)
		}
	}
}

func TestConsoleDryRun(t *testing.T) {
	b := newBundle(t)
	c := b.client()
	body := c.mustGet("/dry-run?" + sel(b.fingerprint("pay-1")))
	for verdict, n := range map[string]string{"already-applied": "1", "will-apply": "1", "fingerprint-mismatch": "1", "beyond-horizon": "0", "unverified": "0"} {
		must(t, body, `data-count="`+verdict+`">`+n+`<`)
	}
	// Signed in: the confirmation form.
	must(t, body, `id="confirm"`)

	// A selection.
	body = c.mustGet("/dry-run?" + sel(b.fingerprint("pay-1"), "pay-2"))
	must(t, body, `data-count="will-apply">1<`, `data-count="already-applied">0<`)

	// The forged envelope is unverified; nothing was consumed.
	body = c.mustGet("/dry-run?" + sel(b.fingerprint("forged-1")))
	must(t, body, `data-count="unverified">1<`)
	if b.q.len() != 6 || len(b.q.sent()) != 0 {
		t.Errorf("a dry run changed the queue")
	}
}

func TestConsoleDryRunBeyondHorizon(t *testing.T) {
	b := newBundle(t, func(c *Config) { c.Retention = time.Minute })
	body := b.client().mustGet("/dry-run?" + sel(b.fingerprint("pay-1")))
	must(t, body, `data-count="beyond-horizon">3<`)
}

var (
	tileRE    = regexp.MustCompile(`<li class="([^"]*)"><strong data-count="([a-z-]+)">(\d+)<`)
	cssRuleRE = regexp.MustCompile(`([^{}]+)\{([^}]*)\}`)
)

// tiles maps each dry-run tile to its count and classes.
func tiles(t *testing.T, body string) map[string][2]string {
	t.Helper()
	out := map[string][2]string{}
	for _, m := range tileRE.FindAllStringSubmatch(body, -1) {
		out[m[2]] = [2]string{m[3], m[1]}
	}
	if len(out) != 7 {
		t.Fatalf("%d dry-run tiles, want 7: %v", len(out), out)
	}
	return out
}

// TestConsoleDryRunTilesWarnOnlyWhenNonZero: a tile of a bad outcome
// (mismatch, beyond the horizon, unverified, without an id) takes the
// warning colour only when its count is not zero; a zero looks calm.
func TestConsoleDryRunTilesWarnOnlyWhenNonZero(t *testing.T) {
	b := newBundle(t)
	c := b.client()
	// The class of each tile with a count that is not zero; a zero's is
	// tile-zero. tile-bad and tile-warn are the warning colours.
	tones := map[string]string{"already-applied": "tile-ok", "will-apply": "tile-info", "fingerprint-mismatch": "tile-bad",
		"beyond-horizon": "tile-warn", "unverified": "tile-bad", "missing-id": "tile-warn",
		"truncated": "tile-warn"}
	check := func(q string, nonZero ...string) {
		t.Helper()
		got := tiles(t, c.mustGet("/dry-run?"+q))
		for k, v := range got {
			n, class := v[0], strings.Fields(v[1])
			want := tones[k]
			if n == "0" {
				want = "tile-zero"
			}
			if !slices.Contains(class, want) || slices.Contains(class, "tile-bad") && want != "tile-bad" || slices.Contains(class, "tile-warn") && want != "tile-warn" {
				t.Errorf("%s: %s in a tile of class %q, want %s", k, n, v[1], want)
			}
		}
		for _, k := range nonZero {
			if got[k][0] == "0" {
				t.Errorf("%s: 0, want a count to see its colour", k)
			}
		}
	}
	// One mismatch; no unverified, none without an id.
	check(sel(b.fingerprint("pay-1")), "fingerprint-mismatch")
	// One unverified.
	check(sel(b.fingerprint("forged-1")), "unverified")
	// Beyond the horizon.
	hb := newBundle(t, func(c *Config) { c.Retention = time.Minute })
	c = hb.client()
	check(sel(hb.fingerprint("pay-1")), "beyond-horizon")

	// The stylesheet colours a tile's count as a warning only through
	// the classes a non-zero bad count gets.
	css := c.mustGet("/static/console.css")
	for _, m := range cssRuleRE.FindAllStringSubmatch(css, -1) {
		selector, decl := strings.TrimSpace(m[1]), m[2]
		if !strings.Contains(decl, "var(--bad)") && !strings.Contains(decl, "var(--warn)") {
			continue
		}
		for _, one := range strings.Split(selector, ",") {
			if (strings.Contains(one, ".c-") || strings.Contains(one, ".counts")) && !strings.Contains(one, ".tile-bad") && !strings.Contains(one, ".tile-warn") {
				t.Errorf("console.css colours a dry-run tile whatever its count: %q { %s }", strings.TrimSpace(one), strings.TrimSpace(decl))
			}
		}
	}
}

// runAction signs in, dry-runs sel and confirms action.
func runAction(t *testing.T, b *bundle, c *client, action, q string) job {
	t.Helper()
	body := c.mustGet("/dry-run?" + q)
	m := confirmRE.FindStringSubmatch(body)
	if m == nil {
		t.Fatalf("no confirmation form:\n%s", body)
	}
	form, _ := url.ParseQuery(q)
	form.Set("csrf", c.csrf)
	form.Set("confirm", m[1])
	form.Set("action", action)
	code, body, h := c.post("/actions", form, nil)
	if code != http.StatusSeeOther {
		t.Fatalf("%s: %d\n%s", action, code, body)
	}
	loc := h.Get("Location")
	deadline := time.Now().Add(10 * time.Second)
	for {
		_, body, _ := c.get(loc + "?format=json")
		var j job
		if err := json.Unmarshal([]byte(body), &j); err != nil {
			t.Fatalf("%s: %v", body, err)
		}
		if j.Done {
			page := c.mustGet(loc)
			must(t, page, `id="job-outcome">`+j.Outcome+`<`)
			return j
		}
		if time.Now().After(deadline) {
			t.Fatalf("job still running: %+v", j)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func TestConsoleReplayGroupAndAudit(t *testing.T) {
	b := newBundle(t)
	c := b.client()
	c.login("alice-secret-1")
	fp := b.fingerprint("pay-1")
	body := c.mustGet("/dry-run?" + sel(fp))
	must(t, body, `id="confirm"`, "signed in as <strong>alice</strong>")

	j := runAction(t, b, c, "replay", sel(fp))
	if j.Outcome != "done" || j.Result.Republished != 1 || j.Result.Skipped != 1 || j.Result.Mismatched != 1 || j.Who != "alice" {
		t.Fatalf("replay: %+v", j)
	}
	sent := b.q.sent()
	if len(sent) != 1 || sent[0].dest != "payments" || sent[0].msg.ID != "pay-2" {
		t.Fatalf("republished %+v", sent)
	}
	// pay-1 (applied) and pay-2 (republished) left the DLQ; pay-3 stays.
	if b.q.len() != 4 {
		t.Errorf("DLQ holds %d, want 4", b.q.len())
	}

	body = c.mustGet("/audit")
	must(t, body, "<td>alice</td><td>replay</td><td>memory:payments.dlq</td>", "group "+fp+", every message",
		"3 selected, 1 would apply, 1 already applied, 1 with a fingerprint mismatch",
		"republished 1, skipped 1 as already applied, left 1 with a fingerprint mismatch, 3 scanned",
		`&#34;will_apply&#34;: 1`, `&#34;republished&#34;: 1`, `outcome-done`)
	var who, outcome string
	if err := b.pool.QueryRow(context.Background(), `SELECT who, outcome FROM `+b.schema+`.idemq_console_audit`).Scan(&who, &outcome); err != nil {
		t.Fatal(err)
	}
	if who != "alice" || outcome != "done" {
		t.Errorf("audit row: %s %s", who, outcome)
	}
}

func TestConsoleRequeueSelection(t *testing.T) {
	b := newBundle(t)
	c := b.client()
	c.login("alice-secret-1")
	fp := b.fingerprint("pay-1")
	// Requeue republishes the selected originals without the dedup check:
	// pay-1 although it was applied (the consumer skips it).
	j := runAction(t, b, c, "requeue", sel(fp, "pay-1", "pay-2"))
	if j.Result.Republished != 2 || j.Result.Skipped != 0 {
		t.Fatalf("requeue: %+v", j)
	}
	sent := b.q.sent()
	if len(sent) != 2 || sent[0].msg.ID != "pay-1" || sent[1].msg.ID != "pay-2" {
		t.Fatalf("republished %+v", sent)
	}
	if sent[0].msg.Headers["x-idemq-error-class"] == "" {
		t.Errorf("the envelope is gone: a second failure would lose the history")
	}
}

func TestConsoleReplayRefusesUnverified(t *testing.T) {
	b := newBundle(t)
	c := b.client()
	c.login("alice-secret-1")
	j := runAction(t, b, c, "replay", sel(b.fingerprint("forged-1")))
	if j.Result.Unverified != 1 || j.Result.Republished != 0 || len(b.q.sent()) != 0 {
		t.Fatalf("a forged envelope was replayed: %+v", j)
	}
}

func TestConsoleMutationsNeedCSRFOriginAndToken(t *testing.T) {
	b := newBundle(t)
	fp := b.fingerprint("pay-1")
	c := b.client()
	c.login("alice-secret-1")
	body := c.mustGet("/dry-run?" + sel(fp))
	confirm := confirmRE.FindStringSubmatch(body)[1]
	form := func() url.Values {
		return url.Values{"dlq": {"memory:payments.dlq"}, "fp": {fp}, "csrf": {c.csrf}, "confirm": {confirm}, "action": {"replay"}}
	}
	cases := []struct {
		name    string
		form    url.Values
		headers map[string]string
		code    int
	}{
		{"no csrf", func() url.Values { f := form(); f.Del("csrf"); return f }(), nil, http.StatusForbidden},
		{"wrong csrf", func() url.Values { f := form(); f.Set("csrf", "x"+c.csrf); return f }(), nil, http.StatusForbidden},
		{"foreign origin", form(), map[string]string{"Origin": "http://evil.example"}, http.StatusForbidden},
		{"null origin", form(), map[string]string{"Origin": "null"}, http.StatusForbidden},
		{"no origin nor referer", form(), map[string]string{"Origin": ""}, http.StatusForbidden},
		{"foreign referer", form(), map[string]string{"Origin": "", "Referer": "http://evil.example/x"}, http.StatusForbidden},
		{"cross-site fetch", form(), map[string]string{"Sec-Fetch-Site": "cross-site"}, http.StatusForbidden},
		{"stale dry run", func() url.Values { f := form(); f.Set("confirm", "9/9/9/9/9/9/9"); return f }(), nil, http.StatusConflict},
		{"bad action", func() url.Values { f := form(); f.Set("action", "drop"); return f }(), nil, http.StatusBadRequest},
	}
	for _, tc := range cases {
		code, _, _ := c.post("/actions", tc.form, tc.headers)
		if code != tc.code {
			t.Errorf("%s: %d, want %d", tc.name, code, tc.code)
		}
	}
	// A same-origin Referer is accepted in place of Origin.
	if code, _, _ := c.post("/actions", func() url.Values { f := form(); f.Set("action", "x"); return f }(), map[string]string{"Origin": "", "Referer": b.ts.URL + "/dry-run"}); code != http.StatusBadRequest {
		t.Errorf("same-origin referer: %d", code)
	}
	if code, _, _ := c.get("/actions"); code != http.StatusMethodNotAllowed {
		t.Errorf("GET /actions: %d", code)
	}

	// A session that did not sign in may not act, CSRF token or not
	// (another session's included).
	anon := b.anonymous()
	anon.mustGet("/login")
	f := form()
	f.Set("csrf", anon.csrf)
	if code, _, _ := anon.post("/actions", f, nil); code != http.StatusUnauthorized {
		t.Errorf("anonymous: %d", code)
	}
	f.Set("csrf", c.csrf)
	if code, _, _ := anon.post("/actions", f, nil); code != http.StatusUnauthorized {
		t.Errorf("another session's CSRF token: %d", code)
	}
	// A signed-in session with another session's CSRF token is refused.
	other := b.client()
	f.Set("csrf", c.csrf)
	if code, _, _ := other.post("/actions", f, nil); code != http.StatusForbidden {
		t.Errorf("another session's CSRF token, signed in: %d", code)
	}
	if len(b.q.sent()) != 0 || b.q.len() != 6 {
		t.Errorf("a refused request changed the queue")
	}
}

func TestConsoleLogin(t *testing.T) {
	b := newBundle(t)
	c := b.anonymous()
	c.mustGet("/login")
	u, _ := url.Parse(b.ts.URL)
	before := c.http.Jar.Cookies(u)[0].Value
	if code, _, _ := c.post("/login", url.Values{"csrf": {c.csrf}, "token": {"wrong-secret"}}, nil); code != http.StatusUnauthorized {
		t.Errorf("wrong token: %d", code)
	}
	if code, _, _ := c.post("/login", url.Values{"token": {"alice-secret-1"}}, nil); code != http.StatusForbidden {
		t.Errorf("login without CSRF: %d", code)
	}
	code, _, h := c.post("/login", url.Values{"csrf": {c.csrf}, "token": {"alice-secret-1"}, "next": {"//evil.example/"}}, nil)
	if code != http.StatusSeeOther || h.Get("Location") != "/" {
		t.Errorf("login: %d to %q", code, h.Get("Location"))
	}
	sc := h.Get("Set-Cookie")
	for _, want := range []string{"HttpOnly", "SameSite=Strict", "Path=/"} {
		if !strings.Contains(sc, want) {
			t.Errorf("cookie %q lacks %s", sc, want)
		}
	}
	if after := c.http.Jar.Cookies(u)[0].Value; after == before {
		t.Errorf("the session id was not renewed at sign-in")
	}
	must(t, c.mustGet("/"), "signed in as <strong>alice</strong>")
	if code, _, _ := c.post("/logout", url.Values{"csrf": {c.csrf}}, nil); code != http.StatusSeeOther {
		t.Errorf("logout: %d", code)
	}
	// Signed out, every page goes to the sign-in page again.
	if code, _, h := c.get("/"); code != http.StatusSeeOther || !strings.HasPrefix(h.Get("Location"), "/login") {
		t.Errorf("GET / signed out: %d to %q", code, h.Get("Location"))
	}
}

func TestConsoleReadOnly(t *testing.T) {
	for name, opt := range map[string]option{"read-only": readOnly, "no token": noTokens} {
		t.Run(name, func(t *testing.T) {
			b := newBundle(t, opt)
			c := b.client()
			fp := b.fingerprint("pay-1")
			body := c.mustGet("/dry-run?" + sel(fp))
			mustNot(t, body, `id="confirm"`, `action="/actions"`, "Sign in with a token", `href="/login`)
			must(t, body, "read-only")
			c.mustGet("/login")
			// With tokens (read-only), every page needs a sign-in, so
			// it takes them; without, there is nothing to sign in for.
			want := map[string]int{"read-only": http.StatusSeeOther, "no token": http.StatusForbidden}[name]
			if code, _, _ := c.post("/login", url.Values{"csrf": {c.csrf}, "token": {"alice-secret-1"}}, nil); code != want {
				t.Errorf("login: %d, want %d", code, want)
			}
			f := url.Values{"dlq": {"memory:payments.dlq"}, "fp": {fp}, "csrf": {c.csrf}, "action": {"replay"}}
			if code, _, _ := c.post("/actions", f, nil); code != http.StatusForbidden {
				t.Errorf("action: %d", code)
			}
			if len(b.q.sent()) != 0 {
				t.Errorf("a read-only console replayed")
			}
		})
	}
}

func TestConsoleLookup(t *testing.T) {
	b := newBundle(t)
	c := b.client()
	body := c.mustGet("/lookup?consumer=ledger&id=pay-1")
	must(t, body, "<strong>Applied</strong>", "<dd>payments</dd>", "<dd>2</dd>", "<dd>1234</dd>",
		"1 in memory <code>payments.dlq</code>, class permanent")
	body = c.mustGet("/lookup?consumer=ledger&id=pay-2")
	must(t, body, "<strong>Not applied</strong>", "1 in memory")
	body = c.mustGet("/lookup?consumer=ledger&id=other-9")
	must(t, body, "<strong>Applied</strong>", "None in the dead-letter queues given.")
	body = c.mustGet("/lookup?key=key-1")
	must(t, body, "<dd>completed</dd>", "<dd>POST /orders</dd>", "<dd>201</dd>")
	must(t, c.mustGet("/lookup?key=nope"), "No such key.")
}

func TestConsoleErrorsRedacted(t *testing.T) {
	q := &memQueue{openErr: errors.New(`dial amqp://guest:hunter2hunter2@rabbit:5672/: connection refused`)}
	b := newBundle(t, withQueue(q))
	c := b.client()
	for _, path := range []string{"/", "/dead-letters", "/dry-run?" + sel("0123456789abcdef")} {
		body := c.mustGet(path)
		mustNot(t, body, "hunter2")
		must(t, body, "connection refused")
	}
}

func TestCheckAddr(t *testing.T) {
	for _, tc := range []struct {
		addr  string
		token bool
		ok    bool
	}{
		{"127.0.0.1:8080", false, true}, {"[::1]:8080", false, true}, {"localhost:8080", false, true},
		{"0.0.0.0:8080", false, false}, {":8080", false, false}, {"10.1.2.3:8080", false, false},
		{"0.0.0.0:8080", true, true}, {"nonsense", true, false},
	} {
		if err := CheckAddr(tc.addr, tc.token); (err == nil) != tc.ok {
			t.Errorf("CheckAddr(%q, %v) = %v", tc.addr, tc.token, err)
		}
	}
	b := newBundle(t, noTokens)
	err := ListenAndServe(context.Background(), "0.0.0.0:0", b.srv, nil)
	if err == nil || !strings.Contains(err.Error(), "not a loopback address") {
		t.Fatalf("ListenAndServe on 0.0.0.0 without a token: %v", err)
	}
}

func TestListenAndServe(t *testing.T) {
	b := newBundle(t)
	ctx, cancel := context.WithCancel(context.Background())
	addrc := make(chan net.Addr, 1)
	done := make(chan error, 1)
	go func() { done <- ListenAndServe(ctx, "127.0.0.1:0", b.srv, func(a net.Addr) { addrc <- a }) }()
	a := <-addrc
	resp, err := http.Get("http://" + a.String() + "/healthz")
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != 200 {
		t.Errorf("healthz: %d", resp.StatusCode)
	}
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
}

func TestParseToken(t *testing.T) {
	for in, want := range map[string]Token{"alice:s3cret-long": {"alice", "s3cret-long"}, "bare-secret-1": {"operator", "bare-secret-1"}} {
		if got, err := ParseToken(in); err != nil || got != want {
			t.Errorf("ParseToken(%q) = %v, %v", in, got, err)
		}
	}
	for _, bad := range []string{"", "alice:", ":secret-long", "short"} {
		if _, err := ParseToken(bad); err == nil {
			t.Errorf("ParseToken(%q) accepted", bad)
		}
	}
}

func TestConsoleHostHeader(t *testing.T) {
	b := newBundle(t)
	for host, code := range map[string]int{"127.0.0.1:1": 200, "localhost": 200, "[::1]:8080": 200, "evil.example": http.StatusMisdirectedRequest, "evil.example:8080": http.StatusMisdirectedRequest} {
		req, _ := http.NewRequest(http.MethodGet, b.ts.URL+"/", nil)
		req.Host = host
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != code {
			t.Errorf("Host %s: %d, want %d", host, resp.StatusCode, code)
		}
	}
	b2 := newBundle(t, func(c *Config) { c.AllowedHosts = []string{"console.internal"} })
	for host, code := range map[string]int{"console.internal:8080": 200, "127.0.0.1": http.StatusMisdirectedRequest} {
		req, _ := http.NewRequest(http.MethodGet, b2.ts.URL+"/healthz", nil)
		req.Host = host
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != code {
			t.Errorf("allowed console.internal, Host %s: %d, want %d", host, resp.StatusCode, code)
		}
	}
}

func TestConsoleQueueBusy(t *testing.T) {
	b := newBundle(t)
	defer func(d time.Duration) { lockWait = d }(lockWait)
	lockWait = 50 * time.Millisecond
	lock := b.srv.locks["memory:payments.dlq"]
	lock <- struct{}{}
	body := b.client().mustGet("/dead-letters")
	<-lock
	must(t, body, "is busy: a replay is running on it")
}

func TestConsoleReplayFailureRecorded(t *testing.T) {
	b := newBundle(t)
	b.q.pubErr = errors.New("publish to amqp://guest:hunter2hunter2@rabbit:5672/: channel closed")
	c := b.client()
	c.login("alice-secret-1")
	j := runAction(t, b, c, "replay", sel(b.fingerprint("pay-1")))
	if j.Outcome != "failed" || !strings.Contains(j.Error, "channel closed") || strings.Contains(j.Error, "hunter2") {
		t.Fatalf("job: %+v", j)
	}
	var outcome, msg string
	if err := b.pool.QueryRow(context.Background(), `SELECT outcome, error FROM `+b.schema+`.idemq_console_audit`).Scan(&outcome, &msg); err != nil {
		t.Fatal(err)
	}
	if outcome != "failed" || strings.Contains(msg, "hunter2") || !strings.Contains(msg, "channel closed") {
		t.Errorf("audit: %s %q", outcome, msg)
	}
	body := c.mustGet("/audit")
	must(t, body, "outcome-failed", "channel closed")
	mustNot(t, body, "hunter2")
	if b.q.len() != 5 {
		t.Errorf("DLQ holds %d, want 5 (only the applied pay-1 removed)", b.q.len())
	}
}

func TestConsoleNotMigrated(t *testing.T) {
	b := newBundle(t)
	if _, err := b.pool.Exec(context.Background(), `DROP TABLE `+b.schema+`.processed_messages`); err != nil {
		t.Fatal(err)
	}
	must(t, b.client().mustGet("/"), "processed_messages does not exist: run &#39;idemq migrate&#39;")
}
