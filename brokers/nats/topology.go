package natsjs

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// declare creates the work stream and the dead-letter stream of c (which
// has had its defaults applied) if they are missing. An existing stream is
// never modified: it must capture the subjects asked for.
func declare(ctx context.Context, js jetstream.JetStream, c Config) error {
	t := c.Topology
	streams := []jetstream.StreamConfig{
		{Name: c.Stream, Subjects: t.Subjects, Duplicates: t.Duplicates},
		{Name: t.DeadLetterStream, Subjects: []string{c.DeadLetter.Subject}},
	}
	for _, sc := range streams {
		sc.Storage = t.Storage
		sc.Replicas = t.Replicas
		sc.MaxAge = t.MaxAge
		sc.Description = "declared by idemq"
		if err := ensureStream(ctx, js, sc); err != nil {
			return err
		}
	}
	return nil
}

func ensureStream(ctx context.Context, js jetstream.JetStream, sc jetstream.StreamConfig) error {
	s, err := js.Stream(ctx, sc.Name)
	if errors.Is(err, jetstream.ErrStreamNotFound) {
		_, err = js.CreateStream(ctx, sc)
		if errors.Is(err, jetstream.ErrStreamNameAlreadyInUse) {
			s, err = js.Stream(ctx, sc.Name) // created meanwhile
		} else if err != nil {
			return fmt.Errorf("natsjs: create stream %q: %w", sc.Name, err)
		} else {
			return nil
		}
	}
	if err != nil {
		return fmt.Errorf("natsjs: stream %q: %w", sc.Name, err)
	}
	have := s.CachedInfo().Config.Subjects
	for _, want := range sc.Subjects {
		if !slices.Contains(have, want) {
			return fmt.Errorf("natsjs: stream %q exists with subjects %q, without %q; it is not modified: add the subject, or delete the stream", sc.Name, have, want)
		}
	}
	return nil
}

// check verifies, at NewSource, that the work stream exists and that a
// stream other than the one the Source reads (or, in the same stream, a
// subject the Source does not read) captures the dead-letter subject.
func check(ctx context.Context, js jetstream.JetStream, c Config) error {
	if _, err := js.Stream(ctx, c.Stream); err != nil {
		if errors.Is(err, jetstream.ErrStreamNotFound) {
			return fmt.Errorf("natsjs: stream %q not found (create it, or set Config.Topology): %w", c.Stream, err)
		}
		return fmt.Errorf("natsjs: stream %q: %w", c.Stream, err)
	}
	name, err := js.StreamNameBySubject(ctx, c.DeadLetter.Subject)
	if err != nil {
		if errors.Is(err, jetstream.ErrStreamNotFound) {
			return fmt.Errorf("natsjs: no stream captures the dead-letter subject %q (create one, or set Config.Topology): %w", c.DeadLetter.Subject, err)
		}
		return fmt.Errorf("natsjs: dead-letter subject %q: %w", c.DeadLetter.Subject, err)
	}
	if name == c.Stream && c.Subject == "" {
		return fmt.Errorf("natsjs: %w", configError("DeadLetter.Subject",
			"%q is captured by the Source's own stream %q, which it reads whole (Subject is empty): dead letters would be consumed again", c.DeadLetter.Subject, name))
	}
	return nil
}

// apiAttemptTimeout bounds one JetStream API request at start. A request
// the server never answers (sent to a stream leader just cut off, or lost
// in an election) is sent again after it, rather than waiting out the
// caller's context.
const apiAttemptTimeout = 5 * time.Second

// retryAPI runs f, each attempt bounded by apiAttemptTimeout, until it
// succeeds, fails for good, or ctx ends. f must be idempotent.
func retryAPI(ctx context.Context, f func(context.Context) error) error {
	wait := retryInitial
	for {
		actx, cancel := context.WithTimeout(ctx, apiAttemptTimeout)
		err := f(actx)
		cancel()
		if err == nil || ctx.Err() != nil || !transientAPIError(err) {
			return err
		}
		if !pause(ctx, wait) {
			return err
		}
		wait = min(2*wait, retryMax)
	}
}

// pause waits d, or until ctx ends; it reports whether d passed.
func pause(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-ctx.Done():
		return false
	}
}

// transientAPIError reports an API error that a later attempt may not
// meet: no answer in time, no responder, a reconnecting connection, or a
// server that says JetStream is unavailable for now (an election).
func transientAPIError(err error) bool {
	var apiErr *jetstream.APIError
	switch {
	case errors.Is(err, context.DeadlineExceeded), errors.Is(err, nats.ErrTimeout),
		errors.Is(err, nats.ErrNoResponders), errors.Is(err, jetstream.ErrNoStreamResponse),
		errors.Is(err, nats.ErrConnectionReconnecting), errors.Is(err, nats.ErrDisconnected):
		return true
	case errors.As(err, &apiErr):
		return apiErr.Code == 503 || apiErr.Code == 408
	}
	return false
}
