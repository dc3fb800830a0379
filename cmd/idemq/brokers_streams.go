package main

import (
	"context"
	"flag"

	"github.com/nats-io/nats.go"

	"github.com/idemq/idemq/brokers/redisstream"
	"github.com/idemq/idemq/internal/redact"
)

// NATS JetStream and Redis Streams dead-letter queues: the flags of
// `idemq dlq` (registerStreams) and those of `idemq status` and
// `idemq console` (streamDLQFlags).

const (
	natsURLHelp  = "NATS server URL, or a comma-separated list (default $NATS_URL, then " + nats.DefaultURL + ")"
	redisURLHelp = "Redis URL, redis://[user:password@]host:port/db or rediss:// (default $REDIS_URL, then " + redisstream.DefaultURL + ")"
)

// registerStreams registers the NATS and Redis flags of `idemq dlq`.
func (b *brokerFlags) registerStreams(fs *flag.FlagSet) {
	fs.StringVar(&b.natsURL, "nats-url", "", natsURLHelp)
	fs.StringVar(&b.subject, "subject", "", "NATS JetStream dead-letter `subject` (a Source's default is \"<subject>.dlq\")")
	fs.StringVar(&b.natsStream, "stream", "", "NATS JetStream `stream` that stores --subject (default: the one the server says captures it)")
	fs.StringVar(&b.redisURL, "redis-url", "", redisURLHelp)
	fs.StringVar(&b.streamKey, "stream-key", "", "Redis Streams dead-letter stream's `key` (a Source's default is \"<stream>.dlq\")")
	registerRedisFields(fs, &b.redisBodyField)
}

// registerRedisFields registers the flag naming the consumer's Redis body
// field, which reading the dead letters and republishing them use.
func registerRedisFields(fs *flag.FlagSet, bodyField *string) {
	fs.StringVar(bodyField, "redis-body-field", "", "Redis entry `field` of the body, as the consumer's (and its dead-letterer's) BodyField (default \"body\")")
}

// streamDLQFlags select NATS JetStream and Redis Streams dead-letter queues
// for `idemq status` and `idemq console`.
type streamDLQFlags struct {
	natsURL        string
	subjects       listFlag
	natsStream     string
	redisURL       string
	keys           listFlag
	redisBodyField string
}

// register registers the flags; withFields also those of the Redis entry
// fields, which reading and republishing dead letters need.
func (f *streamDLQFlags) register(fs *flag.FlagSet, purpose string, withFields bool) {
	if withFields {
		registerRedisFields(fs, &f.redisBodyField)
	}
	fs.StringVar(&f.natsURL, "nats-url", "", natsURLHelp+", for --dlq-subject")
	fs.Var(&f.subjects, "dlq-subject", "NATS JetStream dead-letter `subject` "+purpose+" (repeatable)")
	fs.StringVar(&f.natsStream, "dlq-stream", "", "NATS JetStream `stream` that stores the --dlq-subject (default: the one the server says captures each)")
	fs.StringVar(&f.redisURL, "redis-url", "", redisURLHelp+", for --dlq-stream-key")
	fs.Var(&f.keys, "dlq-stream-key", "Redis Streams dead-letter stream `key` "+purpose+" (repeatable)")
}

// resolve validates the flags and returns one brokerFlags per dead-letter
// queue, NATS subjects first, URLs defaulted from the environment.
func (f *streamDLQFlags) resolve(e *env) ([]*brokerFlags, error) {
	if f.natsStream != "" && len(f.subjects) == 0 {
		return nil, usagef("--dlq-stream needs --dlq-subject")
	}
	var out []*brokerFlags
	for _, s := range f.subjects {
		b := &brokerFlags{broker: "nats", natsURL: f.natsURL, subject: s, natsStream: f.natsStream}
		if err := b.validateNATS(e, "--dlq-subject", "--dlq-stream"); err != nil {
			return nil, err
		}
		out = append(out, b)
	}
	for _, k := range f.keys {
		b := &brokerFlags{broker: "redis", redisURL: f.redisURL, streamKey: k, redisBodyField: f.redisBodyField}
		if err := b.validateRedis(e, "--dlq-stream-key"); err != nil {
			return nil, err
		}
		out = append(out, b)
	}
	return out, nil
}

// secrets are the raw URLs whose passwords must never be shown.
func (f *streamDLQFlags) secrets(e *env) []string {
	var out []string
	if len(f.subjects) > 0 {
		out = append(out, natsSecrets(natsURLOr(f.natsURL, e))...)
	}
	if len(f.keys) > 0 {
		out = append(out, redisURLOr(f.redisURL, e))
	}
	return out
}

// info is what the console shows it is connected to, passwords masked.
func (f *streamDLQFlags) info(e *env) [][2]string {
	var out [][2]string
	if len(f.subjects) > 0 {
		out = append(out, [2]string{"NATS", redactNATSURLs(natsURLOr(f.natsURL, e))})
	}
	if len(f.keys) > 0 {
		out = append(out, [2]string{"Redis", redact.URL(redisURLOr(f.redisURL, e))})
	}
	return out
}

// statusStreamDepth reads a NATS or Redis dead-letter queue's depth and
// oldest dead letter.
func statusStreamDepth(ctx context.Context, b *brokerFlags) statusDLQ {
	if b.broker == "nats" {
		return statusNATSDepth(ctx, b)
	}
	return statusRedisDepth(ctx, b)
}

// streamDLQKind names what a NATS or Redis dead-letter queue is, for
// messages.
func streamDLQKind(broker string) string {
	if broker == "nats" {
		return "NATS subject"
	}
	return "Redis stream"
}
