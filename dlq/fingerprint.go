package dlq

import (
	"crypto/sha256"
	"encoding/hex"
	"regexp"
	"strconv"
	"strings"
	"unicode/utf8"
)

// Placeholders that NormalizeError puts in place of the parts of an error
// text that differ from one message to the next.
const (
	PlaceholderID     = "<id>"    // the message's own dedup id
	PlaceholderQuoted = "<q>"     // a quoted value: "...", '...' or `...`
	PlaceholderTime   = "<time>"  // an RFC 3339 (or Go time.Time) timestamp, or a date
	PlaceholderUUID   = "<uuid>"  // a UUID
	PlaceholderHex    = "<hex>"   // a hex id: 0x..., or 8 or more hex digits with a digit among them
	PlaceholderAddr   = "<addr>"  // an IPv4 address (with its port), or a bracketed IPv6 one
	PlaceholderEmail  = "<email>" // an e-mail address
	PlaceholderNumber = "<n>"     // a number, with what follows it in the same word (1.5s, 42nd, 0042x)
)

// normalizeTruncatedBytes bounds the normalised text of an error that the
// envelope truncated (Options.MaxErrorBytes): two such texts are cut at
// the same raw length, so their normalised tails differ whenever their
// variable parts differ in length; only a prefix well before the cut is
// comparable.
const normalizeTruncatedBytes = 256

// truncatedMark ends an error text that truncate cut.
const truncatedMark = "…[truncated]"

// volatile matches, in one pass, every part of an error text that
// NormalizeError replaces or protects. Alternatives are tried in order at
// each position; the submatch that is set says which one matched.
var volatile = regexp.MustCompile(strings.Join([]string{
	// 1: a SQLSTATE code, kept as it is: it names the cause.
	`(\(SQLSTATE [0-9A-Z]{5}\))`,
	// 2: a double-quoted string, as written by %q (escapes included).
	`("(?:[^"\\\n]|\\.)*")`,
	// 3: a back-quoted string (%#q).
	"(`[^`\\n]*`)",
	// 4: a single-quoted string: the quote opens at the start or after a
	// non-word character, so the apostrophe of "handler's" opens nothing.
	`(?:^|[^A-Za-z0-9_'])('[^'\n]*')`,
	// 5: a timestamp: RFC 3339 (T or space, fraction, Z or offset), Go's
	// time.Time.String form (" +0000 UTC m=+0.1"), or a bare date.
	`(\b\d{4}-\d{2}-\d{2}(?:[Tt ]\d{2}:\d{2}(?::\d{2}(?:[.,]\d+)?)?(?:[Zz]|[+-]\d{2}:?\d{2}| [+-]\d{4}(?: [A-Z]{2,5})?)?(?: m=[+-]\d+\.\d+)?)?)`,
	// 6: a UUID.
	`(\b[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}\b)`,
	// 7: an e-mail address.
	`([A-Za-z0-9._%+\-]+@[A-Za-z0-9\-]+(?:\.[A-Za-z0-9\-]+)*\.[A-Za-z]{2,})`,
	// 8: an IPv4 address with an optional port, or a bracketed IPv6 one.
	`(\b\d{1,3}(?:\.\d{1,3}){3}(?::\d{1,5})?\b|\[[0-9a-fA-F:.]*:[0-9a-fA-F:.]*\](?::\d{1,5})?)`,
	// 9: a hex id: 0x-prefixed, or a word of 8 or more hex digits
	// (replaced only if it holds a digit: "deadbeef" might be a word).
	`(\b0[xX][0-9a-fA-F]+\b|\b[0-9a-fA-F]{8,}\b)`,
	// 10: a number, with the rest of its word: 42, 1,000, 1.5s, 2m0s,
	// 0042abc.
	`(\d+(?:[.,]\d+)*[A-Za-z0-9_]*)`,
}, "|"))

// objectKeywords are the words after which Postgres quotes the name of a
// schema object, not a value: `violates unique constraint "orders_pkey"`,
// `relation "ledger" does not exist`. Such a name says which constraint or
// table failed, so it is kept.
var objectKeywords = []string{
	"constraint", "relation", "table", "column", "index", "schema", "function", "type",
	"database", "role", "sequence", "trigger", "view", "extension", "domain", "operator", "collation",
}

// NormalizeError returns the shape of an error text: the text with every
// part that differs from one message to the next replaced by a
// placeholder, so that the dead letters of one cause share one shape. It
// replaces, in this order of precedence:
//
//   - messageID, the message's own dedup id, wherever it stands as a
//     whole token (not inside a longer word), quoted or not, with
//     PlaceholderID; ids shorter than 3 bytes are left to the rules below,
//     which would otherwise turn "attempt 1 of 5" into "attempt <id> of 5"
//     for the message with id "1";
//   - quoted strings ("...", with %q's escapes; `...`; and '...' that
//     opens after a non-word character, so no apostrophe opens one) with
//     PlaceholderQuoted, the quotes kept, except a name Postgres quotes
//     after a word such as constraint, relation, table or column, which
//     says what failed and is kept;
//   - timestamps (RFC 3339 with a T or a space, a fraction and a zone;
//     Go's time.Time.String form; bare dates), UUIDs, e-mail addresses,
//     IP addresses with their port, and hex ids (0x..., or 8 or more hex
//     digits, one of them a decimal digit) with their placeholders;
//   - numbers, with the rest of their word (1.5s, 2m0s, 42nd), with
//     PlaceholderNumber: "order-0042" becomes "order-<n>".
//
// A SQLSTATE code, "(SQLSTATE 23505)", is kept: it names the cause. Runs
// of white space become one space. A text the envelope truncated (it ends
// in "…[truncated]") keeps only the first 256 bytes of its shape, followed
// by "…": texts cut at the same length differ near the cut whenever their
// variable parts differ in length.
//
// The rules may be refined in later versions of idemq, which changes the
// shape (and FailureFingerprint) of some texts: compare shapes made by the
// same version.
func NormalizeError(text, messageID string) string {
	truncated := strings.HasSuffix(text, truncatedMark)
	text = strings.TrimSuffix(text, truncatedMark)
	text = replaceID(text, messageID)
	var b strings.Builder
	b.Grow(len(text))
	last := 0
	for _, m := range volatile.FindAllStringSubmatchIndex(text, -1) {
		group := 0
		for g := 1; 2*g < len(m); g++ {
			if m[2*g] >= 0 {
				group = g
				break
			}
		}
		// Only the group is replaced: a single-quoted string's match
		// also holds the character before it, which stays.
		start, end := m[2*group], m[2*group+1]
		tok := text[start:end]
		b.WriteString(text[last:start])
		b.WriteString(replacement(group, tok, text[:start]))
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

// replacement is what NormalizeError writes for token, matched by the
// volatile alternative group; before is the text before it.
func replacement(group int, tok, before string) string {
	switch group {
	case 1: // SQLSTATE
		return tok
	case 2, 3, 4: // quoted
		inner := tok[1 : len(tok)-1]
		if inner == PlaceholderID || (group == 2 && afterObjectKeyword(before)) {
			return tok
		}
		return tok[:1] + PlaceholderQuoted + tok[len(tok)-1:]
	case 5:
		return PlaceholderTime
	case 6:
		return PlaceholderUUID
	case 7:
		return PlaceholderEmail
	case 8:
		return PlaceholderAddr
	case 9:
		switch {
		case strings.HasPrefix(tok, "0x") || strings.HasPrefix(tok, "0X"):
			return PlaceholderHex
		case strings.Trim(tok, "0123456789") == "":
			return PlaceholderNumber // a long number is a number
		case strings.ContainsAny(tok, "0123456789"):
			return PlaceholderHex
		}
		return tok
	case 10:
		return PlaceholderNumber
	}
	return tok
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
// %q-escaped form, with PlaceholderID.
func replaceID(text, id string) string {
	if len(id) < 3 {
		return text
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
		b.WriteString(PlaceholderID)
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

// FailureFingerprint identifies the kind of a failure: a digest of the
// consumer, the original source, the error class and the shape of the
// error text (NormalizeError, with the entry's message id). Dead letters of
// one cause share it although each error text names its own id, times and
// values; Inspect groups by it, and so should anything else that groups
// dead letters, so that the groups agree. It is 16 lower-case hex digits.
func FailureFingerprint(e Entry) string {
	return fingerprintOf(e, NormalizeError(e.Error, e.MessageID))
}

func fingerprintOf(e Entry, shape string) string {
	h := sha256.New()
	for _, s := range []string{e.Consumer, e.Source, string(e.Class), shape} {
		h.Write([]byte(strconv.Itoa(len(s))))
		h.Write([]byte{':'})
		h.Write([]byte(s))
	}
	return hex.EncodeToString(h.Sum(nil)[:8])
}
