package consumer

import (
	"strings"
	"testing"
	"unicode/utf8"
)

// FuzzIDExtraction: the id extractors never panic, whatever the headers,
// and return exactly the broker id or the named header's value.
func FuzzIDExtraction(f *testing.F) {
	f.Add("id-1", "Idempotency-Key", "key-1", "other", "x", true)
	f.Add("", "", "", "", "", false)
	f.Add("\x00\xff", "Idempotency-Key", "\r\n\x1b", "Idempotency-Key", "last", true)
	f.Fuzz(func(t *testing.T, id, name, value, k2, v2 string, withHeaders bool) {
		m := &Message{ID: id}
		if withHeaders {
			m.Headers = map[string]string{name: value, k2: v2}
		}
		if got, err := idFromMessage(m); got != id || err != nil {
			t.Fatalf("idFromMessage = %q, %v", got, err)
		}
		want := ""
		if withHeaders {
			want = m.Headers[name]
		}
		if got, err := IDFromHeader(name)(m); got != want || err != nil {
			t.Fatalf("IDFromHeader(%q) = %q, %v; want %q", name, got, err, want)
		}
		var nilMsg *Message
		if nilMsg.Header(name) != "" {
			t.Fatal("Header on a nil message")
		}
	})
}

// FuzzIDText: the runtime's check for ids Postgres can store accepts
// exactly valid UTF-8 without NUL bytes, and toText turns anything into
// such text, leaving storable strings unchanged.
func FuzzIDText(f *testing.F) {
	f.Add("plain")
	f.Add("nul\x00")
	f.Add("\xff\xfe\xc3\x28")
	f.Add("é\u2028\r\n\x1b")
	f.Fuzz(func(t *testing.T, s string) {
		ok := isText(s)
		if ok != (utf8.ValidString(s) && !strings.ContainsRune(s, 0)) {
			t.Fatalf("isText(%q) = %v", s, ok)
		}
		out := toText(s)
		if !isText(out) {
			t.Fatalf("toText(%q) = %q, not storable", s, out)
		}
		if ok && out != s {
			t.Fatalf("toText changed storable %q to %q", s, out)
		}
	})
}
