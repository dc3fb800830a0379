package rabbitmq

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/url"
	"regexp"
	"strings"
	"sync"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemq/idemq/internal/redact"
)

// DefaultURL is the broker URL used when a config leaves URL empty.
const DefaultURL = "amqp://guest:guest@127.0.0.1:5672/"

// Defaults shared by the configs in this package.
const (
	defaultDialTimeout = 30 * time.Second
	defaultHeartbeat   = 10 * time.Second
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
		Heartbeat:  defaultHeartbeat,
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
	return checkURLField("URL", rawURL)
}

// checkURLField is checkURL for the config field named field.
func checkURLField(field, rawURL string) error {
	if n := len(schemes.FindAllStringIndex(rawURL, -1)); n > 1 {
		return configError(field, "holds %d URLs; give one (a comma-separated list is not supported; other nodes of a cluster go in FailoverURLs)", n)
	}
	if _, err := amqp.ParseURI(rawURL); err != nil {
		var ue *url.Error
		if errors.As(err, &ue) {
			return configError(field, "cannot parse the URL: %v (percent-encode reserved characters in the user name and password)", ue.Err)
		}
		return configError(field, "%v", err)
	}
	return nil
}

// checkNodes checks URL and each of failover, the nodes of a cluster.
func checkNodes(url string, failover []string) error {
	if err := checkURL(url); err != nil {
		return err
	}
	for i, u := range failover {
		if err := checkURLField(fmt.Sprintf("FailoverURLs[%d]", i), u); err != nil {
			return err
		}
	}
	return nil
}

// nodes are the AMQP URLs of one cluster's nodes: a config's URL, then its
// FailoverURLs. Each connection is made to the first node that answers,
// trying each once, from the node after the one a connection was last lost
// to: a consumer whose node died moves to another at its first reconnect,
// instead of waiting for that node to return (or for its dial to time out,
// when a partition hides it). A quorum queue is served on every node of
// its cluster.
type nodes struct {
	urls []string

	mu    sync.Mutex
	first int // the node the next dial tries first
}

func newNodes(url string, failover []string) *nodes {
	return &nodes{urls: append([]string{url}, failover...)}
}

// dial connects to a node, and returns the connection and the node's
// index. If no node answers, the error joins each node's.
func (n *nodes) dial(ctx context.Context, name string, timeout time.Duration) (*amqp.Connection, int, error) {
	n.mu.Lock()
	first := n.first
	n.mu.Unlock()
	var errs []error
	for i := range n.urls {
		node := (first + i) % len(n.urls)
		conn, err := dial(ctx, n.urls[node], name, timeout)
		if err == nil {
			n.mu.Lock()
			n.first = node
			n.mu.Unlock()
			return conn, node, nil
		}
		errs = append(errs, err)
		if ctx.Err() != nil {
			break
		}
	}
	return nil, 0, errors.Join(errs...)
}

// String lists the nodes' URLs, without their passwords.
func (n *nodes) String() string {
	urls := make([]string, len(n.urls))
	for i, u := range n.urls {
		urls[i] = redact.URL(u)
	}
	return strings.Join(urls, ", ")
}

// lost says that a connection to node was lost: the next dial tries the
// node after it first.
func (n *nodes) lost(node int) {
	n.mu.Lock()
	if n.first == node {
		n.first = (node + 1) % len(n.urls)
	}
	n.mu.Unlock()
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
