package console

import (
	"net/http"
	"net/url"
	"strings"
	"testing"
)

// TestConsoleAnonymousRefused: with tokens configured (the console may then
// listen beyond loopback), no page but the sign-in page, its static files
// and the health check is served to a session that has not signed in: a
// GET goes to the sign-in page, with the page to come back to, and shows
// none of the dead letters, rows or keys. Without tokens (loopback,
// read-only) every page is served as before.
func TestConsoleAnonymousRefused(t *testing.T) {
	b := newBundle(t)
	anon := b.anonymous()
	for _, path := range []string{"/", "/dead-letters?dlq=memory:payments.dlq", "/group?dlq=memory:payments.dlq&fp=x",
		"/dry-run?dlq=memory:payments.dlq", "/jobs/1", "/audit", "/lookup?consumer=ledger&id=pay-1", "/lookup?key=key-1", "/nope"} {
		code, body, h := anon.get(path)
		if code != http.StatusSeeOther || h.Get("Location") != "/login?next="+url.QueryEscape(path) {
			t.Errorf("anonymous GET %s: %d to %q, want 303 to the sign-in page", path, code, h.Get("Location"))
		}
		mustNot(t, body, "card 4242", "<strong>Applied</strong>", "POST /orders", "<dd>completed</dd>")
	}
	if code, _, _ := anon.post("/actions", url.Values{"action": {"replay"}}, nil); code != http.StatusUnauthorized {
		t.Errorf("anonymous POST /actions: %d, want 401", code)
	}
	for _, path := range []string{"/login", "/healthz", "/static/console.css"} {
		if code, body, _ := anon.get(path); code != http.StatusOK {
			t.Errorf("anonymous GET %s: %d\n%s", path, code, body)
		}
	}
	anon.login("alice-secret-1")
	must(t, anon.mustGet("/lookup?consumer=ledger&id=pay-1"), "<strong>Applied</strong>")

	open := newBundle(t, noTokens).anonymous()
	must(t, open.mustGet("/lookup?consumer=ledger&id=pay-1"), "<strong>Applied</strong>")
}

// TestConsoleReadOnlyWithTokensSignsIn: a read-only console with tokens
// still needs a session to be read, so it takes sign-ins; it runs no action.
func TestConsoleReadOnlyWithTokensSignsIn(t *testing.T) {
	b := newBundle(t, readOnly)
	c := b.anonymous()
	c.login("alice-secret-1")
	body := c.mustGet("/dry-run?" + sel(b.fingerprint("pay-1")))
	mustNot(t, body, `id="confirm"`)
	must(t, body, "read-only")
}

// TestConsoleSignInForms: the token is accepted as the secret alone or as
// name:secret, the form it is configured in (IDEMQ_CONSOLE_TOKEN=alice:...),
// and the sign-in page says so.
func TestConsoleSignInForms(t *testing.T) {
	b := newBundle(t)
	for _, typed := range []string{"alice-secret-1", "alice:alice-secret-1", "  alice:alice-secret-1 "} {
		c := b.anonymous()
		c.login(typed)
		must(t, c.mustGet("/"), "signed in as <strong>alice</strong>")
	}
	c := b.anonymous()
	must(t, c.mustGet("/login"), "name:secret")
	c.mustGet("/login")
	for _, typed := range []string{"bob:alice-secret-1", "alice:wrong-secret", "alice", ":alice-secret-1"} {
		if code, _, _ := c.post("/login", url.Values{"csrf": {c.csrf}, "token": {typed}}, nil); code != http.StatusUnauthorized {
			t.Errorf("sign-in with %q: %d, want 401", typed, code)
		}
	}
}

// TestConsoleNextStaysOnTheConsole: the page to come back to after sign-in
// must resolve to this console: browsers drop tabs and newlines from a URL
// and read a backslash as a slash, so "/\t/evil.example" is
// "//evil.example", another host.
func TestConsoleNextStaysOnTheConsole(t *testing.T) {
	for next, want := range map[string]string{
		"/dead-letters?dlq=memory:payments.dlq": "/dead-letters?dlq=memory:payments.dlq",
		"/":                                     "/",
		"/\t/evil.example":                      "/",
		"/\n/evil.example":                      "/",
		"/\r/evil.example":                      "/",
		"/ /evil.example":                       "/",
		"//evil.example/":                       "/",
		"/\\evil.example":                       "/",
		"\\\\evil.example":                      "/",
		"https://evil.example/":                 "/",
		"http:/evil.example":                    "/",
		"javascript:alert(1)":                   "/",
		"":                                      "/",
		"/%09/evil.example":                     "/%09/evil.example",
	} {
		if got := safeNext(next); got != want {
			t.Errorf("safeNext(%q) = %q, want %q", next, got, want)
		}
		if strings.HasPrefix(safeNext(next), "//") {
			t.Errorf("safeNext(%q) leaves the console", next)
		}
	}
}
