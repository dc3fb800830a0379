package memory_test

import (
	"context"
	"fmt"

	"github.com/idemq/idemq/brokers/memory"
	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/dlq"
)

// Publish two messages, nack the first with requeue and ack what comes.
func Example() {
	ctx := context.Background()
	b := memory.NewBroker()

	_ = b.Publish(ctx, "orders",
		&consumer.Message{ID: "o-1", Body: []byte("first")},
		&consumer.Message{ID: "o-2", Body: []byte("second")},
	)

	sub, err := b.Subscribe("orders", memory.SubscribeOptions{Prefetch: 10})
	if err != nil {
		fmt.Println(err)
		return
	}
	defer sub.Close()

	d, _ := sub.Receive(ctx)
	fmt.Println("got", string(d.Message().Body))
	_ = d.Nack(ctx, true) // back to the head of the queue

	for range 2 {
		d, _ := sub.Receive(ctx)
		m := d.Message()
		fmt.Println("got", string(m.Body), "redelivered:", m.Redelivered)
		_ = d.Ack(ctx)
	}
	fmt.Println("ready:", b.Ready("orders"), "unacked:", b.Unacked("orders"))
	// Output:
	// got first
	// got first redelivered: true
	// got second redelivered: false
	// ready: 0 unacked: 0
}

// Dead-letter failed messages with the failure headers the runtime's
// DeadLetterer contract describes: the runtime does it with the
// Subscription's dead-letterer unless consumer.Config.DeadLetterer is set.
func ExampleSubscription_DeadLetterer() {
	ctx := context.Background()
	b := memory.NewBroker()
	sub, err := b.Subscribe("orders", memory.SubscribeOptions{})
	if err != nil {
		panic(err)
	}
	dl := sub.DeadLetterer() // to "orders.dlq"

	msg := &consumer.Message{ID: "o-1", Body: []byte("bad"), Source: "orders"}
	_ = dl.DeadLetter(ctx, msg, consumer.Failure{
		Consumer:  "billing",
		MessageID: "o-1",
		Class:     consumer.ClassPermanent,
		Err:       fmt.Errorf("unknown account"),
		Attempts:  1,
	})

	m := b.Messages("orders.dlq")[0]
	r, err := dlq.Parse(m) // the failure envelope
	if err != nil {
		fmt.Println(err)
		return
	}
	fmt.Println(string(m.Body), r.Class, r.Error, r.Source)
	// Output:
	// bad permanent unknown account orders
}
