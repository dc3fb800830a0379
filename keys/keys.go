// Package keys derives idempotency keys for the child operations of a parent
// operation: the outbox messages a handler publishes, the idempotency keys it
// sends to other services, the rows it names.
//
// A handler that is retried (a redelivered message, an HTTP request replayed
// with its Idempotency-Key) must produce the same child keys every time, or
// the services downstream see a new operation and apply it again. ChildKey
// makes the child key a pure function of the parent key and a step name:
//
//	id := keys.ChildKey(msg.ID, "notify-customer/v1")
//
// # Step names are a contract
//
// A child key is only as stable as its step name. Treat step names like
// column names in a public schema:
//
//   - Never derive a step name from a position in a list ("item-0",
//     "step-3", a loop index). Reordering, inserting or removing an element
//     renames every later step, so a retry after a deploy produces
//     different keys and repeats the work. Name a step after what it does
//     and, for per-item steps, after the item's own stable id:
//     "ship-line/v1/" + line.SKU.
//   - Version every name ("charge-card/v1"). When the meaning of a step
//     changes, so that a replay of the old operation must not be confused
//     with the new one, bump the version; otherwise never rename it.
//   - Never reuse a retired name for something else.
//
// [ValidateStep] enforces the shape: lower-case segments separated by "/",
// no segment made only of digits, and a final "vN" version segment.
// [Derive] validates and derives in one call; [ChildKey] derives without
// checking, for step names that are constants validated by a test.
package keys

import (
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"regexp"
	"strings"
)

// domain separates ChildKey's hashes from any other sha256 of the same
// bytes. Changing it would change every derived key: it never changes.
const domain = "idemq.keys.ChildKey.v1"

// MaxStepLen is the longest step name ValidateStep accepts, in bytes.
const MaxStepLen = 200

// Errors wrapped by ValidateStep and Derive. Compare with errors.Is.
var (
	// ErrInvalidStep: the step name is not a stable, versioned name.
	ErrInvalidStep = errors.New("keys: invalid step name")
	// ErrEmptyParent: the parent key is empty, so the child key would not
	// identify anything.
	ErrEmptyParent = errors.New("keys: empty parent key")
)

var (
	segmentRE = regexp.MustCompile(`^[a-z0-9][a-z0-9._-]*$`)
	versionRE = regexp.MustCompile(`^v[1-9][0-9]*$`)
	digitsRE  = regexp.MustCompile(`^[0-9]+$`)
)

// ChildKey returns the key of step within the operation identified by
// parentKey: the lower-case hex sha256 (64 characters) of a length-prefixed
// encoding of a fixed domain string, parentKey and step. The same inputs give
// the same key in every process and every version of idemq; distinct
// (parentKey, step) pairs give distinct keys, even when their concatenations
// are equal.
//
// ChildKey does not check step; see ValidateStep and Derive, and the package
// documentation for why step names must be stable and versioned.
func ChildKey(parentKey, step string) string {
	h := sha256.New()
	var n [8]byte
	for _, part := range [...]string{domain, parentKey, step} {
		binary.BigEndian.PutUint64(n[:], uint64(len(part)))
		h.Write(n[:])
		h.Write([]byte(part))
	}
	return hex.EncodeToString(h.Sum(nil))
}

// Derive returns ChildKey(parentKey, step) after checking that parentKey is
// not empty and that step is a valid step name (see ValidateStep).
func Derive(parentKey, step string) (string, error) {
	if parentKey == "" {
		return "", fmt.Errorf("%w (step %q)", ErrEmptyParent, step)
	}
	if err := ValidateStep(step); err != nil {
		return "", err
	}
	return ChildKey(parentKey, step), nil
}

// ValidateStep reports whether step looks like a stable, versioned step name:
// one or more segments separated by "/", each of lower-case letters, digits,
// '.', '_' or '-' and starting with a letter or digit; the last segment is a
// version "v1", "v2", ...; no segment before it is made only of digits (a
// list position, such as "items/3/v1"); at most MaxStepLen bytes. For example
// "charge-card/v1", "email/welcome/v2" and "ship-line/sku-123/v1" are valid.
// The error wraps ErrInvalidStep.
func ValidateStep(step string) error {
	bad := func(reason string) error {
		return fmt.Errorf("%w %q: %s", ErrInvalidStep, step, reason)
	}
	if len(step) > MaxStepLen {
		return bad(fmt.Sprintf("%d bytes, more than %d", len(step), MaxStepLen))
	}
	segs := strings.Split(step, "/")
	if len(segs) < 2 {
		return bad(`want a name and a version, such as "charge-card/v1"`)
	}
	last := segs[len(segs)-1]
	if !versionRE.MatchString(last) {
		return bad(fmt.Sprintf(`last segment %q is not a version such as "v1"`, last))
	}
	for _, s := range segs[:len(segs)-1] {
		switch {
		case !segmentRE.MatchString(s):
			return bad(fmt.Sprintf("segment %q: use lower-case letters, digits, '.', '_' or '-', starting with a letter or digit", s))
		case digitsRE.MatchString(s):
			return bad(fmt.Sprintf("segment %q is only digits, like a list position: name steps after what they do or a stable id", s))
		}
	}
	return nil
}
