package dlq_test

import (
	"errors"
	"fmt"
	"time"

	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/dlq"
)

// A signed envelope verifies under its key; one whose source was changed
// afterwards does not, so a replay with VerifyKeys leaves it in the queue.
func ExampleVerify() {
	key := []byte("a 32-byte secret, kept out of VCS") // in production: dlq.ReadKeyFile
	msg := &consumer.Message{ID: "pay-7", Body: []byte(`{"amount":100}`), Source: "payments", Partition: -1, Offset: -1}
	at := time.Date(2026, 11, 29, 12, 0, 0, 0, time.UTC)
	env := dlq.Envelope(msg, consumer.Failure{Consumer: "ledger", MessageID: "pay-7", Class: consumer.ClassPermanent,
		Err: errors.New("unknown account"), Attempts: 1, FirstFailure: at, LastFailure: at}, dlq.Options{SigningKey: key})
	fmt.Println("as dead-lettered:", dlq.Verify(env, key))

	env.Headers["x-idemq-source"] = "admin-commands"
	fmt.Println("source changed:", dlq.Verify(env, key))

	delete(env.Headers, "x-idemq-signature")
	fmt.Println("signature removed:", dlq.Verify(env, key))
	// Output:
	// as dead-lettered: <nil>
	// source changed: dlq: envelope not verified: signature does not match any key
	// signature removed: dlq: envelope not verified: not signed
}
