// Package natstest keeps the tests that share one JetStream server from
// tripping over each other's stream deletions.
//
// nats-server 2.9 removes an account's store directory ($G) when its last
// stream is deleted. A stream created at that moment by another test
// package fails with "error creating store for stream" (its mkdir finds the
// parent gone). Tests run packages in parallel, each creating and deleting
// streams of its own, so this happens now and then on a fresh server.
// EnsureAnchor creates a small stream that no test deletes, so that the
// directory is never empty again; each package that uses the shared server
// calls it before its first stream.
package natstest

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// AnchorStream is the stream EnsureAnchor creates; tests must not delete it.
const AnchorStream = "IDEMQ_TEST_ANCHOR"

// EnsureAnchor creates AnchorStream on the JetStream server at url if it is
// missing. It returns an error if the server cannot be reached, which the
// caller may ignore: the tests that need the server report it themselves.
func EnsureAnchor(url string) error {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	nc, err := nats.Connect(url, nats.Timeout(5*time.Second))
	if err != nil {
		return fmt.Errorf("natstest: connect: %w", err)
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		return fmt.Errorf("natstest: %w", err)
	}
	_, err = js.CreateStream(ctx, jetstream.StreamConfig{
		Name:        AnchorStream,
		Subjects:    []string{"idemq.test.anchor"},
		Description: "keeps the account's store directory for idemq's tests; do not delete",
		MaxMsgs:     1,
	})
	if err != nil && !errors.Is(err, jetstream.ErrStreamNameAlreadyInUse) {
		return fmt.Errorf("natstest: create %s: %w", AnchorStream, err)
	}
	return nil
}
