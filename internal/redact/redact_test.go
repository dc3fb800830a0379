package redact_test

import (
	"errors"
	"fmt"
	"net/url"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/idemq/idemq/internal/redact"
)

// secret is the password every URL below carries.
const secret = "hunter2Secret"

func TestDSN(t *testing.T) {
	for _, c := range []struct{ in, want string }{
		{"postgres://app:" + secret + "@127.0.0.1:5432/test?sslmode=disable", "postgres://app:xxxxx@127.0.0.1:5432/test?sslmode=disable"},
		{"postgresql://app:" + secret + "@127.0.0.1/test", "postgresql://app:xxxxx@127.0.0.1/test"},
		{"postgres://app@127.0.0.1/test?password=" + secret + "&sslmode=disable", "postgres://app@127.0.0.1/test?password=xxxxx&sslmode=disable"},
		{"postgres://app@127.0.0.1/test?sslpassword=" + secret, "postgres://app@127.0.0.1/test?sslpassword=xxxxx"},
		{"postgres://app@127.0.0.1/test", "postgres://app@127.0.0.1/test"},
		{"host=127.0.0.1 user=app password=" + secret, "(the DSN)"},
		{"host=127.0.0.1 user=app sslpassword='" + secret + "'", "(the DSN)"},
		{"postgres://app:" + secret + "@127.0.0.1:notaport/test", "(the DSN)"},
		{"postgres://app:" + secret + "%zz@127.0.0.1/test", "(the DSN)"},
		{"postgres://app:" + secret + "@[::1/test", "(the DSN)"},
		{"amqp://app:" + secret + "@127.0.0.1/", "(the DSN)"},
	} {
		if got := redact.DSN(c.in); got != c.want {
			t.Errorf("DSN(%q) = %q, want %q", c.in, got, c.want)
		}
	}
}

func TestURL(t *testing.T) {
	for _, c := range []struct{ in, want string }{
		{"amqp://app:" + secret + "@127.0.0.1:5672/", "amqp://app:xxxxx@127.0.0.1:5672/"},
		{"amqps://app:" + secret + "@127.0.0.1/vhost", "amqps://app:xxxxx@127.0.0.1/vhost"},
		{"amqp://guest@127.0.0.1:5672/", "amqp://guest@127.0.0.1:5672/"},
		{"postgres://app@127.0.0.1/test?password=" + secret, "postgres://app@127.0.0.1/test?password=xxxxx"},
		{"amqp://app:" + secret + "@127.0.0.1:notaport/", "(unparseable URL)"},
		{"amqp://app:" + secret + "%zz@127.0.0.1/", "(unparseable URL)"},
		{"amqp://app:" + secret + "@[::1/", "(unparseable URL)"},
	} {
		if got := redact.URL(c.in); got != c.want {
			t.Errorf("URL(%q) = %q, want %q", c.in, got, c.want)
		}
	}
}

// TestError masks the password of every shape docs/security.md
// names, in errors that quote the string whole (as net/url's do) and in
// pgx's own parse errors.
func TestError(t *testing.T) {
	for _, dsn := range []string{
		"postgres://app:" + secret + "@127.0.0.1:5432/test",
		"postgres://app:" + url.QueryEscape(secret+"/ü") + "@127.0.0.1:5432/test", // percent-encoded
		"postgres://app@127.0.0.1/test?password=" + secret,
		"postgres://app@127.0.0.1/test?sslmode=require&sslpassword=" + secret,
		"host=127.0.0.1 user=app password=" + secret,
		"host=127.0.0.1 user=app password='" + secret + "' dbname=test",
		"host=127.0.0.1 user=app sslpassword=" + secret,
		"host=127.0.0.1 user=app password = " + secret,
		"host=127.0.0.1 user=app password='" + secret, // unterminated quote
		"postgres://app:" + secret + "@127.0.0.1:notaport/test",
		"postgres://app:" + secret + "%zz@127.0.0.1/test",
		"postgres://app:" + secret + "@[::1/test",
		"amqp://app:" + secret + "@127.0.0.1:5672/",
		"amqp://app:" + secret + "@127.0.0.1:notaport/",
	} {
		t.Run(dsn, func(t *testing.T) {
			base := errors.New("base")
			quoted := fmt.Errorf("connect %s (unescaped %s): %w", dsn, mustUnescape(dsn), base)
			got := redact.Error(quoted, "postgres://other@127.0.0.1/x", dsn)
			if strings.Contains(got.Error(), secret) {
				t.Fatalf("password leaked: %s", got)
			}
			if !strings.Contains(got.Error(), redact.Mask) {
				t.Errorf("nothing masked: %s", got)
			}
			if !errors.Is(got, base) {
				t.Errorf("%v does not unwrap to its cause", got)
			}
			if _, err := pgx.ParseConfig(dsn); err != nil {
				if got := redact.Error(err, dsn); strings.Contains(got.Error(), secret) {
					t.Fatalf("password leaked from pgx's parse error: %s", got)
				}
			}
			if _, err := url.Parse(dsn); err != nil {
				if got := redact.Error(err, dsn); strings.Contains(got.Error(), secret) {
					t.Fatalf("password leaked from net/url's parse error: %s", got)
				}
			}
		})
	}
	if redact.Error(nil, "postgres://app:"+secret+"@h/") != nil {
		t.Error("Error(nil) is not nil")
	}
}

// TestErrorURLList: a string that holds several URLs, as a comma-separated
// list mistaken for one URL does, has each URL's password masked, also
// where an error quotes only a part of it (a broker that echoes the rest
// of the list as a vhost name).
func TestErrorURLList(t *testing.T) {
	list := "amqp://guest:guest@127.0.0.1:5672/,amqp://app:" + secret + "@127.0.0.1:5673/,amqps://ops:" + secret + "2@h/"
	echo := errors.New(`Exception (402) Reason: "NOT_ALLOWED - vhost ,amqp://app:` + secret + `@127.0.0.1:5673/,amqps://ops:` + secret + `2@h/ not found"`)
	got := redact.Error(echo, list).Error()
	if strings.Contains(got, secret) || strings.Contains(got, "guest:guest") {
		t.Fatalf("password leaked: %s", got)
	}
	if want := "amqp://app:" + redact.Mask + "@127.0.0.1:5673/"; !strings.Contains(got, want) {
		t.Errorf("%s lacks %s", got, want)
	}
}

// mustUnescape returns s unescaped, or s if it does not unescape.
func mustUnescape(s string) string {
	if u, err := url.QueryUnescape(s); err == nil {
		return u
	}
	return s
}
