package keys_test

import (
	"fmt"

	"github.com/idemq/idemq/keys"
)

// ExampleChildKey derives the id of the event a payment handler publishes
// through the outbox. A redelivery of the same payment derives the same id,
// so consumers downstream deduplicate the second copy.
func ExampleChildKey() {
	incoming := "payment-42"
	eventID := keys.ChildKey(incoming, "payment-captured-event/v1")
	again := keys.ChildKey(incoming, "payment-captured-event/v1")
	fmt.Println(len(eventID), eventID == again)
	fmt.Println(eventID == keys.ChildKey("payment-43", "payment-captured-event/v1"))
	// Output:
	// 64 true
	// false
}

// ExampleChildKey_perItem names per-item steps after the item's own id,
// never after its position in the list.
func ExampleChildKey_perItem() {
	order := "order-7"
	for _, sku := range []string{"sku-123", "sku-9"} {
		step := "reserve-stock/" + sku + "/v1" // not "reserve-stock/0/v1"
		fmt.Println(step, keys.ValidateStep(step) == nil)
		_ = keys.ChildKey(order, step)
	}
	// Output:
	// reserve-stock/sku-123/v1 true
	// reserve-stock/sku-9/v1 true
}

// ExampleDerive validates the step name as it derives, rejecting a step
// named after a list position.
func ExampleDerive() {
	_, err := keys.Derive("order-7", "reserve-stock/0/v1")
	fmt.Println(err)
	k, err := keys.Derive("order-7", "charge-card/v1")
	fmt.Println(len(k), err)
	// Output:
	// keys: invalid step name "reserve-stock/0/v1": segment "0" is only digits, like a list position: name steps after what they do or a stable id
	// 64 <nil>
}
