package outbox

import (
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
)

// indexedError is an error that says which message of a Publish call
// failed: a *MessageError, or a broker adapter's error of its own.
type indexedError interface {
	error
	MessageIndex() int
}

// MessageError says which message of a Publish call failed: the message at
// Index, with Err. A [PublishFunc] returns one per failed message, alone,
// wrapped or joined with errors.Join, and thereby promises that the broker
// confirmed every message of the call it does not name: the relay marks
// those sent and retries only the named ones, each with its own backoff and
// its own error. Any error with a method MessageIndex() int (the failed
// message's position in the call's msgs) counts as a MessageError does, so
// a broker adapter's error type can say the same without importing this
// package; the idemq brokers' do.
type MessageError struct {
	// Index is the message's position in the Publish call's msgs.
	Index int
	// Err is why it failed.
	Err error
}

// Error describes the failed message and why it failed.
func (e *MessageError) Error() string {
	return fmt.Sprintf("outbox: publish message %d: %v", e.Index, e.Err)
}

// Unwrap returns Err.
func (e *MessageError) Unwrap() error { return e.Err }

// MessageIndex returns Index.
func (e *MessageError) MessageIndex() int { return e.Index }

// messageErrors returns the error of each failed message of a Publish call
// of n messages, by index, if err consists only of indexedError values with
// indexes below n (joined, wrapped or alone). Otherwise ok is false: err
// does not say which messages failed.
func messageErrors(err error, n int) (failed map[int]error, ok bool) {
	failed = map[int]error{}
	var walk func(error) bool
	walk = func(err error) bool {
		switch x := err.(type) {
		case nil:
			return false
		case indexedError:
			i := x.MessageIndex()
			if i < 0 || i >= n {
				return false
			}
			if prev, dup := failed[i]; dup {
				failed[i] = errors.Join(prev, x)
			} else {
				failed[i] = x
			}
			return true
		case interface{ Unwrap() []error }:
			errs := x.Unwrap()
			for _, e := range errs {
				if !walk(e) {
					return false
				}
			}
			return len(errs) > 0
		default:
			if inner := errors.Unwrap(err); inner != nil {
				return walk(inner)
			}
			return false
		}
	}
	if !walk(err) {
		return nil, false
	}
	return failed, true
}

// newLeaseToken returns a random UUID (version 4), the fencing token of one
// claim.
func newLeaseToken() (string, error) {
	var b [16]byte
	if _, err := rand.Read(b[:]); err != nil {
		return "", fmt.Errorf("outbox: relay: lease token: %w", err)
	}
	b[6] = b[6]&0x0f | 0x40
	b[8] = b[8]&0x3f | 0x80
	h := hex.EncodeToString(b[:])
	return h[:8] + "-" + h[8:12] + "-" + h[12:16] + "-" + h[16:20] + "-" + h[20:], nil
}

// leaseOwner names a relay in lease_owner: host, process id and a random
// suffix telling relays of one process apart.
func leaseOwner() string {
	host, err := os.Hostname()
	if err != nil || host == "" {
		host = "unknown-host"
	}
	var b [4]byte
	_, _ = rand.Read(b[:])
	return fmt.Sprintf("%s/%d/%s", host, os.Getpid(), hex.EncodeToString(b[:]))
}
