package idemqprom_test

import (
	"context"
	"log"
	"net/http"

	"github.com/jackc/pgx/v5"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/idemq/idemq/brokers/memory"
	"github.com/idemq/idemq/consumer"
	idemqprom "github.com/idemq/idemq/observability/prometheus"
	"github.com/idemq/idemq/processed"
)

// Export a consumer's metrics on /metrics.
func Example() {
	ctx := context.Background()
	store, err := processed.Open(ctx, "postgres://postgres@127.0.0.1:5432/test", processed.Config{})
	if err != nil {
		log.Fatal(err)
	}
	defer store.Close()
	broker := memory.NewBroker()
	sub, _ := broker.Subscribe("payments", memory.SubscribeOptions{})

	reg := prometheus.NewRegistry()
	metrics, err := idemqprom.New(reg, idemqprom.Options{Consumer: "billing"})
	if err != nil {
		log.Fatal(err)
	}
	rt, err := consumer.New(consumer.Config{
		Name:    "billing",
		Source:  sub,
		Store:   store,
		Handler: func(ctx context.Context, tx pgx.Tx, msg *consumer.Message) error { return nil },
		Hooks:   []consumer.Hook{metrics},
	})
	if err != nil {
		log.Fatal(err)
	}
	if err := metrics.RegisterRuntime(rt); err != nil { // in-flight gauge
		log.Fatal(err)
	}
	http.Handle("/metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
	go func() { _ = http.ListenAndServe("127.0.0.1:9464", nil) }()
	_ = rt.Run(ctx)
}
