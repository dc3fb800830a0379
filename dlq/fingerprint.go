package dlq

import (
	"crypto/sha256"
	"encoding/hex"
	"regexp"
	"strconv"
	"strings"
	"unicode/utf8"
)

// Placeholders that normalizeError puts in place of the parts of an error
// text that differ from one message to the next.
const (
	placeholderID     = "<id>"    // the message's own dedup id
	placeholderQuoted = "<q>"     // a quoted value: "...", '...' or `...`
	placeholderTime   = "<time>"  // a timestamp (RFC 3339, Go's time.Time and layouts, HTTP dates), or a date
	placeholderUUID   = "<uuid>"  // a UUID
	placeholderHex    = "<hex>"   // a hex id: 0x..., or a word of 8 or more hex digits, one of them decimal
	placeholderAddr   = "<addr>"  // an IPv4 address (with its port), or a bracketed IPv6 one
	placeholderEmail  = "<email>" // an e-mail address
	placeholderNumber = "<n>"     // a number, with what follows it in the same word (1.5s, 42nd, 0042x)
)

// normalizeTruncatedBytes bounds the normalised text of an error that the
// envelope truncated (Options.MaxErrorBytes): two such texts are cut at
// the same raw length, so their normalised tails differ whenever their
// variable parts differ in length; only a prefix well before the cut is
// comparable.
const normalizeTruncatedBytes = 256

// truncatedMark ends an error text that truncate cut.
const truncatedMark = "…[truncated]"

// A rule is one kind of variable part of an error text.
type rule int

const (
	ruleSQLState  rule = iota // "(SQLSTATE 23505)": kept, it names the cause
	ruleDQuoted               // "...", as %q writes it (escapes included)
	ruleBQuoted               // `...`, as %#q writes it
	ruleSQuoted               // '...'
	ruleTime                  // RFC 3339, Go's time.Time.String, a bare date
	ruleNamedTime             // a timestamp with English day and month names
	ruleUUID                  // a UUID
	ruleEmail                 // an e-mail address
	ruleAddr                  // an IPv4 address (and port), a bracketed IPv6 one
	ruleName                  // a name that holds digits (UTF-8, sha256): kept
	ruleHex                   // 0x..., or a word of 8 or more hex digits
	ruleNumber                // a number, with the rest of its word
)

// rulePatterns are the rules' regular expressions, each with exactly one
// capture group: the part the rule replaces or keeps. They are tried in
// this order at each position of the text.
var rulePatterns = [...]string{
	ruleSQLState: `(\(SQLSTATE [0-9A-Z]{5}\))`,
	ruleDQuoted:  `("(?:[^"\\\n]|\\.)*")`,
	ruleBQuoted:  "(`[^`\\n]*`)",
	// The quote opens at the start or after a non-word character (which
	// the match holds, outside the group), so the apostrophe of
	// "handler's" opens nothing.
	ruleSQuoted: `(?:^|[^A-Za-z0-9_'])('[^'\n]*')`,
	// T or a space, a fraction, Z or an offset; or Go's
	// "2006-01-02 15:04:05.999 -0700 MST m=+0.1"; or a date alone.
	ruleTime: `(\b\d{4}-\d{2}-\d{2}(?:[Tt ]\d{2}:\d{2}(?::\d{2}(?:[.,]\d+)?)?(?:[Zz]|[+-]\d{2}:?\d{2}| [+-]\d{4}(?: [A-Z]{2,5})?)?(?: m=[+-]\d+\.\d+)?)?)`,
	// Go's RFC 1123(Z), RFC 850, ANSIC and Unix date layouts, and HTTP
	// dates: the names vary with the day, so they go too.
	ruleNamedTime: `(\b(?:(?:Mon|Tue|Wed|Thu|Fri|Sat|Sun)[a-z]*,? )?(?:\d{1,2}[ -](?:Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec)[a-z]*[ -]\d{2,4}|(?:Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec)[a-z]* {1,2}\d{1,2}) \d{2}:\d{2}(?::\d{2}(?:\.\d+)?)?(?: [A-Z]{2,5}| [+-]\d{4})?(?: \d{4})?\b)`,
	ruleUUID:      `(\b[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}\b)`,
	ruleEmail:     `([A-Za-z0-9._%+\-]+@[A-Za-z0-9\-]+(?:\.[A-Za-z0-9\-]+)*\.[A-Za-z]{2,})`,
	ruleAddr:      `(\b\d{1,3}(?:\.\d{1,3}){3}(?::\d{1,5})?\b|\[[0-9a-fA-F:.]*:[0-9a-fA-F:.]*\](?::\d{1,5})?)`,
	// Encodings, hashes, types and protocols whose names hold digits:
	// words, not values. A whole word only: "sha2567" is not a hash.
	ruleName: `(?i:\b((?:utf-?(?:8|16|32)(?:le|be)?|iso-8859-\d{1,2}|sha-?(?:1|224|256|384|512)|md5|base(?:32|64)|u?int(?:8|16|32|64)|float(?:32|64)|ipv[46]|http/[123](?:\.[01])?)\b))`,
	// Replaced only if it holds a digit: "deadbeef" might be a word.
	ruleHex: `(\b0[xX][0-9a-fA-F]+\b|\b[0-9a-fA-F]{8,}\b)`,
	// 42, 1,000, 1.5s, 1h2m3.5s, 0042abc.
	ruleNumber: `(\d[A-Za-z0-9_]*(?:[.,]\d[A-Za-z0-9_]*)*)`,
}

// volatile matches, in one pass, every part of an error text that a rule
// replaces or keeps; the capture group that is set says which rule.
var volatile = regexp.MustCompile(strings.Join(rulePatterns[:], "|"))

// mayVary holds the bytes of which every rule's match holds at least one
// (a UUID or hex id without a decimal digit is kept as it is): a text
// without any of them is left as it is, without running volatile.
const mayVary = "0123456789\"'`@["

// objectKeywords are the words after which Postgres quotes the name of a
// schema object, not a value: `violates unique constraint "orders_pkey"`,
// `relation "ledger" does not exist`. Such a name says which constraint or
// table failed, so it is kept.
var objectKeywords = []string{
	"constraint", "relation", "table", "column", "index", "schema", "function", "type",
	"database", "role", "sequence", "trigger", "view", "extension", "domain", "operator", "collation",
}

// normalizeError returns the shape of an error text: the text with every
// part that differs from one message to the next replaced by a
// placeholder, so that the dead letters of one cause share one shape. It
// replaces, in this order of precedence (at each position of the text, the
// first rule that matches there wins):
//
//   - messageID, the message's own dedup id, wherever it stands as a
//     whole token (not inside a longer word), quoted or not, with
//     placeholderID; an id shorter than 3 bytes only where %q quoted it,
//     and is otherwise left to the rules below, which would otherwise
//     turn "attempt 1 of 5" into "attempt <id> of 5" for the message with
//     id "1";
//   - quoted strings ("...", with %q's escapes; `...`; and '...' that
//     opens after a non-word character, so no apostrophe opens one) with
//     placeholderQuoted, the quotes kept, except a name Postgres quotes
//     after a word such as constraint, relation, table or column, which
//     says what failed and is kept;
//   - timestamps (RFC 3339 with a T or a space, a fraction and a zone;
//     Go's time.Time.String form; bare dates; dates with English day and
//     month names, as in RFC 1123 and HTTP), UUIDs, e-mail addresses,
//     IP addresses with their port, and hex ids (0x..., or 8 or more hex
//     digits, one of them a decimal digit) with their placeholders;
//   - numbers, with the rest of their word and their decimals (1.5s,
//     1h2m3.5s, 42nd, 1,000), with placeholderNumber: "order-0042"
//     becomes "order-<n>", "user42" "user<n>".
//
// A SQLSTATE code, "(SQLSTATE 23505)", is kept: it names the cause. So are
// the names of encodings, hashes, types and protocols that hold digits, as
// whole words: UTF-8, UTF-16LE, ISO-8859-1, sha256, SHA-512, MD5, base64,
// int64, uint32, float64, IPv6, HTTP/1.1. Runs
// of white space become one space. A text the envelope truncated (it ends
// in "…[truncated]") keeps only the first 256 bytes of its shape, followed
// by "…": texts cut at the same length differ near the cut whenever their
// variable parts differ in length.
//
// The rules may be refined in later versions of idemq, which changes the
// shape (and Entry.Fingerprint) of some texts: compare shapes made by the
// same version.
func normalizeError(text, messageID string) string {
	truncated := strings.HasSuffix(text, truncatedMark)
	text = strings.TrimSuffix(text, truncatedMark)
	text = replaceID(text, messageID)
	var b strings.Builder
	b.Grow(len(text))
	last := 0
	var matches [][]int
	if strings.ContainsAny(text, mayVary) {
		matches = volatile.FindAllStringSubmatchIndex(text, -1)
	}
	for _, m := range matches {
		r := rule(0)
		for m[2*r+2] < 0 {
			r++
		}
		// Only the group is replaced: a single-quoted string's match
		// also holds the character before it, which stays.
		start, end := m[2*r+2], m[2*r+3]
		b.WriteString(text[last:start])
		b.WriteString(r.replace(text[start:end], text[:start]))
		last = end
	}
	b.WriteString(text[last:])
	out := strings.Join(strings.Fields(b.String()), " ")
	if truncated {
		if len(out) > normalizeTruncatedBytes {
			n := normalizeTruncatedBytes
			for n > 0 && !utf8.RuneStart(out[n]) {
				n--
			}
			out = out[:n]
		} else if i := strings.LastIndexByte(out, ' '); i > 0 {
			out = out[:i] // the last word may be cut
		}
		out += "…"
	}
	return out
}

// replace returns what normalizeError writes for tok, matched by r;
// before is the text before it.
func (r rule) replace(tok, before string) string {
	hasDigit := strings.ContainsAny(tok, "0123456789")
	switch r {
	case ruleDQuoted, ruleBQuoted, ruleSQuoted:
		inner := tok[1 : len(tok)-1]
		if inner == placeholderID || (r == ruleDQuoted && afterObjectKeyword(before)) {
			return tok
		}
		return tok[:1] + placeholderQuoted + tok[len(tok)-1:]
	case ruleTime, ruleNamedTime:
		return placeholderTime
	case ruleUUID:
		if hasDigit {
			return placeholderUUID
		}
	case ruleEmail:
		return placeholderEmail
	case ruleAddr:
		return placeholderAddr
	case ruleHex:
		switch {
		case strings.HasPrefix(tok, "0x") || strings.HasPrefix(tok, "0X"):
			return placeholderHex
		case strings.Trim(tok, "0123456789") == "":
			return placeholderNumber // a long number is a number
		case hasDigit:
			return placeholderHex
		}
	case ruleNumber:
		return placeholderNumber
	}
	return tok // ruleSQLState, ruleName, and a UUID or hex word without a digit
}

// afterObjectKeyword reports whether before ends in one of objectKeywords
// and a space: what follows is a quoted Postgres object name.
func afterObjectKeyword(before string) bool {
	before, ok := strings.CutSuffix(before, " ")
	if !ok {
		return false
	}
	for _, k := range objectKeywords {
		if rest, ok := strings.CutSuffix(before, k); ok && (rest == "" || !isWordByte(rest[len(rest)-1])) {
			return true
		}
	}
	return false
}

// replaceID replaces the whole-token occurrences of id in text, and of its
// %q-escaped form, with placeholderID.
func replaceID(text, id string) string {
	if id == "" {
		return text
	}
	if len(id) < 3 {
		// Only quoted, as %q writes it: "message id "42" was applied"
		// reads like "message id "order-0042" was applied".
		return strings.ReplaceAll(text, strconv.Quote(id), `"`+placeholderID+`"`)
	}
	text = replaceToken(text, id)
	if q := strconv.Quote(id); q[1:len(q)-1] != id {
		text = replaceToken(text, q[1:len(q)-1])
	}
	return text
}

// replaceToken replaces the occurrences of tok in text that are not part
// of a longer word.
func replaceToken(text, tok string) string {
	var b strings.Builder
	for {
		i := strings.Index(text, tok)
		if i < 0 {
			break
		}
		j := i + len(tok)
		if (i > 0 && isWordByte(text[i-1]) && isWordByte(tok[0])) || (j < len(text) && isWordByte(text[j]) && isWordByte(tok[len(tok)-1])) {
			b.WriteString(text[:i+1])
			text = text[i+1:]
			continue
		}
		b.WriteString(text[:i])
		b.WriteString(placeholderID)
		text = text[j:]
	}
	if b.Len() == 0 {
		return text
	}
	b.WriteString(text)
	return b.String()
}

func isWordByte(c byte) bool {
	return c == '_' || c >= '0' && c <= '9' || c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= 0x80
}

// Fingerprint identifies the kind of failure e is: a digest of the
// consumer, the original source, the error class and the shape of the
// error text (the text with its variable parts, the entry's message id
// among them, replaced by placeholders: see the package doc). Dead letters
// of one cause share it although each error text names its own id, times
// and values; Inspect groups by it, and so should anything else that
// groups dead letters, so that the groups agree. It is 16 lower-case hex
// digits.
//
// The shape's rules may be refined in later versions of idemq, which
// changes the fingerprint of some texts: compare fingerprints made by the
// same version.
func (e Entry) Fingerprint() string {
	return e.fingerprint(normalizeError(e.Error, e.MessageID))
}

// fingerprint is Fingerprint given the shape of e's error text.
func (e Entry) fingerprint(shape string) string {
	h := sha256.New()
	for _, s := range []string{e.Consumer, e.Source, string(e.Class), shape} {
		h.Write([]byte(strconv.Itoa(len(s))))
		h.Write([]byte{':'})
		h.Write([]byte(s))
	}
	return hex.EncodeToString(h.Sum(nil)[:8])
}
