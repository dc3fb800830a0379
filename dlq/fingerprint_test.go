package dlq_test

import (
	"context"
	"errors"
	"fmt"
	"regexp"
	"strings"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/idemq/idemq/brokers/memory"
	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/dlq"
)

func TestNormalizeError(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name, id, text, want string
	}{
		// The runtime's own texts (consumer/attempt.go, settle.go, errors.go).
		{"mismatch", "order-0003",
			`message id "order-0003" was applied at 2026-12-01T08:00:00.123456789Z with a different payload`,
			`message id "<id>" was applied at <time> with a different payload`},
		{"mismatch in a batch", "o-117",
			`message id "o-117" was applied earlier in the same batch with a different payload`,
			`message id "<id>" was applied earlier in the same batch with a different payload`},
		{"mismatch, id with a quote", `a"b-12`,
			`message id "a\"b-12" was applied at 2026-12-01T08:00:00Z with a different payload`,
			`message id "<id>" was applied at <time> with a different payload`},
		{"too large", "pay-1",
			`body is 2097152 bytes, over the 1048576-byte limit`,
			`body is <n> bytes, over the <n>-byte limit`},
		{"id too long", "",
			`extract message id: message id is 600 bytes, over the 512-byte limit`,
			`extract message id: message id is <n> bytes, over the <n>-byte limit`},
		{"id not UTF-8", "",
			`extract message id: message id "\xff\x00ab" is not valid UTF-8 text (or holds a NUL byte), which Postgres cannot store`,
			`extract message id: message id "<q>" is not valid UTF-8 text (or holds a NUL byte), which Postgres cannot store`},
		// Names that hold digits are words, not values: they stay.
		{"names with digits", "m-1",
			`decode UTF-16LE as utf8 then ISO-8859-15: sha256 and SHA-512 of base64 body differ (int64, float32, IPv6, HTTP/1.1, MD5) for acct-42 at step 3`,
			`decode UTF-16LE as utf8 then ISO-8859-15: sha256 and SHA-512 of base64 body differ (int64, float32, IPv6, HTTP/1.1, MD5) for acct-<n> at step <n>`},
		{"a name inside a longer word is not a name", "m-1", `xutf8 base640 sha2567`, `xutf<n> base<n> sha<n>`},
		{"no id", "", `extract message id: message has no id`, `extract message id: message has no id`},
		{"MessageID panicked", "",
			`extract message id: MessageID function panicked: runtime error: invalid memory address or nil pointer dereference`,
			`extract message id: MessageID function panicked: runtime error: invalid memory address or nil pointer dereference`},
		{"panic index", "m-1", `handler panic: runtime error: index out of range [7] with length 3`,
			`handler panic: runtime error: index out of range [<n>] with length <n>`},
		{"panic value", "m-1", `handler panic: unexpected account acct-42 in order m-1`,
			`handler panic: unexpected account acct-<n> in order <id>`},
		{"statement ignored", "m-1",
			`commit: a statement in the handler's transaction failed and the handler returned nil, ignoring its error: ` +
				`Postgres aborted the transaction, so nothing was applied (return the statement's error, or run the statement in a savepoint with tx.Begin to recover from it): ` +
				`ERROR: current transaction is aborted, commands ignored until end of transaction block (SQLSTATE 25P02)`,
			`commit: a statement in the handler's transaction failed and the handler returned nil, ignoring its error: ` +
				`Postgres aborted the transaction, so nothing was applied (return the statement's error, or run the statement in a savepoint with tx.Begin to recover from it): ` +
				`ERROR: current transaction is aborted, commands ignored until end of transaction block (SQLSTATE 25P02)`},
		{"connection losses", "m-1",
			`its transaction lost the database connection 5 times while the database stayed reachable (a statement that kills its backend, ` +
				`idle_in_transaction_session_timeout under a slow handler, a proxy limit): handler: database connection lost: ` +
				`read tcp 127.0.0.1:54012->127.0.0.1:5432: read: connection reset by peer`,
			`its transaction lost the database connection <n> times while the database stayed reachable (a statement that kills its backend, ` +
				`idle_in_transaction_session_timeout under a slow handler, a proxy limit): handler: database connection lost: ` +
				`read tcp <addr>-><addr>: read: connection reset by peer`},
		{"IPv6", "", `dial tcp [::1]:5432: connect: connection refused`, `dial tcp <addr>: connect: connection refused`},

		// Postgres errors: the SQLSTATE and the quoted object names stay,
		// the quoted values go.
		{"unique violation", "m-1",
			`ERROR: duplicate key value violates unique constraint "orders_pkey" (SQLSTATE 23505)`,
			`ERROR: duplicate key value violates unique constraint "orders_pkey" (SQLSTATE 23505)`},
		{"not null", "m-1",
			`insert: ERROR: null value in column "amount" of relation "ledger" violates not-null constraint (SQLSTATE 23502)`,
			`insert: ERROR: null value in column "amount" of relation "ledger" violates not-null constraint (SQLSTATE 23502)`},
		{"invalid input", "m-1",
			`ERROR: invalid input syntax for type integer: "12x" (SQLSTATE 22P02)`,
			`ERROR: invalid input syntax for type integer: "<q>" (SQLSTATE 22P02)`},
		{"too long", "m-1", `ERROR: value too long for type character varying(10) (SQLSTATE 22001)`,
			`ERROR: value too long for type character varying(<n>) (SQLSTATE 22001)`},
		{"missing relation", "m-1", `ERROR: relation "public.ledger" does not exist (SQLSTATE 42P01)`,
			`ERROR: relation "public.ledger" does not exist (SQLSTATE 42P01)`},
		{"serialization", "m-1", `commit: ERROR: could not serialize access due to concurrent update (SQLSTATE 40001)`,
			`commit: ERROR: could not serialize access due to concurrent update (SQLSTATE 40001)`},

		// Handler errors.
		{"permanent, double quotes", "order-001", `permanent: parse order: unknown currency "EUR" (handler bug)`,
			`permanent: parse order: unknown currency "<q>" (handler bug)`},
		{"single quotes and apostrophes", "order-001", `permanent: can't parse 'shipped ': the handler's input for order-001`,
			`permanent: can't parse '<q>': the handler's input for <id>`},
		{"adjacent single quotes", "m-1", `'a' 'b','c' ('d')`, `'<q>' '<q>','<q>' ('<q>')`},
		{"apostrophes only", "m-1", `the consumer's and the runtime's view differ`, `the consumer's and the runtime's view differ`},
		{"back quotes", "m-1", "unexpected token `}` at offset 17", "unexpected token `<q>` at offset <n>"},
		{"URL in quotes", "m-1", `Post "https://api.example.com/v1/charges/ch_42": context deadline exceeded`,
			`Post "<q>": context deadline exceeded`},
		{"UUID", "m-1", `payment 3F2A9C0D-1e2b-4a5f-9c0d-1e2b4a5f9c0d not found`, `payment <uuid> not found`},
		{"UUID message id", "3f2a9c0d-1e2b-4a5f-9c0d-1e2b4a5f9c0d", `order 3f2a9c0d-1e2b-4a5f-9c0d-1e2b4a5f9c0d was cancelled`,
			`order <id> was cancelled`},
		{"hex ids", "m-1", `trace 4bf92f3577b34da6a3ce929d0e0e4736 span 0xC000123abc failed; deadbeef stays, offset 123456789 is a number`,
			`trace <hex> span <hex> failed; deadbeef stays, offset <n> is a number`},
		{"Go time", "m-1", `retry at 2026-12-01 09:00:00.123 +0000 UTC m=+0.500000001, after 2026-11-30`,
			`retry at <time>, after <time>`},
		{"RFC 3339 offset", "m-1", `not before 2026-12-01T10:00:00+01:00`, `not before <time>`},
		{"RFC 1123", "m-1", `429 from upstream, retry after Tue, 01 Dec 2026 09:00:00 GMT`, `<n> from upstream, retry after <time>`},
		{"RFC 1123Z and ANSIC", "m-1", `at Wed, 02 Dec 2026 10:30:00 +0100 or Thu Dec  3 10:30:00 2026`, `at <time> or <time>`},
		{"Unix date and RFC 850", "m-1", `at Thu Dec  3 10:30:00 UTC 2026 or Thursday, 03-Dec-26 10:30:00 UTC`, `at <time> or <time>`},
		{"named date without a day name", "m-1", `expires 3 Dec 2026 10:30:00 GMT`, `expires <time>`},
		{"no digit, no quote", "m-1", "handler timed\n out: context deadline exceeded", "handler timed out: context deadline exceeded"},
		{"UUID and hex words without a digit stay", "m-1", `abcdefab-abcd-abcd-abcd-abcdefabcdef deadbeefcafe 7`, `abcdefab-abcd-abcd-abcd-abcdefabcdef deadbeefcafe <n>`},
		{"compound durations", "m-1", `waited 1h2m3.5s of 45.5s`, `waited <n> of <n>`},
		{"paths and sentences", "m-1", `cannot open /data/part-17.json: 3 tries. Gave up at step 2.`,
			`cannot open /data/part-<n>.json: <n> tries. Gave up at step <n>.`},
		{"durations and decimals", "m-1", `timed out after 1.5s (budget 2m0s, 1,000 rows, -3 left)`,
			`timed out after <n> (budget <n>, <n> rows, -<n> left)`},
		{"e-mail", "m-1", `no customer alice.smith+test@example.co.uk`, `no customer <email>`},
		{"id inside a longer word", "order-0042", `order-0042 is not order-00421`, `<id> is not order-<n>`},
		{"short id left to the number rule", "7", `attempt 7 of 7`, `attempt <n> of <n>`},
		{"short id, quoted", "42", `message id "42" was applied at 2026-12-01T08:00:00Z with a different payload (attempt 42)`,
			`message id "<id>" was applied at <time> with a different payload (attempt <n>)`},
		{"white space", "m-1", "line one\n\tline   two ", "line one line two"},
		{"empty", "m-1", "", ""},
		{"non-ASCII", "m-1", `ungültiger Betrag "12,50 €" für Konto 9`, `ungültiger Betrag "<q>" für Konto <n>`},
	} {
		if got := dlq.NormalizeError(tc.text, tc.id); got != tc.want {
			t.Errorf("%s:\n text %s\n got  %s\n want %s", tc.name, tc.text, got, tc.want)
		}
	}
}

// TestNormalizeErrorTruncated: two long texts that differ only in their
// ids and times, cut by the envelope at the same length (so at different
// points of their shape), have the same shape.
func TestNormalizeErrorTruncated(t *testing.T) {
	t.Parallel()
	entry := func(id string, at time.Time) dlq.Entry {
		long := fmt.Errorf("order %s (placed %s): %s", id, at.Format(time.RFC3339Nano), strings.Repeat("line item rejected; ", 80))
		env := dlq.Envelope(&consumer.Message{ID: id, Body: []byte("x")}, consumer.Failure{Consumer: "shop", MessageID: id,
			Class: consumer.ClassPermanent, Err: long, LastFailure: at}, dlq.Options{Host: "h"})
		rec, err := dlq.Parse(env)
		if err != nil {
			t.Fatal(err)
		}
		return rec.Entry
	}
	a := entry("o-1", time.Date(2026, 12, 1, 9, 0, 0, 0, time.UTC))
	b := entry("order-000000017", time.Date(2026, 12, 1, 9, 0, 0, 123456789, time.UTC))
	if !strings.HasSuffix(a.Error, "[truncated]") || len(a.Error) != len(b.Error) {
		t.Fatalf("not truncated alike: %d %d", len(a.Error), len(b.Error))
	}
	sa, sb := dlq.NormalizeError(a.Error, a.MessageID), dlq.NormalizeError(b.Error, b.MessageID)
	if sa != sb || !strings.HasPrefix(sa, "order <id> (placed <time>): line item rejected;") || !strings.HasSuffix(sa, "…") {
		t.Fatalf("shapes differ:\n%s\n%s", sa, sb)
	}
	if a.Fingerprint() != b.Fingerprint() {
		t.Fatal("fingerprints differ")
	}
	// A short truncated text loses its last, possibly cut, word.
	if got := dlq.NormalizeError("order 17 was rejec…[truncated]", ""); got != "order <n> was…" {
		t.Fatalf("short truncated: %q", got)
	}
}

func TestFailureFingerprint(t *testing.T) {
	t.Parallel()
	at := time.Date(2026, 12, 1, 9, 0, 0, 0, time.UTC)
	mismatch := func(id string, at time.Time) dlq.Entry {
		return dlq.Entry{Consumer: "billing", Source: "payments", MessageID: id, Class: consumer.ClassFingerprintMismatch,
			Error: fmt.Sprintf("message id %q was applied at %s with a different payload", id, at.Format(time.RFC3339Nano))}
	}
	a, b := mismatch("pay-1", at), mismatch("pay-2000", at.Add(time.Hour+time.Millisecond))
	fp := a.Fingerprint()
	if !regexp.MustCompile(`^[0-9a-f]{16}$`).MatchString(fp) {
		t.Fatalf("fingerprint %q: want 16 hex digits", fp)
	}
	if b.Fingerprint() != fp {
		t.Fatal("same cause, different ids and times: fingerprints differ")
	}
	for name, change := range map[string]func(*dlq.Entry){
		"consumer": func(e *dlq.Entry) { e.Consumer = "ledger" },
		"source":   func(e *dlq.Entry) { e.Source = "refunds" },
		"class":    func(e *dlq.Entry) { e.Class = consumer.ClassPermanent },
		"error":    func(e *dlq.Entry) { e.Error = "message id was applied" },
		// The fields are delimited: moving text from one to the next
		// changes the fingerprint.
		"boundary": func(e *dlq.Entry) { e.Consumer, e.Source = "billingp", "ayments" },
	} {
		e := a
		change(&e)
		if e.Fingerprint() == fp {
			t.Errorf("a different %s gives the same fingerprint", name)
		}
	}
}

// TestInspectGroupsByFingerprint: twelve dead letters from four causes,
// each error text naming its own id, times and values, come out as four
// groups, with their counts, first and last failures and one sample text.
func TestInspectGroupsByFingerprint(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	broker := memory.NewBroker()
	base := time.Date(2026, 12, 1, 9, 0, 0, 0, time.UTC)
	var first []string // each cause's first error text
	for i := 0; i < 12; i++ {
		id := fmt.Sprintf("order-%04d", 17*i+3)
		at := base.Add(time.Duration(i) * 7 * time.Minute)
		f := consumer.Failure{Consumer: "billing", MessageID: id, Attempts: 1, FirstFailure: at, LastFailure: at}
		switch i % 4 {
		case 0:
			f.Class, f.ProcessedAt = consumer.ClassFingerprintMismatch, at.Add(-time.Hour)
			f.Err = fmt.Errorf("message id %q was applied at %s with a different payload", id, f.ProcessedAt.Format(time.RFC3339Nano))
		case 1:
			f.Class = consumer.ClassPermanent
			f.Err = consumer.Permanent(fmt.Errorf("unknown account %q for order %s (received %s)", fmt.Sprintf("acct-%d", 100+i), id, at.Format(time.RFC3339)))
		case 2:
			f.Class = consumer.ClassPanic
			f.Err = &consumer.PanicError{Value: fmt.Errorf("runtime error: index out of range [%d] with length %d", i, i/2)}
		case 3:
			f.Class, f.Attempts = consumer.ClassRetryableExhausted, 5
			f.Err = fmt.Errorf("insert ledger row for %s: %w", id,
				errors.New(`ERROR: insert or update on table "ledger" violates foreign key constraint "ledger_account_fkey" (SQLSTATE 23503)`))
		}
		if i < 4 {
			first = append(first, f.Err.Error())
		}
		env := dlq.Envelope(&consumer.Message{ID: id, Body: []byte{byte(i)}, Source: "payments", Partition: -1, Offset: -1}, f, dlq.Options{})
		if err := broker.Publish(ctx, "payments.dlq", env); err != nil {
			t.Fatal(err)
		}
	}
	sub, err := broker.Subscribe("payments.dlq", memory.SubscribeOptions{Prefetch: 12})
	if err != nil {
		t.Fatal(err)
	}
	rep, err := dlq.Inspect(ctx, dlq.SourceBrowser(sub, 12, 500*time.Millisecond), dlq.Filter{}, 0)
	if err != nil {
		t.Fatal(err)
	}
	if rep.Total != 12 || len(rep.Groups) != 4 {
		t.Fatalf("%d messages in %d groups, want 12 in 4: %+v", rep.Total, len(rep.Groups), rep)
	}
	patterns := []string{
		`message id "<id>" was applied at <time> with a different payload`,
		`permanent: unknown account "<q>" for order <id> (received <time>)`,
		`handler panic: runtime error: index out of range [<n>] with length <n>`,
		`insert ledger row for <id>: ERROR: insert or update on table "ledger" violates foreign key constraint "ledger_account_fkey" (SQLSTATE 23503)`,
	}
	for i, g := range rep.Groups {
		wantFirst, wantLast := base.Add(time.Duration(i)*7*time.Minute), base.Add(time.Duration(i+8)*7*time.Minute)
		e := dlq.Entry{Consumer: "billing", Source: "payments", Class: g.Class, MessageID: g.Sample[0], Error: g.Error}
		switch {
		case g.Count != 3 || g.Pattern != patterns[i] || g.Error != first[i] || len(g.Sample) != 3:
			t.Errorf("group %d: %+v\nwant pattern %s, sample error %s", i, g, patterns[i], first[i])
		case !g.FirstSeen.Equal(wantFirst) || !g.LastSeen.Equal(wantLast):
			t.Errorf("group %d seen %s to %s, want %s to %s", i, g.FirstSeen, g.LastSeen, wantFirst, wantLast)
		case g.Fingerprint != e.Fingerprint():
			t.Errorf("group %d: fingerprint %s, want Entry.Fingerprint's %s", i, g.Fingerprint, e.Fingerprint())
		}
	}
	if n := broker.Ready("payments.dlq"); n != 12 {
		t.Fatalf("inspect consumed messages: %d left", n)
	}
}

// FuzzNormalizeError: any text normalises without a panic, to valid UTF-8
// if the text was, and the same way twice.
func FuzzNormalizeError(f *testing.F) {
	for _, s := range []string{`message id "a" was applied at 2026-12-01T08:00:00Z`, `'x' "y\"z" ` + "`w`", "can't 'x", `"\`,
		"0x 0xg 12345678 1.2.3.4:5 [::1] a@b.cc 2026-01-01 " + strings.Repeat("é", 300) + "…[truncated]"} {
		f.Add(s, "a")
	}
	f.Fuzz(func(t *testing.T, text, id string) {
		got := dlq.NormalizeError(text, id)
		if utf8.ValidString(text) && !utf8.ValidString(got) {
			t.Fatalf("NormalizeError(%q, %q) = %q: not UTF-8", text, id, got)
		}
		if again := dlq.NormalizeError(text, id); again != got {
			t.Fatalf("not deterministic: %q then %q", got, again)
		}
	})
}

// NormalizeError turns the error texts of one cause, each naming its own
// message id, time and values, into one shape.
func ExampleNormalizeError() {
	fmt.Println(dlq.NormalizeError(`message id "pay-42" was applied at 2026-12-01T08:00:00.5Z with a different payload`, "pay-42"))
	fmt.Println(dlq.NormalizeError(`permanent: unknown account "acct-17" (order pay-43, 3 items)`, "pay-43"))
	fmt.Println(dlq.NormalizeError(`ERROR: duplicate key value violates unique constraint "orders_pkey" (SQLSTATE 23505)`, "pay-44"))
	// Output:
	// message id "<id>" was applied at <time> with a different payload
	// permanent: unknown account "<q>" (order <id>, <n> items)
	// ERROR: duplicate key value violates unique constraint "orders_pkey" (SQLSTATE 23505)
}

// BenchmarkNormalizeError: a typical error text, and a full 1 KiB one.
func BenchmarkNormalizeError(b *testing.B) {
	short := `message id "order-0003" was applied at 2026-12-01T08:00:00.123456789Z with a different payload`
	long := fmt.Sprintf("order %s (placed %s): %s", "order-0003", "2026-12-01T08:00:00Z", strings.Repeat(`line 17 of "cart" rejected; `, 40))[:1000]
	for _, tc := range []struct{ name, text string }{{"short", short}, {"1KiB", long}} {
		b.Run(tc.name, func(b *testing.B) {
			b.SetBytes(int64(len(tc.text)))
			for b.Loop() {
				dlq.NormalizeError(tc.text, "order-0003")
			}
		})
	}
}
