package dlq

import (
	"bytes"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"hash"
	"os"
	"slices"
	"strings"

	"github.com/idemq/idemq/consumer"
)

// headerSignature carries the envelope's HMAC when Options.SigningKey is
// set: "v1=" and the hex HMAC-SHA256 of every x-idemq-* header (this one
// excepted) and the body. See Verify.
const headerSignature = "x-idemq-signature"

// minKeyBytes is the shortest signing or verification key accepted.
const minKeyBytes = 16

const (
	signatureVersion = "v1="
	headerPrefix     = "x-idemq-"
	signatureDomain  = "idemq dead-letter envelope v1"
)

// ErrBadSignature is returned by Verify for an envelope that no key
// verifies: it is not signed, or it was altered, forged, or signed with a
// key that is not trusted. The error wrapping it says which.
var ErrBadSignature = errors.New("dlq: envelope not verified")

// Sign sets msg's x-idemq-signature header for key, replacing any there.
// It covers the body and every header named x-idemq-*: the dedup id,
// consumer, source and the rest of the envelope, so that a replay can
// trust them. Envelope calls it when Options.SigningKey is set.
func Sign(msg *consumer.Message, key []byte) {
	if msg.Headers == nil {
		msg.Headers = map[string]string{}
	}
	delete(msg.Headers, headerSignature)
	msg.Headers[headerSignature] = signatureVersion + hex.EncodeToString(mac(msg, key))
}

// Verify checks msg's x-idemq-signature header against keys, any one of
// which may match (list the current key and those being rotated out). It
// returns nil, or an error wrapping ErrBadSignature that says whether the
// envelope is not signed or its signature does not match.
//
// A signed envelope proves that a holder of the key dead-lettered this body
// with these x-idemq-* headers, so a replay can use its consumer, dedup id
// and source. Without verification, anyone who can publish to the
// dead-letter queue can choose them.
func Verify(msg *consumer.Message, keys ...[]byte) error {
	sig, ok := msg.Headers[headerSignature]
	if !ok {
		return fmt.Errorf("%w: not signed", ErrBadSignature)
	}
	got, err := hex.DecodeString(strings.TrimPrefix(sig, signatureVersion))
	if !strings.HasPrefix(sig, signatureVersion) || err != nil {
		return fmt.Errorf("%w: signature in an unknown format", ErrBadSignature)
	}
	for _, k := range keys {
		if hmac.Equal(got, mac(msg, k)) {
			return nil
		}
	}
	return fmt.Errorf("%w: signature does not match any key", ErrBadSignature)
}

// validateKey reports whether key is long enough to sign or verify with.
func validateKey(key []byte) error {
	if len(key) < minKeyBytes {
		return fmt.Errorf("dlq: signing key of %d bytes, want at least %d (32 random bytes are best)", len(key), minKeyBytes)
	}
	return nil
}

// ReadKeyFile reads a signing or verification key from a file: its contents
// with surrounding white space removed, so a key made by
// `openssl rand -hex 32 > dlq.key` reads as its 64 hex characters. The key
// must be at least 16 bytes long, as every signing and verification key.
func ReadKeyFile(path string) ([]byte, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("dlq: read key file: %w", err)
	}
	key := bytes.TrimSpace(b)
	if err := validateKey(key); err != nil {
		return nil, fmt.Errorf("%w (in %s)", err, path)
	}
	return key, nil
}

// mac is the HMAC-SHA256 under key of a domain string, the sorted x-idemq-*
// headers but the signature, each name and value length-prefixed, and the
// SHA-256 of the body.
func mac(msg *consumer.Message, key []byte) []byte {
	m := hmac.New(sha256.New, key)
	writeField(m, signatureDomain)
	names := make([]string, 0, 16)
	for k := range msg.Headers {
		if strings.HasPrefix(strings.ToLower(k), headerPrefix) && k != headerSignature {
			names = append(names, k)
		}
	}
	slices.Sort(names)
	var n [8]byte
	binary.BigEndian.PutUint64(n[:], uint64(len(names)))
	m.Write(n[:])
	for _, k := range names {
		writeField(m, k)
		writeField(m, msg.Headers[k])
	}
	body := sha256.Sum256(msg.Body)
	m.Write(body[:])
	return m.Sum(nil)
}

func writeField(h hash.Hash, s string) {
	var n [8]byte
	binary.BigEndian.PutUint64(n[:], uint64(len(s)))
	h.Write(n[:])
	h.Write([]byte(s))
}

// verifier checks envelopes against trusted keys; a nil one trusts all.
type verifier [][]byte

func newVerifier(keys [][]byte) (verifier, error) {
	for i, k := range keys {
		if err := validateKey(k); err != nil {
			return nil, &consumer.ConfigError{Field: fmt.Sprintf("VerifyKeys[%d]", i), Reason: err.Error()}
		}
	}
	return verifier(keys), nil
}

// trusted reports whether msg may be replayed: always without keys, and
// with keys only if its signature matches one.
func (v verifier) trusted(msg *consumer.Message) bool {
	return len(v) == 0 || Verify(msg, v...) == nil
}
