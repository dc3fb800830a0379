package rabbitmq

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/url"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
)

// DefaultURL is the broker URL used when a config leaves URL empty.
const DefaultURL = "amqp://guest:guest@127.0.0.1:5672/"

// Defaults shared by the configs in this package.
const (
	DefaultDialTimeout = 30 * time.Second
	DefaultHeartbeat   = 10 * time.Second
)

// dial opens an AMQP connection. The TCP dial honours ctx; the AMQP
// handshake is bounded by timeout (or ctx's deadline, if sooner). Automatic
// recovery is left off: the callers reconnect themselves, so that a
// delivery's channel is never silently replaced.
func dial(ctx context.Context, rawURL, name string, timeout time.Duration) (*amqp.Connection, error) {
	// amqp091's own parse error would quote the URL, password included.
	if err := checkURL(rawURL); err != nil {
		return nil, err
	}
	props := amqp.NewConnectionProperties()
	if name != "" {
		props.SetClientConnectionName(name)
	}
	cfg := amqp.Config{
		Heartbeat:  DefaultHeartbeat,
		Locale:     "en_US",
		Properties: props,
		Dial: func(network, addr string) (net.Conn, error) {
			d := net.Dialer{Timeout: timeout}
			c, err := d.DialContext(ctx, network, addr)
			if err != nil {
				return nil, err
			}
			deadline := time.Now().Add(timeout)
			if dl, ok := ctx.Deadline(); ok && dl.Before(deadline) {
				deadline = dl
			}
			// Cleared by amqp091 once the handshake completes.
			if err := c.SetDeadline(deadline); err != nil {
				_ = c.Close()
				return nil, err
			}
			return c, nil
		},
	}
	conn, err := amqp.DialConfig(rawURL, cfg)
	if err != nil {
		if ctxErr := ctx.Err(); ctxErr != nil {
			return nil, fmt.Errorf("rabbitmq: dial %s: %w", redact(rawURL), ctxErr)
		}
		return nil, fmt.Errorf("rabbitmq: dial %s: %w", redact(rawURL), err)
	}
	return conn, nil
}

// checkURL validates rawURL as amqp.ParseURI does, without the URL in the
// error: net/url's parse errors quote the whole URL, password included.
func checkURL(rawURL string) error {
	if _, err := amqp.ParseURI(rawURL); err != nil {
		var ue *url.Error
		if errors.As(err, &ue) {
			return configError("URL", "cannot parse the URL: %v (percent-encode reserved characters in the user name and password)", ue.Err)
		}
		return configError("URL", "%v", err)
	}
	return nil
}

// maxShortstr is the longest AMQP short string: queue, exchange and
// consumer tag names, routing keys and header names.
const maxShortstr = 255

// checkName rejects a queue or exchange name AMQP cannot carry. Other bytes
// are the broker's to judge.
func checkName(field, name string) error {
	switch {
	case name == "":
		return configError(field, "required")
	case len(name) > maxShortstr:
		return configError(field, "%d bytes, more than AMQP's %d-byte limit", len(name), maxShortstr)
	}
	return nil
}

// redact returns rawURL without its password, for logs and errors.
func redact(rawURL string) string {
	u, err := url.Parse(rawURL)
	if err != nil {
		return "(unparseable URL)"
	}
	return u.Redacted()
}

// isClosed reports whether err says an amqp091 connection or channel is
// closed.
func isClosed(err error) bool {
	return errors.Is(err, amqp.ErrClosed)
}
