package dlq

import (
	"cmp"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"strconv"
	"time"
	"unicode/utf8"

	"github.com/idemq/idemq/consumer"
)

// The header contract of a dead-lettered message, listed in the package
// doc. Every broker adapter carries these as string headers. Times are RFC
// 3339 with nanoseconds, in UTC.
const (
	headerConsumer            = "x-idemq-consumer"
	headerMessageID           = "x-idemq-message-id"
	headerErrorClass          = "x-idemq-error-class"
	headerError               = "x-idemq-error"
	headerAttempts            = "x-idemq-attempts"
	headerFirstFailure        = "x-idemq-first-failure"
	headerLastFailure         = "x-idemq-last-failure"
	headerSource              = "x-idemq-source"
	headerPartition           = "x-idemq-partition"
	headerOffset              = "x-idemq-offset"
	headerHost                = "x-idemq-host"
	headerDeadLetters         = "x-idemq-dead-letters"
	headerOriginalProcessedAt = "x-idemq-original-processed-at"
	headerOriginalKey         = "x-idemq-original-key"
)

// The envelope headers that describe a dead letter's history and
// truncation. Parse reads them into a Record.
const (
	// HeaderHistory is a JSON array of the earlier failures (Entry
	// objects), oldest first.
	HeaderHistory = "x-idemq-history"
	// HeaderTruncated marks a dead letter cut to fit the broker (see
	// DeadLetterer): a comma-separated list of what it lacks of the
	// original message, among "body" (it holds only the first
	// Options.PreviewBytes), "headers" (original headers that did not fit)
	// and "history" (the earlier failures). Absent on a whole dead letter.
	// Replay, Requeue and Classify never run or republish a truncated
	// dead letter: they leave it in the queue.
	HeaderTruncated = "x-idemq-truncated"
	// HeaderOriginalSize is, on a truncated dead letter, the original
	// body's size in bytes, in decimal.
	HeaderOriginalSize = "x-idemq-original-size"
	// HeaderOriginalSHA256 is, on a truncated dead letter, the hex SHA-256
	// of the original body: its consumer.Message.Fingerprint, which the
	// dedup row of an applied original holds.
	HeaderOriginalSHA256 = "x-idemq-original-sha256"
)

// The defaults of Options, as its fields document them.
const (
	defaultMaxErrorBytes = 1024
	defaultMaxHistory    = 10
	defaultPreviewBytes  = 1024
)

// Options tune the envelope. The zero value is ready to use.
type Options struct {
	// Host is written to x-idemq-host. Defaults to os.Hostname().
	Host string
	// MaxErrorBytes truncates error texts. Defaults to 1024.
	MaxErrorBytes int
	// MaxHistory bounds HeaderHistory; the oldest entries are dropped
	// first. Defaults to 10.
	MaxHistory int
	// SigningKey, if set, signs every envelope (x-idemq-signature), so that
	// a replay given the key in VerifyKeys replays only envelopes written
	// here, not ones forged by whoever can publish to the dead-letter
	// queue. At least 16 bytes; use 32 random bytes, kept secret.
	// Defaults to none: envelopes are not signed.
	SigningKey []byte
	// PreviewBytes is how much of the body a truncated dead letter keeps,
	// and how many bytes of the original's headers (names and values) it
	// keeps at most, smallest first (see DeadLetterer). Defaults to 1024.
	PreviewBytes int
}

func (o Options) withDefaults() Options {
	if o.Host == "" {
		o.Host, _ = os.Hostname()
	}
	if o.MaxErrorBytes == 0 {
		o.MaxErrorBytes = defaultMaxErrorBytes
	}
	if o.MaxHistory == 0 {
		o.MaxHistory = defaultMaxHistory
	}
	if o.PreviewBytes == 0 {
		o.PreviewBytes = defaultPreviewBytes
	}
	return o
}

func (o Options) validate() error {
	switch {
	case o.MaxErrorBytes < 16:
		return &consumer.ConfigError{Field: "MaxErrorBytes", Reason: fmt.Sprintf("%d, must be at least 16", o.MaxErrorBytes)}
	case o.MaxHistory < 0:
		return &consumer.ConfigError{Field: "MaxHistory", Reason: "negative"}
	case o.PreviewBytes < 0:
		return &consumer.ConfigError{Field: "PreviewBytes", Reason: "negative"}
	case o.SigningKey != nil:
		if err := validateKey(o.SigningKey); err != nil {
			return &consumer.ConfigError{Field: "SigningKey", Reason: err.Error()}
		}
	}
	return nil
}

// Entry is one failure as recorded in the envelope.
type Entry struct {
	Consumer     string                `json:"consumer"`
	MessageID    string                `json:"message_id,omitempty"`
	Class        consumer.FailureClass `json:"class"`
	Error        string                `json:"error"`
	Attempts     int                   `json:"attempts"`
	FirstFailure time.Time             `json:"first_failure,omitzero"`
	LastFailure  time.Time             `json:"last_failure,omitzero"`
	Source       string                `json:"source,omitempty"`
	Partition    int32                 `json:"partition"`
	Offset       int64                 `json:"offset"`
	Host         string                `json:"host,omitempty"`
	// Key is the original's ordering key (consumer.Message.Key) as its
	// consumer saw it, which a processed.Sharded's default shard map
	// routes by. On Kafka it names the original's topic and partition,
	// where the dead letter's own names the dead-letter topic's. Like
	// Source, it comes from the first envelope; "" if the original had
	// none, or the envelope is from before this header existed.
	Key string `json:"key,omitempty"`
	// ProcessedAt is, for class fingerprint-mismatch, when the original
	// with the same id was applied (x-idemq-original-processed-at); zero if
	// unknown or for other classes.
	ProcessedAt time.Time `json:"original_processed_at,omitzero"`
}

// Record is a parsed envelope: the latest failure and the ones before it.
type Record struct {
	Entry
	// DeadLetters counts the times the message was dead-lettered.
	DeadLetters int
	// History holds the earlier failures, oldest first (possibly
	// truncated to Options.MaxHistory).
	History []Entry
	// Truncated says what the dead letter lacks of the original, if it
	// was cut to fit its broker (HeaderTruncated): "" for a whole one.
	Truncated string
	// OriginalSize and OriginalSHA256 describe the original body of a
	// truncated dead letter: 0 and "" for a whole one.
	OriginalSize   int64
	OriginalSHA256 string
}

// ErrNoEnvelope is returned by Parse for a message without idemq failure
// headers.
var ErrNoEnvelope = errors.New("dlq: message has no idemq failure envelope")

// Envelope returns the dead-letter copy of msg: body and headers unchanged,
// plus headers describing f. A previous envelope on msg is moved into the
// history. Source, Partition, Offset and Key come from an earlier envelope
// of the same consumer (f.Consumer) if there is one (a replayed message
// keeps its original source and ordering key; an envelope from before the
// key was kept gives none), else from msg.
// With opts.SigningKey, the envelope is signed (x-idemq-signature).
func Envelope(msg *consumer.Message, f consumer.Failure, opts Options) *consumer.Message {
	opts = opts.withDefaults()
	m := msg.Clone()
	h := make(map[string]string, len(m.Headers)+13)
	for k, v := range m.Headers {
		h[k] = v
	}
	cur := Entry{
		Consumer: f.Consumer, MessageID: f.MessageID, Class: f.Class, Attempts: f.Attempts,
		FirstFailure: f.FirstFailure.UTC(), LastFailure: f.LastFailure.UTC(), ProcessedAt: f.ProcessedAt.UTC(),
		Source: msg.Source, Partition: msg.Partition, Offset: msg.Offset, Host: opts.Host, Key: msg.Key,
	}
	if f.Err != nil {
		cur.Error = truncate(f.Err.Error(), opts.MaxErrorBytes)
	}
	deadLetters := 1
	// A history header that is not ours (forged, or malformed) would make
	// the envelope unparseable: only a parsed previous envelope's stays.
	delete(h, HeaderHistory)
	if prev, err := Parse(msg); err == nil {
		// The original's source and key come from an earlier envelope of
		// the same consumer: a message replayed from its dead-letter
		// queue. Another consumer's (a requeued message that reached
		// another queue, a header some producer wrote) says nothing of
		// where this consumer received it or the key it claimed it under.
		if prev.Consumer == f.Consumer {
			if prev.Source != "" {
				cur.Source, cur.Partition, cur.Offset = prev.Source, prev.Partition, prev.Offset
			}
			// An earlier envelope without a key is from before it was
			// kept: msg's own key is then the dead-letter queue's, not
			// the original's, and none is recorded.
			cur.Key = prev.Key
		}
		history := append(prev.History, prev.Entry)
		if n := len(history) - opts.MaxHistory; n > 0 {
			history = history[n:]
		}
		deadLetters = prev.DeadLetters + 1
		if b, err := json.Marshal(history); err == nil && opts.MaxHistory > 0 {
			h[HeaderHistory] = string(b)
		}
	}
	h[headerConsumer] = cur.Consumer
	h[headerMessageID] = cur.MessageID
	h[headerErrorClass] = string(cur.Class)
	h[headerError] = cur.Error
	h[headerAttempts] = strconv.Itoa(cur.Attempts)
	h[headerFirstFailure] = formatTime(cur.FirstFailure)
	h[headerLastFailure] = formatTime(cur.LastFailure)
	// The header describes this failure only: an earlier one's moved into
	// the history with its entry.
	delete(h, headerOriginalProcessedAt)
	if !cur.ProcessedAt.IsZero() {
		h[headerOriginalProcessedAt] = formatTime(cur.ProcessedAt)
	}
	h[headerSource] = cur.Source
	delete(h, headerPartition)
	delete(h, headerOffset)
	if cur.Partition >= 0 {
		h[headerPartition] = strconv.Itoa(int(cur.Partition))
	}
	if cur.Offset >= 0 {
		h[headerOffset] = strconv.FormatInt(cur.Offset, 10)
	}
	h[headerHost] = cur.Host
	delete(h, headerOriginalKey)
	if cur.Key != "" {
		h[headerOriginalKey] = cur.Key
	}
	h[headerDeadLetters] = strconv.Itoa(deadLetters)
	// An earlier signature covers the earlier envelope: it goes, and a
	// new one is made if there is a key.
	delete(h, headerSignature)
	m.Headers = h
	if opts.SigningKey != nil {
		Sign(m, opts.SigningKey)
	}
	return m
}

// Parse reads the envelope of a dead-lettered message. It returns
// ErrNoEnvelope if msg carries none, and an error describing the first
// malformed header otherwise.
func Parse(msg *consumer.Message) (Record, error) {
	h := msg.Headers
	class, ok := h[headerErrorClass]
	if !ok {
		return Record{}, ErrNoEnvelope
	}
	r := Record{Entry: Entry{
		Consumer: h[headerConsumer], MessageID: h[headerMessageID], Class: consumer.FailureClass(class),
		Error: h[headerError], Source: h[headerSource], Host: h[headerHost], Key: h[headerOriginalKey], Partition: -1, Offset: -1,
	}, DeadLetters: 1}
	var err error
	bad := func(name string, e error) error { return fmt.Errorf("dlq: header %s: %w", name, e) }
	if v := h[headerAttempts]; v != "" {
		if r.Attempts, err = strconv.Atoi(v); err != nil {
			return r, bad(headerAttempts, err)
		}
	}
	if r.FirstFailure, err = parseTime(h[headerFirstFailure]); err != nil {
		return r, bad(headerFirstFailure, err)
	}
	if r.LastFailure, err = parseTime(h[headerLastFailure]); err != nil {
		return r, bad(headerLastFailure, err)
	}
	if r.ProcessedAt, err = parseTime(h[headerOriginalProcessedAt]); err != nil {
		return r, bad(headerOriginalProcessedAt, err)
	}
	if v := h[headerPartition]; v != "" {
		p, err := strconv.ParseInt(v, 10, 32)
		if err != nil {
			return r, bad(headerPartition, err)
		}
		r.Partition = int32(p)
	}
	if v := h[headerOffset]; v != "" {
		if r.Offset, err = strconv.ParseInt(v, 10, 64); err != nil {
			return r, bad(headerOffset, err)
		}
	}
	if v := h[headerDeadLetters]; v != "" {
		if r.DeadLetters, err = strconv.Atoi(v); err != nil {
			return r, bad(headerDeadLetters, err)
		}
	}
	if v := h[HeaderHistory]; v != "" {
		if err := json.Unmarshal([]byte(v), &r.History); err != nil {
			return r, bad(HeaderHistory, err)
		}
	}
	if v, ok := h[HeaderTruncated]; ok {
		// A truncated dead letter must never pass for a whole one: an
		// empty mark is still a mark.
		r.Truncated = cmp.Or(v, "body")
		if r.OriginalSize, err = strconv.ParseInt(h[HeaderOriginalSize], 10, 64); err != nil {
			return r, bad(HeaderOriginalSize, err)
		}
		r.OriginalSHA256 = h[HeaderOriginalSHA256]
	}
	return r, nil
}

// Restore returns msg, the dead letter r was parsed from, as its consumer
// first saw it, for replay: the dedup id, source, partition, offset and
// ordering key come back from the envelope. The envelope headers stay, so
// a second failure grows the history.
//
// Key, the runtime's ordering key, is the original's (Entry.Key), so that
// a replay orders by it and a sharded store routes and finds the message
// by the key it was claimed under; an envelope without one keeps the
// dead-letter queue's own (for Kafka "<dlq topic>/<partition>").
// RecordKey, the broker's record key, is kept byte for byte (a null key
// stays nil): the dead-lettering publisher wrote the original record key,
// so a requeued Kafka record goes back under the key it was produced
// with, to the partition that key hashes to.
func (r Record) Restore(msg *consumer.Message) *consumer.Message {
	m := msg.Clone() // keeps RecordKey, nil or not
	if r.MessageID != "" {
		m.ID = r.MessageID
	}
	if r.Source != "" {
		m.Source, m.Partition, m.Offset = r.Source, r.Partition, r.Offset
	}
	if r.Key != "" {
		m.Key = r.Key
	}
	m.Redelivered = true
	return m
}

func formatTime(t time.Time) string {
	if t.IsZero() {
		return ""
	}
	return t.UTC().Format(time.RFC3339Nano)
}

func parseTime(s string) (time.Time, error) {
	if s == "" {
		return time.Time{}, nil
	}
	return time.Parse(time.RFC3339Nano, s)
}

// truncate cuts s to at most n bytes, marking the cut, without splitting a
// UTF-8 sequence.
func truncate(s string, n int) string {
	const mark = "…[truncated]"
	if len(s) <= n {
		return s
	}
	n -= len(mark)
	for n > 0 && !utf8.RuneStart(s[n]) {
		n--
	}
	return s[:n] + mark
}
