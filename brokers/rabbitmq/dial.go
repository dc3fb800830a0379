package rabbitmq

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/url"
	"regexp"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemq/idemq/internal/redact"
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
			err = ctxErr
		}
		// The broker's reply may quote what the URL gave it (a vhost).
		return nil, redact.Error(fmt.Errorf("rabbitmq: dial %s: %w", redact.URL(rawURL), err), rawURL)
	}
	return conn, nil
}

// schemes finds the start of each URL in a string: "amqp://", "amqps://".
var schemes = regexp.MustCompile(`(?i)amqps?://`)

// checkURL validates rawURL as amqp.ParseURI does, without the URL in the
// error: net/url's parse errors quote the whole URL, password included.
// A comma-separated list is refused: amqp091 would read the rest of the
// list as the vhost's name.
func checkURL(rawURL string) error {
	if n := len(schemes.FindAllStringIndex(rawURL, -1)); n > 1 {
		return configError("URL", "holds %d URLs; give one (a comma-separated list is not supported)", n)
	}
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

// isClosed reports whether err says an amqp091 connection or channel is
// closed.
func isClosed(err error) bool {
	return errors.Is(err, amqp.ErrClosed)
}
