// Package redact keeps passwords in Postgres DSNs and broker URLs out of
// errors and logs.
//
// It covers what docs/security.md promises: the password in a
// URL's user info, password= and sslpassword= in a URL's query or in a
// key/value DSN, quoted or not, even when the string cannot be parsed.
// [DSN] and [URL] make a string safe to show; [Error] masks the passwords
// of the given DSNs or URLs wherever they appear in an error's text, for
// errors that third-party code built from the raw string.
package redact

import (
	"net/url"
	"regexp"
	"sort"
	"strings"
)

// Mask replaces every password.
const Mask = "xxxxx"

// DSN returns a postgres:// or postgresql:// URL with the password of its
// user info and its password and sslpassword query parameters masked. A
// key/value DSN, or anything else that is not such a URL, is not shown at
// all: it returns "(the DSN)".
func DSN(s string) string {
	u, err := url.Parse(s)
	if err != nil || (u.Scheme != "postgres" && u.Scheme != "postgresql") {
		return "(the DSN)"
	}
	return maskURL(u)
}

// URL returns rawURL, of any scheme (amqp://, amqps://, postgres://...),
// with the password of its user info and its password and sslpassword query
// parameters masked, or "(unparseable URL)" if it cannot be parsed.
func URL(rawURL string) string {
	u, err := url.Parse(rawURL)
	if err != nil {
		return "(unparseable URL)"
	}
	return maskURL(u)
}

func maskURL(u *url.URL) string {
	q := u.Query()
	for _, k := range []string{"password", "sslpassword"} {
		if q.Has(k) {
			q.Set(k, Mask)
		}
	}
	u.RawQuery = q.Encode()
	return u.Redacted()
}

// passwordRE finds password settings in a key/value DSN or a URL query,
// however malformed the rest is.
var passwordRE = regexp.MustCompile(`(?i)(?:ssl)?password\s*=\s*('(?:[^'\\]|\\.)*'?|[^\s&]+)`)

// Error returns err with every password found in the given DSNs or URLs
// (several in one string included, as in a comma-separated list) masked
// in its text; nil if err is nil. pgx redacts its own parse errors
// only on a best-effort basis, and says so; net/url's errors quote the
// whole URL. This makes sure no password reaches the terminal or a log. The
// result still unwraps to err. Passwords shorter than 3 bytes are not
// masked: they cannot be told apart from the rest of the text.
func Error(err error, dsns ...string) error {
	if err == nil {
		return nil
	}
	var secrets []string
	add := func(s string) {
		if len(s) >= 3 {
			secrets = append(secrets, s)
		}
		if u, uerr := url.QueryUnescape(s); uerr == nil && u != s && len(u) >= 3 {
			secrets = append(secrets, u)
		}
	}
	for _, dsn := range dsns {
		for _, m := range passwordRE.FindAllStringSubmatch(dsn, -1) {
			add(m[1])
			add(strings.Trim(m[1], "'"))
		}
		// Every URL in the string, for a list mistaken for one URL: the
		// user information of each runs from its "://" to the last "@"
		// before the next "://" (net/url takes the last "@" too).
		parts := strings.Split(dsn, "://")
		for _, rest := range parts[1:] {
			if at := strings.LastIndex(rest, "@"); at >= 0 {
				if _, pw, ok := strings.Cut(rest[:at], ":"); ok {
					add(pw)
				}
			}
		}
	}
	msg := err.Error()
	sort.Slice(secrets, func(i, j int) bool { return len(secrets[i]) > len(secrets[j]) })
	for _, s := range secrets {
		msg = strings.ReplaceAll(msg, s, Mask)
	}
	return &scrubbedError{msg: msg, err: err}
}

// scrubbedError is an error whose text had secrets masked.
type scrubbedError struct {
	msg string
	err error
}

func (e *scrubbedError) Error() string { return e.msg }
func (e *scrubbedError) Unwrap() error { return e.err }
