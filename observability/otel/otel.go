// Package idemqotel traces idemq consumers with OpenTelemetry. It is a
// separate package, so the core (package consumer) does not depend on
// OpenTelemetry.
//
// # Propagation
//
// Producers put their trace context into the message headers with
// [InjectHeaders] (or [InjectMessage]) as W3C Trace Context: the
// "traceparent" and "tracestate" headers. The RabbitMQ and Kafka adapters
// carry headers as they are, so the context crosses the broker. The DLQ
// envelope (package dlq) keeps a message's headers unchanged, so a
// dead-lettered message, and its replay, stay in the producer's trace.
// Outbox and other publishers that build new messages from a handler should
// call InjectHeaders with the handler's context, so that their messages
// continue the consumer's trace.
//
// # Spans
//
// [Tracing.Middleware] extracts the context from Message.Headers and starts
// a consumer span "process <source>" around each handler attempt, as a child
// of the producer's span, with the messaging semantic-convention attributes
// (messaging.system, messaging.destination.name, messaging.message.id,
// messaging.operation.type "process", messaging.consumer.group.name, and
// for Kafka the partition and offset). The handler's context carries that
// span, so the handler's database and HTTP spans nest under it. A failed
// attempt records the error and sets the span's status to Error.
//
// Middleware only sees new messages, inside their transaction. The other
// outcomes are reported by the runtime through hooks, which run on the
// runtime's context rather than the message's, so a hook cannot add an
// event to the message's process span (which, for a retry or a dead letter,
// has ended anyway). Instead, *Tracing implements the hooks and records each
// outcome as a short span, parented from the message's headers like the
// process span, holding one span event:
//
//	span "duplicate <source>"    event "idemq.duplicate"      a duplicate was skipped
//	span "retry <source>"        event "idemq.retry"          a failed attempt will be retried
//	span "dead_letter <source>"  event "idemq.dead_lettered"  the message went to the DLQ
//	span "ack <source>"          event "idemq.ack_failed"     an ack failed after the commit
//
// A trace therefore shows, under the producer's span, every attempt at a
// message and what became of it. This design keeps no per-message state, so
// nothing leaks when a message is requeued at shutdown.
//
// Batch handlers cannot take Middleware; wrap them with
// [Tracing.WrapBatch], which starts one span per batch linked to every
// message's producer span.
//
// # Attributes
//
// Besides the semantic-convention attributes, the spans and events carry
// these idemq attributes:
//
//	idemq.attempt                  int     process span, retry event: the attempt, from 1
//	idemq.redelivered              bool    every span of a redelivered message (set only if true)
//	idemq.error.permanent          bool    process span whose handler returned a permanent error
//	idemq.processed_at             string  duplicate event: when the original was applied (RFC 3339)
//	idemq.duplicate.age_seconds    float   duplicate event: how long ago that was
//	idemq.retry.delay_seconds      float   retry event: the delay before the next attempt
//	idemq.error.class              string  dead_lettered event: the consumer.FailureClass
//	idemq.attempts                 int     dead_lettered event: the attempts made
//
// The tracer's instrumentation scope is the package path,
// "github.com/idemq/idemq/observability/otel".
package idemqotel

import (
	"context"
	"fmt"
	"strconv"
	"time"

	"github.com/jackc/pgx/v5"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/propagation"
	semconv "go.opentelemetry.io/otel/semconv/v1.43.0"
	"go.opentelemetry.io/otel/trace"

	"github.com/idemq/idemq/consumer"
)

// scopeName is the instrumentation scope of the tracer.
const scopeName = "github.com/idemq/idemq/observability/otel"

// Span event names (see the package doc).
const (
	eventDuplicate    = "idemq.duplicate"
	eventRetry        = "idemq.retry"
	eventDeadLettered = "idemq.dead_lettered"
	eventAckFailed    = "idemq.ack_failed"
)

// idemq-specific attribute keys (see the package doc).
const (
	attrAttempt      = attribute.Key("idemq.attempt")
	attrRedelivered  = attribute.Key("idemq.redelivered")
	attrProcessedAt  = attribute.Key("idemq.processed_at")
	attrDuplicateAge = attribute.Key("idemq.duplicate.age_seconds")
	attrRetryDelay   = attribute.Key("idemq.retry.delay_seconds")
	attrErrorClass   = attribute.Key("idemq.error.class")
	attrAttempts     = attribute.Key("idemq.attempts")
	attrPermanent    = attribute.Key("idemq.error.permanent")
)

// w3c is the default propagator: W3C Trace Context.
var w3c propagation.TextMapPropagator = propagation.TraceContext{}

// InjectHeaders writes the span context of ctx into headers as W3C Trace
// Context ("traceparent", and "tracestate" if any). It writes nothing if ctx
// carries no valid span context, or if headers is nil (which cannot be
// written: use InjectMessage to have the map made).
func InjectHeaders(ctx context.Context, headers map[string]string) {
	if headers == nil {
		return
	}
	w3c.Inject(ctx, propagation.MapCarrier(headers))
}

// InjectMessage is InjectHeaders on msg.Headers, making the map if msg has
// none and ctx carries a span context.
func InjectMessage(ctx context.Context, msg *consumer.Message) {
	if msg == nil || !trace.SpanContextFromContext(ctx).IsValid() {
		return
	}
	if msg.Headers == nil {
		msg.Headers = map[string]string{}
	}
	InjectHeaders(ctx, msg.Headers)
}

// Extract returns ctx with the remote span context carried by msg's W3C
// Trace Context headers, or ctx itself if msg carries none.
func Extract(ctx context.Context, msg *consumer.Message) context.Context {
	if msg == nil {
		return ctx
	}
	return w3c.Extract(ctx, propagation.MapCarrier(msg.Headers))
}

// Options configures Tracing. The zero value selects the defaults.
type Options struct {
	// Consumer is the consumer's name (consumer.Config.Name), recorded as
	// messaging.consumer.group.name. Defaults to "": not recorded.
	Consumer string
	// System is messaging.system, such as "rabbitmq" or "kafka". Defaults
	// to a guess from each message's Metadata: "kafka" for messages from
	// brokers/kafka, "rabbitmq" for those from brokers/rabbitmq, else
	// "idemq".
	System string
	// TracerProvider makes the tracer. Defaults to the global one,
	// otel.GetTracerProvider().
	TracerProvider trace.TracerProvider
	// Propagator reads the trace context from message headers. Defaults
	// to W3C Trace Context, the format InjectHeaders writes.
	Propagator propagation.TextMapPropagator
}

// Tracing traces a consumer: Middleware for its handler, and hooks for the
// outcomes the handler does not see. Put it in consumer.Config.Hooks and its
// Middleware in consumer.Config.Middleware. It is safe for concurrent use.
type Tracing struct {
	consumer.HookDefaults
	opts   Options
	tracer trace.Tracer
	prop   propagation.TextMapPropagator
}

var (
	_ consumer.HookDuplicate    = (*Tracing)(nil)
	_ consumer.HookRetry        = (*Tracing)(nil)
	_ consumer.HookDeadLettered = (*Tracing)(nil)
	_ consumer.HookAckFailed    = (*Tracing)(nil)
)

// New returns a Tracing for opts.
//
//	tr := idemqotel.New(idemqotel.Options{Consumer: "billing"})
//	cfg.Middleware = append(cfg.Middleware, tr.Middleware())
//	cfg.Hooks = append(cfg.Hooks, tr)
func New(opts Options) *Tracing {
	if opts.TracerProvider == nil {
		opts.TracerProvider = otel.GetTracerProvider()
	}
	if opts.Propagator == nil {
		opts.Propagator = w3c
	}
	return &Tracing{
		opts:   opts,
		tracer: opts.TracerProvider.Tracer(scopeName),
		prop:   opts.Propagator,
	}
}

// extract returns ctx with msg's remote span context, if any.
func (t *Tracing) extract(ctx context.Context, msg *consumer.Message) context.Context {
	if msg == nil {
		return ctx
	}
	return t.prop.Extract(ctx, propagation.MapCarrier(msg.Headers))
}

// system returns messaging.system for msg.
func (t *Tracing) system(msg *consumer.Message) string {
	if t.opts.System != "" {
		return t.opts.System
	}
	if msg != nil {
		if _, ok := msg.Metadata["kafka.topic"]; ok {
			return "kafka"
		}
		// brokers/rabbitmq's MetaDeliveryTag and MetaExchange.
		_, tag := msg.Metadata["delivery_tag"]
		_, exchange := msg.Metadata["exchange"]
		if tag && exchange {
			return "rabbitmq"
		}
	}
	return "idemq"
}

// attrs returns the semantic-convention attributes of msg.
func (t *Tracing) attrs(msg *consumer.Message, opType attribute.KeyValue, opName string) []attribute.KeyValue {
	system := t.system(msg)
	a := []attribute.KeyValue{
		semconv.MessagingSystemKey.String(system),
		opType,
		semconv.MessagingOperationName(opName),
	}
	if t.opts.Consumer != "" {
		a = append(a, semconv.MessagingConsumerGroupName(t.opts.Consumer))
	}
	if msg == nil {
		return a
	}
	a = append(a, semconv.MessagingDestinationName(msg.Source))
	if msg.ID != "" {
		a = append(a, semconv.MessagingMessageID(msg.ID))
	}
	a = append(a, semconv.MessagingMessageBodySize(len(msg.Body)))
	if msg.Partition >= 0 {
		a = append(a, semconv.MessagingDestinationPartitionID(strconv.Itoa(int(msg.Partition))))
	}
	if msg.Offset >= 0 && system == "kafka" {
		a = append(a, semconv.MessagingKafkaOffset(int(msg.Offset)))
	}
	if rk, ok := msg.Metadata["routing_key"]; ok && system == "rabbitmq" && rk != "" {
		a = append(a, semconv.MessagingRabbitMQDestinationRoutingKey(rk))
	}
	if msg.Redelivered {
		a = append(a, attrRedelivered.Bool(true))
	}
	return a
}

func spanName(op string, msg *consumer.Message) string {
	if msg == nil || msg.Source == "" {
		return op
	}
	return op + " " + msg.Source
}

// Middleware returns the consumer.Middleware that starts the process span of
// each handler attempt, as a child of the context in the message's headers,
// and runs the handler with it.
func (t *Tracing) Middleware() consumer.Middleware {
	return func(next consumer.Handler) consumer.Handler {
		return func(ctx context.Context, tx pgx.Tx, msg *consumer.Message) (err error) {
			ctx, span := t.tracer.Start(t.extract(ctx, msg), spanName("process", msg),
				trace.WithSpanKind(trace.SpanKindConsumer),
				trace.WithAttributes(t.attrs(msg, semconv.MessagingOperationTypeProcess, "process")...),
				trace.WithAttributes(attrAttempt.Int(attemptOf(msg))))
			defer func() {
				if v := recover(); v != nil {
					// The runtime recovers handler panics; mark the
					// span and let the panic go on to it.
					span.SetStatus(codes.Error, fmt.Sprintf("handler panic: %v", v))
					span.End()
					panic(v)
				}
				if err != nil {
					span.RecordError(err)
					span.SetStatus(codes.Error, err.Error())
					if consumer.IsPermanent(err) {
						span.SetAttributes(attrPermanent.Bool(true))
					}
				}
				span.End()
			}()
			return next(ctx, tx, msg)
		}
	}
}

func attemptOf(msg *consumer.Message) int {
	if msg == nil {
		return 0
	}
	return msg.Attempt
}

// WrapBatch returns h wrapped in a span per batch, "process <source>" with
// messaging.batch.message_count, linked to the producer span of every
// message that carries one. Use it for consumer.Config.BatchHandler, which
// takes no Middleware.
func (t *Tracing) WrapBatch(h consumer.BatchHandler) consumer.BatchHandler {
	return func(ctx context.Context, tx pgx.Tx, msgs []*consumer.Message) (err error) {
		links := make([]trace.Link, 0, len(msgs))
		var first *consumer.Message
		sameSource := true
		for _, m := range msgs {
			if m == nil {
				continue
			}
			if first == nil {
				first = m
			} else if m.Source != first.Source {
				sameSource = false
			}
			sc := trace.SpanContextFromContext(t.extract(context.Background(), m))
			if !sc.IsValid() {
				continue
			}
			l := trace.Link{SpanContext: sc}
			if m.ID != "" {
				l.Attributes = []attribute.KeyValue{semconv.MessagingMessageID(m.ID)}
			}
			links = append(links, l)
		}
		a := []attribute.KeyValue{
			semconv.MessagingSystemKey.String(t.system(first)),
			semconv.MessagingOperationTypeProcess,
			semconv.MessagingOperationName("process"),
			semconv.MessagingBatchMessageCount(len(msgs)),
		}
		if t.opts.Consumer != "" {
			a = append(a, semconv.MessagingConsumerGroupName(t.opts.Consumer))
		}
		name := "process"
		if first != nil && sameSource {
			a = append(a, semconv.MessagingDestinationName(first.Source))
			name = spanName("process", first)
		}
		ctx, span := t.tracer.Start(ctx, name, trace.WithSpanKind(trace.SpanKindConsumer),
			trace.WithLinks(links...), trace.WithAttributes(a...))
		defer func() {
			if v := recover(); v != nil {
				span.SetStatus(codes.Error, fmt.Sprintf("handler panic: %v", v))
				span.End()
				panic(v)
			}
			if err != nil {
				span.RecordError(err)
				span.SetStatus(codes.Error, err.Error())
			}
			span.End()
		}()
		return h(ctx, tx, msgs)
	}
}

// outcome records a short span holding one event, parented from msg's
// headers.
func (t *Tracing) outcome(ctx context.Context, msg *consumer.Message, op string, opType attribute.KeyValue,
	event string, eventAttrs []attribute.KeyValue, err error) {
	now := time.Now()
	_, span := t.tracer.Start(t.extract(ctx, msg), spanName(op, msg),
		trace.WithSpanKind(trace.SpanKindConsumer),
		trace.WithTimestamp(now),
		trace.WithAttributes(t.attrs(msg, opType, op)...))
	if err != nil {
		eventAttrs = append(eventAttrs, semconv.ExceptionMessage(err.Error()))
	}
	span.AddEvent(event, trace.WithTimestamp(now), trace.WithAttributes(eventAttrs...))
	if err != nil && event != eventRetry {
		span.SetStatus(codes.Error, err.Error())
	}
	span.End(trace.WithTimestamp(now))
}

// OnDuplicate records a "duplicate" span with an idemq.duplicate event
// carrying the original's processed_at and the duplicate's age.
func (t *Tracing) OnDuplicate(ctx context.Context, msg *consumer.Message, processedAt time.Time) {
	var a []attribute.KeyValue
	if !processedAt.IsZero() {
		a = append(a, attrProcessedAt.String(processedAt.UTC().Format(time.RFC3339Nano)),
			attrDuplicateAge.Float64(max(time.Since(processedAt), 0).Seconds()))
	}
	t.outcome(ctx, msg, "duplicate", semconv.MessagingOperationTypeSettle, eventDuplicate, a, nil)
}

// OnRetry records a "retry" span with an idemq.retry event carrying the
// attempt that failed, its error and the delay before the next one.
func (t *Tracing) OnRetry(ctx context.Context, msg *consumer.Message, attempt int, err error, delay time.Duration) {
	t.outcome(ctx, msg, "retry", semconv.MessagingOperationTypeProcess, eventRetry,
		[]attribute.KeyValue{attrAttempt.Int(attempt), attrRetryDelay.Float64(delay.Seconds())}, err)
}

// OnDeadLettered records a "dead_letter" span, with status Error and an
// idemq.dead_lettered event carrying the failure class, attempts and error.
func (t *Tracing) OnDeadLettered(ctx context.Context, msg *consumer.Message, f consumer.Failure) {
	err := f.Err
	if err == nil {
		err = fmt.Errorf("dead-lettered: %s", f.Class)
	}
	t.outcome(ctx, msg, "dead_letter", semconv.MessagingOperationTypeSettle, eventDeadLettered,
		[]attribute.KeyValue{attrErrorClass.String(string(f.Class)), attrAttempts.Int(f.Attempts)}, err)
}

// OnAckFailed records an "ack" span, with status Error and an
// idemq.ack_failed event. The effect is committed; the redelivery will be
// skipped as a duplicate.
func (t *Tracing) OnAckFailed(ctx context.Context, msg *consumer.Message, err error) {
	t.outcome(ctx, msg, "ack", semconv.MessagingOperationTypeSettle, eventAckFailed, nil, err)
}
