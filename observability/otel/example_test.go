package idemqotel_test

import (
	"context"
	"log"

	"github.com/jackc/pgx/v5"

	"github.com/idemq/idemq/consumer"
	idemqotel "github.com/idemq/idemq/observability/otel"
)

// Trace a consumer: the middleware continues each producer's trace in the
// handler, and the hooks record duplicates, retries and dead letters.
func Example() {
	tracing := idemqotel.New(idemqotel.Options{Consumer: "billing"}) // the global TracerProvider
	cfg := consumer.Config{
		Name: "billing",
		Handler: func(ctx context.Context, tx pgx.Tx, msg *consumer.Message) error {
			// ctx carries the "process" span: spans started from it
			// nest under it.
			return nil
		},
		Middleware: []consumer.Middleware{tracing.Middleware()},
		Hooks:      []consumer.Hook{tracing},
		// Source, DB, Store, DeadLetterer...
	}
	_ = cfg
}

// A publisher continues the current trace in the messages it writes.
func ExampleInjectHeaders() {
	publish := func(ctx context.Context, msg *consumer.Message) error { return nil } // a broker's Publish
	ctx := context.Background()                                                      // a context carrying a span
	msg := &consumer.Message{ID: "order-42", Body: []byte(`{}`), Headers: map[string]string{}}
	idemqotel.InjectHeaders(ctx, msg.Headers) // traceparent, tracestate
	if err := publish(ctx, msg); err != nil {
		log.Fatal(err)
	}
}
